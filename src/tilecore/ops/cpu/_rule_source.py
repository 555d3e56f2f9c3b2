"""An optimizer's update rule as scalar Python source that numba compiles into a kernel.

Update rules are written once, in `jnp`, on gathered rows (`tilecore.optimizers`).
The CPU wing applies them inside its fused kernels, one element at a time, while
a row is in cache. Rather than a second, hand-written copy of every rule (which
could drift), the rule is traced to a jaxpr and each equation becomes one scalar
statement. A rule qualifies when every equation is elementwise on the traced
`[rows, dim]` block (scalars being hyperparameters); a rule that reduces along
a row, or uses a primitive not listed here, gets `None` and the wing applies it
with JAX instead (same results, more passes over memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ...optimizers import update_rule
from ...specs import OptimizerSpec

_UNARY: dict[str, Callable[[str], str]] = {
    "neg": lambda a: f"-{a}",
    "sqrt": lambda a: f"np.sqrt({a})",
    "rsqrt": lambda a: f"(_ONE / np.sqrt({a}))",
    "exp": lambda a: f"np.exp({a})",
    "log": lambda a: f"np.log({a})",
    "log1p": lambda a: f"np.log1p({a})",
    "expm1": lambda a: f"np.expm1({a})",
    "tanh": lambda a: f"np.tanh({a})",
    "logistic": lambda a: f"(_ONE / (_ONE + np.exp(-{a})))",
    "abs": lambda a: f"np.abs({a})",
    "sign": lambda a: f"np.sign({a})",
    "floor": lambda a: f"np.floor({a})",
    "ceil": lambda a: f"np.ceil({a})",
    "square": lambda a: f"({a} * {a})",
    "copy": lambda a: a,
    "copy_p": lambda a: a,
}
_BINARY: dict[str, Callable[[str, str], str]] = {
    "add": lambda a, b: f"({a} + {b})",
    "sub": lambda a, b: f"({a} - {b})",
    "mul": lambda a, b: f"({a} * {b})",
    "div": lambda a, b: f"({a} / {b})",
    "pow": lambda a, b: f"np.power({a}, {b})",
    "max": lambda a, b: f"np.maximum({a}, {b})",
    "min": lambda a, b: f"np.minimum({a}, {b})",
    "eq": lambda a, b: f"({a} == {b})",
    "ne": lambda a, b: f"({a} != {b})",
    "lt": lambda a, b: f"({a} < {b})",
    "le": lambda a, b: f"({a} <= {b})",
    "gt": lambda a, b: f"({a} > {b})",
    "ge": lambda a, b: f"({a} >= {b})",
    "and": lambda a, b: f"({a} & {b})",
    "or": lambda a, b: f"({a} | {b})",
}
_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call")
_CASTS = {np.dtype(np.float32): "np.float32", np.dtype(np.int32): "np.int32",
          np.dtype(np.bool_): "bool"}


class NotElementwise(Exception):
    """The rule cannot be written as scalar statements (the wing falls back to JAX)."""


@dataclasses.dataclass(frozen=True)
class RuleSource:
    """A rule as the module-level source of `def rule(grad, row, *slots, *hyper)`.

    Attributes:
      source: constants (`_C<k>`, `_ONE`) then the function, which returns
        `(new_row, *new_slots)` as float32 scalars.
      num_slots: slot arrays the rule reads and returns.
      hyper_kinds: per hyperparameter, "f" (float32: the kernel reads it from its
        float operand) or "i" (int32 or bool: from its int operand).
    """

    source: str
    num_slots: int
    hyper_kinds: tuple[str, ...]


def hyper_kind(value: Any) -> str | None:
    """How a hyperparameter reaches the kernel: "f", "i", or None (not a scalar we carry)."""
    if np.ndim(value) != 0:
        return None
    dtype = jnp.result_type(value)
    if jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize <= 4:
        return "f"
    if dtype == jnp.bool_ or (jnp.issubdtype(dtype, jnp.integer) and np.dtype(dtype).itemsize <= 4):
        return "i"
    return None


def rule_source(spec: OptimizerSpec, dim: int) -> RuleSource | None:
    """`spec`'s update rule as scalar source, or None when it is not elementwise on rows of
    `dim` values (or returns other shapes or dtypes: JAX's path then reports the error).

    The rule is traced on a `[dim + 1, dim]` block: on a block of another width a rule that
    slices its rows (`row[:, :5]` on a width of 3) traced as a whole row and was compiled
    in, updating every column; and rows never as many as columns, so no transposition
    passes for elementwise. The source has no shapes in it: every width shares its kernels.
    """
    hyperparameters = spec.hyperparameters(0)
    kinds = tuple(hyper_kind(h) for h in hyperparameters)
    if None in kinds:
        return None
    shape = (dim + 1, dim)
    block = jax.ShapeDtypeStruct(shape, jnp.float32)
    scalars = [jax.ShapeDtypeStruct((), jnp.float32 if k == "f" else jnp.int32) for k in kinds]
    num_slots = len(spec.slot_names)
    params = ["grad", "row", *(f"slot{i}" for i in range(num_slots)),
              *(f"hyper{i}" for i in range(len(kinds)))]
    try:
        closed = jax.make_jaxpr(update_rule(spec))(*[block] * (2 + num_slots), *scalars)
        writer = _Writer(shape)
        outputs = writer.inline(closed, params)
    except NotElementwise:
        return None
    except Exception:  # a rule that cannot trace on a block: JAX's path reports its error
        return None
    if len(outputs) != 1 + num_slots or any(
            tuple(aval.shape) != shape or aval.dtype != jnp.float32
            for aval in closed.out_avals):  # pyright: ignore[reportAttributeAccessIssue]
        return None  # not float32 rows for rows: JAX's path reports the rule's error
    body = [f"    {line}" for line in writer.lines]
    body.append(f"    return ({', '.join(f'np.float32({o})' for o in outputs)},)")
    source = "\n".join([
        "_ONE = np.float32(1.0)",
        *writer.constants,
        "",
        "",
        f"def rule({', '.join(params)}):",
        *body,
        "",
    ])
    return RuleSource(source, num_slots, kinds)  # pyright: ignore[reportArgumentType]


class _Writer:
    """Turns jaxpr equations into numbered scalar assignments."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block  # the traced [rows, dim]: a value of another shape is not elementwise
        self.lines: list[str] = []
        self.constants: list[str] = []
        self._count = 0

    def _fresh(self) -> str:
        self._count += 1
        return f"v{self._count}"

    def _constant(self, value: Any) -> str:
        array = np.asarray(value)
        if array.ndim != 0 and array.shape != self.block:
            raise NotElementwise(f"constant of shape {array.shape}")
        if array.ndim and not np.all(array == array.flat[0]):
            raise NotElementwise("a non-uniform constant block")
        item = array.flat[0]
        name = f"_C{len(self.constants)}"
        if array.dtype == np.bool_:
            text = "True" if item else "False"
        elif np.issubdtype(array.dtype, np.integer):
            text = f"np.int32({int(item)})"
        elif np.issubdtype(array.dtype, np.floating):
            text = f"np.float32(float.fromhex({float(item).hex()!r}))"
        else:
            raise NotElementwise(f"constant of dtype {array.dtype}")
        self.constants.append(f"{name} = {text}")
        return name

    def inline(self, closed: Any, args: Sequence[str]) -> list[str]:
        """Write `closed`'s equations with its inputs bound to `args`; its output names."""
        jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
        consts = getattr(closed, "consts", ())
        env: dict[Any, str] = {}
        for var, const in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self._constant(const)
        for var, name in zip(jaxpr.invars, args, strict=True):
            self._check(var.aval)
            env[var] = name

        def read(atom: Any) -> str:
            if isinstance(atom, Literal):
                return self._constant(atom.val)
            return env[atom]

        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                self._check(var.aval)
            ins = [read(a) for a in eqn.invars]
            outs = self._equation(eqn, ins)
            for var, name in zip(eqn.outvars, outs, strict=True):
                env[var] = name
        return [read(a) for a in jaxpr.outvars]

    def _equation(self, eqn: Any, ins: list[str]) -> list[str]:
        name = eqn.primitive.name
        if name in _CALLS:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if inner is None:
                raise NotElementwise(f"call {name} without a jaxpr")
            return self.inline(inner, ins)
        if name in _UNARY:
            return [self._assign(_UNARY[name](ins[0]))]
        if name in _BINARY:
            return [self._assign(_BINARY[name](ins[0], ins[1]))]
        if name == "not":
            boolean = eqn.invars[0].aval.dtype == np.bool_
            return [self._assign(f"(not {ins[0]})" if boolean else f"(~{ins[0]})")]
        if name == "integer_pow":
            return [self._assign(_integer_pow(ins[0], int(eqn.params["y"])))]
        if name == "select_n":
            which, *cases = ins
            if len(cases) != 2 or eqn.invars[0].aval.dtype != np.bool_:
                raise NotElementwise("select_n over more than two cases")
            return [self._assign(f"({cases[1]} if {which} else {cases[0]})")]
        if name == "clamp":
            low, x, high = ins
            return [self._assign(f"np.minimum(np.maximum({x}, {low}), {high})")]
        if name == "convert_element_type":
            cast = _CASTS.get(np.dtype(eqn.params["new_dtype"]))
            if cast is None:
                raise NotElementwise(f"conversion to {eqn.params['new_dtype']}")
            return [self._assign(f"{cast}({ins[0]})")]
        if name in ("broadcast_in_dim", "reshape") and eqn.invars[0].aval.shape == ():
            return [ins[0]]  # a scalar spread over the block: the same scalar per element
        raise NotElementwise(f"primitive {name}")

    def _check(self, aval: Any) -> None:
        shape = getattr(aval, "shape", None)
        if shape not in ((), self.block):
            raise NotElementwise(f"a value of shape {shape}")
        if np.dtype(aval.dtype) not in _CASTS:
            raise NotElementwise(f"a value of dtype {aval.dtype}")

    def _assign(self, expression: str) -> str:
        name = self._fresh()
        self.lines.append(f"{name} = {expression}")
        return name


def _integer_pow(x: str, y: int) -> str:
    if y == 0:
        return "_ONE"
    product = " * ".join([x] * abs(y)) if abs(y) <= 4 else f"np.power({x}, np.float32({abs(y)}))"
    return f"({product})" if y > 0 else f"(_ONE / ({product}))"
