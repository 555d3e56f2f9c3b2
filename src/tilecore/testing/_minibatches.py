"""Reading and predicting the minibatching layout.

With `enable_minibatching` a stack's buffers hold, per device, segments packed
SparseCore-major then by minibatch; row-pointer block `sc·M + mb` (max(N, 8)
wide) holds absolute exclusive ends, and partition p of a block covers
`[roundup8(previous end), end[p])`. `unpack_minibatches` reads them back into
per-minibatch `Entries`; `minibatch_reference` predicts what they must hold from
the single-pass oracle, given the hash bucket of each row and the split.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..preprocessing import PreprocessedBatch, StackBuffers
from ..preprocessing._highway import BUCKET_KEY, NUM_BUCKETS, highway_hash64
from ..stacking import StackingPlan
from ._entries import DeviceSc, Entries

DeviceScMinibatch = tuple[int, int, int]
"""`(local device, SparseCore, minibatch)`."""


def _round_up8(value: int) -> int:
    return -(-value // 8) * 8


def row_bucket(partition: int, local_row: int, num_partitions: int) -> int:
    """The minibatching bucket of a row: HighwayHash64 of its stacked column ID
    (`local_row·N + partition`, 4 little-endian bytes) under the reference's key, mod 64."""
    col = np.array([local_row * num_partitions + partition], np.uint32).view(np.uint8)
    return int(highway_hash64(col, BUCKET_KEY)) % NUM_BUCKETS


def minibatch_of_buckets(split: int) -> np.ndarray:
    """`[64]` minibatch of each bucket for a 63-bit split: bit `offset(level) + j` set
    splits node j of that level (levels of 32, 16, …, 1 nodes) at its midpoint."""
    boundaries = np.zeros(NUM_BUCKETS, np.int64)
    bit, size = 0, 2
    while size <= NUM_BUCKETS:
        for start in range(0, NUM_BUCKETS, size):
            boundaries[start + size // 2] = (split >> bit) & 1
            bit += 1
        size *= 2
    return np.cumsum(boundaries)


def unpack_minibatched_stack(buffers: StackBuffers, plan: StackingPlan, num_minibatches: int
                             ) -> dict[DeviceScMinibatch, Entries]:
    """One stack's minibatching buffers → entries per (device, SparseCore, minibatch).

    Raises ValueError when row pointers run backwards, past the buffer, or
    segments overlap.
    """
    topo = plan.topology
    n, s_per, local = topo.num_partitions, topo.sc_per_device, topo.num_local_devices
    arrays = [np.asarray(a).reshape(local, -1) for a in (
        buffers.row_pointers, buffers.embedding_ids, buffers.sample_ids, buffers.gains)]
    pointers, eids, sids, gains = arrays
    block = max(n, 8)
    out: dict[DeviceScMinibatch, Entries] = {}
    for d in range(local):
        prev = 0
        for k in range(s_per * num_minibatches):
            blk = pointers[d, k * block:(k + 1) * block]
            parts, lo_hi = [], []
            for p in range(n):
                start, end = _round_up8(prev), int(blk[p])
                if not start <= end <= eids.shape[1]:
                    raise ValueError(
                        f"device {d}, row-pointer block {k}: partition {p} ends at {end}; "
                        f"expected in [{start}, {eids.shape[1]}] (block {blk.tolist()})."
                    )
                parts.append(np.full(end - start, p, np.int32))
                lo_hi.append((start, end))
                prev = end
            sc, mb = divmod(k, num_minibatches)
            out[d, sc, mb] = Entries(
                partition=np.concatenate(parts),
                local_row=np.concatenate([eids[d, a:b] for a, b in lo_hi]).astype(np.int32),
                sample=np.concatenate([sids[d, a:b] for a, b in lo_hi]).astype(np.int32),
                gain=np.concatenate([gains[d, a:b] for a, b in lo_hi]).astype(np.float32),
            )
    return out


def unpack_minibatches(batch: PreprocessedBatch, plan: StackingPlan
                       ) -> dict[str, dict[DeviceScMinibatch, Entries]]:
    """`{stack: {(device, sc, minibatch): Entries}}` of a minibatching batch."""
    return {name: unpack_minibatched_stack(b, plan, batch.num_minibatches)
            for name, b in batch.stacks.items()}


def split_into_minibatches(entries: Mapping[DeviceSc, Entries], split: int, num_partitions: int
                           ) -> dict[DeviceScMinibatch, Entries]:
    """Single-pass entries (sorted by partition, row, sample) → the minibatches a
    split makes: per partition, rows of the minibatch's buckets, ordered by
    (bucket, row, sample). No limits are applied."""
    mb_of = minibatch_of_buckets(split)
    num_mb = int(mb_of[-1]) + 1
    out: dict[DeviceScMinibatch, Entries] = {}
    for (d, sc), e in entries.items():
        buckets = np.array([row_bucket(int(p), int(r), num_partitions)
                            for p, r in zip(e.partition, e.local_row, strict=True)], np.int64)
        mbs = mb_of[buckets] if len(buckets) else buckets
        for mb in range(num_mb):
            keep = np.flatnonzero(mbs == mb)
            order = keep[np.lexsort((e.sample[keep], e.local_row[keep], buckets[keep],
                                     e.partition[keep]))]
            out[d, sc, mb] = Entries(e.partition[order], e.local_row[order], e.sample[order],
                                     e.gain[order])
    return out


def _tree_split(counts: np.ndarray, limit: int) -> int:
    values = [int(c) for c in counts]
    mask, bit, size = 0, 0, 2
    while size <= NUM_BUCKETS:
        for start in range(0, NUM_BUCKETS, size):
            left, right = values[start], values[start + size // 2]
            if left + right > limit:
                mask |= 1 << bit
                values[start] = max(left, right)
            else:
                values[start] = left + right
            bit += 1
        size *= 2
    return mask


def reference_split(merged: Mapping[DeviceSc, Entries], max_ids: int, max_unique: int,
                    num_partitions: int) -> int:
    """The 63-bit split one stack asks for, from its single-pass merged entries.

    Per (SparseCore, partition), the reference's tree walk over the 64 buckets'
    entry counts (against `max_ids`) and distinct-row counts (against
    `max_unique`), all OR-ed. Callers OR the splits of every stack and process.
    """
    mask = 0
    for e in merged.values():
        for p in range(num_partitions):
            in_p = e.partition == p
            ids = np.zeros(NUM_BUCKETS, np.int64)
            unique = np.zeros(NUM_BUCKETS, np.int64)
            for r in e.local_row[in_p]:
                ids[row_bucket(p, int(r), num_partitions)] += 1
            for r in np.unique(e.local_row[in_p]):
                unique[row_bucket(p, int(r), num_partitions)] += 1
            mask |= _tree_split(ids, max_ids) | _tree_split(unique, max_unique)
    return mask


def bucket_maxima(merged: Mapping[DeviceSc, Entries], num_partitions: int) -> tuple[int, int]:
    """Most entries and distinct rows any (SparseCore, partition, bucket) holds.

    These are the tightest limits minibatching can meet without dropping: with
    them every partition that holds more than one bucket's load must be split.
    """
    ids: dict[tuple, int] = {}
    rows: dict[tuple, set[int]] = {}
    for key, e in merged.items():
        for p, r in zip(e.partition, e.local_row, strict=True):
            k = (key, int(p), row_bucket(int(p), int(r), num_partitions))
            ids[k] = ids.get(k, 0) + 1
            rows.setdefault(k, set()).add(int(r))
    return max(ids.values(), default=1), max((len(v) for v in rows.values()), default=1)
