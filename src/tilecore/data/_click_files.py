"""Click batches stored as `.npz` files: a writer, and a reader with the dataset's interface.

Layout of a directory:

    clicks.json           {"features": [{"name", "vocab_size", "max_ids"}, …],
                           "num_dense": D, "batch_size": B}
    train/00000.npz, …    one batch each
    eval/00000.npz, …     held-out batches

A batch file is in the one `.npz` batch layout every command reads
(`load_batch`, `tilecore limits --data`): `<feature>/values` (int IDs) and
`<feature>/row_splits` (int64, B + 1 entries) per feature, plus `dense` (`[B, D]`
float32) and `labels` (`[B]`, 0 or 1). Files in the earlier layout
(`<feature>.values`, `<feature>.row_splits`) are still read. Training steps cycle
over the train files. A file whose labels are not 0 or 1, or whose dense values
are not finite, is refused (naming it and the value) as the stream readers refuse
such a row; `clicks.json` is checked key by key (`_schema_json`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..preprocessing import Ragged
from ._checks import DENSE_RULE, LABEL_RULE, bad_dense, bad_labels, check_index, check_integer
from ._click_specs import features_by_table
from ._clicks import ClickBatch, ClickFeature
from ._files import npz_arrays, ragged_from_npz, read_npz
from ._schema_json import feature_entries, read_json_file, read_object

SCHEMA_FILE = "clicks.json"


class ClickSource(Protocol):
    """What training needs from click data: its schema and batches by index."""

    @property
    def features(self) -> tuple[ClickFeature, ...]: ...

    @property
    def num_dense(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    def train_batch(self, step: int) -> ClickBatch: ...

    def eval_batch(self, index: int) -> ClickBatch: ...


def _write_atomic(path: Path, content: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)


def _write_batch(path: Path, batch: ClickBatch) -> None:
    for name, ragged in batch.sparse.items():
        if ragged.weights is not None:
            raise ValueError(f"write_click_files: feature {name!r} has weights; the click file "
                             "format stores IDs only.")
    arrays: dict[str, Any] = {**npz_arrays(batch.sparse), "dense": batch.dense,
                              "labels": batch.labels}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    _write_atomic(path, buffer.getvalue())


def write_click_files(directory: str | Path, source: ClickSource, *, train_batches: int,
                      eval_batches: int) -> Path:
    """Write `train_batches` training and `eval_batches` held-out batches of `source`.

    Returns the directory, which `load_click_files` reads back.
    """
    if train_batches < 1 or eval_batches < 1:
        raise ValueError(f"write_click_files: need >= 1 train and eval batch, got "
                         f"{train_batches=}, {eval_batches=}.")
    root = Path(directory)
    for split, count, get in (("train", train_batches, source.train_batch),
                              ("eval", eval_batches, source.eval_batch)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            _write_batch(root / split / f"{i:05d}.npz", get(i))
    schema = {
        "features": [dataclasses.asdict(f) for f in source.features],
        "num_dense": source.num_dense, "batch_size": source.batch_size,
    }
    _write_atomic(root / SCHEMA_FILE, (json.dumps(schema, indent=2) + "\n").encode())
    return root


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClickFiles:
    """Click batches read from a directory written by `write_click_files`."""

    directory: Path
    features: tuple[ClickFeature, ...]
    num_dense: int
    batch_size: int
    train_files: tuple[Path, ...]
    eval_files: tuple[Path, ...]

    def train_batch(self, step: int) -> ClickBatch:
        """Training batch `step`: the files in name order, cycled."""
        check_index("train_batch: step", step)
        return self._read(self.train_files[step % len(self.train_files)])

    def eval_batch(self, index: int) -> ClickBatch:
        """Held-out batch `index` (cycled over the eval files)."""
        check_index("eval_batch: index", index)
        return self._read(self.eval_files[index % len(self.eval_files)])

    def _read(self, path: Path) -> ClickBatch:
        npz = read_npz(path)
        found = ragged_from_npz(path, npz)
        missing = [key for key in ("dense", "labels") if key not in npz]
        missing += [f"{f.name}/values" for f in self.features if f.name not in found]
        if missing:
            raise ValueError(f"Click file {path}: missing arrays {missing}; it holds "
                             f"{sorted(npz)}. Write it with write_click_files.")
        sparse: dict[str, Ragged] = {f.name: found[f.name] for f in self.features}
        dense, labels = _numbers(path, npz, "dense"), _numbers(path, npz, "labels")
        b, d = self.batch_size, self.num_dense
        if dense.shape != (b, d) or labels.shape != (b,):
            raise ValueError(f"Click file {path}: dense {dense.shape} and labels {labels.shape}; "
                             f"expected {(b, d)} and {(b,)} (clicks.json).")
        for name, values, bad, rule in (("labels", labels, bad_labels(labels), LABEL_RULE),
                                        ("dense", dense, bad_dense(dense), DENSE_RULE)):
            if bad.any():
                at = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(f"Click file {path}: {name}{list(at)} is "
                                 f"{values[at].item()!r}: {rule} ({int(bad.sum())} of "
                                 f"{bad.size} values are not).")
        for f in self.features:
            if len(sparse[f.name].row_splits) != b + 1:
                raise ValueError(f"Click file {path}: feature {f.name!r} has "
                                 f"{len(sparse[f.name].row_splits) - 1} rows; expected {b}.")
            values = np.asarray(sparse[f.name].values)
            outside = np.flatnonzero((values < 0) | (values >= f.vocab_size))
            if len(outside):
                raise ValueError(f"Click file {path}: feature {f.name!r} has ID "
                                 f"{values[outside[0]]} at position {int(outside[0])}, outside "
                                 f"[0, {f.vocab_size}) (clicks.json; {len(outside)} IDs are).")
        return ClickBatch(sparse=sparse, dense=dense.astype(np.float32),
                          labels=labels.astype(np.float32))


def _numbers(path: Path, npz: dict[str, np.ndarray], name: str) -> np.ndarray:
    """The array `name` of a click file as float64 (booleans, integers and reals)."""
    values = npz[name]
    if values.dtype.kind not in "biuf":
        raise ValueError(f"Click file {path}: {name} holds {values.dtype} values; it needs "
                         "numbers.")
    return values.astype(np.float64)


def load_click_files(directory: str | Path) -> ClickFiles:
    """Open a directory of click files (see the module docstring for the layout)."""
    root = Path(directory)
    schema_path = root / SCHEMA_FILE
    if not schema_path.is_file():
        raise ValueError(f"Click data {root}: no {SCHEMA_FILE}; write the directory with "
                         "tilecore.data.write_click_files.")
    features, num_dense, batch_size = _read_schema(schema_path)
    train = tuple(sorted((root / "train").glob("*.npz")))
    evals = tuple(sorted((root / "eval").glob("*.npz")))
    if not train or not evals:
        raise ValueError(f"Click data {root}: found {len(train)} train/*.npz and {len(evals)} "
                         "eval/*.npz files; need at least one of each.")
    return ClickFiles(directory=root, features=features, num_dense=num_dense,
                      batch_size=batch_size, train_files=train, eval_files=evals)


def _read_schema(path: Path) -> tuple[tuple[ClickFeature, ...], int, int]:
    """The features, dense features and batch size that `clicks.json` at `path` holds."""
    schema = read_object(read_json_file(path), str(path), ("features", "num_dense", "batch_size"))
    entries = feature_entries(schema["features"], f"{path}: features",
                              optional=("max_ids", "exponent", "table"))
    if not entries:
        raise ValueError(f"{path}: features is empty; click data needs at least one feature.")
    features = tuple(ClickFeature(**entry) for entry in entries)
    features_by_table(features, str(path))  # names once, a shared table's sizes agree
    return (features, check_integer(f"{path}: num_dense", schema["num_dense"], 1),
            check_integer(f"{path}: batch_size", schema["batch_size"], 1))
