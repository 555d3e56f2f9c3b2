"""The nnx side of the checkpoint utilities: find the embedding layer, describe the
state Orbax restores into, and put restacked arrays back into the layer's variables.

A compat `SparseCoreEmbed` keeps `{stack: EmbeddingVariables(table, slot)}` in its
`embedding_table` variable, saved as `<layer>/embedding_table/value/<stack>/table`
and `.../slot/<slot name>` (no `slot` entry for SGD), as the reference's does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.nnx as nnx
import jax
import numpy as np
import orbax.checkpoint as ocp

from ._checkpoint_io import check_shapes, host_targets, restore
from ._checkpoint_layout import proto_tables
from ._native import resolve_num_sc_per_device

EMBEDDING_VARIABLE = "embedding_table"


def embedding_layer_name(model: nnx.Module, name: str | None = None) -> str:
    """The attribute of `model` that holds its `SparseCoreEmbed` (found when `name` is None)."""
    from .lib.flax.nnx.embed import SparseCoreEmbed

    if name is None:
        for attr, value in sorted(vars(model).items()):
            if isinstance(value, SparseCoreEmbed):
                return attr
        raise ValueError(
            f"Could not find an attribute of type SparseCoreEmbed in {type(model).__name__}; "
            "pass embedding_layer_name explicitly (the embedding layer must be a direct "
            "attribute of the model)."
        )
    if not isinstance(getattr(model, name, None), SparseCoreEmbed):
        raise ValueError(
            f"Attribute {name!r} of {type(model).__name__} is "
            f"{type(getattr(model, name, None)).__name__}, not a SparseCoreEmbed; pass the name "
            "of the model's SparseCoreEmbed layer."
        )
    return name


def layer_shards(layer: Any) -> tuple[int, int]:
    """(devices, SparseCores per device) the layer's tables are stacked for."""
    return layer.num_shards, resolve_num_sc_per_device(layer.num_sc_per_device)


def abstract_state(state: nnx.State) -> nnx.State:
    """`state` with every array replaced by its shape, dtype and sharding (Orbax's target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def layout_differences(proto: Any, layer: Any, where: str) -> list[str]:
    """How the stacking an `EmbeddingSpecProto` records differs from the layer's: the
    SparseCore count, tables only on one side, and per table its vocabulary size,
    width and place in its stack (empty when they agree)."""
    from .lib.nn.embedding import get_table_specs

    saved, n = proto_tables(proto, where)
    devices, per_device = layer_shards(layer)
    model = get_table_specs(layer.feature_specs)
    diffs = [] if n == devices * per_device else [
        f"{n} SparseCores saved, {devices}×{per_device} in the model"]
    for name in sorted(set(saved) | set(model)):
        if name not in saved or name not in model:
            diffs.append(f"table {name!r} only in the {'model' if name in model else 'checkpoint'}")
            continue
        sizes = [(s.vocabulary_size, s.embedding_dim) for s in (saved[name], model[name])]
        if sizes[0] != sizes[1]:
            diffs.append(f"table {name!r}: (vocabulary_size, embedding_dim) {sizes[0]} saved, "
                         f"{sizes[1]} in the model")
        elif saved[name].setting_in_stack != model[name].setting_in_stack:
            diffs.append(f"table {name!r}: saved {saved[name].setting_in_stack}, model "
                         f"{model[name].setting_in_stack}")
    return diffs


def check_same_layout(proto: Any, layer: Any, where: str) -> None:
    """Raise unless the checkpoint's stacking equals the layer's (same N, stacks, settings)."""
    diffs = layout_differences(proto, layer, where)
    if diffs:
        raise ValueError(
            f"Checkpoint {where} was stacked for another topology or stacking than the model:\n"
            "  - " + "\n  - ".join(diffs) + "\nUse restore_cross_topology_checkpoint to re-lay "
            "its tables for the model."
        )


def _slot(original: Any, new: Mapping[str, Any], stack: str, where: str) -> Any:
    fields = getattr(original, "_fields", ())
    missing = [f for f in fields if f not in new]
    extra = sorted(set(new) - set(fields))
    if missing or extra:
        raise ValueError(
            f"Stack {stack!r} in {where}: the checkpoint has slot variables {sorted(new)}, the "
            f"model's optimizer {list(fields)}. Give the model the optimizer the checkpoint "
            "was trained with."
        )
    return type(original)(**{f: _like(new[f], getattr(original, f)) for f in fields})


def _like(array: Any, original: Any) -> Any:
    """`array` in `original`'s dtype (as a same-topology restore gives it) and sharding."""
    return jax.device_put(np.asarray(array).astype(original.dtype, copy=False),
                          original.sharding)


def place_stacks(original: Mapping[str, Any], stacks: Mapping[str, Any], where: str
                 ) -> dict[str, Any]:
    """The layer's `{stack: EmbeddingVariables}` rebuilt from `{stack: {"table", "slot"}}`
    arrays, each put on its original sharding after checking its shape."""
    missing = sorted(set(original) - set(stacks))
    if missing:
        raise ValueError(f"{where} has no arrays for the model's stacks {missing} (it has "
                         f"{sorted(stacks)}).")
    out = {}
    for name, ev in original.items():
        new = stacks[name]
        table = np.asarray(new["table"])
        if table.shape != tuple(ev.table.shape):
            raise ValueError(
                f"Stack {name!r} in {where} has shape {table.shape}, but the model's is "
                f"{tuple(ev.table.shape)}; the target feature specs and topology must be those "
                "of the model."
            )
        slot = _slot(ev.slot, new.get("slot") or {}, name, where)
        out[name] = type(ev)(table=_like(table, ev.table), slot=slot)
    return out


def _saved_stacks_metadata(model_tree: Any, layer: str, where: str) -> Any:
    node = model_tree
    for key in (layer, EMBEDDING_VARIABLE, "value"):
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(
                f"Checkpoint {where} has no embedding tables at {layer}/{EMBEDDING_VARIABLE}/"
                "value in its model item; restore a checkpoint saved from a model whose "
                f"SparseCoreEmbed is the attribute {layer!r}."
            )
        node = node[key]
    return node


def restore_with_saved_stacks(manager: Any, step: int, metadata: Mapping[str, Any],
                              keys: tuple[str, str, str], model: nnx.Module,
                              optimizer: nnx.Optimizer, layer: str, where: str
                              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore the model and optimizer items: dense state on the model's shardings, the
    embedding stacks as saved (host arrays of any topology).

    Returns (saved stacks `{stack: {"table", "slot"}}`, restored items).
    """
    model_key, optimizer_key, _ = keys
    model_state, opt_state = nnx.state(model), nnx.state(optimizer, nnx.OptState)
    check_shapes(metadata[model_key], model_state, where,
                 skip=lambda path: path[:2] == (layer, EMBEDDING_VARIABLE))
    check_shapes(metadata[optimizer_key], opt_state, where, skip=lambda _: False)
    target = abstract_state(model_state)
    variable = target[layer][EMBEDDING_VARIABLE]  # type: ignore[index]
    saved = host_targets(_saved_stacks_metadata(metadata[model_key], layer, where))
    target[layer][EMBEDDING_VARIABLE] = variable.replace(value=saved)  # type: ignore[index]
    restored = restore(manager, step, {
        model_key: ocp.args.StandardRestore(target),
        optimizer_key: ocp.args.StandardRestore(abstract_state(opt_state)),
    })
    stacks = restored[model_key][layer][EMBEDDING_VARIABLE].get_value()
    return stacks, restored
