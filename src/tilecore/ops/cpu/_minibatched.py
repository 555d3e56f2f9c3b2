"""CPU kernels reading minibatched buffers on a single device (see `_minibatching`).

The forward kernel walks every block of every minibatch in one call: activations
accumulate over minibatches, so one pass over the pointed ranges gives the sum.
The gradient kernel lists one minibatch's entries (a bounded window of them) and
sums them per row, so the optimizer can be applied minibatch by minibatch.
Like every kernel here they never raise: pointers outside the buffer are clipped,
entries outside their shard or SparseCore are skipped, and a minibatch with more
entries than its limits allow is truncated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numba
import numpy as np

from .._backend import FlatBuffers
from .._layout import StackLayout
from ._ffi import register_kernel
from ._kernels import _aggregate, _layout_array, entry_in_range

_jit = numba.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@_jit
def _lookup_minibatched_kernel(layout, count, row_pointers, embedding_ids, sample_ids, gains,
                               table, out):
    """out[sc·samples + sample] += gain·table[p·R + id] over every block of every minibatch."""
    n, s_count, per_block, rows_per_shard, samples = (layout[0], layout[1], layout[2],
                                                      layout[3], layout[4])
    m = count[0]
    size = embedding_ids.shape[0]
    dim = table.shape[1]
    out[:] = 0.0
    previous = 0
    for k in range(min(s_count * m, row_pointers.shape[0] // per_block)):
        base_sample = (k // m) * samples
        for p in range(n):
            end = min(row_pointers[k * per_block + p], size)
            start = (previous + 7) & ~7
            previous = end
            base_row = p * rows_per_shard
            for j in range(max(start, 0), end):
                if not entry_in_range(embedding_ids[j], sample_ids[j], rows_per_shard,
                                      samples):
                    continue
                r = base_row + embedding_ids[j]
                o = base_sample + sample_ids[j]
                g = gains[j]
                for d in range(dim):
                    out[o, d] += g * table[r, d]
    return 0


@_jit
def _minibatch_entries(layout, which, row_pointers, embedding_ids, sample_ids, gains, capacity):
    """(table row, sample, gain) of one minibatch's pointed-to entries, at most `capacity`."""
    n, s_count, per_block, rows_per_shard, samples = (layout[0], layout[1], layout[2],
                                                      layout[3], layout[4])
    minibatch, m = which[0], which[1]
    size = embedding_ids.shape[0]
    rows = np.full(capacity, -1, np.int32)
    smp = np.zeros(capacity, np.int32)
    gns = np.zeros(capacity, np.float32)
    used = 0
    for s in range(s_count):
        k = s * m + minibatch
        if (k + 1) * per_block > row_pointers.shape[0]:
            break
        previous = row_pointers[k * per_block - per_block + n - 1] if k > 0 else 0
        for p in range(n):
            end = min(row_pointers[k * per_block + p], size)
            start = (previous + 7) & ~7
            previous = end
            for j in range(max(start, 0), end):
                if used == capacity:
                    return rows, smp, gns
                if not entry_in_range(embedding_ids[j], sample_ids[j], rows_per_shard,
                                      samples):
                    continue
                rows[used] = p * rows_per_shard + embedding_ids[j]
                smp[used] = s * samples + sample_ids[j]
                gns[used] = gains[j]
                used += 1
    return rows, smp, gns


@_jit
def _minibatch_row_gradients_kernel(layout, which, row_pointers, embedding_ids, sample_ids,
                                    gains, grads, unique, sums, distinct):
    rows, samples, entry_gains = _minibatch_entries(
        layout, which, row_pointers, embedding_ids, sample_ids, gains, unique.shape[0])
    return _aggregate(rows, samples, entry_gains, grads, unique, sums, distinct)


_f32, _i32 = np.float32, np.int32
LOOKUP_MINIBATCHED = register_kernel(
    "tilecore_lookup_minibatched", _lookup_minibatched_kernel,
    args=[(_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_f32, 1), (_f32, 2)],
    rets=[(_f32, 2)])
MINIBATCH_ROW_GRADIENTS = register_kernel(
    "tilecore_minibatch_row_gradients", _minibatch_row_gradients_kernel,
    args=[(_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_i32, 1), (_f32, 1), (_f32, 2)],
    rets=[(_i32, 1), (_f32, 2), (_i32, 1)])


def lookup_minibatched_buffers(flat: FlatBuffers, num_minibatches: jax.Array,
                               table: jax.Array, layout: StackLayout) -> jax.Array:
    """A single device's stacked activations summed over all minibatches of its buffers."""
    out = jax.ShapeDtypeStruct((layout.sc_per_device * layout.samples_per_sc, table.shape[1]),
                               np.float32)
    count = jnp.reshape(num_minibatches, (1,)).astype(jnp.int32)
    return LOOKUP_MINIBATCHED(_layout_array(layout), count, *flat, table, results=[out])[0]


def minibatch_capacity(layout: StackLayout, buffer_size: int) -> int:
    """Most entries one minibatch of one device can hold: every partition of every SC full."""
    return min(layout.sc_per_device * layout.num_partitions * layout.partition_span, buffer_size)


def minibatch_row_gradients_buffers(flat: FlatBuffers, grads: jax.Array,
                                    layout: StackLayout, minibatch: jax.Array,
                                    num_minibatches: jax.Array
                                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(distinct rows padded with −1, their summed gradients, count) of one minibatch."""
    capacity = minibatch_capacity(layout, flat[1].shape[0])
    which = jnp.stack([minibatch, num_minibatches]).astype(jnp.int32)
    results = [jax.ShapeDtypeStruct((capacity,), np.int32),
               jax.ShapeDtypeStruct((capacity, grads.shape[1]), np.float32),
               jax.ShapeDtypeStruct((1,), np.int32)]
    out = MINIBATCH_ROW_GRADIENTS(_layout_array(layout), which, *flat, grads, results=results)
    return out[0], out[1], out[2][0]
