"""Minibatching's shortcuts agree bit for bit with the long way round.

Pass 1 lets its sorted entries go when the speculative packing holds them all
(`mk.unpack` reads them back, merged, if a split is needed), and pass 2 merges
sorted entries and writes segments within the limits straight to their places
(`mk.scatter_pack`) instead of regrouping (`order_by_minibatch`) and packing
(`pack`).
"""

from __future__ import annotations

import numpy as np
import pytest

from tilecore.preprocessing import _kernels as k
from tilecore.preprocessing import _minibatch_kernels as mk
from tilecore.preprocessing._highway import NUM_BUCKETS

ROWBITS = 9


def _sorted_entries(rng: np.random.Generator, n_part: int, size: int, dup_rate: float
                    ) -> np.ndarray:
    """Sorted `(partition << ROWBITS | row) << SAMPLE_BITS | sample` keys, some repeated."""
    keys = (rng.integers(0, n_part, size).astype(np.uint64) << np.uint64(ROWBITS)) | rng.integers(
        0, 1 << ROWBITS, size).astype(np.uint64)
    entries = (keys << np.uint64(k.SAMPLE_BITS)) | rng.integers(0, 64, size).astype(np.uint64)
    repeat = rng.random(size) < dup_rate
    entries = np.concatenate([entries, entries[repeat]])
    return np.sort(entries)


def _merged(entries: np.ndarray, gains: np.ndarray, weighted: bool, sample_gains: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """Distinct entries and their gains summed in order in float32 (the merge, spelled out)."""
    out_entries: list[int] = []
    out_gains: list[np.float32] = []
    for i, x in enumerate(entries):
        gain = gains[i] if weighted else sample_gains[int(x) & ((1 << k.SAMPLE_BITS) - 1)]
        if out_entries and out_entries[-1] == x:
            out_gains[-1] = np.float32(out_gains[-1] + gain)
        else:
            out_entries.append(int(x))
            out_gains.append(np.float32(gain))
    return np.array(out_entries, np.uint64), np.array(out_gains, np.float32)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_unpack_reads_back_the_merged_entries(weighted: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_part, combiner = 4, k.MEAN
    entries = _sorted_entries(rng, n_part, 700, dup_rate=0.3)
    gains = rng.uniform(0.5, 2, len(entries)).astype(np.float32) if weighted else np.zeros(
        0, np.float32)
    sample_gains = rng.uniform(0.1, 1, 64).astype(np.float32)
    slot = len(entries) + 8 * n_part
    eids, sids = np.zeros(slot, np.int32), np.zeros(slot, np.int32)
    out_gains, rows = np.zeros(slot, np.float32), np.zeros(8, np.int32)
    ids, unique = np.zeros(n_part, np.int64), np.zeros(n_part, np.int64)
    required, dropped, overflow = k.emit(
        entries, gains, weighted, sample_gains, combiner, ROWBITS, n_part, 10**6, 10**6, eids,
        sids, out_gains, rows, ids, unique, True)
    assert required > 0 and dropped == 0 and overflow == 0
    want_entries, want_gains = _merged(entries, gains, weighted, sample_gains)
    m = len(want_entries)
    assert m == ids.sum() < len(entries)  # duplicates were merged
    got_entries, got_gains = np.zeros(m, np.uint64), np.zeros(m, np.float32)
    assert mk.unpack(eids, sids, out_gains, rows, n_part, ROWBITS, got_entries, got_gains) == m
    np.testing.assert_array_equal(got_entries, want_entries)
    np.testing.assert_array_equal(got_gains.view(np.int32), want_gains.view(np.int32))


@pytest.mark.parametrize("capacity_share", [2.0, 0.6])  # roomy; entries past the buffer
@pytest.mark.parametrize(("weighted", "combiner"), [(True, k.SUM), (False, k.SQRTN),
                                                    (False, k.SUM)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scatter_pack_equals_regroup_then_pack(capacity_share: float, weighted: bool,
                                               combiner: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_part, block, base = 4, 8, 16
    entries = _sorted_entries(rng, n_part, 900, dup_rate=0.3)
    gains = rng.uniform(-1, 1, len(entries)).astype(np.float32) if weighted else np.zeros(
        0, np.float32)
    sample_gains = rng.uniform(0.1, 1, 64).astype(np.float32)
    keys = entries >> np.uint64(k.SAMPLE_BITS)
    rows, row_of_entry = np.unique(keys, return_inverse=True)
    row_buckets = (np.arange(len(rows)) * 7 % NUM_BUCKETS).astype(np.uint8)
    merged = np.concatenate([[True], entries[1:] != entries[:-1]])
    partitions = (entries >> np.uint64(ROWBITS + k.SAMPLE_BITS)).astype(np.int64)
    ids_pb = np.zeros((n_part, NUM_BUCKETS), np.int64)
    np.add.at(ids_pb, (partitions[merged], row_buckets[row_of_entry[merged]].astype(np.int64)), 1)
    mb_of_bucket = mk.minibatch_of_buckets(int(rng.integers(1, 1 << mk.SPLIT_BITS)))
    num_mb = int(mb_of_bucket[-1]) + 1
    capacity = base + int(merged.sum() * capacity_share)

    def buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (np.full(capacity, 5, np.int32), np.full(capacity, 5, np.int32),
                np.full(capacity, 5, np.float32), np.full(num_mb * block, -3, np.int32))

    g_entries, g_gains = np.zeros(len(entries), np.uint64), np.zeros(len(gains), np.float32)
    mk.order_by_minibatch(entries, gains, weighted, row_buckets, mb_of_bucket, num_mb, ROWBITS,
                          n_part, g_entries, g_gains)
    onehot = (mb_of_bucket[:, None] == np.arange(num_mb)[None, :]).astype(np.int64)
    seg_counts = np.ascontiguousarray((ids_pb @ onehot).T)
    want = buffers()
    want_end, dropped, want_overflow = mk.pack(
        g_entries, g_gains, weighted, sample_gains, combiner, seg_counts, ROWBITS, 10**6, 10**6,
        base, True, *want, block)
    got = buffers()
    got_end, got_overflow = mk.scatter_pack(
        entries, gains, weighted, sample_gains, combiner, row_buckets, mb_of_bucket, num_mb,
        ROWBITS, ids_pb, base, *got, block)
    assert dropped == 0 and (got_end, got_overflow) == (want_end, want_overflow)
    assert (want_overflow > 0) == (capacity_share < 1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.view(np.int32), w.view(np.int32))
