"""The update rule of each optimizer spec, and its slot initialisation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp

from ..specs import (
    F2A,
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    CustomOptimizer,
    LaProp,
    OptimizerSpec,
)
from ._adagrad import adagrad
from ._adagrad_momentum import adagrad_momentum
from ._adam import adam
from ._f2a import f2a
from ._ftrl import ftrl
from ._laprop import laprop
from ._sgd import sgd

UpdateRule: TypeAlias = Callable[..., tuple[jax.Array, ...]]
"""`rule(grad, row, *slots, *hyperparameters) -> (new_row, *new_slots)`.

Every array is the `[rows, dim]` gather of the touched rows; slots follow the spec's
`slot_names` order and hyperparameters the order `spec.hyperparameters(step)` returns.
A rule is pure `jnp` and row-wise, so one fused sparse-update path applies any rule.
"""

_RULES: dict[type[OptimizerSpec], UpdateRule] = {
    SGD: sgd,
    Adagrad: adagrad,
    AdagradMomentum: adagrad_momentum,
    Adam: adam,
    F2A: f2a,
    FTRL: ftrl,
    LaProp: laprop,
}


def update_rule(spec: OptimizerSpec) -> UpdateRule:
    """The row-wise update rule for `spec` (a `CustomOptimizer` gives its `update_fn`)."""
    if isinstance(spec, CustomOptimizer):
        return spec.update_fn  # pyright: ignore[reportReturnType]
    for cls in type(spec).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    known = ", ".join(sorted(cls.__name__ for cls in _RULES))
    raise TypeError(
        f"No update rule for optimizer spec {type(spec).__name__}; got spec={spec!r}. "
        f"Use one of {known}, or wrap your rule in tilecore.CustomOptimizer(update_fn=...)."
    )


def init_slots(
    spec: OptimizerSpec,
    shape: tuple[int, ...],
    dtype: Any = jnp.float32,
    sharding: Any = None,
) -> tuple[jax.Array, ...]:
    """Slot variables for a table of `shape`, each filled with its initial constant.

    Returned in `spec.slot_names` order; `sharding` (a `jax.sharding.Sharding` or a
    device) places every slot like the table it belongs to.
    """
    return tuple(
        jnp.full(shape, value, dtype=dtype, device=sharding)
        for value in spec.slot_initial_values()
    )
