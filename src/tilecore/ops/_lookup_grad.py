"""Backward pass fused with the optimizer: per-row gradients, then the row update."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from ..preprocessing import PreprocessedBatch, StackBuffers
from ..specs import OptimizerSpec
from ..stacking import StackingPlan
from . import _checks as checks
from ._activations import stack_gradients
from ._cpu_kernels import row_gradients as cpu_row_gradients
from ._cpu_kernels import row_gradients_buffers, use_cpu_kernels
from ._cpu_minibatched import minibatch_row_gradients_buffers
from ._layout import StackLayout, stack_layouts
from ._lookup import (
    DEFAULT_AXIS,
    flat_buffers,
    local_rows,
    num_minibatches_of,
    on_mesh,
    received_entries,
    received_minibatch,
)
from ._minibatching import MAX_MINIBATCHES, buffer_entries, check_sizes
from ._routing import Entries
from ._sparse_update import apply_sparse_update
from ._variables import EmbeddingVariables


def row_gradients(rows: jax.Array, values: jax.Array, sentinel: int
                  ) -> tuple[jax.Array, jax.Array]:
    """Sum `values` per distinct row: (unique rows padded with `sentinel`, their sums).

    Sort-and-segment: no array proportional to the table is formed, and every
    duplicate of a row lands in one sum, so the optimizer sees each row once.
    """
    order = jnp.argsort(rows)
    rows_sorted = rows[order]
    first = jnp.concatenate([jnp.ones((1,), bool), rows_sorted[1:] != rows_sorted[:-1]])
    segment = jnp.cumsum(first) - 1
    size = rows.shape[0]
    sums = jax.ops.segment_sum(values[order], segment, num_segments=size, indices_are_sorted=True)
    unique = jnp.full((size,), sentinel, rows.dtype).at[segment].set(rows_sorted)
    return unique, sums


def lookup_grad_stack(buffers: StackBuffers, grads: jax.Array, variables: EmbeddingVariables,
                      layout: StackLayout, optimizer: OptimizerSpec, step: Any,
                      axis: str | None = None, clip: tuple[float, float] | None = None,
                      num_minibatches: jax.Array | int = 1) -> EmbeddingVariables:
    """Update one device's shard of a stack from its stacked activation gradients.

    Minibatched buffers are applied one minibatch at a time (the optimizer runs once
    per minibatch, on that minibatch's rows, as on the reference system).
    """
    if layout.minibatched:
        return _lookup_grad_minibatched(buffers, grads, variables, layout, optimizer, step, axis,
                                        clip, num_minibatches)
    if layout.num_devices == 1 and use_cpu_kernels():
        unique, sums, count = row_gradients_buffers(buffers, grads, layout)
        return apply_sparse_update(variables, unique, sums, optimizer, step, clip=clip,
                                   count=count)
    entries = received_entries(buffers, layout, axis)
    return _update_from_entries(entries, _all_grads(grads, layout, axis), variables, layout,
                                optimizer, step, axis, clip)


def _all_grads(grads: jax.Array, layout: StackLayout, axis: str | None) -> jax.Array:
    """`[G·S·samples, dim]`: the activation gradients of every source device."""
    if layout.num_devices > 1:
        grads = jax.lax.all_gather(grads, axis)  # [G, S·samples, dim]
    return grads.reshape(-1, layout.dim)


def _update_from_entries(entries: Entries, grads: jax.Array, variables: EmbeddingVariables,
                         layout: StackLayout, optimizer: OptimizerSpec, step: Any,
                         axis: str | None, clip: tuple[float, float] | None
                         ) -> EmbeddingVariables:
    """Sum the received entries' gradients per row and apply the optimizer to those rows."""
    g, s = entries.valid.shape[0], layout.sc_per_device
    source = jnp.arange(g * s, dtype=jnp.int32).reshape(g, s, 1)
    return _update_rows(entries, source, grads, variables, layout, optimizer, step, axis, clip)


def _update_rows(entries: Entries, source: jax.Array, grads: jax.Array,
                 variables: EmbeddingVariables, layout: StackLayout, optimizer: OptimizerSpec,
                 step: Any, axis: str | None, clip: tuple[float, float] | None
                 ) -> EmbeddingVariables:
    """`_update_from_entries` with each entry's source SparseCore given (broadcastable)."""
    sample = jnp.where(entries.valid, source * layout.samples_per_sc + entries.sample_ids,
                       0).reshape(-1)
    if use_cpu_kernels():
        rows = jnp.where(entries.valid, local_rows(entries, layout, axis), -1).reshape(-1)
        unique, sums, count = cpu_row_gradients(rows, sample, entries.gains.reshape(-1), grads)
        return apply_sparse_update(variables, unique, sums, optimizer, step, clip=clip,
                                   count=count)
    values = grads[sample] * entries.gains.reshape(-1, 1)
    sentinel = layout.rows_per_device
    rows = jnp.where(entries.valid, local_rows(entries, layout, axis), sentinel).reshape(-1)
    unique, sums = row_gradients(rows, values, sentinel)
    return apply_sparse_update(variables, unique, sums, optimizer, step, clip=clip)


def _lookup_grad_minibatched(buffers: StackBuffers, grads: jax.Array,
                             variables: EmbeddingVariables, layout: StackLayout,
                             optimizer: OptimizerSpec, step: Any, axis: str | None,
                             clip: tuple[float, float] | None, num_minibatches: jax.Array | int
                             ) -> EmbeddingVariables:
    """Minibatched buffers: one device's update, whatever the minibatch count.

    Every occurrence of a row lies in one minibatch (preprocessing buckets rows by
    hash), so the minibatches update disjoint rows. On one device with XLA ops the
    whole buffer is therefore read and applied in a single pass (`buffer_entries`):
    same result as a pass per minibatch, at about the standard layout's cost, without
    a loop that carries the tables (at M=1 that loop made the criteo26 training step
    2.1x the standard one with XLA on CPU, 1.5x on GPU). The CPU kernels and meshes
    loop over the minibatches (a mesh exchanges one minibatch's windows at a time).
    """
    flat = flat_buffers(buffers)
    check_sizes(flat[0], flat[1], layout)
    count = jnp.clip(jnp.asarray(num_minibatches, jnp.int32).reshape(()), 1, MAX_MINIBATCHES)
    single = layout.num_devices == 1
    if single and not use_cpu_kernels():
        entries, source = buffer_entries(*flat, layout, count)
        return _update_rows(entries, source, grads.reshape(-1, layout.dim), variables, layout,
                            optimizer, step, axis, clip)
    grads = grads.reshape(-1, layout.dim) if single else _all_grads(grads, layout, axis)

    def body(minibatch: jax.Array, variables: EmbeddingVariables) -> EmbeddingVariables:
        if single:
            unique, sums, distinct = minibatch_row_gradients_buffers(
                flat, grads, layout, minibatch, count)
            return apply_sparse_update(variables, unique, sums, optimizer, step, clip=clip,
                                       count=distinct)
        entries = received_minibatch(flat, layout, axis, minibatch, count)
        return _update_from_entries(entries, grads, variables, layout, optimizer, step, axis,
                                    clip)

    return jax.lax.fori_loop(0, count, body, EmbeddingVariables(variables.table,
                                                                 tuple(variables.slots)))


def lookup_grad(
    plan: StackingPlan,
    batch: PreprocessedBatch,
    variables: Mapping[str, EmbeddingVariables],
    activation_grads: Mapping[str, jax.Array],
    step: Any = 0,
    *,
    mesh: Mesh | None = None,
    axis: str = DEFAULT_AXIS,
    stacked: bool = False,
    clip: Mapping[str, tuple[float, float]] | None = None,
    check_finite: bool = False,
    serialize_stacks: bool = False,
) -> dict[str, EmbeddingVariables]:
    """Apply each stack's optimizer to the rows the batch touched.

    Per touched row `g = Σ gain · grad[sample]` over every entry of the step (all
    devices), then the stack's update rule on those rows only; untouched rows
    and slots are unchanged. Donate `variables` (jit `donate_argnums`) to update
    in place.

    Args:
      activation_grads: feature name → `[batch, dim]` gradients of the
        activations `lookup` returned (stack name → stacked block if `stacked`).
      step: the global 0-based step (schedules, Adam/LaProp bias correction).
      clip: stack name → (min, max) applied to the table values after the update.
      check_finite: raise `FloatingPointError` naming the stack if an updated table
        or slot holds NaN or Inf (a debugging aid).
      serialize_stacks: update the stacks one after another, so that only one
        stack's temporaries are alive at a time (lower peak memory, less overlap).
    """
    layouts = stack_layouts(plan)
    devices = plan.topology.global_devices
    if mesh is None and devices != 1:
        raise ValueError(f"The plan spans {devices} devices; pass the mesh they form.")
    clip = dict(clip or {})
    unknown = sorted(set(clip) - set(layouts))
    if unknown:
        raise ValueError(f"clip names unknown stacks {unknown}; stacks: {sorted(layouts)}.")

    def per_device(buffers: Mapping[str, StackBuffers], tables: Mapping[str, EmbeddingVariables],
                   grads: Mapping[str, jax.Array], step: Any, num_minibatches: jax.Array
                   ) -> dict[str, EmbeddingVariables]:
        def one_stack(name: str) -> Callable[[Any], EmbeddingVariables]:
            layout = layouts[name]

            def run(inputs: tuple[StackBuffers, Any, EmbeddingVariables]) -> EmbeddingVariables:
                stack_buffers, stack_grads, stack_variables = inputs
                block = (stack_grads if stacked else
                         stack_gradients(plan, name, dict(stack_grads), layout))
                new = lookup_grad_stack(
                    stack_buffers, block, stack_variables, layout, plan.stacks[name].optimizer,
                    step, None if mesh is None else axis, clip.get(name), num_minibatches,
                )
                if check_finite:
                    for array in (new.table, *new.slots):
                        checks.check_finite(array, stack=name, what="updated variables")
                return new

            return run

        work = [
            (one_stack(name),
             (buffers[name], grads[name] if stacked else
              {f: grads[f] for f in plan.stacks[name].feature_names}, tables[name]))
            for name in layouts
        ]
        if serialize_stacks:
            results = checks.one_after_another(work)
        else:
            results = [fn(inputs) for fn, inputs in work]
        return dict(zip(layouts, results, strict=True))

    tables = {name: variables[name] for name in layouts}
    step = jnp.asarray(step, jnp.int32)  # one compiled program whatever the step's Python type
    count = num_minibatches_of(batch)
    if mesh is None:
        return per_device(batch.stacks, tables, activation_grads, step, count)
    sharded = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(PartitionSpec(axis), PartitionSpec(axis), PartitionSpec(axis), PartitionSpec(),
                  PartitionSpec()),
        out_specs=PartitionSpec(axis), check_vma=False,
    )
    stacks, tables, grads = on_mesh(mesh, axis, dict(batch.stacks), tables, dict(activation_grads))
    return sharded(stacks, tables, grads, step, count)
