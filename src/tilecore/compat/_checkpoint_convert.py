"""Offline conversion of an nnx checkpoint to another topology, on the host.

Both pytree items are read as saved (host arrays, whatever topology wrote them);
the embedding stacks found under `embedding_table` in the model item are
unstacked as the checkpoint's proto records and either restacked for the target
or kept as per-table `[vocab, dim]` arrays; the items are then saved as a new
checkpoint with the target's proto.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from ..specs._numbers import is_integer
from ._checkpoint_io import PathLike, create_manager, host_targets, restore
from ._checkpoint_layout import proto_tables, restack, unstack
from ._checkpoint_targets import target_specs


def find_embedding_table(tree: Any) -> dict[str, Any] | None:
    """The first `embedding_table` mapping in a restored state dict (depth first)."""
    if not isinstance(tree, dict):
        return None
    if isinstance(tree.get("embedding_table"), dict):
        return tree["embedding_table"]
    for child in tree.values():
        found = find_embedding_table(child)
        if found is not None:
            return found
    return None


def check_topology(devices: Any, per_device: Any, what: str) -> tuple[int, int]:
    """(devices, SparseCores per device) as Python ints, after checking both are integers
    (NumPy's too; a bool or float: TypeError, as the row math raised) >= 1 (ValueError)."""
    counts = f"num_global_devices={devices!r}, num_sc_per_device={per_device!r}"
    if not all(is_integer(v) for v in (devices, per_device)):
        raise TypeError(f"{what} needs integer device and SparseCore counts; got {counts}.")
    if not all(v > 0 for v in (devices, per_device)):
        raise ValueError(f"{what} needs device and SparseCore counts >= 1; got {counts}.")
    return int(devices), int(per_device)


def stacked_target(feature_specs: Any, devices: int, per_device: int
                   ) -> tuple[Any, dict[str, Any]]:
    """(proto, table name → TableSpec) of target feature specs, after checking they are
    stacked for `devices` × `per_device` SparseCores."""
    from .lib.nn.embedding import get_table_specs
    from .lib.nn.embedding_proto_utils import create_proto_from_feature_specs

    target = create_proto_from_feature_specs(feature_specs, devices, per_device)
    try:
        proto_tables(target, "target_feature_specs")
    except ValueError as err:
        raise ValueError(f"target_feature_specs are not stacked for {devices} devices × "
                         f"{per_device} SparseCores ({err}); prepare them for the target "
                         "topology first.") from None
    return target, get_table_specs(feature_specs)


def _targets(proto: Any, topology: Any, batch: int | None, feature_specs: Any, where: str
             ) -> tuple[Any, dict[str, Any], int]:
    """(target proto, stacked table specs, N) for the target topology."""
    if not all(hasattr(topology, f) for f in ("num_global_devices", "num_sc_per_device")):
        raise TypeError(f"target_topology must be a TargetTopology(num_global_devices, "
                        f"num_sc_per_device), got {type(topology).__name__} {topology!r:.80}.")
    devices, per_device = check_topology(topology.num_global_devices,
                                         topology.num_sc_per_device, "target_topology")
    if feature_specs is None:
        proto, specs = target_specs(proto, devices, per_device, batch, where)
        return proto, specs, devices * per_device
    target, specs = stacked_target(feature_specs, devices, per_device)
    return target, specs, devices * per_device


def _on_host(tree: Mapping[str, Any]) -> dict[str, Any]:
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda x: jax.device_put(x, cpu), dict(tree))


def convert_items(manager: ocp.CheckpointManager, step: int, metadata: Mapping[str, Any],
                  keys: tuple[str, str, str], proto: Any, topology: Any, batch: int | None,
                  feature_specs: Any) -> tuple[dict[str, Any], Any]:
    """(converted model and optimizer items, target proto) of one checkpoint step."""
    model_key, optimizer_key, _ = keys
    where = f"{manager.directory}/{step}"
    restored = restore(manager, step, {
        key: ocp.args.StandardRestore(host_targets(metadata[key]))
        for key in (model_key, optimizer_key)})
    model = restored[model_key]
    found = find_embedding_table(model)
    if found is None:
        raise ValueError(f"Could not find 'embedding_table' in the model item of {where}; "
                         "convert a checkpoint saved from a model with a SparseCoreEmbed layer.")
    stacks = found.get("value", found)
    tables = unstack(proto, stacks, where)
    if topology is None:
        new, target = tables, proto
    else:
        target, specs, num_shards = _targets(proto, topology, batch, feature_specs, where)
        new = restack(specs, tables, num_shards, where)
    for tree in new.values():  # an optimizer without slots saves `slot` as None (SGD)
        tree.setdefault("slot", None)
    stacks.clear()
    stacks.update(_on_host(new))
    return {model_key: model, optimizer_key: restored[optimizer_key]}, target


def save_converted(path: PathLike, step: int, keys: tuple[str, str, str],
                   items: Mapping[str, Any], proto: Any) -> None:
    """Save the converted items and `proto` as `step` of a checkpoint at `path`."""
    model_key, optimizer_key, spec_key = keys
    manager = create_manager(path, ocp.CheckpointManagerOptions(create=True), keys)
    try:
        if step in manager.all_steps():
            raise ValueError(f"{manager.directory} already holds step {step}; write the "
                             "converted checkpoint to another directory or pass save_step.")
        manager.save(step, args=ocp.args.Composite(**{
            model_key: ocp.args.StandardSave(items[model_key]),
            optimizer_key: ocp.args.StandardSave(items[optimizer_key]),
            spec_key: ocp.args.ProtoSave(proto),
        }))
        manager.wait_until_finished()
    finally:
        manager.close()
