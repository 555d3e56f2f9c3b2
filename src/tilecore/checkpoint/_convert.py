"""Stacked, sharded variables ⇄ per-table `[vocab, dim]` arrays, for any topology.

`shard_variables(new_plan, unshard_variables(old_plan, variables))` moves tables
and every optimizer slot from one topology (devices × SparseCores, stacking) to
another; the values of real rows are carried over bit for bit.

Padding (rows past `vocab_size` and columns past `embedding_dim`) is filled with
0.0 in tables and with the optimizer's initial value in slots. The reference's
restack converter fills tables with NaN instead; tilecore does not, because the
device gather reads whole padded rows of real IDs, so NaN in padded columns would
flow into (discarded) activation columns and trip `check_finite`, and a zero
Adagrad accumulator there would turn `g/√a` into NaN. Padding rows past the
vocabulary are never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..ops import DEFAULT_AXIS, EmbeddingVariables, shard, unshard
from ..stacking import StackingPlan

TABLE_FILL = 0.0


class TableState(NamedTuple):
    """One table and its slot variables as `[vocab_size, embedding_dim]` numpy arrays.

    Slots follow the table's optimizer `slot_names` order.
    """

    table: np.ndarray
    slots: tuple[np.ndarray, ...] = ()


def stack_plan(plan: StackingPlan, stack: str) -> StackingPlan:
    """`plan` restricted to one stack, so its arrays convert without the others'.

    The stack's tables and features (with their settings) stay; the others go, so
    the sub-plan is itself a consistent plan (every feature in a stack).
    """
    spec = plan.stacks[stack]
    names, features = spec.table_names, set(spec.feature_names)
    return dataclasses.replace(
        plan, tables={t: plan.tables[t] for t in names}, stacks={stack: spec},
        table_settings={t: plan.table_settings[t] for t in names},
        features={f: v for f, v in plan.features.items() if f in features},
        feature_settings={f: v for f, v in plan.feature_settings.items() if f in features})


def check_variables(plan: StackingPlan, variables: Mapping[str, EmbeddingVariables]) -> None:
    """Raise if `variables` lacks a stack of `plan` or has the wrong shapes, dtypes or slot
    count (a checkpoint of them would restore into variables the ops refuse)."""
    missing = sorted(set(plan.stacks) - set(variables))
    extra = sorted(set(variables) - set(plan.stacks))
    if missing or extra:
        raise ValueError(
            f"The variables do not match the plan's stacks: missing {missing}, unknown {extra}. "
            "Pass the variables built for this plan (tilecore.ops.init_tables(plan, key))."
        )
    for name, spec in plan.stacks.items():
        var = variables[name]
        want = (spec.vocab_size, spec.embedding_dim)
        slots = spec.optimizer.slot_names
        if len(var.slots) != len(slots):
            raise ValueError(
                f"Stack {name!r}: {len(var.slots)} slot arrays, but its optimizer "
                f"{type(spec.optimizer).__name__} has slots {slots}."
            )
        for what, array in (("table", var.table), *zip(slots, var.slots, strict=True)):
            if tuple(np.shape(array)) != want:
                raise ValueError(
                    f"Stack {name!r}: {what} has shape {tuple(np.shape(array))}; the plan "
                    f"expects {want} (stacked vocab × padded dim for {plan.topology} topology)."
                )
            dtype = np.dtype(spec.weights_dtype) if what == "table" else np.dtype(np.float32)
            if np.dtype(array.dtype) != dtype:
                raise ValueError(
                    f"Stack {name!r}: {what} is {np.dtype(array.dtype).str} "
                    f"({np.dtype(array.dtype).name}); the plan stores it as {dtype.name} "
                    "(tables in their TableSpec weights_dtype, optimizer slots in float32), "
                    "as the ops that read it back require."
                )


def unshard_variables(
    plan: StackingPlan, variables: Mapping[str, EmbeddingVariables]
) -> dict[str, TableState]:
    """Each table of `plan` with its slots, as host `[vocab, dim]` arrays.

    The stacked arrays are copied to the host (they must be addressable by this
    process, as in a single-process job).
    """
    check_variables(plan, variables)
    out: dict[str, TableState] = {}
    for name in plan.stacks:
        sub = stack_plan(plan, name)
        var = variables[name]
        tables = unshard(sub, {name: var.table})
        slots = [unshard(sub, {name: slot}) for slot in var.slots]
        out.update({t: TableState(tables[t], tuple(s[t] for s in slots)) for t in tables})
    return out


def place(array: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    """`array` on `sharding` (None: the default device)."""
    return jnp.asarray(array) if sharding is None else jax.device_put(array, sharding)


def table_sharding(plan: StackingPlan, mesh: Mesh | None, axis: str) -> NamedSharding | None:
    """Rows split over `axis` of `mesh`; checks the mesh fits the plan's device count."""
    if mesh is None:
        if plan.topology.global_devices != 1:
            raise ValueError(
                f"The plan spans {plan.topology.global_devices} devices ({plan.topology}); "
                "pass the mesh they form (mesh=..., axis=...)."
            )
        return None
    if axis not in mesh.shape or mesh.shape[axis] != plan.topology.global_devices:
        raise ValueError(
            f"The mesh {dict(mesh.shape)} does not fit the plan: axis {axis!r} must have "
            f"{plan.topology.global_devices} devices ({plan.topology} topology)."
        )
    return NamedSharding(mesh, PartitionSpec(axis, None))


def shard_variables(
    plan: StackingPlan,
    tables: Mapping[str, TableState],
    *,
    mesh: Mesh | None = None,
    axis: str = DEFAULT_AXIS,
) -> dict[str, EmbeddingVariables]:
    """Per-table arrays → every stack's `EmbeddingVariables` for `plan` (the inverse of
    `unshard_variables`), split by rows over `axis` of `mesh` (None: one device).

    Padding gets 0.0 in tables and the optimizer's initial value in slots. Tables
    are stored in their stack's `weights_dtype` (a float32 table given for a
    half-precision stack is rounded to nearest), slots in float32. Raises ValueError
    when a table holds finite values its stack's dtype cannot (they would become inf).
    """
    sharding = table_sharding(plan, mesh, axis)
    missing = sorted(set(plan.tables) - set(tables))
    if missing:
        raise ValueError(f"shard_variables: no arrays for tables {missing} of the plan.")
    out = {}
    for name, spec in plan.stacks.items():
        sub = stack_plan(plan, name)
        initial = spec.optimizer.slot_initial_values()
        for t in spec.table_names:
            if len(tables[t].slots) != len(initial):
                raise ValueError(
                    f"Table {t!r}: {len(tables[t].slots)} slot arrays given, but its optimizer "
                    f"{type(spec.optimizer).__name__} has slots {spec.optimizer.slot_names}."
                )
        for t in spec.table_names:
            _check_fits(t, tables[t].table, spec.weights_dtype)
        table = shard(sub, {t: tables[t].table for t in spec.table_names}, fill=TABLE_FILL)[name]
        slots = tuple(
            place(shard(sub, {t: tables[t].slots[i] for t in spec.table_names}, fill=value)[name],
                   sharding)
            for i, value in enumerate(initial)
        )
        out[name] = EmbeddingVariables(place(table.astype(spec.weights_dtype), sharding), slots)
    return out


def _check_fits(name: str, table: Any, dtype: np.dtype) -> None:
    """Raise ValueError naming table `name` when storing it as `dtype` would turn finite
    values into infinities (a float32 table restored into a float16 or bfloat16 plan)."""
    values = np.asarray(table)
    if values.dtype == dtype or not jnp.issubdtype(values.dtype, jnp.floating):
        return
    with np.errstate(over="ignore"):
        lost = np.isfinite(values) & ~np.isfinite(values.astype(dtype))
    if lost.any():
        where = tuple(int(i) for i in np.argwhere(lost)[0])
        raise ValueError(
            f"Table {name!r}: {int(lost.sum())} of its values do not fit its stack's "
            f"weights_dtype {np.dtype(dtype).name} (largest finite "
            f"{float(jnp.finfo(dtype).max):g}) and would become inf, e.g. {values[where]:g} at "
            f"{list(where)}. Keep this table in {values.dtype.name}, or scale it first."
        )
