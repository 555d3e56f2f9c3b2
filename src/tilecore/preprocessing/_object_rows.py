"""Ragged rows (a numpy object array or a list of rows) read without per-row Python.

Two routes, tried by `read_rows`; it returns None when neither applies, and the
caller then takes its general path (which gives the errors):

- an object array whose rows are all exact 1-D numpy arrays of one accepted dtype
  (any stride): checked and copied by the compiled kernels in `_ragged_kernels`,
  which read each row's array header straight from the object array's pointers,
  in parts of `ROWS_PER_PART`+ rows on up to `threads` threads (the calling thread
  and the preprocessing pool; the kernels release the GIL);
- rows that are all Python lists or tuples: lengths by `map(len, ...)`, values by
  one `np.array` over the chained rows (the per-value conversion of Python numbers
  is the only per-value Python work), accepted if numpy infers an accepted dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from . import _ragged_kernels as k
from ._buffers import allocate
from ._threads import pool

_T = TypeVar("_T")

ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
WEIGHT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@functools.cache
def header_offsets() -> np.ndarray | None:
    """Byte offsets of the ndarray header fields the kernels read (indexed by
    `_ragged_kernels.TYPE` …), or None if they do not match this interpreter and numpy.

    They follow from `sizeof(PyObject)` and numpy's stable `PyArrayObject` layout, and
    are checked on probe arrays (strided, 2-D, empty, each dtype the routes accept).
    """
    base = object.__basicsize__
    if sys.maxsize != 2**63 - 1:  # the offsets assume 8-byte pointers
        return None
    offsets = np.array([base - 8, base, base + 8, base + 16, base + 24, base + 40, base + 48],
                       np.int64)
    probes = [np.arange(12, dtype=d)[::3] for d in ID_DTYPES + WEIGHT_DTYPES]
    probes += [np.arange(5, dtype=np.int32), np.zeros((2, 3)), np.ones(0, np.float32)]
    for a in probes:
        expected = (id(np.ndarray), a.ctypes.data, a.ndim, a.shape[0], a.strides[0],
                    id(a.dtype), a.flags.num)
        if tuple(int(x) for x in k.read_header(id(a), offsets)) != expected:
            return None
    return offsets


ROWS_PER_PART = 4096
"""Rows are split into parts of at least this many, one per thread (a part's task
costs tens of microseconds to hand over)."""


def _each_part(parts: list[tuple[int, int]], threads: int,
               task: Callable[[int, int], _T]) -> list[_T]:
    """`task(r0, r1)` for every row range: the first on this thread, the others on the
    preprocessing pool (the kernels release the GIL)."""
    futures = [pool(threads).submit(task, a, b) for a, b in parts[1:]]
    first = task(*parts[0])
    return [first, *(f.result() for f in futures)]


def _parts(count: int, threads: int) -> list[tuple[int, int]]:
    n = max(1, min(threads, count // ROWS_PER_PART))
    bounds = [count * i // n for i in range(n + 1)]
    return list(itertools.pairwise(bounds))


@dataclasses.dataclass(frozen=True, eq=False)
class Rows:
    """Validated ragged rows: their lengths, their dtype, and how to read their values."""

    lengths: np.ndarray  # int64, one per row
    dtype: np.dtype  # of every non-empty row (the first accepted dtype if none is)
    _flat: np.ndarray | None = None  # the values already joined (list route)
    # Compiled route: each row's data address and stride in bytes, the object array
    # (held so that the rows, and the addresses, stay alive), the row ranges that
    # threads take, and the thread count.
    _data: np.ndarray | None = None
    _strides: np.ndarray | None = None
    _rows: np.ndarray | None = None
    _parts: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    _threads: int = 1

    def splits(self) -> np.ndarray:
        """int64 row splits: 0, then the running total of the lengths."""
        splits = np.zeros(len(self.lengths) + 1, np.int64)
        np.cumsum(self.lengths, out=splits[1:])
        return splits

    def values(self, splits: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
        """The rows back to back (as `dtype`, default their own), given `self.splits()`."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if self._flat is not None:
            return np.ascontiguousarray(self._flat, dtype=dtype)
        data, strides = self._data, self._strides
        assert data is not None and strides is not None
        out = allocate([((int(splits[-1]),), dtype.type)])[0]  # recycled: no page faults
        source = np.empty(0, self.dtype)
        _each_part(self._parts, self._threads, lambda a, b: k.copy_rows(
            data[a:b], strides[a:b], splits[a:b + 1], source, out))
        return out

    def all_one(self) -> bool:
        """Whether every value, as float32, is 1.0 (stops at the first that is not)."""
        if self._flat is not None:
            return bool(k.all_one(self._flat.astype(np.float32, copy=False)))
        data, strides = self._data, self._strides
        assert data is not None and strides is not None
        source = np.empty(0, self.dtype)
        return all(_each_part(self._parts, self._threads, lambda a, b: k.rows_all_one(
            data[a:b], strides[a:b], self.lengths[a:b], source)))


def read_rows(rows: object, accepted: tuple[np.dtype, ...], threads: int = 1) -> Rows | None:
    """`rows` (a 1-D object array or a list/tuple of rows) as `Rows` whose non-empty rows
    share one of the `accepted` dtypes, or None: take the general path. Object arrays
    of many rows are read by up to `threads` threads."""
    if isinstance(rows, np.ndarray):
        if rows.dtype != object or rows.ndim != 1:
            return None
        found = _array_rows(rows, accepted, threads)
        if found is not None:
            return found
    elif not isinstance(rows, list | tuple):
        return None
    return _list_rows(rows, accepted)


def _array_rows(rows: np.ndarray, accepted: tuple[np.dtype, ...], threads: int) -> Rows | None:
    offsets = header_offsets()
    if offsets is None:
        return None
    lengths, data, strides = np.empty((3, len(rows)), np.int64)
    descrs = np.array([id(d) for d in accepted], np.int64)
    address, step = rows.ctypes.data, rows.strides[0]
    parts = _parts(len(rows), threads)
    found = _each_part(parts, threads, lambda a, b: k.scan_rows(
        address + a * step, step, offsets, id(np.ndarray), descrs, lengths[a:b], data[a:b],
        strides[a:b]))
    kinds = {kind for status, kind in found if kind >= 0}
    if any(status != k.OK for status, _ in found) or len(kinds) > 1:
        return None  # a row the kernels do not take, or parts of different dtypes
    return Rows(lengths, accepted[kinds.pop() if kinds else 0], _data=data, _strides=strides,
                _rows=rows, _parts=parts, _threads=threads)


def _list_rows(rows: list | tuple | np.ndarray, accepted: tuple[np.dtype, ...]) -> Rows | None:
    if not set(map(type, rows)) <= {list, tuple}:
        return None
    lengths = np.fromiter(map(len, rows), np.int64, count=len(rows))
    try:
        flat = np.array(list(itertools.chain.from_iterable(rows)))
    except (ValueError, TypeError, OverflowError):  # nested or odd rows: the general path
        return None
    if flat.ndim != 1 or flat.size != lengths.sum():
        return None
    if not flat.size:
        return Rows(lengths, accepted[0], _flat=flat.astype(accepted[0]))
    if flat.dtype not in accepted:
        return None
    return Rows(lengths, flat.dtype, _flat=flat)
