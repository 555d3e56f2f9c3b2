"""`tilecore train` and its library: AUC, the prefetcher, tiny end-to-end runs."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
from tilecore import data, training
from tilecore.cli import main
from tilecore.training import _tables

TINY = ["--batch-size", "64", "--vocab-sizes", "40,300,200,60", "--sc-per-device", "2",
        "--embedding-dim", "8", "--eval-batches", "1", "--tune-batches", "1", "--threads", "1"]
JSON_KEYS = ("examples_per_s", "auc", "loss", "dropped_ids", "num_minibatches")


def brute_force_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


@pytest.mark.parametrize("levels", [None, 3, 2])  # continuous scores, and heavy ties
def test_auc_matches_brute_force(levels: int | None) -> None:
    rng = np.random.default_rng(levels or 0)
    for n in (2, 7, 200):
        labels = np.r_[0, 1, rng.integers(0, 2, n - 2)].astype(np.float32)
        scores = rng.normal(size=n) + labels
        if levels is not None:
            scores = np.round(scores * levels / 4)
        assert training.auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores))


def test_auc_edge_cases() -> None:
    assert training.auc(np.array([0, 1]), np.array([0.1, 0.9])) == 1.0
    assert training.auc(np.array([0, 1]), np.array([0.9, 0.1])) == 0.0
    assert training.auc(np.array([0, 1, 0, 1]), np.zeros(4)) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        training.auc(np.ones(3), np.arange(3.0))
    with pytest.raises(ValueError, match="NaN"):
        training.auc(np.array([0, 1]), np.array([0.0, np.nan]))


def test_log_loss_matches_definition() -> None:
    rng = np.random.default_rng(0)
    y, z = rng.integers(0, 2, 50), rng.normal(size=50) * 5
    p = 1 / (1 + np.exp(-z))
    want = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert training.log_loss(y, z) == pytest.approx(want)


@pytest.mark.parametrize(("depth", "workers"), [(0, None), (1, None), (3, None), (4, 2)])
def test_prefetcher_keeps_order(depth: int, workers: int | None) -> None:
    def produce(i: int) -> int:
        time.sleep(0.002 * ((7 * i) % 5))  # later items often finish first
        return i * i

    with training.Prefetcher(produce, 20, depth=depth, workers=workers) as items:
        assert list(items) == [i * i for i in range(20)]


def test_prefetcher_stays_within_depth_and_raises_worker_errors() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def produce(i: int) -> int:
        with lock:
            started.append(i)
        if i == 3:
            raise KeyError("bad batch 3")
        return i

    items = training.Prefetcher(produce, 100, depth=2)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad batch 3"):
        next(items)
    assert max(started) <= 4  # never more than `depth` ahead; shut down after the error
    with pytest.raises(StopIteration):
        next(items)


def test_prefetcher_closes_early_without_deadlock() -> None:
    release = threading.Event()

    def produce(i: int) -> int:
        release.wait(5)
        return i

    items = training.Prefetcher(produce, 10, depth=3)
    timer = threading.Timer(0.05, release.set)
    timer.start()
    t0 = time.perf_counter()
    items.close()  # waits only for the running items, cancels the rest
    assert time.perf_counter() - t0 < 4
    assert list(items) == []
    timer.join()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict]:
    out = tmp_path_factory.mktemp("train")
    status = main(["train", "--steps", "4", "--eval-every", "2", *TINY, "--out", str(out),
                   "--json", str(out / "result.json")])
    return status, out, json.loads((out / "result.json").read_text())


def test_tiny_run_writes_summary_plots_and_checkpoint(tiny_run: tuple[int, Path, dict]) -> None:
    status, out, result = tiny_run
    assert status == 0
    assert list(result)[:5] == list(JSON_KEYS)
    assert result["examples_per_s"] > 0 and 0 <= result["auc"] <= 1 and result["loss"] > 0
    assert result["num_minibatches"] == 4 and result["dropped_ids"] >= 0
    assert result["steps"] == 4 and result["pipelining"] is True
    assert [e["step"] for e in result["evals"]] == [2, 4] and len(result["train_losses"]) == 4
    assert result["topology"] == "1x2" and set(result["limits"]) == set(result["partition_load"])
    for png in ("loss_auc.png", "partition_load.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with np.load(out / "checkpoint" / "step_00000004.npz") as ckpt:
        assert int(ckpt["step"]) == 4
        assert ckpt["table/c01"].shape == (300, 8) and np.all(np.isfinite(ckpt["table/c01"]))
        assert ckpt["slot/c01/0"].shape == (300, 8)  # Adagrad's accumulator
        assert any(k.startswith("param/") for k in ckpt.files)


def _tiny_source() -> data.ClickDataset:
    return data.clicks(seed=0, batch_size=64, vocab_sizes=(40, 300, 200, 60), multi_hot={2: 4})


def _tiny_config(**changes: object) -> training.TrainConfig:
    base = dict(steps=4, eval_every=4, eval_batches=1, tune_batches=1,
                topology=tc.Topology(global_devices=1, sc_per_device=2),
                model=training.ModelConfig(embedding_dim=8))
    return training.TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("pipelining", [True, False])
def test_non_finite_table_stops_training_naming_step_and_table(
        pipelining: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from tilecore import ops
    from tilecore.training import _loop

    def poisoned(plan: tc.StackingPlan, seed: int, **kwargs: object) -> dict:
        variables = _tables.init_variables(plan, seed, **kwargs)  # type: ignore[arg-type]
        stack = plan.table_settings["c01"].stack_name
        table = ops.unshard(plan, {s: v.table for s, v in variables.items()})
        table["c01"][:] = np.nan  # a fault in one table only
        sharded = ops.shard(plan, table)
        return {s: ops.EmbeddingVariables(jnp.asarray(sharded[s]), v.slots) if s == stack else v
                for s, v in variables.items()}

    monkeypatch.setattr(_loop, "init_variables", poisoned)
    with pytest.raises(training.NonFiniteLossError,
                       match=r"at step 0: the loss is nan; the activations of table\(s\) \['c01'\]"):
        training.train(_tiny_source(), _tiny_config(pipelining=pipelining), progress=io.StringIO())


def test_diverging_dense_model_stops_training_naming_the_step() -> None:
    config = _tiny_config(table_optimizer=tc.SGD(learning_rate=1e30), steps=6)
    with pytest.raises(training.NonFiniteLossError, match=r"stopped at step [1-5]: the loss"):
        training.train(_tiny_source(), config, progress=io.StringIO())


def test_checkpoint_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = training.train(_tiny_source(), _tiny_config(steps=2, eval_every=2,
                                                         checkpoint_dir=tmp_path))
    path = Path(str(result.summary.checkpoint))
    before = path.read_bytes()

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        training.save_checkpoint(tmp_path, result.plan, result.state, step=2)
    assert path.read_bytes() == before  # the earlier checkpoint is intact


def test_train_from_files(tmp_path: Path) -> None:
    root = data.write_click_files(tmp_path / "clicks", _tiny_source(), train_batches=2,
                                  eval_batches=1)
    out = tmp_path / "out"
    args = ["train", "--data", str(root), "--steps", "3", "--eval-every", "3", "--sc-per-device",
            "2", "--embedding-dim", "8", "--eval-batches", "1", "--tune-batches", "2",
            "--no-pipelining", "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "summary.json").read_text())
    assert result["steps"] == 3 and result["pipelining"] is False and result["batch_size"] == 64
    assert main([*args, "--batch-size", "64"]) == 2  # --data fixes the batch size


def test_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--steps", "0"]) == 2
    assert main(["train", "--topology", "2x4", "--devices", "1"]) == 2
    err = capsys.readouterr().err
    assert "--steps must be >= 1" in err and "contradicts --topology" in err


def test_two_devices_in_a_subprocess(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = "import sys; from tilecore.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["train", "--devices", "2", "--steps", "3", "--eval-every", "3", *TINY,
            "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["devices"] == 2 and result["topology"] == "2x2"
    assert "running again" not in proc.stdout  # the flag was set before JAX started
    assert np.isfinite(result["loss"]) and result["num_minibatches"] == 3


def test_profile_writes_a_trace(tmp_path: Path) -> None:
    result = training.train(_tiny_source(), _tiny_config(steps=2, eval_every=2,
                                                         profile_dir=tmp_path / "trace"))
    assert result.summary.steps == 2
    traces = list(itertools.chain((tmp_path / "trace").rglob("*.xplane.pb")))
    assert traces and traces[0].stat().st_size > 0
