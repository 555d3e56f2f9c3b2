"""Forward pass: pooled embedding activations from packed COO buffers."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..preprocessing import PreprocessedBatch, StackBuffers
from ..stacking import StackingPlan
from . import _checks as checks
from ._activations import unstack_activations
from ._checks import quantize
from ._cpu_kernels import lookup_buffers, use_cpu_kernels
from ._cpu_minibatched import lookup_minibatched_buffers
from ._ffi import gather_pool
from ._layout import StackLayout, stack_layouts
from ._minibatching import MAX_MINIBATCHES, buffer_entries, check_sizes, minibatch_windows
from ._routing import Entries, exchange, slot_entries, windows_by_device
from ._variables import EmbeddingVariables

DEFAULT_AXIS = "sparsecore"


FlatBuffers = tuple[jax.Array, jax.Array, jax.Array, jax.Array]
"""One device's `(row_pointers, embedding_ids, sample_ids, gains)`, each 1-D."""


def flat_buffers(buffers: StackBuffers) -> FlatBuffers:
    """One device's `(row_pointers, embedding_ids, sample_ids, gains)`, flattened."""
    rp, eids, sids, gains = (jnp.asarray(x).reshape(-1) for x in (
        buffers.row_pointers, buffers.embedding_ids, buffers.sample_ids, buffers.gains))
    return rp, eids, sids, gains


def received_entries(buffers: StackBuffers, layout: StackLayout, axis: str | None) -> Entries:
    """Entries addressed to this device's partitions, `[G(source), S(source SC), K]`.

    With one device that is the whole slot (`[1, S, slot]`), without communication.
    """
    rp, eids, sids, gains = flat_buffers(buffers)
    entries = slot_entries(rp, eids, sids, gains, layout)
    if layout.num_devices == 1:
        return Entries(*(x[None] for x in entries))
    assert axis is not None
    return exchange(windows_by_device(entries, rp, layout), axis)


def received_minibatch(flat: FlatBuffers, layout: StackLayout, axis: str | None,
                       minibatch: jax.Array, num_minibatches: jax.Array) -> Entries:
    """`received_entries` of one minibatch of minibatched buffers (`[G, S, K]` windows)."""
    entries = minibatch_windows(*flat, layout, minibatch, num_minibatches)
    if layout.num_devices == 1:
        return entries
    assert axis is not None
    return exchange(entries, axis)


def local_rows(entries: Entries, layout: StackLayout, axis: str | None) -> jax.Array:
    """Row of each entry in this device's table shard (0 for invalid entries)."""
    first = 0 if layout.num_devices == 1 else jax.lax.axis_index(axis) * layout.sc_per_device
    rows = (entries.partitions - first) * layout.rows_per_shard + entries.embedding_ids
    return jnp.where(entries.valid, rows, 0)


def sample_segments(entries: Entries, layout: StackLayout) -> jax.Array:
    """Segment of each entry in the `[G·S·samples]` pooled output (out of range if invalid)."""
    g, s, b = entries.valid.shape[0], layout.sc_per_device, layout.samples_per_sc
    source = jnp.arange(g * s, dtype=jnp.int32).reshape(g, s, 1)
    return jnp.where(entries.valid, source * b + entries.sample_ids, g * s * b)


def pool_entries(entries: Entries, table: jax.Array, layout: StackLayout, axis: str | None,
                 cpu: bool) -> jax.Array:
    """This device's `[S·samples_per_sc, dim]` activations from the entries it received."""
    g, per_device = entries.valid.shape[0], layout.sc_per_device * layout.samples_per_sc
    rows = local_rows(entries, layout, axis).reshape(-1)
    segments = sample_segments(entries, layout).reshape(-1)
    if cpu:
        pooled = gather_pool(table, rows, segments, entries.gains.reshape(-1), g * per_device)
    else:
        pooled = _pool(table, rows, segments, entries.gains.reshape(-1), layout, g * per_device)
    if layout.num_devices == 1:
        return pooled
    pooled = pooled.reshape(g, per_device, layout.dim)
    return jax.lax.all_to_all(pooled, axis, 0, 0, tiled=True).sum(0)


def _pool(table: jax.Array, rows: jax.Array, segments: jax.Array, gains: jax.Array,
          layout: StackLayout, num_segments: int) -> jax.Array:
    """`Σ gain · table[row]` per segment with XLA ops (segments out of range are dropped)."""
    values = jnp.take(table, rows, axis=0)
    if layout.quantization is not None:
        values = quantize(values, layout.quantization)
    return jax.ops.segment_sum(values * gains.reshape(-1, 1), segments, num_segments=num_segments)


def lookup_stack(buffers: StackBuffers, table: jax.Array, layout: StackLayout,
                 axis: str | None = None, num_minibatches: jax.Array | int = 1) -> jax.Array:
    """One device's stacked activations `[S·samples_per_sc, dim]` (inside shard_map if G>1).

    Minibatched buffers are read one minibatch at a time on a mesh (a loop of
    `num_minibatches` passes with static shapes, one all-to-all each), accumulating
    the activations; on one device in one pass, as the sum is the same.
    """
    cpu = use_cpu_kernels() and layout.quantization is None
    if layout.minibatched:
        return _lookup_minibatched(buffers, table, layout, axis, num_minibatches, cpu)
    if layout.num_devices == 1 and cpu:
        return lookup_buffers(buffers, table, layout)
    return pool_entries(received_entries(buffers, layout, axis), table, layout, axis, cpu)


def _lookup_minibatched(buffers: StackBuffers, table: jax.Array, layout: StackLayout,
                        axis: str | None, num_minibatches: jax.Array | int, cpu: bool
                        ) -> jax.Array:
    flat = flat_buffers(buffers)
    check_sizes(flat[0], flat[1], layout)
    count = jnp.clip(jnp.asarray(num_minibatches, jnp.int32).reshape(()), 1, MAX_MINIBATCHES)
    if layout.num_devices == 1:
        if cpu:
            return lookup_minibatched_buffers(flat, count, table, layout)
        # Minibatches only add up activations: on one device, read them all in one pass
        # (a loop with a traced trip count costs a device-host round trip per iteration
        # on GPUs).
        entries, source = buffer_entries(*flat, layout, count)
        per_device = layout.sc_per_device * layout.samples_per_sc
        segments = jnp.where(entries.valid, source * layout.samples_per_sc + entries.sample_ids,
                             per_device)
        return _pool(table, local_rows(entries, layout, None), segments, entries.gains, layout,
                     per_device)

    def body(minibatch: jax.Array, total: jax.Array) -> jax.Array:
        entries = received_minibatch(flat, layout, axis, minibatch, count)
        return total + pool_entries(entries, table, layout, axis, cpu)

    zeros = jnp.zeros((layout.sc_per_device * layout.samples_per_sc, table.shape[1]), table.dtype)
    return jax.lax.fori_loop(0, count, body, zeros)


def on_mesh(mesh: Mesh, axis: str, *trees: object) -> tuple:
    """The trees' arrays split over `axis` of `mesh` by their leading dimension."""
    spec = NamedSharding(mesh, PartitionSpec(axis))
    explicit = mesh.axis_types[mesh.axis_names.index(axis)] == jax.sharding.AxisType.Explicit
    place = (lambda x: jax.reshard(x, spec)) if explicit else (
        lambda x: jax.lax.with_sharding_constraint(x, spec))
    return tuple(jax.tree.map(place, tree) for tree in trees)


def num_minibatches_of(batch: PreprocessedBatch) -> jax.Array:
    """The batch's minibatch count as an int32 scalar (traced under jit: no recompilation).

    The reference system keeps one count per local device (`[local_devices]`); every
    device runs the same number of minibatches, so any entry will do.
    """
    count = jnp.asarray(batch.num_minibatches, jnp.int32)
    return count.reshape(-1)[0] if count.ndim else count


def _table_of(value: EmbeddingVariables | jax.Array) -> jax.Array:
    return value.table if isinstance(value, EmbeddingVariables) else value


def lookup(
    plan: StackingPlan,
    batch: PreprocessedBatch,
    tables: Mapping[str, EmbeddingVariables | jax.Array],
    *,
    mesh: Mesh | None = None,
    axis: str = DEFAULT_AXIS,
    stacked: bool = False,
    check_finite: bool = False,
) -> dict[str, jax.Array]:
    """Pooled activations: `out[sample] = Σ gain · table[row]` over the sample's entries.

    Args:
      plan: the stacking plan the batch was preprocessed with.
      batch: preprocessed buffers with a leading device dimension (`[G, size]`).
      tables: stack name → the stack's variables (or bare table), sharded by rows
        over `axis` of `mesh` when there are several devices.
      mesh, axis: the device mesh and the axis tables and batches are split over;
        None for a single device.
      stacked: return each stack's `[G·S·samples, dim]` block instead of
        per-feature `[batch, dim]` activations.
      check_finite: raise `FloatingPointError` naming the stack if an activation
        is NaN or Inf (a debugging aid; it costs a host round trip).

    Returns:
      Feature name → `[batch, embedding_dim]` (or stack name → stacked block).
    """
    layouts = stack_layouts(plan)
    devices = plan.topology.global_devices
    if mesh is None and devices != 1:
        raise ValueError(f"The plan spans {devices} devices; pass the mesh they form.")

    def per_device(buffers: Mapping[str, StackBuffers], tabs: Mapping[str, jax.Array],
                   num_minibatches: jax.Array) -> dict[str, jax.Array]:
        out: dict[str, jax.Array] = {}
        for name, layout in layouts.items():
            block = lookup_stack(buffers[name], tabs[name], layout, None if mesh is None else axis,
                                 num_minibatches)
            if check_finite:
                checks.check_finite(block, stack=name, what="activations")
            out.update({name: block} if stacked else
                       unstack_activations(plan, name, block, layout))
        return out

    tabs = {name: _table_of(tables[name]) for name in layouts}
    count = num_minibatches_of(batch)
    if mesh is None:
        return per_device(batch.stacks, tabs, count)
    sharded = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(PartitionSpec(axis), PartitionSpec(axis), PartitionSpec()),
        out_specs=PartitionSpec(axis), check_vma=False,
    )
    stacks, tabs = on_mesh(mesh, axis, dict(batch.stacks), tabs)
    return sharded(stacks, tabs, count)


