"""Stacked activations ↔ per-feature activations, with the reference's conventions.

A stack's activations are SparseCore-major: `f` blocks of `total_sample_count/N`
rows (N = G·S partitions), and inside each block the stack's features follow
in `row_offset` order, each with `B_f/N` rows. On one device `f = S`; compat also
accepts a stack's global activations (all devices' blocks, `f = N`), so these
functions work inside `shard_map` (per device, as in the reference) and outside
it on global arrays alike. Imports JAX: load it lazily.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp

from ._native import stack_of
from ._pytree import assert_same_structure, leaves, map_leaves
from ._specs import FeatureSpec


def _slice_rows(feature: FeatureSpec, partitions: int) -> tuple[int, int, int]:
    """(rows per SparseCore block, feature's first row in a block, its rows per block)."""
    stack = stack_of(feature)
    batch = int(feature.output_shape[0])
    for name, value in (("total_sample_count", stack.total_sample_count), ("batch", batch),
                        ("row_offset", feature.id_transformation.row_offset)):
        if value % partitions:
            raise ValueError(
                f"Feature {feature.name!r}: {name}={value} does not split over the N={partitions} "
                "SparseCores (global_device_count × num_sc_per_device); stack the specs for "
                "this topology."
            )
    return (stack.total_sample_count // partitions,
            feature.id_transformation.row_offset // partitions, batch // partitions)


def unstack(activations: Any, feature_specs: Any, global_device_count: int,
            num_sc_per_device: int) -> Any:
    """Per-feature activations (shaped like `feature_specs`) from per-stack blocks."""
    partitions = global_device_count * num_sc_per_device

    def one(feature: FeatureSpec) -> jax.Array:
        stack = stack_of(feature)
        if stack.stack_name not in activations:
            raise ValueError(
                f"activations has no stack {stack.stack_name!r} (feature {feature.name!r}); "
                f"it has {sorted(activations)}."
            )
        block = jnp.asarray(activations[stack.stack_name])
        per_block, first, count = _slice_rows(feature, partitions)
        width = int(feature.output_shape[-1])
        if width > feature.table_spec.embedding_dim:
            raise ValueError(
                f"Feature {feature.name!r} has output shape {tuple(feature.output_shape)} "
                f"wider than its table's embedding_dim={feature.table_spec.embedding_dim}."
            )
        if block.ndim != 2 or block.shape[0] % per_block:
            raise ValueError(
                f"Activations of stack {stack.stack_name!r} have shape {block.shape}; expected "
                f"[k·{per_block}, dim] (k = num_sc_per_device per device, or G·S globally)."
            )
        blocks = block.reshape(-1, per_block, block.shape[-1])
        return blocks[:, first:first + count, :width].reshape(-1, width)

    return map_leaves(one, feature_specs)


def stack(activation_gradients: Any, feature_specs: Any, num_sc_per_device: int,
          global_device_count: int | None = None) -> dict[str, jax.Array]:
    """Per-stack gradient blocks from per-feature gradients (the inverse of `unstack`).

    Gradients hold one device's rows (`B_f/G`) or, with `global_device_count`
    given, may hold every device's rows (`B_f`); narrower gradients are padded
    with zeros to the stack's padded width.
    """
    grads = assert_same_structure(activation_gradients, feature_specs, "activation_gradients",
                                  "feature_specs")
    by_stack: dict[str, list[tuple[FeatureSpec, Any]]] = defaultdict(list)
    for feature, grad in zip(leaves(feature_specs), grads, strict=True):
        by_stack[stack_of(feature).stack_name].append((feature, grad))
    out = {}
    for name, members in by_stack.items():
        members.sort(key=lambda m: m[0].id_transformation.row_offset)
        parts = []
        for feature, grad in members:
            grad = jnp.asarray(grad, jnp.float32)
            batch = int(feature.output_shape[0])
            padded = stack_of(feature).stack_embedding_dim
            local = batch // max(global_device_count or 1, 1)
            if (grad.ndim == 0 or grad.shape[0] not in (batch, local)
                    or grad.size // grad.shape[0] > padded):
                per_device = f" (or {local} rows per device)" if local != batch else ""
                raise ValueError(
                    f"Gradient of feature {feature.name!r} has shape {tuple(grad.shape)}; "
                    f"expected its activations' shape ({batch}, "
                    f"{int(feature.output_shape[-1])}){per_device}."
                )
            grad = grad.reshape(grad.shape[0], -1)
            blocks = num_sc_per_device
            if global_device_count and global_device_count > 1 and grad.shape[0] == batch:
                blocks *= global_device_count
            if grad.shape[0] % blocks:
                raise ValueError(
                    f"Gradient of feature {feature.name!r} has {grad.shape[0]} rows, which do not "
                    f"split over {blocks} SparseCore blocks."
                )
            grad = jnp.pad(grad, ((0, 0), (0, padded - grad.shape[1])))
            parts.append(grad.reshape(blocks, -1, padded))
        joined = jnp.concatenate(parts, axis=1)
        out[name] = joined.reshape(-1, joined.shape[-1])
    return out
