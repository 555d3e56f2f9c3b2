"""`tilecore bench step` at a tiny size, and its naive step computing what the fused one does."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
from tilecore import data, ops
from tilecore_apps._devices import with_device_count
from tilecore_apps.bench._fused import OPTIMIZERS, bench_features, fused_step, projections
from tilecore_apps.bench._naive import naive_inputs, naive_optimizer, naive_step
from tilecore_apps.bench._peer import forward_bytes, update_bytes
from tilecore_apps.bench._step import _argv
from tilecore_apps.cli import main
from tilecore_apps.cli._main import build_parser

TINY = ["--batch-size", "64", "--max-vocab", "1000"]


def test_bench_step_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.json"
    status = main(["bench", "step", "--workload", "criteo26", "--optimizer", "adagrad",
                   "--repeats", "2", "--warmup", "1", "--batches", "2", "--threads", "1",
                   "--json", str(out), *TINY])
    assert status == 0
    result = json.loads(out.read_text())
    for key in ("examples_per_s", "ids_per_s", "forward_examples_per_s", "forward_ids_per_s",
                "naive_examples_per_s", "naive_forward_examples_per_s", "speedup_vs_naive",
                "forward_speedup_vs_naive", "step_ms", "forward_ms", "naive_step_ms",
                "workload", "optimizer", "devices", "backend", "naive_update"):
        assert key in result, key
    assert (result["workload"], result["optimizer"], result["devices"]) == ("criteo26",
                                                                          "adagrad", 1)
    assert result["backend"] == jax.default_backend() and result["batch_size"] == 64
    assert result["examples_per_s"] > 0 and result["naive_examples_per_s"] > 0
    assert result["speedup_vs_naive"] == pytest.approx(
        result["naive_step_ms"] / result["step_ms"])
    assert result["naive_update"].startswith("optax.adagrad")
    assert "speedup vs naive" in capsys.readouterr().out
    # Bandwidth and memory.
    assert result["copy_bandwidth_gb_s"] > 0.1 and result["forward_gb_s"] > 0
    assert result["forward_fraction_of_copy"] == pytest.approx(
        result["forward_gb_s"] / result["copy_bandwidth_gb_s"])
    # The step less the forward, floored at 1 ns where one noisy repeat (--repeats 1) timed
    # the step under the forward.
    assert result["update_ms"] == pytest.approx(
        max(result["step_ms"] - result["forward_ms"], 1e-6))
    assert result["update_fraction_of_copy"] == pytest.approx(
        result["update_gb_s"] / result["copy_bandwidth_gb_s"])
    # The timed calls' peak holds the tables and batches, and is part of the run's.
    assert 0 < result["step_peak_rss_mb"] <= result["peak_rss_mb"] + 1
    assert 0 <= result["file_rss_mb"] < result["step_peak_rss_mb"]  # the code is part of it
    # Whole 2 MiB pages of the variables (26 tables of 1,000 rows of 32 floats, one Adagrad
    # slot each) moved onto huge pages, where the kernel has them.
    moved = round(result["huge_pages_gb"] * 1e9)
    assert moved % (2 << 20) == 0 and moved <= 2 * 26 * 1000 * 32 * 4
    assert result["other_cpus"] is None or result["other_cpus"] >= 0


def test_other_processes_load_is_measured_and_said() -> None:
    """On a shared machine a busy neighbour doubled the timed calls of tilecore and FBGEMM
    alike: each run records how many CPUs other processes kept busy, and says so."""
    import subprocess
    import sys
    import time

    from tilecore_apps.bench._machine import OtherLoad
    from tilecore_apps.bench._step import _contention

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        load = OtherLoad.start()
        time.sleep(1.0)
        cpus = load.cpus()
    finally:
        busy.kill()
        busy.wait()
    assert cpus is None or cpus > 0.5  # the neighbour's loop (and whatever else runs)
    quiet = {"other_cpus": 0.05, "peer_other_cpus": None, "cpu_count": 2}
    assert _contention(quiet) == []
    said = _contention({**quiet, "peer_other_cpus": 0.9})
    assert len(said) == 1 and "0.1 while tilecore was timed, 0.9 while FBGEMM was" in said[0]


def test_bench_step_without_naive(tmp_path: Path) -> None:
    # 1 KiB of activation memory per SparseCore: each of the 8 tables gets a stack of its
    # own (the default 2 MiB stacks them into 2).
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--workload", "stacked", "--optimizer", "ftrl", "--no-naive",
                 "--repeats", "1", "--warmup", "1", "--batches", "1", "--json", str(out),
                 "--activation-mem-mb", str(1 / 1024), *TINY]) == 0
    result = json.loads(out.read_text())
    assert "naive_examples_per_s" not in result and result["ids_per_s"] > 0
    assert result["stacks"] == 8 and result["activation_mem_mb"] == 1 / 1024


def test_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "step", "--repeats", "0", *TINY]) == 2
    assert "--repeats" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "step", "--optimizer", "rmsprop"])


def test_rerun_command_line_round_trips() -> None:
    argv = ["bench", "step", "--workload", "stacked", "--optimizer", "adam", "--devices", "4",
            "--repeats", "3", "--json", "x.json", "--no-naive", "--weights-dtype", "bfloat16",
            *TINY]
    args = build_parser().parse_args(argv)
    again = build_parser().parse_args(_argv(args))
    assert vars(again) == vars(args)
    assert with_device_count("--foo --xla_force_host_platform_device_count=2", 8) == (
        "--foo --xla_force_host_platform_device_count=8")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_naive_step_computes_the_fused_step(optimizer: str) -> None:
    """With dense zero gradients SGD and Adagrad leave untouched rows alone, so the naive
    step must produce exactly the fused step's tables: the benchmark compares like with like."""
    workload = data.get_workload("criteo26", batch_size=32)
    features = bench_features(workload.features, OPTIMIZERS[optimizer](), max_vocab=300)
    plan = tc.plan_stacking(features, tc.Topology(sc_per_device=2))
    raw = {k: tc.Ragged(r.values % 300, r.row_splits) for k, r in workload.batch(0).items()}
    plan = tc.update_preprocessing_parameters(plan, tc.preprocess(
        plan.with_config(allow_id_dropping=True), raw, num_threads=1)[1])
    batch, _ = tc.preprocess(plan, raw, num_threads=1)
    weights = projections(features)
    variables = ops.init_tables(plan, jax.random.key(0))
    tables = {k: jnp.asarray(v) for k, v in
              ops.unshard(plan, {k: v.table for k, v in variables.items()}).items()}

    fused = fused_step(plan, None, weights)(variables, batch, jnp.int32(0))
    transform, _ = naive_optimizer(plan.stacks[next(iter(plan.stacks))].optimizer)
    (naive, _), = [naive_step(features, weights, transform)(
        (tables, transform.init(tables)), naive_inputs(features, [raw])[0])]
    fused_tables = ops.unshard(plan, {k: v.table for k, v in fused.items()})
    for name in naive:
        np.testing.assert_allclose(np.asarray(naive[name]), fused_tables[name], rtol=1e-5,
                                   atol=1e-7, err_msg=name)


def test_peer_python_is_checked_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """FBGEMM's CPU kernels have no Adam; a Python without torch is named with the fix."""
    assert main(["bench", "step", "--optimizer", "adam", "--peer-python", sys.executable,
                 *TINY]) == 2
    assert "no exact counterpart of 'adam'" in capsys.readouterr().err
    assert main(["bench", "step", "--weights-dtype", "bfloat16", "--peer-python",
                 sys.executable, *TINY]) == 2
    assert "do not train bfloat16" in capsys.readouterr().err
    if importlib.util.find_spec("torch") is None:
        assert main(["bench", "step", "--peer-python", sys.executable, *TINY]) == 2
        err = capsys.readouterr().err
        assert "cannot import torch and fbgemm_gpu" in err and "fbgemm-gpu-cpu" in err


PEER_PYTHON = os.environ.get("TILECORE_FBGEMM_PYTHON")


@pytest.mark.skipif(not PEER_PYTHON, reason="set TILECORE_FBGEMM_PYTHON to a Python with torch "
                    "and fbgemm-gpu-cpu to run FBGEMM beside tilecore")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bench_step_runs_fbgemm_on_the_same_batches(tmp_path: Path, dtype: str) -> None:
    out = tmp_path / "peer.json"
    assert main(["bench", "step", "--optimizer", "sgd", "--no-naive", "--repeats", "2",
                 "--warmup", "1", "--peer-python", str(PEER_PYTHON), "--json", str(out),
                 "--weights-dtype", dtype, *TINY]) == 0
    result = json.loads(out.read_text())
    assert result["peer_weights_precision"] == {"float32": "fp32", "float16": "fp16"}[dtype]
    assert result["peer_step_ms"] > 0 and result["peer_forward_ms"] > 0
    assert result["peer_step_ratio"] == pytest.approx(result["peer_step_ms"] / result["step_ms"])
    assert "fbgemm" in result["peer_versions"]
    assert 0 < result["peer_step_peak_rss_mb"] <= result["peer_peak_rss_mb"]
    assert 0 < result["peer_file_rss_mb"] < result["peer_step_peak_rss_mb"]


def test_half_precision_tables(tmp_path: Path) -> None:
    """The command on 16-bit tables (one format: the other's path differs only in the
    dtype, which test_ops_half covers op by op, and `forward_bytes` below)."""
    out = tmp_path / "half.json"
    assert main(["bench", "step", "--no-naive", "--repeats", "1", "--warmup", "1",
                 "--weights-dtype", "bfloat16", "--no-huge-pages", "--json", str(out),
                 *TINY]) == 0
    result = json.loads(out.read_text())
    assert result["weights_dtype"] == "bfloat16" and result["ids_per_s"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward_bytes(dtype: str) -> None:
    """Half the bytes per row read: the forward's bytes count 2 per value, not 4."""
    features = bench_features(data.get_workload("criteo26").features, tc.SGD(),
                              max_vocab=10, weights_dtype=dtype)
    batch = {f.name: tc.Ragged.from_rows([[0, 1]]) for f in features}
    dims = sum(f.table.embedding_dim for f in features)
    assert forward_bytes(features, [batch], 1) == 2 * 2 * dims + 4 * dims


def test_update_bytes_count_each_touched_row_once() -> None:
    """Distinct rows per table (features sharing a table share them), each read and written
    with its slots; activation gradients read once."""
    table = tc.TableSpec(name="t", vocab_size=100, embedding_dim=4, combiner="sum")
    other = tc.TableSpec(name="u", vocab_size=100, embedding_dim=8, combiner="sum")
    features = [tc.FeatureSpec(name="a", table=table, input_shape=(2, 2)),
                tc.FeatureSpec(name="b", table=table, input_shape=(2, 1)),
                tc.FeatureSpec(name="c", table=other, input_shape=(2, 2))]
    batch = {"a": tc.Ragged.from_rows([[1, 2], [2]]), "b": tc.Ragged.from_rows([[2], [3]]),
             "c": tc.Ragged.from_rows([[5, 5], [5]])}
    slots = 1  # Adagrad's accumulator
    rows = 3 * 4 * (4 + 4 * slots) + 1 * 8 * (4 + 4 * slots)  # t: rows 1, 2, 3; u: row 5
    assert update_bytes(features, [batch], 2, slots) == 2 * rows + 4 * 2 * (4 + 4 + 8)

