"""`tilecore bench scale` at a tiny size: JSON and PNG, the memory budget, bad options."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax
import pytest

from tilecore_apps.bench import _scale
from tilecore_apps.cli import main

# 32 samples a batch; IDs per batch are multiples of it. 10 MB holds vocab 1,000 (dim 32,
# Adagrad: 0.26 MB) but not 100,000 (25.6 MB).
TINY = ["--batch-size", "32", "--repeats", "1", "--warmup", "1", "--batches", "1",
        "--threads", "1"]


def test_bench_scale_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[tuple[int, int]] = []
    measure = _scale._measure

    def spy(vocab: int, ids: int, args: argparse.Namespace) -> dict[str, Any]:
        measured.append((vocab, ids))
        return measure(vocab, ids, args)

    monkeypatch.setattr(_scale, "_measure", spy)
    out, png = tmp_path / "scale.json", tmp_path / "plots" / "scale.png"
    assert main(["bench", "scale", "--vocab-sizes", "100000,1000,100", "--vocab-sweep-ids",
                 "128", "--ids-per-batch", "64,128", "--ids-sweep-vocab", "1000",
                 "--memory-limit-gb", "0.01", "--json", str(out), "--plot", str(png),
                 *TINY]) == 0
    # Vocab 100,000 is over the budget: never measured. (1000, 128) is in both sweeps: once.
    assert measured == [(100, 128), (1000, 128), (1000, 64)]
    result = json.loads(out.read_text())
    for key in ("optimizer", "backend", "device_kind", "cpu_model", "batch_size", "dim",
                "memory_limit_gb", "memory_limit_source", "vocab_sweep", "ids_sweep",
                "tilecore_version", "jax_version"):
        assert key in result, key
    assert result["backend"] == jax.default_backend() and result["optimizer"] == "adagrad"
    assert result["memory_limit_gb"] == pytest.approx(0.01)
    vocab = result["vocab_sweep"]
    assert [p["vocab_size"] for p in vocab["points"]] == [100, 1000]
    assert vocab["skipped_vocab_sizes"] == [100_000]
    assert "stopped before vocab 100,000" in vocab["stopped"]
    ids = result["ids_sweep"]
    assert ids["vocab_size"] == 1000
    assert [p["ids_per_batch"] for p in ids["points"]] == [64, 128]
    for point in vocab["points"] + ids["points"]:
        for key in ("step_ms", "ids_per_s", "ns_per_id", "variable_bytes",
                    "unique_ids_per_batch", "ids_per_sample", "dropped_ids", "peak_rss_mb"):
            assert key in point, key
        assert point["step_ms"] > 0 and point["dropped_ids"] == 0
        assert point["ids_per_s"] == pytest.approx(point["ids_per_batch"] / point["step_ms"] * 1e3)
        assert point["ns_per_id"] == pytest.approx(1e9 / point["ids_per_s"])
    # Table and Adagrad accumulator, float32, rows padded to multiples of 8.
    assert vocab["points"][0]["variable_bytes"] == 2 * 104 * 32 * 4
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "vocabulary sweep, 128 IDs per batch" in printed and "stopped before" in printed


def test_budget_below_every_vocabulary_allocates_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("measured a vocabulary over the budget")

    monkeypatch.setattr(_scale, "_measure", fail)
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    assert main(["bench", "scale", "--sweep", "vocab", "--vocab-sizes", "1000,10000000000",
                 "--vocab-sweep-ids", "32", "--memory-limit-gb", "0.0001", "--json", str(out),
                 "--plot", str(png), *TINY]) == 0
    vocab = json.loads(out.read_text())["vocab_sweep"]
    assert vocab["points"] == [] and vocab["skipped_vocab_sizes"] == [1000, 10**10]
    assert json.loads(out.read_text())["ids_sweep"] is None
    assert png.stat().st_size > 0
    assert "stopped before vocab 1,000" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--vocab-sizes", ""], "--vocab-sizes: must be integers >= 1"),
    (["--vocab-sizes", "1000,0"], "--vocab-sizes: must be integers >= 1"),
    (["--ids-per-batch", "1e3"], "--ids-per-batch: must be integers >= 1"),
    (["--memory-limit-gb", "0"], "--memory-limit-gb: must be a number > 0"),
    (["--repeats", "0"], "--repeats: must be an integer >= 1"),
    (["--batch-size", "-4"], "--batch-size: must be an integer >= 1"),
])
def test_bad_values_are_usage_errors(flags: list[str], message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "scale", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_inconsistent_options_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scale", "--batch-size", "32", "--ids-per-batch", "64,100"]) == 2
    err = capsys.readouterr().err
    assert "--ids-per-batch 100 is not a multiple of --batch-size 32" in err and "96" in err
    assert main(["bench", "scale", "--sweep", "ids", "--ids-sweep-vocab", "1000000",
                 "--memory-limit-gb", "0.01"]) == 2
    assert "--ids-sweep-vocab 1000000 needs 0.256 GB" in capsys.readouterr().err


def test_default_budget_is_half_the_free_memory() -> None:
    budget, source = _scale._budget(None)
    assert budget > 0 and source.startswith("50% of")
