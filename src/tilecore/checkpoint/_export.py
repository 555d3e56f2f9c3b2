"""Tables for serving, and a checkpoint's record of what it holds."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..ops import EmbeddingVariables
from ..stacking import StackingPlan
from ._compare import table_mismatches
from ._convert import unshard_variables
from ._errors import CheckpointMismatchError
from ._save_restore import read_tables
from ._store import PathLike, pick_step, read_layout, read_raw_metadata


def read_metadata(directory: PathLike, *, step: int | None = None) -> dict[str, Any]:
    """The JSON record saved with `step` (None: the latest).

    Keys: `step`, `topology`, `config`, `tables` (sizes, combiner, limits,
    `optimizer` with type, slots and hyperparameters, `weights_dtype`),
    `features`, `stacks` (each with its `weights_dtype`),
    `table_settings`, `feature_settings`, `not_serialized` (callables such
    as learning-rate schedules, stored by name only), `checksums` (CRC-32, or
    `hashsum64` for arrays spread over processes, with dtype and shape of every
    array, per stack table and slot, and of every `extra` leaf; absent in
    checkpoints written before them) and `metadata_crc32` (the
    record's own seal).

    Raises:
      CheckpointNotFoundError: no checkpoint (or not `step`) in `directory`.
      CheckpointCorruptError: the record cannot be read, is malformed or changed
        after saving.
    """
    step = pick_step(directory, step)
    read_layout(directory, step)  # raises CheckpointCorruptError if malformed
    return dict(read_raw_metadata(directory, step))


def _write_npz(path: PathLike, tables: Mapping[str, np.ndarray]) -> None:
    """Write atomically: a temporary file in the same directory, then a rename."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as file:
            savez: Callable[..., None] = np.savez  # table names are keywords here
            savez(file, **tables)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_tables(
    source: PathLike | Mapping[str, EmbeddingVariables],
    plan: StackingPlan | None = None,
    *,
    step: int | None = None,
    npz_path: PathLike | None = None,
) -> dict[str, np.ndarray]:
    """Every table as a plain `[vocab_size, embedding_dim]` float32 array, for serving.

    Args:
      source: a checkpoint directory (read with its own saved layout, whatever
        topology wrote it) or stack name → `EmbeddingVariables` in memory.
      plan: the plan of in-memory `source` (required then). For a checkpoint it
        is optional; if given, the saved tables must match its names and sizes.
      step: the checkpoint step (None: the latest).
      npz_path: also write the tables to this `.npz` file (one array per table).

    Returns:
      Table name → its rows, without padding and without optimizer slots.
    """
    if npz_path is not None:  # checked before the tables are read
        target = Path(npz_path)
        if target.is_dir() or not target.parent.is_dir():
            raise ValueError(f"export_tables: npz_path={str(npz_path)!r} must name a file in an "
                             "existing directory.")
    if isinstance(source, Mapping):
        if plan is None:
            raise ValueError("export_tables: pass the plan the in-memory variables belong to.")
        states = unshard_variables(plan, source)
    else:
        step = pick_step(source, step)
        _, saved = read_layout(source, step)
        if plan is not None:
            mismatches = table_mismatches(saved, plan, optimizers=False)
            if mismatches:
                raise CheckpointMismatchError(Path(source), step, mismatches)
        states = read_tables(source, step, saved)
    tables = {name: np.asarray(state.table, np.float32)  # exact for half-precision tables
              for name, state in states.items()}
    if npz_path is not None:
        _write_npz(npz_path, tables)
    return tables
