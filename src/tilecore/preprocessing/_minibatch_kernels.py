"""Compiled loops of minibatching (numba, GIL released).

With minibatching one SparseCore's sorted entries are first merged into a
persistent array (`merge`), because where they land is known only once every
SparseCore of the device has been counted. If some partition anywhere exceeds its
limits, each merged entry gets the bucket of its row (`bucketize`), the per-
(partition, bucket) counts give a 63-bit split (`split_mask`), and the entries
are regrouped by (minibatch, partition, bucket) (`order_by_minibatch`). `pack`
then walks the segments, applying limits per (partition, minibatch) and writing
the device buffer at absolute positions.

Merged entries keep the sorted-entry form `(partition << rowbits | row) << 26 | sample`
(uint64) with a float32 gain beside.
"""

from __future__ import annotations

import numpy as np

from .._numba import njit
from ._bucket_memo import known_bucket, remember_bucket
from ._highway import NUM_BUCKETS, hash_buckets
from ._kernels import SAMPLE_BITS, SUM
from ._packed import aligned, fill

_jit = njit(nogil=True, cache=True, error_model="numpy")
SPLIT_BITS = NUM_BUCKETS - 1


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
def merge(entries, gains, has_weights, sample_gains, combiner, rowbits, out_entries, out_gains,
          out_raw, ids_out, unique_out):
    """Merge duplicate (sample, row) entries, summing gains; count per partition.

    Returns the number of merged entries; `out_raw` gets the raw occurrences
    behind each (what a drop counts). `ids_out[p]`/`unique_out[p]` get the
    merged entries and distinct rows sent to partition p (nothing is dropped).
    """
    n = entries.shape[0]
    part_shift = np.uint64(rowbits + SAMPLE_BITS)
    sb = np.uint64(SAMPLE_BITS)
    sample_mask = np.uint64((1 << SAMPLE_BITS) - 1)
    i = 0
    m = 0
    last_key = np.uint64(0xFFFFFFFFFFFFFFFF)
    while i < n:
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
        p = np.int64(x >> part_shift)
        key = x >> sb
        if key != last_key:
            unique_out[p] += 1
            last_key = key
        ids_out[p] += 1
        out_entries[m] = x
        out_gains[m] = gain
        out_raw[m] = raw
        m += 1
    return m


@_jit
def unpack(eids, sids, gains, row_pointers, num_partitions, rowbits, out_entries, out_gains):
    """`merge`'s entries and gains read back from a slot `emit` packed dropping none.

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
def bucketize(entries, rowbits, log2n, state, memo, starts, misses, miss_buckets, buckets,
              ids_pb, unique_pb):
    """Bucket of each merged entry's row and the per-(partition, bucket) counts
    `ids_pb`/`unique_pb` (`[N, 64]`, accumulated).

    One walk: entries are sorted by row, so each distinct row's bucket is read once
    from `memo`; the rows it does not know yet are set aside (their column in
    `misses`, their first entry in `starts`), hashed together (`hash_buckets`) after
    the walk, remembered, and only their runs of entries walked again. `starts`,
    `misses` and `miss_buckets` are scratch as long as `entries`.
    """
    n = entries.shape[0]
    sb = np.uint64(SAMPLE_BITS)
    row_mask = np.uint64((1 << rowbits) - 1)
    rb = np.uint64(rowbits)
    shift = np.uint64(log2n)
    last_key = np.uint64(0xFFFFFFFFFFFFFFFF)
    b = np.int64(0)
    p = np.int64(0)
    n_miss = 0
    for i in range(n):
        key = entries[i] >> sb
        if key != last_key:
            last_key = key
            p = np.int64(key >> rb)
            col = np.int64(((key & row_mask) << shift) | (key >> rb))
            b = known_bucket(memo, col)
            if b >= 0:
                unique_pb[p, b] += 1
            else:
                misses[n_miss] = col
                starts[n_miss] = i
                n_miss += 1
        if b >= 0:
            buckets[i] = b
            ids_pb[p, b] += 1
    if n_miss == 0:
        return
    hash_buckets(misses[:n_miss], state, miss_buckets[:n_miss])
    for m in range(n_miss):
        b = np.int64(miss_buckets[m])
        remember_bucket(memo, misses[m], b)
        i = starts[m]
        key = entries[i] >> sb
        p = np.int64(key >> rb)
        unique_pb[p, b] += 1
        while i < n and entries[i] >> sb == key:
            buckets[i] = b
            ids_pb[p, b] += 1
            i += 1


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
def order_by_minibatch(entries, gains, raw, buckets, mb_of_bucket, num_minibatches, rowbits,
                       ids_pb, out_entries, out_gains, out_raw, seg_counts):
    """Stable regroup of merged entries by (minibatch, partition, bucket).

    `ids_pb` are this SparseCore's per-(partition, bucket) counts; `seg_counts`
    (`[M, N]`) receives each (minibatch, partition) segment's entry count.
    """
    n_part = ids_pb.shape[0]
    start = np.empty((n_part, NUM_BUCKETS), np.int64)
    pos = 0
    for mb in range(num_minibatches):
        for p in range(n_part):
            before = pos
            for b in range(NUM_BUCKETS):
                if mb_of_bucket[b] == mb:
                    start[p, b] = pos
                    pos += ids_pb[p, b]
            seg_counts[mb, p] = pos - before
    part_shift = np.uint64(rowbits + SAMPLE_BITS)
    for i in range(entries.shape[0]):
        p = np.int64(entries[i] >> part_shift)
        b = buckets[i]
        at = start[p, b]
        start[p, b] = at + 1
        out_entries[at] = entries[i]
        out_gains[at] = gains[i]
        out_raw[at] = raw[i]


@_jit
def scatter_pack(entries, gains, buckets, mb_of_bucket, num_minibatches, rowbits, ids_pb, base,
                 eids, sids, out_gains, row_pointers, block):
    """`order_by_minibatch` then `pack` in one pass, for segments within the limits.

    Nothing is dropped, so each (minibatch, partition, bucket) group's place in the
    device buffer follows from the counts `ids_pb`: the layout (row pointers,
    filler) is written first, then every merged entry straight to its place.
    Returns (end position, overflow (entries past the buffer)), as `pack` does.
    """
    capacity = eids.shape[0]
    n_part = ids_pb.shape[0]
    start = np.empty((n_part, NUM_BUCKETS), np.int64)
    pos = base
    for mb in range(num_minibatches):
        for p in range(n_part):
            start_p = aligned(pos)
            fill(eids, sids, out_gains, pos, start_p)
            pos = start_p
            for b in range(NUM_BUCKETS):
                if mb_of_bucket[b] == mb:
                    start[p, b] = pos
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
    for i in range(entries.shape[0]):
        x = entries[i]
        p = np.int64(x >> part_shift)
        b = buckets[i]
        at = start[p, b]
        start[p, b] = at + 1
        if at >= capacity:
            overflow += 1
        else:
            eids[at] = np.int32((x >> sb) & row_mask)
            sids[at] = np.int32(x & sample_mask)
            out_gains[at] = gains[i]
    return pos, overflow


@_jit
def pack(entries, gains, raw, seg_counts, rowbits, max_ids, max_unique, base, write, eids, sids,
         out_gains, row_pointers, block):
    """Write one SparseCore's segments from `base`, (minibatch, partition) by segment.

    Entries over a segment's limits are dropped in order, as the reference does:
    the running count of entries (kept or not) or of new rows has reached the limit.
    Each partition starts on a multiple of 8; the gaps hold filler. Row pointers
    (block `mb` of width `block`) are absolute exclusive ends, unused slots the last
    aligned end; positions past the buffer are not written and count as overflow.
    With `write` False only the size is computed. Returns
    (end position, dropped raw occurrences, overflow (merged entries past the buffer)).
    """
    capacity = eids.shape[0]
    sb = np.uint64(SAMPLE_BITS)
    sample_mask = np.uint64((1 << SAMPLE_BITS) - 1)
    row_mask = np.uint64((1 << rowbits) - 1)
    num_mb, n_part = seg_counts.shape
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
            last_key = np.uint64(0xFFFFFFFFFFFFFFFF)
            for ids in range(1, seg_counts[mb, p] + 1):
                x = entries[i]
                key = x >> sb
                if key != last_key:
                    uniq += 1
                    last_key = key
                if ids > max_ids or uniq > max_unique:
                    dropped += raw[i]
                elif pos >= capacity:
                    overflow += 1
                    pos += 1
                else:
                    if write:
                        eids[pos] = np.int32(key & row_mask)
                        sids[pos] = np.int32(x & sample_mask)
                        out_gains[pos] = gains[i]
                    pos += 1
                i += 1
            if write:
                row_pointers[mb * block + p] = min(pos, capacity)
        if write:
            end = min(aligned(pos), capacity)
            for p in range(n_part, block):
                row_pointers[mb * block + p] = end
    if write:
        fill(eids, sids, out_gains, pos, aligned(pos))
    return pos, dropped, overflow
