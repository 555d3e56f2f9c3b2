"""`jax_tpu_embedding.sparsecore.lib.auto_pipelining.decompose` on tilecore: a train
step's jaxpr split into SparseCore forward (lookup), dense, and SparseCore backward
(update).

The step `(carry, *args) -> (carry, *results)` is cut at its lookups and updates
(see `utils`) into four jaxprs, run by a `FunctionRunner`:

- lookup: `(carry, args) -> activations`;
- dense: `(activations, carry, args) -> (update data, carry, *results)`, the
  embedding variables passed through unchanged;
- update: `(update data, carry) -> carry`, only the embedding variables changed;
- update_lookup: update, then lookup on the updated carry.

The embedding variables are the carry leaves the updates' variables are computed
from; they must all be in the carry, the dense part must not read them, and the
updates must read nothing but them and their update data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
import jax.extend as jex
from jax import core as jax_core
from jax.interpreters import partial_eval as pe

from ..._auto_pipelining_jaxpr import with_io
from ..._auto_pipelining_split import chain, cut, inputs_of, leaf_names, named
from . import preprocess, utils

Carry: TypeAlias = Any
Activations: TypeAlias = list[jax.Array]
Updates: TypeAlias = list[jax.Array]
TreeDef: TypeAlias = Any  # a jax.tree_util.PyTreeDef (pyright rejects it in annotations)


def _check_inputs(values: Sequence[Any], invars: Sequence[Any], what: str) -> None:
    """`values` fit the jaxpr inputs `invars` (the same count, shapes and dtypes)."""
    got = [(tuple(jax.numpy.shape(v)), jax.numpy.result_type(v)) for v in values]
    want = [(tuple(v.aval.shape), v.aval.dtype) for v in invars]
    if got != want:
        raise ValueError(
            f"auto_pipelining: the {what} handed on from the previous step do not fit this "
            f"step ({len(got)} arrays {got[:3]}…, expected {len(want)} {want[:3]}…); keep "
            "the shapes of the step's arguments the same from step to step."
        )


@dataclasses.dataclass
class FunctionRunner:
    """Runs the parts of a step function (the jaxprs of `decompose`)."""

    result_structure: TreeDef
    carry_structure: TreeDef
    literals: list[Any]  # the step jaxpr's constants, shared by the four parts

    lookup_jaxpr: jex.core.Jaxpr
    update_jaxpr: jex.core.Jaxpr
    update_lookup_jaxpr: jex.core.Jaxpr
    dense_jaxpr: jex.core.Jaxpr

    update_params_len: int
    activations_len: int

    def _run_jaxpr(self, jaxpr: jex.core.Jaxpr, *args: Any) -> list[Any]:
        return jax_core.eval_jaxpr(jaxpr, self.literals, *jax.tree.leaves(args))

    def embedding_lookup(self, carry: Carry, *args: Any) -> Activations:
        """The activations of the step's lookups on `args`, with `carry`'s tables."""
        return self._run_jaxpr(self.lookup_jaxpr, carry, *args)

    def dense(self, activations: Activations, carry: Carry, *args: Any) -> tuple[Any, ...]:
        """`(update data, carry, *results)`: the step without its lookups and updates."""
        _check_inputs(activations, self.dense_jaxpr.invars[: self.activations_len],
                      "activations")
        out = self._run_jaxpr(self.dense_jaxpr, activations, carry, *args)
        updates, results = out[: self.update_params_len], out[self.update_params_len:]
        return updates, *jax.tree.unflatten(self.result_structure, results)

    def embedding_update(self, updates: Updates, carry: Carry) -> Carry:
        """`carry` with its embedding variables updated by a step's update data."""
        _check_inputs(updates, self.update_jaxpr.invars[: self.update_params_len],
                      "embedding updates")
        return jax.tree.unflatten(self.carry_structure,
                                  self._run_jaxpr(self.update_jaxpr, updates, carry))

    def embedding_update_lookup(self, updates: Updates, carry: Carry,
                                *args: Any) -> tuple[Activations, Carry]:
        """Update the embedding variables, then look `args` up in the updated tables."""
        _check_inputs(updates, self.update_lookup_jaxpr.invars[: self.update_params_len],
                      "embedding updates")
        out = self._run_jaxpr(self.update_lookup_jaxpr, updates, carry, *args)
        acts = out[: self.activations_len]
        return acts, jax.tree.unflatten(self.carry_structure, out[self.activations_len:])

    def none_result(self) -> Any:
        """The step's result structure with every leaf None (no dense step ran)."""
        return jax.tree.unflatten(self.result_structure,
                                  [None] * self.result_structure.num_leaves)


def _tables(parts: Any, carry_len: int, names: list[str]) -> list[bool]:
    """Which inputs the updates' embedding variables come from, after the checks that
    each table is looked up and updated once, by paired calls, and lives in the carry."""
    lookups = [inputs_of(parts.step, t) for t in parts.lookup_tables]
    updates = [inputs_of(parts.step, v) for v in parts.update_variables]
    if not lookups:
        raise ValueError("auto_pipelining: the train step has no embedding lookup; call "
                         "tpu_sparse_dense_matmul (or a SparseCoreEmbed layer) on the "
                         "carry's embedding variables.")
    if not updates:
        raise ValueError("auto_pipelining: the train step has no embedding update; call "
                         "tpu_sparse_dense_matmul_grad and return its result in the carry.")
    n = len(parts.step.invars)
    for kind, masks in (("lookups", lookups), ("updates", updates)):
        for i, mask in enumerate(masks):
            for other in masks[:i]:
                shared = [a and b for a, b in zip(mask, other, strict=True)]
                if any(shared):
                    raise ValueError(
                        f"auto_pipelining: two embedding {kind} use the same tables "
                        f"({named(shared, names)}); call each of tpu_sparse_dense_matmul and "
                        "tpu_sparse_dense_matmul_grad once per table per step.")
    table = [any(m[i] for m in updates) for i in range(n)]
    looked = [any(m[i] for m in lookups) for i in range(n)]
    for lookup in lookups:
        if not any(a and b for a, b in zip(lookup, table, strict=True)):
            raise ValueError(f"auto_pipelining: the lookup of {named(lookup, names)} has no "
                             "matching tpu_sparse_dense_matmul_grad; update every looked-up "
                             "table in the step.")
    for update in updates:
        if not any(a and b for a, b in zip(update, looked, strict=True)):
            raise ValueError(f"auto_pipelining: the update of {named(update, names)} has no "
                             "matching tpu_sparse_dense_matmul lookup.")
    if any(table[carry_len:]):
        raise ValueError("auto_pipelining: the embedding variables come from the step's "
                         f"arguments ({named(table[carry_len:], names[carry_len:])}); keep "
                         "them in the carry (the first argument).")
    return table


def _require(used: list[bool], allowed: list[bool], what: str, names: list[str]) -> None:
    extra = [u and not a for u, a in zip(used, allowed, strict=True)]
    if any(extra):
        raise ValueError(f"auto_pipelining: {what} ({named(extra, names)}); the step cannot "
                         "be split into lookup, dense and update parts.")


def decompose(closed_jaxpr: jex.core.ClosedJaxpr, result_structure: TreeDef,
              carry_structure: TreeDef) -> FunctionRunner:
    """Split the jaxpr of a step `(carry, *args) -> (carry, *results)` into its parts.

    Raises ValueError naming the carry leaves (or step parts) at fault when the step
    cannot be split: no lookup or update, two for one table, tables outside the carry,
    tables read by the dense part, lookups after updates.
    """
    carry_len = carry_structure.num_leaves
    parts = cut(preprocess.preprocess(closed_jaxpr.jaxpr))
    step, full = parts.step, parts.jaxpr
    n_in, n_out = len(step.invars), len(step.outvars)
    names = leaf_names(carry_structure) + [f"argument leaf {i}" for i in range(n_in - carry_len)]
    acts, upds = len(parts.act_in), len(parts.upd_in)
    table_in = _tables(parts, carry_len, names)
    table_out = table_in[:carry_len] + [False] * (n_out - carry_len)

    lookup = pe.dce_jaxpr(with_io(step, outvars=parts.act_in), True, True)[0]
    if any(utils.is_embedding_update(e) for e in lookup.eqns):
        raise ValueError("auto_pipelining: a lookup reads tables written by "
                         "tpu_sparse_dense_matmul_grad in the same step; look up first.")

    keep = [True] * acts + [False] * upds + [not t for t in table_in]
    dense, used = pe.dce_jaxpr(full, [False] * acts + [True] * upds + [not t for t in table_out],
                               keep)
    _require(used[acts + upds:], keep[acts + upds:], "the dense part reads embedding variables",
             names)
    _require(used[acts:acts + upds], [False] * upds, "the dense part reads updated tables",
             [f"update input {i}" for i in range(upds)])
    dense = with_io(dense, invars=parts.act_in + list(step.invars), outvars=parts.upd_out + [
        step.invars[k] if table_out[k] else o for k, o in enumerate(step.outvars)])

    keep = [False] * acts + [True] * (upds + carry_len) + [False] * (n_in - carry_len)
    update, used = pe.dce_jaxpr(full, [False] * (acts + upds) + table_out, keep)
    _require(used[acts + upds:], keep[acts + upds:], "the updated tables depend on the step's "
             "arguments other than through tpu_sparse_dense_matmul_grad", names)
    _require(used[:acts], [False] * acts, "the updated tables depend on activations other "
             "than through tpu_sparse_dense_matmul_grad", [f"activation {i}" for i in range(acts)])
    update = with_io(update, invars=parts.upd_in + list(step.invars[:carry_len]), outvars=[
        o if table_in[k] else step.invars[k] for k, o in enumerate(step.outvars[:carry_len])])

    return FunctionRunner(
        result_structure=result_structure, carry_structure=carry_structure,
        literals=list(closed_jaxpr.consts), lookup_jaxpr=lookup, update_jaxpr=update,
        update_lookup_jaxpr=chain(update, lookup, carry_len), dense_jaxpr=dense,
        update_params_len=upds, activations_len=acts,
    )
