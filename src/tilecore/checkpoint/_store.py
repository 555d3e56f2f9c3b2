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
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding, SingleDeviceSharding

from ..specs._numbers import is_integer
from ._checksums import Expected, leaf_key, problem, seal_problem
from ._errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointTargetError
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
    try:
        opened = ocp.CheckpointManager(Path(directory).absolute(), options=options,
                                       item_handlers=_handlers())
    except (FileNotFoundError, NotADirectoryError) as error:  # a step went while listed
        if not Path(directory).is_dir():
            raise
        raise CheckpointNotFoundError(
            f"Checkpoint {str(directory)!r}: {_removed(str(error))} was removed while the steps "
            f"were being listed: {_PRUNED}") from error
    with opened as mgr:
        yield mgr


def available_steps(directory: PathLike) -> tuple[int, ...]:
    """Steps with a finished checkpoint in `directory`, ascending (empty if none)."""
    if not Path(directory).is_dir():
        return ()
    with manager(directory, create=False) as mgr:
        return tuple(sorted(mgr.all_steps()))


def pick_step(directory: PathLike, step: int | None) -> int:
    """`step` (or the latest) after checking that it was saved."""
    if step is not None and not is_integer(step):
        raise TypeError(f"step must be an integer (a saved step) or None (the latest), got "
                        f"step={step!r}.")
    steps = available_steps(directory)
    if not steps:
        why = "does not exist" if not Path(directory).exists() else "holds no finished checkpoint"
        raise CheckpointNotFoundError(
            f"No checkpoint at {str(directory)!r}: the directory {why}. Check the path, or save "
            "one first with tilecore.checkpoint.save(path, plan, variables, step=...)."
        )
    if step is None:
        return steps[-1]
    step = int(step)
    if step not in steps:
        raise CheckpointNotFoundError(
            f"No checkpoint for step={step} at {str(directory)!r}; saved steps: {list(steps)}."
        )
    return step


def step_dir(directory: PathLike, step: int) -> Path:
    """The directory Orbax writes step `step` to."""
    return Path(directory).absolute() / str(step)


def _brief(error: BaseException) -> str:
    """`error` in one line, with its root cause (TensorStore's own words) if different."""
    def line(e: BaseException) -> str:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0][:300] if text else ''}"

    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    return line(error) if root is error else f"{line(error)}; caused by {line(root)}"


def read_raw_metadata(directory: PathLike, step: int) -> Any:
    """The JSON record of `step`, as written."""
    where = step_dir(directory, step) / METADATA / "metadata"
    try:
        with manager(directory, create=False) as mgr:
            return mgr.restore(step, args=ocp.args.Composite(
                **{METADATA: ocp.args.JsonRestore()}))[METADATA]
    except Exception as error:  # Orbax raises many types for an unreadable file.
        raise corrupt(directory, step, f"its metadata file {str(where)!r} cannot be read "
                                       f"({_brief(error)})") from error


def read_layout(directory: PathLike, step: int) -> tuple[Any, SavedLayout]:
    """The JSON record of `step` and the layout parsed from it."""
    raw = read_raw_metadata(directory, step)
    try:
        layout = parse(raw)
        why = seal_problem(raw)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        raise corrupt(directory, step, f"its metadata is malformed ({error!r})") from error
    if why is not None:
        where = step_dir(directory, step) / METADATA / "metadata"
        raise corrupt(directory, step, f"its metadata file {str(where)!r} is malformed: {why}")
    return raw, layout


_MISSING = re.compile(r"No such file or directory: '([^']+)'|Path is not a directory: (\S+)")
_PRUNED = ("another process deletes checkpoints in this directory (a training run keeping "
           "its newest few). Read again, or read a copy of the step.")


def _removed(text: str) -> str:
    """The path an error's text says went missing (or 'a file')."""
    found = _MISSING.search(text)
    return repr(found[1] or found[2]) if found else "a file"


def corrupt(directory: PathLike, step: int, why: str
            ) -> CheckpointCorruptError | CheckpointNotFoundError:
    """The error for a damaged step: which one, why, and what to do instead; or, when a
    file went missing because the step (or another) was deleted while being read (a
    training run pruning to `max_to_keep`), a CheckpointNotFoundError saying so."""
    where = str(step_dir(directory, step))
    missing = _MISSING.search(why)
    if not os.path.isdir(where) or (missing is not None and not os.path.abspath(
            missing[1] or missing[2]).startswith(os.path.abspath(where) + os.sep)):
        return CheckpointNotFoundError(
            f"Checkpoint {str(directory)!r}: "
            f"{repr(where) if missing is None else _removed(why)} was removed "
            f"while step {step} was being read: {_PRUNED}")
    try:
        steps: object = list(available_steps(directory))
    except Exception:  # listing failed too: the message still names the step
        steps = "unknown"
    return CheckpointCorruptError(
        f"Checkpoint {str(directory)!r} step {step} is damaged: {why}. The files under "
        f"{where!r} were altered after saving (a disk error, an interrupted copy, an edit) "
        "or not written by tilecore.checkpoint.save. Restore another step "
        f"(saved steps: {steps}), or move {where!r} away and save again."
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


def _host_args(tree: Any) -> Any:
    """Restore arguments reading every array of a saved metadata `tree` as numpy,
    whatever topology wrote it; scalars come back as saved."""
    def one(leaf: Any) -> ocp.RestoreArgs:
        is_array = getattr(leaf, "shape", ()) != () or type(leaf).__name__ == "ArrayMetadata"
        return ocp.RestoreArgs(restore_type=np.ndarray) if is_array else ocp.RestoreArgs()

    return jax.tree.map(one, tree)


def _read_leaf(mgr: ocp.CheckpointManager, step: int, item: str, leaves: list[Any],
               treedef: Any, args: Any, index: int) -> Any:
    """Leaf `index` of the tree `leaves`/`treedef` (every other leaf an Orbax
    placeholder: not read)."""
    alone = jax.tree_util.tree_unflatten(
        treedef, [leaf if i == index else ocp.PLACEHOLDER for i, leaf in enumerate(leaves)])
    restored = mgr.restore(step, args=ocp.args.Composite(
        **{item: ocp.args.PyTreeRestore(alone, restore_args=args)}))[item]
    found = [v for v in jax.tree_util.tree_leaves(restored) if v is not ocp.PLACEHOLDER]
    if len(found) != 1:
        raise ValueError(f"Orbax returned {len(found)} arrays for one requested")
    return found[0]


def _check_keys(directory: PathLike, step: int, item: str, keys: list[str],
                expected: Mapping[str, Expected]) -> None:
    """Every array the layout expects is saved, and no other."""
    missing, unknown = sorted(set(expected) - set(keys)), sorted(set(keys) - set(expected))
    if missing or unknown:
        names = [expected[k].name for k in missing]
        raise corrupt(directory, step, f"its {item!r} arrays do not match its metadata: "
                                       f"missing {names}, unexpected {unknown}")


def read_item(directory: PathLike, step: int, item: str, expected: Mapping[str, Expected],
              *, target: Any = None, exact: bool = False,
              then: Callable[[Any], Any] | None = None) -> Any:
    """`item` of `step` read one array at a time, each checked against `expected`.

    Args:
      target: the tree to read into (its structure and leaf placements, see
        `restore_args`); None reads the tree as saved, arrays as numpy.
      expected: leaf key (`leaf_key`) → what that array must be (shape, checksum);
        leaves without an entry are read unchecked.
      exact: the saved leaves must be exactly those of `expected`.
      then: applied to each array once checked (e.g. to put it on devices, so that
        one host copy at a time is held); its result takes the array's place.

    Reading arrays one by one names the damaged one when a file cannot be read, and
    leaves no read of another array running when one fails: otherwise TensorStore
    calls into Orbax's closed event loop and prints tracebacks until the interpreter
    exits.

    Raises:
      CheckpointCorruptError: a file cannot be read, or an array differs from
        `expected` (names the array and the item's directory).
    """
    where = str(step_dir(directory, step) / item)
    hint = "" if target is None else " (or the restore target does not fit what was saved)"
    with contextlib.ExitStack() as stack:
        try:
            mgr = stack.enter_context(manager(directory, create=False))
            saved = mgr.item_metadata(step)[item].tree
            tree = saved if target is None else target
            args = _host_args(tree) if target is None else restore_args(target)
            paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
            leaves = [leaf for _, leaf in paths]
        except Exception as error:  # a damaged _METADATA / array_metadatas file
            raise corrupt(directory, step, f"the metadata of its {item!r} arrays under "
                                           f"{where!r} cannot be read ({_brief(error)})"
                          ) from error
        keys = [leaf_key(path) for path, _ in paths]
        if target is not None:
            _check_target(where, dict(zip(keys, leaves, strict=True)),
                          {leaf_key(p): leaf for p, leaf in
                           jax.tree_util.tree_flatten_with_path(saved)[0]})
        if exact:
            _check_keys(directory, step, item, keys, expected)
        values = []
        for index, key in enumerate(keys):
            want = expected.get(key, Expected(f"{item} leaf {key!r}"))
            try:
                value = _read_leaf(mgr, step, item, leaves, treedef, args, index)
            except Exception as error:  # TensorStore/Orbax raise many types for bad files
                raise corrupt(directory, step, f"{want.name} cannot be read from {where!r}"
                                               f"{hint} ({_brief(error)})") from error
            why = problem(want, value)
            if why is not None:
                raise corrupt(directory, step, f"{want.name} in {where!r} is not the array "
                                               f"that was saved: {why}")
            values.append(value if then is None else then(value))
    return jax.tree_util.tree_unflatten(treedef, values)


def _check_target(where: str, wanted: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Raise CheckpointTargetError (the checkpoint is fine) when a restore target's leaves
    are not the saved tree's, or not of the saved shapes."""
    missing = sorted(set(saved) - set(wanted))
    unknown = sorted(set(wanted) - set(saved))
    reshaped = [f"{key!r} saved {tuple(saved[key].shape)}, the target's "
                f"{tuple(wanted[key].shape)}" for key in sorted(set(saved) & set(wanted))
                if hasattr(saved[key], "shape") and hasattr(wanted[key], "shape")
                and tuple(saved[key].shape) != tuple(wanted[key].shape)]
    parts = ([f"it lacks the saved leaves {missing[:8]}"] if missing else []) + (
        [f"it has leaves that were not saved {unknown[:8]}"] if unknown else []) + (
        [f"leaves of other shapes: {'; '.join(reshaped[:8])}"] if reshaped else [])
    if parts:
        raise CheckpointTargetError(
            f"restore: the target does not fit the tree saved in {where!r}: "
            f"{'; '.join(parts)}. Pass a target of the saved structure, or none "
            "(the tree as saved).")
