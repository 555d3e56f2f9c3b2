"""Custom optimizers as StableHLO (`jax_tpu_embedding.sparsecore.lib.nn.custom_optimizer_lowering`).

The module's `main(grad, row, *slots, *hyperparameters) -> (row', *slots')` takes
and returns one `[1, embedding_dim]` float32 row per argument (hyperparameters
broadcast over the row), so a module written here runs in the reference and one
written there runs here (`CustomOptimizerSpec(stablehlo=...)`). Thin names over
`tilecore.optimizers.lower_rule`, `clip_module` and `clip_values`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ....optimizers import clip_module, clip_values, lower_rule

__all__ = ["apply_clipping", "lower_to_stablehlo", "wrap_stablehlo_with_limits"]


def apply_clipping(
    val: jax.Array, min_value: float | None = None, max_value: float | None = None
) -> jax.Array:
    """`val` clipped to `[min_value, max_value]`; either bound may be None (not applied)."""
    return clip_values(val, min_value, max_value)


def lower_to_stablehlo(
    custom_computation_fn: Callable[..., Any],
    embedding_dim: int = 1,
    num_slot_variables: int = 0,
    num_hyperparameters: int = 1,
    min_value: float | None = None,
    max_value: float | None = None,
) -> str:
    """StableHLO text of `custom_computation_fn(grad, row, *slots, lr, *hyperparameters)`.

    Every argument is traced as a `[1, embedding_dim]` float32 row; the new row is
    clipped to `[min_value, max_value]` when either is given. Unlike the reference,
    arguments the rule ignores are kept, so the calling convention always holds.
    """
    return lower_rule(custom_computation_fn, dim=embedding_dim, num_slots=num_slot_variables,
                      num_hyperparameters=num_hyperparameters, min_value=min_value,
                      max_value=max_value)


def wrap_stablehlo_with_limits(
    stablehlo: str | bytes,
    embedding_dim: int,
    num_slot_variables: int,
    num_hyperparameters: int,
    min_value: float | None = None,
    max_value: float | None = None,
) -> str:
    """The module `stablehlo` as text, its new row clipped when a limit is given.

    The module is checked against the calling convention (argument and result counts,
    `[1, embedding_dim]` rows); a mismatch raises `ValueError`.
    """
    return clip_module(stablehlo, dim=embedding_dim, num_slots=num_slot_variables,
                       num_hyperparameters=num_hyperparameters, min_value=min_value,
                       max_value=max_value)
