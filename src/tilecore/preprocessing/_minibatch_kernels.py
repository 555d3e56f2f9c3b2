"""Compiled loops of minibatching (numba, GIL released).

Where one SparseCore's entries land is known only once every SparseCore (of every
process) has been counted, so they wait in sorted form, duplicates not merged:
`(partition << rowbits | row) << 26 | sample` (uint64), a float32 gain beside
when weighted. If some partition anywhere exceeds its limits, each distinct row
gets its bucket (`bucketize`, which also counts merged entries and rows per
(partition, bucket)), the counts give a 63-bit split (`split_mask`), and
`scatter_pack` merges the entries and writes each straight to its (minibatch,
partition, bucket) place in the device buffer. Where a segment exceeds a limit
even so, the entries are regrouped by (minibatch, partition, bucket)
(`order_by_minibatch`) and `pack` merges and writes them segment by segment,
dropping what is over the limits, as the reference does.
"""

from __future__ import annotations

import numpy as np

from .._numba import njit
from ._bucket_memo import UNKNOWN, known_bucket, remember_bucket
from ._highway import NUM_BUCKETS, hash_buckets
from ._kernels import SAMPLE_BITS, SUM
from ._packed import aligned, fill

_jit = njit(nogil=True, cache=True, error_model="numpy")
SPLIT_BITS = NUM_BUCKETS - 1
_NO_ENTRY = np.uint64(0xFFFFFFFFFFFFFFFF)


@_jit
def compact(eids, sids, gains, row_pointers, starts, ends, block):
    """Move one device's single-minibatch packings together.

    SparseCore `sc`'s packing, `ends[sc]` entries at `starts[sc]` with row pointers
    relative to its start in `row_pointers[sc·block:(sc+1)·block]`, moves to the
    8-aligned end of the previous one's; row pointers become absolute, gaps and
    the tail get filler and blocks past the last SparseCore repeat its end.
    """
    base = 0
    for sc in range(starts.shape[0]):
        src = starts[sc]
        end = ends[sc]
        if src > base:
            for j in range(end):
                eids[base + j] = eids[src + j]
                sids[base + j] = sids[src + j]
                gains[base + j] = gains[src + j]
        elif src < base:
            for j in range(end - 1, -1, -1):
                eids[base + j] = eids[src + j]
                sids[base + j] = sids[src + j]
                gains[base + j] = gains[src + j]
        if base:
            for j in range(sc * block, (sc + 1) * block):
                row_pointers[j] += base
        next_base = aligned(base + end)
        fill(eids, sids, gains, base + end, next_base)
        base = next_base
    fill(eids, sids, gains, base, eids.shape[0])
    for j in range(starts.shape[0] * block, row_pointers.shape[0]):
        row_pointers[j] = base


@_jit
def unpack(eids, sids, gains, row_pointers, num_partitions, rowbits, out_entries, out_gains):
    """The merged entries and gains read back from a slot `emit` packed dropping none.

    Partition p's entries end at `row_pointers[p]` and start at the previous end
    rounded up to 8 (slot-relative). Returns the number of entries written.
    """
    sb = np.uint64(SAMPLE_BITS)
    m = 0
    start = 0
    for p in range(num_partitions):
        end = row_pointers[p]
        prefix = np.uint64(p) << np.uint64(rowbits)
        for j in range(start, end):
            out_entries[m] = ((prefix | np.uint64(eids[j])) << sb) | np.uint64(sids[j])
            out_gains[m] = gains[j]
            m += 1
        start = aligned(end)
    return m


@_jit
def bucketize(entries, rowbits, log2n, state, memo, cols, row_counts, misses, miss_cols,
              miss_buckets, row_buckets, ids_pb, unique_pb):
    """Bucket of each distinct row of sorted entries, in order, into `row_buckets`,
    and the per-(partition, bucket) counts of merged entries `ids_pb` and distinct
    rows `unique_pb` (`[N, 64]`, accumulated). Returns the number of rows.

    Entries are sorted by row: one walk notes each row's column (`cols`) and merged
    entries (`row_counts`; equal entries count once). Then every row's memoised
    bucket is read in a loop of independent reads (the memo is large: its reads
    miss the cache, and overlap only so), and counted; the rows the memo does not
    know yet (`misses`, their columns `miss_cols`) are hashed together
    (`hash_buckets`) and remembered. `cols`, `row_counts`, `misses`, `miss_cols` and
    `miss_buckets` are scratch as long as `entries`.
    """
    rows = _rows(entries, rowbits, log2n, cols, row_counts)
    for r in range(rows):
        row_buckets[r] = known_bucket(memo, cols[r])
    partition_mask = (1 << log2n) - 1
    n_miss = 0
    for r in range(rows):
        if row_buckets[r] == UNKNOWN:
            misses[n_miss] = r
            miss_cols[n_miss] = cols[r]
            n_miss += 1
        else:
            p = cols[r] & partition_mask
            ids_pb[p, row_buckets[r]] += row_counts[r]
            unique_pb[p, row_buckets[r]] += 1
    if n_miss == 0:
        return rows
    hash_buckets(miss_cols[:n_miss], state, miss_buckets[:n_miss])
    for m in range(n_miss):
        r = misses[m]
        b = np.int64(miss_buckets[m])
        remember_bucket(memo, cols[r], b)
        row_buckets[r] = b
        p = cols[r] & partition_mask
        ids_pb[p, b] += row_counts[r]
        unique_pb[p, b] += 1
    return rows


@_jit
def _rows(entries, rowbits, log2n, cols, row_counts):
    """Each distinct row's column and merged entries (equal entries count once), in
    order, of sorted entries; returns the number of rows. (Duplicates come at random:
    they are counted without a branch.)"""
    sb = np.uint64(SAMPLE_BITS)
    row_mask = np.uint64((1 << rowbits) - 1)
    rb = np.uint64(rowbits)
    shift = np.uint64(log2n)
    rows = 0
    count = 0
    last = _NO_ENTRY
    for i in range(entries.shape[0]):
        x = entries[i]
        if x >> sb != last >> sb:
            if rows:
                row_counts[rows - 1] = count
            key = x >> sb
            cols[rows] = np.int64(((key & row_mask) << shift) | (key >> rb))
            rows += 1
            count = 0
        count += np.int64(x != last)
        last = x
    if rows:
        row_counts[rows - 1] = count
    return rows


@_jit
def _split_one(counts, limit):
    """The reference's tree walk over 64 bucket counts: bit k set where a node's
    subtrees together exceed `limit` (the node then keeps the larger subtree)."""
    values = counts.astype(np.int64)
    mask = np.uint64(0)
    bit = 0
    size = 2
    while size <= NUM_BUCKETS:
        half = size // 2
        for i in range(0, NUM_BUCKETS, size):
            total = values[i] + values[i + half]
            if total > limit:
                mask |= np.uint64(1) << np.uint64(bit)
                values[i] = max(values[i], values[i + half])
            else:
                values[i] = total
            bit += 1
        size *= 2
    return mask


@_jit
def split_mask(ids_pb, unique_pb, max_ids, max_unique):
    """OR of the splits of every partition's ids and unique counts."""
    mask = np.uint64(0)
    for p in range(ids_pb.shape[0]):
        mask |= _split_one(ids_pb[p], max_ids)
        mask |= _split_one(unique_pb[p], max_unique)
    return mask


def minibatch_of_buckets(mask: int) -> np.ndarray:
    """`[64]` minibatch index of each bucket under a split mask.

    Buckets form contiguous minibatches; the boundary between buckets i and i+1
    sits at the midpoint of exactly one tree node, and is a minibatch boundary
    exactly when that node's bit is set.
    """
    boundary = np.zeros(NUM_BUCKETS, bool)
    bit, size = 0, 2
    while size <= NUM_BUCKETS:
        for i in range(0, NUM_BUCKETS, size):
            boundary[i + size // 2] = bool((mask >> bit) & 1)
            bit += 1
        size *= 2
    return np.cumsum(boundary).astype(np.int64)


@_jit
def order_by_minibatch(entries, gains, has_weights, row_buckets, mb_of_bucket, num_minibatches,
                       rowbits, num_partitions, out_entries, out_gains):
    """Stable regroup of sorted entries by (minibatch, partition, bucket), each row's
    run of entries taking its bucket from `row_buckets`.

    A row's run moves whole, so duplicates stay together and `pack` merges them as
    it walks. Gains move with their entries when weighted.
    """
    n = entries.shape[0]
    sb = np.uint64(SAMPLE_BITS)
    part_shift = np.uint64(rowbits + SAMPLE_BITS)
    raw_pb = np.zeros((num_partitions, NUM_BUCKETS), np.int64)
    r = 0
    i = 0
    while i < n:
        key = entries[i] >> sb
        start = i
        while i < n and entries[i] >> sb == key:
            i += 1
        raw_pb[np.int64(entries[start] >> part_shift), row_buckets[r]] += i - start
        r += 1
    at_pb = np.empty((num_partitions, NUM_BUCKETS), np.int64)
    pos = 0
    for mb in range(num_minibatches):
        for p in range(num_partitions):
            for b in range(NUM_BUCKETS):
                if mb_of_bucket[b] == mb:
                    at_pb[p, b] = pos
                    pos += raw_pb[p, b]
    r = 0
    i = 0
    while i < n:
        key = entries[i] >> sb
        p = np.int64(entries[i] >> part_shift)
        b = row_buckets[r]
        r += 1
        at = at_pb[p, b]
        while i < n and entries[i] >> sb == key:
            out_entries[at] = entries[i]
            if has_weights:
                out_gains[at] = gains[i]
            at += 1
            i += 1
        at_pb[p, b] = at


@_jit
def scatter_pack(entries, gains, has_weights, sample_gains, combiner, row_buckets, mb_of_bucket,
                 num_minibatches, rowbits, ids_pb, base, eids, sids, out_gains, row_pointers,
                 block):
    """Merge sorted entries and write each where its segment puts it, for segments
    within the limits: `order_by_minibatch` then `pack` in one pass.

    Nothing is dropped, so each (minibatch, partition, bucket) group's place in the
    device buffer follows from its merged-entry count `ids_pb`: the layout (row
    pointers, filler) is written first, then every merged entry straight to its
    place, each row's run of entries to the place of its bucket (`row_buckets`).
    Returns (end position, overflow (merged entries past the buffer)), as `pack` does.
    """
    capacity = eids.shape[0]
    n_part = ids_pb.shape[0]
    at_pb = np.empty((n_part, NUM_BUCKETS), np.int64)
    pos = base
    for mb in range(num_minibatches):
        for p in range(n_part):
            start_p = aligned(pos)
            fill(eids, sids, out_gains, pos, start_p)
            pos = start_p
            for b in range(NUM_BUCKETS):
                if mb_of_bucket[b] == mb:
                    at_pb[p, b] = pos
                    pos += ids_pb[p, b]
            row_pointers[mb * block + p] = min(pos, capacity)
        end = min(aligned(pos), capacity)
        for p in range(n_part, block):
            row_pointers[mb * block + p] = end
    fill(eids, sids, out_gains, pos, aligned(pos))
    sb = np.uint64(SAMPLE_BITS)
    sample_mask = np.uint64((1 << SAMPLE_BITS) - 1)
    row_mask = np.uint64((1 << rowbits) - 1)
    part_shift = np.uint64(rowbits + SAMPLE_BITS)
    overflow = 0
    n = entries.shape[0]
    r = 0
    i = 0
    while i < n:
        key = entries[i] >> sb
        p = np.int64(entries[i] >> part_shift)
        b = row_buckets[r]
        r += 1
        at = at_pb[p, b]
        row = np.int32(key & row_mask)
        while i < n and entries[i] >> sb == key:
            x = entries[i]
            if has_weights:
                gain = gains[i]
            elif combiner == SUM:
                gain = np.float32(1.0)
            else:
                gain = sample_gains[np.int64(x & sample_mask)]
            step = gain
            i += 1
            while i < n and entries[i] == x:
                gain += gains[i] if has_weights else step
                i += 1
            if at >= capacity:
                overflow += 1
            else:
                eids[at] = row
                sids[at] = np.int32(x & sample_mask)
                out_gains[at] = gain
            at += 1
        at_pb[p, b] = at
    return pos, overflow


@_jit
def pack(entries, gains, has_weights, sample_gains, combiner, seg_counts, rowbits, max_ids,
         max_unique, base, write, eids, sids, out_gains, row_pointers, block):
    """Merge and write one SparseCore's sorted entries from `base`, (minibatch,
    partition) by segment, `seg_counts[mb, p]` merged entries each.

    Merged entries over a segment's limits are dropped in order, as the reference
    does: the running count of merged entries (kept or not) or of new rows has
    reached the limit. Each partition starts on a multiple of 8; the gaps hold
    filler. Row pointers (block `mb` of width `block`) are absolute exclusive ends,
    unused slots the last aligned end; positions past the buffer are not written
    and count as overflow. With `write` False only the size is computed. Returns
    (end position, dropped raw occurrences, overflow (merged entries past the buffer)).
    """
    capacity = eids.shape[0]
    sb = np.uint64(SAMPLE_BITS)
    sample_mask = np.uint64((1 << SAMPLE_BITS) - 1)
    row_mask = np.uint64((1 << rowbits) - 1)
    num_mb, n_part = seg_counts.shape
    n = entries.shape[0]
    i = 0
    pos = base
    dropped = 0
    overflow = 0
    for mb in range(num_mb):
        for p in range(n_part):
            start = aligned(pos)
            if write:
                fill(eids, sids, out_gains, pos, start)
            pos = start
            uniq = 0
            last_key = _NO_ENTRY
            for ids in range(1, seg_counts[mb, p] + 1):
                x = entries[i]
                if has_weights:
                    gain = gains[i]
                elif combiner == SUM:
                    gain = np.float32(1.0)
                else:
                    gain = sample_gains[np.int64(x & sample_mask)]
                step = gain
                raw = 1
                i += 1
                while i < n and entries[i] == x:
                    gain += gains[i] if has_weights else step
                    raw += 1
                    i += 1
                key = x >> sb
                if key != last_key:
                    uniq += 1
                    last_key = key
                if ids > max_ids or uniq > max_unique:
                    dropped += raw
                elif pos >= capacity:
                    overflow += 1
                    pos += 1
                else:
                    if write:
                        eids[pos] = np.int32(key & row_mask)
                        sids[pos] = np.int32(x & sample_mask)
                        out_gains[pos] = gain
                    pos += 1
            if write:
                row_pointers[mb * block + p] = min(pos, capacity)
        if write:
            end = min(aligned(pos), capacity)
            for p in range(n_part, block):
                row_pointers[mb * block + p] = end
    if write:
        fill(eids, sids, out_gains, pos, aligned(pos))
    return pos, dropped, overflow
