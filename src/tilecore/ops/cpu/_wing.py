"""The CPU wing's kernels (see `tilecore.ops._backend.Wing` for their contracts)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ...specs import OptimizerSpec
from .._activations import ActivationSlice, stack_slices
from .._backend import FlatBuffers, RowGradients, Wing
from .._layout import StackLayout
from .._rounding import Rounding
from .._sparse_update import updated
from .._variables import EmbeddingVariables
from ._ffi import gather_pool
from ._fused_update import fused_kernels, fused_update_buffers, fused_update_rows
from ._kernels import (
    gather_rows,
    lookup_buffers,
    passes,
    row_gradients_buffers,
    scatter_rows,
)
from ._kernels import row_gradients as _row_gradients_kernel

_CHUNK = 4096


def _pool(table: jax.Array, rows: jax.Array, segments: jax.Array, gains: jax.Array,
          num_segments: int, quantization: Any) -> jax.Array:
    assert quantization is None  # `_backend.lookup_wing` sends quantized tables to XLA
    return gather_pool(table, rows, segments, gains, num_segments)


def _row_gradients(rows: jax.Array, valid: jax.Array, samples: jax.Array, gains: jax.Array,
                   grads: jax.Array, sentinel: int) -> RowGradients:
    del sentinel  # the kernel pads with -1
    return _row_gradients_kernel(jnp.where(valid, rows, -1), samples, gains, grads)


def apply_update(variables: EmbeddingVariables, rows: jax.Array, sums: jax.Array,
                 spec: OptimizerSpec, step: Any, clip: tuple[float, float] | None,
                 count: jax.Array | None, rounding: Rounding | None = None
                 ) -> EmbeddingVariables:
    """The optimizer on the `count` leading rows only: in one fused pass when the rule
    is elementwise, else with JAX a chunk at a time (work and memory follow the
    touched rows, not the padded list). A half-precision table (`rounding` given) is
    read and written as 16-bit values either way, rounded stochastically by
    `_round16` in the fused pass, by `_rounding` in JAX on a chunk."""
    kernels = fused_kernels(spec, variables.table.dtype, variables.table.shape[1])
    if kernels is not None:
        return fused_update_rows(kernels, variables, rows, sums, spec, step, clip, count,
                                 rounding)
    real = jnp.int32(rows.shape[0]) if count is None else count
    chunk = min(_CHUNK, rows.shape[0])
    last = rows.shape[0] - chunk

    def body(i: jax.Array, variables: EmbeddingVariables) -> EmbeddingVariables:
        # The last window is shifted back to fit; rows an earlier window took are masked.
        start = jnp.minimum(i * chunk, last)
        index = start + jnp.arange(chunk)
        mine = (index >= i * chunk) & (index < real)
        part_rows = jnp.where(mine, jax.lax.dynamic_slice_in_dim(rows, start, chunk), -1)
        # Rows past `count` are the kernel's uninitialised padding: zeros, so that no
        # value of them reaches the rule (it drops those rows' results anyway).
        part_sums = jnp.where(mine[:, None], jax.lax.dynamic_slice_in_dim(sums, start, chunk),
                              0)
        return updated(variables, part_rows, part_sums, spec, step, clip, gather_rows,
                       scatter_rows, rounding)

    return jax.lax.fori_loop(0, (real + chunk - 1) // chunk, body, variables)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 4))
def _lookup_local(flat: FlatBuffers, table: jax.Array, layout: StackLayout,
                  num_minibatches: jax.Array, slices: Sequence[ActivationSlice]
                  ) -> list[jax.Array]:
    return lookup_buffers(flat, table, layout, num_minibatches, slices)


@_lookup_local.defjvp
def _lookup_local_jvp(layout: StackLayout, slices: Sequence[ActivationSlice],
                      primals: tuple[Any, ...], tangents: tuple[Any, ...]
                      ) -> tuple[list[jax.Array], list[jax.Array]]:
    """The kernel's activations, and their tangent by XLA's lookup (the same sums), which
    JAX can linearise and transpose: `jax.grad`, `jvp` and `vjp` of a lookup with respect
    to the tables (or the gains) give the XLA wing's results. An FFI call has no
    derivative of its own; the kernel stays the forward."""
    from ..xla import WING as XLA

    flat, table, num_minibatches = primals
    activations = _lookup_local(flat, table, layout, num_minibatches, slices)

    def xla_lookup(flat: FlatBuffers, table: jax.Array) -> list[jax.Array]:
        return XLA.lookup_local(flat, table, layout, num_minibatches, slices)

    _, tangent = jax.jvp(xla_lookup, (flat, table), tangents[:2])
    return activations, tangent


def _update_local(flat: FlatBuffers, grads: Sequence[jax.Array],
                  slices: Sequence[ActivationSlice], variables: EmbeddingVariables,
                  layout: StackLayout, spec: OptimizerSpec, step: Any,
                  clip: tuple[float, float] | None, num_minibatches: jax.Array,
                  rounding: Rounding | None = None) -> EmbeddingVariables:
    """One device's update; minibatched buffers one minibatch at a time (the optimizer
    runs once per minibatch, as on the reference system). An elementwise rule runs
    fused with the gradient sums, one pass over the sorted buffers reading each slice's
    gradients where they lie (a half-precision table too, see `apply_update`); another
    rule sums the gradients of a block of them first."""
    kernels = fused_kernels(spec, variables.table.dtype, variables.table.shape[1])
    if kernels is not None:
        if not layout.minibatched:
            return fused_update_buffers(kernels, flat, grads, slices, variables, layout, spec,
                                        step, clip, passes(1), rounding)

        def fused(minibatch: jax.Array, variables: EmbeddingVariables) -> EmbeddingVariables:
            return fused_update_buffers(kernels, flat, grads, slices, variables, layout, spec,
                                        step, clip, passes(num_minibatches, minibatch), rounding)

        return jax.lax.fori_loop(0, num_minibatches, fused, variables)
    block = stack_slices(grads, layout, slices)
    if not layout.minibatched:
        unique, sums, count = row_gradients_buffers(flat, block, layout)
        return apply_update(variables, unique, sums, spec, step, clip, count, rounding)

    def body(minibatch: jax.Array, variables: EmbeddingVariables) -> EmbeddingVariables:
        unique, sums, count = row_gradients_buffers(flat, block, layout, minibatch,
                                                    num_minibatches)
        return apply_update(variables, unique, sums, spec, step, clip, count, rounding)

    return jax.lax.fori_loop(0, num_minibatches, body, variables)


WING = Wing(name="cpu", pool=_pool, row_gradients=_row_gradients, apply_update=apply_update,
            lookup_local=_lookup_local, update_local=_update_local)
