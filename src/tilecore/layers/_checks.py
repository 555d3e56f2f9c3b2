"""Checks shared by the linen and nnx layers: clear errors before the ops fail obscurely."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def check_variables(plan: StackingPlan, variables: Mapping[str, Any], layer: str) -> None:
    """`variables` holds every stack of `plan` (and nothing else)."""
    check_names(layer, "the embedding variables", variables, plan.stacks,
                "Use the variables this layer was initialised with (or ops.init_tables(plan, "
                "key) for this plan).")


def check_activation_grads(plan: StackingPlan, grads: Any, layer: str) -> None:
    """`grads` maps exactly `plan`'s features to arrays shaped like their activations."""
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
