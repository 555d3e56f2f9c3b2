"""Checks shared by the linen and nnx layers: clear errors before the ops fail obscurely."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
    missing = sorted(set(plan.stacks) - set(variables))
    unknown = sorted(set(variables) - set(plan.stacks))
    if missing or unknown:
        raise ValueError(
            f"{layer}: the embedding variables hold stacks {sorted(variables)} but the plan has "
            f"{sorted(plan.stacks)} (missing {missing}, unknown {unknown}). Use the variables "
            "this layer was initialised with (or ops.init_tables(plan, key) for this plan)."
        )


def check_activation_grads(plan: StackingPlan, grads: Any, layer: str) -> None:
    """`grads` maps exactly `plan`'s features to arrays shaped like their activations."""
    if not isinstance(grads, Mapping):
        raise TypeError(
            f"{layer}: activation gradients must map feature name → [batch, dim] array, got "
            f"{type(grads).__name__}."
        )
    missing = sorted(set(plan.features) - set(grads))
    unknown = sorted(set(grads) - set(plan.features))
    if missing or unknown:
        raise ValueError(
            f"{layer}: activation gradients are keyed by features {sorted(grads)}, but the "
            f"plan's features are {sorted(plan.features)} (missing {missing}, unknown "
            f"{unknown}). Pass the gradients of this layer's activations (its probe)."
        )
    for name, feature in plan.features.items():
        shape = tuple(getattr(grads[name], "shape", ()))
        want = (feature.batch_size, feature.table.embedding_dim)
        if shape != want:
            raise ValueError(
                f"{layer}: the activation gradient of feature {name!r} has shape {shape}; "
                f"expected {want} (its activations' global [batch, embedding_dim])."
            )
