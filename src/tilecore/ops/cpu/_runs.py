"""The forward's inner loop: the entries of one slice added into their output rows, a run
at a time (numba, inlined into `_kernels._lookup_buffers`, which walks the buffers and
starts each run; this file's bytes are part of the numba cache's `source_stamp`)."""

from __future__ import annotations

import numpy as np

from ._vector import FLOAT32, add_scaled_from, jit_inline, prefetch_row_at

PREFETCH_DISTANCE = 12
"""How many entries ahead the forward prefetches table rows (8 to 16 alike on AMD Zen 4)."""


@jit_inline
def add_runs(j, end, sample_ids, embedding_ids, gains, low, span, address, width, rows,
             partition_rows, table_stride, far, source_format):
    """`_add_run` with the width a constant for float32 rows of 32: the row arithmetic is
    then straight-line code and a sample's output row a shift away (criteo26's many-IDs
    stacks: 3.3 ns per entry, 4.1 with the width a variable, 5.3 before the runs; AMD
    Zen 4). Other widths and formats take the general loop: each constant copy of the
    loop adds about 2.5 s to the kernel's first compile (a copy for 16 too, and for every
    format, took it from 11 to 19 s for a float32 and a bfloat16 table)."""
    if source_format == FLOAT32 and width == 32:
        return _add_run(j, end, sample_ids, embedding_ids, gains, low, span, address, 32,
                        rows, partition_rows, table_stride, far, FLOAT32)
    return _add_run(j, end, sample_ids, embedding_ids, gains, low, span, address, width, rows,
                    partition_rows, table_stride, far, source_format)


@jit_inline
def _add_run(j, end, sample_ids, embedding_ids, gains, low, span, address, width, rows,
             partition_rows, table_stride, far, source_format):
    """Add entries `j, j + 1, ...` (before `end`) of one slice into its rows (`width`
    floats each from `address`) while their sample is in `[low, low + span)` and their row
    in the shard (`rows` rows from `partition_rows`, `table_stride` bytes apart); the index
    of the first entry that is not, or `end`. Prefetches the rows of a `far` table
    `PREFETCH_DISTANCE` entries ahead, those of the run's samples (no other's: the part's
    own entries; the few past a change of slice go unprefetched). The loop needs nearly
    every register: a test against the part's samples instead kept two more live, three
    more values were reloaded from the stack per entry, and the many-IDs stacks took a
    tenth longer.

    The loop indexes with unsigned integers: numba wraps a negative signed index around,
    which cost a shift, two masks and two loads of array lengths per entry. At width 32
    it runs 24 instructions per entry (one reload from the stack) where the loop that
    took every entry through the slice checks and the width dispatch ran 45 (reloading
    the arrays' addresses from the stack). Criteo26's forward kernels take 0.7× the time
    on one core (the many-IDs stacks 0.65×: 3.3 ns per entry, of which the output rows'
    round trips to L2 are about 1.3), bit for bit the same sums."""
    at = np.uint64(j)
    stop = np.uint64(end)
    ahead = np.uint64(PREFETCH_DISTANCE)
    while at < stop:
        if far and at + ahead < stop and np.uint32(sample_ids[at + ahead] - low) < np.uint32(
                span):
            prefetch_row_at(partition_rows + embedding_ids[at + ahead] * table_stride,
                            width * 4 if source_format == FLOAT32 else width * 2)
        sample = sample_ids[at]
        row = embedding_ids[at]
        if np.uint32(sample - low) >= np.uint32(span) or np.uint32(row) >= np.uint32(rows):
            break
        add_scaled_from(address + sample * (width * 4), partition_rows + row * table_stride,
                        gains[at], width, source_format)
        at += np.uint64(1)
    return np.int64(at)
