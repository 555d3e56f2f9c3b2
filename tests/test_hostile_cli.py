"""The commands given hostile values: each is refused at once with one line naming the flag
and its value, before the work it would spoil (or, for a peer that misbehaves, as soon as
it does), never a traceback, a hang or a machine's memory filled."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tilecore as tc
from tilecore import data
from tilecore_apps import _devices
from tilecore_apps._common import write_file
from tilecore_apps.bench import _peer, _step
from tilecore_apps.bench._fused import bench_features
from tilecore_apps.cli import main

TINY = ["--batch-size", "64", "--max-vocab", "1000"]
STEP = ["bench", "step", "--repeats", "1", "--warmup", "1", "--batches", "1", "--no-naive", *TINY]


def _script(path: Path, body: str, mode: int = 0o755) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(mode)
    return path


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's error line for `argv` (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# --- bench step --peer-python ------------------------------------------------------------


def test_peer_python_that_is_no_program_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """"" ran "." (Permission denied, naming no flag); a text file, a directory and a
    missing path each named only an errno."""
    text = _script(tmp_path / "notes.txt", "hello\n", mode=0o644)
    for value, message in (("", "must be a program to run"),
                           (str(tmp_path), f"'{tmp_path}' is a directory"),
                           (str(text), f"'{text}' is not executable"),
                           (str(tmp_path / "nope"), f"'{tmp_path / 'nope'}': no such file")):
        err = _usage_error([*STEP, "--peer-python", value], capsys)
        assert f"argument --peer-python: {message}" in err, err


def test_peer_python_that_cannot_start_or_never_imports_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both found by the probe, before anything is timed; the probe no longer waits for
    ever (the bound is named)."""
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x7fELF not really")
    garbage.chmod(0o755)
    assert main([*STEP, "--peer-python", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert f"--peer-python {garbage}: cannot run it (Exec format error)" in err, err

    monkeypatch.setattr(_peer, "PROBE_TIMEOUT_S", 0.5)
    hangs = _script(tmp_path / "hangs.sh", "sleep 30\n")  # sh's child holds the pipe too
    start = time.monotonic()
    assert main([*STEP, "--peer-python", str(hangs)]) == 2
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert f"--peer-python {hangs} did not import torch and fbgemm_gpu within 0.5 s" in err, err


def _run_peer(python: Path) -> dict:
    """`run_peer` on one tiny batch of criteo26's features (no JAX work before it)."""
    features = bench_features(data.get_workload("criteo26").features, tc.SGD(), max_vocab=10)
    batch = {f.name: tc.Ragged.from_rows([[0, 1]]) for f in features}
    return _peer.run_peer(python, features, [batch], tc.SGD(), "sgd",
                          {"warmup": 1, "repeats": 1}, seed=0)


PROBE_OK = 'if [ "$1" = "-c" ]; then exit 0; fi\n'


@pytest.mark.parametrize(("body", "message"), [
    ('echo "peer blew up" >&2\nexit 3\n', "the FBGEMM peer failed (exit 3): peer blew up"),
    ('echo "{not json" > "$3"\n', "exited 0 but its result is not JSON (Expecting property"),
    ("exit 0\n", "exited 0 but wrote no result"),
    ('echo "[1]" > "$3"\n', "its result is a JSON list, not an object"),
    ('echo \'{"forward_s": 1}\' > "$3"\n', "its result's 'step_s' is None, not a number"),
    ('echo \'{"forward_s": 0, "step_s": 1, "threads": 1, "peak_rss_mb": 1, '
     '"step_peak_rss_mb": 1, "file_rss_mb": 1, "torch_version": "2", '
     '"fbgemm_version": "1", "weights_precision": "fp32"}\' > "$3"\n',
     "its result's 'forward_s' is 0, not a time > 0"),
    ("kill -9 $$\n", "the FBGEMM peer failed (killed by signal 9)"),
])
def test_a_peer_that_fails_is_one_line_naming_it(tmp_path: Path, body: str,
                                                 message: str) -> None:
    """A failing peer was a RuntimeError (a traceback: main handles ValueError), bad JSON
    json's own message, no result a FileNotFoundError naming a temporary file."""
    peer = _script(tmp_path / "peer.sh", PROBE_OK + body)
    with pytest.raises(ValueError) as error:
        _run_peer(peer)
    assert f"bench step: --peer-python {peer}: " in str(error.value)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_peer_that_never_returns_is_stopped(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """It was waited for without end; now past its bound it is killed, with what it
    started (a shell's child holds the pipe: killing the shell alone would still hang)."""
    monkeypatch.setattr(_peer, "PEER_START_S", 0.5)
    monkeypatch.setattr(_peer, "PEER_CALL_S", 0.0)
    peer = _script(tmp_path / "peer.sh", PROBE_OK + "sleep 30\necho done\n")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"the FBGEMM peer did not finish within 0.5 s "
                                         r"\(0.5 s to start, 0 s for each of its 12 calls\)"):
        _run_peer(peer)
    assert time.monotonic() - start < 10


def test_sigterm_reaches_the_peer_and_what_it_started(tmp_path: Path) -> None:
    """The peer runs in a session of its own (so that a timeout can kill all of it): a
    SIGTERM sent to `bench step` is passed on to it, not left for it to outlive."""
    peer = _script(tmp_path / "peer.sh", "sleep 30\n")
    outer: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _: outer.append(signum))
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        start = time.monotonic()
        done = _peer._run_peer_process([str(peer)], timeout=20)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert done.returncode == -signal.SIGTERM and not outer
    assert time.monotonic() - start < 10


# --- output paths checked before the work ------------------------------------------------


def test_output_paths_of_every_command_are_checked_before_the_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench preprocess --json, limits --plot and bench scale --plot took any path: a
    directory failed once the work was done, leaving a temporary file beside it."""
    adir = tmp_path / "results"
    adir.mkdir()
    for argv in (["bench", "preprocess", "--workload", "multihot", "--json", str(adir)],
                 ["limits", "--workload", "multihot", "--plot", str(adir)],
                 ["bench", "scale", "--plot", str(adir)]):
        flag = argv[-2]
        err = _usage_error(argv, capsys)
        assert f"argument {flag}: '{adir}' is a directory; give a file name" in err, err
    assert os.listdir(tmp_path) == ["results"]


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    adir = tmp_path / "results"
    adir.mkdir()
    with pytest.raises(IsADirectoryError):
        write_file(adir, b"{}\n")
    assert os.listdir(tmp_path) == ["results"]


# --- sizes that cannot fit -----------------------------------------------------------------


def test_data_rows_that_cannot_fit_are_refused_before_anything_is_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--rows 99999999999999 grew the process ~170 MB/s until the OOM killer came: every
    format is now written batch by batch, and rows the disk cannot take are refused."""
    out = tmp_path / "d"
    assert main(["data", "--out", str(out), "--rows", "99999999999999",
                 "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "tilecore data: error: --rows 99999999999999: the parquet files would take at " \
           "least" in err, err
    assert "GiB on disk" in err and "use fewer --rows" in err and not out.exists()

    class Usage:
        free = 10 * 2**20

    monkeypatch.setattr("tilecore_apps._fits.shutil.disk_usage", lambda _: Usage())
    assert main(["data", "--out", str(out), "--rows", "1000000", "--format", "npz"]) == 2
    err = capsys.readouterr().err
    assert "--rows 1000000: the npz files would take at least 0.1 GiB on disk, more than " \
           f"the 0.0 GiB free where '{out}' is" in err, err
    assert not out.exists()


@pytest.mark.parametrize("argv", [
    ["limits", "--workload", "multihot", "--batches", "2"],
    ["bench", "preprocess", "--workload", "multihot", "--batches", "2"],
    ["bench", "step", "--no-naive", "--max-vocab", "1000", "--batches", "1"],
])
def test_batch_sizes_that_cannot_fit_are_refused_before_any_batch_is_drawn(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """numpy's bare "Unable to allocate 745. GiB" (after ~20 s at 10**9) named no flag."""
    assert main([*argv, "--batch-size", str(10**12)]) == 2
    err = capsys.readouterr().err
    assert f"--batch-size {10**12}: " in err and "GiB of memory, more than this host's" in err
    assert "use a smaller --batch-size" in err, err


# --- devices -------------------------------------------------------------------------------


def test_bench_step_topology_is_checked_before_a_child_is_started(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--devices 100000 re-ran the command with 100,000 CPU devices before the plan
    found it no power of two; 65536 (one) would have too."""
    def no_child(*_: object, **__: object) -> None:
        raise AssertionError("a child process was started")

    monkeypatch.setattr(_devices.subprocess, "Popen", no_child)
    assert main([*STEP, "--devices", "100000"]) == 2
    err = capsys.readouterr().err
    assert "bench step: --devices 100000 --sc-per-device 1: Topology: global_devices × " \
           "sc_per_device must be a power of two, got 100000 × 1 = 100000." in err, err
    assert main([*STEP, "--devices", "65536"]) == 2
    err = capsys.readouterr().err
    most = _devices.max_cpu_devices()
    assert f"--devices 65536: JAX here runs on CPU, where at most {most} devices" in err, err
    assert most == max(256, 4 * (os.cpu_count() or 1))


def test_train_with_too_many_cpu_devices_is_refused_at_once() -> None:
    """It started JAX with 65,536 CPU devices in-process: no output for minutes, memory
    growing ~70 MB/s."""
    tilecore = Path(sys.executable).with_name("tilecore")
    done = subprocess.run([str(tilecore), "train", "--devices", "65536", "--sc-per-device", "1",
                           "--batch-size", "64", "--steps", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "tilecore train: error: --devices 65536: JAX here runs on CPU, where at most" \
           in done.stderr, done.stderr


def test_train_topology_errors_name_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a power of two: the error named Topology's fields, not the flags given."""
    assert main(["train", "--devices", "100000", "--steps", "1"]) == 2
    assert "tilecore train: error: --devices 100000 --sc-per-device 4: Topology: " \
           "global_devices × sc_per_device must be a power of two" in capsys.readouterr().err


# --- bench step --minibatch-split, bench preprocess --warmup ------------------------------


def test_minibatch_split_past_what_the_buffers_take_names_the_largest(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It failed on suggested_coo_buffer_size_per_device of an auto-named stack."""
    argv = [*STEP, "--minibatching", "--minibatch-split"]
    assert main([*argv, "100"]) == 2
    err = capsys.readouterr().err
    found = re.search(r"bench step: --minibatch-split 100 leaves the limits too small to fill "
                      r"the COO buffer .* the largest --minibatch-split this workload takes is "
                      r"(\d+)\.", err)
    assert found, err
    largest = int(found[1])

    class Timed(Exception):
        """The batches were preprocessed under the plan: timing would start here."""

    def timed(*_: object, **__: object) -> None:
        raise Timed

    monkeypatch.setattr(_step, "_time_fused", timed)
    with pytest.raises(Timed):
        main([*argv, str(largest)])
    assert main([*argv, str(largest + 1)]) == 2
    assert f"takes is {largest}." in capsys.readouterr().err


def test_bench_preprocess_warmup_message_states_its_bound(
        capsys: pytest.CaptureFixture[str]) -> None:
    """It said '--warmup must be >= 1' though 0 is accepted."""
    assert main(["bench", "preprocess", "--warmup", "-1"]) == 2
    assert "bench preprocess: --warmup must be >= 0, got -1." in capsys.readouterr().err
    assert main(["bench", "preprocess", "--repeats", "0"]) == 2
    assert "bench preprocess: --repeats must be >= 1, got 0." in capsys.readouterr().err
