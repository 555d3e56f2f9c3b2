"""The reference's nnx checkpoint utilities
(`jax_tpu_embedding.sparsecore.lib.flax.nnx.checkpoint_utils`) on tilecore.

A step is the reference's Orbax layout: items `model` (`nnx.state(model)`),
`optimizer` (`nnx.state(optimizer, nnx.OptState)`) and `embedding_spec` (the
`EmbeddingSpecProto` of the stacking, as `proto.pbtxt`), so checkpoints written by
either side restore on the other. The stacked tables are
`<layer>/embedding_table/value/<stack>/{table, slot/<name>}`, `[stack_vocab, dim]`
with the SparseCore shards one after the other. Cross-topology restore and
conversion unstack them as the proto records and restack them for the target
(devices × SparseCores per device, and stacking); the row math is compat's
`table_stacking` layout.

Differences: the embedding layer of a restored model is checked against the
checkpoint (shapes, stacking, SparseCore count) and a mismatch raises, naming the
tables, instead of restoring a wrong layout; read errors raise
`tilecore.checkpoint.CheckpointCorruptError` naming the directory; restacked
padding is 0.0 in tables (not NaN) and the optimizer's initial value in slots;
`convert_cross_topology_checkpoint` writes the given item keys (the reference
always writes `model`/`optimizer`/`embedding_spec`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import typing
from pathlib import Path
from typing import Any

import flax.nnx as nnx
import orbax.checkpoint as ocp

from .....specs._numbers import is_integer
from ...._checkpoint_convert import check_topology, convert_items, save_converted, stacked_target
from ...._checkpoint_io import (
    PathLike,
    check_manager,
    check_shapes,
    create_manager,
    open_checkpoint,
    restore,
)
from ...._checkpoint_layout import proto_tables, restack, unstack
from ...._checkpoint_model import (
    abstract_state,
    check_same_layout,
    layer_shards,
    layout_differences,
    place_stacks,
    restore_with_saved_stacks,
)
from ...._checkpoint_model import embedding_layer_name as _find_layer
from ...nn.embedding import Nested as Nested
from ...nn.embedding_proto_utils import create_proto_from_feature_specs
from ...proto.embedding_spec_pb2 import EmbeddingSpecProto

_log = logging.getLogger(__name__)

__all__ = [
    "Nested",
    "TargetTopology",
    "convert_cross_topology_checkpoint",
    "create_checkpoint_manager",
    "decompress_checkpoint",
    "restore_checkpoint",
    "restore_cross_topology_checkpoint",
    "save_checkpoint",
]


class TargetTopology(typing.NamedTuple):
    """The topology a checkpoint is converted for.

    Attributes:
      num_global_devices: devices (chips) in the target topology.
      num_sc_per_device: SparseCores per device in the target topology.
      device_kind: optional device kind (e.g. 'TPU v5'), for logs only.
    """

    num_global_devices: int
    num_sc_per_device: int
    device_kind: str | None = None


def decompress_checkpoint(checkpoint_path: str) -> str:
    """Unpack a checkpoint archive (.tgz) under `$TEST_UNDECLARED_OUTPUTS_DIR`; its directory."""
    testdir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
    if not testdir:
        raise ValueError("TEST_UNDECLARED_OUTPUTS_DIR environment variable is not set; set it "
                         f"to a writable directory to decompress {checkpoint_path}.")
    name = Path(checkpoint_path).name
    out = Path(testdir) / "decompressed_checkpoints" / name.removesuffix(".tgz")
    out.mkdir(parents=True, exist_ok=True)
    _log.info("Decompressing checkpoint %s to %s", checkpoint_path, out)
    # The "data" filter refuses members that would land outside `out` (absolute paths,
    # "..", links pointing out) or be devices; Python 3.14 makes it the default.
    safe: dict[str, typing.Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    try:
        shutil.unpack_archive(checkpoint_path, out, **safe)
    except (shutil.ReadError, tarfile.TarError, ValueError, OSError, EOFError) as err:
        raise ValueError(f"Cannot unpack checkpoint archive {checkpoint_path}: {err}. Pass a "
                         "complete .tgz archive of a checkpoint directory.") from err
    return os.fspath(out)


def create_checkpoint_manager(
    *, cp_path: PathLike, cp_options: ocp.CheckpointManagerOptions,
    model_key: str = "model", optimizer_key: str = "optimizer",
    embedding_spec_key: str = "embedding_spec",
) -> ocp.CheckpointManager:
    """A CheckpointManager for `cp_path` with standard model/optimizer items and a proto spec."""
    return create_manager(cp_path, cp_options, (model_key, optimizer_key, embedding_spec_key))


def save_checkpoint(
    *, cp_manager: ocp.CheckpointManager, step: int, model: nnx.Module,
    optimizer: nnx.Optimizer, feature_specs: Nested[Any], num_global_devices: int,
    num_sc_per_device: int, model_key: str = "model", optimizer_key: str = "optimizer",
    embedding_spec_key: str = "embedding_spec",
) -> None:
    """Save the model, optimizer state and embedding spec proto as `step` of `cp_manager`.

    The proto records the stacking of `feature_specs` for `num_global_devices` ×
    `num_sc_per_device` SparseCores, which later restores use to re-lay the tables.
    """
    check_manager(cp_manager, "save_checkpoint")
    proto = create_proto_from_feature_specs(feature_specs, global_device_count=num_global_devices,
                                            num_sparsecore_per_device=num_sc_per_device)
    try:
        proto_tables(proto, "the feature specs")
    except ValueError as err:
        raise ValueError(
            f"save_checkpoint: num_global_devices={num_global_devices} × num_sc_per_device="
            f"{num_sc_per_device} does not match how feature_specs were stacked ({err}). Pass "
            "the topology the specs were prepared for."
        ) from None
    _check_specs_describe_model(model, proto)
    if not is_integer(step) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an integer >= 0, got step={step!r}.")
    latest = cp_manager.latest_step()
    if latest is not None and step <= latest:  # Orbax would skip it without a word (a step
        # its save interval skips stays skipped, as the reference's programs expect)
        raise ValueError(f"save_checkpoint: step {step} would not be saved: "
                         f"{cp_manager.directory} already holds step {latest}, and steps must "
                         "increase. The state of this call is not on disk.")
    cp_manager.save(step, args=ocp.args.Composite(**{
        model_key: ocp.args.StandardSave(nnx.state(model)),
        optimizer_key: ocp.args.StandardSave(nnx.state(optimizer, nnx.OptState)),
        embedding_spec_key: ocp.args.ProtoSave(proto),
    }))


def _check_specs_describe_model(model: nnx.Module, proto: EmbeddingSpecProto) -> None:
    """The proto `save_checkpoint` writes must describe the tables it saves: specs of
    other sizes or stacking than the model's layer would write a checkpoint whose spec
    misreads its arrays (a layer nested deeper than an attribute is not checked)."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"save_checkpoint: model must be an nnx.Module holding a "
                        f"SparseCoreEmbed, got {type(model).__name__}.")
    try:
        name = _find_layer(model)
    except ValueError:
        return
    diffs = layout_differences(proto, getattr(model, name), "the feature specs")
    if diffs:
        raise ValueError(
            f"save_checkpoint: feature_specs do not describe the tables of the model's "
            f"SparseCoreEmbed {name!r}:\n  - " + "\n  - ".join(diffs) + "\nPass the "
            "feature specs the layer was built with; nothing was saved."
        )


def restore_checkpoint(
    *, cp_manager: ocp.CheckpointManager | None = None,
    input_checkpoint_path: PathLike | None = None, step: int | None = None,
    model: nnx.Module, optimizer: nnx.Optimizer, model_key: str = "model",
    optimizer_key: str = "optimizer", embedding_spec_key: str = "embedding_spec",
) -> None:
    """Restore a checkpoint of the same topology into `model` and `optimizer` in place.

    `step=None` restores the latest step; nothing happens when both `cp_manager`
    and `input_checkpoint_path` are None.
    """
    if cp_manager is None and input_checkpoint_path is None:
        return
    keys = (model_key, optimizer_key, embedding_spec_key)
    with open_checkpoint(cp_manager, input_checkpoint_path, step, keys,
                         EmbeddingSpecProto) as (manager, step, metadata, proto):
        where = f"{manager.directory}/{step}"
        layer = getattr(model, _find_layer(model))
        check_same_layout(proto, layer, where)
        model_state, opt_state = nnx.state(model), nnx.state(optimizer, nnx.OptState)
        check_shapes(metadata[model_key], model_state, where, skip=lambda _: False)
        check_shapes(metadata[optimizer_key], opt_state, where, skip=lambda _: False)
        restored = restore(manager, step, {
            model_key: ocp.args.StandardRestore(abstract_state(model_state)),
            optimizer_key: ocp.args.StandardRestore(abstract_state(opt_state)),
        })
    nnx.update(model, restored[model_key])  # Orbax placed every array on the model's sharding
    nnx.update(optimizer, restored[optimizer_key])
    _log.info("Restored checkpoint %s", where)


def restore_cross_topology_checkpoint(
    *, cross_topology_checkpoint_restore_path: PathLike | None, model: nnx.Module,
    optimizer: nnx.Optimizer, target_feature_specs: Nested[Any], num_global_devices: int,
    num_sc_per_device: int, model_key: str = "model", optimizer_key: str = "optimizer",
    embedding_spec_key: str = "embedding_spec", embedding_layer_name: str | None = None,
    restore_step: int | None = None,
) -> None:
    """Restore a checkpoint saved on another topology (or stacking) into `model` in place.

    The embedding tables are unstacked as the checkpoint's proto records and
    restacked for `target_feature_specs` (prepared for `num_global_devices` ×
    `num_sc_per_device`, the model's topology); the rest restores as saved.
    """
    if cross_topology_checkpoint_restore_path is None:
        return
    keys = (model_key, optimizer_key, embedding_spec_key)
    name = _find_layer(model, embedding_layer_name)
    layer = getattr(model, name)
    num_global_devices, num_sc_per_device = check_topology(
        num_global_devices, num_sc_per_device, "restore_cross_topology_checkpoint")
    if layer_shards(layer) != (num_global_devices, num_sc_per_device):
        raise ValueError(
            f"The model's embedding layer {name!r} spans {layer_shards(layer)} (devices, "
            f"SparseCores per device), not ({num_global_devices}, {num_sc_per_device}); pass "
            "the model's topology."
        )
    _, target_tables = stacked_target(target_feature_specs, num_global_devices,
                                      num_sc_per_device)
    with open_checkpoint(None, cross_topology_checkpoint_restore_path, restore_step, keys,
                         EmbeddingSpecProto) as (manager, step, metadata, proto):
        where = f"{manager.directory}/{step}"
        saved, restored = restore_with_saved_stacks(manager, step, metadata, keys, model,
                                                    optimizer, name, where)
    stacks = restack(target_tables, unstack(proto, saved, where),
                     num_global_devices * num_sc_per_device, where)
    embedding = place_stacks(layer.embedding_table.get_value(), stacks, where)
    # Nothing of the model changes until every table has been re-laid without error.
    nnx.update(model, restored[model_key])
    nnx.update(optimizer, restored[optimizer_key])
    layer.embedding_table.set_value(embedding)
    _log.info("Restored cross-topology checkpoint %s", where)


def convert_cross_topology_checkpoint(
    *, input_checkpoint_path: PathLike | None, output_checkpoint_path: PathLike | None,
    target_topology: TargetTopology | None = None, target_batch_size: int | None = None,
    model_key: str = "model", optimizer_key: str = "optimizer",
    embedding_spec_key: str = "embedding_spec", restore_step: int | None = None,
    save_step: int | None = None, target_feature_specs: Nested[Any] | None = None,
) -> None:
    """Convert a checkpoint for another topology, on the host, and save it as a new one.

    With `target_topology` the tables are restacked for it (by `target_feature_specs`
    if given, else by specs rebuilt from the checkpoint's proto, with
    `target_batch_size` as the new global batch); without, each table is saved
    unstacked (`[vocab, dim]`, keyed by table name) with the source proto.
    `save_step=None` keeps the restored step. Nothing happens if either path is None.
    """
    if input_checkpoint_path is None or output_checkpoint_path is None:
        return
    if save_step is not None and (not is_integer(save_step) or save_step < 0):
        raise ValueError(f"convert_cross_topology_checkpoint: save_step must be an integer >= 0 "
                         f"or None, got save_step={save_step!r}.")
    keys = (model_key, optimizer_key, embedding_spec_key)
    with open_checkpoint(None, input_checkpoint_path, restore_step, keys,
                         EmbeddingSpecProto) as (manager, step, metadata, proto):
        items, target_proto = convert_items(manager, step, metadata, keys, proto,
                                            target_topology, target_batch_size,
                                            target_feature_specs)
    save_converted(output_checkpoint_path, step if save_step is None else save_step, keys,
                   items, target_proto)
    _log.info("Converted %s/%d to %s", input_checkpoint_path, step, output_checkpoint_path)
