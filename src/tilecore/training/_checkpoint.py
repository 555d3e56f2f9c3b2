"""Saving the final state: one file, written atomically.

A seam for `tilecore.checkpoint` (Orbax, topology conversion): until it is used
here, the state is saved as per-table arrays (topology-independent, via
`ops.unshard`) plus the dense parameters in one `.npz`. The file is written
under a temporary name and renamed, so a run interrupted mid-save leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import ops
from ..pipelining import TrainState
from ..stacking import StackingPlan


def checkpoint_arrays(plan: StackingPlan, state: TrainState) -> dict[str, np.ndarray]:
    """The state as named numpy arrays: `table/<t>`, `slot/<t>/<i>`, `param/<path>`."""
    arrays = {f"table/{t}": a for t, a in ops.unshard(
        plan, {s: v.table for s, v in state.variables.items()}).items()}
    for i in range(min((len(v.slots) for v in state.variables.values()), default=0)):
        slots = ops.unshard(plan, {s: v.slots[i] for s, v in state.variables.items()})
        arrays.update({f"slot/{t}/{i}": a for t, a in slots.items()})
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.dense.params):
        arrays[f"param/{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return arrays


def save_checkpoint(directory: Path, plan: StackingPlan, state: TrainState, *, step: int) -> Path:
    """Write `directory/step_<step>.npz` atomically; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:08d}.npz"
    buffer = io.BytesIO()
    arrays: dict[str, Any] = {"step": np.int64(step), **checkpoint_arrays(plan, state)}
    np.savez(buffer, **arrays)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)
    return path
