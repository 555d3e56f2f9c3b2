"""The run's checkpoints through `tilecore.checkpoint` (Orbax): save, find, resume.

A checkpoint holds every stack's table and optimizer slots (stacked layout, with
the specs and plan as metadata) and, as `extra`, the dense model's parameters,
its optax state and the step. Saves are atomic (Orbax writes a temporary
directory and renames it), so a run interrupted mid-save keeps the previous
checkpoint; only the newest `KEEP` are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import Mesh

from .. import checkpoint, ops
from ..pipelining import DenseState, TrainState
from ..stacking import StackingPlan

KEEP = 2


class Resumed(NamedTuple):
    """What a run continues from: the saved step, tables with slots, and dense state."""

    step: int
    variables: dict[str, ops.EmbeddingVariables]
    dense: DenseState


def save_checkpoint(directory: Path, plan: StackingPlan, state: TrainState, *, step: int,
                    max_to_keep: int | None = KEEP) -> Path:
    """Save `state` (tables, slots, dense params, optax state) as step `step` of `directory`.

    Returns the step's directory. Older steps beyond the newest `max_to_keep` are
    deleted (None keeps all).
    """
    extra = {"dense": state.dense, "step": np.int64(step)}
    return checkpoint.save(directory, plan, state.variables, step=step, extra=extra,
                           max_to_keep=max_to_keep)


def latest_step(directory: Path) -> int | None:
    """The newest finished checkpoint's step in `directory` (None if there is none)."""
    steps = checkpoint.available_steps(directory)
    return steps[-1] if steps else None


def restore_checkpoint(directory: Path, plan: StackingPlan, dense: DenseState, *,
                       mesh: Mesh | None = None) -> Resumed:
    """The newest checkpoint in `directory`, laid out for `plan` (on `mesh`).

    `dense` is a fresh dense state of the model: it gives the structure (optax
    state types) and placement the saved one is read into.

    Raises:
      tilecore.checkpoint.CheckpointMismatchError: the saved tables differ from
        `plan`'s (names, vocab sizes, dims, optimizers); every difference is listed.
      tilecore.checkpoint.CheckpointNotFoundError: no finished checkpoint there.
    """
    target: dict[str, Any] = {"dense": dense, "step": np.int64(0)}
    saved = checkpoint.restore(directory, plan, mesh=mesh, extra=target)
    if saved.extra is None:
        raise checkpoint.CheckpointCorruptError(
            f"Checkpoint {str(directory)!r} (step {saved.step}) has no dense model state; it "
            "was not written by tilecore.training. Start without resuming, or point --out "
            "at a training run's directory.")
    return Resumed(saved.step, saved.variables, saved.extra["dense"])
