"""The training step `bench step` and `bench scale` time: tilecore's fused ops, the dense model.

The same tiny dense "model" sits on top of both the fused and the naive step: a
fixed random projection of every feature's activations, and half the mean
squared norm of the sum. Its gradient reaches every activation, so the backward
pass touches every looked-up row.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import tilecore as tc
from tilecore import ops

from ._timing import median_seconds

OPTIMIZERS: dict[str, Callable[[], tc.OptimizerSpec]] = {
    "sgd": tc.SGD,
    "adagrad": tc.Adagrad,
    "adagrad_momentum": tc.AdagradMomentum,
    "adam": tc.Adam,
    "ftrl": tc.FTRL,
    "laprop": tc.LaProp,
}
"""`--optimizer` choices: each builds the spec with tilecore's (the reference's) defaults."""

PROJECTION_WIDTH = 8
INIT_SCALE = 0.05


def uniform_init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    """U(−0.05, 0.05): a cheap initializer (the default truncated normal is slow on CPU)."""
    return jax.random.uniform(key, tuple(shape), dtype, -INIT_SCALE, INIT_SCALE)


def lean_init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    """Values spread over (−0.05, 0.05) by hashing each element's index (the key unused).

    Initialising holds nothing but the table: `uniform_init`'s threefry bits hold about
    three tables' worth of temporaries at their peak, which a run sized to the memory
    cannot afford. `shape` is 2-D: `(rows, dim)`.
    """
    del key
    rows, cols = (jax.lax.broadcasted_iota(jnp.uint32, tuple(shape), d) for d in (0, 1))
    bits = ((rows * jnp.uint32(shape[1]) + cols) * jnp.uint32(2654435761)) >> 8  # 24 bits
    return ((bits.astype(jnp.float32) / 2**24 - 0.5) * (2 * INIT_SCALE)).astype(dtype)


def bench_features(
    features: Sequence[tc.FeatureSpec], optimizer: tc.OptimizerSpec, *, max_vocab: int | None,
    initializer: Callable[..., jax.Array] = uniform_init, weights_dtype: Any = "float32",
) -> list[tc.FeatureSpec]:
    """The workload's features with `optimizer`, `initializer` and `weights_dtype` on
    every table.

    `max_vocab` caps every vocabulary (tiny test runs; IDs are then taken modulo it).
    """
    tables: dict[str, tc.TableSpec] = {}
    out = []
    for feature in features:
        name = feature.table.name
        if name not in tables:
            vocab = feature.table.vocab_size
            tables[name] = dataclasses.replace(
                feature.table, optimizer=optimizer, initializer=initializer,
                weights_dtype=weights_dtype,
                vocab_size=vocab if max_vocab is None else min(vocab, max_vocab),
            )
        out.append(dataclasses.replace(feature, table=tables[name]))
    return out


def projections(features: Sequence[tc.FeatureSpec], seed: int = 0) -> dict[str, np.ndarray]:
    """Feature name → a fixed random `[dim, 8]` float32 projection."""
    rng = np.random.default_rng(seed)
    return {
        f.name: (rng.standard_normal((f.table.embedding_dim, PROJECTION_WIDTH))
                 / np.sqrt(f.table.embedding_dim)).astype(np.float32)
        for f in features
    }


def dense_loss(activations: Mapping[str, jax.Array], weights: Mapping[str, Any]) -> jax.Array:
    """`0.5 · mean_b ‖Σ_f act_f[b] · W_f‖²`: the dense model on top of the embeddings."""
    z = functools.reduce(operator.add, (activations[name] @ w for name, w in weights.items()))
    return 0.5 * jnp.mean(jnp.sum(z * z, axis=-1))


def fused_forward(plan: tc.StackingPlan, mesh: Mesh | None) -> Callable[..., Any]:
    """`jit(lookup)`: `(variables, batch) -> activations`."""
    return jax.jit(lambda variables, batch: ops.lookup(plan, batch, variables, mesh=mesh))


def fused_step(plan: tc.StackingPlan, mesh: Mesh | None,
               weights: Mapping[str, np.ndarray]) -> Callable[..., Any]:
    """`jit(step, donate variables)`: `(variables, batch, step) -> variables`.

    Forward with `lookup`, activation gradients of `dense_loss` by `jax.grad`,
    then `lookup_grad` (gradient and optimizer fused, touched rows only).
    """
    consts = {name: jnp.asarray(w) for name, w in weights.items()}

    def step(variables: Any, batch: tc.PreprocessedBatch, step: jax.Array) -> Any:
        activations = ops.lookup(plan, batch, variables, mesh=mesh)
        grads = jax.grad(dense_loss)(activations, consts)
        return ops.lookup_grad(plan, batch, variables, grads, step, mesh=mesh)

    return jax.jit(step, donate_argnums=0)


def put_batches(prepped: Sequence[tc.PreprocessedBatch], mesh: Mesh | None) -> list[Any]:
    """The batches on the devices (the input pipeline, not timed): buffers split over the
    mesh's axis, the minibatch count replicated; on one device (no mesh) all on it."""
    if mesh is None:
        return [jax.device_put(b) for b in prepped]
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*mesh.axis_names))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [jax.device_put(b, jax.tree.map(lambda x: split if np.ndim(x) else replicated, b))
            for b in prepped]


class Steps:
    """`steps(i)`: one `fused_step` on `batches[i % n]` from the previous step's variables,
    the first from `variables`, which it donates (the caller's arrays are gone after the
    first call); `steps.variables`: the newest, the only ones kept."""

    def __init__(self, plan: tc.StackingPlan, batches: Sequence[Any], mesh: Mesh | None,
                 weights: Mapping[str, np.ndarray], variables: Any):
        self._train = fused_step(plan, mesh, weights)
        self._batches = batches
        self.variables = variables

    def __call__(self, i: int) -> Any:
        self.variables = self._train(self.variables, self._batches[i % len(self._batches)],
                                     jnp.int32(i))
        return self.variables


def time_step(plan: tc.StackingPlan, batches: Sequence[Any], mesh: Mesh | None,
              weights: Mapping[str, np.ndarray], variables: Any, timing: Mapping[str, int]
              ) -> float:
    """Median seconds of `fused_step` over `batches` (cycled) from `variables`, which it
    donates (`Steps`); the last step's are dropped on return. `timing`: `median_seconds`'s
    `warmup` and `repeats`."""
    return median_seconds(Steps(plan, batches, mesh, weights, variables), **timing)
