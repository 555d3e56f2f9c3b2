"""Where training batches come from: staged batches, the input-only rate, `bench train`."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

import tilecore as tc
from tilecore import data
from tilecore_apps import dlrm as training
from tilecore_apps.cli import main


def _source() -> data.ClickDataset:
    return data.clicks(seed=0, batch_size=64, vocab_sizes=(40, 300, 200, 60), multi_hot={2: 4})


def _config(**changes: object) -> training.TrainConfig:
    base = dict(steps=5, eval_every=5, eval_batches=1, tune_batches=1, num_threads=1,
                topology=tc.Topology(global_devices=1, sc_per_device=2),
                model=training.ModelConfig(embedding_dim=8))
    return training.TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _spy_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps of every `train_batch` call on a click dataset, in order."""
    steps: list[int] = []
    original = data.ClickDataset.train_batch

    def spy(self: data.ClickDataset, step: int) -> data.ClickBatch:
        steps.append(step)
        return original(self, step)

    monkeypatch.setattr(data.ClickDataset, "train_batch", spy)
    return steps


def test_staged_batches_are_prepared_once_and_cycled(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _spy_steps(monkeypatch)
    result = training.train(_source(), _config(staged_batches=2), progress=io.StringIO())
    s = result.summary
    assert steps == [0, 0, 1]  # FDO's tune batch, then the 2 staged ones, never more
    assert s.input == "2 staged" and len(s.train_losses) == 5
    assert all(math.isfinite(x) for x in s.train_losses) and 0.0 < s.auc < 1.0
    assert s.train_losses[2] != s.train_losses[0]  # the same batch, after 2 updates


def test_summary_says_where_batches_came_from() -> None:
    s = training.train(_source(), _config(steps=3, eval_every=3), progress=io.StringIO()).summary
    assert s.input == "threads" and "input: threads" in s.format()
    assert s.to_json()["input"] == "threads"


@pytest.mark.parametrize("changes, message", [
    (dict(staged_batches=-1), "staged_batches must be an integer >= 0"),
    (dict(staged_batches=2, input_processes=1), "exclude each other"),
])
def test_staged_batches_are_checked(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**changes)


def test_input_rate_prepares_each_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _spy_steps(monkeypatch)
    rate = training.input_rate(_source(), _config(), batches=6)
    assert math.isfinite(rate) and rate > 0
    assert steps == [0, *range(7)]  # the tune batch, then 1 untimed + 6 timed
    with pytest.raises(ValueError, match="batches must be >= 1, got 0"):
        training.input_rate(_source(), _config(), batches=0)
    with pytest.raises(ValueError, match="stages them"):
        training.input_rate(_source(), _config(staged_batches=2), batches=2)


def test_input_rate_with_worker_processes_counts_their_bad_rows(tmp_path: Path) -> None:
    """Bad rows skipped in worker processes count in the run's source, each once (both
    workers read past the first), as when threads read them."""
    lines = data.write_sample(tmp_path, "criteo-tsv", rows=112).read_text().splitlines()
    for row in (100, 85, 51):  # in training batches 4 and 2 (16 rows, 1 held out); unread
        lines.insert(row, "bad")
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    counts = []
    for processes in (0, 2):
        source = data.open_click_data(path, data.ReadOptions(
            batch_size=16, vocab_sizes=(50,), held_out_batches=1, skip_bad_rows=True,
            progress=False))
        with pytest.warns(data.BadRowsWarning, match="line 52"):
            rate = training.input_rate(source, _config(input_processes=processes), batches=4)
        assert math.isfinite(rate) and rate > 0
        assert isinstance(source, data.StreamedClicks)
        counts.append(source.bad_rows)
    assert counts == [2, 2]


def test_bench_train_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--batch-size", "64", "--steps", "3", "--repeats", "1",
                 "--staged", "2", "--threads", "1", "--preprocess-on", "host",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["preprocess_on"] == "host"
    for key in ("train_examples_per_s", "staged_examples_per_s", "input_examples_per_s"):
        assert math.isfinite(result[key]) and result[key] > 0
    assert result["train_over_staged"] == pytest.approx(
        result["train_examples_per_s"] / result["staged_examples_per_s"])
    assert isinstance(result["host_bound"], bool) and result["backend"] == "cpu"
    assert {k: len(v) for k, v in result["runs"].items()} == {"input": 1, "staged": 1, "train": 1}
    assert "device ceiling" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--steps", "2"], "--steps must be >= 3"),
    (["--staged", "0"], "--staged must be >= 1"),
    (["--input-processes", "-1"], "--input-processes must be >= 0"),
])
def test_bench_train_checks_its_options(argv: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_device_preprocessing_trains_like_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """`preprocess_on="device"` packs the same bits: the same losses and AUC, step by step."""
    from tilecore.ops import _device_preprocessing

    calls = []
    original = _device_preprocessing.preprocess_on_device

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_device_preprocessing, "preprocess_on_device", spy)
    summaries = {
        on: training.train(_source(), _config(steps=3, eval_every=3, minibatching=False,
                                              preprocess_on=on), progress=io.StringIO()).summary
        for on in ("host", "device")}
    host, device = summaries["host"], summaries["device"]
    assert len(calls) == 3 + 1  # the training batches, and the evaluation's held-out one
    assert len(host.train_losses) == 3 and device.train_losses == host.train_losses
    assert (device.loss, device.auc, device.dropped_ids) == (host.loss, host.auc, host.dropped_ids)
    with pytest.raises(ValueError, match="without minibatching"):
        _config(preprocess_on="device")
