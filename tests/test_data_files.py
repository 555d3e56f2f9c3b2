"""Batches on disk: `.npz` and `.parquet` round trips and the errors of malformed files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tilecore as tc
from tilecore import data


def _batch(rng: np.random.Generator, weighted: bool) -> dict[str, tc.Ragged]:
    out = {}
    for name in ("clicks", "history"):
        lengths = rng.integers(0, 6, size=17)
        splits = np.concatenate([[0], np.cumsum(lengths)])
        values = rng.integers(0, 1000, size=splits[-1])
        weights = rng.random(splits[-1], dtype=np.float32) if weighted else None
        out[name] = tc.Ragged(values, splits, weights)
    return out


@pytest.mark.parametrize("suffix", [".npz", ".parquet"])
@pytest.mark.parametrize("weighted", [False, True])
def test_round_trip(tmp_path: Path, suffix: str, weighted: bool) -> None:
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    batch = _batch(np.random.default_rng(7), weighted)
    loaded = data.load_batch(data.save_batch(tmp_path / f"batch{suffix}", batch))
    assert loaded.keys() == batch.keys()
    for name, ragged in batch.items():
        np.testing.assert_array_equal(loaded[name].values, ragged.values)
        np.testing.assert_array_equal(loaded[name].row_splits, ragged.row_splits)
        if weighted:
            np.testing.assert_array_equal(loaded[name].weights, ragged.weights)
        else:
            assert loaded[name].weights is None


def test_loaded_batch_preprocesses_like_the_original(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    batch = data.criteo(batch_size=32).batch(3)
    plan = tc.plan_stacking(data.criteo(batch_size=32).features,
                            tc.Topology(global_devices=1, sc_per_device=2))
    want, _ = tc.preprocess(plan, batch)
    got, _ = tc.preprocess(plan, data.load_batch(data.save_batch(tmp_path / "b.parquet", batch)))
    for name, buffers in want.stacks.items():
        np.testing.assert_array_equal(got.stacks[name].row_pointers, buffers.row_pointers)
        np.testing.assert_array_equal(got.stacks[name].embedding_ids, buffers.embedding_ids)


@pytest.mark.parametrize("suffix", [".npz", ".parquet"])
def test_big_endian_batches_are_saved(tmp_path: Path, suffix: str) -> None:
    """A byte-swapped Ragged ('>i8' IDs and splits, '>f4' weights): .parquet failed in
    pyarrow ("Byte-swapped arrays not supported"), naming no feature."""
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    batch = _batch(np.random.default_rng(3), weighted=True)

    def swap(array: object) -> np.ndarray:
        array = np.asarray(array)
        return array.astype(array.dtype.newbyteorder(">"))

    swapped = {name: tc.Ragged(swap(r.values), swap(r.row_splits), swap(r.weights))
               for name, r in batch.items()}
    loaded = data.load_batch(data.save_batch(tmp_path / f"b{suffix}", swapped))
    for name, ragged in batch.items():
        np.testing.assert_array_equal(loaded[name].values, ragged.values)
        np.testing.assert_array_equal(loaded[name].row_splits, ragged.row_splits)
        np.testing.assert_array_equal(np.asarray(loaded[name].weights), ragged.weights)


def test_parquet_names_the_feature_it_cannot_write(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    bad = {"clicks": tc.Ragged(np.array([{"a": 1}, 2], object), np.array([0, 2]))}
    with pytest.raises(ValueError, match=r"b.parquet: save_batch cannot write feature 'clicks'"):
        data.save_batch(tmp_path / "b.parquet", bad)


def test_parquet_errors(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"f": pa.array([[1, 2], None, [3]])}), path)
    with pytest.raises(ValueError, match="'f' has 1 null rows"):
        data.load_batch(path)
    pq.write_table(pa.table({"f": pa.array([[1, 2], [3]]),
                             "f/weights": pa.array([[1.0], [2.0]])}), path)
    with pytest.raises(ValueError, match="one weight per ID"):
        data.load_batch(path)
    pq.write_table(pa.table({"g/weights": pa.array([[1.0]])}), path)
    with pytest.raises(ValueError, match=r"weight columns \['g/weights'\] have no ID column"):
        data.load_batch(path)
    path.write_text("junk")
    with pytest.raises(ValueError, match="cannot read it as a Parquet file"):
        data.load_batch(path)


def test_unknown_suffix_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown batch file type '\.csv'"):
        data.save_batch(tmp_path / "b.csv", {})
    with pytest.raises(FileNotFoundError, match="no such batch file"):
        data.load_batch(tmp_path / "absent.parquet")


def test_npz_errors(tmp_path: Path) -> None:
    """Arrays of the wrong kind and damaged archives name the file (and array): the float
    IDs reached preprocessing as a TypeError naming no file, a cut archive's zipfile error
    and a damaged member's zlib error were raw tracebacks."""
    path = tmp_path / "b.npz"
    np.savez(path, **{"f/values": np.arange(6.0), "f/row_splits": np.array([0, 2, 6])})
    with pytest.raises(ValueError, match=rf"{path}: f/values holds float64 values; it must hold "
                                         "integer IDs"):
        data.load_batch(path)
    np.savez(path, **{"f/values": np.arange(6), "f/row_splits": np.array([0.0, 2, 6])})
    with pytest.raises(ValueError, match="f/row_splits holds float64 values"):
        data.load_batch(path)
    np.savez_compressed(path, **{"f/values": np.arange(5000), "f/row_splits": np.arange(5001)})
    packed = bytearray(path.read_bytes())
    good = bytes(packed)
    packed[200:260] = bytes(b ^ 0xFF for b in packed[200:260])
    path.write_bytes(bytes(packed))
    with pytest.raises(ValueError, match=rf"{path}: the \.npz archive is damaged: its array "
                                         r"'f/values' cannot be read"):
        data.load_batch(path)
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=rf"{path}: cannot read it as an \.npz archive"):
        data.load_batch(path)
