"""The reference's optimizer spec classes: mutable shells over tilecore's frozen specs.

Argument names, defaults and slot names follow `jax_tpu_embedding`'s
`embedding_spec`; `to_native()` gives the equivalent `tilecore` optimizer spec,
which is what stacking, preprocessing and the device update read. The base class
and `CustomOptimizerSpec` live in their own modules and are re-exported here.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from .. import specs as native
from ._custom_optimizer import CustomOptimizerSpec as CustomOptimizerSpec
from ._optimizer_base import CallableTableInitializer as CallableTableInitializer
from ._optimizer_base import HyperParameterType as HyperParameterType
from ._optimizer_base import OptimizerSpec as OptimizerSpec
from ._optimizer_base import as_float32
from ._placeholder import CallablePlaceholder as CallablePlaceholder

if TYPE_CHECKING:
    import jax

SGDSlotVariables = collections.namedtuple("SGDSlotVariables", [])
AdagradSlotVariables = collections.namedtuple("AdagradSlotVariables", ["accumulator"])
AdamSlotVariables = collections.namedtuple("AdamSlotVariables", ["momentum", "velocity"])
AdagradMomentumSlotVariables = collections.namedtuple(
    "AdagradMomentumSlotVariables", ["accumulator", "momentum"]
)
FTRLSlotVariables = collections.namedtuple("FtrlSlotVariables", ["accumulator", "linear"])
LaPropSlotVariables = collections.namedtuple("LaPropSlotVariables", ["mu", "nu"])
F2ASlotVariables = collections.namedtuple("F2ASlotVariables", ["accumulator", "local_step"])


class SGDOptimizerSpec(OptimizerSpec):
    """Stochastic gradient descent: `w -= lr·g`."""

    _short_name = "sgd"

    def __init__(self, learning_rate: Any = 0.001) -> None:
        super().__init__(learning_rate)

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        return SGDSlotVariables()

    def to_native(self) -> native.SGD:
        return native.SGD(**self._native_kwargs())


class AdagradOptimizerSpec(OptimizerSpec):
    """Adagrad (no epsilon): `a += g²; w -= lr·g/√a`."""

    _fields = ("initial_accumulator_value",)
    _float_params = ("initial_accumulator_value",)
    _short_name = "adagrad"

    def __init__(self, learning_rate: Any = 0.001, initial_accumulator_value: Any = 0.1) -> None:
        super().__init__(learning_rate)
        self.initial_accumulator_value = initial_accumulator_value

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        return AdagradSlotVariables(*super().slot_variables_initializers())

    def to_native(self) -> native.Adagrad:
        return native.Adagrad(**self._native_kwargs())


class AdamOptimizerSpec(OptimizerSpec):
    """Adam with host-side bias correction (`tilecore.Adam`)."""

    _fields = ("beta_1", "beta_2", "epsilon")
    _float_params = ("beta_1", "beta_2", "epsilon")
    _short_name = "adam"

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta_1: Any = 0.9,
        beta_2: Any = 0.999,
        epsilon: Any = 1e-8,
    ) -> None:
        super().__init__(learning_rate)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        return AdamSlotVariables(*super().slot_variables_initializers())

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """Bias-corrected `(α_t, beta_1, beta_2, ε̂_t)` at `step` (None: 0), with
        `α_t = lr·√(1−β2^(t+1))/(1−β1^(t+1))` and `ε̂_t = ε·√(1−β2^(t+1))`."""
        return as_float32(self.to_native().hyperparameters(0 if step is None else step))

    def to_native(self) -> native.Adam:
        return native.Adam(**self._native_kwargs())


class AdagradMomentumOptimizerSpec(OptimizerSpec):
    """Adagrad with momentum (`tilecore.AdagradMomentum`)."""

    _fields = ("momentum", "beta2", "epsilon", "exponent", "use_nesterov",
               "initial_accumulator_value", "initial_momentum_value")
    _float_params = ("momentum", "beta2", "epsilon", "exponent", "initial_accumulator_value",
                     "initial_momentum_value")
    _bool_params = ("use_nesterov",)
    _short_name = "adagrad_momentum"

    def __init__(
        self,
        learning_rate: Any = 0.001,
        momentum: float = 0.9,
        beta2: float = 1.0,
        epsilon: float = 1e-10,
        exponent: float = 2.0,
        use_nesterov: bool = False,
        initial_accumulator_value: float = 0.1,
        initial_momentum_value: float = 0.0,
    ) -> None:
        super().__init__(learning_rate)
        self.momentum = momentum
        self.beta2 = beta2
        self.epsilon = epsilon
        self.exponent = exponent
        self.use_nesterov = use_nesterov
        self.initial_accumulator_value = initial_accumulator_value
        self.initial_momentum_value = initial_momentum_value

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        return AdagradMomentumSlotVariables(*super().slot_variables_initializers())

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(lr, momentum, beta2, epsilon, exponent, use_nesterov)`; the flag a bool."""
        import jax.numpy as jnp

        *values, _ = super().get_hyperparameters(step)
        return (*values, jnp.asarray(self.use_nesterov, jnp.bool_))

    def to_native(self) -> native.AdagradMomentum:
        return native.AdagradMomentum(**self._native_kwargs())


class FTRLOptimizerSpec(OptimizerSpec):
    """Follow-the-regularized-leader (`tilecore.FTRL`)."""

    _fields = ("learning_rate_power", "l1_regularization_strength",
               "l2_regularization_strength", "beta", "initial_accumulator_value",
               "initial_linear_value", "multiply_linear_by_learning_rate")
    _float_params = ("learning_rate_power", "l1_regularization_strength",
                     "l2_regularization_strength", "beta", "initial_accumulator_value",
                     "initial_linear_value")
    _bool_params = ("multiply_linear_by_learning_rate",)
    _short_name = "ftrl"

    def __init__(
        self,
        learning_rate: Any = 0.01,
        learning_rate_power: float = -0.5,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        beta: float = 0.0,
        initial_accumulator_value: float = 0.1,
        initial_linear_value: float = 0.0,
        multiply_linear_by_learning_rate: bool = False,
    ) -> None:
        super().__init__(learning_rate)
        self.learning_rate_power = learning_rate_power
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.beta = beta
        self.initial_accumulator_value = initial_accumulator_value
        self.initial_linear_value = initial_linear_value
        self.multiply_linear_by_learning_rate = multiply_linear_by_learning_rate

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        return FTRLSlotVariables(*super().slot_variables_initializers())

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(lr, learning_rate_power, l1, l2, beta)`, as the reference orders them (the
        native rule also takes `multiply_linear_by_learning_rate`, from the spec)."""
        return super().get_hyperparameters(step)[:5]

    def to_native(self) -> native.FTRL:
        return native.FTRL(**self._native_kwargs())


class LaPropOptimizerSpec(OptimizerSpec):
    """LaProp (`tilecore.LaProp`); `rms_clip_threshold` must stay None, as in the reference."""

    _fields = ("b1", "b2", "eps", "initial_slot_value")
    _float_params = ("b1", "b2", "eps", "initial_slot_value")
    _short_name = "laprop"

    def __init__(
        self,
        learning_rate: Any = 0.001,
        b1: float = 0.9,
        b2: float = 0.95,
        eps: float = 1e-30,
        rms_clip_threshold: float | None = None,
        initial_slot_value: float = 0.0,
    ) -> None:
        super().__init__(learning_rate)
        self.b1 = b1
        self.b2 = b2
        self.eps = eps
        if rms_clip_threshold is not None:
            raise ValueError(
                f"LaPropOptimizerSpec: rms_clip_threshold={rms_clip_threshold!r}, but "
                "jax-tpu-embedding 0.2.0 defines no rule for it (it rejects the argument "
                "too), so neither does compat. Leave it as None."
            )
        self.rms_clip_threshold = rms_clip_threshold
        self.initial_slot_value = initial_slot_value

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        return LaPropSlotVariables(*super().slot_variables_initializers())

    def get_decay_rate(self, step: Any = None) -> jax.Array:
        """The bias-corrected decay `b2·(1−b2^t)/(1−b2^(t+1))` at `step` (None: `b2`)."""
        import jax.numpy as jnp

        if step is None:
            return jnp.asarray(self.b2, jnp.float32)
        return jnp.asarray(self.to_native().hyperparameters(step)[2], jnp.float32)

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(lr, b1, decay_rate, eps)` at `step` (see `get_decay_rate`)."""
        lr, b1, _, eps = super().get_hyperparameters(step)
        return (lr, b1, self.get_decay_rate(step), eps)

    def to_native(self) -> native.LaProp:
        return native.LaProp(**self._native_kwargs())


class F2AOptimizerSpec(OptimizerSpec):
    """Frequency-aware Adagrad (`tilecore.F2A`): a row updated rarely gets a larger step.

    Slots `accumulator` and `local_step` (the row's update count); the boost is
    `min((max(t, 1)/local_step')^rho, max_lr_multiplier)` at global step `t`.
    """

    _fields = ("rho", "initial_accumulator_value", "initial_local_step_value",
               "l1_regularization_strength", "l2_regularization_strength", "max_lr_multiplier")
    _float_params = ("rho", "initial_accumulator_value", "initial_local_step_value",
                     "l1_regularization_strength", "l2_regularization_strength",
                     "max_lr_multiplier")
    _short_name = "f2a"

    def __init__(
        self,
        learning_rate: Any = 0.01,
        rho: float = 0.5,
        initial_accumulator_value: float = 0.1,
        initial_local_step_value: float = 0.0,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        max_lr_multiplier: float = 1e6,
    ) -> None:
        super().__init__(learning_rate)
        self.rho = rho
        self.initial_accumulator_value = initial_accumulator_value
        self.initial_local_step_value = initial_local_step_value
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.max_lr_multiplier = max_lr_multiplier

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        return F2ASlotVariables(*super().slot_variables_initializers())

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(lr, rho, l1, l2, max_lr_multiplier, global_step)` at `step` (None: 0)."""
        step = 0 if step is None else step
        return as_float32(self.to_native().hyperparameters(step))

    def to_native(self) -> native.F2A:
        return native.F2A(**self._native_kwargs())


def native_optimizer(table_name: str, optimizer: object) -> native.OptimizerSpec:
    """`optimizer` (a compat or a native spec) as a native spec, naming the table on errors."""
    if isinstance(optimizer, native.OptimizerSpec):
        return optimizer
    if not isinstance(optimizer, OptimizerSpec):
        raise TypeError(
            f"TableSpec {table_name!r}: optimizer must be an optimizer spec such as "
            f"embedding_spec.SGDOptimizerSpec(), got {optimizer!r}."
        )
    try:
        return optimizer.to_native()
    except (TypeError, ValueError) as err:
        raise type(err)(f"TableSpec {table_name!r}: {err}") from err

