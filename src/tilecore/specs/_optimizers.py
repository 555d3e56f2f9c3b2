"""Optimizer specifications: hyperparameters, slot variables and their defaults.

Specs are plain frozen values (no JAX): they describe *what* update a table gets.
The device-side update rules live in `tilecore.optimizers`. Defaults and slot
initial values follow the reference system, so limits and checkpoints carry over.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, cast

from ._numbers import make_plain

LearningRate = float | Callable[[int], float]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_fraction(owner: str, name: str, value: float) -> None:
    if not (_is_number(value) and 0.0 <= value < 1.0):
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {name}={value!r}.")


def _check_positive(owner: str, name: str, value: float) -> None:
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: {name} must be a finite number > 0, got {name}={value!r}.")


def _check_finite(owner: str, name: str, value: float) -> None:
    if not (_is_number(value) and math.isfinite(value)):
        raise ValueError(f"{owner}: {name} must be a finite number, got {name}={value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """Base of all optimizer specs.

    Attributes:
      learning_rate: a float, or a schedule `step -> float` evaluated on the host
        with the global 0-based training step.
    """

    learning_rate: LearningRate = 1e-3

    _slot_names: ClassVar[tuple[str, ...]] = ()
    short_name: ClassVar[str] = "optimizer"

    @property
    def slot_names(self) -> tuple[str, ...]:
        """Names of the slot variables kept beside the table, in update-rule order."""
        return self._slot_names

    def __post_init__(self) -> None:
        make_plain(self, *(f.name for f in dataclasses.fields(self)))
        if not callable(self.learning_rate):
            _check_positive(type(self).__name__, "learning_rate", self.learning_rate)

    def learning_rate_at(self, step: Any) -> Any:
        """The learning rate in effect at `step` (0-based).

        `step` may be a Python int or a traced JAX scalar (inside `jit`); a schedule
        must then be written with traceable arithmetic (e.g. optax schedules).
        Whatever number type the schedule returns (a Python or NumPy int, a JAX array),
        the rate is a float: a concrete value is checked (a finite number >= 0) and
        returned as a Python float, a traced one is cast to float32 (its value is
        known only on the device).

        Raises:
          ValueError: the schedule returned something other than a scalar, or a
            concrete value that is not finite or is negative.
        """
        lr = self.learning_rate
        if not callable(lr):
            return float(lr)
        owner = f"{type(self).__name__}: the learning-rate schedule"
        value: Any = lr(step)
        shape = getattr(value, "shape", ())
        if isinstance(value, bool | str | bytes) or not (
                isinstance(value, int | float) or hasattr(value, "astype")) or shape != ():
            raise ValueError(f"{owner} returned {value!r} at step={step}; it must return a "
                             "scalar number (a float, or a 0-d array).")
        try:
            rate = float(value)
        except TypeError:  # traced (jax's ConcretizationTypeError is a TypeError)
            return cast(Any, value).astype("float32")
        if not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"{owner} returned {rate} at step={step}; it must return a "
                             "finite number >= 0.")
        return rate

    def slot_initial_values(self) -> tuple[float, ...]:
        """Constant each slot variable starts from, in `slot_names` order."""
        return ()

    def hyperparameters(self, step: Any) -> tuple[Any, ...]:
        """Scalars handed to the update rule at `step` (a Python int or a traced scalar)."""
        return (self.learning_rate_at(step),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(OptimizerSpec):
    """Plain SGD: `w -= lr * g`."""

    short_name: ClassVar[str] = "sgd"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adagrad(OptimizerSpec):
    """Adagrad without epsilon: `a += g²; w -= lr * g / √a`."""

    initial_accumulator_value: float = 0.1

    _slot_names: ClassVar[tuple[str, ...]] = ("accumulator",)
    short_name: ClassVar[str] = "adagrad"

    def __post_init__(self) -> None:
        super().__post_init__()
        # No epsilon (as on the reference): the first update divides by the square root of
        # this plus g², so 0 makes a row whose gradient sums to 0 NaN, and < 0 any small one.
        _check_positive("Adagrad", "initial_accumulator_value", self.initial_accumulator_value)

    def slot_initial_values(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdagradMomentum(OptimizerSpec):
    """Adagrad with momentum.

    `a' = a + g²` if beta2 == 1 else `β2·a + (1−β2)·g²`;
    `s = (a' + ε)^(−1/exponent) · g`; `m' = momentum·m + s`;
    `u = momentum·m' + s` with Nesterov else `m'`; `w -= lr · u`.
    """

    momentum: float = 0.9
    beta2: float = 1.0
    epsilon: float = 1e-10
    exponent: float = 2.0
    use_nesterov: bool = False
    initial_accumulator_value: float = 0.1
    initial_momentum_value: float = 0.0

    _slot_names: ClassVar[tuple[str, ...]] = ("accumulator", "momentum")
    short_name: ClassVar[str] = "adagrad_momentum"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("momentum", "beta2", "epsilon", "initial_accumulator_value",
                     "initial_momentum_value"):
            _check_finite("AdagradMomentum", name, getattr(self, name))
        for name in ("epsilon", "initial_accumulator_value"):  # (a + ε)^(-1/exponent) stays real
            if getattr(self, name) < 0:
                raise ValueError(f"AdagradMomentum: {name} must be >= 0, got "
                                 f"{name}={getattr(self, name)!r}.")
        _check_positive("AdagradMomentum", "exponent", self.exponent)

    def slot_initial_values(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value, self.initial_momentum_value)

    def hyperparameters(self, step: Any) -> tuple[Any, ...]:
        return (self.learning_rate_at(step), self.momentum, self.beta2, self.epsilon,
                self.exponent, float(self.use_nesterov))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adam(OptimizerSpec):
    """Adam with bias correction folded into the host-side hyperparameters.

    With t the 0-based step: `α = lr·√(1−β2^(t+1))/(1−β1^(t+1))`,
    `ε̂ = ε·√(1−β2^(t+1))`; `m' = m + (1−β1)(g−m)`; `v' = v + (1−β2)(g²−v)`;
    `w -= α·m'/(√v' + ε̂)`.
    """

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-8

    _slot_names: ClassVar[tuple[str, ...]] = ("momentum", "velocity")
    short_name: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("beta_1", "beta_2"):
            _check_fraction("Adam", name, getattr(self, name))
        _check_positive("Adam", "epsilon", self.epsilon)

    def slot_initial_values(self) -> tuple[float, ...]:
        return (0.0, 0.0)

    def hyperparameters(self, step: Any) -> tuple[Any, ...]:
        t = step + 1
        correction = (1.0 - self.beta_2**t) ** 0.5
        alpha = self.learning_rate_at(step) * correction / (1.0 - self.beta_1**t)
        return (alpha, self.beta_1, self.beta_2, self.epsilon * correction)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FTRL(OptimizerSpec):
    """Follow-the-regularized-leader (McMahan et al.), with the reference's options."""

    learning_rate: LearningRate = 0.01
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    initial_linear_value: float = 0.0
    multiply_linear_by_learning_rate: bool = False

    _slot_names: ClassVar[tuple[str, ...]] = ("accumulator", "linear")
    short_name: ClassVar[str] = "ftrl"

    def __post_init__(self) -> None:
        super().__post_init__()
        power = self.learning_rate_power
        if not (_is_number(power) and math.isfinite(power) and power <= 0):
            raise ValueError(f"FTRL: learning_rate_power must be <= 0 (and finite), got {power!r}.")
        for name in ("l1_regularization_strength", "l2_regularization_strength", "beta"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value >= 0):
                raise ValueError(f"FTRL: {name} must be finite and >= 0, got {name}={value!r}.")
        _check_finite("FTRL", "initial_linear_value", self.initial_linear_value)
        _check_positive("FTRL", "initial_accumulator_value", self.initial_accumulator_value)

    def slot_initial_values(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value, self.initial_linear_value)

    def hyperparameters(self, step: Any) -> tuple[Any, ...]:
        return (self.learning_rate_at(step), self.learning_rate_power,
                self.l1_regularization_strength, self.l2_regularization_strength, self.beta,
                float(self.multiply_linear_by_learning_rate))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaProp(OptimizerSpec):
    """LaProp (Ziyin et al.): Adam with the momentum taken after normalisation.

    `d = b2·(1−b2^t)/(1−b2^(t+1))` (0 at step 0); `ν' = d·ν + (1−d)(g² + eps)`;
    `μ' = b1·μ + √(1−b1²)·g/√ν'`; `w -= lr·μ'`.
    """

    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-30
    rms_clip_threshold: float | None = None
    initial_slot_value: float = 0.0

    _slot_names: ClassVar[tuple[str, ...]] = ("mu", "nu")
    short_name: ClassVar[str] = "laprop"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rms_clip_threshold is not None:
            raise ValueError(
                "LaProp: rms_clip_threshold is not supported (as in the reference); "
                f"got rms_clip_threshold={self.rms_clip_threshold!r}. Leave it as None."
            )
        for name in ("b1", "b2"):
            _check_fraction("LaProp", name, getattr(self, name))
        _check_positive("LaProp", "eps", self.eps)
        _check_finite("LaProp", "initial_slot_value", self.initial_slot_value)

    def slot_initial_values(self) -> tuple[float, ...]:
        return (self.initial_slot_value, self.initial_slot_value)

    def hyperparameters(self, step: Any) -> tuple[Any, ...]:
        decay = self.b2 * (1.0 - self.b2**step) / (1.0 - self.b2 ** (step + 1))
        return (self.learning_rate_at(step), self.b1, decay, self.eps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class F2A(OptimizerSpec):
    """Frequency-aware Adagrad: rarely updated rows get a larger step.

    Slot `local_step` counts the updates of each row; with `t` the global step
    (0-based, as `hyperparameters` passes it):
    `n' = n + 1`; `f = min((max(t, 1)/n')^rho, max_lr_multiplier)`; `a' = a + g²`;
    `w -= lr·(f·g/√a' + l1·sign(w) + l2·w)`.
    """

    learning_rate: LearningRate = 0.01
    rho: float = 0.5
    initial_accumulator_value: float = 0.1
    initial_local_step_value: float = 0.0
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    max_lr_multiplier: float = 1e6

    _slot_names: ClassVar[tuple[str, ...]] = ("accumulator", "local_step")
    short_name: ClassVar[str] = "f2a"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_finite("F2A", "rho", self.rho)
        for name in ("l1_regularization_strength", "l2_regularization_strength",
                     "initial_local_step_value"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value >= 0):
                raise ValueError(f"F2A: {name} must be finite and >= 0, got {name}={value!r}.")
        _check_positive("F2A", "initial_accumulator_value", self.initial_accumulator_value)
        _check_positive("F2A", "max_lr_multiplier", self.max_lr_multiplier)

    def slot_initial_values(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value, self.initial_local_step_value)

    def hyperparameters(self, step: Any) -> tuple[Any, ...]:
        """`(lr, rho, l1, l2, max_lr_multiplier, step)`: the reference's order; the rule
        casts the step (a Python int or a traced integer) to float32."""
        return (self.learning_rate_at(step), self.rho, self.l1_regularization_strength,
                self.l2_regularization_strength, self.max_lr_multiplier, step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomOptimizer(OptimizerSpec):
    """A user-supplied per-row rule.

    `update_fn(grad, row, *slots, *hyperparameters) -> (row', *slots')`, every array
    of shape `(rows, dim)` float32; `hyperparameters` defaults to `(learning_rate,)`.
    Each row's result must depend on that row alone (reduce with `axis=1` only): the
    rule runs on blocks of the rows a batch touches, and the ops refuse a rule whose
    rows depend on each other.
    """

    update_fn: Callable[..., tuple[object, ...]]
    slot_initial_value_tuple: tuple[float, ...] = ()
    name: str = "custom"
    extra_hyperparameters: tuple[float, ...] = ()

    short_name: ClassVar[str] = "custom"

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(f"slot_{i}" for i in range(len(self.slot_initial_value_tuple)))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not callable(self.update_fn):
            raise TypeError(f"CustomOptimizer: update_fn must be callable, got {self.update_fn!r}.")
        for value in self.slot_initial_value_tuple:
            _check_finite("CustomOptimizer", "slot_initial_value_tuple", value)
        for value in self.extra_hyperparameters:  # bools and ints reach the rule as ints
            if not isinstance(value, bool):
                _check_finite("CustomOptimizer", "extra_hyperparameters", value)

    def slot_initial_values(self) -> tuple[float, ...]:
        return tuple(self.slot_initial_value_tuple)

    def hyperparameters(self, step: Any) -> tuple[Any, ...]:
        return (self.learning_rate_at(step), *self.extra_hyperparameters)
