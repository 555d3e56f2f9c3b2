"""Base of the reference's optimizer spec classes, and learning-rate conversion helpers.

`OptimizerSpec` has the reference's methods (`get_learning_rate`,
`get_hyperparameters`, `get_optimizer_primitive`, `get_float_params`, …); each is
answered from the equivalent frozen `tilecore` spec that `to_native()` builds.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from .. import specs as native

if TYPE_CHECKING:
    import jax

    from ..optimizers import UpdateRule

HyperParameterType = Callable[[Any], Any] | float
CallableTableInitializer = Callable[..., Any]
"""`init(key, shape, dtype) -> array` (a `jax.nn.initializers` initializer)."""


def schedule_arity(fn: Callable[..., Any]) -> int:
    """Positional parameters a learning-rate callable takes (bound `self` excluded)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: assume `step`
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


@dataclasses.dataclass(frozen=True)
class _NoArgSchedule:
    """A learning rate `fn()` seen as a schedule of the step (the step is ignored)."""

    fn: Callable[[], Any]

    def __call__(self, step: int) -> float:
        del step
        return float(self.fn())


def native_learning_rate(owner: str, learning_rate: Any) -> native.LearningRate:
    """`learning_rate` (a number, or a callable of no argument or of the step) for tilecore."""
    if not callable(learning_rate):
        return float(learning_rate)
    arity = schedule_arity(learning_rate)
    if arity == 0:
        return _NoArgSchedule(learning_rate)
    if arity == 1:
        return cast(native.LearningRate, learning_rate)
    raise ValueError(
        f"{owner}: a learning-rate callable must take no argument or one (the step); "
        f"{learning_rate!r} takes {arity}."
    )


def constant_of(owner: str, initializer: Any) -> Any:
    """The value a slot starts from: a plain number as a float (anything else as given), or
    the one value an initializer (`jax.nn.initializers.constant(v)`) fills with.

    tilecore slots start from one constant, so an initializer is called once, with a
    key (as a random one needs), and must fill every entry with one value. Whether
    that value is a finite number is the native spec's check
    (`tilecore.CustomOptimizer.slot_initial_value_tuple`), so it is not repeated here:
    NaN passes through and is refused there.
    """
    if not callable(initializer):
        return float(initializer) if isinstance(initializer, numbers.Real) else initializer
    import jax  # deferred: the rest of this module is host-side

    try:
        values = np.asarray(initializer(jax.random.key(0), (8,), np.float32))
    except (TypeError, ValueError) as err:
        raise type(err)(
            f"{owner}: the slot initializer {initializer!r} failed when called as "
            f"init(key, (8,), float32): {err}"
        ) from err
    if values.size == 0 or not np.array_equal(values, np.full_like(values, values.flat[0]),
                                              equal_nan=True):
        raise ValueError(
            f"{owner}: tilecore slot variables start from a constant, but the slot initializer "
            f"{initializer!r} fills different values (e.g. {values.ravel()[:3].tolist()}). Use "
            "jax.nn.initializers.constant(value) or a float."
        )
    return values.flat[0].item()


def as_float32(values: tuple[Any, ...]) -> tuple[jax.Array, ...]:
    """Each value as a float32 JAX scalar, as the reference's hyperparameters are."""
    import jax.numpy as jnp

    return tuple(jnp.asarray(v, jnp.float32) for v in values)


class OptimizerSpec:
    """Base of the reference-style optimizer specs.

    Attributes:
      learning_rate: a float, or a callable of no argument or of the step.
    """

    _fields: ClassVar[tuple[str, ...]] = ()
    _float_params: ClassVar[tuple[str, ...]] = ()
    _bool_params: ClassVar[tuple[str, ...]] = ()
    _short_name: ClassVar[str] = "optimizer"

    def __init__(self, learning_rate: Any = 0.001) -> None:
        self.learning_rate = learning_rate

    def _params(self) -> tuple[Any, ...]:
        return (self.learning_rate, *(getattr(self, f) for f in self._fields))

    def __hash__(self) -> int:
        return hash((type(self).__name__, *self._params()))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._params() == other._params()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        args = ", ".join(
            f"{name}={getattr(self, name)!r}" for name in ("learning_rate", *self._fields)
        )
        return f"{type(self).__name__}({args})"

    def short_name(self) -> str:
        """Identifier used in variable names (`sgd`, `adagrad`, …)."""
        return self._short_name

    def get_learning_rate(self, step: Any = None) -> jax.Array:
        """The learning rate at `step`, a float32 scalar (a callable of the step needs one)."""
        import jax.numpy as jnp

        if not callable(self.learning_rate):
            return jnp.asarray(self.learning_rate, jnp.float32)
        lr = cast(Callable[..., Any], self.learning_rate)
        arity = schedule_arity(lr)
        if arity == 0:
            return jnp.asarray(lr(), jnp.float32)
        if arity > 1:
            raise ValueError(
                f"{type(self).__name__}: learning-rate callbacks take no parameter or a single "
                f"step count; {lr!r} takes {arity}."
            )
        if step is None:
            raise ValueError(
                f"Specified learning rate callable {lr} requires a `step` argument to be specified."
            )
        return jnp.asarray(lr(step), jnp.float32)

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """The scalars the update applies at `step` (float32), in the reference's order.

        The learning rate first, then the optimizer's own (see each class). A step of
        None stands for 0 where a hyperparameter depends on it.
        """
        rest = self.to_native().hyperparameters(0 if step is None else step)[1:]
        return as_float32((self.get_learning_rate(step), *rest))

    def get_optimizer_primitive(self) -> UpdateRule:
        """The object that applies this optimizer's update: its tilecore update rule.

        tilecore has no primitive per optimizer (the reference's SparseCore kernels):
        one fused sparse update applies a row-wise rule
        `rule(grad, row, *slots, *hyperparameters) -> (row', *slots')` to the rows a
        batch touched. This returns that rule (`tilecore.optimizers.update_rule`); call
        it on `[rows, dim]` arrays with `self.to_native().hyperparameters(step)`.
        """
        from ..optimizers import update_rule

        return update_rule(self.to_native())

    def slot_variables_initializers(self) -> tuple[CallableTableInitializer, ...]:
        """Initializers of the slot variables (`jax.nn.initializers.constant`), in order."""
        import jax  # deferred: only device-side code needs JAX initializers

        values = self.to_native().slot_initial_values()
        return tuple(jax.nn.initializers.constant(v) for v in values)

    def slot_variables_count(self) -> int:
        return len(self.to_native().slot_names)

    def get_float_params(self) -> dict[str, float]:
        """Float hyperparameters by constructor argument name (for serialization)."""
        return {p: float(getattr(self, p)) for p in self._float_params if hasattr(self, p)}

    def get_bool_params(self) -> dict[str, bool]:
        """Bool hyperparameters by constructor argument name (for serialization)."""
        return {p: bool(getattr(self, p)) for p in self._bool_params if hasattr(self, p)}

    @classmethod
    def from_float_and_bool_params(cls, float_params: dict[str, float],
                                   bool_params: dict[str, bool],
                                   learning_rate: Any) -> OptimizerSpec:
        """The spec of `get_float_params()`/`get_bool_params()` output and a learning rate.

        Names the class does not take are ignored, as in the reference.
        """
        kwargs: dict[str, Any] = {"learning_rate": learning_rate}
        kwargs.update({p: float(float_params[p]) for p in cls._float_params if p in float_params})
        kwargs.update({p: bool(bool_params[p]) for p in cls._bool_params if p in bool_params})
        return cls(**kwargs)

    def to_native(self) -> native.OptimizerSpec:
        """The equivalent frozen `tilecore` optimizer spec."""
        raise NotImplementedError(
            f"{type(self).__name__} is the abstract base; use one of the embedding_spec "
            "optimizer classes (SGDOptimizerSpec, AdagradOptimizerSpec, …)."
        )

    def _native_kwargs(self) -> dict[str, Any]:
        owner = type(self).__name__
        kwargs: dict[str, Any] = {
            "learning_rate": native_learning_rate(owner, self.learning_rate)
        }
        for name in self._fields:
            value = getattr(self, name)
            kwargs[name] = value if isinstance(value, bool | None) else float(value)
        return kwargs
