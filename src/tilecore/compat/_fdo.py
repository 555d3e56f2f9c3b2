"""The reference's file FDO clients over tilecore's FDO files (`tilecore.fdo`).

The history, the merge and the returned shapes follow jax-tpu-embedding 0.2.0:

- `record` keeps, per statistic and table, the first value as given (as int64)
  and stacks later ones under it (`[steps, width]`); without `retain_history`
  (CSV only) a stacked history collapses to its element-wise max.
- `publish` writes `fdo_stats_<jax.process_index()>_<time_ns>.<ext>` in
  `base_dir`, keys `<table><suffix>` (suffixes from the stats fields' metadata).
- `load` reads the newest file of each process; a key of the first file is kept
  as stored, each further file's value joins it by an element-wise max over all
  rows. The loaded statistics replace the local history.

File names, latest-file selection, atomic writes and the validated formats are
tilecore's (`tilecore.fdo`). Differences from the reference: bad statistics and
hostile files (truncated, a stack missing, negative or absurd counts, widths no
topology gives, files that disagree) raise a ValueError naming the file, table
and value; `publish` creates `base_dir` and writes atomically; `base_dir` is a
local path (no `etils.epath` remote schemes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, ClassVar, cast

import numpy as np

from ..fdo._files import latest_files, publish_file
from ..fdo._formats import split_key
from ..preprocessing._observed import check_counts
from ._fdo_checks import check_file, check_same_keys, join_rows
from ._results import SparseDenseMatmulInputStats
from .lib.fdo.fdo_client import FDOClient

_LOG = logging.getLogger(__name__)
_FIELDS = dataclasses.fields(SparseDenseMatmulInputStats)
_SUFFIX = {field.name: field.metadata["suffix"] for field in _FIELDS}
_Arrays = dict[str, np.ndarray]


def process_index() -> int:
    """`jax.process_index()` when JAX is loaded; 0 otherwise (no distributed runtime)."""
    jax = sys.modules.get("jax")
    return 0 if jax is None else int(jax.process_index())


def _as_counts(value: Any, field: str, table: str) -> np.ndarray:
    """One recorded value as int64 counts (floats truncated, as the reference casts them)."""
    where = f"record: {field} of table {table!r}"
    array = np.asarray(value)
    if array.dtype.kind == "f":
        if not np.isfinite(array).all():
            raise ValueError(f"{where} holds non-finite values {array}; pass counts.")
        array = array.astype(np.int64)
    elif array.dtype.kind not in "iu":
        raise TypeError(f"{where} has dtype {array.dtype}; pass integer counts (numpy arrays "
                        "or ints, as preprocess_sparse_dense_matmul_input returns them).")
    return check_counts(array, where, "Pass the statistics that preprocessing returned.")


def _fields_of(data: Any) -> list[tuple[str, Any]]:
    """(field name, {table: value}) pairs of a stats dataclass or a mapping of its fields."""
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return [(f.name, getattr(data, f.name)) for f in dataclasses.fields(data)]
    if isinstance(data, Mapping):
        return list(data.items())
    raise TypeError(f"record: expected a SparseDenseMatmulInputStats, got {type(data).__name__}.")


class FileFDOClient(FDOClient):
    """A reference FDO client storing one file per `publish` (subclasses pick the format)."""

    _extension: ClassVar[str]
    _write: ClassVar[Callable[[IO[bytes], Mapping[str, np.ndarray]], None]]
    _read: ClassVar[Callable[[Path], _Arrays]]

    def __init__(self, base_dir: str | os.PathLike[str], retain_history: bool = True) -> None:
        if not isinstance(base_dir, str | os.PathLike):
            raise TypeError(f"base_dir must be a path (str or os.PathLike), got {base_dir!r}.")
        self._base_dir = Path(base_dir)
        self._retain_history = bool(retain_history)
        self._params: dict[str, dict[str, np.ndarray]] = {f.name: {} for f in _FIELDS}
        self._last_time_ns = 0

    def record(self, data: SparseDenseMatmulInputStats) -> None:
        """Adds each table's statistics as one more step of this process's history."""
        for name, per_table in _fields_of(data):
            if name not in self._params:
                _LOG.warning("Unsupported FDO stats: %s", name)
                continue
            if not isinstance(per_table, Mapping):
                raise TypeError(f"record: {name} must map table names to counts, "
                                f"got {type(per_table).__name__}.")
            history = self._params[name]
            for table, value in per_table.items():
                counts = _as_counts(value, name, str(table))
                old = history.get(table)
                history[table] = counts if old is None else join_rows(
                    old, counts, f"record: {name} of table {table!r}", np.vstack)
        if not self._retain_history:
            for history in self._params.values():
                for table, value in history.items():
                    if value.ndim > 1:
                        history[table] = value.max(0)

    def publish(self) -> None:
        """Writes the local history to `fdo_stats_<process>_<time_ns>.<ext>` in `base_dir`."""
        arrays = {f"{table}{_SUFFIX[name]}": value
                  for name, history in self._params.items() for table, value in history.items()}
        path, self._last_time_ns = publish_file(
            self._base_dir, process_index(), self._extension, self._last_time_ns,
            lambda file: type(self)._write(file, arrays))
        _LOG.info("Wrote FDO stats to %s", path)

    def load(self) -> SparseDenseMatmulInputStats:
        """Reads the newest file of every process and merges them by element-wise max.

        Raises:
          FileNotFoundError: no `fdo_stats_<process>_<time_ns>.<ext>` in `base_dir`.
          ValueError: a file is truncated or corrupt, or the files disagree (tables,
            widths): the message names the file, the table and the value.
        """
        files = latest_files(self._base_dir, self._extension)
        if not files:
            raise FileNotFoundError(
                f"No stats files found in {self._base_dir / f'fdo_stats*.{self._extension}'}; "
                "call record(stats) and publish() first (in every process).")
        merged: _Arrays = {}
        first_keys: set[str] | None = None
        for path in files:
            arrays = type(self)._read(path)
            check_file(arrays, path)
            if first_keys is None:
                first_keys = set(arrays)
            check_same_keys(set(arrays), path, first_keys, files[0])
            for key, value in arrays.items():
                old = merged.get(key)
                merged[key] = value if old is None else join_rows(
                    old, value, f"FDO file {path}: {key} (against {files[0].name})",
                    lambda rows: np.max(np.vstack(rows), axis=0))
        result: dict[str, dict[str, np.ndarray]] = {f.name: {} for f in _FIELDS}
        field_of = {suffix: name for name, suffix in _SUFFIX.items()}
        for key, value in merged.items():
            parts = split_key(key)
            assert parts is not None  # check_file refused other keys
            result[field_of[parts[1]]][parts[0]] = value
        self._params = result  # as the reference: the loaded statistics become the history
        return SparseDenseMatmulInputStats(**cast(dict[str, Any], result))
