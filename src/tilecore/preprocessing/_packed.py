"""The packed COO layout of one device's buffers: its one definition.

Every stack's batch is four 1-D arrays per device (the reference's "CSR-wrapped
COO", see `StackBuffers`):
- `row_pointers`: per SparseCore (per minibatch when minibatched) a block of
  `max(N, 8)` exclusive ends, one per partition; a partition's entries start at
  the previous end rounded up to `ALIGNMENT`; unused pointers repeat the last
  aligned end. Plain buffers give ends relative to the SparseCore's slot (its
  `size // S` entries); minibatched ones absolute ends, block `s·M + m` for
  SparseCore `s`'s minibatch `m`.
- `embedding_ids`, `sample_ids`, `gains`: the entries, sorted by (local row,
  sample) within a partition; alignment gaps and unused tails hold filler
  (`FILLER_ID`, `FILLER_ID`, `FILLER_GAIN`).

This module owns those facts: the constants, the one alignment rule (`align_up`,
which works on Python ints, numpy and JAX arrays; `aligned` is its numba form),
the filler writer every packing kernel calls, and the reader that every CPU
kernel walks the buffers with (`run_bounds`). The JAX ops read the same pointers
with `align_up`.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from .._numba import njit

ALIGNMENT = 8
"""Partitions start on multiples of this many entries."""
FILLER_ID = np.int32(2**31 - 1)
"""`embedding_ids` and `sample_ids` of a filler entry."""
FILLER_GAIN = np.float32(np.nan)
"""`gains` of a filler entry."""
MIN_POINTERS = 8
"""A SparseCore's pointer block holds `max(N, MIN_POINTERS)` pointers."""


def align_up(position: Any) -> Any:
    """`position` rounded up to a multiple of `ALIGNMENT` (ints, numpy or JAX arrays)."""
    return (position + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT


def pointers_per_block(num_partitions: int) -> int:
    """Row pointers in one SparseCore's (or one minibatch's) block."""
    return max(num_partitions, MIN_POINTERS)


_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)
aligned = numba.njit(inline="always", cache=True)(align_up)
"""`align_up` compiled for numba kernels."""


@_jit
def fill(embedding_ids, sample_ids, gains, start, stop):
    """Write filler into entries `[start, stop)` (clipped to the buffer)."""
    for j in range(max(start, 0), min(stop, embedding_ids.shape[0])):
        embedding_ids[j] = FILLER_ID
        sample_ids[j] = FILLER_ID
        gains[j] = FILLER_GAIN


@_jit
def run_bounds(layout, which, row_pointers, size):
    """`[S, N, 2]` start and stop of every (SparseCore, partition) run of one pass.

    `layout` = [N, S, pointers per block, rows per shard, samples per SparseCore,
    minibatched]; `which` = [minibatch, number of minibatches] (plain buffers read
    [0, 1]). Pointers are clipped to the buffer, so a damaged batch gives empty or
    shorter runs, never an index outside it.
    """
    n, s_count, per_block = layout[0], layout[1], layout[2]
    bounds = np.zeros((s_count, n, 2), np.int64)
    blocks = row_pointers.shape[0] // per_block
    if layout[5] == 0:
        slot = size // s_count
        for s in range(min(s_count, blocks)):
            previous = 0
            for p in range(n):
                end = row_pointers[s * per_block + p]
                start = min(max(aligned(previous), 0), slot)
                previous = end
                bounds[s, p, 0] = s * slot + start
                bounds[s, p, 1] = s * slot + max(min(end, slot), start)
        return bounds
    minibatch, m = which[0], which[1]
    for s in range(s_count):
        k = s * m + minibatch
        if k < 0 or k >= blocks:
            continue
        previous = row_pointers[k * per_block - per_block + n - 1] if k > 0 else 0
        for p in range(n):
            end = min(row_pointers[k * per_block + p], size)
            start = min(max(aligned(previous), 0), size)
            previous = end
            bounds[s, p, 0] = start
            bounds[s, p, 1] = max(end, start)
    return bounds
