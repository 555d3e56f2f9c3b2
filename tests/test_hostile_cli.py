"""The commands given hostile values: each is refused at once with one line naming the flag
and its value, before the work it would spoil (or, for a peer that misbehaves, as soon as
it does), never a traceback, a hang or a machine's memory filled."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tilecore_apps import _devices
from tilecore_apps._common import write_file
from tilecore_apps.bench import _step
from tilecore_apps.cli import main

TINY = ["--batch-size", "64", "--max-vocab", "1000"]
STEP = ["bench", "step", "--repeats", "1", "--warmup", "1", "--batches", "1", "--no-naive", *TINY]


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's error line for `argv` (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


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
    """--rows 99999999999999 grew the process ~170 MB/s until the OOM killer came."""
    out = tmp_path / "d"
    assert main(["data", "--out", str(out), "--rows", "99999999999999",
                 "--format", "parquet"]) == 2
    err = capsys.readouterr().err
    assert "tilecore data: error: --rows 99999999999999: the parquet rows" in err, err
    assert "GiB of memory, more than this host's memory and swap" in err
    assert "use fewer --rows" in err and not out.exists()

    # npz writes one batch at a time: the bound there is the disk.
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
    assert "bench step: --devices 100000 --sc-per-device 1: tables are sharded over devices " \
           "x SparseCores partitions, 100000 here; --sc-per-device and the partitions must be " \
           "powers of two." in err, err
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
