"""The reference's device functions as adapters over `tilecore.ops` (imports JAX).

The reference's `tpu_sparse_dense_matmul(_grad)` run per device: users wrap them
in `shard_map` over the mesh (in_specs `P(axis)`, check_rep off) and each call
sees one device's flat buffers, table shard and activations. Compat does the same
when it finds itself inside `shard_map` (the context mesh has manual axes): the
per-device steps of `tilecore.ops` run with the collectives over those axes.

Called outside `shard_map` compat works on global arrays instead: flat
`[local_devices·size]` (or `[local_devices, size]`) buffers, `[N·R, dim]` tables
sharded by rows, `[batch, dim]` activations. With several devices it wraps the
same per-device steps in `shard_map` itself, over a mesh taken from `mesh=`, else
from the tables' sharding (`jax.typeof(table).sharding` under `jit`), else from
the context mesh (`jax.set_mesh`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .. import ops
from ..ops._per_device import lookup_grad_stack, lookup_stack
from ..preprocessing import StackBuffers
from ..stacking import StackingPlan

Axis = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the call runs: per device inside `shard_map`, or on global arrays."""

    per_device: bool
    mesh: Any = None  # Mesh or AbstractMesh for global calls over several devices
    axis: Axis = None


def _axis_of(names: tuple[str, ...]) -> Axis:
    return names[0] if len(names) == 1 else names


def _mesh_size(mesh: Any, axis: Axis) -> int:
    names = (axis,) if isinstance(axis, str) else tuple(axis or ())
    return math.prod(mesh.shape[name] for name in names)


def placement(global_device_count: int, table: Any, mesh: Any = None) -> Placement:
    """Per device (inside `shard_map`) or global; for global calls, the mesh and axis."""
    context = jax.sharding.get_abstract_mesh()
    manual = tuple(n for n in context.axis_names if n in getattr(context, "manual_axes", ()))
    if manual:
        axis = _axis_of(manual)
        if _mesh_size(context, axis) != global_device_count:
            raise ValueError(
                f"Inside shard_map over axes {manual} of {_mesh_size(context, axis)} devices, "
                f"but global_device_count={global_device_count}; pass the mesh size."
            )
        return Placement(per_device=True, axis=None if global_device_count == 1 else axis)
    if global_device_count == 1:
        return Placement(per_device=False)
    axis: Axis = None
    if mesh is None:
        sharding = jax.typeof(table).sharding
        mesh = getattr(sharding, "mesh", None)
        spec = getattr(sharding, "spec", ())
        if spec and spec[0] is not None:
            axis = spec[0]
    if (mesh is None or mesh.empty) and not context.empty:
        mesh = context
    if mesh is None or mesh.empty:
        raise ValueError(
            f"global_device_count={global_device_count} but no mesh was found: call inside "
            "shard_map (as the reference does), pass tables sharded over a mesh (e.g. from "
            "init_embedding_variables), or use `with jax.set_mesh(mesh):`."
        )
    axis = axis or _axis_of(tuple(mesh.axis_names))
    if _mesh_size(mesh, axis) != global_device_count:
        raise ValueError(
            f"The mesh {dict(mesh.shape)} splits tables over {axis!r} "
            f"({_mesh_size(mesh, axis)} devices) but global_device_count={global_device_count}."
        )
    return Placement(per_device=False, mesh=mesh, axis=axis)


def run_placed(where: Placement, fn: Callable[..., Any], *args: Any, replicated: int = 0) -> Any:
    """`fn(*args)` per device: directly, or in `shard_map` over the mesh for global arrays.

    The last `replicated` arguments are the same on every device (e.g. the step).
    """
    if where.per_device or where.mesh is None:
        return fn(*args)
    split = PartitionSpec(where.axis)
    specs = (split,) * (len(args) - replicated) + (PartitionSpec(),) * replicated
    return jax.shard_map(fn, mesh=where.mesh, in_specs=specs, out_specs=split,
                         check_vma=False)(*args)


def matmul_input_parts(preprocessed_inputs: Any) -> Any:
    """The `SparseDenseMatmulInput` of a `PreprocessedInput` (or the input itself)."""
    return getattr(preprocessed_inputs, "sparse_dense_matmul_input", preprocessed_inputs)


def buffers(parts: Any, name: str) -> StackBuffers:
    return StackBuffers(
        row_pointers=parts.lhs_row_pointers[name], embedding_ids=parts.lhs_embedding_ids[name],
        sample_ids=parts.lhs_sample_ids[name], gains=parts.lhs_gains[name],
    )


def flat_table(table: jax.Array) -> jax.Array:
    """A table shard `[rows, dim]`. Also accepted, as by the reference: pmap-style
    `[1, rows, dim]`, and rank-1 `[rows]` tables of width 1 (updated in their shape)."""
    if table.ndim == 1:
        return table.reshape(-1, 1)
    return table.reshape(-1, table.shape[-1]) if table.ndim == 3 else table


def minibatch_count(num_minibatches: Any) -> jax.Array:
    """One device's minibatch count as an int32 scalar, from the reference's per-device
    `num_minibatches` (`[local_devices]`, `[local_devices, 1]`, or a scalar): every device
    runs the same number of minibatches."""
    count = jnp.asarray(num_minibatches, jnp.int32)
    return count.reshape(-1)[0] if count.ndim else count


def lookup_stacks(plan: StackingPlan, stacks: Mapping[str, StackBuffers],
                  tables: Mapping[str, jax.Array], axis: Axis,
                  num_minibatches: Any = 1) -> dict[str, jax.Array]:
    """One device's stacked activations `[S·samples_per_sc, dim]` for every stack."""
    layouts = ops.stack_layouts(plan)
    count = minibatch_count(num_minibatches)
    return {name: lookup_stack(stacks[name], flat_table(tables[name]), layout, axis, count)[0]  # pyright: ignore[reportArgumentType]
            for name, layout in layouts.items()}


def update_stacks(plan: StackingPlan, stacks: Mapping[str, StackBuffers],
                  variables: Mapping[str, Any], grads: Mapping[str, jax.Array], step: Any,
                  axis: Axis, clip: Mapping[str, tuple[float, float]],
                  num_minibatches: Any = 1) -> dict[str, Any]:
    """One device's updated `(table, slots)` of every stack (shapes as given)."""
    count = minibatch_count(num_minibatches)
    out = {}
    for name, layout in ops.stack_layouts(plan).items():
        table, slots = variables[name]
        flat = ops.EmbeddingVariables(flat_table(table), tuple(flat_table(s) for s in slots))
        new = lookup_grad_stack(
            stacks[name], [jnp.asarray(grads[name], jnp.float32).reshape(-1, layout.dim)], flat,
            layout, plan.stacks[name].optimizer, step, axis, clip.get(name), count,  # pyright: ignore[reportArgumentType]
        )
        out[name] = (new.table.reshape(table.shape),
                     tuple(n.reshape(s.shape) for n, s in zip(new.slots, slots, strict=True)))
    return out


def context_device_count() -> int:
    """Devices of the enclosing `shard_map`'s manual axes (1 outside `shard_map`)."""
    context = jax.sharding.get_abstract_mesh()
    manual = getattr(context, "manual_axes", ())
    return math.prod(context.shape[n] for n in context.axis_names if n in manual)
