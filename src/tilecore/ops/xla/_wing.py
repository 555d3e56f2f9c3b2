"""The XLA wing's kernels (see `tilecore.ops._backend.Wing` for their contracts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ...specs import OptimizerSpec
from .._activations import ActivationSlice, stack_slices, take_slices
from .._backend import FlatBuffers, RowGradients, Wing
from .._checks import quantize
from .._layout import StackLayout
from .._minibatching import buffer_entries
from .._per_device import local_rows, pool_entries, received_entries, sources, update_rows
from .._rounding import Rounding, take_rows
from .._sparse_update import apply_sparse_update
from .._variables import EmbeddingVariables


def _pool_rows(table: jax.Array, rows: jax.Array, segments: jax.Array, gains: jax.Array,
               num_segments: int, quantization: Any) -> jax.Array:
    """`Σ gain · table[row]` per segment (segments out of range are dropped).

    The entries stay in their buffers' order (by row). Sorting them by segment first, so
    that XLA could add each segment's run in registers, made criteo26's forward at batch
    65536 four times slower on an NVIDIA H200 (1.54 -> 6.41 ms), but that sort moved
    three arrays, the kind `sort_by` found slow there: with `sort_by` it is untried.
    """
    values = take_rows(table, rows, mode="fill")  # as jnp.take: a row out of range reads NaN
    values = values.astype(jnp.float32)  # half-precision rows pool in float32
    if quantization is not None:
        values = quantize(values, quantization)
    return jax.ops.segment_sum(values * gains.reshape(-1, 1), segments, num_segments=num_segments)


def row_gradients(rows: jax.Array, valid: jax.Array, samples: jax.Array, gains: jax.Array,
                  grads: jax.Array, sentinel: int) -> RowGradients:
    """Sum `gain · grads[sample]` per distinct row: (unique rows padded with `sentinel`,
    their sums, None).

    Sort-and-segment: no array proportional to the table is formed, and every
    duplicate of a row lands in one sum, so the optimizer sees each row once. The
    entries' rows, samples and gains are sorted together and the gradient rows gathered
    in that order, so no `[entries, dim]` array is permuted (one pass less over the
    largest arrays of the update). There are as many sums as the shard can hold distinct
    rows, not one per entry, so the optimizer gathers and scatters no more rows than that
    (criteo26 at batch 65536 on an NVIDIA H200: the update 17.7 -> 10.1 ms).
    """
    samples, gains, segment, unique = sorted_segments(rows, valid, samples, gains, sentinel)
    values = grads[samples] * gains.reshape(-1, 1)
    sums = jax.ops.segment_sum(values, segment, num_segments=unique.shape[0],
                               indices_are_sorted=True)
    return unique, sums, None


def sorted_segments(rows: jax.Array, valid: jax.Array, samples: jax.Array, gains: jax.Array,
                    sentinel: int) -> tuple[jax.Array, ...]:
    """The entries sorted by row (invalid ones, and any row outside `[0, sentinel)`, as
    `sentinel`, a row past the shard), stably: (their samples, their gains, each one's
    segment: its row's rank among the distinct rows, the distinct rows ascending padded
    with `sentinel` to as many as there can be: fewer than the entries where the shard
    has fewer rows). Every wing's per-row sums start here.

    On a table smaller than its buffers (criteo26's six 1,000-row tables take 1.3 M
    entries each at batch 65536) the rows are bounded by the shard, not by the entries.
    """
    inside = valid & (rows >= 0) & (rows < sentinel)
    rows = jnp.where(inside, rows, sentinel).astype(jnp.int32)
    rows, samples, gains = sort_by(rows, samples.astype(jnp.int32), gains.astype(jnp.float32))
    first = jnp.concatenate([jnp.ones((1,), bool), rows[1:] != rows[:-1]])
    segment = jnp.cumsum(first, dtype=jnp.int32) - 1
    bound = min(rows.shape[0], sentinel + 1)  # the sentinel's entries are one segment more
    heads = jnp.where(first, segment, bound)  # each segment's row written once, by its first
    unique = jnp.full((bound,), sentinel, rows.dtype).at[heads].set(rows, mode="drop")
    return samples, gains, segment, unique


def sort_by(keys: jax.Array, *values: jax.Array) -> tuple[jax.Array, ...]:
    """`keys` sorted ascending, stably, and each of `values` in the same order.

    The keys are sorted with their positions and the values gathered by position: on
    GPUs XLA sorts such a pair with CUB's radix sort, and sorting the keys with two value
    arrays instead made criteo26's training step at batch 65536 on an NVIDIA H200 take
    11.0 ms, not 8.1.
    """
    keys, order = jax.lax.sort((keys, jnp.arange(keys.shape[0], dtype=jnp.int32)),
                               num_keys=1, is_stable=True)
    return (keys, *(v[order] for v in values))


def _apply_update(variables: EmbeddingVariables, rows: jax.Array, sums: jax.Array,
                  spec: OptimizerSpec, step: Any, clip: tuple[float, float] | None,
                  count: jax.Array | None, rounding: Rounding | None) -> EmbeddingVariables:
    del count  # padding rows hold a sentinel past the shard: their scatters are dropped
    return apply_sparse_update(variables, rows, sums, spec, step, clip=clip, rounding=rounding)


def lookup_local(flat: FlatBuffers, table: jax.Array, layout: StackLayout,
                 num_minibatches: jax.Array, slices: Sequence[ActivationSlice]
                 ) -> list[jax.Array]:
    """One device's activations of each slice (see `pooled_locally`)."""
    return take_slices(pooled_locally(WING, flat, table, layout, num_minibatches), layout,
                       slices)


def pooled_locally(kernels: Wing, flat: FlatBuffers, table: jax.Array, layout: StackLayout,
                   num_minibatches: jax.Array) -> jax.Array:
    """One device's activations, its entries pooled by `kernels.pool` (this wing's, or
    another wing's that shares the rest of this one). Minibatches only add up
    activations, so minibatched buffers are read in one pass (a loop with a traced trip
    count costs a device-host round trip per iteration on GPUs)."""
    if not layout.minibatched:
        return pool_entries(received_entries(flat, layout, None), table, layout, None, kernels)
    entries, source = buffer_entries(*flat, layout, num_minibatches)
    per_device = layout.sc_per_device * layout.samples_per_sc
    segments = jnp.where(entries.valid, source * layout.samples_per_sc + entries.sample_ids,
                         per_device)
    return kernels.pool(table, local_rows(entries, layout, None), segments, entries.gains,
                        per_device, layout.quantization)


def update_local(flat: FlatBuffers, grads: Sequence[jax.Array],
                 slices: Sequence[ActivationSlice], variables: EmbeddingVariables,
                 layout: StackLayout, spec: OptimizerSpec, step: Any,
                 clip: tuple[float, float] | None, num_minibatches: jax.Array,
                 rounding: Rounding | None) -> EmbeddingVariables:
    """One device's update (see `updated_locally`)."""
    return updated_locally(WING, flat, grads, slices, variables, layout, spec, step, clip,
                           num_minibatches, rounding)


def updated_locally(kernels: Wing, flat: FlatBuffers, grads: Sequence[jax.Array],
                    slices: Sequence[ActivationSlice], variables: EmbeddingVariables,
                    layout: StackLayout, spec: OptimizerSpec, step: Any,
                    clip: tuple[float, float] | None, num_minibatches: jax.Array,
                    rounding: Rounding | None) -> EmbeddingVariables:
    """One device's update by `kernels.row_gradients` and `kernels.apply_update` (this
    wing's, or another's that shares the rest of this one), from the slices' gradients
    stacked into one block. Every occurrence of a row lies in one minibatch
    (preprocessing buckets rows by hash), so the minibatches update disjoint rows and
    minibatched buffers are applied in a single pass: the same result as a pass per
    minibatch, at about the standard layout's cost, without a loop that carries the
    tables (at M=1 that loop made the criteo26 training step 2.1x the standard one on
    CPU, 1.5x on GPU)."""
    if layout.minibatched:
        entries, source = buffer_entries(*flat, layout, num_minibatches)
    else:
        entries = received_entries(flat, layout, None)
        source = sources(entries)
    block = stack_slices(grads, layout, slices)
    return update_rows(entries, source, block, variables, layout, spec, step, None, clip,
                       kernels, rounding)


WING = Wing(name="xla", pool=_pool_rows, row_gradients=row_gradients,
            apply_update=_apply_update, lookup_local=lookup_local, update_local=update_local)
