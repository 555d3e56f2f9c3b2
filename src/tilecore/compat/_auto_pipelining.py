"""Tracing a user's train step for `lib.auto_pipelining`: argument checks, static
arguments carried across steps, and the `FunctionRunner` of one traced step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex

from ..specs._numbers import is_integer
from ._auto_pipelining_hook import marking
from .lib.auto_pipelining import decompose

_TRACER_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                  jax.errors.TracerArrayConversionError)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Static:
    """A static argument kept in the pipelining state: no leaves, the value in the treedef
    (so `jit` sees it as part of the state's structure, as its own static arguments)."""

    value: Any


def name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def check_static_argnums(fn: Callable[..., Any], static_argnums: Any) -> tuple[int, ...]:
    """`static_argnums` as a tuple of positions ≥ 1 of `fn`'s arguments (0 is the carry).

    As `jax.make_jaxpr` (the reference's tracer) reads it: None is none, one integer
    (NumPy's too) is one position; a float or other non-iterable is a TypeError.
    """
    if not callable(fn):
        raise TypeError(f"auto_pipelining: fn must be the train step (a callable), got "
                        f"{type(fn).__name__} {fn!r:.60}.")
    if static_argnums is None:
        return ()
    if is_integer(static_argnums):
        static_argnums = (static_argnums,)
    try:
        nums = tuple(static_argnums)
    except TypeError:
        raise TypeError(f"auto_pipelining({name_of(fn)}): static_argnums must be an integer or "
                        f"a sequence of integers (positions ≥ 1), got "
                        f"{type(static_argnums).__name__} {static_argnums!r}.") from None
    bad = [n for n in nums if not is_integer(n) or n < 1]
    if bad:
        raise ValueError(
            f"auto_pipelining({name_of(fn)}): static_argnums={static_argnums!r} holds {bad}; "
            "give positions ≥ 1 of the step's arguments (position 0 is the carry, which is "
            "never static)."
        )
    return tuple(int(n) for n in nums)


def check_call(fn: Callable[..., Any], static_argnums: tuple[int, ...], carry: Any,
               args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Raise for a call the pipelined step cannot take: keywords, static positions out
    of range, unhashable static values, non-array leaves in the other arguments."""
    what = f"auto_pipelining({name_of(fn)})"
    if kwargs:
        raise TypeError(f"{what}: pass the step's arguments positionally (they are kept for "
                        f"the next step by position); got keywords {sorted(kwargs)}.")
    beyond = [n for n in static_argnums if n > len(args)]
    if beyond:
        raise ValueError(f"{what}: static_argnums {beyond} are beyond the call's "
                         f"{len(args) + 1} arguments (the carry and {len(args)} more).")
    for position, value in enumerate((carry, *args)):
        if position in static_argnums:
            try:
                hash(value)
            except TypeError as err:
                raise TypeError(f"{what}: static argument {position} ({type(value).__name__}) "
                                "is not hashable; pass it as an array argument (not in "
                                "static_argnums) or make it hashable.") from err
            continue
        for leaf in jax.tree.leaves(value):
            if not jex.core.valid_jaxtype(leaf):
                where = "the carry" if position == 0 else f"argument {position}"
                raise TypeError(
                    f"{what}: {where} holds a {type(leaf).__name__} ({leaf!r:.60}), which is "
                    f"not an array; list position {position} in static_argnums to pass it as "
                    "a static value" + (" (the carry must hold arrays only)." if position == 0
                                        else ".")
                )


def wrap_statics(args: Sequence[Any], static_argnums: tuple[int, ...]) -> tuple[Any, ...]:
    """The step's arguments (after the carry) with the static ones held in `Static`."""
    return tuple(Static(a) if k + 1 in static_argnums else a for k, a in enumerate(args))


def unwrap(args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(a.value if isinstance(a, Static) else a for a in args)


def same_signature(a: Any, b: Any) -> bool:
    """Whether two stored argument tuples trace alike (statics, structure, shapes)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(jax.numpy.shape(x) == jax.numpy.shape(y)
               and jax.numpy.result_type(x) == jax.numpy.result_type(y)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def trace(fn: Callable[..., Any], static_argnums: tuple[int, ...], carry: Any,
          args: Sequence[Any]) -> tuple[jex.core.ClosedJaxpr, Any]:
    """The jaxpr of `fn(carry, *args)` with the lookups and updates marked, and its
    output shapes (a fresh closure each time: no cached, unmarked trace is reused)."""
    try:
        with marking():
            return jax.make_jaxpr(lambda *a: fn(*a), static_argnums=static_argnums,
                                  return_shape=True)(carry, *unwrap(args))
    except _TRACER_ERRORS as err:
        traced = [k + 1 for k, a in enumerate(args) if not isinstance(a, Static)]
        raise TypeError(
            f"auto_pipelining({name_of(fn)}): tracing the step needed the concrete value of a "
            f"traced argument ({type(err).__name__}). Arguments that steer Python control "
            "flow (flags, sizes, modes) must be static: list their positions in "
            f"static_argnums (the carry is 0). Traced positions now: {traced}."
        ) from err


def _check_carry_kept(what: str, carry: Any, new: Any) -> None:
    """The step's new carry has the carry's shapes and dtypes: the next step (traced for
    the pipeline's state) gets it, so a change failed a step later, obscurely."""
    changed = [
        f"carry{jax.tree_util.keystr(path)}: {jax.numpy.result_type(a).name}"
        f"{list(jax.numpy.shape(a))} in, {b.dtype.name}{list(b.shape)} out"
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(carry)[0],
                                jax.tree.leaves(new), strict=True)
        if (jax.numpy.shape(a), jax.numpy.result_type(a)) != (tuple(b.shape), b.dtype)]
    if changed:
        raise ValueError(f"{what}: the step's first result must keep the carry's shapes and "
                         f"dtypes (it is the next step's carry); changed: "
                         + "; ".join(changed[:6]) + (" …" if len(changed) > 6 else "")
                         + ". Cast or reshape the new values to the carry's.")


def build_runner(fn: Callable[..., Any], static_argnums: tuple[int, ...], carry: Any,
                 args: Sequence[Any]) -> decompose.FunctionRunner:
    """Trace `fn(carry, *args)` and split it into lookup, dense and update parts."""
    closed, shape = trace(fn, static_argnums, carry, args)
    what = f"auto_pipelining({name_of(fn)})"
    carry_only = jax.tree.structure(shape) == jax.tree.structure(carry)
    if not isinstance(shape, tuple) or not shape or carry_only:
        got = "an array" if isinstance(shape, jax.ShapeDtypeStruct) else type(shape).__name__
        raise TypeError(f"{what}: the step must return a tuple (carry, *results); got {got}"
                        + (" (the carry alone, which is not enough even when it is a tuple)"
                           if carry_only else "") + ". Return e.g. `new_carry, loss`.")
    if jax.tree.structure(carry) != jax.tree.structure(shape[0]):
        raise ValueError(f"{what}: the step's first result must have the carry's structure "
                         f"{jax.tree.structure(carry)}; got {jax.tree.structure(shape[0])}.")
    _check_carry_kept(what, carry, shape[0])
    return decompose.decompose(closed, jax.tree.structure(shape), jax.tree.structure(carry))
