"""Minibatching in host preprocessing: hash buckets, split, layout, agreement.

Bit-exact against golden outputs of the reference system
(tests/fixtures/reference/minibatching, from tools/make_reference_fixtures.py),
and property-checked against the single-pass numpy oracle.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tilecore as tc
from test_reference_fixtures import assert_stats_equal, build_plan, inputs_of
from test_reference_fixtures import load as load_fixture
from tilecore.preprocessing import Agreement, LimitExceededError, LocalAgreement
from tilecore.preprocessing._highway import BUCKET_KEY, highway_hash64
from tilecore.testing import (
    bucket_maxima,
    preprocess_reference,
    reference_split,
    row_bucket,
    split_into_minibatches,
    unpack_minibatches,
)

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "reference" / "minibatching"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
FILLER = 2**31 - 1


def load(case: str) -> tuple[dict, dict[str, np.ndarray]]:
    return load_fixture(case, FIXTURES)


def fixture_plan(spec: dict) -> tc.StackingPlan:
    plan = build_plan(spec)
    stacks = {
        name: dataclasses.replace(stack, suggested_coo_buffer_size_per_device=spec[
            "result_stacking"]["stacks"][name]["suggested_coo_buffer_size_per_device"])
        for name, stack in plan.stacks.items()
    }
    return dataclasses.replace(plan, stacks=stacks).with_config(enable_minibatching=True)


# Published HighwayHash64 vectors: key 00..1f, data 00..(n-1).
_TEST_KEY = np.array([0x0706050403020100, 0x0F0E0D0C0B0A0908, 0x1716151413121110,
                      0x1F1E1D1C1B1A1918], np.uint64)
_VECTORS = {0: 0x907A56DE22C26E53, 1: 0x7EAB43AAC7CDDD78, 3: 0x5C6BEFAB8A463D80,
            4: 0xF205A46893007EDA, 20: 0x38AD9B1141D3DD16, 33: 0x2C90F73CA03181FC,
            64: 0x75542C5D4CD2A6FF}


@pytest.mark.parametrize("size", sorted(_VECTORS))
def test_highway_hash64_matches_published_vectors(size: int) -> None:
    data = np.arange(size, dtype=np.uint8)
    assert int(highway_hash64(data, _TEST_KEY)) == _VECTORS[size]


def test_highway_hash64_second_key_vector() -> None:
    data = (128 + np.arange(33)).astype(np.uint8)
    key = np.array([1, 2, 3, 4], np.uint64)
    assert int(highway_hash64(data, key)) == 0x53C516CCE478CAD7


def test_bucket_kernel_matches_byte_hash() -> None:
    from tilecore.preprocessing._highway import bucket_state, buckets

    cols = np.random.default_rng(0).integers(0, 2**31, 200)
    expected = [int(highway_hash64(np.array([c], np.uint32).view(np.uint8), BUCKET_KEY)) & 63
                for c in cols]
    np.testing.assert_array_equal(buckets(cols, bucket_state()), expected)


def test_bucketize_reads_what_the_hash_gives() -> None:
    """Each distinct row of sorted entries gets its hashed bucket and the per-(partition,
    bucket) counts add up (repeated entries count once, as merged), whether the memo
    knows the row (the second call), not yet (the first) or never (columns past the
    memo, hashed every time); misses are remembered, columns past the memo are not."""
    from tilecore.preprocessing import _minibatch_kernels as mk
    from tilecore.preprocessing._bucket_memo import UNKNOWN
    from tilecore.preprocessing._highway import NUM_BUCKETS, bucket_state, buckets
    from tilecore.preprocessing._kernels import SAMPLE_BITS

    rng = np.random.default_rng(3)
    rowbits, log2n = 12, 2  # 4 partitions; columns row·4 + partition, up to 16383
    part, row = rng.integers(0, 4, 3000), rng.integers(0, 1500, 3000)
    sample = rng.integers(0, 64, 3000)
    merged = np.unique((((part << rowbits) | row) << SAMPLE_BITS) | sample).astype(np.uint64)
    entries = np.sort(np.concatenate([merged, merged[rng.random(len(merged)) < 0.3]]))
    key = merged >> np.uint64(SAMPLE_BITS)
    partition = (key >> np.uint64(rowbits)).astype(np.int64)
    cols = ((key & np.uint64((1 << rowbits) - 1)).astype(np.int64) << log2n) | partition
    expected = buckets(cols, bucket_state())
    memo = np.full(4096, UNKNOWN, np.uint8)  # some columns lie past it
    state = np.array(bucket_state(), np.uint64)
    want_ids = np.zeros((4, NUM_BUCKETS), np.int64)
    np.add.at(want_ids, (partition, expected), 1)
    first = np.concatenate([[True], key[1:] != key[:-1]])
    want_unique = np.zeros((4, NUM_BUCKETS), np.int64)
    np.add.at(want_unique, (partition[first], expected[first]), 1)
    for _ in range(2):
        got = np.full(len(entries), 99, np.uint8)
        ids_pb, unique_pb = np.zeros((4, NUM_BUCKETS), np.int64), np.zeros((4, NUM_BUCKETS),
                                                                           np.int64)
        scratch = [np.empty(len(entries), np.int64) for _ in range(5)]
        rows = mk.bucketize(entries, rowbits, log2n, state, memo, *scratch, got, ids_pb,
                            unique_pb)
        assert rows == first.sum()
        np.testing.assert_array_equal(got[:rows], expected[first])
        np.testing.assert_array_equal(ids_pb, want_ids)
        np.testing.assert_array_equal(unique_pb, want_unique)
        inside = cols < 4096
        np.testing.assert_array_equal(memo[cols[inside]], expected[inside])
        assert (memo != UNKNOWN).sum() == len(np.unique(cols[inside]))
        assert (~inside).any() and inside.any()


@pytest.mark.parametrize("case", CASES)
def test_minibatched_buffers_match_reference(case: str, recwarn: pytest.WarningsRecorder) -> None:
    spec, arrays = load(case)
    plan = fixture_plan(spec)
    batch, stats = tc.preprocess(plan, inputs_of(spec, arrays), has_leading_dimension=False)
    assert batch.num_minibatches == spec["num_minibatches"]
    topo = plan.topology
    block = max(topo.num_partitions, 8)
    used = topo.sc_per_device * batch.num_minibatches * block
    for name in spec["stack_order"]:
        ours = batch.stacks[name]
        want_rows = arrays[f"out/{name}/row_pointers"].reshape(topo.num_local_devices, -1)
        rows = ours.row_pointers.reshape(topo.num_local_devices, -1)
        np.testing.assert_array_equal(rows[:, :used], want_rows[:, :used])
        covered, filler = arrays[f"out/{name}/covered"], arrays[f"out/{name}/filler"]
        for field in ("embedding_ids", "sample_ids", "gains"):
            got, want = getattr(ours, field), arrays[f"out/{name}/{field}"]
            assert got.shape == want.shape and got.dtype == want.dtype, field
            np.testing.assert_array_equal(got[covered], want[covered], err_msg=f"{name}.{field}")
        # Filler between partitions and after the last segment; unused blocks repeat the end.
        assert np.all(ours.embedding_ids[~covered] == FILLER)
        assert np.all(ours.sample_ids[~covered] == FILLER)
        assert np.all(np.isnan(ours.gains[~covered]))
        assert filler.sum() <= (~covered).sum()
        for d in range(topo.num_local_devices):
            assert np.all(rows[d, used:] == -(-rows[d, used - 1] // 8) * 8)
        assert_stats_equal(stats, spec["stats"][name], name)
    assert bool(recwarn.list) == any(stats.id_drop_counters.values())


def test_buffer_sizes_with_minibatching() -> None:
    spec, _ = load("mb_t1x2_forced")
    plan = fixture_plan(spec)
    stack = next(iter(plan.stacks.values()))
    size = tc.preprocessing.coo_buffer_size_per_device(stack, plan.topology,
                                                       enable_minibatching=True)
    assert size == 64 * tc.preprocessing.coo_buffer_size_per_device(stack, plan.topology)
    assert spec["buffer_sizes"]["t"]["coo_size_per_device"] == size
    assert spec["buffer_sizes"]["t"]["row_pointers_size_per_device"] == (
        tc.preprocessing.row_pointers_size_per_device(plan.topology, enable_minibatching=True))


def test_single_bucket_over_limit_raises_naming_bucket() -> None:
    spec, arrays = load("mb_drop_single_bucket")
    plan = fixture_plan(spec).with_config(allow_id_dropping=False)
    with pytest.raises(LimitExceededError, match=r"bucket \d+ alone") as info:
        tc.preprocess(plan, inputs_of(spec, arrays))
    error = info.value
    assert error.stack == "t" and error.bucket is not None and error.observed > error.allowed
    # The named bucket really holds a row of that partition.
    ref = preprocess_reference(plan, inputs_of(spec, arrays)).stacks["t"]
    rows = {int(r) for e in ref.merged.values() for p, r in zip(e.partition, e.local_row,
                                                                 strict=True)
            if p == error.partition}
    assert error.bucket in {row_bucket(error.partition, r, plan.topology.num_partitions)
                            for r in rows}


class _RecordingAgreement:
    """An agreement whose peers contribute fixed values (and that records calls)."""

    def __init__(self, peer_required: int = 0, peer_split: int = 0) -> None:
        self.peer = {"required": peer_required, "split": peer_split, "failed": 0}
        self.calls: list[tuple[int, str, int]] = []

    @property
    def process_count(self) -> int:
        return 2

    def all_reduce_or(self, batch_number: int, round: str, value: int) -> int:
        self.calls.append((batch_number, round, value))
        return value | self.peer[round]


def _small_plan(max_ids: int = 256, **config: object) -> tuple[tc.StackingPlan, dict]:
    table = tc.TableSpec(name="t", vocab_size=512, embedding_dim=8, optimizer=tc.SGD(),
                         max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_ids)
    feature = tc.FeatureSpec(name="f", table=table, input_shape=(32, 4), output_shape=(32, 8))
    plan = tc.stack_tables([feature], tc.Topology(global_devices=1, sc_per_device=2),
                           config=tc.SparseCoreConfig(enable_minibatching=True, **config))
    rng = np.random.default_rng(1)
    return plan, {"f": rng.integers(0, 512, (32, 4))}


def test_peer_requirement_and_split_are_applied() -> None:
    plan, inputs = _small_plan()
    agreement = _RecordingAgreement(peer_required=1, peer_split=1 << 62)
    assert isinstance(agreement, Agreement)
    batch, _ = tc.preprocess(plan, inputs, batch_number=7, agreement=agreement)
    assert agreement.calls == [(7, "required", 0), (7, "split", 0), (7, "failed", 0)]
    assert batch.num_minibatches == 2  # the root split: buckets 0-31 | 32-63
    parts = unpack_minibatches(batch, plan)["t"]
    for (_, _, mb), e in parts.items():
        for p, r in zip(e.partition, e.local_row, strict=True):
            assert (row_bucket(int(p), int(r), plan.topology.num_partitions) >= 32) == (mb == 1)


def test_a_peer_failure_stops_this_process_too() -> None:
    plan, inputs = _small_plan()
    agreement = _RecordingAgreement(peer_required=1, peer_split=1 << 62)
    agreement.peer["failed"] = 1  # a peer's bucket exceeded its limits
    with pytest.raises(tc.preprocessing.PeerPreprocessingError, match="Batch 3: another process"):
        tc.preprocess(plan, inputs, batch_number=3, agreement=agreement)
    assert agreement.calls[-1] == (3, "failed", 0)


def test_not_required_asks_only_once_and_keeps_one_minibatch() -> None:
    plan, inputs = _small_plan()
    agreement = _RecordingAgreement()
    batch, stats = tc.preprocess(plan, inputs, agreement=agreement)
    assert agreement.calls == [(0, "required", 0)]
    assert batch.num_minibatches == 1
    single = preprocess_reference(plan, inputs).stacks["t"].kept
    got = unpack_minibatches(batch, plan)["t"]
    for (d, sc), e in single.items():
        assert got[d, sc, 0].bit_equal(e), got[d, sc, 0].describe_difference(e)
    assert stats.dropped_ids == 0


def test_multi_process_plan_needs_an_agreement() -> None:
    table = tc.TableSpec(name="t", vocab_size=64, embedding_dim=8, optimizer=tc.SGD())
    feature = tc.FeatureSpec(name="f", table=table, input_shape=(16, 2), output_shape=(16, 8))
    plan = tc.stack_tables([feature], tc.Topology(global_devices=2, local_devices=1,
                                                  sc_per_device=2),
                           config=tc.SparseCoreConfig(enable_minibatching=True))
    inputs = {"f": np.zeros((8, 2), np.int64)}
    with pytest.raises(ValueError, match=r"tilecore\.distributed"):
        tc.preprocess(plan, inputs)
    with pytest.raises(ValueError, match=r"spans 2 process\(es\) but the agreement"):
        tc.preprocess(plan, inputs, agreement=LocalAgreement())  # would hang its collectives
    with pytest.raises(TypeError, match="Agreement"):
        tc.preprocess(plan, inputs, agreement=object())  # type: ignore[arg-type]


@st.composite
def _skewed_cases(draw: st.DrawFn) -> tuple[tc.StackingPlan, dict, dict]:
    sc = draw(st.sampled_from([1, 2, 4]))
    devices = draw(st.sampled_from([1, 2]))
    n = sc * devices
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    weighted = draw(st.booleans())
    combiner = draw(st.sampled_from(["sum", "mean", "sqrtn"]))
    tables = [tc.TableSpec(name=f"t{i}", vocab_size=int(v), embedding_dim=8, optimizer=tc.SGD(),
                           combiner=combiner)
              for i, v in enumerate(rng.integers(200, 3000, 2))]
    batch = 32 * n
    features = [tc.FeatureSpec(name=f"f{i}", table=t, input_shape=(batch, 6),
                               output_shape=(batch, 8)) for i, t in enumerate(tables)]
    plan = tc.stack_tables(features, tc.Topology(global_devices=devices, sc_per_device=sc),
                           config=tc.SparseCoreConfig(enable_minibatching=True))
    inputs, weights = {}, {}
    for f in features:
        # Many distinct rows per partition: limits of one bucket's load force splits.
        ids = rng.integers(0, f.table.vocab_size, (batch, 6))
        if weighted:
            weights[f.name] = rng.uniform(0.5, 2.0, (batch, 6)).astype(np.float32)
        inputs[f.name] = ids
    return plan, inputs, weights


@settings(max_examples=10, deadline=None)
@given(_skewed_cases())
def test_minibatches_partition_the_single_pass_result(case: tuple) -> None:
    plan, inputs, weights = case
    n = plan.topology.num_partitions
    reference = preprocess_reference(plan.with_config(enable_minibatching=False), inputs,
                                     weights)
    # Limits as tight as a single bucket allows: every partition must be split.
    for name in plan.stacks:
        max_ids, max_unique = bucket_maxima(reference.stacks[name].merged, n)
        plan = plan.with_stack_limits(name, max_ids_per_partition=max_ids,
                                      max_unique_ids_per_partition=max_unique)
    batch, stats = tc.preprocess(plan, inputs, weights, num_threads=2)
    assert batch.num_minibatches >= 5
    split, expected = _expected_minibatches(plan, inputs, weights)
    assert batch.num_minibatches == bin(split).count("1") + 1
    got = unpack_minibatches(batch, plan)
    n = plan.topology.num_partitions
    for name, stack in plan.stacks.items():
        ref = reference.stacks[name]
        np.testing.assert_array_equal(stats.max_ids_per_partition[name],
                                      ref.max_ids_per_partition)
        assert stats.id_drop_counters[name] == 0
        for (d, sc), single in ref.merged.items():
            parts = [got[name][d, sc, mb] for mb in range(batch.num_minibatches)]
            for mb, part in enumerate(parts):
                assert part.bit_equal(expected[name][d, sc, mb]), (name, d, sc, mb)
            # Union == single pass (same rows, samples, gains), in (partition, row, sample) order.
            union = tc.testing.Entries(*(np.concatenate([getattr(p, f) for p in parts])
                                         for f in ("partition", "local_row", "sample", "gain")))
            order = np.lexsort((union.sample, union.local_row, union.partition))
            union = tc.testing.Entries(union.partition[order], union.local_row[order],
                                       union.sample[order], union.gain[order])
            assert union.bit_equal(single), union.describe_difference(single)
            # Every row lives in exactly one minibatch; every minibatch fits the limits.
            owner: dict[tuple[int, int], int] = {}
            for mb, part in enumerate(parts):
                for p, r in zip(part.partition, part.local_row, strict=True):
                    assert owner.setdefault((int(p), int(r)), mb) == mb
                counts = np.bincount(part.partition, minlength=n)
                assert counts.max(initial=0) <= stack.max_ids_per_partition
                rows = {(int(p), int(r)) for p, r in zip(part.partition, part.local_row,
                                                         strict=True)}
                uniq = np.bincount([p for p, _ in rows], minlength=n) if rows else np.zeros(n)
                assert uniq.max(initial=0) <= stack.max_unique_ids_per_partition
    # One split for every stack: each stack's buckets map to minibatches the same way.
    owners: dict[int, int] = {}
    for name in plan.stacks:
        for (_, _, mb), part in got[name].items():
            for p, r in zip(part.partition, part.local_row, strict=True):
                assert owners.setdefault(row_bucket(int(p), int(r), n), mb) == mb


def _expected_minibatches(plan: tc.StackingPlan, inputs: dict, weights: dict | None = None
                          ) -> tuple[int, dict]:
    """(split, {stack: {(d, sc, mb): Entries}}) predicted from the single-pass oracle."""
    n = plan.topology.num_partitions
    unlimited = plan.with_config(enable_minibatching=False)
    for name in plan.stacks:
        unlimited = unlimited.with_stack_limits(name, max_ids_per_partition=10**6,
                                                max_unique_ids_per_partition=10**6)
    reference = preprocess_reference(unlimited, inputs, weights)
    split = 0
    for name, stack in plan.stacks.items():
        split |= reference_split(reference.stacks[name].merged, stack.max_ids_per_partition,
                                 stack.max_unique_ids_per_partition, n)
    return split, {name: split_into_minibatches(reference.stacks[name].merged, split, n)
                   for name in plan.stacks}


@pytest.mark.parametrize("case", ["mb_t1x2_forced", "mb_two_stacks_featstack",
                                  "mb_t2x4_l2_weighted_mean"])
def test_oracle_predicts_reference_minibatches(case: str) -> None:
    spec, arrays = load(case)
    plan = fixture_plan(spec)
    inputs = inputs_of(spec, arrays)
    batch, _ = tc.preprocess(plan, inputs)
    split, expected = _expected_minibatches(plan, inputs)
    assert batch.num_minibatches == bin(split).count("1") + 1 == spec["num_minibatches"]
    got = unpack_minibatches(batch, plan)
    for name, parts in expected.items():
        assert parts.keys() == got[name].keys()
        for key, e in parts.items():
            assert got[name][key].bit_equal(e), (name, key, got[name][key].describe_difference(e))


def _expected_single_minibatch(plan: tc.StackingPlan, inputs: dict, weights: dict,
                               stack: str, shape: tuple[int, int, int]) -> dict[str, np.ndarray]:
    """The minibatching layout of one untriggered minibatch, built from the oracle:
    per device, SparseCore segments back to back, partitions 8-aligned, row
    pointers absolute, filler everywhere else."""
    topo = plan.topology
    s, n = topo.sc_per_device, topo.num_partitions
    local, coo, rows = shape
    block = rows // (64 * s)
    eids = np.full((local, coo), FILLER, np.int32)
    sids = np.full((local, coo), FILLER, np.int32)
    gains = np.full((local, coo), np.nan, np.float32)
    rp = np.zeros((local, rows), np.int32)
    merged = preprocess_reference(plan.with_config(enable_minibatching=False), inputs,
                                  weights).stacks[stack].merged
    for d in range(local):
        pos = 0
        for sc in range(s):
            e = merged[d, sc]
            for p in range(n):
                pos = (pos + 7) & ~7
                at = np.flatnonzero(e.partition == p)
                eids[d, pos:pos + len(at)] = e.local_row[at]
                sids[d, pos:pos + len(at)] = e.sample[at]
                gains[d, pos:pos + len(at)] = e.gain[at]
                pos += len(at)
                rp[d, sc * block + p] = pos
            pos = (pos + 7) & ~7
            rp[d, sc * block + n:(sc + 1) * block] = pos
        rp[d, s * block:] = pos
    return {"embedding_ids": eids, "sample_ids": sids, "gains": gains, "row_pointers": rp}


@settings(max_examples=8, deadline=None)
@given(sc=st.sampled_from([1, 2, 4]), devices=st.sampled_from([1, 2]), skewed=st.booleans(),
       combiner=st.sampled_from(["sum", "mean"]), threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31))
def test_untriggered_buffers_match_oracle_layout(sc: int, devices: int, skewed: bool,
                                                 combiner: str, threads: int, seed: int) -> None:
    """Pass 1 packs each SparseCore into its slot and moves the slots together; a
    SparseCore larger than its slot (`skewed`: a device-wide buffer sized to the
    batch, one SparseCore holding most entries) is packed from the merged entries."""
    from tilecore.preprocessing import _minibatching

    rng = np.random.default_rng(seed)
    table = tc.TableSpec(name="t", vocab_size=4096, embedding_dim=8, optimizer=tc.SGD(),
                         combiner=combiner, max_ids_per_partition=4096,
                         max_unique_ids_per_partition=4096)
    batch = 16 * sc * devices
    feature = tc.FeatureSpec(name="f", table=table, input_shape=(batch, 5),
                             output_shape=(batch, 8))
    plan = tc.stack_tables([feature], tc.Topology(global_devices=devices, sc_per_device=sc),
                           config=tc.SparseCoreConfig(enable_minibatching=True))
    ids = rng.integers(0, 4096, (batch, 5))
    if skewed:  # all but the first SparseCore of each device see one ID only
        per_sc = batch // (sc * devices)
        for slice_index in range(sc * devices):
            if slice_index % sc:
                ids[slice_index * per_sc:(slice_index + 1) * per_sc] = 7
    inputs, weights = {"f": ids}, {"f": rng.uniform(0.5, 2, (batch, 5)).astype(np.float32)}
    _, stats = tc.preprocess(plan, inputs, weights)
    need = int(stats.required_buffer_size_per_sc["t"].sum(1).max())
    plan = plan.with_stack_limits("t", suggested_coo_buffer_size_per_device=need)
    merges = []
    real_merge = _minibatching._entries_of
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_minibatching, "_entries_of", lambda *a: merges.append(1) or real_merge(*a))
        out, stats = tc.preprocess(plan, inputs, weights, num_threads=threads)
    assert out.num_minibatches == 1 and stats.dropped_ids == 0
    slot = plan.stacks["t"].suggested_coo_buffer_size_per_device
    slot = -(-slot // (8 * sc)) * 8  # the device buffer rounded up to 8·S, per SparseCore
    if skewed and sc > 1:  # the first SparseCore overflows its slot: packed from merged entries
        assert merges
    elif int(stats.required_buffer_size_per_sc["t"].max()) <= slot:
        assert not merges  # every slot fits: only moved together
    got = out.stacks["t"]
    shape = (*got.embedding_ids.shape, got.row_pointers.shape[1])
    expected = _expected_single_minibatch(plan, inputs, weights, "t", shape)
    for name, want in expected.items():
        np.testing.assert_array_equal(getattr(got, name).view(np.int32), want.view(np.int32),
                                      err_msg=name)
