"""CPU kernels for the device ops (numba, called by XLA through its typed FFI).

XLA's CPU gathers, scatters and sorts cost 80–300 ns per row; these loops do the
same work at memory speed. `use_cpu_kernels()` decides per process whether the ops
call them (CPU backend, FFI available, not disabled by $TILECORE_KERNELS=xla);
every other backend uses the pure-XLA path.
"""

from __future__ import annotations

import os
from functools import cache

import jax
import jax.numpy as jnp
import numba
import numpy as np

from ..preprocessing import StackBuffers
from ._ffi import register_kernel, unavailable_reason
from ._layout import StackLayout

KERNELS_ENV = "TILECORE_KERNELS"

_jit = numba.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@cache
def use_cpu_kernels() -> bool:
    """Whether the ops run their CPU kernels (`$TILECORE_KERNELS`: auto, ffi or xla).

    Decided once per process; in a multi-process run every process must decide the
    same (checked against the peers that decided before, see below).
    """
    choice = os.environ.get(KERNELS_ENV, "auto").lower()
    if choice not in ("auto", "ffi", "xla"):
        raise ValueError(f"${KERNELS_ENV} must be auto, ffi or xla; got {choice!r}.")
    if choice == "xla" or (choice == "auto" and jax.default_backend() != "cpu"):
        reason: str | None = f"${KERNELS_ENV}={choice}, backend {jax.default_backend()}"
    elif jax.default_backend() != "cpu":  # choice == "ffi"
        raise RuntimeError(
            f"${KERNELS_ENV}=ffi asks for the numba CPU kernels, but JAX's default backend is "
            f"{jax.default_backend()!r}: its arrays are not on the CPU. Unset ${KERNELS_ENV} "
            "(auto) or set it to xla.")
    else:
        reason = unavailable_reason()
        if reason is not None and choice == "ffi":
            raise RuntimeError(
                f"${KERNELS_ENV}=ffi but the CPU kernels are unavailable: {reason}")
    _check_same_choice_as_peers(reason)
    return reason is None


_CHOICE_KEY = "tilecore/cpu_kernels/"


def _check_same_choice_as_peers(reason: str | None) -> None:
    """Publish this process's kernel choice; raise if a peer already chose differently.

    The two paths compile to different programs whose collectives XLA schedules in
    a different order; in a multi-process run gloo then pairs one process's
    all-to-all with another's of a different operand (wrong activations, NaN).
    Never blocks (the first process to decide cannot see the others, a later one
    can): every process must make the same choice, and this catches most that don't.
    """
    from ..distributed._exchange import jax_store

    store = jax_store()
    if store is None or jax.process_count() == 1:
        return
    mine = "ffi" if reason is None else f"xla ({reason})"
    me = jax.process_index()
    store.key_value_set(f"{_CHOICE_KEY}{me}", mine, allow_overwrite=True)
    for key, theirs in store.key_value_dir_get(_CHOICE_KEY):
        if theirs.split(" ")[0] != mine.split(" ")[0]:
            raise RuntimeError(
                f"Process {me} runs the ops with {mine} but process "
                f"{key.rsplit('/', 1)[-1]} with {theirs}: every process must run the same "
                f"kernels (their collectives must match). Set ${KERNELS_ENV} to the same "
                "value (ffi or xla) on every process.")


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
        for d in range(dim):
            sums[u, d] += g * grads[s, d]
    distinct[0] = u + 1
    return 0


@_jit
def _row_gradients_kernel(rows, samples, gains, grads, unique, sums, distinct):
    return _aggregate(rows, samples, gains, grads, unique, sums, distinct)


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
            start = (previous + 7) & ~7
            previous = end
            for j in range(s * slot + start, s * slot + min(end, slot)):
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
            start = (previous + 7) & ~7
            previous = end
            base = p * rows_per_shard
            for j in range(s * slot + start, s * slot + min(end, slot)):
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


def lookup_buffers(buffers: StackBuffers, table: jax.Array, layout: StackLayout) -> jax.Array:
    """A single device's stacked activations, read straight from its packed buffers."""
    out = jax.ShapeDtypeStruct((layout.sc_per_device * layout.samples_per_sc, table.shape[1]),
                               np.float32)
    flat = [jnp.reshape(x, -1) for x in (buffers.row_pointers, buffers.embedding_ids,
                                         buffers.sample_ids, buffers.gains)]
    return LOOKUP_BUFFERS(_layout_array(layout), *flat, table, results=[out])[0]


def row_gradients_buffers(buffers: StackBuffers, grads: jax.Array, layout: StackLayout
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`row_gradients` of a single device's packed buffers (no routing, no entry arrays)."""
    flat = [jnp.reshape(x, -1) for x in (buffers.row_pointers, buffers.embedding_ids,
                                         buffers.sample_ids, buffers.gains)]
    n = flat[1].shape[0]
    results = [jax.ShapeDtypeStruct((n,), np.int32),
               jax.ShapeDtypeStruct((n, grads.shape[1]), np.float32),
               jax.ShapeDtypeStruct((1,), np.int32)]
    out = ROW_GRADIENTS_BUFFERS(_layout_array(layout), *flat, grads, results=results)
    return out[0], out[1], out[2][0]
