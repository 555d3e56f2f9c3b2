"""`jax_tpu_embedding.sparsecore.lib.auto_pipelining.preprocess` on tilecore: checking
that a train step's lookups and updates can be split off (see `utils` for how they
appear in a jaxpr).

A lookup (update) must be a top-level equation of the step or sit directly inside
a top-level `shard_map`; `custom_vjp` wrappers around a lookup are inlined first,
as in the reference. Anything else around them (`jit`, `cond`, `grad`, loops) is
an error that names the wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend as jex

from ..._auto_pipelining_jaxpr import with_io
from . import utils

_WHAT = {utils.EMBEDDING_LOOKUP_PRIMITIVE_PREFIX: "tpu_sparse_dense_matmul",
         utils.EMBEDDING_UPDATE_PRIMITIVE_PREFIX: "tpu_sparse_dense_matmul_grad"}


def _has_mark(eqn: jex.core.JaxprEqn, mark: str) -> bool:
    """Whether `eqn`, or any jaxpr nested in its parameters, holds a `mark` call."""
    found = utils.marked_call(eqn)
    if found is not None and found[0] == mark:
        return True
    return any(_has_mark(inner, mark) for sub in jex.core.jaxprs_in_params(eqn.params)
               for inner in sub.eqns)


def _has_embedding_lookup(eqn: jex.core.JaxprEqn) -> bool:
    return _has_mark(eqn, utils.EMBEDDING_LOOKUP_PRIMITIVE_PREFIX)


def _has_embedding_update(eqn: jex.core.JaxprEqn) -> bool:
    return _has_mark(eqn, utils.EMBEDDING_UPDATE_PRIMITIVE_PREFIX)


def _inline_custom_vjp(jaxpr: jex.core.Jaxpr) -> jex.core.Jaxpr:
    """`jaxpr` with the `custom_vjp` calls that hold a lookup replaced by their bodies.

    A body may return its inputs unchanged (nnx's `custom_vjp` returns the layer's
    state next to the activations): later equations then read those inputs directly.
    """
    eqns: list[jex.core.JaxprEqn] = []
    alias: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom if isinstance(atom, jex.core.Literal) else alias.get(atom, atom)

    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=[read(a) for a in eqn.invars])
        if (eqn.primitive.name == utils.CUSTOM_VJP_CALL_PRIMITIVE_NAME
                and _has_embedding_lookup(eqn)):
            body = eqn.params["call_jaxpr"].jaxpr
            body, outvars = _computed_outputs(body, eqn.invars, eqn.outvars, alias)
            eqns.extend(utils.inline_jaxpr(body, eqn.invars, outvars))
        else:
            eqns.append(eqn)
    return jaxpr.replace(eqns=eqns, outvars=[read(a) for a in jaxpr.outvars])


def _computed_outputs(body: jex.core.Jaxpr, invars: Sequence[Any], outvars: Sequence[Any],
                      alias: dict[Any, Any]) -> tuple[jex.core.Jaxpr, list[Any]]:
    """`body` returning only the values it computes (each once), and the caller's
    variables for those; the caller's other outputs go into `alias`, mapped to the
    caller's atom that they equal (an input of the call, a literal, or another output)."""
    produced = {v for eqn in body.eqns for v in eqn.outvars}
    outer_of_inner = dict(zip(body.invars, invars, strict=True))
    kept_inner: list[Any] = []
    kept_outer: list[Any] = []
    for inner, outer in zip(body.outvars, outvars, strict=True):
        if isinstance(inner, jex.core.Literal):
            alias[outer] = inner
        elif inner not in produced:
            alias[outer] = outer_of_inner[inner]
        elif inner in kept_inner:
            alias[outer] = kept_outer[kept_inner.index(inner)]
        else:
            kept_inner.append(inner)
            kept_outer.append(outer)
    return with_io(body, outvars=kept_inner), kept_outer


def _validate(eqn: jex.core.JaxprEqn, mark: str) -> None:
    found = utils.is_embedding_lookup(eqn) if mark == utils.EMBEDDING_LOOKUP_PRIMITIVE_PREFIX \
        else utils.is_embedding_update(eqn)
    if not found:
        raise ValueError(
            f"auto_pipelining: {_WHAT[mark]} is called inside a {eqn.primitive.name!r} "
            "equation; call it at the top of the train step (or directly inside "
            "jax.shard_map), not under jit, cond, loops or autodiff, so that it can be "
            "split from the dense part."
        )


def validate_jaxpr(jaxpr: jex.core.Jaxpr) -> None:
    """Raise if a lookup or update of `jaxpr` cannot be split off."""
    for eqn in jaxpr.eqns:
        lookup, update = _has_embedding_lookup(eqn), _has_embedding_update(eqn)
        if lookup and update:
            raise ValueError(
                f"auto_pipelining: one {eqn.primitive.name!r} equation holds both "
                "tpu_sparse_dense_matmul and tpu_sparse_dense_matmul_grad; call them in "
                "separate shard_maps (or outside shard_map)."
            )
        if lookup:
            _validate(eqn, utils.EMBEDDING_LOOKUP_PRIMITIVE_PREFIX)
        if update:
            _validate(eqn, utils.EMBEDDING_UPDATE_PRIMITIVE_PREFIX)


def preprocess(jaxpr: jex.core.Jaxpr) -> jex.core.Jaxpr:
    """`jaxpr` with lookups un-wrapped from `custom_vjp`, validated for splitting."""
    jaxpr = _inline_custom_vjp(jaxpr)
    validate_jaxpr(jaxpr)
    return jaxpr
