"""Hand-picked random problems for the device-op tests, shared by the single- and
multi-device test files (the latter rebuilds them in a subprocess, so everything
here is deterministic in the case's seed and the step).

A case fixes the tables, the features and how they stack; its batches (ragged,
with empty samples, duplicate IDs in a sample, Zipf-skewed IDs so rows are shared
between samples, weights on some features) and table values are drawn from numpy
generators seeded by (seed, step).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

import tilecore as tc

Stacking = str | tuple[tuple[str, ...], ...]
"""`"none"` (feature stacking only), `"auto"`, or explicit groups of table names."""


def _custom_rule(grad: Any, row: Any, velocity: Any, learning_rate: Any, decay: Any
                 ) -> tuple[Any, Any]:
    """A user rule that runs on numpy and jnp alike: a damped, normalised momentum."""
    velocity = decay * velocity + grad
    return row - learning_rate * velocity / (1.0 + abs(velocity)), velocity


def _schedule(step: Any) -> Any:
    return 0.2 / (1.0 + step)


OPTIMIZERS: dict[str, tc.OptimizerSpec] = {
    "sgd": tc.SGD(learning_rate=0.1),
    "sgd-schedule": tc.SGD(learning_rate=_schedule),
    "adagrad": tc.Adagrad(learning_rate=0.1, initial_accumulator_value=0.2),
    "adagrad_momentum": tc.AdagradMomentum(learning_rate=0.05, beta2=0.9, exponent=3.0,
                                           initial_momentum_value=0.1),
    "adagrad_momentum-nesterov": tc.AdagradMomentum(learning_rate=0.05, use_nesterov=True),
    "adam": tc.Adam(learning_rate=0.01),
    "ftrl": tc.FTRL(learning_rate=0.1),
    "ftrl-l1-l2-mlr": tc.FTRL(learning_rate=0.2, learning_rate_power=-0.6,
                              l1_regularization_strength=0.05, l2_regularization_strength=0.1,
                              beta=0.1, initial_linear_value=0.1,
                              multiply_linear_by_learning_rate=True),
    "laprop": tc.LaProp(learning_rate=0.01, initial_slot_value=0.05),
    "f2a": tc.F2A(learning_rate=0.05, rho=0.5, l1_regularization_strength=0.01,
                  l2_regularization_strength=0.01, initial_local_step_value=1.0),
    "custom": tc.CustomOptimizer(update_fn=_custom_rule, learning_rate=0.1,
                                 slot_initial_value_tuple=(0.25,), extra_hyperparameters=(0.5,)),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """Tables, features `(name, table, global batch)` and stacking of one problem."""

    name: str
    tables: tuple[tc.TableSpec, ...]
    features: tuple[tuple[str, str, int], ...]
    stacking: Stacking = "auto"
    sc_per_device: int = 2
    weighted: tuple[str, ...] = ()
    max_len: int = 6
    allow_id_dropping: bool = False
    rotation: int | None = None
    seed: int = 0

    def with_optimizer(self, name: str, optimizer: tc.OptimizerSpec) -> Case:
        """The same problem with every table trained by `optimizer`."""
        tables = tuple(dataclasses.replace(t, optimizer=optimizer) for t in self.tables)
        return dataclasses.replace(self, name=f"{self.name}-{name}", tables=tables)

    def feature_specs(self) -> list[tc.FeatureSpec]:
        tables = {t.name: t for t in self.tables}
        return [tc.FeatureSpec(name=f, table=tables[t], input_shape=(batch, self.max_len))
                for f, t, batch in self.features]

    def plan(self, devices: int = 1) -> tc.StackingPlan:
        topology = tc.Topology(global_devices=devices, sc_per_device=self.sc_per_device)
        config = tc.SparseCoreConfig(allow_id_dropping=self.allow_id_dropping,
                                     disable_table_stacking=self.stacking == "none")
        features = self.feature_specs()
        if isinstance(self.stacking, tuple):
            return tc.stack_tables(features, topology, self.stacking, rotation=self.rotation,
                                   config=config)
        return tc.plan_stacking(features, topology, config)

    def table_values(self) -> dict[str, np.ndarray]:
        """Per-table `[vocab, dim]` float32 values: random normal, never only 0 or 1."""
        rng = np.random.default_rng([self.seed, 999])
        return {t.name: rng.normal(0.0, 1.0, (t.vocab_size, t.embedding_dim)).astype(np.float32)
                for t in self.tables}

    def batch(self, step: int) -> tuple[dict[str, tc.Ragged], dict[str, np.ndarray]]:
        """The global batch of `step`: ragged IDs per feature, weights of weighted ones."""
        rng = np.random.default_rng([self.seed, step])
        tables = {t.name: t for t in self.tables}
        inputs, weights = {}, {}
        for feature, table_name, batch in self.features:
            table = tables[table_name]
            rows = []
            for _ in range(batch):
                length = 0 if rng.random() < 0.2 else int(rng.integers(1, self.max_len + 1))
                zipf = (rng.zipf(1.3, length) - 1) % table.vocab_size
                ids = np.where(rng.random(length) < 0.5, zipf,
                               rng.integers(0, table.vocab_size, length))
                for i in range(1, length):  # duplicates inside the sample
                    if rng.random() < 0.25:
                        ids[i] = ids[rng.integers(0, i)]
                rows.append(ids.tolist())
            inputs[feature] = tc.Ragged.from_rows(rows)
            if feature in self.weighted:
                count = len(inputs[feature].values)
                low = -2.0 if table.combiner == "sum" else 0.2  # Σw stays away from 0
                weights[feature] = rng.uniform(low, 2.0, count).astype(np.float32)
        return inputs, weights

    def activation_grads(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step, 7])
        tables = {t.name: t for t in self.tables}
        return {f: rng.normal(0.0, 1.0, (batch, tables[t].embedding_dim)).astype(np.float32)
                for f, t, batch in self.features}


def table(name: str, vocab: int, dim: int, combiner: str = "sum", *, limits: int | None = None,
          optimizer: tc.OptimizerSpec | None = None) -> tc.TableSpec:
    """A TableSpec; `limits` sets small per-partition limits (max_unique = limits − 1)."""
    extra: dict[str, Any] = {}
    if limits is not None:
        extra = {"max_ids_per_partition": limits, "max_unique_ids_per_partition": limits - 1}
    return tc.TableSpec(name=name, vocab_size=vocab, embedding_dim=dim, combiner=combiner,  # type: ignore[arg-type]
                        optimizer=optimizer or tc.Adagrad(learning_rate=0.1), **extra)


CASES: dict[str, Case] = {case.name: case for case in [
    # One table, one feature, unit weights.
    Case("one-table-sum", (table("a", 37, 5),), (("f", "a", 32),), seed=1),
    # Feature stacking: three features share a mean-combined table; weights on two.
    Case("feature-stacking-mean",
         (table("a", 53, 11, "mean"),),
         (("f0", "a", 32), ("f1", "a", 64), ("f2", "a", 32)),
         weighted=("f0", "f2"), seed=2),
    # Table stacking: three sqrtn tables of one padded dim (3, 5, 8 → 8) stack; one
    # of them is also feature-stacked.
    Case("table-stacking-sqrtn",
         (table("a", 29, 3, "sqrtn"), table("b", 70, 5, "sqrtn"), table("c", 16, 8, "sqrtn")),
         (("fa", "a", 32), ("fb0", "b", 32), ("fb1", "b", 32), ("fc", "c", 64)),
         weighted=("fb1",), seed=3),
    # Every combiner and optimizer at once, tables kept apart (no table stacking).
    Case("mixed-no-stacking",
         (table("a", 41, 13, "sum", optimizer=tc.SGD(learning_rate=0.3)),
          table("b", 23, 20, "mean", optimizer=tc.Adam(learning_rate=0.02)),
          table("c", 64, 1, "sqrtn", optimizer=tc.FTRL())),
         (("fa", "a", 32), ("fb", "b", 32), ("fc0", "c", 32), ("fc1", "c", 32)),
         stacking="none", weighted=("fa", "fb", "fc1"), seed=4),
    # Explicit groups with shard rotation 1, small limits, IDs dropped; S = 4.
    Case("groups-dropping",
         (table("a", 90, 6, limits=3), table("b", 50, 6, limits=4),
          table("c", 33, 9, limits=2), table("d", 19, 2, "mean", limits=3)),
         (("fa", "a", 32), ("fb", "b", 32), ("fc0", "c", 32), ("fc1", "c", 32),
          ("fd", "d", 32)),
         stacking=(("b", "a"), ("c",)), rotation=1, sc_per_device=4, weighted=("fa", "fd"),
         allow_id_dropping=True, seed=5),
    # Limits never hit, but a small suggested COO buffer overflows: the tail is dropped.
    Case("coo-overflow",
         (tc.TableSpec(name="a", vocab_size=50, embedding_dim=6, optimizer=tc.Adagrad(),
                       suggested_coo_buffer_size_per_device=32),),
         (("f", "a", 32),), max_len=8, allow_id_dropping=True, seed=7),
]}

RICH = Case(
    "rich",
    (table("a", 61, 5, "mean", limits=5), table("b", 35, 7, "mean", limits=4)),
    (("fa0", "a", 32), ("fa1", "a", 32), ("fb", "b", 32)),
    weighted=("fa1", "fb"), allow_id_dropping=True, seed=6,
)
"""The one-stack structure every optimizer is tested on: feature stacking (fa0, fa1),
table stacking (a with b: dims 5 and 7 pad to 8), weighted and unit-weight features,
IDs dropped (small limits)."""


def preprocess(plan: tc.StackingPlan, inputs: Mapping[str, Any], weights: Mapping[str, Any]
               ) -> tuple[tc.PreprocessedBatch, tc.PreprocessStats]:
    """`tc.preprocess` with the expected IdDroppingWarning silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tc.IdDroppingWarning)
        return tc.preprocess(plan, inputs, weights)


def initial_slots(plan: tc.StackingPlan) -> dict[str, tuple[np.ndarray, ...]]:
    """Per-table slot arrays at their optimizer's initial values."""
    return {
        name: tuple(np.full((t.vocab_size, t.embedding_dim), value, np.float32)
                    for value in t.optimizer.slot_initial_values())
        for name, t in plan.tables.items()
    }


def shard_slots(plan: tc.StackingPlan, slots: Mapping[str, tuple[np.ndarray, ...]]
                ) -> dict[str, tuple[np.ndarray, ...]]:
    """Per-table slots → per-stack slot tuples (padding filled with the initial value)."""
    from tilecore.ops import shard

    def slot(table: str, k: int) -> np.ndarray:
        if k < len(slots[table]):
            return slots[table][k]
        spec = plan.tables[table]  # a table of another stack: any array of the right shape
        return np.zeros((spec.vocab_size, spec.embedding_dim), np.float32)

    out = {}
    for stack_name, stack in plan.stacks.items():
        initial = stack.optimizer.slot_initial_values()
        out[stack_name] = tuple(
            shard(plan, {t: slot(t, k) for t in plan.tables}, fill=value)[stack_name]
            for k, value in enumerate(initial)
        )
    return out


def assert_close(actual: Any, expected: Any, err_msg: str = "", *, rtol: float = 1e-5,
                 atol: float = 1e-6) -> None:
    """Equal to float32 precision: `rtol`, plus an `atol` at the array's own scale."""
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol,
                               atol=atol * scale, err_msg=err_msg)


# --- running the ops and the oracle over several steps --------------------------------------


@dataclasses.dataclass
class Run:
    """What `run_steps` saw, as numpy arrays, per step.

    `activations[t]`: feature → `[batch, dim]`; `before[t]` / `after[t]`: stack →
    `[table, *slots]` stacked arrays around step t's `lookup_grad`; `dropped[t]`: IDs
    preprocessing dropped; `traces`: how often each jitted function was traced.
    """

    activations: list[dict[str, np.ndarray]]
    before: list[dict[str, list[np.ndarray]]]
    after: list[dict[str, list[np.ndarray]]]
    dropped: list[int]
    traces: dict[str, int]

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat name → array (for `np.savez`); `from_arrays` is the inverse."""
        out = {f"traces/{k}": np.asarray(v) for k, v in self.traces.items()}
        for t in range(len(self.activations)):
            out[f"{t}/dropped"] = np.asarray(self.dropped[t])
            out.update({f"{t}/act/{f}": a for f, a in self.activations[t].items()})
            for kind, states in (("before", self.before[t]), ("after", self.after[t])):
                for stack, arrays in states.items():
                    out.update({f"{t}/{kind}/{stack}/{k}": a for k, a in enumerate(arrays)})
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Run:
        steps = 1 + max(int(k.split("/")[0]) for k in arrays if not k.startswith("traces/"))
        run = cls([{} for _ in range(steps)], [{} for _ in range(steps)],
                  [{} for _ in range(steps)], [0] * steps, {})
        for key in sorted(arrays, key=lambda k: (len(k), k)):
            parts, value = key.split("/"), np.asarray(arrays[key])
            if parts[0] == "traces":
                run.traces[parts[1]] = int(value)
                continue
            t = int(parts[0])
            if parts[1] == "dropped":
                run.dropped[t] = int(value)
            elif parts[1] == "act":
                run.activations[t][parts[2]] = value
            else:
                states = run.before[t] if parts[1] == "before" else run.after[t]
                arrays_of_stack = states.setdefault(parts[2], [])
                assert int(parts[3]) == len(arrays_of_stack)
                arrays_of_stack.append(value)
        return run


def run_steps(case: Case, devices: int = 1, steps: int = 3, *, mesh: Any = None,
              clip: Mapping[str, tuple[float, float]] | None = None) -> Run:
    """`lookup` then `lookup_grad` (both jitted, variables donated) on `steps` batches."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from tilecore import ops

    plan = case.plan(devices)
    tables = ops.shard(plan, case.table_values())
    slots = shard_slots(plan, initial_slots(plan))
    place: Any = (jnp.asarray if mesh is None else
                  lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec("sparsecore"))))
    variables = {name: ops.EmbeddingVariables(place(tables[name]), tuple(map(place, slots[name])))
                 for name in plan.stacks}
    traces = {"lookup": 0, "lookup_grad": 0}

    def forward(batch: tc.PreprocessedBatch, variables: Any) -> Any:
        traces["lookup"] += 1
        return ops.lookup(plan, batch, variables, mesh=mesh)

    def backward(batch: tc.PreprocessedBatch, variables: Any, grads: Any, step: Any) -> Any:
        traces["lookup_grad"] += 1
        return ops.lookup_grad(plan, batch, variables, grads, step, mesh=mesh,
                               options=ops.UpdateOptions(clip=clip or {}))

    forward_jit = jax.jit(forward)
    backward_jit = jax.jit(backward, donate_argnums=1)
    run = Run([], [], [], [], traces)

    def state(variables: Any) -> dict[str, list[np.ndarray]]:
        return {name: [np.array(v.table), *(np.array(s) for s in v.slots)]
                for name, v in variables.items()}

    for step in range(steps):
        batch, stats = preprocess(plan, *case.batch(step))
        run.dropped.append(stats.dropped_ids)
        run.activations.append({f: np.asarray(a) for f, a in
                                forward_jit(batch, variables).items()})
        run.before.append(state(variables))
        variables = backward_jit(batch, variables, case.activation_grads(step), jnp.int32(step))
        run.after.append(state(variables))
    return run


@dataclasses.dataclass
class OracleStep:
    activations: dict[str, np.ndarray]
    touched: dict[str, list[int]]
    tables: dict[str, np.ndarray]
    slots: dict[str, tuple[np.ndarray, ...]]


def oracle_steps(case: Case, devices: int = 1, steps: int = 3, *,
                 clip: Mapping[str, tuple[float, float]] | None = None) -> list[OracleStep]:
    """The numpy oracle's trajectory over the same batches (its own state, float32)."""
    from tilecore.testing import (
        reference_lookup,
        reference_lookup_grad,
        reference_row_gradients,
    )

    plan = case.plan(devices)
    tables, slots = case.table_values(), initial_slots(plan)
    out = []
    for step in range(steps):
        inputs, weights = case.batch(step)
        grads = case.activation_grads(step)
        activations = reference_lookup(plan, inputs, weights, tables)
        touched = {t: list(rows) for t, rows in
                   reference_row_gradients(plan, inputs, weights, grads).items()}
        tables, slots = reference_lookup_grad(plan, inputs, weights, tables, slots, grads, step,
                                              clip=clip)
        out.append(OracleStep(activations, touched, tables, slots))
    return out


def unshard_state(plan: tc.StackingPlan, state: Mapping[str, list[np.ndarray]]
                  ) -> dict[str, list[np.ndarray]]:
    """Stack → `[table, *slots]` stacked arrays ⇒ table → `[table, *slots]` `[vocab, dim]`."""
    from tilecore import ops

    out: dict[str, list[np.ndarray]] = {name: [] for name in plan.tables}
    for k in range(max(len(arrays) for arrays in state.values())):
        # unshard wants every stack; a stack with fewer slots lends its table instead.
        per_table = ops.unshard(plan, {s: a[k] if k < len(a) else a[0] for s, a in state.items()})
        for name, spec in plan.tables.items():
            if k <= len(spec.optimizer.slot_names):
                out[name].append(per_table[name])
    return out


def check_against_oracle(case: Case, run: Run, oracle: list[OracleStep], devices: int = 1
                         ) -> None:
    """Activations, tables and slots equal the oracle's; untouched rows are bit-unchanged."""
    from tilecore import ops

    plan = case.plan(devices)
    for t, (got, want) in enumerate(zip(run.activations, oracle, strict=True)):
        assert got.keys() == want.activations.keys()
        for f, expected in want.activations.items():
            assert got[f].shape == expected.shape and got[f].dtype == np.float32, f
            assert_close(got[f], expected, f"{case.name}: activations of {f} at step {t}")
        state = unshard_state(plan, run.after[t])
        for name, expected in want.tables.items():
            assert_close(state[name][0], expected, f"{case.name}: table {name} after step {t}")
            slot_names = plan.tables[name].optimizer.slot_names
            assert len(state[name]) == 1 + len(slot_names)
            for slot_name, got_slot, want_slot in zip(slot_names, state[name][1:],
                                                      want.slots[name], strict=True):
                assert_close(got_slot, want_slot,
                             f"{case.name}: slot {slot_name} of {name} after step {t}")
        # Untouched rows: every stacked row no touched ID maps to, padding rows included.
        touched = ops.shard(plan, {
            name: np.isin(np.arange(spec.vocab_size), want.touched[name])[:, None]
            * np.ones((1, spec.embedding_dim), np.float32)
            for name, spec in plan.tables.items()})
        for stack, mask in touched.items():
            untouched = ~mask.any(axis=1)
            assert not untouched.all(), f"{case.name}: step {t} touched no row of {stack}"
            for k, (old, new) in enumerate(zip(run.before[t][stack], run.after[t][stack],
                                               strict=True)):
                assert old.shape == new.shape and new.dtype == np.float32
                np.testing.assert_array_equal(
                    new[untouched].view(np.uint32), old[untouched].view(np.uint32),
                    err_msg=f"{case.name}: untouched rows of {stack}[{k}] changed at step {t}")
