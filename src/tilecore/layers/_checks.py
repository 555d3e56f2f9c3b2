"""Checks shared by the linen and nnx layers: clear errors before the ops fail obscurely."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..ops._contract import check_mesh as ops_check_mesh
from ..ops._contract import check_names
from ..preprocessing import PreprocessedBatch
from ..stacking import StackingPlan


def check_batch(plan: StackingPlan, batch: Any, layer: str) -> None:
    """`batch` is a `PreprocessedBatch` of `plan`'s stacks."""
    if not isinstance(batch, PreprocessedBatch):
        raise TypeError(
            f"{layer}: expected the PreprocessedBatch that layer.preprocess(inputs) returns, "
            f"got {type(batch).__name__}."
        )
    if set(batch.stacks) != set(plan.stacks):
        raise ValueError(
            f"{layer}: the batch holds stacks {sorted(batch.stacks)} but the layer's plan has "
            f"stacks {sorted(plan.stacks)}; preprocess with this layer's plan "
            "(layer.preprocess(inputs))."
        )


def check_plan(plan: Any, layer: str) -> None:
    """`plan` is a `StackingPlan` (before the layer reads its stacks)."""
    if not isinstance(plan, StackingPlan):
        raise TypeError(f"{layer}: plan must be the StackingPlan that tilecore.plan_stacking "
                        f"returns, got {type(plan).__name__}.")


def check_mesh(plan: StackingPlan, mesh: Mesh | None, axis: str, layer: str) -> None:
    """`axis` is an axis of `mesh` over the plan's devices (`ops`' check, before the
    layer's first use of the mesh)."""
    if mesh is not None:
        ops_check_mesh(plan, mesh, axis, layer)


def check_variables(plan: StackingPlan, variables: Mapping[str, Any], layer: str) -> None:
    """`variables` holds every stack of `plan` (and nothing else), each table and slot of
    the plan's global `[stack vocab, stack dim]` shape.

    Variables of another plan (another width or vocabulary) are named here, by stack
    and shape, before the ops meet the first array that differs (the probe's, when the
    variables came from another plan's `init`).
    """
    remedy = ("Use the variables this layer was initialised with (or ops.init_tables(plan, "
              "key) for this plan).")
    check_names(layer, "the embedding variables", variables, plan.stacks, remedy)
    for name, stack in plan.stacks.items():
        want = (stack.vocab_size, stack.embedding_dim)
        arrays = {"table": getattr(variables[name], "table", None)}
        arrays.update((f"slot {k}", slot)
                      for k, slot in enumerate(getattr(variables[name], "slots", ())))
        for what, array in arrays.items():
            shape = getattr(array, "shape", None)
            if shape is not None and tuple(shape) != want:
                raise ValueError(
                    f"{layer}: the {what} of stack {name!r} (tables "
                    f"{', '.join(stack.table_names)}) has shape {tuple(shape)}; this layer's "
                    f"plan makes it {want} ({stack.vocab_size} rows, width "
                    f"{stack.embedding_dim}): the variables were made for another plan. "
                    f"{remedy}"
                )


def check_activation_grads(plan: StackingPlan, grads: Any, layer: str) -> None:
    """`grads` maps exactly `plan`'s features to floating arrays shaped like their
    activations (integer or bool gradients were cast and applied without a word)."""
    check_names(layer, "the activation gradients", grads, plan.features,
                "Pass the gradients of this layer's activations (its probe): feature name → "
                "[batch, dim] array.")
    for name, feature in plan.features.items():
        shape = tuple(getattr(grads[name], "shape", ()))
        want = (feature.batch_size, feature.table.embedding_dim)
        if shape != want:
            raise ValueError(
                f"{layer}: the activation gradient of feature {name!r} has shape {shape}; "
                f"expected {want} (its activations' global [batch, embedding_dim])."
            )
        dtype = np.dtype(getattr(grads[name], "dtype", np.float32))
        if not jnp.issubdtype(dtype, jnp.floating):  # NumPy's test refuses bfloat16
            raise TypeError(
                f"{layer}: the activation gradient of feature {name!r} is {dtype.name}; "
                "gradients are floating arrays (take them from jax.grad of the loss with "
                "respect to the probe, without casting)."
            )
