"""`save` and `restore`: a training job's embeddings (and anything else) in one call.

`save` records a checksum of every array in the metadata (`_checksums`); `restore`,
`export_tables` and `verify` read the arrays one at a time and compare each with
it, so a damaged file is an error naming the array, never different values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from .. import __version__
from ..ops import DEFAULT_AXIS, EmbeddingVariables, unshard
from ..specs._numbers import is_integer
from ..stacking import StackingPlan
from ._checksums import (
    checksum,
    embedding_checksums,
    extra_checksums,
    leaf_key,
    saved_checksums,
    seal,
)
from ._compare import same_layout, table_mismatches
from ._convert import (
    TableState,
    check_variables,
    place,
    shard_variables,
    stack_plan,
    table_sharding,
)
from ._errors import CheckpointMismatchError
from ._metadata import SavedLayout, plan_json
from ._store import (
    EMBEDDINGS,
    EXTRA,
    METADATA,
    PathLike,
    manager,
    pick_step,
    read_item,
    read_layout,
)

log = logging.getLogger(__name__)


class Checkpoint(NamedTuple):
    """What `restore` returns.

    Attributes:
      step: the training step the checkpoint was saved at.
      variables: stack name → `EmbeddingVariables` laid out for the restoring plan.
      extra: the pytree passed to `save` as `extra` (None if none was).
    """

    step: int
    variables: dict[str, EmbeddingVariables]
    extra: Any


def _embeddings_tree(order: tuple[str, ...], variables: Mapping[str, EmbeddingVariables]
                     ) -> list[dict[str, Any]]:
    return [{"table": variables[s].table, "slots": list(variables[s].slots)} for s in order]


def _checksums(plan: StackingPlan, variables: Mapping[str, EmbeddingVariables], extra: Any
               ) -> dict[str, Any]:
    """The metadata's record of every array's checksum, taken on the whole arrays
    (one at a time), so it holds for any topology that reads them."""
    order = tuple(plan.stacks)
    slots = {s: plan.stacks[s].optimizer.slot_names for s in order}
    return saved_checksums(embedding_checksums(order, slots, variables),
                           None if extra is None else extra_checksums(extra))


def _check_extra(extra: Any) -> None:
    """Every leaf of `extra` is something Orbax saves: an array or a number (a function,
    say, failed inside Orbax and left its threads printing tracebacks at exit)."""
    paths = jax.tree_util.tree_flatten_with_path(extra)[0]
    for path, leaf in paths:
        if not isinstance(leaf, np.ndarray | jax.Array | np.generic | int | float | bool | str):
            raise TypeError(f"save: extra{jax.tree_util.keystr(path)} is a "
                            f"{type(leaf).__name__}; extra may hold arrays, numbers and strings only.")


def save(
    directory: PathLike,
    plan: StackingPlan,
    variables: Mapping[str, EmbeddingVariables],
    *,
    step: int,
    extra: Any = None,
    max_to_keep: int | None = None,
) -> Path:
    """Write a checkpoint of `variables` (every stack's table and slots) at `step`.

    Args:
      directory: the checkpoint root; each step gets its own subdirectory.
      plan: the stacking plan `variables` are laid out for; stored as JSON with
        every table, feature and optimizer spec (see `read_metadata`).
      variables: stack name → `EmbeddingVariables`, on any devices or mesh.
      step: the training step (an integer >= 0), also the subdirectory's name.
      extra: any pytree to save alongside (dense parameters, optax state, data
        iterator position, …); restored by `restore`.
      max_to_keep: keep only the newest this many steps (None keeps all).

    Returns:
      The step's directory. The save is synchronous and atomic: Orbax writes into a
      temporary directory and renames it once complete, so an interrupted save
      leaves earlier steps intact and is never mistaken for a checkpoint. The
      metadata records a checksum of every array (and `extra` leaf), compared when
      the checkpoint is read: a CRC-32, or for an array spread over the processes
      of a multi-process job a `hashsum64` that the processes add up from their
      shards (`_checksums`); every process must call `save`.

    Raises:
      ValueError: `step` is saved already or older than the newest step there, or, in
        a multi-process job, the processes save other steps or directories, or other
        host values (numbers, NumPy arrays) in `extra` (raised on every process).
    """
    if not is_integer(step) or step < 0:
        raise ValueError(f"save: step must be an integer >= 0, got step={step!r}.")
    if max_to_keep is not None and (not is_integer(max_to_keep) or max_to_keep < 1):
        raise ValueError(  # 0 would delete the step just saved
            f"save: max_to_keep must be an integer >= 1 or None (keep all), got {max_to_keep=!r}.")
    check_variables(plan, variables)
    if extra is not None:
        _check_extra(extra)
    items: dict[str, ocp.args.CheckpointArgs] = {
        EMBEDDINGS: ocp.args.PyTreeSave(_embeddings_tree(tuple(plan.stacks), variables)),
        METADATA: ocp.args.JsonSave(seal({**plan_json(plan, int(step), __version__),
                                          "has_extra": extra is not None,
                                          "checksums": _checksums(plan, variables, extra)})),
    }
    if extra is not None:
        items[EXTRA] = ocp.args.PyTreeSave(extra)
    _agree("save", directory, int(step), extra)
    with manager(directory, create=True, max_to_keep=max_to_keep) as mgr:
        steps = mgr.all_steps()
        if int(step) in steps:
            raise ValueError(
                f"save: step {step} already exists in {str(directory)!r}; pick a new step "
                "(checkpoints are never overwritten)."
            )
        if steps and int(step) < max(steps):  # Orbax would skip it and return False
            raise ValueError(
                f"save: step {step} is older than step {max(steps)}, the newest in "
                f"{str(directory)!r}; steps must increase. Save a newer step, or move the "
                "newer ones away first.")
        if not mgr.save(int(step), args=ocp.args.Composite(**items)):
            raise RuntimeError(f"save: Orbax declined to save step {step} in "
                               f"{str(directory)!r}; nothing was written.")
    return Path(directory).absolute() / str(int(step))


def _agree(what: str, directory: PathLike, step: int, extra: Any = None) -> None:
    """In a multi-process job, every process saves (or restores) the same step of the same
    directory, and `extra`'s host values (numbers, NumPy arrays: Orbax writes process 0's)
    are the same on every process: otherwise a ValueError on every process naming what
    differs (the saves waited on each other for 10 minutes; a restore failed inside JAX;
    process 1 got process 0's host values back). Global jax.Arrays are the job's own."""
    if jax.process_count() == 1:
        return
    from ..distributed._together import agree_on

    items: dict[str, Any] = {"directory": str(Path(directory).absolute()), "step": int(step)}
    if extra is not None:  # only the host leaves: the arrays' checksums are the metadata's
        items["extra host values"] = {
            leaf_key(path): checksum(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(extra)[0]
            if not isinstance(leaf, jax.Array)}
    agree_on(items, f"checkpoint {what}s",
             f"Every process must {what} the same step of the same directory, with the same "
             "host values (numbers, NumPy arrays) in extra: Orbax writes process 0's, so "
             "keep per-process state out of it", name=f"checkpoint {what}")


def _note_unchecked(directory: PathLike, step: int, saved: SavedLayout) -> None:
    if not saved.checksummed:
        log.debug("Checkpoint %r step %d records no checksums (written before tilecore "
                  "recorded them): its arrays are checked for shape only.", str(directory), step)


def _read_stacked(directory: PathLike, step: int, saved: SavedLayout,
                  then: Callable[[Any], Any] | None = None) -> dict[str, EmbeddingVariables]:
    """Every saved stack's table and slots, read one array at a time and checked
    against its shape and checksum; `then` maps each host array (default: kept)."""
    _note_unchecked(directory, step, saved)
    arrays = read_item(directory, step, EMBEDDINGS, saved.embeddings, exact=True, then=then)
    return {s: EmbeddingVariables(a["table"], tuple(a["slots"]))
            for s, a in zip(saved.stack_order, arrays, strict=True)}


def read_tables(directory: PathLike, step: int, saved: SavedLayout) -> dict[str, TableState]:
    """Every saved table with its slots as host `[vocab, dim]` arrays (any topology)."""
    out: dict[str, TableState] = {}
    for stack, var in _read_stacked(directory, step, saved).items():
        sub = stack_plan(saved.plan, stack)
        tables = unshard(sub, {stack: var.table})
        slots = [unshard(sub, {stack: s}) for s in var.slots]
        out.update({t: TableState(tables[t], tuple(s[t] for s in slots)) for t in tables})
    return out


def verify(directory: PathLike, *, step: int | None = None) -> int:
    """Read every array of a checkpoint and compare it with the checksum saved with it.

    Arrays are read to the host one at a time and dropped once checked: nothing
    goes to a device. A checkpoint written before checksums existed is checked for
    readable files and array shapes only.

    Args:
      directory: the checkpoint root given to `save`.
      step: the step to check; None checks the latest.

    Returns:
      The step checked.

    Raises:
      CheckpointNotFoundError: no checkpoint (or not `step`) in `directory`.
      CheckpointCorruptError: its metadata or an array cannot be read, or an array
        differs from what was saved; names the step's directory and the array.
    """
    step = pick_step(directory, step)
    raw, saved = read_layout(directory, step)
    _read_stacked(directory, step, saved, then=lambda _: None)
    if raw.get("has_extra"):
        read_item(directory, step, EXTRA, saved.extra, then=lambda _: None)
    return step


def restore(
    directory: PathLike,
    plan: StackingPlan,
    *,
    step: int | None = None,
    mesh: Mesh | None = None,
    axis: str = DEFAULT_AXIS,
    extra: Any = None,
) -> Checkpoint:
    """Read a checkpoint into variables laid out for `plan`, on any topology.

    The saved tables must match `plan`'s (names, vocab sizes, dims, optimizer
    types); hyperparameters may differ. Every array is read to the host, one at a
    time, and compared with the checksum `save` recorded. When `plan` stacks and
    shards the tables exactly as the saved plan did, each goes straight onto the
    devices (another device count included). Otherwise (other devices × SparseCores, other
    stacking) every table and slot is unsharded to `[vocab, dim]` on the host and
    resharded for `plan`: real rows are carried bit for bit, padding gets 0.0
    (tables) or the optimizer's initial slot value.

    Args:
      directory: the checkpoint root given to `save`.
      plan: the restoring model's plan (any topology).
      step: the step to read; None reads the latest.
      mesh, axis: where the tables go: rows split over `axis` of `mesh`; None
        for a single-device plan (the default device).
      extra: a target for the saved `extra` pytree (concrete values or
        `jax.ShapeDtypeStruct`s with shardings): its structure (tuples, named
        tuples, optax states) and placements are used. None returns it as Orbax
        stores it: containers as dicts/lists, arrays as numpy.

    Raises:
      CheckpointNotFoundError: no checkpoint (or not `step`) in `directory`.
      CheckpointCorruptError: the metadata or an array cannot be read, or an array
        differs from what was saved (its checksum); names the step's directory and
        the array (stack and table or slot, or the `extra` leaf).
      CheckpointMismatchError: the tables differ; lists every difference.
      CheckpointTargetError: `extra` is not of the saved structure or leaf shapes.
      ValueError: in a multi-process job, the processes read other steps or
        directories (raised on every process).
    """
    step = pick_step(directory, step)
    _agree("restore", directory, step)
    raw, saved = read_layout(directory, step)
    mismatches = table_mismatches(saved, plan)
    if mismatches:
        raise CheckpointMismatchError(Path(directory), step, mismatches)
    sharding = table_sharding(plan, mesh, axis)
    if same_layout(saved, plan):
        stacked = _read_stacked(directory, step, saved, then=lambda a: place(a, sharding))
        variables = {s: stacked[s] for s in plan.stacks}
    else:
        variables = shard_variables(plan, read_tables(directory, step, saved), mesh=mesh,
                                    axis=axis)
    restored_extra = None
    if raw.get("has_extra"):
        restored_extra = read_item(directory, step, EXTRA, saved.extra, target=extra)
    return Checkpoint(step, variables, restored_extra)
