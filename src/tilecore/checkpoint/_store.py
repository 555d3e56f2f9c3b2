"""The Orbax side: one `CheckpointManager` layout, read and written item by item.

A step directory holds three items: `embeddings` (every stack's table and slots,
a list in the plan's stack order), `extra` (the caller's pytree, if any) and
`tilecore` (the JSON metadata). Orbax writes a step into a temporary directory
and renames it when every item is complete, so an interrupted save never
replaces or damages the previous step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding, SingleDeviceSharding

from ._errors import CheckpointCorruptError, CheckpointNotFoundError
from ._metadata import SavedLayout, parse

EMBEDDINGS, EXTRA, METADATA = "embeddings", "extra", "tilecore"
PathLike = str | os.PathLike[str]


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    return {EMBEDDINGS: ocp.PyTreeCheckpointHandler(), EXTRA: ocp.PyTreeCheckpointHandler(),
            METADATA: ocp.JsonCheckpointHandler()}


@contextlib.contextmanager
def manager(directory: PathLike, *, create: bool, max_to_keep: int | None = None
            ) -> Iterator[ocp.CheckpointManager]:
    """A synchronous manager over `directory` (saves are complete on return)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=create, enable_async_checkpointing=False)
    with ocp.CheckpointManager(Path(directory).absolute(), options=options,
                               item_handlers=_handlers()) as mgr:
        yield mgr


def available_steps(directory: PathLike) -> tuple[int, ...]:
    """Steps with a finished checkpoint in `directory`, ascending (empty if none)."""
    if not Path(directory).is_dir():
        return ()
    with manager(directory, create=False) as mgr:
        return tuple(sorted(mgr.all_steps()))


def pick_step(directory: PathLike, step: int | None) -> int:
    """`step` (or the latest) after checking that it was saved."""
    steps = available_steps(directory)
    if not steps:
        why = "does not exist" if not Path(directory).exists() else "holds no finished checkpoint"
        raise CheckpointNotFoundError(
            f"No checkpoint at {str(directory)!r}: the directory {why}. Check the path, or save "
            "one first with tilecore.checkpoint.save(path, plan, variables, step=...)."
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointNotFoundError(
            f"No checkpoint for step={step} at {str(directory)!r}; saved steps: {list(steps)}."
        )
    return step


def read_raw_metadata(directory: PathLike, step: int) -> Any:
    """The JSON record of `step`, as written."""
    try:
        with manager(directory, create=False) as mgr:
            return mgr.restore(step, args=ocp.args.Composite(
                **{METADATA: ocp.args.JsonRestore()}))[METADATA]
    except Exception as error:  # Orbax raises many types for an unreadable file.
        raise corrupt(directory, step, f"its metadata cannot be read ({error!r})") from error


def read_layout(directory: PathLike, step: int) -> tuple[Any, SavedLayout]:
    """The JSON record of `step` and the layout parsed from it."""
    raw = read_raw_metadata(directory, step)
    try:
        return raw, parse(raw)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        raise corrupt(directory, step, f"its metadata is malformed ({error!r})") from error


def corrupt(directory: PathLike, step: int, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"Checkpoint {str(directory)!r} step {step} is damaged: {why}. It was not written by "
        "tilecore.checkpoint.save or was altered; restore another step "
        f"(saved steps: {list(available_steps(directory))})."
    )


def restore_args(target: Any) -> Any:
    """Orbax restore arguments that recreate each leaf of `target` as that leaf is.

    jax arrays and `ShapeDtypeStruct`s are read onto their sharding (one device if
    none), numpy values as numpy, Python scalars as themselves.
    """
    default = SingleDeviceSharding(jax.devices()[0])

    def one(leaf: Any) -> ocp.RestoreArgs:
        if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            sharding = getattr(leaf, "sharding", None)
            return ocp.ArrayRestoreArgs(
                sharding=sharding if isinstance(sharding, Sharding) else default,
                global_shape=leaf.shape, dtype=leaf.dtype)
        if isinstance(leaf, np.ndarray | np.generic):
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
        return ocp.RestoreArgs()

    return jax.tree.map(one, target)


def host_restore_args(directory: PathLike, step: int, item: str) -> Any:
    """Restore arguments reading every array of `item` as numpy, whatever the topology."""
    with manager(directory, create=False) as mgr:
        tree = mgr.item_metadata(step)[item].tree
    def one(leaf: Any) -> ocp.RestoreArgs:
        is_array = getattr(leaf, "shape", ()) != () or type(leaf).__name__ == "ArrayMetadata"
        return ocp.RestoreArgs(restore_type=np.ndarray) if is_array else ocp.RestoreArgs()

    return jax.tree.map(one, tree)


def read_item(directory: PathLike, step: int, item: str, target: Any, args: Any) -> Any:
    """`item` of `step`, as `target` (None: as saved) with Orbax `args`."""
    try:
        with manager(directory, create=False) as mgr:
            return mgr.restore(step, args=ocp.args.Composite(
                **{item: ocp.args.PyTreeRestore(target, restore_args=args)}))[item]
    except (FileNotFoundError, KeyError, ValueError) as error:
        raise corrupt(directory, step, f"its {item!r} arrays cannot be read ({error!r})"
                      ) from error
