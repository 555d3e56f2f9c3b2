"""One device's work on one stack, shared by every wing (inside `shard_map` when G > 1).

On one device a wing reads its own buffers directly (`Wing.lookup_local`,
`Wing.update_local`). On a mesh the entries travel to the device that owns their
partition (`_routing`), one minibatch at a time for minibatched buffers, and the
wing's kernels pool them (`Wing.pool`) or sum their gradients per row and apply
the optimizer (`Wing.row_gradients`, `Wing.apply_update`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..preprocessing import StackBuffers
from ..specs import OptimizerSpec
from ._activations import ActivationSlice, stack_slices, take_slices, whole_block
from ._backend import FlatBuffers, Wing, lookup_wing, wing
from ._contract import (
    check_buffers,
    check_grads,
    check_table,
    check_table_dtype,
    check_variables,
)
from ._layout import StackLayout
from ._minibatching import MAX_MINIBATCHES, minibatch_windows
from ._rounding import Rounding, rounding_key
from ._routing import Entries, exchange, slot_entries, windows_by_device
from ._variables import EmbeddingVariables


def flat_buffers(buffers: StackBuffers) -> FlatBuffers:
    """One device's `(row_pointers, embedding_ids, sample_ids, gains)`, flattened."""
    rp, eids, sids, gains = (jnp.asarray(x).reshape(-1) for x in (
        buffers.row_pointers, buffers.embedding_ids, buffers.sample_ids, buffers.gains))
    return rp, eids, sids, gains


def minibatch_count(layout: StackLayout, num_minibatches: jax.Array | int) -> jax.Array:
    """The minibatch count as an int32 scalar in [1, 64] (1 without minibatching)."""
    if not layout.minibatched:
        return jnp.int32(1)
    return jnp.clip(jnp.asarray(num_minibatches, jnp.int32).reshape(()), 1, MAX_MINIBATCHES)


def received_entries(flat: FlatBuffers, layout: StackLayout, axis: str | None) -> Entries:
    """Entries addressed to this device's partitions, `[G(source), S(source SC), K]`.

    With one device that is the whole slot (`[1, S, slot]`), without communication.
    """
    rp, eids, sids, gains = flat
    entries = slot_entries(rp, eids, sids, gains, layout)
    if layout.num_devices == 1:
        return Entries(*(x[None] for x in entries))
    assert axis is not None
    return exchange(windows_by_device(entries, rp, layout), axis)


def received_minibatch(flat: FlatBuffers, layout: StackLayout, axis: str,
                       minibatch: jax.Array, num_minibatches: jax.Array) -> Entries:
    """`received_entries` of one minibatch of minibatched buffers (`[G, S, K]` windows)."""
    return exchange(minibatch_windows(*flat, layout, minibatch, num_minibatches), axis)


def local_rows(entries: Entries, layout: StackLayout, axis: str | None) -> jax.Array:
    """Row of each entry in this device's table shard (0 for invalid entries)."""
    first = 0 if layout.num_devices == 1 else jax.lax.axis_index(axis) * layout.sc_per_device
    rows = (entries.partitions - first) * layout.rows_per_shard + entries.embedding_ids
    return jnp.where(entries.valid, rows, 0)


def sample_segments(entries: Entries, source: jax.Array, layout: StackLayout,
                    invalid: int) -> jax.Array:
    """Row of each entry's sample in the `[G·S·samples]` gradients/activations of its
    source SparseCore (`source`, broadcastable to the entries), `invalid` if not valid."""
    return jnp.where(entries.valid, source * layout.samples_per_sc + entries.sample_ids, invalid)


def sources(entries: Entries) -> jax.Array:
    """The source SparseCore `[G, S, 1]` of routed `[G, S, K]` entries."""
    g, s = entries.valid.shape[:2]
    return jnp.arange(g * s, dtype=jnp.int32).reshape(g, s, 1)


# --- lookup -----------------------------------------------------------------------------------


def lookup_stack(buffers: StackBuffers, table: jax.Array, layout: StackLayout,
                 axis: str | None = None, num_minibatches: jax.Array | int = 1,
                 slices: Sequence[ActivationSlice] | None = None) -> list[jax.Array]:
    """One device's activations of each slice of its `[S·samples_per_sc, dim]` block
    (inside shard_map if G>1): the features' slices, or by default the whole block.

    Minibatched buffers are read one minibatch at a time on a mesh (a loop of
    `num_minibatches` passes with static shapes, one all-to-all each), accumulating
    the activations; on one device in one pass, as the sum is the same. On one device
    the wing writes each slice's activations itself (the CPU wing's kernel writes them
    where they go, with no block to copy them out of).
    """
    kernels = lookup_wing(layout)
    slices = [whole_block(layout)] if slices is None else list(slices)
    flat = flat_buffers(buffers)
    check_buffers(flat, layout)
    check_table(table, layout)
    check_table_dtype(table, layout)
    count = minibatch_count(layout, num_minibatches)
    if layout.num_devices == 1:
        return kernels.lookup_local(flat, table, layout, count, slices)
    assert axis is not None
    if not layout.minibatched:
        block = pool_entries(received_entries(flat, layout, axis), table, layout, axis, kernels)
        return take_slices(block, layout, slices)

    def body(minibatch: jax.Array, total: jax.Array) -> jax.Array:
        entries = received_minibatch(flat, layout, axis, minibatch, count)
        return total + pool_entries(entries, table, layout, axis, kernels)

    zeros = jnp.zeros((layout.sc_per_device * layout.samples_per_sc, table.shape[1]),
                      jnp.float32)
    return take_slices(jax.lax.fori_loop(0, count, body, zeros), layout, slices)


def pool_entries(entries: Entries, table: jax.Array, layout: StackLayout, axis: str | None,
                 kernels: Wing) -> jax.Array:
    """This device's `[S·samples_per_sc, dim]` activations from the entries it received."""
    g, per_device = entries.valid.shape[0], layout.sc_per_device * layout.samples_per_sc
    rows = local_rows(entries, layout, axis).reshape(-1)
    segments = sample_segments(entries, sources(entries), layout, g * per_device).reshape(-1)
    pooled = kernels.pool(table, rows, segments, entries.gains.reshape(-1), g * per_device,
                          layout.quantization)
    if layout.num_devices == 1:
        return pooled
    pooled = pooled.reshape(g, per_device, layout.dim)
    return jax.lax.all_to_all(pooled, axis, 0, 0, tiled=True).sum(0)


# --- update -----------------------------------------------------------------------------------


def lookup_grad_stack(buffers: StackBuffers, grads: Sequence[jax.Array],
                      variables: EmbeddingVariables, layout: StackLayout,
                      optimizer: OptimizerSpec, step: Any, axis: str | None = None,
                      clip: tuple[float, float] | None = None,
                      num_minibatches: jax.Array | int = 1, rounding_seed: int = 0,
                      slices: Sequence[ActivationSlice] | None = None) -> EmbeddingVariables:
    """Update one device's shard of a stack from its activation gradients: one array per
    slice of its `[S·samples_per_sc, dim]` block (the features', each `[S·samples, width]`,
    as `_activations.feature_gradients` checks them, naming the feature), or by default
    one array, the block itself (checked here).

    On one device the wing reads each slice's gradients where they lie (the CPU wing's
    fused kernel: no block is built). Minibatched buffers are applied one minibatch at a
    time on a mesh (the optimizer runs once per minibatch, on that minibatch's rows, as on
    the reference system). A half-precision table's rows are written with stochastic
    rounding, its bits drawn from `rounding_seed`, the stack, the step and each value's
    global row and column (`_rounding`).
    """
    kernels = wing()
    flat = flat_buffers(buffers)
    check_buffers(flat, layout)
    check_variables(variables, layout, optimizer)
    if slices is None:
        (block,) = grads
        check_grads(block, layout)
        grads, slices = [block.reshape(-1, layout.dim)], [whole_block(layout)]
    count = minibatch_count(layout, num_minibatches)
    variables = EmbeddingVariables(variables.table, tuple(variables.slots))
    rounding = None
    if layout.half:
        first = 0 if layout.num_devices == 1 else jax.lax.axis_index(axis) * layout.rows_per_device
        rounding = Rounding(rounding_key(rounding_seed, layout.name, step), first)
    if layout.num_devices == 1:
        return kernels.update_local(flat, list(grads), list(slices), variables, layout,
                                    optimizer, step, clip, count, rounding)
    assert axis is not None
    block = stack_slices(grads, layout, slices)
    block = jax.lax.all_gather(block, axis).reshape(-1, layout.dim)  # every source device's
    if not layout.minibatched:
        entries = received_entries(flat, layout, axis)
        return update_rows(entries, sources(entries), block, variables, layout, optimizer,
                           step, axis, clip, kernels, rounding)

    def body(minibatch: jax.Array, variables: EmbeddingVariables) -> EmbeddingVariables:
        entries = received_minibatch(flat, layout, axis, minibatch, count)
        return update_rows(entries, sources(entries), block, variables, layout, optimizer,
                           step, axis, clip, kernels, rounding)

    return jax.lax.fori_loop(0, count, body, variables)


def update_rows(entries: Entries, source: jax.Array, grads: jax.Array,
                variables: EmbeddingVariables, layout: StackLayout, optimizer: OptimizerSpec,
                step: Any, axis: str | None, clip: tuple[float, float] | None, kernels: Wing,
                rounding: Rounding | None = None) -> EmbeddingVariables:
    """Sum the entries' gradients per row of this device's shard (each entry's source
    SparseCore given, broadcastable) and apply the optimizer to those rows."""
    samples = sample_segments(entries, source, layout, 0).reshape(-1)
    rows = local_rows(entries, layout, axis).reshape(-1)
    unique, sums, count = kernels.row_gradients(
        rows, entries.valid.reshape(-1), samples, entries.gains.reshape(-1), grads,
        layout.rows_per_device)
    return kernels.apply_update(variables, unique, sums, optimizer, step, clip, count, rounding)
