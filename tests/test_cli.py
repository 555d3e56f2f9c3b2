"""The `tilecore` command at tiny sizes, invoked in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tilecore as tc
from tilecore.data import criteo
from tilecore.preprocessing import NUM_THREADS_ENV
from tilecore_apps._common import calibrate, parse_topology, write_file
from tilecore_apps.cli import main

TINY = ["--batch-size", "64"]


def test_bench_preprocess_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "bench.json"
    status = main(["bench", "preprocess", "--workload", "criteo", "--topology", "2x4",
                   "--threads", "1", "--repeats", "3", "--warmup", "1", "--batches", "2",
                   "--json", str(out), "--device", *TINY])
    assert status == 0
    result = json.loads(out.read_text())
    device = result["device"]  # timed beside the host, on the same batches, bit-identical
    assert device["bit_identical"] and 0 < device["min_s"] <= device["median_s"]
    assert device["backend"] == "cpu" and device["first_call_s"] > 0
    for key in ("workload", "topology", "threads", "median_s", "min_s", "max_s",
                "ids_per_batch", "ids_per_s", "repeats", "output_bytes", "peak_extra_bytes"):
        assert key in result, key
    assert result["workload"] == "criteo" and result["topology"] == "2x4"
    assert result["threads"] == 1 and result["repeats"] == 3 and result["batch_size"] == 64
    assert 0 < result["min_s"] <= result["median_s"] <= result["max_s"]
    assert result["ids_per_s"] > 0 and result["output_bytes"] > 0
    assert "M IDs/s" in capsys.readouterr().out


def test_bench_threads_from_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NUM_THREADS_ENV, "2")
    out = tmp_path / "bench.json"
    assert main(["bench", "preprocess", "--workload", "multihot", "--repeats", "1",
                 "--warmup", "0", "--batches", "1", "--json", str(out), *TINY]) == 0
    assert json.loads(out.read_text())["threads"] == 2


@pytest.mark.parametrize("workload", ["criteo", "multihot", "stacked", "criteo26"])
def test_demo_runs(workload: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--workload", workload, "--steps", "2", "--threads", "1", *TINY]) == 0
    printed = capsys.readouterr().out
    assert "M IDs/s" in printed and "batches/s" in printed and "dropped" in printed


def test_calibration_leaves_nothing_to_drop() -> None:
    workload = criteo(batch_size=64)
    plan = tc.plan_stacking(workload.features, tc.Topology(global_devices=1, sc_per_device=4))
    batches = [workload.batch(step) for step in range(3)]
    calibrated, stats = calibrate(plan, batches, num_threads=1)
    assert not calibrated.config.allow_id_dropping
    for name, stack in calibrated.stacks.items():
        assert stack.max_ids_per_partition == max(1, int(stats.max_ids_per_partition[name].max()))
    for batch in batches:  # would raise LimitExceededError if a limit were too low
        assert tc.preprocess(calibrated, batch, num_threads=1)[1].dropped_ids == 0
    roomy, _ = calibrate(plan, batches[:1], num_threads=1, headroom=0.5)
    for name, stack in roomy.stacks.items():
        assert stack.max_ids_per_partition >= 1.5 * int(stats.max_ids_per_partition[name].max()) - 1


def test_topology_parsing() -> None:
    assert parse_topology("1x4") == tc.Topology(global_devices=1, sc_per_device=4)
    assert parse_topology(" 8X2 ").num_partitions == 16
    with pytest.raises(ValueError, match="LxS"):
        parse_topology("4")


def test_bad_options_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--topology", "one-by-four", *TINY]) == 2
    assert "LxS" in capsys.readouterr().err
    assert main(["bench", "preprocess", "--repeats", "0", *TINY]) == 2
    with pytest.raises(SystemExit):
        main(["demo", "--workload", "nope"])


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--batch-size", "0"], "--batch-size: must be an integer >= 1, got '0'"),
    (["train", "--batch-size", "-8"], "--batch-size: must be an integer >= 1, got '-8'"),
    (["train", "--steps", "0"], "--steps: must be an integer >= 1, got '0'"),
    (["train", "--steps", "-3"], "--steps: must be an integer >= 1, got '-3'"),
    (["train", "--eval-every", "0"], "--eval-every: must be an integer >= 1, got '0'"),
    (["train", "--prefetch", "-1"], "--prefetch: must be an integer >= 0, got '-1'"),
    (["train", "--learning-rate", "0"], "--learning-rate: must be a number > 0, got '0'"),
    (["train", "--headroom", "nan"], "--headroom: must be a number >= 0, got 'nan'"),
    (["train", "--vocab-sizes", "10,x"], "--vocab-sizes: must be integers >= 1 separated"),
    (["train", "--vocab-sizes", "10,0"], "got '10,0'"),
    (["train", "--topology", "4"], "--topology: topology must look like LxS"),
    (["train", "--threads", "0"], "--threads: must be an integer >= 1, got '0'"),
    (["train", "--checkpoint-every", "0"], "--checkpoint-every: must be an integer >= 1"),
    (["limits", "--batches", "0"], "--batches: must be an integer >= 1, got '0'"),
    (["limits", "--batch-size", "-1"], "--batch-size: must be an integer >= 1, got '-1'"),
    (["limits", "--topology", "1x4", "one"], "--topology: topology must look like LxS"),
    (["limits", "--workload", "nope"], "--workload: invalid choice: 'nope'"),
    (["bench", "preprocess", "--threads", "-2"], "--threads: must be an integer >= 1, got '-2'"),
    (["bench", "preprocess", "--workload", "nope"], "--workload: invalid choice: 'nope'"),
    (["bench", "step", "--activation-mem-mb", "0"],
     "--activation-mem-mb: must be a number > 0, got '0'"),
    (["train", "--seed", "-1"], "--seed: must be an integer >= 0, got '-1'"),
    (["bench", "step", "--batch-size", "0"], "--batch-size: must be an integer >= 1, got '0'"),
    (["bench", "train", "--batch-size", "-4"], "--batch-size: must be an integer >= 1, got '-4'"),
    (["data", "--out", "x", "--seed", str(2**70)], "--seed: must be an integer in [0, 2**32)"),
    (["bench", "step", "--seed", "1.5"], "--seed: must be an integer >= 0, got '1.5'"),
])
def test_bad_values_are_usage_errors_naming_the_flag(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"tilecore {argv[0]}" in err and message in err, err
    assert "_" not in err.split("error:")[1].replace("--", "")  # no internal function names


def test_output_paths_that_cannot_be_written_are_usage_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any work (a --json directory used to fail once training was done,
    losing the summary; a path below a file was a raw traceback)."""
    afile, adir = tmp_path / "afile", tmp_path / "adir"
    afile.write_text("")
    adir.mkdir()
    for argv, message in (
            (["train", "--out", f"{afile}/run"], f"--out: cannot make '{afile}/run': '{afile}' is a file"),
            (["train", "--json", str(adir)], f"--json: '{adir}' is a directory; give a file name"),
            (["train", "--profile", str(afile)], f"--profile: '{afile}' is a file, not a directory"),
            (["data", "--out", str(afile)], f"--out: '{afile}' is a file, not a directory"),
            (["limits", "--json", f"{afile}/x.json"], f"--json: cannot write '{afile}/x.json'"),
            (["bench", "train", "--json", str(adir)], f"--json: '{adir}' is a directory")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"tilecore {argv[0]}" in err and message in err, err


def test_data_refuses_too_few_rows_for_npz_before_writing_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "--out", str(tmp_path / "d"), "--rows", "600"]) == 2
    err = capsys.readouterr().err
    assert "--rows >= 2048, got 600" in err and "--batch-size 1024" in err, err
    assert not (tmp_path / "d").exists()  # the TSV and Parquet files were written first before


def test_version_is_the_packaged_one(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    version = tomllib.loads(pyproject.read_text())["project"]["version"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tilecore {version}"


def test_output_files_are_written_through_links_and_special_files(tmp_path: Path) -> None:
    """--json and --plot replaced a symbolic link (or /dev/null, as root) by a new file."""
    (tmp_path / "results").mkdir()
    link = tmp_path / "out.json"
    link.symlink_to("results/out.json")
    write_file(link, b"{}\n")
    assert link.is_symlink() and (tmp_path / "results" / "out.json").read_bytes() == b"{}\n"
    write_file(link, b"[]\n")  # an existing target is replaced through the link too
    assert link.is_symlink() and (tmp_path / "results" / "out.json").read_bytes() == b"[]\n"
    write_file(Path("/dev/null"), b"x")
    assert Path("/dev/null").is_char_device()
