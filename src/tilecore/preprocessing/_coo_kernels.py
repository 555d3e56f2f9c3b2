"""Row splits of sparse (COO) inputs in one compiled pass (numba, GIL released).

A TF-style sparse tensor names each value's row in `indices[:, 0]`. `row_splits`
checks every row index against the batch, counts the values per row and tells
whether the rows are already in order; `stable_order` is the counting sort that
puts them in order otherwise (values of one row keep their order).
"""

from __future__ import annotations

import numpy as np

from .._numba import njit

_jit = njit(nogil=True, cache=True, error_model="numpy")


@_jit
def _count(rows, batch, splits):
    """`splits` (zeros, batch + 1) := row splits of `rows`; returns (first position whose
    row is outside [0, batch) or -1, whether `rows` never decreases)."""
    in_order = True
    previous = 0
    for i in range(rows.shape[0]):
        row = np.int64(rows[i])
        if row < 0 or row >= batch:
            return i, False
        splits[row + 1] += 1
        in_order &= row >= previous
        previous = row
    for r in range(batch):
        splits[r + 1] += splits[r]
    return -1, in_order


@_jit
def _order(rows, splits, order):
    cursor = splits[:-1].copy()
    for i in range(rows.shape[0]):
        row = np.int64(rows[i])
        order[cursor[row]] = i
        cursor[row] += 1


def row_splits(rows: np.ndarray, batch: int) -> tuple[np.ndarray, int, np.ndarray | None]:
    """(int64 splits, first position whose row is outside [0, batch) or -1, the stable
    order that sorts `rows` or None when they are in order already).

    `rows`: 1-D int32 or int64 row indices, any stride (e.g. the column `indices[:, 0]`).
    """
    splits = np.zeros(batch + 1, np.int64)
    bad, in_order = _count(rows, batch, splits)
    if bad >= 0 or in_order:
        return splits, int(bad), None
    order = np.empty(rows.shape[0], np.int64)
    _order(rows, splits, order)
    return splits, -1, order
