"""The CPU wing's fused update: rules as scalar kernels, sorted runs, and the fallbacks.

`test_ops.py` checks every optimizer end to end against the numpy oracle (through
the fused kernels on CPU); these tests pin what those cannot see: that every rule
really takes the fused path, that a rule which is not elementwise falls back and
is still right, that buffers whose runs are not sorted (built by hand) update the
same as sorted ones, and that the generated scalar code equals the `jnp` rule on
random data for the primitives it translates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
from _ops_cases import (
    OPTIMIZERS,
    RICH,
    check_against_oracle,
    oracle_steps,
    preprocess,
    run_steps,
)
from tilecore import ops
from tilecore.ops._backend import wing
from tilecore.ops._sparse_update import apply_sparse_update
from tilecore.ops.cpu._fused_update import fused_kernels, fused_update_rows
from tilecore.ops.cpu._rule_source import rule_source

pytestmark = pytest.mark.skipif(wing().name != "cpu", reason="the CPU wing is not in use")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_takes_the_fused_kernel(name: str) -> None:
    source = rule_source(OPTIMIZERS[name], 8)
    assert source is not None
    assert source.num_slots == len(OPTIMIZERS[name].slot_names)
    assert "def rule(" in source.source


def _rowwise_adagrad(grad: Any, row: Any, accumulator: Any, learning_rate: Any
                     ) -> tuple[Any, Any]:
    """Row-wise Adagrad on the row's squared norm (padding columns add nothing), one
    accumulator value per row kept in every column."""
    accumulator = accumulator + (grad * grad).sum(axis=-1, keepdims=True)
    return row - learning_rate * grad / (accumulator ** 0.5), accumulator + 0 * grad


def test_a_rule_that_reduces_a_row_falls_back_and_matches_the_oracle() -> None:
    spec = tc.CustomOptimizer(update_fn=_rowwise_adagrad, learning_rate=0.1,
                              slot_initial_value_tuple=(0.2,))
    assert rule_source(spec, 8) is None and fused_kernels(spec, np.float32, 8) is None
    case = RICH.with_optimizer("rowwise", spec)
    check_against_oracle(case, run_steps(case, steps=2), oracle_steps(case, steps=2))


def _mixed_rule(grad: Any, row: Any, slot: Any, lr: Any, power: Any, flag: Any
                ) -> tuple[Any, Any]:
    """Every translated primitive family: comparisons, selects, clip, integer powers,
    transcendental functions, an integer hyperparameter converted to float."""
    step = jnp.asarray(flag, jnp.float32)
    big = jnp.where(jnp.abs(grad) > 0.5, grad ** 3, jnp.clip(grad, -0.25, 0.25))
    slot = jnp.maximum(slot, 0.0) + jnp.exp(-jnp.square(grad)) * jnp.tanh(step)
    scaled = jnp.power(slot + 1.0, power) * jax.lax.rsqrt(slot + 1.0)
    row = jnp.where((row < 0) & (slot > 0.5), row * 0.5, row) - lr * big * scaled
    return row + jnp.sign(grad) * jnp.log1p(jnp.abs(grad)) * 1e-3, slot


def test_generated_rule_equals_the_jnp_rule() -> None:
    spec = tc.CustomOptimizer(update_fn=_mixed_rule, learning_rate=0.1,
                              slot_initial_value_tuple=(0.3,), extra_hyperparameters=(-0.5, 3))
    kernels = fused_kernels(spec, np.float32, 6)
    assert kernels is not None and kernels.rule.hyper_kinds == ("f", "f", "i")
    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (40, 6)).astype(np.float32)
    slot = rng.uniform(-1, 2, (40, 6)).astype(np.float32)
    rows = np.array([3, 17, 0, 39, 8, -1, 40, 5], np.int32)  # -1 and 40 are padding
    sums = rng.normal(0, 1, (8, 6)).astype(np.float32)
    variables = ops.EmbeddingVariables(jnp.asarray(table), (jnp.asarray(slot),))
    got = jax.jit(lambda v, s: fused_update_rows(kernels, v, jnp.asarray(rows), jnp.asarray(s),
                                                 spec, 7, (-2.0, 2.0), jnp.int32(7)))(
        variables, sums)
    listed = np.where(rows[:7] < 0, 40, rows[:7])  # apply_sparse_update's padding: >= V
    expected = apply_sparse_update(variables, jnp.asarray(listed), jnp.asarray(sums[:7]),
                                       spec, 7, clip=(-2.0, 2.0))
    # Row 5 is past `count` (7 rows real): it stays untouched by the fused kernel.
    np.testing.assert_array_equal(np.asarray(got.table)[5], table[5])
    touched = [3, 17, 0, 39, 8]
    np.testing.assert_allclose(np.asarray(got.table)[touched],
                               np.asarray(expected.table)[touched], rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.slots[0])[touched],
                               np.asarray(expected.slots[0])[touched], rtol=2e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(40), [*touched, 5])
    np.testing.assert_array_equal(np.asarray(got.table)[untouched], table[untouched])


def _reverse_runs(batch: tc.PreprocessedBatch, plan: tc.StackingPlan) -> tc.PreprocessedBatch:
    """`batch` with every (SparseCore, partition) run's entries in reverse order."""
    n = plan.topology.num_partitions
    per_sc = max(n, 8)
    stacks = {}
    for name, buffers in batch.stacks.items():
        pointers = np.asarray(buffers.row_pointers).reshape(-1)
        arrays = [np.asarray(a).reshape(-1).copy()
                  for a in (buffers.embedding_ids, buffers.sample_ids, buffers.gains)]
        s_count = plan.topology.sc_per_device
        slot = arrays[0].shape[0] // s_count
        for s in range(s_count):
            previous = 0
            for p in range(n):
                end = int(pointers[s * per_sc + p])
                start = (previous + 7) & ~7
                previous = end
                window = slice(s * slot + start, s * slot + end)
                for a in arrays:
                    a[window] = a[window][::-1].copy()
        shape = np.shape(buffers.embedding_ids)
        stacks[name] = dataclasses.replace(
            buffers, embedding_ids=arrays[0].reshape(shape), sample_ids=arrays[1].reshape(shape),
            gains=arrays[2].reshape(shape))
    return dataclasses.replace(batch, stacks=stacks)


def test_unsorted_runs_update_like_sorted_ones() -> None:
    case = RICH.with_optimizer("adagrad", OPTIMIZERS["adagrad"])
    plan = case.plan()
    inputs, weights = case.batch(0)
    batch, _ = preprocess(plan, inputs, weights)
    shuffled = _reverse_runs(batch, plan)
    assert not all(np.array_equal(np.asarray(a.embedding_ids), np.asarray(b.embedding_ids))
                   for a, b in zip(batch.stacks.values(), shuffled.stacks.values(),
                                   strict=True))
    grads = {f: jnp.asarray(g) for f, g in case.activation_grads(0).items()}

    def updated(b: tc.PreprocessedBatch) -> dict[str, Any]:
        variables = ops.init_tables(plan, jax.random.key(0))
        return ops.lookup_grad(plan, b, variables, grads, 0)

    for name, (a, b) in {n: (updated(batch)[n], updated(shuffled)[n]) for n in batch.stacks}.items():
        for x, y in zip((a.table, *a.slots), (b.table, *b.slots), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6,
                                       err_msg=name)


def _array_table(arrays: list[np.ndarray]) -> np.ndarray:
    """What a kernel variadic in its operands receives for `arrays`: address, rows, width."""
    return np.array([(a.ctypes.data, *a.shape) for a in arrays], np.int64).reshape(-1, 3)


@pytest.mark.parametrize("sorted_runs", [True, False])
def test_update_parts_write_their_own_rows_and_add_up_to_the_whole(sorted_runs: bool) -> None:
    from tilecore.ops._activations import feature_slices, stack_slices
    from tilecore.ops._layout import stack_layouts
    from tilecore.ops._per_device import flat_buffers
    from tilecore.ops.cpu import _kernels
    from tilecore.ops.cpu._fused_update import _hyper_operands

    case = RICH.with_optimizer("adagrad", OPTIMIZERS["adagrad"])
    plan = case.plan()
    batch, _ = preprocess(plan, *case.batch(0))
    if not sorted_runs:
        batch = _reverse_runs(batch, plan)
    rng = np.random.default_rng(5)
    for name, layout in stack_layouts(plan).items():
        spec = plan.stacks[name].optimizer
        kernels = fused_kernels(spec, np.float32, layout.dim)
        kernel = kernels.update_buffers.kernel
        hf, hi = (np.asarray(x) for x in _hyper_operands(kernels.rule, spec, 3, None))
        rows = layout.rows_per_device
        ins = [rng.standard_normal((rows, layout.dim)).astype(np.float32)
               for _ in range(1 + len(spec.slot_names))]
        ins[1:] = [np.abs(x) for x in ins[1:]]  # accumulators
        slices = list(feature_slices(plan, name).values())
        per_feature = [rng.standard_normal((layout.sc_per_device * count, width)
                                           ).astype(np.float32) for _, count, width in slices]
        grads = np.asarray(stack_slices(per_feature, layout, slices))  # zeros past a width
        buffers = (_kernels.layout_array(layout), np.array([0, 1], np.int32),
                   *(np.asarray(x) for x in flat_buffers(batch.stacks[name])))
        block = (np.array([[0, layout.samples_per_sc]], np.int32), _array_table([grads]))
        operands = (*buffers, block[0], hf, hi, *ins, block[1])
        whole = [np.full_like(x, np.nan) for x in ins]
        assert kernel(*operands, *whole, 0, 1) == 0
        assert all(np.isfinite(x).all() for x in whole)
        assert not np.array_equal(whole[0], ins[0])  # rows were updated
        # Each feature's gradients read where they lie: the same update as from the block.
        features = [np.full_like(x, np.nan) for x in ins]
        assert kernel(*buffers, _kernels.slice_operand(slices), hf, hi, *ins,
                      _array_table(per_feature), *features, 0, 1) == 0
        for got, want in zip(features, whole, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=name)
        # One gradient array short of the slices: refused, nothing read past the table.
        assert kernel(*buffers, _kernels.slice_operand(slices), hf, hi, *ins,
                      _array_table(per_feature[:-1]), *features, 0, 1) == 1
        local = np.arange(rows) % layout.rows_per_shard
        for parts in (2, 3):
            outs = [np.full_like(x, np.nan) for x in ins]
            for part in range(parts):
                kernel(*operands, *outs, part, parts)
                done = local < layout.rows_per_shard * (part + 1) // parts  # parts so far own
                for got, want in zip(outs, whole, strict=True):
                    np.testing.assert_array_equal(got[done], want[done], err_msg=name)
                    assert np.isnan(got[~done]).all(), name


def test_update_rows_parts_write_their_own_rows_and_add_up_to_the_whole() -> None:
    from tilecore.ops.cpu._fused_update import _hyper_operands

    spec = OPTIMIZERS["adagrad"]
    kernels = fused_kernels(spec, np.float32, 8)
    kernel = kernels.update_rows.kernel
    hf, hi = (np.asarray(x) for x in _hyper_operands(kernels.rule, spec, 3, None))
    rng = np.random.default_rng(6)
    ins = [rng.standard_normal((97, 8)).astype(np.float32), rng.random((97, 8), np.float32)]
    rows = np.concatenate([rng.permutation(97)[:60], [-1, 97, 500]]).astype(np.int32)
    sums = rng.standard_normal((rows.shape[0], 8)).astype(np.float32)
    operands = (rows, sums, np.array([rows.shape[0]], np.int32), hf, hi, *ins)
    whole = [np.full_like(x, np.nan) for x in ins]
    assert kernel(*operands, *whole, 0, 1) == 0
    for parts in (2, 5):
        outs = [np.full_like(x, np.nan) for x in ins]
        for part in range(parts):
            kernel(*operands, *outs, part, parts)
            done = 97 * (part + 1) // parts
            for got, want in zip(outs, whole, strict=True):
                np.testing.assert_array_equal(got[:done], want[:done])
                assert np.isnan(got[done:]).all()


def _one_table(optimizer: tc.OptimizerSpec, vocab: int, dim: int, ids: np.ndarray
               ) -> tuple[tc.StackingPlan, tc.PreprocessedBatch, dict[str, Any]]:
    """A plan of table "t" (`vocab` x `dim`, summed) and feature "f" of `ids`' shape on two
    SparseCores, the batch of `ids`, and the plan's initial tables."""
    table = tc.TableSpec(name="t", vocab_size=vocab, embedding_dim=dim, combiner="sum",
                         optimizer=optimizer)
    plan = tc.plan_stacking([tc.FeatureSpec(name="f", table=table, input_shape=ids.shape)],
                            tc.Topology(global_devices=1, sc_per_device=2))
    batch, _ = tc.preprocess(plan, {"f": ids})
    return plan, batch, ops.init_tables(plan, jax.random.key(0))


def _update_size(optimizer: tc.OptimizerSpec) -> float:
    """Σ|table change| after one `lookup_grad` of unit gradients: 16 IDs, each row once."""
    plan, batch, variables = _one_table(optimizer, 32, 4, np.arange(16).reshape(8, 2))
    before = np.asarray(variables["t"].table).copy()
    after = ops.lookup_grad(plan, batch, variables, {"f": jnp.ones((8, 4))}, 0)
    return float(np.abs(np.asarray(after["t"].table) - before).sum())


def test_rates_and_hyperparameters_of_any_number_type_update_alike(kernels: str) -> None:
    """An int learning rate from a schedule, or an int hyperparameter of a custom rule, is
    the number it says, whichever table of the process compiled the rule first (the fused
    kernels once read an int as float bits, or a float as 0, and updated nothing)."""
    sizes = [_update_size(tc.SGD(learning_rate=lr)) for lr in (
        lambda step: 1, 1.0, 0.5, lambda step: np.int64(2), lambda step: jnp.int32(1))]
    assert sizes == [64.0, 64.0, 32.0, 128.0, 64.0]

    def scaled(grad: Any, row: Any, learning_rate: Any, scale: Any) -> tuple[Any]:
        return (row - learning_rate * scale * grad,)

    sizes = [_update_size(tc.CustomOptimizer(update_fn=scaled, learning_rate=0.5,
                                             extra_hyperparameters=(scale,)))
             for scale in (2, 2.0, 3, 0.5)]  # type: ignore[arg-type]
    assert sizes == [64.0, 64.0, 96.0, 16.0]


@pytest.mark.parametrize("broken", ["narrow row", "five of eight columns", "scalar slot",
                                    "transposed row", "integer row", "no tuple"])
def test_a_rule_returning_rows_of_another_shape_is_refused(kernels: str, broken: str) -> None:
    """On the CPU wing a [rows, 1] row was scattered as [rows, dim]: values read past the
    rule's output went into the table; the XLA wing broadcast it over the row. A rule
    keeping five of eight columns was compiled in as a whole row (traced on 3 columns,
    its slice was the row), and integer rows were rounded in silence."""
    def rule(grad: Any, row: Any, slot: Any, lr: Any) -> Any:
        if broken == "narrow row":
            return row[:, :1] - lr * grad[:, :1], slot
        if broken == "five of eight columns":
            return (row - lr * grad)[:, :5], (slot + grad)[:, :5]
        if broken == "scalar slot":
            return row - lr * grad, jnp.float32(0.0)
        if broken == "integer row":
            return (row - lr * grad).astype(jnp.int32), slot
        if broken == "no tuple":
            return row - lr * grad
        return (row - lr * grad).T, slot

    plan, batch, variables = _one_table(
        tc.CustomOptimizer(update_fn=rule, learning_rate=0.1, slot_initial_value_tuple=(0.5,)),
        64, 8, np.arange(16).reshape(16, 1))
    message = {"integer row": r"returned new_row of dtype int32; expected floating-point rows",
               "no tuple": r"returned a \w+, not a tuple; expected a tuple \(new_row, \*new_slots\) "
                           r"of 2 arrays"}.get(
        broken, r"returned (new_row|new slot 0) of shape \(.*\); expected \(\d+, 8\)")
    with pytest.raises(ValueError, match=r"The CustomOptimizer update rule " + message):
        ops.lookup_grad(plan, batch, variables, {"f": jnp.ones((16, 8))}, 0)


def test_a_rule_reading_the_row_width_gets_the_tables(kernels: str) -> None:
    """The fused kernel's source was traced on rows of 3 values: a rule that reads its rows'
    width (`row.shape[1]`) was compiled with 3 in it, on a table of 8 (a step of 1.5, not 4,
    on the CPU wing alone)."""
    def rule(grad: Any, row: Any, lr: Any) -> tuple[Any]:
        return (row - lr * grad * row.shape[1],)

    plan, batch, variables = _one_table(tc.CustomOptimizer(update_fn=rule, learning_rate=0.5),
                                        64, 8, np.arange(16).reshape(16, 1))
    after = ops.lookup_grad(plan, batch, variables, {"f": jnp.ones((16, 8))}, 0)["t"]
    change = (ops.unshard(plan, {"t": variables["t"].table})["t"][:16]
              - ops.unshard(plan, {"t": after.table})["t"][:16])
    np.testing.assert_allclose(change, 0.5 * 8, rtol=1e-6)


def test_a_rule_of_more_slots_than_a_kernel_call_can_pass_runs_in_jax(kernels: str) -> None:
    """Ten slots made the fused kernel's calls 34 arguments long, which numba cannot
    compile (it raised `UnsupportedError` from the generated module); such a rule now
    runs in JAX, on either wing, and updates every slot."""
    def rule(grad: Any, row: Any, *rest: Any) -> tuple[Any, ...]:
        *slots, lr = rest
        return (row - lr * grad, *(s + (k + 1) * grad for k, s in enumerate(slots)))

    spec = tc.CustomOptimizer(update_fn=rule, learning_rate=0.5,
                              slot_initial_value_tuple=(0.0,) * 10)
    assert fused_kernels(spec, np.float32, 8) is None
    plan, batch, variables = _one_table(spec, 64, 8, np.arange(16).reshape(16, 1))
    after = ops.lookup_grad(plan, batch, variables, {"f": jnp.ones((16, 8))}, 0)["t"]
    rows = ops.unshard(plan, {"t": after.table})["t"][:16]
    before = ops.unshard(plan, {"t": variables["t"].table})["t"][:16]
    np.testing.assert_allclose(rows, before - 0.5, rtol=1e-6)
    for k, slot in enumerate(after.slots):
        np.testing.assert_array_equal(ops.unshard(plan, {"t": slot})["t"][:16], k + 1.0)


def test_a_rule_of_more_hyperparameters_than_a_kernel_call_can_pass_runs_in_jax(
        kernels: str) -> None:
    """The scalar rule's call passes the gradient, the row, the slots and every
    hyperparameter: 30 extra ones make 33 arguments, past what numba compiles."""
    def rule(grad: Any, row: Any, lr: Any, *extra: Any) -> tuple[Any]:
        return (row - lr * grad * sum(extra),)

    spec = tc.CustomOptimizer(update_fn=rule, learning_rate=0.5,
                              extra_hyperparameters=(0.1,) * 30)
    assert fused_kernels(spec, np.float32, 8) is None
    plan, batch, variables = _one_table(spec, 64, 8, np.arange(16).reshape(16, 1))
    after = ops.lookup_grad(plan, batch, variables, {"f": jnp.ones((16, 8))}, 0)["t"]
    change = (ops.unshard(plan, {"t": variables["t"].table})["t"][:16]
              - ops.unshard(plan, {"t": after.table})["t"][:16])
    np.testing.assert_allclose(change, 0.5 * 3.0, rtol=1e-5)
