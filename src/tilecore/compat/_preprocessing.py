"""Running tilecore's preprocessing with the reference's options and conventions."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ..preprocessing import (
    IdDroppingWarning,
    PreprocessedBatch,
    PreprocessStats,
    check_limits,
    preprocess,
)
from ..stacking import StackingPlan


def check_options(sharding_strategy: str, what: str) -> None:
    """The reference's one sharding strategy, MOD (any case), or a clear error."""
    if not isinstance(sharding_strategy, str) or sharding_strategy.upper() != "MOD":
        raise ValueError(
            f"{what}: unsupported sharding strategy {sharding_strategy!r}; only MOD is "
            "supported (tables are mod-sharded over devices × SparseCores)."
        )


def run(
    plan: StackingPlan,
    inputs: Mapping[str, Any],
    weights: Mapping[str, Any] | None,
    *,
    allow_id_dropping: bool,
    has_leading_dimension: bool,
    batch_number: int = 0,
    agreement: Any = None,
) -> tuple[PreprocessedBatch, PreprocessStats]:
    """tilecore's `preprocess`, except that a too-small suggested COO buffer drops, as in the reference.

    tilecore raises when a stack's `suggested_coo_buffer_size_per_device` cannot
    hold the batch; the reference silently drops what does not fit (logging a
    warning) even without `allow_id_dropping`. Compat keeps the reference's
    behaviour: it preprocesses with dropping on, raises `LimitExceededError` if a
    limit was exceeded, and otherwise warns about the overflow drops.

    With minibatching (`plan.config.enable_minibatching`), `batch_number` and
    `agreement` (how processes agree on the split; None: this process alone) go to
    `tilecore.preprocess`.
    """
    kwargs: dict[str, Any] = {"has_leading_dimension": has_leading_dimension,
                              "batch_number": batch_number, "agreement": agreement}
    has_suggested = any(
        s.suggested_coo_buffer_size_per_device is not None for s in plan.stacks.values()
    )
    if allow_id_dropping or not has_suggested:
        plan = plan.with_config(allow_id_dropping=allow_id_dropping)
        return preprocess(plan, inputs, weights, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IdDroppingWarning)
        batch, stats = preprocess(plan.with_config(allow_id_dropping=True), inputs, weights,
                                  **kwargs)
    check_limits(plan, stats)
    dropped = {name: count for name, count in stats.id_drop_counters.items() if count}
    if dropped:
        sizes = {name: plan.stacks[name].suggested_coo_buffer_size_per_device for name in dropped}
        warnings.warn(
            IdDroppingWarning(
                f"The COO buffers of stacks {sizes} (suggested_coo_buffer_size_per_device) were "
                f"too small; IDs that did not fit were dropped, as the reference does: {dropped}. "
                "Raise the suggested sizes, e.g. with embedding.update_preprocessing_parameters."
            ),
            stacklevel=3,
        )
    return batch, stats
