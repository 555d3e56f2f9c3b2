"""Stacked checkpoint arrays ⇄ per-table arrays, for the nnx checkpoint utilities.

A checkpoint's embedding item holds, per stack, `{"table": T, "slot": {name: S}}`
with flat `[stack_vocab, stack_dim]` arrays (the `N` SparseCore shards one after
the other). `unstack` reads the layout the checkpoint's `EmbeddingSpecProto`
records and gives each table's `[vocab, dim]` arrays; `restack` lays per-table
arrays out for target TableSpecs (stacked for another topology). The row math is
`compat._arrays`' (`unshard_and_unstack_tables` / `stack_and_shard_tables`).

Padding of restacked arrays: tables get 0.0 (tilecore's convention; the
reference uses NaN, which would reach the discarded activation columns); slots
get their optimizer's initial value when the target optimizer is known, else 0.0
as in the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._host import host_memory_bytes
from ._arrays import stack_and_shard_tables, unshard_and_unstack_tables
from ._proto_tables import layout_specs, stacks_of
from ._pytree import leaves_with_paths
from ._specs import TableSpec

_log = logging.getLogger(__name__)

Tree = Any
SlotFill = Callable[[TableSpec], Mapping[str, float]]


def proto_tables(proto: Any, source: str) -> tuple[dict[str, TableSpec], int]:
    """The stacked TableSpecs an `EmbeddingSpecProto` records (sizes and settings) and N,
    checked for consistency (`_proto_tables.layout_specs`)."""
    try:
        stacks = stacks_of(proto, "the embedding spec")
        specs = {spec.name: spec for stack in stacks for spec in layout_specs(stack)}
    except ValueError as err:
        raise ValueError(f"The embedding spec of {source} is inconsistent: {err}") from None
    counts = sorted({s.num_sparsecores for s in stacks})
    if len(counts) != 1:
        raise ValueError(
            f"The embedding spec of {source} records num_sparsecores {counts} for its "
            f"{len(stacks)} stacks; a checkpoint has one count for all. It is damaged or was "
            "not written by save_checkpoint."
        )
    return specs, counts[0]


def unstack(proto: Any, stacks: Mapping[str, Tree], source: str) -> dict[str, Tree]:
    """Stack name → `{"table", "slot"}` tree of flat stacked arrays ⇒ table name → the
    same tree of `[vocab, dim]` numpy arrays, as the checkpoint's proto lays them out."""
    specs, n = proto_tables(proto, source)
    want = {s.stack_name: (s.stack_vocab_size, s.stack_embedding_dim)
            for s in proto.stacked_table_specs}
    if set(stacks) != set(want) and set(stacks) == set(specs):
        raise ValueError(
            f"{source} holds one unstacked [vocab, dim] array per table ({sorted(stacks)}), "
            "as convert_cross_topology_checkpoint writes without a target_topology; its "
            f"embedding spec describes stacks {sorted(want)}, which it cannot be read or "
            "re-laid as. Convert the original checkpoint with a target_topology instead."
        )
    if set(stacks) != set(want):
        raise ValueError(
            f"The embedding tables of {source} do not match its embedding spec: stacks "
            f"{sorted(stacks)} saved, {sorted(want)} described. The checkpoint is damaged; "
            "write it again."
        )
    host: dict[str, Tree] = {}
    for name, tree in stacks.items():
        parts = {}
        for path, leaf in leaves_with_paths(tree):
            if tuple(np.shape(leaf)) != want[name]:
                raise ValueError(
                    f"Stack {name!r} in {source}: {'/'.join(map(str, path))} has shape "
                    f"{tuple(np.shape(leaf))}, but the checkpoint's embedding spec records "
                    f"{want[name]} ({n} SparseCores). The checkpoint is damaged; write it again."
                )
            parts[path] = np.asarray(leaf)
        host[name] = _rebuild(parts)
    return unshard_and_unstack_tables(specs, host, n)


def _rebuild(parts: Mapping[tuple[object, ...], Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for path, leaf in parts.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def slot_fill_values(table: TableSpec) -> dict[str, float]:
    """Slot name → the optimizer's initial slot value (the padding restacked slots get)."""
    try:
        names = getattr(table.optimizer.slot_variables_initializers(), "_fields", ())
        values = table.optimizer.to_native().slot_initial_values()
    except (NotImplementedError, TypeError, ValueError):  # custom optimizers: no native form
        return {}
    return dict(zip(names, values, strict=False)) if len(names) == len(values) else {}


def restack(table_specs: Mapping[str, TableSpec], tables: Mapping[str, Tree], num_shards: int,
            source: str, slot_fill: SlotFill = slot_fill_values) -> dict[str, Tree]:
    """Table name → `{"table", "slot"}` tree of `[vocab, dim]` arrays ⇒ stack name → the
    same tree of flat `[stack_vocab, stack_dim]` arrays for the (stacked) `table_specs`."""
    missing = sorted(set(table_specs) - set(tables))
    if missing:
        raise ValueError(
            f"{source} has no arrays for tables {missing} of the target feature specs (it has "
            f"{sorted(tables)}); restore a checkpoint of a model with these tables."
        )
    dropped = sorted(set(tables) - set(table_specs))
    if dropped:
        _log.warning("Tables %s of %s are not in the target feature specs; dropped.", dropped,
                     source)
    members: dict[str, list[TableSpec]] = {}
    for spec in table_specs.values():
        members.setdefault(spec.stacked_table_spec.stack_name, []).append(spec)
    _check_fits(members, tables, num_shards, source)
    return {stack: _restack_one(specs, tables, num_shards, source, slot_fill)
            for stack, specs in members.items()}


def _check_fits(members: Mapping[str, list[TableSpec]], tables: Mapping[str, Tree],
                num_shards: int, source: str) -> None:
    """The restacked arrays (each stack's table and slots, `[stack_vocab, stack_dim]`) fit
    this host's memory and swap: a target of absurd device counts pads every table to
    `8·N` rows, and numpy's allocation failed mid-conversion (or the OOM killer ended it)."""
    sizes = {}
    for stack, specs in members.items():
        rows = specs[0].stacked_table_spec
        leaves = leaves_with_paths(tables[specs[0].name])
        sizes[stack] = sum(rows.stack_vocab_size * rows.stack_embedding_dim
                           * np.dtype(getattr(leaf, "dtype", np.float32)).itemsize
                           for _, leaf in leaves)
    limit, need = host_memory_bytes(), sum(sizes.values())
    if limit is None or need <= limit:
        return
    largest = ", ".join(f"{name!r} {size / 2**30:,.1f} GiB" for name, size in
                        sorted(sizes.items(), key=lambda kv: -kv[1])[:3])
    raise MemoryError(
        f"Converting {source} for {num_shards} partitions needs {need / 2**30:,.1f} GiB of "
        f"tables and slots, more than this host's memory and swap ({limit / 2**30:,.1f} GiB); "
        f"the largest stacks: {largest}. Check the target topology.")


def _restack_one(specs: list[TableSpec], tables: Mapping[str, Tree], num_shards: int,
                 source: str, slot_fill: SlotFill) -> Tree:
    stack = specs[0].stacked_table_spec.stack_name
    paths = [p for p, _ in leaves_with_paths(tables[specs[0].name])]
    for spec in specs[1:]:
        other = [p for p, _ in leaves_with_paths(tables[spec.name])]
        if other != paths:
            raise ValueError(
                f"Tables {specs[0].name!r} and {spec.name!r} of target stack {stack!r} have "
                f"different slot variables in {source} ({paths} vs {other}); stack only tables "
                "that use the same optimizer."
            )
    fill = slot_fill(specs[0])
    parts = {}
    for path in paths:
        pad = 0.0 if path[0] == "table" else float(fill.get(str(path[-1]), 0.0))
        values = {s.name: _leaf(tables[s.name], path) for s in specs}
        try:
            stacked = stack_and_shard_tables({s.name: s for s in specs}, values, num_shards,
                                             pad_value=pad)[stack]
        except ValueError as err:
            raise ValueError(f"{err} (the table in {source} does not fit the target feature "
                             "specs: give the target the same vocabulary_size and "
                             "embedding_dim)") from None
        parts[path] = stacked.reshape(-1, stacked.shape[-1])
    return _rebuild(parts)


def _leaf(tree: Tree, path: tuple[object, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree
