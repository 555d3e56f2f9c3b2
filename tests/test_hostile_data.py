"""Hostile click data: each case is refused with an error naming the file (and the key, row
or value), never a raw pyarrow, json, OSError, KeyError or RecursionError, and never read
in silence.

Found by a hunt over the data readers: `.npz` labels of 7 trained without a word, a
float step recursed until Python gave up, a boolean Parquet label (documented) failed
inside pyarrow, an empty held-out file was called the training file, and damaged
Parquet files or their `tilecore.clicks` metadata failed wherever pyarrow or json did.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tilecore import data

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

GOOD_LINE = "\t".join(["1"] + ["5"] * 13 + ["a1b2"] * 26) + "\n"


def options(**kw: Any) -> data.ReadOptions:
    return data.ReadOptions(**{"batch_size": 4, "held_out_batches": 0, "progress": False, **kw})


def table(**columns: Any) -> Any:
    return pa.table({"label": pa.array([0, 1] * 4), "d0": pa.array(np.arange(8.0)),
                     "s": pa.array([1] * 8), **columns})


def refused(call: Callable[[], object], *parts: str) -> str:
    """The message of the tilecore ValueError `call` raises; it holds every one of `parts`."""
    with pytest.raises(ValueError) as info:
        call()
    assert not isinstance(info.value, pa.ArrowException), repr(info.value)
    message = str(info.value)
    assert all(part in message for part in parts), message
    return message


# --- .npz click files ---------------------------------------------------------------------

@pytest.fixture
def click_files(tmp_path: Path) -> Path:
    ds = data.clicks(seed=1, batch_size=8, vocab_sizes=(10, 10), multi_hot={}, num_dense=2)
    return data.write_click_files(tmp_path / "c", ds, train_batches=1, eval_batches=1)


def _rewrite(root: Path, **arrays: np.ndarray) -> Path:
    path = root / "train" / "00000.npz"
    np.savez(path, **{**dict(np.load(path)), **arrays})
    return path


@pytest.mark.parametrize(("array", "value", "shown"), [
    ("labels", 7.0, "labels[0] is 7.0: the label must be 0 or 1 (8 of 8"),
    ("labels", np.nan, "labels[0] is nan: the label must be 0 or 1"),
    ("dense", np.inf, "dense[0, 0] is inf: dense values must be finite"),
    ("dense", 1e300, "dense[0, 0] is 1e+300: dense values must be finite numbers (within "
                     "float32's range)"),
])
def test_click_files_refuse_labels_and_dense_values_the_stream_readers_refuse(
        click_files: Path, array: str, value: float, shown: str) -> None:
    """Labels of 7 trained in silence; NaN or inf came out later as "diverged"."""
    old = np.load(click_files / "train" / "00000.npz")[array]
    path = _rewrite(click_files, **{array: np.full_like(old, value, dtype=np.float64)})
    refused(lambda: data.open_click_data(click_files).train_batch(0), str(path), shown)


@pytest.mark.parametrize(("arrays", "shown"), [
    ({"c00/values": np.array([3, 11, 2, 0, 1, 4, 5, 6])},
     "feature 'c00' has ID 11 at position 1, outside [0, 10) (clicks.json; 1 IDs are)"),
    ({"c00/values": np.array([3, -1, 2, 0, 1, 4, 5, 6])}, "has ID -1 at position 1"),
    ({"c00/row_splits": np.array([0, 1, 2, 5, 3, 5, 6, 7, 8])},
     "Feature 'c00': row_splits decrease at row 3 (5 > 3)"),
    ({"c00/row_splits": np.array([0, 1, 2, 3, 4, 5, 6, 7, 9])},
     "Feature 'c00': row_splits must start at 0 and end at len(values)=8, got 0 … 9"),
    ({"c00/values": np.zeros((4, 2), np.int64)}, "c00/values (4, 2) must be 1-D"),
    ({"c00/weights": np.ones(3)}, "c00/weights (3,) must hold one weight per value, (8,)"),
])
def test_click_files_refuse_ids_and_rows_that_preprocessing_would_name_without_the_file(
        click_files: Path, arrays: dict[str, np.ndarray], shown: str) -> None:
    """IDs outside the vocabulary and row splits that fall or overrun loaded without a
    word: preprocessing refused them later, naming the feature but not the file."""
    path = _rewrite(click_files, **arrays)
    refused(lambda: data.open_click_data(click_files).train_batch(0), str(path), shown)


def test_click_files_take_boolean_and_integer_labels(click_files: Path) -> None:
    labels = np.array([True, False] * 4)
    _rewrite(click_files, labels=labels)
    assert data.open_click_data(click_files).train_batch(0).labels.tolist() == [1, 0] * 4
    path = _rewrite(click_files, labels=np.array(["x"] * 8))
    refused(lambda: data.open_click_data(click_files).train_batch(0), str(path),
            "labels holds <U1 values; it needs numbers")


@pytest.mark.parametrize(("edit", "shown"), [
    (lambda s: s.pop("features"), "missing keys ['features']"),
    (lambda s: s["features"][0].update(bogus=1), "features[0]: unknown keys ['bogus']"),
    (lambda s: s.update(batch_size="x"), "batch_size must be an integer >= 1, got 'x'"),
    (lambda s: s["features"][0].update(vocab_size="5"),
     "features[0].vocab_size must be an integer in [1, "),
    (lambda s: s["features"][1].update(max_ids=0), "features[1].max_ids must be an integer >= 1"),
    (lambda s: s["features"].append(s["features"][0]), "features ['c00'] come more than once"),
    (lambda s: s.update(num_dense=-1), "num_dense must be an integer >= 1, got -1"),
])
def test_a_bad_clicks_json_names_the_file_and_key(click_files: Path,
                                                  edit: Callable[[dict[str, Any]], object],
                                                  shown: str) -> None:
    path = click_files / "clicks.json"
    schema = json.loads(path.read_text())
    edit(schema)
    path.write_text(json.dumps(schema))
    refused(lambda: data.open_click_data(click_files), str(path), shown)
    path.write_text("{oops")
    refused(lambda: data.open_click_data(click_files), str(path), "not valid JSON")
    path.write_text("[" * 100_000)  # json recurses
    refused(lambda: data.open_click_data(click_files), str(path), "not valid JSON")


# --- streamed sources (TSV here; Parquet is the same class) -------------------------------

def test_a_streamed_batch_index_is_an_integer(tmp_path: Path) -> None:
    """train_batch(1.5) recursed until RecursionError."""
    path = tmp_path / "c.tsv"
    path.write_text(GOOD_LINE * 8)
    source = data.open_click_data(path, options(held_out_batches=1))
    refused(lambda: source.train_batch(1.5),  # type: ignore[arg-type]
            f"{path}: train_batch: step must be an integer >= 0, got 1.5")
    refused(lambda: source.eval_batch(-1), "eval_batch: index must be an integer >= 0, got -1")
    assert source.train_batch(np.int64(1)).labels.tolist() == [1] * 4  # type: ignore[arg-type]


def test_an_empty_held_out_file_is_named(tmp_path: Path) -> None:
    """The error named the training file."""
    train, held = tmp_path / "train.tsv", tmp_path / "held.tsv"
    train.write_text(GOOD_LINE * 8)
    held.write_text("")
    source = data.open_click_data(train, options(held_out_batches=1, eval_path=held))
    message = refused(lambda: source.eval_batch(0), f"{held}: only 0 full batches of 4 rows")
    assert str(train) not in message
    assert source.train_batch(0).labels.tolist() == [1] * 4


@pytest.mark.parametrize(("sizes", "shown"), [
    ((2**70,), "ReadOptions: vocab_sizes[0] must be an integer in [1, 9223372036854775807], "
               f"got {2**70}"),
    ((5, True), "vocab_sizes[1] must be an integer in [1, "),
    (5, "vocab_sizes must be a tuple of sizes"),
])
def test_read_options_name_the_vocabulary_size_out_of_range(sizes: Any, shown: str) -> None:
    """2**70 was a bare OverflowError from the hash."""
    refused(lambda: data.ReadOptions(vocab_sizes=sizes), shown)


# --- Parquet ------------------------------------------------------------------------------

def test_boolean_label_and_dense_columns_are_read(tmp_path: Path) -> None:
    """Documented ("integer, boolean or float"), but failed inside pyarrow's fill_null."""
    path = tmp_path / "b.parquet"
    pq.write_table(table(label=pa.array([True, False] * 4), flag=pa.array([False, True] * 4)),
                   path)
    batch = data.open_click_data(path, options(
        columns=data.ClickColumns(dense=("d0", "flag")))).train_batch(0)
    assert batch.labels.tolist() == [1, 0, 1, 0]
    assert batch.dense[:, 1].tolist() == [0, 1, 0, 1]
    pq.write_table(table(label=pa.array([True, None] + [False] * 6)), path)
    with pytest.raises(data.BadRowError, match="row 2, column 'label': the label must be 0 or 1"):
        data.open_click_data(path, options()).train_batch(0)


def test_damaged_parquet_files_are_named(tmp_path: Path) -> None:
    """An empty second file was ArrowInvalid, a damaged page a bare OSError."""
    folder = tmp_path / "d"
    folder.mkdir()
    pq.write_table(table(), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"")
    source = data.open_click_data(folder, options())
    refused(lambda: [source.train_batch(i) for i in range(3)], str(folder / "b.parquet"),
            "cannot read it as a Parquet file (ArrowInvalid")
    damaged = tmp_path / "p.parquet"
    pq.write_table(table(), damaged)
    packed = damaged.read_bytes()
    damaged.write_bytes(packed[:8] + packed[8:].replace(b"\x00", b"\x01", 20))
    refused(lambda: data.open_click_data(damaged, options()).train_batch(0), str(damaged))
    error = data.DamagedFileError(damaged, 3, "why", unit="row")
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) and "damaged after row 3" in str(again)


@pytest.mark.parametrize(("metadata", "shown"), [
    (b"{not json", "not valid JSON (JSONDecodeError"),
    (b"[1, 2]", "must be a JSON object with keys ['label', 'dense', 'sparse'], got [1, 2]"),
    (b'{"sparse": []}', "missing keys ['label', 'dense']"),
    (b'{"label": "label", "dense": "d0", "sparse": []}', "dense must be a list of names"),
    (b'{"label": "label", "dense": ["d0"], "sparse": [{"name": "s", "vocab_size": "10"}]}',
     "sparse[0].vocab_size must be an integer in [1, "),
    (b'{"label": "label", "dense": ["d0"], "sparse": [{"name": "s", "vocab_size": 2.5}]}',
     "sparse[0].vocab_size must be an integer in [1, "),
    (b'{"label": "label", "dense": ["d0"], "sparse": [{"name": "s", "vocab_size": 5, '
     b'"max_ids": "x"}]}', "sparse[0].max_ids must be an integer >= 1, got 'x'"),
    (b'{"label": "label", "dense": ["d0"], "sparse": [{"name": "s", "vocab_size": 5, '
     b'"table": 5}]}', "sparse[0].table must be a non-empty string, got 5"),
    (b'{"label": "label", "dense": ["d0"], "sparse": [{"name": "s", "vocab": 5}]}',
     "sparse[0]: missing keys ['vocab_size']; unknown keys ['vocab']"),
])
def test_bad_tilecore_metadata_names_the_file_and_key(tmp_path: Path, metadata: bytes,
                                                      shown: str) -> None:
    path = tmp_path / "m.parquet"
    pq.write_table(table().replace_schema_metadata({b"tilecore.clicks": metadata}), path)
    refused(lambda: data.open_click_data(path, options()),
            f"{path}: metadata 'tilecore.clicks'", shown)


def test_duplicate_column_names_are_named(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_arrays(
        [pa.array([0, 1] * 4), pa.array(np.zeros(8)), pa.array([1] * 8), pa.array([2] * 8)],
        names=["label", "d0", "s", "s"]), path)
    refused(lambda: data.open_click_data(path, options()), str(path), "columns ['s'] come more "
            "than once")
