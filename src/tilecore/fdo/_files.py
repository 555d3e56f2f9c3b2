"""File-backed FDO clients: one file per publish, the latest per process merged by max.

File names are `fdo_stats_<process_index>_<time_ns>.<ext>`; each holds, per stack,
the keys `<stack>_max_ids`, `<stack>_max_unique_ids`, `<stack>_required_buffer_size`
and `<stack>_id_drop_counters`, each a 2-D int64 array with one row per recorded
step (`[steps, N]`, `[steps, N]`, `[steps, S]`, `[steps, 1]`). Files in the
layouts of jax-tpu-embedding 0.2.0's clients (0-d and 1-d arrays) load too; the
formats themselves live in `_formats`. A client given the plan checks every file
against it when loading (`preprocessing._observed`); every publish is written atomically.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

import numpy as np

from ..preprocessing import PreprocessStats
from ..preprocessing._errors import FdoStatsError
from ..preprocessing._observed import FIELDS, as_rows, check_counts, check_stacks, warn_missing
from ..stacking import StackingPlan
from ._client import FdoClient
from ._formats import split_key

_PREFIX = "fdo_stats"

Arrays = dict[str, np.ndarray]
"""Key (`<stack>_<field>`) → `[steps, width]` int64."""


def _rows(stats: PreprocessStats) -> dict[str, Arrays]:
    """One row per field and stack: the maximum over local devices, as int64.

    Counts are checked (`check_counts`) so a file is never written with counts
    that no reader accepts.
    """

    def row(value: np.ndarray | int, stack: str, field: str) -> np.ndarray:
        a = check_counts(np.asarray(value), f"record: stack {stack!r} ({field})",
                         "Record the statistics that preprocess returned.")
        return as_rows(a).max(0, keepdims=True)

    fields = (stats.max_ids_per_partition, stats.max_unique_ids_per_partition,
              stats.required_buffer_size_per_sc, stats.id_drop_counters)
    return {field: {k: row(v, k, field) for k, v in values.items()}
            for field, values in zip(FIELDS, fields, strict=True)}


def _split_key(key: str, path: Path) -> tuple[str, str]:
    """`(stack, field)` of a key `<stack>_<field>`, else an FdoStatsError naming the file."""
    parts = split_key(key)
    if parts is None:
        raise FdoStatsError(
            f"FDO file {path}: unexpected key {key!r}; every key must be <stack>_<field> with "
            f"field one of {list(FIELDS)}. The file was not written by an FDO client."
        )
    return parts[0], parts[1][1:]


def _by_stack(arrays: Mapping[str, np.ndarray], path: Path) -> dict[str, dict[str, np.ndarray]]:
    """Group a file's arrays by stack, checking every stack has every field with equal steps."""
    stacks: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        stack, field = _split_key(key, path)
        stacks.setdefault(stack, {})[field] = value
    if not stacks:
        raise FdoStatsError(f"FDO file {path} holds no statistics (empty or truncated). "
                            "Delete it and publish again.")
    for stack, fields in stacks.items():
        missing = [f for f in FIELDS if f not in fields]
        if missing:
            raise FdoStatsError(
                f"FDO file {path}: stack {stack!r} lacks {missing}; the file is truncated or "
                "corrupt. Delete it and publish again."
            )
        steps = {f: int(a.shape[0]) for f, a in fields.items()}
        if len(set(steps.values())) != 1:
            raise FdoStatsError(
                f"FDO file {path}: stack {stack!r} has different numbers of steps per field "
                f"({steps}); the file is truncated or corrupt. Delete it and publish again."
            )
    return stacks


class FileFdoClient(FdoClient):
    """An `FdoClient` storing one file per `publish` in `base_dir` (subclasses pick the format).

    Args:
      base_dir: directory shared by all processes (created on first publish).
      process_index: this process's index (`jax.process_index()` in a JAX job).
      retain_history: keep one row per recorded step (True), or only the running
        maximum (False, one row per stack and field).
      plan: the stacking plan the statistics are for. With it, `load` checks every
        file against the plan's stacks, topology and batch sizes (`load_for`);
        only its stacks and topology matter, not its current limits.

    A step's row is the maximum over this process's local devices of each
    statistic, per partition (`max_ids`, `max_unique_ids`), per SparseCore
    (`required_buffer_size`) or the step's count (`id_drop_counters`).
    """

    extension: str = ""

    def __init__(self, base_dir: str | os.PathLike[str], *, process_index: int = 0,
                 retain_history: bool = True, plan: StackingPlan | None = None) -> None:
        if isinstance(process_index, bool) or not isinstance(process_index, int) or process_index < 0:
            raise ValueError(f"process_index must be an integer >= 0, got {process_index!r}.")
        self.base_dir = Path(base_dir)
        self.process_index = process_index
        self.retain_history = retain_history
        self.plan = plan
        self._history: dict[str, Arrays] = {field: {} for field in FIELDS}
        self._last_time_ns = 0

    # Formats: subclasses write and read the `{key: [steps, width] int64}` mapping.
    def _write(self, file: IO[bytes], arrays: Arrays) -> None:
        raise NotImplementedError

    def _read(self, path: Path) -> Arrays:
        raise NotImplementedError

    def record(self, stats: PreprocessStats) -> None:
        rows = _rows(stats)
        known = self._history["max_ids"]
        if known and set(known) != set(rows["max_ids"]):
            raise FdoStatsError(
                f"record: statistics of stacks {sorted(rows['max_ids'])}, but this client "
                f"recorded stacks {sorted(known)}; use one client per stacking plan."
            )
        for field, per_stack in rows.items():
            history = self._history[field]
            for stack, row in per_stack.items():
                old = history.get(stack)
                if old is not None and old.shape[1] != row.shape[1]:
                    raise FdoStatsError(
                        f"record: stack {stack!r} field {field!r} has width {row.shape[1]}, "
                        f"recorded before with width {old.shape[1]} (a different topology)."
                    )
                new = row if old is None else np.vstack((old, row))
                history[stack] = new if self.retain_history else new.max(0, keepdims=True)

    def publish(self) -> Path:
        """Write the history to `fdo_stats_<process_index>_<time_ns>.<ext>` atomically."""
        arrays = {f"{stack}_{field}": self._history[field][stack]
                  for stack in self._history["max_ids"] for field in FIELDS}
        if not arrays:
            raise ValueError("publish: nothing recorded yet; call record(stats) first.")
        path, self._last_time_ns = publish_file(
            self.base_dir, self.process_index, self.extension, self._last_time_ns,
            lambda f: self._write(f, arrays))
        return path

    def latest_files(self) -> list[Path]:
        """The newest file of each process in `base_dir`, by process index."""
        return latest_files(self.base_dir, self.extension)

    def load(self) -> PreprocessStats:
        """The maximum over the latest file of every process and over their steps.

        Arrays have a leading dimension of 1 (`[1, N]`, `[1, S]`): the maximum is
        also taken over devices, which differ between processes. With the client's
        `plan`, every file is checked against it first (see `load_for`).
        """
        return self._load(self.plan)

    def load_for(self, plan: StackingPlan) -> PreprocessStats:
        """`load`, every file checked against `plan` before its counts can become limits.

        Raises `FdoStatsError` naming the file, stack, field and value for a stack
        the plan lacks, widths of another topology, or counts no batch of the plan
        can produce; warns (`FdoStatsWarning`) for each stack of the plan the files
        lack, which keeps its limits in `update_preprocessing_parameters`.
        """
        return self._load(plan)

    def _load(self, plan: StackingPlan | None) -> PreprocessStats:
        files = self.latest_files()
        if not files:
            raise FileNotFoundError(
                f"No FDO statistics in {self.base_dir} (files {_PREFIX}_<process>_<time_ns>."
                f"{self.extension}); call record(stats) and publish() first."
            )
        merged: dict[str, dict[str, np.ndarray]] = {}
        for path in files:
            stacks = self._read_stacks(path)
            if plan is not None:
                check_stacks(plan, stacks, f"FDO file {path}")
            _merge_into(merged, stacks, path, files[0])
        if plan is not None:
            warn_missing(plan, merged, f"The FDO files {[p.name for p in files]} in "
                                       f"{self.base_dir}")
        return PreprocessStats(
            max_ids_per_partition={s: f["max_ids"][None] for s, f in merged.items()},
            max_unique_ids_per_partition={s: f["max_unique_ids"][None] for s, f in merged.items()},
            required_buffer_size_per_sc={
                s: f["required_buffer_size"][None] for s, f in merged.items()},
            id_drop_counters={s: int(f["id_drop_counters"].max()) for s, f in merged.items()},
        )

    def _read_stacks(self, path: Path) -> dict[str, dict[str, np.ndarray]]:
        """A file's statistics by stack and field; an unreadable file is an FdoStatsError."""
        try:
            arrays = self._read(path)
        except FdoStatsError:
            raise
        except Exception as e:  # e.g. OSError, zlib.error: name the file
            raise FdoStatsError(f"FDO file {path} cannot be read (truncated or corrupt): {e!r}. "
                                "Delete it and publish again.") from e
        return _by_stack(arrays, path)


def _merge_into(merged: dict[str, dict[str, np.ndarray]],
                stacks: Mapping[str, Mapping[str, np.ndarray]], path: Path, first: Path) -> None:
    """Fold one file's stacks into `merged` (per field, the max over steps and files).

    Files of one job hold the same stacks with the same widths; others are an
    FdoStatsError naming both files.
    """
    if merged and set(stacks) != set(merged):
        raise FdoStatsError(
            f"FDO file {path} holds stacks {sorted(stacks)} but {first} holds "
            f"{sorted(merged)} (only in {path.name}: {sorted(set(stacks) - set(merged))}, "
            f"only in {first.name}: {sorted(set(merged) - set(stacks))}). The files come "
            "from different stacking plans; use a separate base_dir per plan."
        )
    for stack, fields in stacks.items():
        for field, value in fields.items():
            top = value.max(0)
            old = merged.setdefault(stack, {}).get(field)
            if old is not None and old.shape != top.shape:
                raise FdoStatsError(
                    f"FDO file {path}: {stack}_{field} has {top.shape[0]} columns but "
                    f"{first} has {old.shape[0]} (a different topology)."
                )
            merged[stack][field] = top if old is None else np.maximum(old, top)


def publish_file(base_dir: Path, process_index: int, extension: str, last_time_ns: int,
                 write: Callable[[IO[bytes]], None]) -> tuple[Path, int]:
    """Write `fdo_stats_<process_index>_<time_ns>.<extension>` in `base_dir` atomically.

    `time_ns` is the clock, or `last_time_ns + 1` when the clock has not moved on,
    so each publish is a newer file. Returns the path and its `time_ns`.
    """
    _check_not_a_file(base_dir)
    base_dir.mkdir(parents=True, exist_ok=True)
    stamp = max(time.time_ns(), last_time_ns + 1)
    path = base_dir / f"{_PREFIX}_{process_index}_{stamp}.{extension}"
    _write_atomically(path, write)
    return path, stamp


def _check_not_a_file(base_dir: Path) -> None:
    """FDO statistics live in a directory: a file at `base_dir` is a mistaken path."""
    if base_dir.exists() and not base_dir.is_dir():
        raise NotADirectoryError(f"FDO base_dir {base_dir} is a file, not a directory; give "
                                 "the directory the statistics files are written to.")


def latest_files(base_dir: Path, extension: str) -> list[Path]:
    """The newest `fdo_stats_<process>_<time_ns>.<extension>` of each process, by process."""
    pattern = re.compile(rf"{_PREFIX}_(\d+)_(\d+)\.{re.escape(extension)}")
    latest: dict[int, tuple[int, Path]] = {}
    _check_not_a_file(base_dir)
    if base_dir.is_dir():
        for entry in base_dir.iterdir():
            match = pattern.fullmatch(entry.name)
            if match:
                process, stamp = int(match[1]), int(match[2])
                if process not in latest or stamp > latest[process][0]:
                    latest[process] = (stamp, entry)
    return [latest[p][1] for p in sorted(latest)]


def _write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write to a hidden temporary file in the same directory, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_table(arrays: Mapping[str, np.ndarray], path: Path) -> Arrays:
    """The checked arrays of a file as `[steps, width]` int64.

    The 0.2.0 layouts are accepted too: a 0-d array (one step's drop count) is
    `[1, 1]`, a 1-d array (one step) `[1, width]`.
    """
    out: Arrays = {}
    for key, value in arrays.items():
        if value.ndim > 2 or (value.ndim == 2 and value.shape[0] < 1):
            raise FdoStatsError(
                f"FDO file {path}: {key} has shape {value.shape}; expected one row per step. "
                "The file is corrupt."
            )
        out[key] = as_rows(value).astype(np.int64, copy=False)
    return out
