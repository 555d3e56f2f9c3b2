"""`jax_tpu_embedding.sparsecore.lib.auto_pipelining.utils` on tilecore: finding the
embedding lookups and updates in a train step's jaxpr.

The reference looks for its TPU primitives (`sparse_dense_matmul_csr*`,
`sparse_dense_matmul_grad*`) inside `shard_map` equations. tilecore's lookup and
update are ordinary JAX ops; while auto-pipelining traces a step, compat's
`tpu_sparse_dense_matmul` and `tpu_sparse_dense_matmul_grad` each become one
nested `jit` equation named `EMBEDDING_LOOKUP_PRIMITIVE_PREFIX` (resp.
`EMBEDDING_UPDATE_PRIMITIVE_PREFIX`) + `_v{k}`, whose last `k` inputs are the
embedding variables (the lookup: tables only; the update: tables and slots). Such
an equation counts as a lookup (update) at the top of the step, or directly inside
a `shard_map` (the reference's way of calling them per device).

The reference's `EMBEDDING_LOOKUP_DATA_LEN` / `EMBEDDING_UPDATE_DATA_LEN` (5 and 6
CSR arrays of one table) have no counterpart: one compat call covers every stack,
so the number of data inputs varies; `lookup_params` / `update_params` read it off
the equation instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import jax.extend as jex
from jax.interpreters import partial_eval as pe

from ..._auto_pipelining_hook import LOOKUP_MARK, UPDATE_MARK, parse_mark
from ..._auto_pipelining_jaxpr import with_io

EMBEDDING_LOOKUP_PRIMITIVE_PREFIX = LOOKUP_MARK
EMBEDDING_UPDATE_PRIMITIVE_PREFIX = UPDATE_MARK
CUSTOM_VJP_CALL_PRIMITIVE_NAME = "custom_vjp_call"
SHARD_MAP_PRIMITIVE_NAME = "shard_map"
JIT_PRIMITIVE_NAMES = ("jit", "pjit")

Atom: TypeAlias = Any  # a jaxpr `Var` or `Literal`


def marked_call(eqn: jex.core.JaxprEqn) -> tuple[str, int] | None:
    """`(mark, number of variable inputs)` of a marked lookup/update `jit`, else None."""
    if eqn.primitive.name not in JIT_PRIMITIVE_NAMES:
        return None
    return parse_mark(eqn.params.get("name"))


def _inner_marked(eqn: jex.core.JaxprEqn, mark: str) -> jex.core.JaxprEqn | None:
    """The marked call `eqn` is, or the one directly inside `eqn` if it is a shard_map."""
    found = marked_call(eqn)
    if found is not None:
        return eqn if found[0] == mark else None
    if eqn.primitive.name != SHARD_MAP_PRIMITIVE_NAME:
        return None
    return next((e for e in eqn.params["jaxpr"].eqns if (marked_call(e) or ("",))[0] == mark),
                None)


def is_embedding_lookup(eqn: jex.core.JaxprEqn) -> bool:
    """Whether `eqn` is a `tpu_sparse_dense_matmul` call (or a shard_map holding one)."""
    return _inner_marked(eqn, LOOKUP_MARK) is not None


def is_embedding_update(eqn: jex.core.JaxprEqn) -> bool:
    """Whether `eqn` is a `tpu_sparse_dense_matmul_grad` call (or a shard_map holding one)."""
    return _inner_marked(eqn, UPDATE_MARK) is not None


def get_embedding_lookup_eqn(eqns: Sequence[jex.core.JaxprEqn]) -> jex.core.JaxprEqn:
    """The first marked lookup call among `eqns`."""
    for eqn in eqns:
        if (marked_call(eqn) or ("",))[0] == LOOKUP_MARK:
            return eqn
    raise ValueError("No embedding lookup (tpu_sparse_dense_matmul) among the given equations.")


def replace_embedding_lookup_eqn(eqns: Sequence[jex.core.JaxprEqn],
                                 new_lookup_eqn: jex.core.JaxprEqn) -> list[jex.core.JaxprEqn]:
    """`eqns` with every marked lookup call replaced by `new_lookup_eqn`."""
    return [new_lookup_eqn if (marked_call(e) or ("",))[0] == LOOKUP_MARK else e for e in eqns]


def _split(eqn: jex.core.JaxprEqn, mark: str) -> tuple[list[Atom], list[Atom]]:
    inner = _inner_marked(eqn, mark)
    if inner is None:
        raise ValueError(f"The equation {eqn.primitive.name!r} holds no {mark} call.")
    count = parse_mark(inner.params["name"])[1]  # pyright: ignore[reportOptionalSubscript]
    if inner is eqn:
        cut = len(eqn.invars) - count
        return list(eqn.invars[:cut]), list(eqn.invars[cut:])
    # Inside a shard_map: its inputs that flow into the call's variables are the tables.
    body = eqn.params["jaxpr"]
    wanted = [v for v in inner.invars[len(inner.invars) - count:]
              if isinstance(v, jex.core.Var)]
    _, used = pe.dce_jaxpr(with_io(body, outvars=wanted), True)
    data = [atom for atom, table in zip(eqn.invars, used, strict=True) if not table]
    tables = [atom for atom, table in zip(eqn.invars, used, strict=True) if table]
    return data, tables


def lookup_params(eqn: jex.core.JaxprEqn) -> tuple[list[Atom], list[Atom]]:
    """A lookup equation's inputs as `(data, tables)`."""
    return _split(eqn, LOOKUP_MARK)


def update_params(eqn: jex.core.JaxprEqn) -> tuple[list[Atom], list[Atom]]:
    """An update equation's inputs as `(data, variables)`: the data (activation
    gradients, preprocessed buffers, step) comes from the dense part of the step."""
    return _split(eqn, UPDATE_MARK)


def clone_vars(var_list: Iterable[Atom]) -> list[jex.core.Var]:
    """Fresh variables with the same abstract values."""
    return [jex.core.Var(var.aval) for var in var_list]


def inline_jaxpr(jaxpr: jex.core.Jaxpr, invars: Sequence[Atom],
                 outvars: Sequence[Any]) -> list[jex.core.JaxprEqn]:
    """`jaxpr`'s equations rewritten to read `invars` and write `outvars` (for inlining
    a call equation into its caller); the body's own variables are renamed."""
    if jaxpr.constvars:
        raise ValueError("inline_jaxpr: the jaxpr has constants; close over no arrays in the "
                         "function that wraps tpu_sparse_dense_matmul.")
    if len(invars) != len(jaxpr.invars) or len(outvars) != len(jaxpr.outvars):
        raise ValueError(f"inline_jaxpr: the jaxpr takes {len(jaxpr.invars)} inputs and gives "
                         f"{len(jaxpr.outvars)} outputs; got {len(invars)} and {len(outvars)}.")
    produced = {v for eqn in jaxpr.eqns for v in eqn.outvars}
    if (any(not isinstance(v, jex.core.Var) or v not in produced for v in jaxpr.outvars)
            or len(set(jaxpr.outvars)) < len(outvars)):
        raise ValueError("inline_jaxpr: the jaxpr returns an input, a constant or one value "
                         "twice; the wrapper of tpu_sparse_dense_matmul must compute each of "
                         "its outputs.")
    renamed: dict[Any, Atom] = dict(zip(jaxpr.invars, invars, strict=True))
    renamed.update((inner, outer) for inner, outer in zip(jaxpr.outvars, outvars, strict=True)
                   if not isinstance(outer, jex.core.DropVar))

    def read(atom: Atom) -> Atom:
        return atom if isinstance(atom, jex.core.Literal) else renamed[atom]

    def write(var: Any) -> Any:
        if isinstance(var, jex.core.DropVar):
            return var
        if var not in renamed:
            renamed[var] = jex.core.Var(var.aval)
        return renamed[var]

    return [eqn.replace(invars=[read(a) for a in eqn.invars],
                        outvars=[write(v) for v in eqn.outvars]) for eqn in jaxpr.eqns]
