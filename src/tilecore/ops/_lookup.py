"""Forward pass: pooled embedding activations from packed COO buffers (the public
`lookup`: per device through `_per_device`, in `shard_map` over a mesh)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..preprocessing import PreprocessedBatch, StackBuffers
from ..specs import DEFAULT_AXIS
from ..stacking import StackingPlan
from . import _checks as checks
from ._activations import feature_slices, whole_block
from ._contract import VARIABLES_REMEDY, check_call, check_names
from ._eager import ByIdentity, device_arrays, should_jit
from ._layout import stack_layouts
from ._per_device import lookup_stack
from ._placement import explicit_axis
from ._variables import EmbeddingVariables


def on_mesh(mesh: Mesh, axis: str, *trees: object) -> tuple:
    """The trees' arrays split over `axis` of `mesh` by their leading dimension."""
    spec = NamedSharding(mesh, PartitionSpec(axis))
    explicit = explicit_axis(mesh, axis)
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

    JAX's transformations apply on every wing: `jax.grad`/`jvp`/`vjp` with respect to the
    tables give their dense gradient (for training, `embed` + `lookup_grad` never form
    it), and `jax.vmap` maps over a leading axis of the batch's buffers.

    Args:
      plan: the stacking plan the batch was preprocessed with.
      batch: preprocessed buffers with a leading device dimension (`[G, size]`).
      tables: stack name → the stack's variables (or bare table), sharded by rows
        over `axis` of `mesh` when there are several devices.
      mesh, axis: the device mesh and the axis tables and batches are split over;
        None for a single device.
      stacked: return each stack's `[G·S·samples, dim]` block instead of
        per-feature `[batch, dim]` activations.
      check_finite: fail the computation if an activation is NaN or Inf (a debugging
        aid; it costs a host round trip): a host callback raises `FloatingPointError`
        naming the stack, which JAX hands on as a `jax.errors.JaxRuntimeError` holding
        that message, when the result is computed.

    Returns:
      Feature name → `[batch, embedding_dim]` (or stack name → stacked block).
    """
    layouts = stack_layouts(plan)
    check_call(plan, batch, mesh, axis, "lookup")
    check_names("lookup", "the tables", tables, plan.stacks, VARIABLES_REMEDY)
    tables = device_arrays(dict(tables))
    if should_jit(batch, tables):
        return _compiled_lookup(ByIdentity(plan), batch, dict(tables), mesh=mesh, axis=axis,
                                stacked=stacked, check_finite=check_finite)

    def per_device(buffers: Mapping[str, StackBuffers], tabs: Mapping[str, jax.Array],
                   num_minibatches: jax.Array) -> dict[str, jax.Array]:
        out: dict[str, jax.Array] = {}
        for name, layout in layouts.items():
            slices = {name: whole_block(layout)} if stacked else feature_slices(plan, name)
            activations = lookup_stack(buffers[name], tabs[name], layout,
                                       None if mesh is None else axis, num_minibatches,
                                       list(slices.values()))
            if check_finite:
                checks.check_finite(activations, stack=name, what="activations")
            out.update(zip(slices, activations, strict=True))
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


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("mesh", "axis", "stacked", "check_finite"))
def _compiled_lookup(plan: ByIdentity[StackingPlan], batch: PreprocessedBatch,
                     tables: Mapping[str, EmbeddingVariables | jax.Array], **options: Any
                     ) -> dict[str, jax.Array]:
    """`lookup` called eagerly, as one program (`_eager`)."""
    return lookup(plan.value, batch, tables, **options)
