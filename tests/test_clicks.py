"""The click dataset: deterministic, a learnable signal, and its .npz file round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tilecore import data
from tilecore_apps.dlrm import auc

SMALL = {"vocab_sizes": (50, 200, 300, 40), "multi_hot": {2: 4}}


def test_batches_are_deterministic_and_train_differs_from_eval() -> None:
    ds = data.clicks(seed=3, batch_size=64, **SMALL)
    a, b = ds.train_batch(5), data.clicks(seed=3, batch_size=64, **SMALL).train_batch(5)
    for name in a.sparse:
        np.testing.assert_array_equal(a.sparse[name].values, b.sparse[name].values)
        np.testing.assert_array_equal(a.sparse[name].row_splits, b.sparse[name].row_splits)
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(a.dense, ds.eval_batch(5).dense)
    assert not np.array_equal(a.dense, ds.train_batch(6).dense)


def test_shapes_ranges_and_multi_hot() -> None:
    ds = data.clicks(seed=0, batch_size=128, **SMALL)
    batch = ds.train_batch(0)
    assert batch.dense.shape == (128, 4) and batch.dense.dtype == np.float32
    assert set(np.unique(batch.labels)) <= {0.0, 1.0}
    for f in ds.features:
        r = batch.sparse[f.name]
        counts = np.diff(r.row_splits)
        assert r.num_rows == 128 and counts.min() >= 1 and counts.max() <= f.max_ids
        assert r.values.min() >= 0 and r.values.max() < f.vocab_size
    assert np.diff(batch.sparse["c02"].row_splits).max() > 1  # multi-hot
    assert np.all(np.diff(batch.sparse["c00"].row_splits) == 1)  # one-hot


def test_ids_are_skewed() -> None:
    ds = data.clicks(seed=0, batch_size=4096, vocab_sizes=(1000, 1000), multi_hot={})
    counts = np.bincount(ds.train_batch(0).sparse["c00"].values, minlength=1000)
    top = np.sort(counts)[::-1]
    assert top[:10].sum() > 0.2 * counts.sum()  # uniform would give 1 %


def test_labels_follow_the_hidden_model() -> None:
    ds = data.clicks(seed=1, batch_size=4096, **SMALL)
    batch = ds.eval_batch(0)
    truth = ds.hidden_logits(batch.sparse, batch.dense)
    assert auc(batch.labels, truth) > 0.75  # learnable: the oracle separates the classes
    p = 1 / (1 + np.exp(-truth))
    assert abs(batch.labels.mean() - p.mean()) < 0.03  # calibrated draws
    assert 0.1 < batch.labels.mean() < 0.6


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multi_hot names features"):
        data.clicks(vocab_sizes=(10, 10), multi_hot={5: 3})
    with pytest.raises(ValueError, match="vocab_size"):
        data.ClickFeature(name="x", vocab_size=0)
    with pytest.raises(ValueError, match="step must be"):
        data.clicks(**SMALL).train_batch(-1)


def test_files_round_trip(tmp_path: Path) -> None:
    ds = data.clicks(seed=2, batch_size=32, **SMALL)
    root = data.write_click_files(tmp_path / "clicks", ds, train_batches=2, eval_batches=1)
    files = data.load_click_files(root)
    assert files.features == ds.features
    assert (files.num_dense, files.batch_size) == (ds.num_dense, ds.batch_size)
    for got, want in ((files.train_batch(1), ds.train_batch(1)),
                      (files.train_batch(3), ds.train_batch(1)),  # cycled
                      (files.eval_batch(0), ds.eval_batch(0))):
        np.testing.assert_array_equal(got.labels, want.labels)
        np.testing.assert_array_equal(got.dense, want.dense)
        for name in want.sparse:
            np.testing.assert_array_equal(got.sparse[name].values, want.sparse[name].values)
            np.testing.assert_array_equal(got.sparse[name].row_splits,
                                          want.sparse[name].row_splits)


def test_files_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no clicks\.json"):
        data.load_click_files(tmp_path)
    ds = data.clicks(seed=2, batch_size=32, **SMALL)
    root = data.write_click_files(tmp_path / "c", ds, train_batches=1, eval_batches=1)
    np.savez(root / "train" / "00000.npz", dense=np.zeros((32, 4)), labels=np.zeros(32))
    with pytest.raises(ValueError, match=r"missing arrays \['c00/values'"):
        data.load_click_files(root).train_batch(0)
