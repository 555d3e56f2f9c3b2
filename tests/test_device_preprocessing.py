"""Device preprocessing against the host path: the same inputs give the same bits.

A few fixed plans (so a handful of compiled programs serve every example: inputs
are padded to capacities the plan fixes) cover several stacks, feature and table
stacking, every combiner, weighted and unweighted features, 4 and 8 partitions,
1, 2 and 4 SparseCores per device, several local devices and a process holding
half the devices; hypothesis draws the batches (empty rows, duplicates, skew),
the limits' effect (dropping or raising) and the input forms.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tilecore as tc
from tilecore import ops
from tilecore.preprocessing._flat import capacity


def _tables() -> list[tc.TableSpec]:
    return [
        tc.TableSpec(name="a", vocab_size=90, embedding_dim=8, combiner="sum",
                     max_ids_per_partition=3, max_unique_ids_per_partition=2),
        tc.TableSpec(name="b", vocab_size=200, embedding_dim=8, combiner="mean",
                     max_ids_per_partition=4, max_unique_ids_per_partition=3),
        tc.TableSpec(name="c", vocab_size=61, embedding_dim=8, combiner="mean",
                     max_ids_per_partition=5, max_unique_ids_per_partition=5),
        tc.TableSpec(name="d", vocab_size=150, embedding_dim=16, combiner="sqrtn",
                     max_ids_per_partition=2, max_unique_ids_per_partition=2),
    ]


def _plan(topology: tc.Topology, batch: int) -> tc.StackingPlan:
    a, b, c, d = _tables()
    features = [
        tc.FeatureSpec(name="f0", table=a, input_shape=(batch, 5)),
        tc.FeatureSpec(name="f1", table=b, input_shape=(batch, 6)),
        tc.FeatureSpec(name="f2", table=c, input_shape=(batch, 4)),
        tc.FeatureSpec(name="f3", table=d, input_shape=(batch, 7)),
        tc.FeatureSpec(name="f4", table=b, input_shape=(batch, 3)),  # shares table b
    ]
    plan = tc.auto_stack_tables(features, topology)  # b and c stack: mean, dim 8
    return with_buffers(plan, lambda s: tc.coo_buffer_size_per_device(s, topology))


def with_buffers(plan: tc.StackingPlan, size: Callable[[tc.StackSpec], int], **limits: int
                 ) -> tc.StackingPlan:
    """`plan` with COO buffers of `size(stack)` entries per device and the given limits."""
    return dataclasses.replace(plan, stacks={
        name: dataclasses.replace(s, **limits, suggested_coo_buffer_size_per_device=size(s))
        for name, s in plan.stacks.items()})


PLANS = {
    "1x4": _plan(tc.Topology(global_devices=1, sc_per_device=4), 16),
    "2x2": _plan(tc.Topology(global_devices=2, sc_per_device=2), 16),
    "4x2 (2 local)": _plan(tc.Topology(global_devices=4, sc_per_device=2, local_devices=2), 32),
    "4x1": _plan(tc.Topology(global_devices=4, sc_per_device=1), 8),
}


def generous(plan: tc.StackingPlan) -> tc.StackingPlan:
    """`plan` with limits of 64 in buffers of the same size (the same compiled program):
    nothing is dropped for the limits, but skewed batches overflow the buffer."""
    return with_buffers(plan, lambda s: s.suggested_coo_buffer_size_per_device or 0,
                        max_ids_per_partition=64, max_unique_ids_per_partition=64)


WEIGHTED = ("f1", "f2", "f3")  # f0 (sum) and f4 (mean, beside the weighted f1) unweighted


def _inputs(plan: tc.StackingPlan, seed: int, *, empty: float, duplicates: float, zipf: bool,
            dense: bool, weighted: tuple[str, ...] = WEIGHTED
            ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    topo = plan.topology
    inputs: dict[str, Any] = {}
    weights: dict[str, np.ndarray] = {}
    for name, feature in plan.features.items():
        rows = feature.batch_size * topo.num_local_devices // topo.global_devices
        width, vocab = feature.input_shape[1], feature.table.vocab_size
        lengths = np.full(rows, width) if dense else rng.integers(0, width + 1, rows)
        if not dense:
            lengths[rng.random(rows) < empty] = 0
        count = int(lengths.sum())
        ids = ((rng.zipf(1.3, count) - 1) % vocab if zipf else rng.integers(0, vocab, count))
        splits = np.concatenate([[0], np.cumsum(lengths)])
        for r in range(rows):  # repeat earlier IDs of the row
            for i in range(splits[r] + 1, splits[r + 1]):
                if rng.random() < duplicates:
                    ids[i] = ids[rng.integers(splits[r], i)]
        ids = ids.astype(np.int32 if seed % 2 else np.int64)
        inputs[name] = ids.reshape(rows, width) if dense else tc.Ragged(ids, splits)
        if name in weighted:
            w = rng.uniform(0.1, 3.0, count).astype(np.float32)
            weights[name] = w.reshape(rows, width) if dense else w
    return inputs, weights


def _outcome(fn: Callable[[], tuple[tc.PreprocessedBatch, tc.PreprocessStats]]) -> Any:
    """(batch, stats, warning messages), or the exception raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            batch, stats = fn()
        except ValueError as error:
            return error
    return batch, stats, [str(w.message) for w in caught]


def assert_same(plan: tc.StackingPlan, inputs: Mapping[str, Any], weights: Mapping[str, Any],
                **kwargs: Any) -> Any:
    """The host and device paths agree: bit-identical buffers, equal statistics and
    warnings, or the same error."""
    host = _outcome(lambda: tc.preprocess(plan, inputs, weights, **kwargs))
    device = _outcome(lambda: ops.preprocess_on_device(plan, inputs, weights, **kwargs))
    if isinstance(host, Exception):
        assert type(device) is type(host) and str(device) == str(host), (host, device)
        return host
    assert not isinstance(device, Exception), device
    (hb, hs, hw), (db, ds, dw) = host, device
    assert hw == dw
    assert hb.num_minibatches == db.num_minibatches and hb.made_for == db.made_for
    for name in hb.stacks:
        for field in dataclasses.fields(tc.StackBuffers):
            want = getattr(hb.stacks[name], field.name)
            got = getattr(db.stacks[name], field.name)
            assert isinstance(got, jax.Array)
            got = np.asarray(got)
            assert (got.dtype, got.shape) == (want.dtype, want.shape), (name, field.name)
            assert got.tobytes() == want.tobytes(), (name, field.name)
        for field in ("max_ids_per_partition", "max_unique_ids_per_partition",
                      "required_buffer_size_per_sc"):
            want, got = getattr(hs, field)[name], getattr(ds, field)[name]
            assert got.dtype == want.dtype == np.int32, field
            np.testing.assert_array_equal(got, want, err_msg=f"{name}.{field}")
    assert dict(hs.id_drop_counters) == dict(ds.id_drop_counters)
    return hs


@settings(max_examples=40)
@given(topology=st.sampled_from(sorted(PLANS)), seed=st.integers(0, 2**32 - 1),
       empty=st.sampled_from([0.0, 0.3]), duplicates=st.sampled_from([0.0, 0.4]),
       zipf=st.booleans(), dense=st.booleans(), dropping=st.booleans(), small=st.booleans())
def test_device_matches_host(topology: str, seed: int, empty: float, duplicates: float,
                             zipf: bool, dense: bool, dropping: bool, small: bool) -> None:
    plan = PLANS[topology] if small else generous(PLANS[topology])
    plan = plan.with_config(allow_id_dropping=dropping)
    inputs, weights = _inputs(plan, seed, empty=empty, duplicates=duplicates, zipf=zipf,
                              dense=dense)
    assert_same(plan, inputs, weights)


def test_limits_drop_and_raise_as_on_the_host() -> None:
    plan = PLANS["2x2"]
    inputs, weights = _inputs(plan, 3, empty=0.0, duplicates=0.4, zipf=True, dense=False)
    stats = assert_same(plan.with_config(allow_id_dropping=True), inputs, weights)
    assert stats.dropped_ids > 0  # the warning was compared too
    error = assert_same(plan, inputs, weights)
    assert isinstance(error, tc.LimitExceededError)
    # The limits generous, the COO buffer too small: the buffer error, or drops counted.
    inputs, weights = _inputs(plan, 1, empty=0.0, duplicates=0.0, zipf=True, dense=True)
    error = assert_same(generous(plan), inputs, weights)
    assert isinstance(error, ValueError) and "COO entries" in str(error)
    stats = assert_same(generous(plan).with_config(allow_id_dropping=True), inputs, weights)
    assert stats.dropped_ids


@pytest.mark.parametrize("damage", ["id_too_large", "negative_id", "nan_weight", "zero_sum",
                                    "overflowing_sum", "overflowing_duplicates", "int64_id"])
def test_invalid_inputs_raise_the_host_error(damage: str) -> None:
    plan = PLANS["1x4"].with_config(allow_id_dropping=True)
    inputs, weights = _inputs(plan, 5, empty=0.0, duplicates=0.0, zipf=False, dense=False)
    f1 = inputs["f1"]
    if damage == "zero_sum":  # a row of a mean feature weighs nothing
        r = int(np.argmax(np.diff(f1.row_splits) >= 2))
        a, b = f1.row_splits[r], f1.row_splits[r + 1]
        weights["f1"][a:b] = [1.0, -1.0] * ((b - a) // 2) + [0.0] * ((b - a) % 2)
    elif damage == "overflowing_sum":  # Σw of a mean feature's row past float32's max
        r = int(np.argmax(np.diff(f1.row_splits) >= 2))
        weights["f1"][f1.row_splits[r]:f1.row_splits[r + 1]] = 3e38
    elif damage == "overflowing_duplicates":  # one ID twice in a sum feature's row, 3e38 each
        f0 = inputs["f0"]
        r = int(np.argmax(np.diff(f0.row_splits) >= 2))
        a = f0.row_splits[r]
        values = f0.values.copy()
        values[a + 1] = values[a]
        inputs["f0"] = tc.Ragged(values, f0.row_splits)
        weights["f0"] = np.ones(values.shape[0], np.float32)
        weights["f0"][a:a + 2] = 3e38
    elif damage == "nan_weight":
        weights["f2"][7] = np.nan
    else:
        values = f1.values.astype(np.int64)
        values[9] = {"id_too_large": 200, "negative_id": -3, "int64_id": 2**40}[damage]
        values[20] = 500
        inputs["f1"] = tc.Ragged(values, f1.row_splits)
    error = assert_same(plan, inputs, weights)
    assert isinstance(error, ValueError) and re.search("Feature 'f[012]'", str(error))


def test_long_duplicate_runs_merge_as_on_the_host() -> None:
    """A sample repeating one ID many times (runs of 9 to 38 entries to merge), with
    weights that differ: the merged gains are the host's bits (the same additions in the
    same order)."""
    plan = PLANS["1x4"]
    inputs, weights = _inputs(plan, 3, empty=0.0, duplicates=0.0, zipf=False, dense=False,
                              weighted=(*WEIGHTED, "f0"))
    rng = np.random.default_rng(5)
    f0 = inputs["f0"]
    repeats = {1: 37, 2: 9, 3: 8}  # row -> extra copies of one ID
    values, splits, w = list(f0.values), [0], list(weights["f0"])
    for row in range(len(f0.row_splits) - 1):
        start, end = f0.row_splits[row], f0.row_splits[row + 1]
        extra = repeats.get(row, 0)
        splits.append(splits[-1] + end - start + extra)
    for row in sorted(repeats, reverse=True):
        at = f0.row_splits[row + 1]
        values[at:at] = [row + 3] * repeats[row]
        w[at:at] = rng.uniform(0.1, 3.0, repeats[row]).astype(np.float32).tolist()
    inputs["f0"] = tc.Ragged(np.asarray(values, np.int32), np.asarray(splits))
    weights["f0"] = np.asarray(w, np.float32)
    for name in plan.stacks:  # room for every ID: nothing raises, nothing drops
        plan = plan.with_stack_limits(name, max_ids_per_partition=512,
                                      max_unique_ids_per_partition=512)
    stats = assert_same(plan, inputs, weights)
    assert not isinstance(stats, Exception) and not any(stats.id_drop_counters.values()), stats


def test_flat_buffers_and_larger_batches() -> None:
    """No leading dimension, a weighted `sum`, and a batch with more IDs than the specs
    declare per row (a larger, power-of-two capacity): one more compiled program."""
    plan = PLANS["4x1"].with_config(allow_id_dropping=True)
    inputs, weights = _inputs(plan, 7, empty=0.0, duplicates=0.3, zipf=False, dense=False,
                              weighted=(*WEIGHTED, "f0"))
    long = np.arange(40) % 90
    f0 = inputs["f0"]
    values = np.concatenate([f0.values[:f0.row_splits[1]], long, f0.values[f0.row_splits[1]:]])
    splits = np.concatenate([f0.row_splits[:2], f0.row_splits[2:] + 40])
    inputs["f0"] = tc.Ragged(values, splits)  # row 1 holds 40 more IDs
    weights["f0"] = np.concatenate([weights["f0"][:f0.row_splits[1]], np.full(40, 0.5, np.float32),
                                    weights["f0"][f0.row_splits[1]:]])
    assert capacity(40, len(values)) == 128 > len(values)
    assert_same(plan, inputs, weights, has_leading_dimension=False)


def test_choice_of_side() -> None:
    plan = PLANS["1x4"]
    minibatching = plan.with_config(enable_minibatching=True)
    assert ops.resolve_preprocess_on("auto", plan) == "host"  # measured faster, GPUs too
    assert ops.resolve_preprocess_on("auto", minibatching) == "host"
    assert ops.resolve_preprocess_on("device", plan) == "device"
    with pytest.raises(ValueError, match="preprocess_on must be"):
        ops.resolve_preprocess_on("gpu", plan)  # type: ignore[arg-type]
    inputs, weights = _inputs(plan, 1, empty=0.0, duplicates=0.0, zipf=False, dense=True)
    with pytest.raises(ValueError, match="does not minibatch"):
        ops.preprocess_on_device(minibatching, inputs, weights)
    with pytest.warns(tc.IdDroppingWarning):
        batch, _ = ops.preprocess_batch(plan.with_config(allow_id_dropping=True), inputs, weights,
                                        preprocess_on="device")
    assert isinstance(batch.stacks[next(iter(plan.stacks))].gains, jax.Array)
    for bad in (0, -5, "x"):  # the host's setting, refused on the device side too
        with pytest.raises(ValueError, match="num_threads must be an integer >= 1"):
            ops.preprocess_batch(plan, inputs, weights, preprocess_on="device",
                                 num_threads=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("row_bits", [7, 31])
def test_sort_orders_by_segment_row_sample_stably(row_bits: int) -> None:
    """The packed one-key sort and the three-key one it falls back to past 64 bits
    (31 row bits + 26 sample bits + 9 segment bits) give the host's order."""
    from tilecore.ops._device_packing import StackStatic, _sort

    st = StackStatic(features=(), combiner=0, num_partitions=64, sc_per_device=4,
                     local_devices=1, slot=8, pointers=64, row_bits=row_bits, sample_bits=26)
    rng = np.random.default_rng(0)
    segment, row, sample = (rng.integers(0, k, 300).astype(np.int32) for k in (257, 100, 5))
    gain = np.arange(300, dtype=np.float32)  # the input order, to check stability
    with jax.enable_x64(True):
        got = [np.asarray(x) for x in jax.jit(_sort, static_argnums=0)(st, segment, row, sample,
                                                                        gain)]
    order = np.lexsort((sample, row, segment))  # stable: ties keep the input order
    for x, want in zip(got, (segment, row, sample, gain), strict=True):
        np.testing.assert_array_equal(x, want[order])
