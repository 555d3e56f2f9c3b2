"""Device ops on one device against the numpy oracle (`tilecore.testing`).

The jitted parts run on a table of hand-picked random cases (`_ops_cases.py`):
every combiner, weights and unit weights, duplicates, empty samples, feature and
table stacking, IDs dropped by small limits, every optimizer, three steps each.
Hypothesis drives the numpy-only properties (the oracle against the packed
buffers, shard/unshard).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tilecore as tc
from _ops_cases import (
    CASES,
    OPTIMIZERS,
    RICH,
    Case,
    assert_close,
    check_against_oracle,
    initial_slots,
    oracle_steps,
    preprocess,
    run_steps,
    shard_slots,
    table,
    unshard_state,
)
from tilecore import ops
from tilecore.ops._backend import wing
from tilecore.testing import (
    PreprocessCase,
    preprocess_cases,
    preprocess_reference,
    reference_lookup,
    reference_lookup_grad,
    reference_row_gradients,
    unpack,
)

# --- the oracle itself, on hand-computed examples ------------------------------------------


def _single(table_spec: tc.TableSpec, rows: list[list[int]], sc_per_device: int = 1,
            **config: Any) -> tc.StackingPlan:
    feature = tc.FeatureSpec(name="f", table=table_spec, input_shape=(len(rows), 4))
    return tc.plan_stacking([feature], tc.Topology(sc_per_device=sc_per_device),
                            tc.SparseCoreConfig(**config))


@pytest.mark.parametrize(("combiner", "weights", "gains"), [
    ("sum", None, (2.0, 1.0)),
    ("mean", None, (2 / 3, 1 / 3)),
    ("sqrtn", None, (2 / math.sqrt(3), 1 / math.sqrt(3))),
    ("sum", [1.0, 2.0, 3.0], (3.0, 3.0)),
    ("mean", [1.0, 2.0, 3.0], (0.5, 0.5)),  # REFERENCE.md §2, verified on the reference
    ("sqrtn", [1.0, 2.0, 3.0], (3 / math.sqrt(14), 3 / math.sqrt(14))),
])
def test_oracle_combiner_gains_by_hand(combiner: str, weights: list[float] | None,
                                       gains: tuple[float, float]) -> None:
    """Sample 0 = [0, 0, 2] (a duplicate); sample 1 is empty and pools to zero."""
    spec = table("t", 8, 3, combiner)
    plan = _single(spec, [[0, 0, 2], []])
    inputs = {"f": tc.Ragged.from_rows([[0, 0, 2], []])}
    w = None if weights is None else {"f": np.asarray(weights, np.float32)}
    values = np.arange(24, dtype=np.float32).reshape(8, 3) - 5.0
    act = reference_lookup(plan, inputs, w, {"t": values})["f"]
    np.testing.assert_allclose(act[0], gains[0] * values[0] + gains[1] * values[2])
    np.testing.assert_array_equal(act[1], 0.0)
    grad = np.array([[1.0, -2.0, 0.5], [9.0, 9.0, 9.0]], np.float32)
    rows = reference_row_gradients(plan, inputs, w, {"f": grad})["t"]
    assert list(rows) == [0, 2]
    np.testing.assert_allclose(rows[0], gains[0] * grad[0])
    np.testing.assert_allclose(rows[2], gains[1] * grad[0])


def test_oracle_drops_like_the_reference_example() -> None:
    """REFERENCE.md §2: max_ids=3, max_unique=2, rows {6,2,4} and {2,0,4,4} in one
    partition keep (0, r1), (2, r0), (2, r1) and drop 4 occurrences. Dropped IDs still
    count in the mean's denominator."""
    spec = tc.TableSpec(name="t", vocab_size=8, embedding_dim=2, combiner="mean",
                        max_ids_per_partition=3, max_unique_ids_per_partition=2)
    rows = [[6, 2, 4], [2, 0, 4, 4]]
    plan = _single(spec, rows, allow_id_dropping=True)
    inputs = {"f": tc.Ragged.from_rows(rows)}
    assert preprocess_reference(plan, inputs).stacks["t"].limit_drops == 4
    values = np.random.default_rng(0).normal(size=(8, 2)).astype(np.float32)
    act = reference_lookup(plan, inputs, None, {"t": values})["f"]
    np.testing.assert_allclose(act[0], values[2] / 3)
    np.testing.assert_allclose(act[1], (values[0] + values[2]) / 4)
    grads = reference_row_gradients(plan, inputs, None, {"f": np.ones((2, 2), np.float32)})
    assert list(grads["t"]) == [0, 2]
    np.testing.assert_allclose(grads["t"][2], [1 / 3 + 1 / 4] * 2)
    new, _ = reference_lookup_grad(plan, inputs, None, {"t": values}, {}, {"f": np.ones((2, 2))},
                                   0)
    untouched = [1, 3, 4, 5, 6, 7]
    np.testing.assert_array_equal(new["t"][untouched], values[untouched])
    np.testing.assert_allclose(new["t"][2], values[2] - 1e-3 * (1 / 3 + 1 / 4))


DROPPING = tc.SparseCoreConfig(allow_id_dropping=True)


@settings(max_examples=40)
@given(case=st.one_of(preprocess_cases(), preprocess_cases(small_limits=True)),
       seed=st.integers(0, 2**16))
def test_oracle_agrees_with_the_packed_buffers(case: PreprocessCase, seed: int) -> None:
    """The oracle (raw inputs) and a lookup read off tilecore's buffers (numpy) agree:
    same gains, ID transform, table layout and dropped pairs. Any topology, multi-process
    included (each process sees its local rows)."""
    plan = case.plan(DROPPING)
    rng = np.random.default_rng(seed)
    values = {name: rng.normal(size=(t.vocab_size, t.embedding_dim)).astype(np.float32)
              for name, t in plan.tables.items()}
    want = reference_lookup(plan, case.inputs, case.weights, values)
    batch, _ = preprocess(plan, case.inputs, case.weights)
    stacked = ops.shard(plan, values, fill=np.nan)
    got = {name: np.zeros_like(a) for name, a in want.items()}
    origins = preprocess_reference(plan, case.inputs, case.weights)
    topo = plan.topology
    for stack, per_sc in unpack(batch, plan).items():
        rows_per_shard = plan.stacks[stack].vocab_size // topo.num_partitions
        for key, entries in per_sc.items():
            for p, row, sample, gain in entries.to_tuples():
                feature, local_row = origins.stacks[stack].origins[key][sample]
                dim = plan.features[feature].table.embedding_dim
                got[feature][local_row] += gain * stacked[stack][p * rows_per_shard + row, :dim]
    for name in want:
        assert_close(got[name], want[name], name)


# --- shard / unshard / init_tables ----------------------------------------------------------


@settings(max_examples=30)
@given(case=preprocess_cases(), fill=st.sampled_from([0.0, -7.5]), seed=st.integers(0, 2**16))
def test_shard_unshard_round_trip_is_exact(case: PreprocessCase, fill: float, seed: int) -> None:
    plan = case.plan()
    rng = np.random.default_rng(seed)
    values = {name: rng.normal(size=(t.vocab_size, t.embedding_dim)).astype(np.float32)
              for name, t in plan.tables.items()}
    stacked = ops.shard(plan, values, fill=fill)
    back = ops.unshard(plan, stacked)
    for name, array in values.items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name].view(np.uint32), array.view(np.uint32))
    n = plan.num_partitions
    covered = {name: np.zeros(a.shape[0], bool) for name, a in stacked.items()}
    for name, t in plan.tables.items():
        setting = plan.table_settings[name]
        stack = stacked[setting.stack_name]
        assert stack.shape == (plan.stacks[setting.stack_name].vocab_size,
                               plan.stacks[setting.stack_name].embedding_dim)
        # The layout the preprocessing's ID transform addresses (REFERENCE.md §4 formula).
        ids = np.arange(t.vocab_size)
        rows = ((ids % n + setting.shard_rotation) % n) * (stack.shape[0] // n) + ids // n \
            + setting.row_offset_in_shard
        np.testing.assert_array_equal(stack[rows, :t.embedding_dim], values[name])
        np.testing.assert_array_equal(stack[rows, t.embedding_dim:], fill)
        for feature in plan.features.values():
            if feature.table.name == name:
                np.testing.assert_array_equal(
                    tc.stacking.physical_rows(plan, feature.name, ids), rows)
        covered[setting.stack_name][rows] = True
    for name, stack in stacked.items():  # padding rows hold the fill
        np.testing.assert_array_equal(stack[~covered[name]], fill)
    # shard ∘ unshard is the identity on the real rows: padding is re-filled.
    again = ops.shard(plan, back, fill=fill)
    for name in stacked:
        np.testing.assert_array_equal(again[name], stacked[name])


def test_shard_rejects_missing_and_misshapen_tables() -> None:
    plan = RICH.plan()
    values = RICH.table_values()
    with pytest.raises(ValueError, match="no array for tables"):
        ops.shard(plan, {"a": values["a"]})
    with pytest.raises(ValueError, match="table 'b' has shape"):
        ops.shard(plan, {**values, "b": values["b"][:, :3]})


def _recording_initializer(calls: list[tuple[int, ...]], offset: float):
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        calls.append(tuple(shape))
        return jax.random.uniform(key, shape, dtype, minval=offset, maxval=offset + 1.0)
    return init


@pytest.mark.parametrize("on_host", [False, True])
def test_init_tables_calls_initializers_per_shard(on_host: bool) -> None:
    calls_a: list[tuple[int, ...]] = []
    calls_c: list[tuple[int, ...]] = []
    specs = [
        table("a", 37, 5, optimizer=tc.Adagrad(initial_accumulator_value=0.3)),
        table("b", 19, 7, optimizer=tc.Adagrad(initial_accumulator_value=0.3)),
        table("c", 50, 3, optimizer=tc.FTRL(initial_linear_value=-0.25)),
    ]
    specs[0] = dataclasses.replace(specs[0], initializer=_recording_initializer(calls_a, 1.0))
    specs[2] = dataclasses.replace(specs[2], initializer=_recording_initializer(calls_c, -3.0))
    case = Case("init", tuple(specs), (("fa", "a", 8), ("fb", "b", 8), ("fc", "c", 8)),
                sc_per_device=4)
    plan = case.plan()
    assert len(plan.stacks) == 2  # a and b stack; c (another optimizer) is alone
    variables = ops.init_tables(plan, jax.random.key(3), on_host=on_host)
    n = plan.num_partitions
    for name in ("a", "c"):
        setting = plan.table_settings[name]
        # Called per shard, vmapped over the shard keys: traced once with the shard shape.
        assert set(calls_a if name == "a" else calls_c) == {
            (setting.padded_vocab_size // n, setting.padded_embedding_dim)}
    for stack_name, stack in plan.stacks.items():
        v = variables[stack_name]
        assert v.table.shape == (stack.vocab_size, stack.embedding_dim)
        assert v.table.dtype == jnp.float32
        assert len(v.slots) == len(stack.optimizer.slot_names)
        for slot, value in zip(v.slots, stack.optimizer.slot_initial_values(), strict=True):
            assert slot.shape == v.table.shape and slot.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(slot), np.float32(value))
    # Every row of a's and c's shards, padding rows and columns included, comes from the
    # initializer (values in [offset, offset + 1)); shards get different keys.
    stacked = {name: np.asarray(v.table) for name, v in variables.items()}
    c = stacked[plan.table_settings["c"].stack_name].reshape(n, -1, 8)
    assert ((c >= -3.0) & (c < -2.0)).all()
    assert len({c[p].tobytes() for p in range(n)}) == n
    setting = plan.table_settings["a"]
    ab = stacked[setting.stack_name].reshape(n, -1, 8)
    a_rows = ab[:, setting.row_offset_in_shard:
                setting.row_offset_in_shard + setting.padded_vocab_size // n]
    assert ((a_rows >= 1.0) & (a_rows < 2.0)).all()


def test_init_tables_on_host_equals_on_device() -> None:
    plan = CASES["mixed-no-stacking"].plan()
    key = jax.random.key(11)
    device = ops.init_tables(plan, key)
    host = ops.init_tables(plan, key, on_host=True)
    assert device.keys() == host.keys() == plan.stacks.keys()
    for name in plan.stacks:
        for a, b in zip((device[name].table, *device[name].slots),
                        (host[name].table, *host[name].slots), strict=True):
            # Same keys and draws; an accelerator's transcendental functions may differ from
            # the CPU's in the last bits (seen on an H100: 1e-5 relative).
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    # The default initializer: truncated normal with stddev 1/√dim, not constant.
    table_values = ops.unshard(plan, {n: v.table for n, v in device.items()})
    for name, values in table_values.items():
        dim = plan.tables[name].embedding_dim
        assert np.abs(values).max() <= 2.0 / math.sqrt(dim) + 1e-6
        assert values.std() > 0.3 / math.sqrt(dim)


# --- lookup and lookup_grad against the oracle ---------------------------------------------


def _custom_calls(case: Case) -> set[str]:
    """The FFI targets the jitted lookup of `case` calls (empty on the pure-XLA path)."""
    plan = case.plan()
    batch, _ = preprocess(plan, *case.batch(0))
    lowered = jax.jit(lambda b, t: ops.lookup(plan, b, t)).lower(
        batch, ops.shard(plan, case.table_values()))
    return set(re.findall(r"custom_call @(tilecore_\w+)", lowered.as_text()))


def test_kernels_setting_picks_the_path(kernels: str) -> None:
    assert wing().name == {"ffi": "cpu", "xla": "xla"}[kernels]
    calls = _custom_calls(CASES[next(iter(CASES))])
    assert bool(calls) == (kernels == "ffi"), calls


@pytest.mark.parametrize("name", CASES)
def test_ops_match_oracle(name: str, kernels: str) -> None:
    """3 steps of jitted lookup + lookup_grad (donated): activations, tables and slots
    equal the oracle's, untouched rows and slots are bit-unchanged, and the second and
    third steps reuse the first step's compilation."""
    assert wing().name == {"ffi": "cpu", "xla": "xla"}[kernels]
    case = CASES[name]
    run = run_steps(case)
    assert run.traces == {"lookup": 1, "lookup_grad": 1}
    assert all(run.dropped) == case.allow_id_dropping  # dropping cases do drop
    check_against_oracle(case, run, oracle_steps(case))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_matches_oracle(name: str) -> None:
    case = RICH.with_optimizer(name, OPTIMIZERS[name])
    run = run_steps(case)
    assert run.traces == {"lookup": 1, "lookup_grad": 1}
    assert all(run.dropped)
    check_against_oracle(case, run, oracle_steps(case))


def test_clip_applies_to_the_table_only() -> None:
    """Touched table rows are clipped; untouched rows and every slot are not (the
    Adagrad accumulator, ≥ 0.1, would be cut to 0.05 if it were)."""
    adagrad = tc.Adagrad(learning_rate=0.5)
    case = dataclasses.replace(RICH, name="clip", allow_id_dropping=False, tables=(
        table("a", 61, 5, "mean", optimizer=adagrad), table("b", 35, 7, "mean", optimizer=adagrad)))
    (stack,) = case.plan().stacks
    clip = {stack: (-0.6, 0.05)}
    run = run_steps(case, steps=2, clip=clip)
    check_against_oracle(case, run, oracle_steps(case, steps=2, clip=clip))
    before, (table_after, accumulator) = run.before[0][stack][0], run.after[0][stack]
    touched = np.any(table_after != before, axis=1)
    assert touched.any()
    assert table_after[touched].min() >= -0.6 and table_after[touched].max() <= 0.05
    assert np.isclose(table_after[touched], -0.6).any() and np.isclose(table_after[touched],
                                                                      0.05).any()
    assert np.abs(table_after[~touched]).max() > 1.0  # untouched rows keep their values
    assert accumulator[touched].min() >= 0.1


def test_unknown_clip_stack_is_rejected() -> None:
    plan = RICH.plan()
    with pytest.raises(ValueError, match="clip names unknown stacks"):
        reference_lookup_grad(plan, {}, None, {}, {}, {}, 0, clip={"nope": (0.0, 1.0)})


def test_stacked_activations_and_gradients_round_trip() -> None:
    """`stacked=True` blocks unstack to the per-feature activations, stacked gradients
    give the same update, and unstack ∘ stack is the identity (bare tables work too)."""
    case = RICH
    plan = case.plan()
    layouts = ops.stack_layouts(plan)
    batch, _ = preprocess(plan, *case.batch(0))
    variables = ops.init_tables(plan, jax.random.key(0))

    @jax.jit
    def both(batch: tc.PreprocessedBatch, variables: Any, grads: Any) -> Any:
        features = ops.lookup(plan, batch, variables)
        bare = ops.lookup(plan, batch, {name: v.table for name, v in variables.items()})
        blocks = ops.lookup(plan, batch, variables, stacked=True)
        unstacked = {f: a for name, block in blocks.items()
                     for f, a in ops.unstack_activations(plan, name, block, layouts[name]).items()}
        grad_blocks = {name: ops.stack_gradients(plan, name, grads, layouts[name])
                       for name in blocks}
        round_trip = {f: a for name, block in grad_blocks.items()
                      for f, a in ops.unstack_activations(plan, name, block, layouts[name]).items()}
        by_feature = ops.lookup_grad(plan, batch, variables, grads)
        by_block = ops.lookup_grad(plan, batch, variables, grad_blocks, stacked=True)
        return features, bare, blocks, unstacked, round_trip, by_feature, by_block

    grads = case.activation_grads(0)
    features, bare, blocks, unstacked, round_trip, by_feature, by_block = both(
        batch, variables, grads)
    for name, block in blocks.items():
        layout = layouts[name]
        assert block.shape == (layout.sc_per_device * layout.samples_per_sc, layout.dim)
    assert unstacked.keys() == features.keys() == grads.keys()
    for f in features:  # bare tables look up like their variables
        np.testing.assert_array_equal(np.asarray(bare[f]), np.asarray(features[f]))
        np.testing.assert_array_equal(np.asarray(unstacked[f]), np.asarray(features[f]))
        np.testing.assert_array_equal(np.asarray(round_trip[f]), grads[f])
    for a, b in zip(jax.tree.leaves(by_feature), jax.tree.leaves(by_block), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_training_update_gradients_match_oracle() -> None:
    """`jax.grad` through the custom-VJP lookup yields the activation gradients, and the
    one-call update equals the oracle's: with loss Σ_f Σ act_f·W_f the activation
    gradient of feature f is W_f and the gradient of W_f is act_f."""
    case = RICH.with_optimizer("adam", OPTIMIZERS["adam"])
    plan = case.plan()
    inputs, weights = case.batch(0)
    batch, _ = preprocess(plan, inputs, weights)
    values = case.table_values()
    slots = initial_slots(plan)
    stacked_slots = shard_slots(plan, slots)
    variables = {name: ops.EmbeddingVariables(jnp.asarray(table_values),
                                              tuple(map(jnp.asarray, stacked_slots[name])))
                 for name, table_values in ops.shard(plan, values).items()}
    params = case.activation_grads(0)

    def loss_fn(params: Any, activations: Any) -> jax.Array:
        return sum((activations[f] * params[f]).sum() for f in params)  # type: ignore[return-value]

    update = jax.jit(lambda b, v, p: ops.training_update(plan, b, v, loss_fn, p, 0))
    loss, param_grads, new = update(batch, variables, params)
    acts = reference_lookup(plan, inputs, weights, values)
    for f in params:
        assert_close(param_grads[f], acts[f], f)
    assert_close(loss, sum((acts[f] * params[f]).sum() for f in params))
    want_tables, want_slots = reference_lookup_grad(plan, inputs, weights, values, slots, params,
                                                    0)
    got = unshard_state(plan, {name: [v.table, *v.slots] for name, v in new.items()})
    for name in want_tables:
        assert_close(got[name][0], want_tables[name], name)
        for k, want_slot in enumerate(want_slots[name]):
            assert_close(got[name][k + 1], want_slot, f"{name} slot {k}")
