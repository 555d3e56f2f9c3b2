"""The run's checkpoints through `tilecore.checkpoint` (Orbax): save, find, resume.

A checkpoint holds every stack's table and optimizer slots (stacked layout, with
the specs and plan as metadata) and, as `extra`, the dense model's parameters,
its optax state and the step. Saves are atomic (Orbax writes a temporary
directory and renames it), so a run interrupted mid-save keeps the previous
checkpoint; only the newest `KEEP` are kept.

Resuming takes the newest *intact* checkpoint: each candidate is verified (every
array read and compared with the checksum saved with it), and a damaged newer one
is skipped with a warning naming it and why. The verdicts are remembered while a
step's files stay unchanged, so finding the step and restoring it verify it once.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import Mesh

from tilecore import checkpoint, ops
from tilecore.pipelining import DenseState, TrainState
from tilecore.stacking import StackingPlan

KEEP = 2

Fingerprint = tuple[tuple[str, int, int], ...]
_VERDICTS: dict[tuple[str, int, Fingerprint], str | None] = {}
"""(directory, step, its files) → None if intact, else why not."""


class Resumed(NamedTuple):
    """What a run continues from: the saved step, tables with slots, and dense state."""

    step: int
    variables: dict[str, ops.EmbeddingVariables]
    dense: DenseState


def save_checkpoint(directory: Path, plan: StackingPlan, state: TrainState, *, step: int,
                    max_to_keep: int | None = KEEP) -> Path:
    """Save `state` (tables, slots, dense params, optax state) as step `step` of `directory`.

    Returns the step's directory. Older steps beyond the newest `max_to_keep` are
    deleted (None keeps all). Damaged checkpoints at `step` or newer (those a
    resumed run skipped) are first moved aside to `<step>.damaged`, with a warning,
    so that the run saves its steps again; an intact one there is never replaced
    (ValueError, as from `tilecore.checkpoint.save`).
    """
    for newer in checkpoint.available_steps(directory):  # the damaged ones a resume skipped
        if newer >= step:
            _move_aside_if_damaged(directory, newer)
    extra = {"dense": state.dense, "step": np.int64(step)}
    return checkpoint.save(directory, plan, state.variables, step=step, extra=extra,
                           max_to_keep=max_to_keep)


def _fingerprint(step_dir: Path) -> Fingerprint:
    """Every file under `step_dir` with its size and modification time: a verdict holds
    only while these are unchanged."""
    files = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            stat = os.stat(os.path.join(root, name))
            files.append((os.path.relpath(os.path.join(root, name), step_dir), stat.st_size,
                          stat.st_mtime_ns))
    return tuple(sorted(files))


def _verdict(directory: Path, step: int) -> tuple[str | None, bool]:
    """(None if step `step` is intact else why not, whether this is the first time it
    was checked with these files)."""
    key = (str(Path(directory).absolute()), step, _fingerprint(Path(directory) / str(step)))
    if key in _VERDICTS:
        return _VERDICTS[key], False
    try:
        checkpoint.verify(directory, step=step)
        why = None
    except checkpoint.CheckpointCorruptError as error:
        why = str(error)
    _VERDICTS[key] = why
    return why, True


def _move_aside_if_damaged(directory: Path, step: int) -> None:
    """Rename a damaged step `step` of `directory` to `<step>.damaged` (which Orbax does
    not list), keeping its files for inspection; an intact or absent one stays."""
    path = Path(directory) / str(step)
    if not path.is_dir() or step not in checkpoint.available_steps(directory):
        return
    why, _ = _verdict(directory, step)
    if why is None:
        return
    target, n = path.with_name(f"{step}.damaged"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{step}.damaged-{n}")
    path.rename(target)
    warnings.warn(f"Moved the damaged checkpoint step {step} to {str(target)!r} to save step "
                  f"{step} again. {why}", UserWarning, stacklevel=3)


def latest_step(directory: Path) -> int | None:
    """The newest intact checkpoint's step in `directory` (None if it holds no finished one).

    Newer damaged checkpoints are skipped, each with a warning naming its step and
    why (once per process, while its files are unchanged).

    Raises:
      tilecore.checkpoint.CheckpointCorruptError: every checkpoint there is damaged;
        each is listed with its reason.
    """
    steps = checkpoint.available_steps(directory)
    if not steps:
        return None
    skipped: list[tuple[int, str, bool]] = []
    for step in reversed(steps):
        why, first = _verdict(directory, step)
        if why is None:
            for bad, reason, new in skipped:
                if new:
                    warnings.warn(
                        f"Skipping the damaged checkpoint step {bad} in {str(directory)!r}: "
                        f"resuming from step {step}, the newest intact one. {reason}",
                        UserWarning, stacklevel=2)
            return step
        skipped.append((step, why, first))
    listed = "\n".join(f"  - step {bad}: {reason}" for bad, reason, _ in skipped)
    raise checkpoint.CheckpointCorruptError(
        f"No intact checkpoint to resume from in {str(directory)!r}: every saved step is "
        f"damaged.\n{listed}\nMove the damaged step directories away and train from the "
        "start, or train into another directory (--out) without --resume.")


def restore_checkpoint(directory: Path, plan: StackingPlan, dense: DenseState, *,
                       mesh: Mesh | None = None, step: int | None = None) -> Resumed:
    """A checkpoint in `directory`, laid out for `plan` (on `mesh`).

    `dense` is a fresh dense state of the model: it gives the structure (optax
    state types) and placement the saved one is read into. `step` None takes the
    newest intact checkpoint (`latest_step`: damaged newer ones are skipped with a
    warning); a given `step` is read as it is, damaged or not.

    Raises:
      tilecore.checkpoint.CheckpointMismatchError: the saved tables differ from
        `plan`'s (names, vocab sizes, dims, optimizers); every difference is listed.
      tilecore.checkpoint.CheckpointNotFoundError: no finished checkpoint there (or
        not `step`).
      tilecore.checkpoint.CheckpointCorruptError: `step` is damaged, or (`step`
        None) every checkpoint is; names the step, the file and the array.
    """
    if step is None:
        step = latest_step(directory)
    target: dict[str, Any] = {"dense": dense, "step": np.int64(0)}
    saved = checkpoint.restore(directory, plan, step=step, mesh=mesh, extra=target)
    if saved.extra is None:
        raise checkpoint.CheckpointCorruptError(
            f"Checkpoint {str(directory)!r} (step {saved.step}) has no dense model state; it "
            "was not written by the DLRM trainer (tilecore train). Start without resuming, or "
            "point --out at a training run's directory.")
    return Resumed(saved.step, saved.variables, saved.extra["dense"])
