"""Minibatching's shortcuts agree bit for bit with the long way round.

Pass 1 lets its sorted entries go when the speculative packing holds them all
(`mk.unpack` reads them back if a split is needed), and pass 2 writes segments
within the limits straight from merged order (`mk.scatter_pack`) instead of
regrouping (`order_by_minibatch`) and packing (`pack`).
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


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_unpack_reads_back_what_merge_gives(weighted: bool, seed: int) -> None:
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
    want_entries, want_gains = np.zeros(len(entries), np.uint64), np.zeros(len(entries), np.float32)
    m = mk.merge(entries, gains, weighted, sample_gains, combiner, ROWBITS, want_entries,
                 want_gains, np.zeros(len(entries), np.int32), np.zeros(n_part, np.int64),
                 np.zeros(n_part, np.int64))
    assert m == ids.sum() < len(entries)  # duplicates were merged
    got_entries, got_gains = np.zeros(m, np.uint64), np.zeros(m, np.float32)
    assert mk.unpack(eids, sids, out_gains, rows, n_part, ROWBITS, got_entries, got_gains) == m
    np.testing.assert_array_equal(got_entries, want_entries[:m])
    np.testing.assert_array_equal(got_gains.view(np.int32), want_gains[:m].view(np.int32))


@pytest.mark.parametrize("capacity_share", [2.0, 0.6])  # roomy; entries past the buffer
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scatter_pack_equals_regroup_then_pack(capacity_share: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_part, block, base = 4, 8, 16
    entries = np.unique(_sorted_entries(rng, n_part, 900, dup_rate=0))  # merged: no repeats
    size = len(entries)
    gains = rng.uniform(-1, 1, size).astype(np.float32)
    raw = rng.integers(1, 4, size).astype(np.int32)
    keys = entries >> np.uint64(k.SAMPLE_BITS)
    buckets = (np.unique(keys, return_inverse=True)[1] * 7 % NUM_BUCKETS).astype(np.uint8)
    partitions = (entries >> np.uint64(ROWBITS + k.SAMPLE_BITS)).astype(np.int64)
    ids_pb = np.zeros((n_part, NUM_BUCKETS), np.int64)
    np.add.at(ids_pb, (partitions, buckets.astype(np.int64)), 1)
    mb_of_bucket = mk.minibatch_of_buckets(int(rng.integers(1, 1 << mk.SPLIT_BITS)))
    num_mb = int(mb_of_bucket[-1]) + 1
    capacity = base + int(size * capacity_share)

    def buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (np.full(capacity, 5, np.int32), np.full(capacity, 5, np.int32),
                np.full(capacity, 5, np.float32), np.full(num_mb * block, -3, np.int32))

    g_entries, g_gains, g_raw = (np.zeros(size, np.uint64), np.zeros(size, np.float32),
                                 np.zeros(size, np.int32))
    seg_counts = np.zeros((num_mb, n_part), np.int64)
    mk.order_by_minibatch(entries, gains, raw, buckets, mb_of_bucket, num_mb, ROWBITS, ids_pb,
                          g_entries, g_gains, g_raw, seg_counts)
    want = buffers()
    want_end, dropped, want_overflow = mk.pack(
        g_entries, g_gains, g_raw, seg_counts, ROWBITS, 10**6, 10**6, base, True, want[0],
        want[1], want[2], want[3], block)
    got = buffers()
    got_end, got_overflow = mk.scatter_pack(entries, gains, buckets, mb_of_bucket, num_mb,
                                            ROWBITS, ids_pb, base, got[0], got[1], got[2], got[3],
                                            block)
    assert dropped == 0 and (got_end, got_overflow) == (want_end, want_overflow)
    assert (want_overflow > 0) == (capacity_share < 1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.view(np.int32), w.view(np.int32))
