"""Batches of ragged IDs on disk: one `.npz` or `.parquet` file per batch.

Both formats hold, per feature, the IDs of every sample and optional per-ID
weights, and load into `Ragged` values that `tilecore.preprocess` takes as they
are. In `.npz` the arrays are `<feature>/values`, `<feature>/row_splits` and
optionally `<feature>/weights`; a click batch (what `tilecore train` reads, see
`write_click_files`) adds `dense` (`[B, D]` float32) and `labels` (`[B]`, 0 or
1), which `load_batch` passes over: every command reads every `.npz` batch. In Parquet every feature is a `list<int>`
column (one row per sample) and `<feature>/weights` an optional `list<float>`
column; read through `pyarrow`, imported when a Parquet file is opened.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..preprocessing import Ragged
from ..preprocessing._inputs import check_splits, native_order

_PARTS = ("values", "row_splits", "weights")
CLICK_ARRAYS = ("dense", "labels")
"""The arrays a click batch adds to the sparse features' (not features themselves)."""
# numpy parses .npy headers with `ast.literal_eval`, which CPython 3.11 cannot run in
# several threads at once ("AST constructor recursion depth mismatch"); prefetching
# threads read batch files concurrently.
_NPZ_LOCK = threading.Lock()
SUFFIXES = (".npz", ".parquet")


def npz_arrays(batch: Mapping[str, Ragged]) -> dict[str, np.ndarray]:
    """The `.npz` arrays of `batch`: `<feature>/values`, `/row_splits`, `/weights`."""
    arrays: dict[str, np.ndarray] = {}
    for name, ragged in batch.items():
        if name in CLICK_ARRAYS or "/" in name:
            raise ValueError(f"save_batch: feature name {name!r} cannot be stored in .npz: "
                             f"it may not contain '/' or be one of {CLICK_ARRAYS}; rename it.")
        arrays[f"{name}/values"] = np.asarray(ragged.values)
        arrays[f"{name}/row_splits"] = np.asarray(ragged.row_splits)
        if ragged.weights is not None:
            arrays[f"{name}/weights"] = np.asarray(ragged.weights)
    return arrays


def save_batch(path: str | os.PathLike[str], batch: Mapping[str, Ragged]) -> Path:
    """Write `batch` to `path` (its suffix, `.npz` or `.parquet`, picks the format)."""
    path = Path(path)
    if path.suffix == ".npz":
        np.savez(path, **npz_arrays(batch))  # pyright: ignore[reportArgumentType]
        return path
    if path.suffix == ".parquet":
        pa, pq = _pyarrow(path)
        columns: dict[str, Any] = {}
        for name, ragged in batch.items():
            columns.update(_parquet_columns(pa, path, name, ragged))
        pq.write_table(pa.table(columns), path)
        return path
    raise ValueError(f"{path}: unknown batch file type {path.suffix!r}; use one of {SUFFIXES}.")


def _parquet_columns(pa: Any, path: Path, name: str, ragged: Ragged) -> dict[str, Any]:
    """Feature `name`'s Parquet columns: its IDs and, if it has them, its weights, as
    `large_list` columns. Arrays go to pyarrow in this machine's byte order (it refuses
    byte-swapped ones, whose values are the same); what it still refuses is named by
    file and feature."""
    try:
        offsets = pa.array(_native(ragged.row_splits, np.int64))
        columns = {name: pa.LargeListArray.from_arrays(offsets, pa.array(_native(ragged.values)))}
        if ragged.weights is not None:
            columns[f"{name}/weights"] = pa.LargeListArray.from_arrays(
                offsets, pa.array(_native(ragged.weights, np.float32)))
    except (pa.ArrowException, ValueError, TypeError) as error:
        raise ValueError(f"{path}: save_batch cannot write feature {name!r} to Parquet "
                         f"({type(error).__name__}: {error}); give it a tilecore.Ragged of "
                         "integer IDs, int64 row splits and float weights.") from None
    return columns


def _native(values: Any, dtype: Any = None) -> np.ndarray:
    """`values` as a numpy array (of `dtype`, if given) in this machine's byte order."""
    return native_order(np.asarray(values, dtype))


def load_batch(path: str | os.PathLike[str]) -> dict[str, Ragged]:
    """Read one batch written by `save_batch` (or by hand in the same layout)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such batch file.")
    if path.suffix == ".npz":
        return _load_npz(path)
    if path.suffix == ".parquet":
        return _load_parquet(path)
    raise ValueError(f"{path}: unknown batch file type {path.suffix!r}; use one of {SUFFIXES}.")


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of the `.npz` archive at `path` (safe to call from several threads)."""
    # A truncated or damaged archive fails in zipfile or zlib, while opening or reading a
    # member. The file is opened here, so that it is closed whatever fails (np.load leaves
    # its own file open when the archive's directory cannot be read).
    damaged = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
    with _NPZ_LOCK, contextlib.ExitStack() as stack:
        try:
            archive = np.load(stack.enter_context(open(path, "rb")), allow_pickle=False)
        except damaged as error:
            raise ValueError(f"{path}: cannot read it as an .npz archive ({error}).") from None
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise ValueError(f"{path}: holds one array, not an .npz archive; save the batch "
                             "with tilecore.data.save_batch or np.savez(path, "
                             "**{'<feature>/values': ..., '<feature>/row_splits': ...}).")
        stack.enter_context(archive)
        arrays: dict[str, np.ndarray] = {}
        key = ""
        try:
            for key in archive:
                arrays[key] = archive[key]
        except damaged as error:
            raise ValueError(f"{path}: the .npz archive is damaged: its array {key!r} cannot "
                             f"be read ({type(error).__name__}: {error}).") from None
        return arrays


def _load_npz(path: Path) -> dict[str, Ragged]:
    return ragged_from_npz(path, read_npz(path))


def ragged_from_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> dict[str, Ragged]:
    """The features of an `.npz` batch's `arrays` (`dense` and `labels` passed over)."""
    arrays = {k: v for k, v in arrays.items() if k not in CLICK_ARRAYS}
    legacy = [k for k in arrays if k.endswith((".values", ".row_splits"))]
    if legacy and len(legacy) == len(arrays):  # the earlier click-file layout, <feature>.values
        arrays = {k.rpartition(".")[0] + "/" + k.rpartition(".")[2]: v for k, v in arrays.items()}
    bad = [k for k in arrays if k.rpartition("/")[2] not in _PARTS or not k.rpartition("/")[0]]
    if bad:
        raise ValueError(f"{path}: array names must be <feature>/values, <feature>/row_splits "
                         f"or <feature>/weights; got {sorted(bad)}.")
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        feature, _, part = key.rpartition("/")
        parts.setdefault(feature, {})[part] = value
    incomplete = sorted(f for f, p in parts.items() if not {"values", "row_splits"} <= p.keys())
    if incomplete:
        raise ValueError(f"{path}: features {incomplete} need both <feature>/values and "
                         "<feature>/row_splits.")
    for feature, p in parts.items():
        for part, kinds, what in (("values", "iu", "integer IDs"), ("row_splits", "iu", "integers"),
                                  ("weights", "iuf", "real numbers")):
            if part in p and p[part].dtype.kind not in kinds:
                raise ValueError(f"{path}: {feature}/{part} holds {p[part].dtype} values; it must "
                                 f"hold {what}.")
    for feature, p in parts.items():
        _check_rows(path, feature, p["values"], p["row_splits"], p.get("weights"))
    return {f: Ragged(p["values"], p["row_splits"], p.get("weights")) for f, p in parts.items()}


def _check_rows(path: Path, feature: str, values: np.ndarray, splits: np.ndarray,
                weights: np.ndarray | None) -> None:
    """A feature's arrays make rows: 1-D values, row splits as preprocessing holds them
    (`check_splits`), weights (if any) one per value. Named here, by file, rather than by
    preprocessing later, by feature alone."""
    if values.ndim != 1:
        raise ValueError(f"{path}: {feature}/values {values.shape} must be 1-D.")
    try:
        check_splits(feature, splits, len(values))
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    if weights is not None and weights.shape != values.shape:
        raise ValueError(f"{path}: {feature}/weights {weights.shape} must hold one weight per "
                         f"value, {values.shape}.")


def _load_parquet(path: Path) -> dict[str, Ragged]:
    pa, pq = _pyarrow(path)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        raise ValueError(f"{path}: cannot read it as a Parquet file ({error}).") from None
    columns = {name: table.column(name).combine_chunks() for name in table.column_names}
    out: dict[str, Ragged] = {}
    for name, column in columns.items():
        if name.endswith("/weights"):
            continue
        if not pa.types.is_list(column.type) and not pa.types.is_large_list(column.type):
            raise ValueError(f"{path}: column {name!r} must be a list of integer IDs per "
                             f"sample, got type {column.type}.")
        if column.null_count:
            raise ValueError(f"{path}: column {name!r} has {column.null_count} null rows; "
                             "write an empty list for a sample without IDs.")
        weights = columns.get(f"{name}/weights")
        w = None
        if weights is not None:
            if not np.array_equal(_offsets(weights), _offsets(column)):
                raise ValueError(f"{path}: column {name}/weights does not have one weight per "
                                 f"ID of column {name!r}.")
            w = _flat(weights)
        out[name] = Ragged(_flat(column), _offsets(column), w)
    orphans = sorted(n for n in columns if n.endswith("/weights") and n[:-8] not in out)
    if orphans:
        raise ValueError(f"{path}: weight columns {orphans} have no ID column.")
    return out


def _offsets(column: Any) -> np.ndarray:
    offsets = column.offsets.to_numpy()
    return offsets - offsets[0]


def _flat(column: Any) -> np.ndarray:
    return column.flatten().to_numpy(zero_copy_only=False)


def _pyarrow(path: Path) -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow, a dependency of tilecore "
                          "that this environment lacks; install it (pip install pyarrow).") from None
    return pa, pq
