"""`tilecore train` and its library: AUC, the prefetcher, tiny end-to-end runs."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _input_worker_sources
import tilecore as tc
from _xla_flags import xla_flags
from tilecore import checkpoint, data
from tilecore_apps import dlrm as training
from tilecore_apps.cli import main
from tilecore_apps.dlrm import _tables

TINY = ["--batch-size", "64", "--vocab-sizes", "40,300,200,60", "--sc-per-device", "2",
        "--embedding-dim", "8", "--eval-batches", "1", "--tune-batches", "1", "--threads", "1"]
JSON_KEYS = ("examples_per_s", "auc", "loss", "dropped_ids", "num_minibatches",
             "minibatched_steps", "mean_minibatches")


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
    # No headroom over one tune batch: later batches exceed the limits and are split.
    status = main(["train", "--steps", "4", "--eval-every", "2", *TINY, "--headroom", "0",
                   "--out", str(out),
                   "--json", str(out / "result.json"), "--profile", str(out / "trace")])
    return status, out, json.loads((out / "result.json").read_text())


def test_tiny_run_writes_summary_plots_and_checkpoint(tiny_run: tuple[int, Path, dict]) -> None:
    status, out, result = tiny_run
    assert status == 0
    assert list(result)[:len(JSON_KEYS)] == list(JSON_KEYS)
    assert result["examples_per_s"] > 0 and 0 <= result["auc"] <= 1 and result["loss"] > 0
    # Minibatching (on by default) splits the batches over the limits: nothing is dropped.
    assert result["minibatching"] is True and result["dropped_ids"] == 0
    assert result["num_minibatches"] > 1 and 1 <= result["minibatched_steps"] <= 4
    assert 1 < result["mean_minibatches"] <= result["num_minibatches"]
    assert np.all(np.isfinite(result["train_losses"])) and np.isfinite(result["loss"])
    assert result["steps"] == 4 and result["pipelining"] is True and result["start_step"] == 0
    assert [e["step"] for e in result["evals"]] == [2, 4] and len(result["train_losses"]) == 4
    assert result["topology"] == "1x2" and set(result["limits"]) == set(result["partition_load"])
    assert 0 <= result["input_wait_fraction"] <= 1 and result["step_seconds"] > 0
    assert result["preprocess_seconds_per_batch"] > 0
    for png in ("loss_auc.png", "partition_load.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text()) == result  # --json is a copy
    directory = out / "checkpoint"
    assert result["checkpoint"] == str((directory / "4").absolute())
    assert checkpoint.available_steps(directory) == (4,)
    tables = checkpoint.export_tables(directory)
    assert tables["c01"].shape == (300, 8) and np.all(np.isfinite(tables["c01"]))
    traces = list((out / "trace").rglob("*.xplane.pb"))  # --profile
    assert traces and traces[0].stat().st_size > 0
    meta = checkpoint.read_metadata(directory)
    assert meta["step"] == 4 and meta["has_extra"]  # the dense model's state rides along


def test_cli_resume_with_other_tables_lists_the_mismatch(
        tiny_run: tuple[int, Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = tiny_run
    base = ["train", "--steps", "6", *TINY, "--out", str(out)]
    assert main([*base, "--resume", "--embedding-dim", "16"]) == 2  # TINY says 8
    err = capsys.readouterr().err
    assert "cannot resume" in err and "1 mismatch" not in err
    for name in ("c00", "c01", "c02", "c03"):
        assert f"table {name!r}: embedding_dim saved=8, expected=16" in err
    assert main(base) == 2  # without --resume or --overwrite a run must not mix with it
    err = capsys.readouterr().err
    assert f"--out {out} already holds a run (checkpoint, " in err
    assert "Continue it with --resume, start over with --overwrite" in err
    assert checkpoint.available_steps(out / "checkpoint") == (4,)


def test_runs_in_a_row_get_new_directories_and_resume_continues_the_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same command twice writes two runs; --resume then continues the newest for
    --steps more steps on another topology (converting its tables), plotting true steps."""
    from tilecore_apps.dlrm import _plots

    monkeypatch.chdir(tmp_path)
    base = ["train", "--steps", "2", "--eval-every", "2", *TINY, "--no-pipelining"]
    assert main(base) == 0 and main(base) == 0
    root = tmp_path / "tilecore-train"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "run-001", "run-002"]
    assert (root / "latest").resolve() == (root / "run-002").resolve()
    for run in ("run-001", "run-002"):
        assert checkpoint.available_steps(root / run / "checkpoint") == (2,)
    capsys.readouterr()
    plotted: list[list[list[float]]] = []
    png = _plots._png

    def capture(fig: object) -> bytes:
        plotted.append([list(line.get_xdata()) for line in fig.axes[0].lines])  # type: ignore[attr-defined]
        return png(fig)

    monkeypatch.setattr(_plots, "_png", capture)
    assert main([*base, "--resume", "--steps", "3", "--sc-per-device", "4"]) == 0  # TINY: 2
    printed = capsys.readouterr().out
    assert "resuming the newest run, tilecore-train/run-002" in printed
    assert "saved on topology 1x2; converting its tables and optimizer slots to 1x4" in printed
    assert "steps 3-5 on 1x4" in printed
    assert sorted(p.name for p in root.iterdir()) == ["latest", "run-001", "run-002"]
    result = json.loads((root / "run-002" / "summary.json").read_text())
    assert result["start_step"] == 2 and result["steps"] == 5 and result["topology"] == "1x4"
    assert len(result["train_losses"]) == 3 and [e["step"] for e in result["evals"]] == [4, 5]
    assert checkpoint.available_steps(root / "run-002" / "checkpoint") == (2, 5)
    assert checkpoint.read_metadata(root / "run-002" / "checkpoint")["topology"][
        "sc_per_device"] == 4
    assert plotted[0] == [[3, 4, 5], [4, 5]]  # per-step train loss, held-out loss


def test_child_process_command_line_reproduces_the_options() -> None:
    """With too few CPU devices, `train` runs itself again in a child process with the
    command line `_argv` rebuilds: it must parse back to the same options."""
    from tilecore_apps.cli import _train
    from tilecore_apps.cli._main import build_parser

    parser = build_parser()
    args = parser.parse_args(["train", *TINY, "--devices", "2", "--resume", "--steps", "7",
                              "--learning-rate", "0.25", "--out", "somewhere"])
    again = parser.parse_args(_train._argv(args, _train._topology(args)))
    assert again.topology == tc.Topology(global_devices=2, sc_per_device=2)
    for name in ("steps", "batch_size", "vocab_sizes", "learning_rate", "resume", "overwrite",
                 "out", "threads", "embedding_dim", "pipelining"):
        assert getattr(again, name) == getattr(args, name), name


def test_run_directories_out_resume_and_overwrite(tmp_path: Path) -> None:
    """Where a run writes: new numbered runs, --out refused when it holds a run unless
    --resume or --overwrite, and --overwrite deletes only what a run writes."""
    from tilecore_apps.cli import _runs

    root = tmp_path / "runs"
    first = _runs.resolve(None, resume=True, overwrite=False, root=root)
    assert first.path == root / "run-001" and first.start_step == 0
    assert "nothing to resume" in first.note
    second = _runs.resolve(None, resume=False, overwrite=False, root=root)
    assert second.path == root / "run-002" and (root / "latest").resolve() == second.path
    _runs.discard_if_empty(second.path)  # a failed run: gone, latest back on the one before
    assert _runs.runs(root) == [first.path] and (root / "latest").resolve() == first.path
    assert _runs.newest_run(root) is None  # no run has a checkpoint
    with pytest.raises(ValueError, match="--overwrite needs --out DIR"):
        _runs.resolve(None, resume=False, overwrite=True, root=root)

    out = tmp_path / "out"
    (out / "checkpoint" / "3").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoint, summary.json\)"
                                         r"\. Continue it with --resume, start over with "
                                         r"--overwrite"):
        _runs.resolve(out, resume=False, overwrite=False)
    again = _runs.resolve(out, resume=False, overwrite=True)
    assert again.start_step == 0 and again.note == f"overwriting {out}"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert _runs.resolve(out, resume=True, overwrite=False).start_step == 0  # nothing saved
    with pytest.raises(ValueError, match=r"notes\.txt is a file; name a directory"):
        _runs.resolve(out / "notes.txt", resume=False, overwrite=True)
    _runs.release(out)

    # Paths where a run keeps its directories or checkpoints are files.
    (tmp_path / "rootfile").write_text("x")
    with pytest.raises(ValueError, match="rootfile is a file, where tilecore train keeps its "
                                         "run directories; move it away or pass --out DIR"):
        _runs.resolve(None, resume=False, overwrite=False, root=tmp_path / "rootfile")
    (tmp_path / "ck" / "checkpoint").parent.mkdir()
    (tmp_path / "ck" / "checkpoint").write_text("x")
    with pytest.raises(ValueError, match=r"checkpoint is a file, where tilecore train keeps its "
                                         r"checkpoints; move it away"):
        _runs.resolve(tmp_path / "ck", resume=True, overwrite=False)

    # A run directory another process writes is refused (two runs mixed their files).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
         "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
         "time.sleep(120)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=r"out is in use by another tilecore train; wait "
                                             r"for it to end, or write this run elsewhere"):
            _runs.resolve(out, resume=True, overwrite=False)
    finally:
        holder.kill()
        holder.communicate()
    assert _runs.resolve(out, resume=True, overwrite=False).path == out
    _runs.release(out)


def _tiny_source() -> data.ClickDataset:
    return data.clicks(seed=0, batch_size=64, vocab_sizes=(40, 300, 200, 60), multi_hot={2: 4})


def _tiny_config(**changes: object) -> training.TrainConfig:
    base = dict(steps=4, eval_every=4, eval_batches=1, tune_batches=1,
                topology=tc.Topology(global_devices=1, sc_per_device=2),
                model=training.ModelConfig(embedding_dim=8))
    return training.TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def test_non_finite_table_stops_training_naming_step_and_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tilecore import ops
    from tilecore_apps.dlrm import _loop

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
        training.train(_tiny_source(), _tiny_config(), progress=io.StringIO())


def test_diverging_dense_model_stops_training_naming_the_step() -> None:
    config = _tiny_config(table_optimizer=tc.SGD(learning_rate=1e30), steps=6)
    with pytest.raises(training.NonFiniteLossError, match=r"stopped at step [1-5]: the loss"):
        training.train(_tiny_source(), config, progress=io.StringIO())


def _states_equal(a: tc.pipelining.TrainState, b: tc.pipelining.TrainState) -> None:
    for x, y in zip(jax.tree.leaves((a.variables, a.dense)), jax.tree.leaves((b.variables, b.dense)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[training.TrainResult, training.TrainResult, Path]:
    """5 steps straight (saving every 2), and 3 steps then resumed for 2 more."""
    config = _tiny_config(steps=5, eval_every=5, pipelining=False)
    straight_dir, split_dir = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("split")
    straight = training.train(_tiny_source(), dataclasses.replace(
        config, checkpoint_dir=straight_dir, checkpoint_every=2), progress=io.StringIO())
    training.train(_tiny_source(), dataclasses.replace(config, steps=3, eval_every=3,
                                                        checkpoint_dir=split_dir),
                   progress=io.StringIO())
    resumed = training.train(_tiny_source(), dataclasses.replace(
        config, checkpoint_dir=split_dir, resume=True), progress=io.StringIO())
    return straight, resumed, straight_dir


def test_resume_equals_training_straight(
        resumed: tuple[training.TrainResult, training.TrainResult, Path]) -> None:
    straight, again, straight_dir = resumed
    assert again.summary.start_step == 3 and len(again.summary.train_losses) == 2
    assert again.summary.train_losses == straight.summary.train_losses[3:]
    assert again.summary.auc == straight.summary.auc
    assert again.summary.minibatched_steps <= 2 and straight.summary.dropped_ids == 0
    _states_equal(again.state, straight.state)
    assert checkpoint.available_steps(straight_dir) == (4, 5)  # every 2 and the end; 2 kept
    saved = training.restore_checkpoint(straight_dir, straight.plan, straight.state.dense)
    assert saved.step == 5
    _states_equal(straight.state._replace(variables=saved.variables, dense=saved.dense),
                  straight.state)


def test_pipelined_resume_equals_training_straight(tmp_path: Path) -> None:
    """Each checkpoint ends a pipelined segment (the pipeline drains), so a run resumed
    from step 3 replays the segments of one saving at step 3: bit-identical."""
    config = _tiny_config(steps=5, eval_every=5, pipelining=True)
    straight = training.train(_tiny_source(), dataclasses.replace(
        config, checkpoint_dir=tmp_path / "straight", checkpoint_every=3), progress=io.StringIO())
    split = dataclasses.replace(config, checkpoint_dir=tmp_path / "split")
    training.train(_tiny_source(), dataclasses.replace(split, steps=3, eval_every=3),
                   progress=io.StringIO())
    again = training.train(_tiny_source(), dataclasses.replace(split, resume=True),
                           progress=io.StringIO())
    assert again.summary.start_step == 3 and again.summary.pipelining
    assert again.summary.train_losses == straight.summary.train_losses[3:]
    assert again.summary.auc == straight.summary.auc
    _states_equal(again.state, straight.state)


def test_interrupted_save_keeps_the_previous_checkpoint(
        resumed: tuple[training.TrainResult, training.TrainResult, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import orbax.checkpoint as ocp

    result = resumed[0]
    training.save_checkpoint(tmp_path, result.plan, result.state, step=5)

    async def fail(self: object, x: object, directory: object) -> None:
        raise KeyboardInterrupt  # the run is stopped while the step is being written

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", fail)
    with pytest.raises(KeyboardInterrupt):
        training.save_checkpoint(tmp_path, result.plan, result.state, step=6)
    monkeypatch.undo()
    assert training.latest_step(tmp_path) == 5  # the partial step 6 is not a checkpoint
    saved = training.restore_checkpoint(tmp_path, result.plan, result.state.dense)
    _states_equal(result.state._replace(variables=saved.variables, dense=saved.dense),
                  result.state)


def test_train_from_files(tmp_path: Path) -> None:
    root = data.write_click_files(tmp_path / "clicks", _tiny_source(), train_batches=2,
                                  eval_batches=1)
    out = tmp_path / "out"
    args = ["train", "--data", str(root), "--steps", "2", "--eval-every", "2", "--sc-per-device",
            "2", "--embedding-dim", "8", "--eval-batches", "1", "--tune-batches", "2",
            "--no-pipelining", "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "summary.json").read_text())
    assert result["steps"] == 2 and result["pipelining"] is False and result["batch_size"] == 64
    assert main([*args, "--batch-size", "64"]) == 2  # --data fixes the batch size


def test_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--topology", "2x4", "--devices", "1"]) == 2
    assert "--devices 1 contradicts --topology 2x4" in capsys.readouterr().err
    assert main(["train", "--overwrite"]) == 2  # nothing to overwrite: every run is new
    assert "--overwrite needs --out DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--resume", "--overwrite", "--out", "somewhere"])
    assert exit_info.value.code == 2
    assert "--overwrite: not allowed with argument --resume" in capsys.readouterr().err


def test_two_devices_in_a_subprocess_stop_on_ctrl_c_with_a_checkpoint(tmp_path: Path) -> None:
    """`--devices 2` runs again in a child process; Ctrl-C (SIGINT to the parent, as a
    terminal sends it) reaches the child once, which finishes the steps in flight,
    evaluates, saves a checkpoint there and says how to go on."""
    env = dict(os.environ, XLA_FLAGS=xla_flags())  # one device: `--devices 2` must re-run
    code = "import sys; from tilecore_apps.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["train", "--devices", "2", "--steps", "100000", "--eval-every", "1000", *TINY,
            "--checkpoint-every", "3", "--out", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not checkpoint.available_steps(tmp_path / "checkpoint") and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["devices"] == 2 and result["topology"] == "2x2"
    assert "running again" not in out  # the flag was set before JAX started
    assert np.isfinite(result["loss"]) and result["dropped_ids"] == 0
    assert result["minibatching"] is True and result["num_minibatches"] >= 1
    stopped = result["steps"]
    assert result["stopped_by"] == "SIGINT" and result["requested_steps"] == 100000
    assert 3 <= stopped < 100000 and result["evals"][-1]["step"] == stopped
    assert max(checkpoint.available_steps(tmp_path / "checkpoint")) == stopped
    assert (f"tilecore train: stopped by SIGINT after step {stopped}, {100000 - stopped} steps "
            f"short; its checkpoint is step {stopped}. Go on with: tilecore train --resume "
            f"--out {tmp_path} --steps {100000 - stopped}") in err
    assert "Traceback" not in err


def test_stop_signals_record_the_first_signal_and_a_second_ctrl_c_interrupts() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be set in the main thread")
    before = signal.getsignal(signal.SIGTERM)
    with training.StopSignals() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() and stop.signal is signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_without_minibatching_ids_over_the_limits_are_dropped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--steps", "4", "--eval-every", "4", *TINY, "--headroom", "0",
            "--no-minibatching", "--no-pipelining", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["minibatching"] is False and result["dropped_ids"] > 0  # same data as tiny_run
    assert (result["num_minibatches"], result["minibatched_steps"]) == (1, 0)
    assert result["mean_minibatches"] == 1.0
    assert "minibatching  off: IDs over the limits are dropped" in capsys.readouterr().out


def test_summary_text_counts_split_steps(
        resumed: tuple[training.TrainResult, training.TrainResult, Path]) -> None:
    s = resumed[0].summary
    assert (f"minibatching  on: {s.minibatched_steps} of 5 steps split, at most "
            f"{s.num_minibatches} minibatches per step (mean {s.mean_minibatches:.3f})"
            in s.format())


def _tight_plan(source: data.ClickDataset, divisor: int) -> tc.StackingPlan:
    """The tiny model's plan with limits of 1/`divisor` of what a batch needs."""
    plan = tc.plan_stacking(training.click_features(source, _tiny_config()),
                            tc.Topology(global_devices=1, sc_per_device=2))
    with warnings.catch_warnings():  # the default limits may drop: only the counts matter
        warnings.simplefilter("ignore", tc.IdDroppingWarning)
        _, stats = tc.preprocess(plan.with_config(allow_id_dropping=True),
                                 source.train_batch(0).sparse, num_threads=1)
    for name in plan.stacks:
        plan = plan.with_stack_limits(
            name,
            max_ids_per_partition=int(stats.max_ids_per_partition[name].max()) // divisor,
            max_unique_ids_per_partition=int(
                stats.max_unique_ids_per_partition[name].max()) // divisor,
            suggested_coo_buffer_size_per_device=64)  # FDO's would be bigger; it is raised
    return plan.with_config(allow_id_dropping=True)


# (limits divisor, batches): 4-5 minibatches, and 8 (batches 0 and 3 at divisor 3 have a
# row alone over a limit, which no split helps).
@pytest.mark.parametrize(("divisor", "batches"), [(2, (0, 1, 2, 3)), (3, (1, 2))])
def test_minibatching_plan_buffers_hold_split_batches(divisor: int, batches: tuple[int, ...]
                                                       ) -> None:
    source = _tiny_source()
    plan = _tight_plan(source, divisor)
    mb = training.minibatching_plan(plan)
    assert mb.config.enable_minibatching and mb.config.allow_id_dropping
    s, n = 2, 2
    for name, stack in mb.stacks.items():  # its inputs' IDs + 8-alignment of 8·N segments per SC
        ids = sum(int(np.prod(f.input_shape)) for f in plan.stack_features(name))
        want = -(-(ids + s * (7 * n * 8 + 7)) // (8 * s)) * 8 * s
        assert stack.suggested_coo_buffer_size_per_device == want
        assert stack.max_ids_per_partition == plan.stacks[name].max_ids_per_partition
        assert want < tc.coo_buffer_size_per_device(  # far below the reference's 64x maximum
            dataclasses.replace(stack, suggested_coo_buffer_size_per_device=None),
            plan.topology, enable_minibatching=True) // 4
    split = []
    strict = mb.with_config(allow_id_dropping=False)  # raises if anything would be dropped
    for i in batches:
        batch, _ = tc.preprocess(strict, source.train_batch(i).sparse, num_threads=1)
        split.append(batch.num_minibatches)
        for name, buffers in batch.stacks.items():
            used = buffers.row_pointers[:, -1]  # past the last block: the aligned end
            assert np.all(used <= mb.stacks[name].suggested_coo_buffer_size_per_device)
            np.testing.assert_array_equal(buffers.embedding_ids[0, used[0]:], 2**31 - 1)
    assert all(1 < m <= training.MAX_MINIBATCHES for m in split)
    with pytest.warns(tc.IdDroppingWarning):  # the same limits without minibatching drop IDs
        _, dropped = tc.preprocess(plan, source.train_batch(0).sparse, num_threads=1)
    assert dropped.dropped_ids > 0


def test_minibatched_buffer_size_rejects_bad_counts() -> None:
    plan = _tight_plan(_tiny_source(), 1)
    name = next(iter(plan.stacks))
    for bad in (0, 65, True):
        with pytest.raises(ValueError, match=rf"max_minibatches must be an integer in 1\.\.64.*"
                                             rf"got {bad!r}"):
            training.minibatched_buffer_size(plan, name, max_minibatches=bad)
    assert (training.minibatched_buffer_size(plan, name, max_minibatches=2)
            < training.minibatched_buffer_size(plan, name))


# Input worker processes (`--input-processes`).

def _worker_plan(source: object) -> tc.StackingPlan:
    config = _tiny_config()
    return tc.plan_stacking(training.click_features(source, config),  # type: ignore[arg-type]
                            config.topology)


def _gone(pid: int) -> bool:
    """Whether `pid` no longer exists (exited and reaped: no zombie left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_input_processes_train_like_threads() -> None:
    source = _input_worker_sources.CheckedSource(_tiny_source())  # raises if a worker has jax
    threads = training.train(source, _tiny_config(steps=5), progress=io.StringIO())
    processes = training.train(source, _tiny_config(steps=5, input_processes=2, prefetch=1),
                               progress=io.StringIO())
    assert processes.summary.train_losses == threads.summary.train_losses
    assert processes.summary.evals == threads.summary.evals
    _states_equal(processes.state, threads.state)


def test_input_processes_return_what_preprocess_returns_in_order(tmp_path: Path) -> None:
    root = data.write_click_files(tmp_path, _tiny_source(), train_batches=3, eval_batches=1)
    source = data.load_click_files(root)  # a --data source
    plan = _worker_plan(source)
    with training.ProcessBatches(source, plan, start=2, stop=7, processes=2, depth=3,
                                 num_threads=1) as batches:
        for step in range(2, 7):
            got = batches.take(step)
            want, stats = tc.preprocess(plan, source.train_batch(step).sparse)
            jax.tree.map(np.testing.assert_array_equal, dataclasses.asdict(got.stats),
                         dataclasses.asdict(stats))
            assert got.seconds > 0
            np.testing.assert_array_equal(got.dense, source.train_batch(step).dense)
            np.testing.assert_array_equal(got.labels, source.train_batch(step).labels)
            assert len(jax.tree.leaves(want)) > 2  # compared array by array
            jax.tree.map(np.testing.assert_array_equal, got.sparse, want)
        with pytest.raises(ValueError, match="expected step 7"):
            batches.take(3)


def test_input_worker_error_carries_its_traceback_and_workers_exit() -> None:
    source = _input_worker_sources.CheckedSource(_tiny_source(), fail_at=3)
    plan = _worker_plan(source)
    with training.ProcessBatches(source, plan, start=0, stop=10, processes=2, depth=2,
                                 num_threads=1) as batches:
        pids = batches.pids
        assert [batches.take(i).labels.shape for i in range(3)] == [(64,)] * 3
        with pytest.raises(ValueError, match=r"^bad batch 3$") as error:  # the input's fault:
            batches.take(3)  # raised as itself, as the threads raise it
    assert isinstance(error.value.__cause__, training.InputWorkerError)
    message = str(error.value.__cause__)
    assert "training batch 3" in message and "ValueError: bad batch 3" in message
    assert "_input_worker_sources.py" in message and "in train_batch" in message  # traceback
    assert all(_gone(pid) for pid in pids) and batches.pids == ()


def test_input_workers_stop_on_early_exit_and_ignore_ctrl_c() -> None:
    source = _input_worker_sources.CheckedSource(_tiny_source(), sleep_s=0.2)
    plan = _worker_plan(source)
    with pytest.raises(KeyboardInterrupt), training.ProcessBatches(
            source, plan, start=0, stop=100, processes=2, depth=4, num_threads=1) as batches:
        pids = batches.pids
        batches.take(0), batches.take(1)  # both workers are up (and ignore SIGINT)
        os.kill(pids[1], signal.SIGINT)  # Ctrl-C reaches the whole process group…
        batches.take(2), batches.take(3)  # …but only the main process acts on it
        t0 = time.perf_counter()
        raise KeyboardInterrupt
    assert time.perf_counter() - t0 < 3  # busy workers are killed, idle ones exit
    assert all(_gone(pid) for pid in pids)


def test_input_processes_option_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--input-processes", "-1"])
    assert "--input-processes: must be an integer >= 0, got '-1'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="input_processes must be an integer >= 0"):
        _tiny_config(input_processes=-2)


def test_too_few_devices_run_the_command_again_in_a_child(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # This process's JAX has started with fewer devices than asked for: the command runs
    # again in a child process whose XLA_FLAGS ask for them (not started here: the child
    # is replaced by a recorder), and its exit status is the command's.
    from tilecore_apps import _devices
    from tilecore_apps.cli import _train

    assert jax.device_count() < 8
    calls = []

    class Child:
        def __init__(self, args: list[str], env: dict[str, str], start_new_session: bool
                     ) -> None:
            assert start_new_session  # signals reach it through the parent, once
            calls.append((args, env))

        def wait(self) -> int:
            return 3

    monkeypatch.setattr(_devices.subprocess, "Popen", Child)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=1")
    monkeypatch.delenv(_devices.RERUN_ENV, raising=False)
    assert _train._ensure_devices(8, ["train", "--devices", "8"]) == 3
    ((args, env),) = calls
    assert args[0] == sys.executable and args[-3:] == ["train", "--devices", "8"]
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"
    assert env[_devices.RERUN_ENV] == "1"
    assert "running again" in capsys.readouterr().out
    # The child itself never runs a grandchild: it says what is wrong instead.
    monkeypatch.setenv(_devices.RERUN_ENV, "1")
    with pytest.raises(ValueError, match="--devices 8"):
        _train._ensure_devices(8, ["train", "--devices", "8"])
