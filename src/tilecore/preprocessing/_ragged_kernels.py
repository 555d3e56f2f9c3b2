"""Compiled flattening of numpy object arrays whose rows are 1-D numpy arrays.

A numpy object array stores one `PyObject*` per row. A row that is an exact
`numpy.ndarray` is a `PyArrayObject`, whose leading fields are numpy's stable ABI
(the same from numpy 1.7 through 2.x, `ndarraytypes.h`, `PyArrayObject_fields`):

    PyObject_HEAD                  ends with `PyTypeObject *ob_type`
    char *data                     at sizeof(PyObject)
    int nd                         + 8
    npy_intp *dimensions           + 16
    npy_intp *strides              + 24
    PyObject *base                 + 32
    PyArray_Descr *descr           + 40
    int flags                      + 48

The kernels read these fields straight from the row pointers, so nothing is
called per row and the GIL is released: `scan_rows` checks every row (an exact
ndarray, 1-D, aligned, its dtype one of the accepted descriptors, every non-empty
row of one dtype) and returns the lengths; `copy_rows` writes the rows back to back
(any stride); `rows_all_one` tells whether every element is 1.0 as float32.
A row that does not qualify makes `scan_rows` return `FALLBACK` and the caller
takes its general path. The offsets are derived from `object.__basicsize__` and
checked against real arrays before the first use (`_object_rows.header_offsets`).
The rows' headers, shapes and data lie all over the heap: each kernel prefetches
those of the row `AHEAD` rows on (about twice as fast on a busy 2-core host).
"""

from __future__ import annotations

import numpy as np
from numba.np.numpy_support import carray

from .._numba import njit
from ._pointers import load, memcpy, pointer, prefetch

OK, FALLBACK = 0, 1
ALIGNED = 0x0100  # NPY_ARRAY_ALIGNED
# Indices into the `offsets` array the kernels take.
TYPE, DATA, NDIM, DIMS, STRIDES, DESCR, FLAGS = range(7)

_jit = njit(nogil=True, cache=True, error_model="numpy")
AHEAD = 16  # rows whose headers are fetched ahead of the one being read


@_jit
def read_header(obj, offsets):
    """(type, data, ndim, first dimension, first stride, descr, flags) of the object at
    `obj`; the fields past `type` are only meaningful when it is an ndarray."""
    ndim = load(obj + offsets[NDIM], np.int32)
    dims = load(obj + offsets[DIMS], np.int64)
    strides = load(obj + offsets[STRIDES], np.int64)
    return (load(obj + offsets[TYPE], np.int64), load(obj + offsets[DATA], np.int64), ndim,
            load(dims, np.int64) if ndim > 0 else -1,
            load(strides, np.int64) if ndim > 0 else -1,
            load(obj + offsets[DESCR], np.int64), load(obj + offsets[FLAGS], np.int32))


@_jit
def scan_rows(address, step, offsets, ndarray_type, descrs, lengths, data, strides):
    """Check the rows whose object pointers start at `address`, `step` bytes apart.

    Writes each row's length, data address and stride (bytes) to `lengths`, `data`
    and `strides` (one entry per row). Returns (OK, k) where `descrs[k]` is the dtype
    of every non-empty row (k = -1 when all rows are empty), or (FALLBACK, row) for
    the first row that is not an aligned 1-D ndarray of an accepted, shared dtype.
    """
    kind = -1
    count = lengths.shape[0]
    for i in range(count):
        if i + AHEAD < count:  # the header of a row ahead, and the shape of one half as far
            ahead = load(address + (i + AHEAD) * step, np.int64)
            if ahead != 0:
                prefetch(ahead + offsets[TYPE])
                prefetch(ahead + offsets[FLAGS])
            half = load(address + (i + AHEAD // 2) * step, np.int64)
            if half != 0 and load(half + offsets[TYPE], np.int64) == ndarray_type:
                prefetch(load(half + offsets[DIMS], np.int64))
        obj = load(address + i * step, np.int64)
        if (obj == 0  # a NULL slot (numpy reads it as None)
                or load(obj + offsets[TYPE], np.int64) != ndarray_type
                or load(obj + offsets[NDIM], np.int32) != 1
                or load(obj + offsets[FLAGS], np.int32) & ALIGNED == 0):
            return FALLBACK, i
        n = load(load(obj + offsets[DIMS], np.int64), np.int64)
        lengths[i] = n
        data[i] = load(obj + offsets[DATA], np.int64)
        strides[i] = load(load(obj + offsets[STRIDES], np.int64), np.int64)
        if n == 0:
            continue
        descr = load(obj + offsets[DESCR], np.int64)
        if kind >= 0:
            if descr != descrs[kind]:
                return FALLBACK, i
            continue
        for k in range(descrs.shape[0]):
            if descr == descrs[k]:
                kind = k
        if kind < 0:
            return FALLBACK, i
    return OK, kind


@_jit
def copy_rows(data, strides, splits, source, out):
    """Rows (as `scan_rows` found them, of `source`'s dtype) into
    `out[splits[i]:splits[i + 1]]`, converted to `out`'s dtype."""
    itemsize = source.itemsize
    same = source.dtype == out.dtype
    base = out.ctypes.data
    count = splits.shape[0] - 1
    for i in range(count):
        if i + AHEAD < count:
            prefetch(data[i + AHEAD])
        start = splits[i]
        n = splits[i + 1] - start
        if n == 1:
            out[start] = load(data[i], source)
        elif n and strides[i] == itemsize and same:
            memcpy(base + start * itemsize, data[i], n * itemsize)
        elif n and strides[i] == itemsize:
            row = carray(pointer(data[i], source), n)
            for j in range(n):
                out[start + j] = row[j]
        else:
            for j in range(n):
                out[start + j] = load(data[i] + j * strides[i], source)


@_jit
def rows_all_one(data, strides, lengths, source):
    """Whether every element of the rows (as `scan_rows` found them) is 1.0 as float32."""
    one = np.float32(1.0)
    itemsize = source.itemsize
    count = lengths.shape[0]
    for i in range(count):
        if i + AHEAD < count:
            prefetch(data[i + AHEAD])
        n = lengths[i]
        if n == 1:
            if np.float32(load(data[i], source)) != one:
                return False
        elif n and strides[i] == itemsize:
            row = carray(pointer(data[i], source), n)
            differ = False
            for j in range(n):  # no early exit inside a row: the loop vectorises
                differ |= np.float32(row[j]) != one
            if differ:
                return False
        else:
            for j in range(n):
                if np.float32(load(data[i] + j * strides[i], source)) != one:
                    return False
    return True


@_jit
def all_one(values):
    """Whether every element of the 1-D `values` is 1.0 (stops at the first that is not)."""
    for i in range(values.shape[0]):  # noqa: SIM110 (numba: a loop, not a generator)
        if values[i] != 1.0:
            return False
    return True
