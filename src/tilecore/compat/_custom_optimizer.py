"""The reference's `CustomOptimizerSpec`: a user rule as a Python function or as StableHLO.

Either form becomes a `tilecore.CustomOptimizer` that the fused sparse update
applies like any built-in optimizer: a Python rule directly (vectorised over the
touched rows), a StableHLO module through `tilecore.optimizers.StableHLORule`
(the module's `main` called once per row, on any backend).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import specs as native
from ._optimizer_base import (
    CallableTableInitializer,
    OptimizerSpec,
    as_float32,
    constant_of,
    native_learning_rate,
)

if TYPE_CHECKING:
    import jax


class CustomOptimizerSpec(OptimizerSpec):
    """A user rule `(grad, row, *slots, learning_rate) -> (row', *slots')`.

    Attributes:
      custom_computation_fn: the rule as a Python (JAX) function.
      stablehlo: the rule as a StableHLO module (text, bytes or `ir.Module`) in the
        calling convention of `custom_optimizer_lowering.lower_to_stablehlo`: every
        argument and result one `[1, embedding_dim]` float32 row. When both are set,
        the module is used, as in the reference.
      slot_variable_initializers_tuple: constant initializers
        (`jax.nn.initializers.constant(v)`) or plain floats, one per slot.
      short_name_str: the optimizer's short name.
    """

    _fields = ("custom_computation_fn", "stablehlo", "slot_variable_initializers_tuple",
               "short_name_str")

    def __init__(
        self,
        learning_rate: Any = 0.001,
        custom_computation_fn: Callable[..., Any] | None = None,
        stablehlo: str | bytes | Any | None = None,
        slot_variable_initializers_tuple: tuple[CallableTableInitializer, ...] = (),
        short_name_str: str = "custom",
    ) -> None:
        super().__init__(learning_rate)
        self.custom_computation_fn = custom_computation_fn
        self.stablehlo = stablehlo
        self.slot_variable_initializers_tuple = tuple(slot_variable_initializers_tuple)
        self.short_name_str = short_name_str

    def short_name(self) -> str:
        return self.short_name_str

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        return self.slot_variable_initializers_tuple

    def slot_variables_count(self) -> int:
        return len(self.slot_variable_initializers_tuple)

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(learning_rate,)` at `step`: the one hyperparameter a custom rule receives."""
        return as_float32((self.get_learning_rate(step),))

    def to_native(self) -> native.CustomOptimizer:
        owner = f"CustomOptimizerSpec {self.short_name_str!r}"
        slots = tuple(constant_of(owner, init) for init in self.slot_variable_initializers_tuple)
        if self.stablehlo is not None:
            from ..optimizers import StableHLORule

            update_fn: Callable[..., Any] = StableHLORule(
                self.stablehlo, num_slots=len(slots), num_hyperparameters=1,
                name=self.short_name_str)
        elif callable(self.custom_computation_fn):
            update_fn = self.custom_computation_fn
        else:
            raise ValueError(
                f"{owner}: either stablehlo or custom_computation_fn must be provided; got "
                f"custom_computation_fn={self.custom_computation_fn!r}, stablehlo=None. Pass a "
                "rule `fn(grad, row, *slots, lr) -> (row, *slots)` or its StableHLO module "
                "(CustomOptimizerSpec.lower_to_stablehlo(fn, embedding_dim=...))."
            )
        return native.CustomOptimizer(
            learning_rate=native_learning_rate(owner, self.learning_rate),
            update_fn=update_fn,
            slot_initial_value_tuple=slots,
            name=self.short_name_str,
        )

    @classmethod
    def lower_to_stablehlo(
        cls,
        custom_computation_fn: Callable[..., Any],
        embedding_dim: int = 1,
        num_slot_variables: int = 0,
        num_hyperparameters: int = 1,
        min_value: float | None = None,
        max_value: float | None = None,
    ) -> str:
        """`custom_optimizer_lowering.lower_to_stablehlo` (StableHLO text of the rule)."""
        from .lib.nn import custom_optimizer_lowering  # imports JAX: only when lowering

        return custom_optimizer_lowering.lower_to_stablehlo(
            custom_computation_fn, embedding_dim, num_slot_variables, num_hyperparameters,
            min_value, max_value)

    @classmethod
    def wrap_stablehlo_with_limits(
        cls,
        stablehlo: str | bytes,
        embedding_dim: int,
        num_slot_variables: int,
        num_hyperparameters: int,
        min_value: float | None = None,
        max_value: float | None = None,
    ) -> str:
        """`custom_optimizer_lowering.wrap_stablehlo_with_limits` (the module, row clipped)."""
        from .lib.nn import custom_optimizer_lowering  # imports JAX: only when lowering

        return custom_optimizer_lowering.wrap_stablehlo_with_limits(
            stablehlo, embedding_dim, num_slot_variables, num_hyperparameters, min_value,
            max_value)
