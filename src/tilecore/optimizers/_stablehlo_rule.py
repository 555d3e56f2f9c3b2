"""Update rules as StableHLO modules: lowering a Python rule, and running a module as one.

The calling convention is the reference system's (`custom_optimizer_lowering`): the
module's `main` takes `(grad, row, *slots, *hyperparameters)`, each a `[1, dim]`
float32 array (one embedding row; a hyperparameter broadcast over the row), and
returns `(row', *slots')`, each `[1, dim]`, as separate results or one tuple. A
module written by the reference runs here, and one written here runs there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ._stablehlo import Signature, call_stablehlo, module_text, signature


def clip_values(values: jax.Array, min_value: float | None = None,
                max_value: float | None = None) -> jax.Array:
    """`values` clipped below at `min_value` and above at `max_value` (either may be None)."""
    if min_value is not None:
        values = jnp.maximum(values, min_value)
    if max_value is not None:
        values = jnp.minimum(values, max_value)
    return values


def _check_count(owner: str, name: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{owner}: {name} must be an int >= {least}, got {name}={value!r}.")


@dataclasses.dataclass(frozen=True)
class StableHLORule:
    """An optimizer update rule given as a StableHLO module (see the module docstring).

    Use it as `tilecore.CustomOptimizer(update_fn=StableHLORule(text, num_slots=...))`:
    the fused sparse update calls it on the gathered `[rows, dim]` arrays with the
    spec's hyperparameters (scalars), and it runs the module once per row (a loop
    in the compiled program; a Python `update_fn` is vectorised and faster).

    Attributes:
      module: the StableHLO module: text, UTF-8 text bytes, MLIR bytecode or an
        `ir.Module`; a `str` (its text) once constructed.
      num_slots: slot variables the rule reads and returns.
      num_hyperparameters: hyperparameters it takes (1 for the learning rate alone).
      name: the optimizer's name, used in errors.
    """

    module: Any
    num_slots: int = 0
    num_hyperparameters: int = 1
    name: str = "custom"
    signature: Signature = dataclasses.field(init=False, repr=False, compare=False)

    @property
    def _owner(self) -> str:
        return f"StableHLO rule of optimizer {self.name!r}"

    def __post_init__(self) -> None:
        owner = self._owner
        _check_count(owner, "num_slots", self.num_slots, 0)
        _check_count(owner, "num_hyperparameters", self.num_hyperparameters, 0)
        text = module_text(self.module, owner)
        sig = signature(text, owner)
        arrays, hyper = 2 + self.num_slots, self.num_hyperparameters
        if len(sig.args) != arrays + hyper or len(sig.results) != 1 + self.num_slots:
            raise ValueError(
                f"{owner}: main takes {len(sig.args)} arguments and returns "
                f"{len(sig.results)} results; with {self.num_slots} slots and {hyper} "
                f"hyperparameters it must take {arrays + hyper} (grad, row, *slots, "
                f"*hyperparameters) and return {1 + self.num_slots} (row, *slots). Lower the "
                "rule with matching num_slot_variables and num_hyperparameters."
            )
        row = sig.args[0]
        if len(row) != 2 or row[0] != 1 or row[1] < 1:
            raise ValueError(f"{owner}: the gradient argument must be [1, dim]; got {list(row)}.")
        dim = row[1]
        for kind, shapes, allowed in (
            ("argument", sig.args[:arrays], {row}),
            ("hyperparameter", sig.args[arrays:], {(), (1,), row}),
            ("result", sig.results, {row}),
        ):
            for i, shape in enumerate(shapes):
                if shape not in allowed:
                    raise ValueError(
                        f"{owner}: {kind} {i} has shape {list(shape)}; expected one of "
                        f"{sorted(map(list, allowed))} (one row of dim {dim})."
                    )
        object.__setattr__(self, "module", text)
        object.__setattr__(self, "signature", sig)

    @property
    def dim(self) -> int:
        """The row width the module was lowered for."""
        return self.signature.args[0][1]

    def __call__(self, grad: ArrayLike, row: ArrayLike, *rest: Any) -> tuple[jax.Array, ...]:
        """`(row', *slots')` for gathered `[rows, dim]` arrays and scalar hyperparameters."""
        arrays = (grad, row, *rest[: self.num_slots])
        hyper = rest[self.num_slots:]
        if len(hyper) != self.num_hyperparameters:
            raise ValueError(
                f"{self._owner}: got {len(rest) - self.num_slots} hyperparameters "
                f"after {self.num_slots} slots; the module takes {self.num_hyperparameters}. "
                "Give the spec as many hyperparameters as the rule was lowered with."
            )
        shapes = {tuple(jnp.shape(a)) for a in arrays}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2 or next(iter(shapes))[1] != self.dim:
            raise ValueError(
                f"{self._owner}: the module updates rows of dim {self.dim}, but was called on "
                f"arrays of shapes {sorted(shapes)}. Lower the rule with embedding_dim equal "
                "to the table's (stacked, padded) row width."
            )
        shaped = tuple(jnp.broadcast_to(jnp.asarray(h, jnp.float32), shape)
                       for h, shape in zip(hyper, self.signature.args[len(arrays):], strict=True))
        rows = tuple(jnp.asarray(a, jnp.float32) for a in arrays)
        if rows[0].shape[0] == 1:
            return call_stablehlo(self.module, self.signature, *rows, *shaped)

        def one_row(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            out = call_stablehlo(self.module, self.signature, *(x[None] for x in xs), *shaped)
            return tuple(o[0] for o in out)

        return jax.lax.map(one_row, rows)


def lower_rule(
    fn: Callable[..., Any],
    *,
    dim: int,
    num_slots: int = 0,
    num_hyperparameters: int = 1,
    min_value: float | None = None,
    max_value: float | None = None,
) -> str:
    """StableHLO text of the update rule `fn(grad, row, *slots, *hyperparameters)`.

    Every argument is traced as a `[1, dim]` float32 array; the module keeps every
    argument, used or not (so the calling convention holds for any rule), and clips
    the new row to `[min_value, max_value]` when either is given. Run the result with
    `StableHLORule`, or hand it to the reference's `CustomOptimizerSpec(stablehlo=)`.
    """
    owner = f"lower_rule({getattr(fn, '__name__', fn)!r})"
    if not callable(fn):
        raise TypeError(f"{owner}: the rule must be callable, got {fn!r}.")
    _check_count(owner, "dim", dim, 1)
    _check_count(owner, "num_slots", num_slots, 0)
    _check_count(owner, "num_hyperparameters", num_hyperparameters, 0)

    def clipped(*args: jax.Array) -> tuple[jax.Array, ...]:
        out = fn(*args)
        out = tuple(out) if isinstance(out, list | tuple) else (out,)
        if len(out) != 1 + num_slots:
            raise ValueError(
                f"{owner}: the rule returned {len(out)} arrays; with num_slots={num_slots} it "
                f"must return {1 + num_slots} (row, *slots)."
            )
        return (clip_values(out[0], min_value, max_value), *out[1:])

    row = jax.ShapeDtypeStruct((1, dim), jnp.float32)
    lowered = jax.jit(clipped, keep_unused=True).lower(*[row] * (2 + num_slots
                                                                 + num_hyperparameters))
    return lowered.as_text(dialect="stablehlo")


def clip_module(module: Any, *, dim: int, num_slots: int, num_hyperparameters: int,
                min_value: float | None = None, max_value: float | None = None) -> str:
    """The StableHLO rule `module` with its new row clipped (text; unchanged without limits)."""
    rule = StableHLORule(module_text(module, "clip_module"), num_slots=num_slots,
                         num_hyperparameters=num_hyperparameters)
    if rule.dim != dim:
        raise ValueError(
            f"clip_module: the module updates rows of dim {rule.dim}, not embedding_dim={dim}; "
            "pass the embedding_dim it was lowered with."
        )
    if min_value is None and max_value is None:
        return rule.module
    return lower_rule(rule, dim=dim, num_slots=num_slots,
                      num_hyperparameters=num_hyperparameters, min_value=min_value,
                      max_value=max_value)
