"""Orbax plumbing for the nnx checkpoint utilities: manager, steps, items, metadata.

A step holds three items, as the reference writes them: the model state and the
optimizer state (`StandardCheckpointHandler`, nnx variables saved as
`{..., "value": array}`) and the `EmbeddingSpecProto` (`ProtoCheckpointHandler`,
text format in `proto.pbtxt`). Read errors are re-raised as
`tilecore.checkpoint.CheckpointCorruptError` naming the directory and item.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from ..checkpoint import CheckpointCorruptError
from ..specs._numbers import is_integer

PathLike = str | os.PathLike[str]
KeyPath = tuple[str, ...]


def create_manager(cp_path: PathLike, cp_options: ocp.CheckpointManagerOptions,
                   keys: tuple[str, str, str]) -> ocp.CheckpointManager:
    """A manager whose model/optimizer items are standard pytrees and whose spec is a proto."""
    model_key, optimizer_key, spec_key = keys
    if len(set(keys)) != 3:
        raise ValueError(f"The checkpoint item keys must differ; got {keys}.")
    registry = ocp.DefaultCheckpointHandlerRegistry()
    standard, proto = ocp.StandardCheckpointHandler(), ocp.ProtoCheckpointHandler()
    for key in (model_key, optimizer_key):
        registry.add(key, ocp.args.StandardRestore, standard)
        registry.add(key, ocp.args.StandardSave, standard)
    registry.add(spec_key, ocp.args.ProtoRestore, proto)
    registry.add(spec_key, ocp.args.ProtoSave, proto)
    return ocp.CheckpointManager(directory=Path(os.fspath(cp_path)).absolute(),
                                 options=cp_options, handler_registry=registry)


def resolve_step(manager: ocp.CheckpointManager, step: int | None) -> int:
    """`step`, or the latest one, after checking it was saved in the manager's directory."""
    if step is not None and not is_integer(step):
        raise TypeError(f"step must be an integer (a saved step) or None (the latest), got "
                        f"step={step!r}.")  # 1.0 was read as a damaged step "1.0"
    steps = sorted(manager.all_steps())
    if step is None:
        if not steps:
            raise ValueError(
                f"No checkpoints found in {manager.directory} (the directory "
                f"{'holds no finished step' if Path(manager.directory).exists() else 'is missing'})"
                ". Check the path, or save a checkpoint there first."
            )
        return steps[-1]
    if step not in steps:
        raise ValueError(
            f"Step {step} not found in checkpoint directory {manager.directory}; it has steps "
            f"{steps}. Pass one of them (or None for the latest)."
        )
    return step


def item_metadata(manager: ocp.CheckpointManager, step: int, keys: Sequence[str]
                  ) -> dict[str, Any]:
    """Item key → its metadata tree (None for the proto), after checking every key is there."""
    where = f"{manager.directory}/{step}"
    try:
        metadata = manager.item_metadata(step)
    except Exception as err:  # orbax raises many kinds on damaged metadata files
        raise CheckpointCorruptError(f"Cannot read the metadata of checkpoint {where}: {err}. "
                                     "The checkpoint is damaged; write it again.") from err
    for key in keys:
        if key not in metadata:
            raise ValueError(
                f'No "{key}" found in checkpoint metadata of {where} (items found: '
                f"{sorted(metadata.keys())}). Pass the model_key/optimizer_key/"
                "embedding_spec_key the checkpoint was saved with."
            )
    return {k: getattr(metadata[k], "tree", metadata[k]) for k in keys}


def restore(manager: ocp.CheckpointManager, step: int, items: Mapping[str, Any]) -> Any:
    """`manager.restore` of the composite `items`, with read errors naming the directory."""
    try:
        return manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as err:  # tensorstore/orbax/protobuf raise many kinds on damaged files
        raise CheckpointCorruptError(
            f"Cannot restore items {sorted(items)} of checkpoint {manager.directory}/{step}: "
            f"{type(err).__name__}: {err}. The checkpoint is damaged or does not match the "
            "model; write it again or restore it with the model it was saved from."
        ) from err


def _key(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flat_shapes(tree: Any) -> dict[KeyPath, tuple[int, ...]]:
    """Path (keys as strings) → shape of every array leaf of a state or metadata tree."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(_key(k) for k in path): tuple(leaf.shape)
            for path, leaf in flat if hasattr(leaf, "shape")}


def check_shapes(saved: Any, wanted: Any, where: str, skip: Callable[[KeyPath], bool]) -> None:
    """Raise naming each parameter that is missing or shaped differently in the checkpoint."""
    have, want = flat_shapes(saved), flat_shapes(wanted)
    problems = []
    for path, shape in want.items():
        if skip(path):
            continue
        if path not in have:
            problems.append(f"{'/'.join(path)}: not in the checkpoint")
        elif have[path] != shape:
            problems.append(f"{'/'.join(path)}: saved shape {have[path]}, expected {shape}")
    extra = [p for p in have if p not in want and not skip(p)]
    problems += [f"{'/'.join(p)}: in the checkpoint but not in the model" for p in extra]
    if problems:
        raise ValueError(
            f"Checkpoint {where} does not fit the model:\n  - " + "\n  - ".join(problems)
            + "\nRestore it into the model (and optimizer) it was saved from."
        )


def host_targets(metadata_tree: Any) -> Any:
    """Metadata tree → ShapeDtypeStructs on the first CPU device (reads any topology)."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=cpu),
                        metadata_tree, is_leaf=lambda x: hasattr(x, "shape"))


def check_manager(cp_manager: Any, where: str) -> None:
    """`cp_manager` is an Orbax CheckpointManager (or None where a path may stand for it)."""
    if cp_manager is not None and not isinstance(cp_manager, ocp.CheckpointManager):
        raise TypeError(f"{where}: cp_manager must be an orbax CheckpointManager (see "
                        f"create_checkpoint_manager), got {type(cp_manager).__name__}"
                        + (f" {cp_manager!r}; a path goes in input_checkpoint_path."
                           if isinstance(cp_manager, str | os.PathLike) else "."))


@contextlib.contextmanager
def open_checkpoint(cp_manager: ocp.CheckpointManager | None, path: PathLike | None,
                    step: int | None, keys: tuple[str, str, str], proto_class: type
                    ) -> Iterator[tuple[ocp.CheckpointManager, int, dict[str, Any], Any]]:
    """(manager, step, item metadata, spec proto) of a step to read; a manager opened here
    for `path` (when `cp_manager` is None) is closed on exit."""
    own = cp_manager is None
    check_manager(cp_manager, "restore")
    if cp_manager is None:
        if path is None:
            raise ValueError("Pass a checkpoint path or a CheckpointManager to read from.")
        cp_manager = create_manager(path, ocp.CheckpointManagerOptions(read_only=True), keys)
    try:
        step = resolve_step(cp_manager, step)
        metadata = item_metadata(cp_manager, step, keys)
        proto = restore(cp_manager, step, {keys[2]: ocp.args.ProtoRestore(proto_class)})[keys[2]]
        yield cp_manager, step, metadata, proto
    finally:
        if own:
            cp_manager.close()
