"""Marks compat's lookup and update calls so that auto-pipelining finds them in a jaxpr.

tilecore's lookup and update are ordinary JAX ops, not primitives of their own, so
in a train step's jaxpr nothing tells them apart from the dense model. While
`marking()` is active (only while `auto_pipelining` traces a step), each call of a
`markable` device function runs inside a nested `jax.jit` named
`{LOOKUP_MARK|UPDATE_MARK}_v{k}`: one jaxpr equation whose inputs are the call's
array arguments with the `k` leaves of its embedding variables last. Outside
`marking()` the functions run unchanged (no nested jit, no extra compilation).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

LOOKUP_MARK = "tilecore_embedding_lookup"
UPDATE_MARK = "tilecore_embedding_update"
_NAME = re.compile(rf"^({LOOKUP_MARK}|{UPDATE_MARK})_v(\d+)$")

_Args = ParamSpec("_Args")
_Result = TypeVar("_Result")
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("tilecore_ap_marking",
                                                               default=False)


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """Within this block, markable device functions trace as named nested jits."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def parse_mark(name: object) -> tuple[str, int] | None:
    """`(mark, number of variable leaves)` of a marked jit's name, else None."""
    match = _NAME.match(name) if isinstance(name, str) else None
    return None if match is None else (match.group(1), int(match.group(2)))


def _tables_only(variables: Any) -> Any:
    """A lookup reads only the tables: slots stay out of the marked call's inputs."""
    return {name: (value[0],) for name, value in variables.items()}


def markable(mark: str, data: tuple[str, ...]) -> Callable[[Callable[_Args, _Result]],
                                                            Callable[_Args, _Result]]:
    """Decorate a device function whose array inputs are the parameters `data` plus
    `embedding_variables`; the other parameters are static (specs, counts, names)."""

    def decorate(fn: Callable[_Args, _Result]) -> Callable[_Args, _Result]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: _Args.args, **kwargs: _Args.kwargs) -> _Result:
            if not _ACTIVE.get():
                return fn(*args, **kwargs)
            import jax

            bound = signature.bind(*args, **kwargs)
            variables = bound.arguments["embedding_variables"]
            if mark == LOOKUP_MARK:
                variables = _tables_only(variables)
            arrays = {name: bound.arguments[name] for name in data if name in bound.arguments}

            def marked(arrays: dict[str, Any], variables: Any) -> _Result:
                call = bound.arguments | arrays | {"embedding_variables": variables}
                return fn(**call)  # pyright: ignore[reportCallIssue]

            marked.__name__ = f"{mark}_v{len(jax.tree.leaves(variables))}"
            return jax.jit(marked)(arrays, variables)

        return run

    return decorate
