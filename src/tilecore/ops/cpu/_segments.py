"""Walking one device's packed buffers as sorted runs, one run per (SparseCore, partition).

Preprocessing writes each SparseCore's entries of a partition sorted by (local
row, sample). So the gradient of a row is a segmented sum: the equal-row
entries of the partition's runs (one per SparseCore of the device), read
front to back. No sort, no scatter, no atomics; the row is finished (and its
optimizer step can be applied) as soon as its last entry is read. These helpers
find the runs, check that they are sorted (a batch built by hand may not be:
the fused kernels then aggregate that partition by sorting it), and produce
the rows one at a time. The runs come from `preprocessing._packed.run_bounds`
(the layout's one reader). Like every kernel here they never raise: pointers
are clipped to the buffer and entries outside their shard or SparseCore skipped.
"""

from __future__ import annotations

import numpy as np

from ..._numba import njit
from ._kernels import entry_in_range
from ._vector import add_scaled

_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)

PREFETCH_DISTANCE = 8
"""Entries ahead of the current one whose row `upcoming_row` names, for prefetching: far
enough that a row of a table too big for the caches arrives before it is updated."""


@_jit
def upcoming_row(cursors, stops, embedding_ids, rows_per_shard):
    """The local row `PREFETCH_DISTANCE` entries ahead in the first run, or −1."""
    ahead = cursors[0] + PREFETCH_DISTANCE
    if ahead < stops[0]:
        row = embedding_ids[ahead]
        if 0 <= row < rows_per_shard:
            return row
    return -1


@_jit
def clip_runs(cursors, stops, embedding_ids, sample_ids, rows_per_shard, samples, first, stop):
    """Narrow sorted runs to the entries of local rows `[first, stop)`: each cursor moves past
    the in-range entries of smaller rows, each stop back to the first of a row `>= stop`
    (entries outside their shard or SparseCore, skipped anyway, may sit on either side).
    The whole shard's rows (a call in one part) need no walk."""
    if first <= 0 and stop >= rows_per_shard:
        return
    for s in range(cursors.shape[0]):
        j = cursors[s]
        while j < stops[s] and (embedding_ids[j] < first or not entry_in_range(
                embedding_ids[j], sample_ids[j], rows_per_shard, samples)):
            j += 1
        cursors[s] = j
        while j < stops[s] and (embedding_ids[j] < stop or not entry_in_range(
                embedding_ids[j], sample_ids[j], rows_per_shard, samples)):
            j += 1
        stops[s] = j


@_jit
def runs_sorted(bounds, p, embedding_ids, sample_ids, rows_per_shard, samples):
    """Whether every run of partition `p` lists its in-range rows in ascending order."""
    for s in range(bounds.shape[0]):
        last = -1
        for j in range(bounds[s, p, 0], bounds[s, p, 1]):
            row = embedding_ids[j]
            if entry_in_range(row, sample_ids[j], rows_per_shard, samples):
                if row < last:
                    return False
                last = row
    return True


@_jit
def next_row(cursors, stops, embedding_ids, sample_ids, gains, grad_rows, rows_per_shard,
             samples, acc):
    """The next (smallest) local row of the runs at `cursors`, with `acc` = its gradient.

    Advances every cursor past the row's entries; returns −1 when the runs are spent.
    `acc[d] = Σ gain·grads[s·samples + sample, d]` over the row's entries, in run order,
    the gradient rows by address and width (`_kernels.gradient_rows`; 0: none, adds nothing).
    """
    best = rows_per_shard
    for s in range(cursors.shape[0]):
        j = cursors[s]
        while j < stops[s] and not entry_in_range(embedding_ids[j], sample_ids[j],
                                                  rows_per_shard, samples):
            j += 1
        cursors[s] = j
        if j < stops[s] and embedding_ids[j] < best:
            best = embedding_ids[j]
    if best == rows_per_shard:
        return -1
    dim = acc.shape[0]
    for d in range(dim):
        acc[d] = 0.0
    acc_address = acc.ctypes.data
    for s in range(cursors.shape[0]):
        j = cursors[s]
        base = s * samples
        while j < stops[s]:
            row = embedding_ids[j]
            if entry_in_range(row, sample_ids[j], rows_per_shard, samples):
                if row != best:
                    break
                o = base + sample_ids[j]
                if grad_rows[o, 0] != 0:
                    add_scaled(acc_address, grad_rows[o, 0], gains[j], grad_rows[o, 1])
            j += 1
        cursors[s] = j
    return best


@_jit
def partition_entries(bounds, p, embedding_ids, sample_ids, gains, rows_per_shard, samples):
    """(local row, gradient row, gain) of partition `p`'s in-range entries, for sorting."""
    total = 0
    for s in range(bounds.shape[0]):
        total += max(bounds[s, p, 1] - bounds[s, p, 0], 0)
    rows = np.full(total, -1, np.int32)
    smp = np.zeros(total, np.int32)
    gns = np.zeros(total, np.float32)
    used = 0
    for s in range(bounds.shape[0]):
        for j in range(bounds[s, p, 0], bounds[s, p, 1]):
            if entry_in_range(embedding_ids[j], sample_ids[j], rows_per_shard, samples):
                rows[used] = embedding_ids[j]
                smp[used] = s * samples + sample_ids[j]
                gns[used] = gains[j]
                used += 1
    return rows, smp, gns
