"""Between one stack's activation block and its features' activations.

A device's stacked activations are `[S·samples_per_sc, dim]`: SparseCore-major,
and inside each SparseCore's block the features follow in row-offset order. A
feature's rows on a device are the concatenation of its slice in every block
(its `ActivationSlice`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..stacking import StackingPlan
from ._layout import StackLayout


class ActivationSlice(NamedTuple):
    """Rows `first:first + samples` of every SparseCore's block, columns `:width`: one
    feature's `[S·samples, width]` activations on a device (or, whole, the block itself)."""

    first: int
    samples: int
    width: int


def feature_slices(plan: StackingPlan, stack: str) -> dict[str, ActivationSlice]:
    """Feature name → its slice of the stack's blocks, in row-offset order."""
    n = plan.num_partitions
    return {
        feature.name: ActivationSlice(plan.feature_settings[feature.name].row_offset // n,
                                      feature.batch_size // n, feature.table.embedding_dim)
        for feature in plan.stack_features(stack)
    }


def whole_block(layout: StackLayout) -> ActivationSlice:
    """The slice that is the whole `[S·samples_per_sc, dim]` block."""
    return ActivationSlice(0, layout.samples_per_sc, layout.dim)


def take_slices(stacked: jax.Array, layout: StackLayout, slices: Sequence[ActivationSlice]
                ) -> list[jax.Array]:
    """Each slice's `[S·samples, width]` activations from a stack's block."""
    blocks = stacked.reshape(layout.sc_per_device, layout.samples_per_sc, stacked.shape[-1])
    return [blocks[:, first:first + count, :width].reshape(-1, width)
            for first, count, width in slices]


def unstack_activations(plan: StackingPlan, stack: str, stacked: jax.Array,
                        layout: StackLayout) -> dict[str, jax.Array]:
    """Per-feature `[rows on this device, dim]` activations from a stack's block."""
    slices = feature_slices(plan, stack)
    return dict(zip(slices, take_slices(stacked, layout, list(slices.values())), strict=True))


def feature_gradients(plan: StackingPlan, stack: str, grads: Mapping[str, jax.Array],
                      layout: StackLayout
                      ) -> tuple[list[jax.Array], list[ActivationSlice]]:
    """The stack's features' activation gradients as float32, and their slices, in
    `feature_slices` order; each gradient checked to have its activations' shape on a
    device."""
    s = layout.sc_per_device
    out, slices = [], []
    for name, piece in feature_slices(plan, stack).items():
        _, count, width = piece
        g = jnp.asarray(grads[name], jnp.float32)
        if g.shape != (s * count, width):
            raise ValueError(
                f"Gradient of feature {name!r} has shape {g.shape}; expected {(s * count, width)} "
                "per device (its activations' shape)."
            )
        out.append(g)
        slices.append(piece)
    return out, slices


def stack_slices(parts: Sequence[jax.Array], layout: StackLayout,
                 slices: Sequence[ActivationSlice]) -> jax.Array:
    """The inverse of `take_slices`: each slice's `[S·samples, width]` array into one
    `[S·samples_per_sc, dim]` block, zeros where no slice is."""
    s = layout.sc_per_device
    block = jnp.zeros((s, layout.samples_per_sc, layout.dim), jnp.float32)
    for part, (first, count, width) in zip(parts, slices, strict=True):
        block = block.at[:, first:first + count, :width].set(
            jnp.asarray(part, jnp.float32).reshape(s, count, width))
    return block.reshape(s * layout.samples_per_sc, layout.dim)


def stack_gradients(plan: StackingPlan, stack: str, grads: Mapping[str, jax.Array],
                    layout: StackLayout) -> jax.Array:
    """The inverse of `unstack_activations`: feature gradients into one stacked block."""
    parts, slices = feature_gradients(plan, stack, grads, layout)
    return stack_slices(parts, layout, slices)
