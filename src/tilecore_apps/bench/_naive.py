"""The same training step written the naive way, for comparison with the fused ops.

Per-table dense `[vocab, dim]` arrays; each feature's rows gathered with
`jnp.take` and pooled per sample with `segment_sum` over its ragged IDs (padded
to a fixed length per feature so that one compilation serves every batch);
`jax.grad` over the whole tables (a dense gradient as large as the tables); and
an optax update over every row. Adagrad and SGD with dense zero gradients leave
untouched rows as they are, so those two compute what the fused step computes;
Adam (optax.adam) also decays the moments of untouched rows. Optimizers optax
lacks apply tilecore's own row rule to whole tables (`dense_rule`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import tilecore as tc
from tilecore.optimizers import init_slots, update_rule

from ._fused import dense_loss, uniform_init
from ._timing import median_seconds

NaiveInputs = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
"""Feature name → (ids, samples, gains), each padded to the feature's fixed length."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _gains(feature: tc.FeatureSpec, ragged: tc.Ragged) -> np.ndarray:
    lengths = np.diff(ragged.row_splits).astype(np.float32)
    per_row = {"sum": np.ones_like(lengths), "mean": 1 / np.maximum(lengths, 1),
               "sqrtn": 1 / np.sqrt(np.maximum(lengths, 1))}[feature.table.combiner]
    gains = np.repeat(per_row, np.diff(ragged.row_splits))
    if ragged.weights is not None:
        if feature.table.combiner != "sum":
            raise ValueError(f"naive step: weighted {feature.table.combiner!r} is not supported.")
        gains = gains * ragged.weights
    return gains.astype(np.float32)


def naive_inputs(
    features: Sequence[tc.FeatureSpec], batches: Sequence[Mapping[str, tc.Ragged]]
) -> list[NaiveInputs]:
    """Each batch's IDs with the sample and gain of every ID, padded to a length per feature.

    The length is the feature's largest ID count over `batches`, rounded up to
    256; padding entries point at sample `batch_size`, which `segment_sum` drops.
    """
    out: list[NaiveInputs] = [{} for _ in batches]
    for feature in features:
        rows = [b[feature.name] for b in batches]
        length = _round_up(max(len(r.values) for r in rows), 256)
        for i, ragged in enumerate(rows):
            count, num_rows = len(ragged.values), ragged.num_rows
            ids = np.zeros(length, np.int32)
            ids[:count] = ragged.values
            samples = np.full(length, num_rows, np.int32)
            samples[:count] = np.repeat(np.arange(num_rows, dtype=np.int32),
                                        np.diff(ragged.row_splits))
            gains = np.zeros(length, np.float32)
            gains[:count] = _gains(feature, ragged)
            out[i][feature.name] = (ids, samples, gains)
    return out


def naive_lookup(tables: Mapping[str, jax.Array], inputs: Mapping[str, Any],
                 features: Sequence[tc.FeatureSpec]) -> dict[str, jax.Array]:
    """`act[b] = Σ gain · table[id]`: `jnp.take` then `segment_sum` per feature."""
    out = {}
    for feature in features:
        ids, samples, gains = inputs[feature.name]
        rows = jnp.take(tables[feature.table.name], ids, axis=0) * gains[:, None]
        out[feature.name] = jax.ops.segment_sum(rows, samples, num_segments=feature.batch_size)
    return out


class DenseRuleState(NamedTuple):
    step: jax.Array
    slots: dict[str, tuple[jax.Array, ...]]


def dense_rule(spec: tc.OptimizerSpec) -> optax.GradientTransformation:
    """tilecore's row rule for `spec` applied to every row of every table, as optax would."""
    rule = update_rule(spec)

    def init(params: Mapping[str, jax.Array]) -> DenseRuleState:
        return DenseRuleState(jnp.zeros([], jnp.int32),
                              {k: init_slots(spec, p.shape) for k, p in params.items()})

    def update(grads: Any, state: DenseRuleState, params: Any = None) -> Any:
        hyper = spec.hyperparameters(state.step)
        updates, slots = {}, {}
        for name, grad in grads.items():
            new_row, *new_slots = rule(grad, params[name], *state.slots[name], *hyper)
            updates[name] = new_row - params[name]
            slots[name] = tuple(new_slots)
        return updates, DenseRuleState(state.step + 1, slots)

    return optax.GradientTransformation(init, update)  # pyright: ignore[reportArgumentType]


def naive_optimizer(spec: tc.OptimizerSpec) -> tuple[optax.GradientTransformation, str]:
    """The optax transformation matching `spec` and a label for reports."""
    lr = spec.learning_rate
    if callable(lr):
        raise ValueError("naive step: learning-rate schedules are not supported; use a float.")
    if type(spec) is tc.SGD:
        return optax.sgd(lr), "optax.sgd"
    if isinstance(spec, tc.Adagrad):
        return optax.adagrad(lr, initial_accumulator_value=spec.initial_accumulator_value,
                             eps=0.0), "optax.adagrad (eps=0)"
    if isinstance(spec, tc.Adam):
        return optax.adam(lr, b1=spec.beta_1, b2=spec.beta_2, eps=spec.epsilon), "optax.adam"
    return dense_rule(spec), f"dense tilecore {spec.short_name} rule (optax has none)"


def naive_forward(features: Sequence[tc.FeatureSpec]) -> Callable[..., Any]:
    """`jit`: `(tables, inputs) -> activations`."""
    return jax.jit(lambda tables, inputs: naive_lookup(tables, inputs, features))


def naive_step(features: Sequence[tc.FeatureSpec], weights: Mapping[str, np.ndarray],
               optimizer: optax.GradientTransformation, out_shardings: Any = None
               ) -> Callable[..., Any]:
    """`jit(step, donate state)`: `((tables, opt_state), inputs) -> (tables, opt_state)`.

    Over a mesh, pass the state's shardings as `out_shardings` so that every call
    gets its state laid out alike (and one compilation serves them all).
    """
    consts = {name: jnp.asarray(w) for name, w in weights.items()}

    def loss(tables: Any, inputs: Any) -> jax.Array:
        return dense_loss(naive_lookup(tables, inputs, features), consts)

    def step(state: Any, inputs: Any) -> Any:
        tables, opt_state = state
        grads = jax.grad(loss)(tables, inputs)
        updates, opt_state = optimizer.update(grads, opt_state, tables)
        return optax.apply_updates(tables, updates), opt_state

    return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)


def init_dense_tables(features: Sequence[tc.FeatureSpec], seed: int, mesh: Mesh | None
                      ) -> dict[str, jax.Array]:
    """Per-table `[vocab, dim]` arrays from `uniform_init`, split by rows over the mesh
    where the vocabulary divides evenly (replicated otherwise)."""
    tables = {f.table.name: f.table for f in features}
    keys = jax.random.split(jax.random.key(seed), len(tables))
    out = {}
    for key, (name, table) in zip(keys, tables.items(), strict=True):
        shape = (table.vocab_size, table.embedding_dim)
        sharding = None
        if mesh is not None:
            split = table.vocab_size % mesh.size == 0
            sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0] if split else None))
        out[name] = jax.jit(lambda k, shape=shape: uniform_init(k, shape),
                            out_shardings=sharding)(key)
    return out


def time_naive(
    features: Sequence[tc.FeatureSpec],
    batches: Sequence[Mapping[str, tc.Ragged]],
    weights: Mapping[str, np.ndarray],
    spec: tc.OptimizerSpec,
    mesh: Mesh | None,
    seed: int,
    timing: Mapping[str, int],
) -> dict[str, Any]:
    """Median seconds of the naive forward and training step over `batches` (cycled)."""
    optimizer, label = naive_optimizer(spec)
    if mesh is not None:  # Auto axes: XLA partitions the naive step as it likes
        mesh = Mesh(mesh.devices, mesh.axis_names)
    replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    inputs = [jax.device_put(x, replicated) for x in naive_inputs(features, batches)]
    n = len(inputs)
    tables = init_dense_tables(features, seed, mesh)
    state = [(tables, jax.jit(optimizer.init)(tables))]
    del tables
    forward = naive_forward(features)
    forward_s = median_seconds(lambda i: forward(state[0][0], inputs[i % n]), **timing)
    shardings = None
    if mesh is not None:  # the tables' shardings; the rest (optax's count) replicated
        shardings = jax.tree.map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
                                 else NamedSharding(mesh, PartitionSpec()), state[0])
        state[0] = jax.device_put(state[0], shardings)
    step = naive_step(features, weights, optimizer, shardings)

    def call(i: int) -> Any:  # the state is donated: keep only the new one
        state[0] = step(state[0], inputs[i % n])
        return state[0]

    step_s = median_seconds(call, **timing)
    return {"update": label, "forward_s": forward_s, "step_s": step_s}
