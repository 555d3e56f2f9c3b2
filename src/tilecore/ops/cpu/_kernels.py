"""CPU kernels for the device ops (numba, called by XLA through its typed FFI).

XLA's CPU gathers, scatters and sorts cost 80–300 ns per row; these loops do the
same work at memory speed. `tilecore.ops._backend` decides per process whether the
ops call them (this wing) or the pure-XLA wing.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..._numba import njit
from ...preprocessing._packed import run_bounds
from .._activations import ActivationSlice
from .._backend import FlatBuffers
from .._layout import StackLayout
from ._ffi import register_kernel
from ._runs import add_runs
from ._vector import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    TABLE_FORMATS,
    add_scaled,
    copy_table,
    jit_inline,
    row_address,
    zero_bytes,
)

_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)

PREFETCH_TABLE_BYTES = 4 << 20
"""Tables above this size have their rows prefetched: the rows of a larger table miss the
caches, and asking early hides that (a fifth off those stacks); a smaller table's rows
hit them, and the prefetches only cost (a sixth more on criteo26's small many-hot stacks)."""


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
    """out = table with out[rows[i]] = values[i] (rows out of range skipped); in place.
    Refuses (1) values that are not one row of the table's width per row index."""
    num_rows, dim = table.shape
    if values.shape[0] != rows.shape[0] or values.shape[1] != dim:
        return 1
    if out.ctypes.data != table.ctypes.data:
        copy_table(out, table)
    for i in range(rows.shape[0]):
        r = rows[i]
        if 0 <= r < num_rows:
            for d in range(dim):
                out[r, d] = values[i, d]
    return 0


@_jit
def _aggregate(rows, samples, gains, grad_rows, unique, sums, distinct):
    """Sum `gains[i]·grads[samples[i]]` per distinct row (rows < 0 are skipped), the
    gradient rows given by address and width (`gradient_rows`, `block_rows`).

    Writes the distinct rows, ascending, to `unique` (the rest −1), their sums to
    `sums` (rows past the distinct count are undefined: their updates are
    dropped) and the count to `distinct[0]`. An LSD radix sort (one or two 16-bit
    passes) orders the entries by row.
    """
    n = rows.shape[0]
    dim = sums.shape[1]
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
        s = samples[i]
        if 0 <= s < grad_rows.shape[0] and grad_rows[s, 0] != 0:  # else it adds nothing
            add_scaled(row_address(sums, u), grad_rows[s, 0], gains[i], grad_rows[s, 1])
    distinct[0] = u + 1
    return 0


@_jit
def _row_gradients_kernel(rows, samples, gains, grads, unique, sums, distinct):
    return _aggregate(rows, samples, gains, block_rows(grads), unique, sums, distinct)


@_jit
def block_rows(grads):
    """The address and width of every row of a `[rows, dim]` gradient block."""
    rows = np.empty((grads.shape[0], 2), np.int64)
    for o in range(grads.shape[0]):
        rows[o, 0] = row_address(grads, o)
        rows[o, 1] = grads.shape[1]
    return rows


@_jit
def gradient_rows(layout, slices, gradients, dim):
    """The address and width of the gradient row of each row of the `[S·samples, dim]`
    block, read from each slice's own gradients (`gradients[k]`: address, rows, width of
    slice k's `[S·count, width]` array; `slice_table` checks them), address 0 for a row no
    slice takes. None where `slice_table` refuses them."""
    found = slice_table(layout, slices, gradients, dim)
    if found is None:
        return None
    owner, where = found
    sc, samples = layout[1], layout[4]
    rows = np.zeros((sc * samples, 2), np.int64)
    for s in range(sc):
        for sample in range(samples):
            k = owner[sample]
            if k >= 0:
                rows[s * samples + sample, 0] = where[k, 0] + s * where[k, 1] + sample * where[k, 2]
                rows[s * samples + sample, 1] = where[k, 3]
    return rows


@jit_inline
def entry_in_range(embedding_id, sample_id, rows_per_shard, samples):
    """Whether an entry addresses a row of its shard and a sample of its SparseCore.

    Preprocessing never writes any other; a batch built by hand, or damaged, may,
    and the kernels skip such entries instead of reading or writing out of bounds.
    """
    return 0 <= embedding_id < rows_per_shard and 0 <= sample_id < samples


@_jit
def _lookup_buffers_kernel(layout, which, row_pointers, embedding_ids, sample_ids, gains, table,
                           slices, outputs, part, parts):
    """One device's pooled activations straight from its packed buffers, summed over the
    `which[1]` minibatches of minibatched buffers (a plain layout has one pass)."""
    return _lookup_buffers(layout, which, row_pointers, embedding_ids, sample_ids, gains, table,
                           slices, outputs, FLOAT32, part, parts)


@_jit
def _lookup_buffers_bf16(layout, which, row_pointers, embedding_ids, sample_ids, gains, table,
                         slices, outputs, part, parts):
    """`_lookup_buffers_kernel` of a bfloat16 table (its uint16 bits)."""
    return _lookup_buffers(layout, which, row_pointers, embedding_ids, sample_ids, gains, table,
                           slices, outputs, BFLOAT16, part, parts)


@_jit
def _lookup_buffers_f16(layout, which, row_pointers, embedding_ids, sample_ids, gains, table,
                        slices, outputs, part, parts):
    """`_lookup_buffers_kernel` of a float16 table (its uint16 bits)."""
    return _lookup_buffers(layout, which, row_pointers, embedding_ids, sample_ids, gains, table,
                           slices, outputs, FLOAT16, part, parts)


@_jit
def slice_table(layout, slices, arrays, dim):
    """Where the rows of the `[S·samples, dim]` block are in one array per slice: per
    sample of a SparseCore's block the slice that takes it (−1 for none; `slices[k]`: its
    first sample and number of samples in each block), and per slice the address of its
    sample 0 in SparseCore 0 (before its array's first row), the bytes from one
    SparseCore's rows to the next's and from one row to the next, and its width
    (`arrays[k]`: address, rows, width of its `[S·count, width ≤ dim]` array). None if the
    counts of slices and arrays differ, an array does not fit its slice, or two slices
    overlap. The one reader of the slices both the lookup's outputs and the update's
    gradients are given by."""
    if slices.shape[0] != arrays.shape[0]:
        return None
    sc, samples = layout[1], layout[4]
    owner = np.full(samples, -1, np.int32)
    where = np.empty((slices.shape[0], 4), np.int64)
    for k in range(slices.shape[0]):
        start, count = slices[k, 0], slices[k, 1]
        address, width = arrays[k, 0], arrays[k, 2]
        if (start < 0 or count < 0 or start + count > samples or arrays[k, 1] != sc * count
                or width < 0 or width > dim):
            return None
        for i in range(start, start + count):
            if owner[i] >= 0:
                return None
            owner[i] = k
        where[k, 0] = address - start * width * 4
        where[k, 1], where[k, 2], where[k, 3] = count * width * 4, width * 4, width
    return owner, where


@_jit
def _zero_slice(layout, slices, outputs, k, s, first, stop):
    """Zero the rows of slice `k`'s output in SparseCore `s`'s block that stacked rows
    `[first, stop)` go to (checked by `slice_table`): one run of bytes."""
    samples = layout[4]
    start, count = slices[k, 0], slices[k, 1]
    address, width = outputs[k, 0], outputs[k, 2]
    low = max(first - s * samples - start, 0)
    high = min(stop - s * samples - start, count)
    if low < high:
        zero_bytes(address + (s * count + low) * width * 4, (high - low) * width * 4)


@_jit
def _zero_untouched(layout, slices, outputs, zeroed, first, stop):
    """Zero each slice's rows in each SparseCore's block that no entry added to (`zeroed`
    false: `_zero_slice` was not called for them)."""
    for k in range(slices.shape[0]):
        for s in range(layout[1]):
            if not zeroed[k, s]:
                _zero_slice(layout, slices, outputs, k, s, first, stop)


@_jit
def _lookup_buffers(layout, which, row_pointers, embedding_ids, sample_ids, gains, table,
                    slices, outputs, source_format, part, parts):
    """Part `part` of `parts` of the activations: stacked rows `[n·part/parts,
    n·(part+1)/parts)` of the `n` of the block, zeroed and then summed from the entries that
    pool into them, each straight into its row of its slice's output (`slice_table`: each
    part reads every entry's sample, a fraction of a row's work, and no part writes
    another's). A slice's rows are zeroed when its first entry comes, so that they are
    still in the core's cache when its entries add to them (the entries of one table's
    rows come together), and the rest at the end. The rows of a table too large for the
    caches are prefetched a few entries ahead, the part's own entries only.

    The entries are added in runs (`_runs.add_runs`): the entries from one up to the first
    whose sample is not among the current slice's samples of this part, or whose row is
    not in the shard. That entry alone takes the full checks here, and sets the slice of
    the next run; a stretch of other parts' entries is skipped with one comparison each."""
    rows_per_shard, samples = layout[3], layout[4]
    dim = table.shape[1]
    far = table.shape[0] * table.strides[0] > PREFETCH_TABLE_BYTES
    n = layout[1] * samples
    first = n * part // parts
    stop = n * (part + 1) // parts
    found = slice_table(layout, slices, outputs, dim)
    if found is None:
        return 1
    owner, where = found
    zeroed = np.zeros((slices.shape[0], layout[1]), np.bool_)
    passes = max(which[1], 1) if layout[5] else 1
    table_stride = table.strides[0]
    for minibatch in range(passes):
        bounds = run_bounds(layout, np.array([minibatch, passes], np.int32), row_pointers,
                            embedding_ids.shape[0])
        for s in range(bounds.shape[0]):
            mine_low = min(max(first - s * samples, 0), samples)
            mine_high = min(max(stop - s * samples, 0), samples)
            if mine_low == mine_high:
                continue
            # The current slice: the samples [low, low + span) of it that this part owns,
            # and where their rows go (none yet: every entry leaves an empty run).
            low, span, address, width = 0, 0, 0, 0
            for p in range(bounds.shape[1]):
                partition_rows = table.ctypes.data + p * rows_per_shard * table_stride
                j, end = bounds[s, p, 0], bounds[s, p, 1]
                while j < end:
                    j = add_runs(j, end, sample_ids, embedding_ids, gains, low, span, address,
                                  width, rows_per_shard, partition_rows, table_stride, far,
                                  source_format)
                    if j == end:
                        break
                    sample = sample_ids[j]
                    if sample < mine_low or sample >= mine_high:
                        j += 1
                        while j < end and not mine_low <= sample_ids[j] < mine_high:
                            j += 1  # another part's entries (one table's rows: many)
                        continue
                    k = owner[sample]
                    if not entry_in_range(embedding_ids[j], sample, rows_per_shard,
                                          samples) or k < 0:
                        j += 1
                        continue
                    if not zeroed[k, s]:
                        _zero_slice(layout, slices, outputs, k, s, first, stop)
                        zeroed[k, s] = True
                    # The slice of entry j: the next run starts with it (its sample is among
                    # the slice's samples of this part and its row in the shard).
                    low = max(slices[k, 0], mine_low)
                    span = min(slices[k, 0] + slices[k, 1], mine_high) - low
                    address = where[k, 0] + s * where[k, 1]
                    width = where[k, 3]
    _zero_untouched(layout, slices, outputs, zeroed, first, stop)
    return 0


@_jit
def _buffer_entries(layout, which, row_pointers, embedding_ids, sample_ids, gains, capacity):
    """(table row, gradient row, gain) of one pass's in-range entries, at most `capacity`
    (the rest −1): a plain layout's whole buffer, or minibatch `which[0]` of `which[1]`."""
    rows_per_shard, samples = layout[3], layout[4]
    rows = np.full(capacity, -1, np.int32)
    smp = np.zeros(capacity, np.int32)
    gns = np.zeros(capacity, np.float32)
    bounds = run_bounds(layout, which, row_pointers, embedding_ids.shape[0])
    used = 0
    for s in range(bounds.shape[0]):
        for p in range(bounds.shape[1]):
            for j in range(bounds[s, p, 0], bounds[s, p, 1]):
                if used == capacity:
                    return rows, smp, gns
                if entry_in_range(embedding_ids[j], sample_ids[j], rows_per_shard, samples):
                    rows[used] = p * rows_per_shard + embedding_ids[j]
                    smp[used] = s * samples + sample_ids[j]
                    gns[used] = gains[j]
                    used += 1
    return rows, smp, gns


@_jit
def _row_gradients_buffers_kernel(layout, which, row_pointers, embedding_ids, sample_ids, gains,
                                  grads, unique, sums, distinct):
    """`_aggregate` of one pass over a device's buffers, its gradients one block."""
    rows, samples, entry_gains = _buffer_entries(layout, which, row_pointers, embedding_ids,
                                                 sample_ids, gains, unique.shape[0])
    return _aggregate(rows, samples, entry_gains, block_rows(grads), unique, sums, distinct)


_f32, _i32 = np.float32, np.int32
GATHER_ROWS = {t: register_kernel(f"tilecore_gather_rows{suffix}", _gather_rows_kernel,
                                  args=[(t, 2), (_i32, 1)], rets=[(t, 2)])
               for t, (suffix, _) in TABLE_FORMATS.items()}
SCATTER_ROWS = {t: register_kernel(f"tilecore_scatter_rows{suffix}", _scatter_rows_kernel,
                                   args=[(t, 2), (_i32, 1), (t, 2)], rets=[(t, 2)])
                for t, (suffix, _) in TABLE_FORMATS.items()}
_LOOKUP_KERNELS = {FLOAT32: _lookup_buffers_kernel, BFLOAT16: _lookup_buffers_bf16,
                   FLOAT16: _lookup_buffers_f16}
LOOKUP_BUFFERS = {t: register_kernel(
    f"tilecore_lookup_buffers{suffix}", _LOOKUP_KERNELS[source_format],
    args=[(_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_f32, 1), (t, 2), (_i32, 2)],
    rets=[(_f32, 2)], split=True, variadic="results")
    for t, (suffix, source_format) in TABLE_FORMATS.items()}
"""Table dtype → the lookup kernel of its rows (float32, bfloat16, float16): one result per
slice of the block it is asked for."""
ROW_GRADIENTS_BUFFERS = register_kernel(
    "tilecore_row_gradients_buffers", _row_gradients_buffers_kernel,
    args=[(_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_f32, 1), (_f32, 2)],
    rets=[(_i32, 1), (_f32, 2), (_i32, 1)])
ROW_GRADIENTS = register_kernel("tilecore_row_gradients", _row_gradients_kernel,
                                args=[(_i32, 1), (_i32, 1), (_f32, 1), (_f32, 2)],
                                rets=[(_i32, 1), (_f32, 2), (_i32, 1)])


def gather_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
    """`table[rows]` with zeros for out-of-range rows."""
    out = jax.ShapeDtypeStruct((rows.shape[0], table.shape[1]), table.dtype)
    return GATHER_ROWS[np.dtype(table.dtype)](table, rows, results=[out])[0]


def scatter_rows(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """`table.at[rows].set(values, mode="drop")`, in place when `table` is donated."""
    out = jax.ShapeDtypeStruct(table.shape, table.dtype)
    return SCATTER_ROWS[np.dtype(table.dtype)](table, rows, values, results=[out],
                                               input_output_aliases={0: 0})[0]


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


def layout_array(layout: StackLayout) -> np.ndarray:
    """The static layout operand every buffer kernel takes (see `_packed.run_bounds`)."""
    return np.array([layout.num_partitions, layout.sc_per_device, layout.pointers_per_sc,
                     layout.rows_per_shard, layout.samples_per_sc, int(layout.minibatched)],
                    np.int32)


def passes(num_minibatches: jax.Array | int, minibatch: jax.Array | int = 0) -> jax.Array:
    """The `which` operand: [minibatch, number of minibatches]."""
    return jnp.stack([jnp.asarray(minibatch, jnp.int32),
                      jnp.asarray(num_minibatches, jnp.int32)])


def buffer_capacity(layout: StackLayout, buffer_size: int) -> int:
    """Most entries one pass of one device can hold: every partition of every SparseCore
    full (a minibatch), or the whole buffer (a plain layout)."""
    if not layout.minibatched:
        return buffer_size
    return min(layout.sc_per_device * layout.num_partitions * layout.partition_span, buffer_size)


def lookup_buffers(flat: FlatBuffers, table: jax.Array, layout: StackLayout,
                   num_minibatches: jax.Array | int, slices: Sequence[ActivationSlice]
                   ) -> list[jax.Array]:
    """A single device's activations of each slice of its stacked block, read straight
    from its packed buffers (summed over every minibatch of minibatched ones) and written
    where each slice's `[S·samples, width]` result lies."""
    results = [jax.ShapeDtypeStruct((layout.sc_per_device * count, width), np.float32)
               for _, count, width in slices]
    return LOOKUP_BUFFERS[np.dtype(table.dtype)](layout_array(layout), passes(num_minibatches),
                                                 *flat, table, slice_operand(slices),
                                                 results=results)


def slice_operand(slices: Sequence[ActivationSlice]) -> np.ndarray:
    """The `[n, 2]` operand of the slices' first samples and counts the kernels that read or
    write one array per slice take (with the arrays' addresses and shapes from XLA)."""
    return np.array([(first, count) for first, count, _ in slices], np.int32).reshape(-1, 2)


def row_gradients_buffers(flat: FlatBuffers, grads: jax.Array, layout: StackLayout,
                          minibatch: jax.Array | int = 0, num_minibatches: jax.Array | int = 1
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`row_gradients` of one pass over a single device's packed buffers (no routing, no
    entry arrays): the whole plain buffer, or one minibatch."""
    n = buffer_capacity(layout, flat[1].shape[0])
    results = [jax.ShapeDtypeStruct((n,), np.int32),
               jax.ShapeDtypeStruct((n, grads.shape[1]), np.float32),
               jax.ShapeDtypeStruct((1,), np.int32)]
    out = ROW_GRADIENTS_BUFFERS(layout_array(layout), passes(num_minibatches, minibatch), *flat,
                                grads, results=results)
    return out[0], out[1], out[2][0]
