"""Multi-process runs: real JAX processes (gloo collectives over localhost) preprocess
their own rows and run the ops on one global mesh; the results equal a single-process
run on the global batch. The agreement's failure modes (different plans, different
batch numbers, a process gone mid-step) raise clear errors on every process, never
hang. A checkpoint of tables no process holds whole is checked on every process, and
on one. Launches: 2 processes × 2 devices (ops, minibatching, agreement, checkpoint) and
4 processes × 1 device (ops, agreement) with the default kernels (numba CPU kernels
through XLA's FFI), and 2 × 2 (ops) on the pure-XLA path; `_distributed_worker.py` is
one process.

Fast in-process tests of the same protocol (threads over an in-memory key-value
store) live in test_distributed_agreement.py.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import tilecore as tc
from _distributed_worker import MINIBATCH_LIMIT, OPS_CASE, STEPS
from _ops_cases import Run, assert_close, run_steps, unshard_state
from _xla_flags import xla_flags

WORKER = Path(__file__).with_name("_distributed_worker.py")


class Launch(NamedTuple):
    processes: int
    devices: int
    """Per process; 4 global devices in every launch."""
    parts: str
    kernels: str
    """`$TILECORE_KERNELS` of every process."""


LAUNCHES = {"2proc": Launch(2, 2, "ops,minibatching,agreement,checkpoint", "auto"),
            "4proc": Launch(4, 1, "ops,agreement", "auto"),
            "2proc-xla": Launch(2, 2, "ops", "xla")}
LAUNCH_TIMEOUT_S = 300


def _gloo_missing() -> str | None:
    jaxlib = importlib.import_module("jax._src.lib")
    if not hasattr(getattr(jaxlib, "_jax", None), "make_gloo_tcp_collectives"):
        return "this jaxlib has no gloo CPU collectives"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(launch: Launch, out: Path) -> Path:
    processes, devices, parts, kernels = launch
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", TILECORE_KERNELS=kernels,
               XLA_FLAGS=xla_flags(devices))
    port = _free_port()
    logs = [open(out / f"log-{p}.txt", "w") for p in range(processes)]  # noqa: SIM115
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(p), str(processes), str(port),
                               str(out), parts], env=env, stdout=log, stderr=subprocess.STDOUT)
             for p, log in enumerate(logs)]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:  # the safety net: never leave a worker behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    done = [(out / f"done-{p}").exists() for p in range(processes)]
    if not all(done):
        tails = "\n".join(f"--- process {p} (rc {proc.returncode}):\n"
                          + "\n".join(_useful_lines(out / f"log-{p}.txt")[-40:])
                          for p, proc in enumerate(procs))
        pytest.fail(f"{processes}-process run did not finish:\n{tails}")
    return out


def _useful_lines(path: Path) -> list[str]:
    """The log without JAX's per-line runtime chatter."""
    return [line for line in path.read_text(errors="replace").splitlines()
            if not line.startswith(("I1", "W1", "I0", "W0", "[Gloo]", "    @"))]


class Launched(NamedTuple):
    processes: int
    out: Path
    parts: str
    cpu_kernels: bool
    """Whether the ops must have run the numba CPU kernels (FFI) on every process."""


@pytest.fixture(scope="module", params=list(LAUNCHES))
def launch(request: pytest.FixtureRequest,
           made_once: Callable[[str, Callable[[Path], object]], Path]) -> Launched:
    reason = _gloo_missing()
    if reason:
        pytest.skip(reason)
    spec = LAUNCHES[request.param]
    out = made_once(f"distributed-{request.param}", lambda folder: _launch(spec, folder))
    from tilecore.ops.cpu import unavailable_reason

    return Launched(spec.processes, out, spec.parts,
                    spec.kernels != "xla" and unavailable_reason() is None)


@pytest.fixture(scope="module")
def single_process() -> Run:
    """The same steps on one process and one device, on the global batch."""
    return run_steps(OPS_CASE, 1, steps=STEPS)


def _ops(out: Path, name: str, processes: int) -> list[dict[str, np.ndarray]]:
    arrays = []
    for p in range(processes):
        with np.load(out / f"ops-{name}-{p}.npz") as data:
            arrays.append({k: data[k] for k in data.files})
    return arrays


def _check_equal_to_single_process(per_process: list[dict[str, np.ndarray]], one: Run,
                                   what: str) -> None:
    global_plan, one_plan = OPS_CASE.plan(4), OPS_CASE.plan(1)
    for step in range(STEPS):
        for feature, expected in one.activations[step].items():
            # Process p's rows follow process p-1's: concatenated, the global batch.
            got = np.concatenate([arrays[f"{step}/act/{feature}"] for arrays in per_process])
            assert_close(got, expected, f"{what}: activations of {feature} at step {step}")
        for arrays in per_process:  # every process sees the same updated tables
            after = {stack: [arrays[f"{step}/after/{stack}/{k}"]
                             for k in range(1 + len(spec.optimizer.slot_names))]
                     for stack, spec in global_plan.stacks.items()}
            got_tables = unshard_state(global_plan, after)
            want_tables = unshard_state(one_plan, one.after[step])
            for table, arrays_of_table in want_tables.items():
                for k, (x, y) in enumerate(zip(got_tables[table], arrays_of_table, strict=True)):
                    assert_close(x, y, f"{what}: {table}[{k}] after step {step}")


def test_ops_equal_single_process(launch: Launched, single_process: Run) -> None:
    """Activations and SGD / Adagrad tables and slots after every step equal one process's."""
    processes, out, _, cpu_kernels = launch
    for p, arrays in enumerate(_ops(out, "plain", processes)):
        assert bool(arrays["cpu_kernels"]) == cpu_kernels, f"process {p} ran the other kernels"
    _check_equal_to_single_process(_ops(out, "plain", processes), single_process,
                                   f"{processes} processes")


def test_minibatched_ops_equal_single_pass(launch: Launched, single_process: Run) -> None:
    """Minibatching split agreed over processes: the same minibatch count as one process
    with every device, and the results of one unlimited pass."""
    processes, out, parts, _ = launch
    if "minibatching" not in parts:
        pytest.skip("minibatching runs in the first 2-process launch only (compile time)")
    per_process = _ops(out, "minibatching", processes)
    plan = OPS_CASE.plan(4).with_config(enable_minibatching=True)
    for stack in plan.stacks:
        plan = plan.with_stack_limits(stack, max_ids_per_partition=MINIBATCH_LIMIT,
                                      max_unique_ids_per_partition=MINIBATCH_LIMIT)
    for step in range(STEPS):
        batch, _ = tc.preprocess(plan, *OPS_CASE.batch(step))
        assert int(batch.num_minibatches) > 1
        for arrays in per_process:
            assert int(arrays[f"{step}/num_minibatches"]) == int(batch.num_minibatches)
    _check_equal_to_single_process(per_process, single_process,
                                   f"{processes} processes, minibatched")


def _agreements(launch: Launched) -> list[dict[str, Any]]:
    processes, out, parts, _ = launch
    if "agreement" not in parts:
        pytest.skip("this launch runs no agreement scenarios (they do not depend on kernels)")
    return [json.loads((out / f"agreement-{p}.json").read_text()) for p in range(processes)]


def test_all_reduce_or_and_key_cleanup(launch: Launched) -> None:
    processes = launch.processes
    for seen in _agreements(launch):
        assert seen["or"] == (1 << processes) - 1
        assert seen["split"] == 1 << 63
        assert seen["own_keys_after_22_calls"] == 1  # only the last call's key is kept


def test_stats_merged_over_processes(launch: Launched) -> None:
    """Element-wise max of every process's statistics, drops summed, the same everywhere."""
    seen = [s["stats"] for s in _agreements(launch)]
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition",
                  "required_buffer_size_per_sc"):
        for stack in seen[0][f"local/{field}"]:
            want = np.max([np.asarray(s[f"local/{field}"][stack]) for s in seen], axis=0)
            for s in seen:
                np.testing.assert_array_equal(s[f"merged/{field}"][stack], want, field)
    for stack in seen[0]["local/id_drop_counters"]:
        want = sum(s["local/id_drop_counters"][stack] for s in seen)
        assert all(s["merged/id_drop_counters"][stack] == want for s in seen)
    local = [s["local/max_ids_per_partition"] for s in seen]
    assert any(local[0] != other for other in local[1:])  # the merge had work to do


def test_different_plans_raise_on_every_process(launch: Launched) -> None:
    processes = launch.processes
    last = processes - 1
    for seen in _agreements(launch):
        message = seen["plan_error"]
        assert message is not None
        assert "processes hold different plans (differing: stack 'a')" in message
        assert f"process {last} vs process 0, stack 'a': max_ids_per_partition: 100 vs 256" in (
            message)


def test_different_batch_numbers_raise_on_every_process(launch: Launched) -> None:
    for p, seen in enumerate(_agreements(launch)):
        message = seen["batch_error"]
        assert message is not None
        if p == 0:
            assert "process 0 is at batch 7, round 'required' but process 1 is at batch 8" in (
                message)
        else:
            assert f"process {p} is at batch 8, round 'required' but process 0 is at batch 7" in (
                message)


def test_process_gone_mid_step_times_out_naming_it(launch: Launched) -> None:
    """The last process exits between two calls: the others raise TimeoutError naming it
    after the agreement's 2 s timeout, not later and not never."""
    processes = launch.processes
    for seen in _agreements(launch)[:-1]:
        assert f"processes [{processes - 1}] did not reach batch 1, round 'required' within 2 s" in (
            seen["timeout_error"])
        assert 1.9 <= seen["timeout_after_s"] < 15


def test_checkpoint_of_tables_split_over_processes_is_checked(launch: Launched) -> None:
    """Saved from shards on 2 processes × 2 devices: `hashsum64` records, which the
    processes add up when saving and when reading onto shards; files of another step
    raise CheckpointCorruptError on every process, and one process with one device
    verifies and exports the intact step. An `extra` leaf saved whole (a `crc32`
    record) and read onto shards of both processes is checked too."""
    processes, out, parts, _ = launch
    if "checkpoint" not in parts:
        pytest.skip("the checkpoint runs in the first 2-process launch only")
    root = out / "checkpoint"
    for p in range(processes):
        seen = json.loads((out / f"checkpoint-{p}.json").read_text())
        assert seen["spans_processes"], f"process {p} held a whole table"
        assert seen["records"] == [["dtype", "hashsum64", "shape"]] * 2
        assert seen["restored_equal"], f"process {p} restored other values"
        assert seen["error"] is not None, f"process {p} restored swapped files"
        for part in (f"step 1 is damaged: stack 'a' (tables ['a']) table in "
                     f"{str(root / '1' / 'embeddings')!r}", "it reads as hashsum64 0x",
                     "but save recorded hashsum64 0x"):
            assert part in seen["error"], (p, part, seen["error"])
        assert seen["host_record"] == ["crc32", "dtype", "shape"]
        assert seen["host_restored_equal"], f"process {p} restored other extra values"
        assert seen["host_error"] is not None, f"process {p} restored swapped extra files"
        for part in ("step 2 is damaged: extra leaf 'host'", "its bytes changed after saving: "
                     "it reads as crc32 0x", "but save recorded crc32 0x"):
            assert part in seen["host_error"], (p, part, seen["host_error"])
        assert "processes hold different checkpoint saves (differing: step)" in (
            seen["step_error"] or ""), (p, seen["step_error"])
        assert "process 1 vs process 0, step: value: 5 vs 4" in seen["step_error"]
        assert "(differing: extra host values)" in (seen["extra_error"] or ""), seen["extra_error"]
        assert "Orbax writes process 0's" in seen["extra_error"]
        assert seen["steps_after"] == [0, 1, 2, 3], seen["steps_after"]
    from tilecore import checkpoint

    assert checkpoint.verify(root, step=0) == 0
    tables = checkpoint.export_tables(root, step=0)
    for name, want in OPS_CASE.table_values().items():
        np.testing.assert_array_equal(tables[name], want, err_msg=name)
    with pytest.raises(checkpoint.CheckpointCorruptError, match="hashsum64"):
        checkpoint.verify(root, step=1)
