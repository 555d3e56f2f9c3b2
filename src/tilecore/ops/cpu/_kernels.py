"""CPU kernels for the device ops (numba, called by XLA through its typed FFI).

XLA's CPU gathers, scatters and sorts cost 80–300 ns per row; these loops do the
same work at memory speed. `tilecore.ops._backend` decides per process whether the
ops call them (this wing) or the pure-XLA wing.
"""

from __future__ import annotations

import jax
import numba
import numpy as np

from .._backend import FlatBuffers
from .._layout import StackLayout
from ._ffi import register_kernel

_jit = numba.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@_jit
def _gather_rows_kernel(table, rows, out):
    """out[i] = table[rows[i]], zeros where rows[i] is out of range."""
    num_rows, dim = table.shape
    for i in range(rows.shape[0]):
        r = rows[i]
        if 0 <= r < num_rows:
            for d in range(dim):
                out[i, d] = table[r, d]
        else:
            for d in range(dim):
                out[i, d] = 0.0
    return 0


@_jit
def _scatter_rows_kernel(table, rows, values, out):
    """out = table with out[rows[i]] = values[i] (rows out of range skipped); in place."""
    num_rows, dim = table.shape
    if out.ctypes.data != table.ctypes.data:
        out[:] = table
    for i in range(rows.shape[0]):
        r = rows[i]
        if 0 <= r < num_rows:
            for d in range(dim):
                out[r, d] = values[i, d]
    return 0


@_jit
def _aggregate(rows, samples, gains, grads, unique, sums, distinct):
    """Sum `gains[i]·grads[samples[i]]` per distinct row (rows < 0 are skipped).

    Writes the distinct rows, ascending, to `unique` (the rest −1), their sums to
    `sums` (rows past the distinct count are undefined: their updates are
    dropped) and the count to `distinct[0]`. An LSD radix sort (one or two 16-bit
    passes) orders the entries by row.
    """
    n = rows.shape[0]
    dim = grads.shape[1]
    order = np.empty(n, np.int32)
    scratch = np.empty(n, np.int32)
    count = 0
    largest = 0
    for i in range(n):
        if rows[i] >= 0:
            order[count] = i
            count += 1
            largest = max(largest, rows[i])
    for shift in (0, 16):
        if shift and largest < (1 << 16):
            break  # one 16-bit pass sorted every row already
        hist = np.zeros(1 << 16, np.int64)
        for k in range(count):
            hist[(rows[order[k]] >> shift) & 0xFFFF] += 1
        total = 0
        for d in range(1 << 16):
            c = hist[d]
            hist[d] = total
            total += c
        for k in range(count):
            i = order[k]
            d = (rows[i] >> shift) & 0xFFFF
            scratch[hist[d]] = i
            hist[d] += 1
        order, scratch = scratch, order
    unique[:] = -1
    u = -1
    last = -1
    for k in range(count):
        i = order[k]
        r = rows[i]
        if r != last:
            u += 1
            unique[u] = r
            last = r
            for d in range(dim):
                sums[u, d] = 0.0
        g = gains[i]
        s = samples[i]
        if 0 <= s < grads.shape[0]:  # a sample outside the gradients contributes nothing
            for d in range(dim):
                sums[u, d] += g * grads[s, d]
    distinct[0] = u + 1
    return 0


@_jit
def _row_gradients_kernel(rows, samples, gains, grads, unique, sums, distinct):
    return _aggregate(rows, samples, gains, grads, unique, sums, distinct)


@_jit
def entry_in_range(embedding_id, sample_id, rows_per_shard, samples):
    """Whether an entry addresses a row of its shard and a sample of its SparseCore.

    Preprocessing never writes any other; a batch built by hand, or damaged, may,
    and the kernels skip such entries instead of reading or writing out of bounds.
    """
    return 0 <= embedding_id < rows_per_shard and 0 <= sample_id < samples


@_jit
def _buffer_entries(layout, row_pointers, embedding_ids, sample_ids):
    """(table row, sample) of every pointed-to entry of one device's buffers (−1 elsewhere).

    `layout` = [N, S, pointers per SparseCore, rows per shard, samples per SparseCore]:
    a single device owns every partition, so no routing is needed.
    """
    n, s_count, per_sc, rows_per_shard, samples = (layout[0], layout[1], layout[2], layout[3],
                                                   layout[4])
    size = embedding_ids.shape[0]
    slot = size // s_count
    rows = np.full(size, -1, np.int32)
    smp = np.zeros(size, np.int32)
    for s in range(s_count):
        previous = 0
        for p in range(n):
            end = row_pointers[s * per_sc + p]
            start = max((previous + 7) & ~7, 0)
            previous = end
            for j in range(s * slot + start, s * slot + min(end, slot)):
                if entry_in_range(embedding_ids[j], sample_ids[j], rows_per_shard, samples):
                    rows[j] = p * rows_per_shard + embedding_ids[j]
                    smp[j] = s * samples + sample_ids[j]
    return rows, smp


@_jit
def _lookup_buffers_kernel(layout, row_pointers, embedding_ids, sample_ids, gains, table, out):
    """One device's pooled activations straight from its packed buffers."""
    n, s_count, per_sc, rows_per_shard, samples = (layout[0], layout[1], layout[2], layout[3],
                                                   layout[4])
    dim = table.shape[1]
    slot = embedding_ids.shape[0] // s_count
    out[:] = 0.0
    for s in range(s_count):
        previous = 0
        for p in range(n):
            end = row_pointers[s * per_sc + p]
            start = max((previous + 7) & ~7, 0)
            previous = end
            base = p * rows_per_shard
            for j in range(s * slot + start, s * slot + min(end, slot)):
                if not entry_in_range(embedding_ids[j], sample_ids[j], rows_per_shard,
                                      samples):
                    continue
                r = base + embedding_ids[j]
                o = s * samples + sample_ids[j]
                g = gains[j]
                for d in range(dim):
                    out[o, d] += g * table[r, d]
    return 0


@_jit
def _row_gradients_buffers_kernel(layout, row_pointers, embedding_ids, sample_ids, gains, grads,
                                  unique, sums, distinct):
    rows, samples = _buffer_entries(layout, row_pointers, embedding_ids, sample_ids)
    return _aggregate(rows, samples, gains, grads, unique, sums, distinct)


_f32, _i32 = np.float32, np.int32
GATHER_ROWS = register_kernel("tilecore_gather_rows", _gather_rows_kernel,
                              args=[(_f32, 2), (_i32, 1)], rets=[(_f32, 2)])
SCATTER_ROWS = register_kernel("tilecore_scatter_rows", _scatter_rows_kernel,
                               args=[(_f32, 2), (_i32, 1), (_f32, 2)], rets=[(_f32, 2)])
LOOKUP_BUFFERS = register_kernel(
    "tilecore_lookup_buffers", _lookup_buffers_kernel,
    args=[(_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_f32, 1), (_f32, 2)],
    rets=[(_f32, 2)])
ROW_GRADIENTS_BUFFERS = register_kernel(
    "tilecore_row_gradients_buffers", _row_gradients_buffers_kernel,
    args=[(_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_f32, 1), (_f32, 2)],
    rets=[(_i32, 1), (_f32, 2), (_i32, 1)])
ROW_GRADIENTS = register_kernel("tilecore_row_gradients", _row_gradients_kernel,
                                args=[(_i32, 1), (_i32, 1), (_f32, 1), (_f32, 2)],
                                rets=[(_i32, 1), (_f32, 2), (_i32, 1)])


def gather_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
    """`table[rows]` with zeros for out-of-range rows."""
    out = jax.ShapeDtypeStruct((rows.shape[0], table.shape[1]), table.dtype)
    return GATHER_ROWS(table, rows, results=[out])[0]


def scatter_rows(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """`table.at[rows].set(values, mode="drop")`, in place when `table` is donated."""
    out = jax.ShapeDtypeStruct(table.shape, table.dtype)
    return SCATTER_ROWS(table, rows, values, results=[out], input_output_aliases={0: 0})[0]


def row_gradients(rows: jax.Array, samples: jax.Array, gains: jax.Array, grads: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(distinct rows padded with −1, per-row `Σ gain·grads[sample]`, how many distinct).

    Entries with rows < 0 are ignored; sums past the distinct count are undefined.
    """
    n = rows.shape[0]
    unique = jax.ShapeDtypeStruct((n,), np.int32)
    sums = jax.ShapeDtypeStruct((n, grads.shape[1]), np.float32)
    distinct = jax.ShapeDtypeStruct((1,), np.int32)
    out = ROW_GRADIENTS(rows, samples, gains, grads, results=[unique, sums, distinct])
    return out[0], out[1], out[2][0]


def _layout_array(layout: StackLayout) -> np.ndarray:
    return np.array([layout.num_partitions, layout.sc_per_device, layout.pointers_per_sc,
                     layout.rows_per_shard, layout.samples_per_sc], np.int32)


def lookup_buffers(flat: FlatBuffers, table: jax.Array, layout: StackLayout) -> jax.Array:
    """A single device's stacked activations, read straight from its packed buffers."""
    out = jax.ShapeDtypeStruct((layout.sc_per_device * layout.samples_per_sc, table.shape[1]),
                               np.float32)
    return LOOKUP_BUFFERS(_layout_array(layout), *flat, table, results=[out])[0]


def row_gradients_buffers(flat: FlatBuffers, grads: jax.Array, layout: StackLayout
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`row_gradients` of a single device's packed buffers (no routing, no entry arrays)."""
    n = flat[1].shape[0]
    results = [jax.ShapeDtypeStruct((n,), np.int32),
               jax.ShapeDtypeStruct((n, grads.shape[1]), np.float32),
               jax.ShapeDtypeStruct((1,), np.int32)]
    out = ROW_GRADIENTS_BUFFERS(_layout_array(layout), *flat, grads, results=results)
    return out[0], out[1], out[2][0]
