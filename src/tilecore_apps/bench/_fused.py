"""The training step `tilecore bench step` times: tilecore's fused ops, and the dense model.

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


def bench_features(
    features: Sequence[tc.FeatureSpec], optimizer: tc.OptimizerSpec, *, max_vocab: int | None
) -> list[tc.FeatureSpec]:
    """The workload's features with `optimizer` and `uniform_init` on every table.

    `max_vocab` caps every vocabulary (tiny test runs; IDs are then taken modulo it).
    """
    tables: dict[str, tc.TableSpec] = {}
    out = []
    for feature in features:
        name = feature.table.name
        if name not in tables:
            vocab = feature.table.vocab_size
            tables[name] = dataclasses.replace(
                feature.table, optimizer=optimizer, initializer=uniform_init,
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
