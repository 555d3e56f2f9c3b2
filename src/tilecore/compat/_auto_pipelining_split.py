"""Jaxpr plumbing for `lib.auto_pipelining.decompose`: cutting a step's jaxpr at its
lookups and updates, finding which carry leaves are embedding variables, and the
checks whose errors say what in the step keeps it from being pipelined."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
import jax.extend as jex
from jax.interpreters import partial_eval as pe

from ._auto_pipelining_jaxpr import with_io
from .lib.auto_pipelining import utils

Atom: TypeAlias = Any


@dataclasses.dataclass
class Cut:
    """The step's jaxpr with its lookups' outputs and updates' data made inputs/outputs.

    `jaxpr` (the full jaxpr) reads `act_in + upd_in + original inputs` and writes `act_out + upd_out
    + original outputs`: the dense part reads the activations from `act_in` (instead
    of the lookups) and hands the update data out through `upd_out`, while the
    updates read their data from `upd_in`.
    """

    step: jex.core.Jaxpr  # the step's own jaxpr, every lookup output named
    jaxpr: jex.core.Jaxpr
    act_in: list[Atom]
    act_out: list[Atom]
    upd_in: list[Atom]
    upd_out: list[Atom]
    lookup_tables: list[list[Atom]]  # per lookup call: the table atoms it reads
    update_variables: list[list[Atom]]  # per update call: the variables it reads


def _fresh_outputs(eqn: jex.core.JaxprEqn) -> jex.core.JaxprEqn:
    """`eqn` with its dropped outputs (`_`) named, so they can be jaxpr outputs."""
    outvars = [jex.core.Var(v.aval) if isinstance(v, jex.core.DropVar) else v
               for v in eqn.outvars]
    return eqn.replace(outvars=outvars)


def cut(jaxpr: jex.core.Jaxpr) -> Cut:
    """Cut `jaxpr` (already preprocessed) at its lookups and updates."""
    jaxpr = jaxpr.replace(eqns=[_fresh_outputs(e) if utils.is_embedding_lookup(e) else e
                                for e in jaxpr.eqns])
    act_in: list[Atom] = []
    act_out: list[Atom] = []
    upd_in: list[Atom] = []
    upd_out: list[Atom] = []
    lookups: list[list[Atom]] = []
    updates: list[list[Atom]] = []
    eqns = []
    for eqn in jaxpr.eqns:
        if utils.is_embedding_lookup(eqn):
            act_in.extend(eqn.outvars)
            eqn = eqn.replace(outvars=utils.clone_vars(eqn.outvars))
            act_out.extend(eqn.outvars)
            lookups.append(utils.lookup_params(eqn)[1])
        elif utils.is_embedding_update(eqn):
            data, variables = utils.update_params(eqn)
            updates.append(variables)
            fed: dict[Any, Atom] = {}
            for atom in data:  # constants stay in place; each variable is cut once
                if isinstance(atom, jex.core.Var) and atom not in fed:
                    fed[atom] = utils.clone_vars([atom])[0]
                    upd_out.append(atom)
                    upd_in.append(fed[atom])
            eqn = eqn.replace(invars=[fed.get(a, a) if isinstance(a, jex.core.Var) else a
                                      for a in eqn.invars])
        eqns.append(eqn)
    full = with_io(jaxpr, eqns=eqns, invars=act_in + upd_in + list(jaxpr.invars),
                   outvars=act_out + upd_out + list(jaxpr.outvars))
    return Cut(jaxpr, full, act_in, act_out, upd_in, upd_out, lookups, updates)


def inputs_of(jaxpr: jex.core.Jaxpr, atoms: Sequence[Atom]) -> list[bool]:
    """Which inputs of `jaxpr` the values `atoms` (computed in it) depend on."""
    wanted = [a for a in atoms if isinstance(a, jex.core.Var)]
    return pe.dce_jaxpr(with_io(jaxpr, outvars=wanted), True)[1]


def leaf_names(structure: Any) -> list[str]:
    """`carry…` paths of the leaves of a carry with this structure, for error messages."""
    tree = jax.tree.unflatten(structure, range(structure.num_leaves))
    return ["carry" + jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def named(mask: Sequence[bool], names: Sequence[str], limit: int = 6) -> str:
    chosen = [name for name, on in zip(names, mask, strict=False) if on]
    more = f" and {len(chosen) - limit} more" if len(chosen) > limit else ""
    return ", ".join(chosen[:limit]) + more


def chain(update: jex.core.Jaxpr, lookup: jex.core.Jaxpr, carry_len: int) -> jex.core.Jaxpr:
    """update_lookup: `update` (updates, carry → carry), then `lookup` (carry, args →
    activations) on the updated carry; returns activations then the carry."""
    args = utils.clone_vars(lookup.invars[carry_len:])
    renamed: dict[Any, Atom] = dict(zip(lookup.invars, list(update.outvars) + args,
                                        strict=True))
    renamed.update((v, v) for v in lookup.constvars)

    def read(atom: Atom) -> Atom:
        return atom if isinstance(atom, jex.core.Literal) else renamed[atom]

    def write(var: Any) -> Any:
        if isinstance(var, jex.core.DropVar):
            return var
        renamed[var] = jex.core.Var(var.aval)
        return renamed[var]

    eqns = [e.replace(invars=[read(a) for a in e.invars], outvars=[write(v) for v in e.outvars])
            for e in lookup.eqns]
    return with_io(update, invars=list(update.invars) + args,
                   outvars=[read(v) for v in lookup.outvars] + list(update.outvars),
                   eqns=list(update.eqns) + eqns, effects=update.effects | lookup.effects)
