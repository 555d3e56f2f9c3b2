"""`tilecore limits` at tiny sizes (batch 64, 2 batches), invoked in-process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tilecore as tc
from tilecore import data
from tilecore.data import criteo, stacked
from tilecore_apps._common import calibrate
from tilecore_apps.cli import main
from tilecore_apps.cli._limits_scan import minibatches_needed, report, scan

TINY = ["--batch-size", "64", "--batches", "2"]


def _run(tmp_path: Path, *extra: str, workload: str = "stacked") -> dict:
    out = tmp_path / "limits.json"
    assert main(["limits", "--workload", workload, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _save_npz(path: Path, batch: dict[str, tc.Ragged], **extra: np.ndarray) -> Path:
    arrays = {f"{f}/{part}": getattr(r, part) for f, r in batch.items()
              for part in ("values", "row_splits")}
    np.savez(path, **arrays, **extra)
    return path


def test_prints_a_table_per_topology_and_stack(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["limits", "--workload", "stacked", "--topology", "1x4", "2x2", *TINY]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    for text in ("topology=1x4", "topology=2x2", "observed", "current", "recommended",
                 "max IDs / partition", "max unique / partition", "COO buffer / device",
                 "HBM stack forward", "HBM stack backward", "padding overhead",
                 "minibatches needed", "estimate", "IDs dropped"):
        assert text in printed, text
    assert printed.count("stack item_query_terms_category_user") == 2
    assert "2/2 batches" in captured.err  # the progress bar


def test_json_numbers_match_calibration(tmp_path: Path) -> None:
    result = _run(tmp_path, "--topology", "2x4", *TINY)
    assert result["batch_size"] == 64 and result["batches"] == 2
    [topo] = result["topologies"]
    assert topo["topology"] == "2x4" and topo["num_partitions"] == 8
    assert topo["minibatches_needed_estimate"] == 1 and topo["dropped_ids"] == 0
    workload = stacked(batch_size=64)
    plan = tc.plan_stacking(workload.features, tc.Topology(global_devices=2, sc_per_device=4))
    calibrated, _ = calibrate(plan, list(workload.batches(2)))
    assert topo["stacks"].keys() == plan.stacks.keys()
    for name, s in topo["stacks"].items():
        rec, cur, obs = s["recommended"], s["current"], s["observed"]
        want = calibrated.stacks[name]
        assert rec["max_ids_per_partition"] == want.max_ids_per_partition
        assert rec["max_unique_ids_per_partition"] == want.max_unique_ids_per_partition
        assert rec["suggested_coo_buffer_size_per_device"] == (
            want.suggested_coo_buffer_size_per_device)
        assert obs["max_ids_per_partition"] == rec["max_ids_per_partition"]
        assert cur["max_ids_per_partition"] == plan.stacks[name].max_ids_per_partition
        assert 0 < rec["forward_hbm_stack_bytes"] <= cur["forward_hbm_stack_bytes"]
        assert 0 <= s["padding_overhead"] < 1
        load = s["per_partition_max_ids"]
        assert len(load["max"]) == len(load["mean"]) == 8
        assert max(load["max"]) == obs["max_ids_per_partition"]
        assert all(m <= x for m, x in zip(load["mean"], load["max"], strict=True))


def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "plots" / "load.png"
    assert main(["limits", "--workload", "stacked", "--topology", "1x4", "2x4",
                 "--plot", str(png), *TINY]) == 0
    content = png.read_bytes()
    assert content.startswith(b"\x89PNG\r\n\x1a\n") and len(content) > 5000


def test_data_round_trip(tmp_path: Path) -> None:
    batch = criteo(batch_size=64).batch(0)
    path = _save_npz(tmp_path / "batch.npz", batch)
    from_data = _run(tmp_path, "--workload", "criteo", "--data", str(path))
    from_workload = _run(tmp_path, "--workload", "criteo", "--batch-size", "64", "--batches", "1")
    assert from_data["batch_size"] == 64 and from_data["source"] == str(path)
    assert from_data["topologies"] == from_workload["topologies"]


def test_parquet_data_matches_npz(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    batch = criteo(batch_size=64).batch(0)
    npz = _run(tmp_path, "--workload", "criteo", "--data", str(_save_npz(tmp_path / "b.npz", batch)))
    parquet = data.save_batch(tmp_path / "b.parquet", batch)
    from_parquet = _run(tmp_path, "--workload", "criteo", "--data", str(parquet))
    assert from_parquet["topologies"] == npz["topologies"]


@pytest.mark.parametrize("case, message", [
    ("missing_file", "no such batch file"),
    ("not_npz", "cannot read it as an .npz archive"),
    ("one_array", "unknown batch file type '.npy'"),
    ("parquet_not_list", "must be a list of integer IDs per sample"),
    ("bad_name", "array names must be <feature>/values"),
    ("no_row_splits", "need both <feature>/values and <feature>/row_splits"),
    ("unknown_feature", "unknown ['zz']"),
    ("missing_feature", "missing ['f00']"),
    ("wrong_rows", "every feature needs 64 rows"),
])
def test_bad_data_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str,
                         message: str) -> None:
    batch = criteo(batch_size=64).batch(0)
    path = tmp_path / "batch.npz"
    if case == "missing_file":
        path = tmp_path / "absent.npz"
    elif case == "not_npz":
        path.write_text("not an archive")
    elif case == "one_array":
        path = tmp_path / "batch.npy"
        np.save(path, np.arange(3))
    elif case == "parquet_not_list":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        path = tmp_path / "batch.parquet"
        pq.write_table(pa.table({"f00": np.arange(64)}), path)
    elif case == "bad_name":
        _save_npz(path, batch, stray=np.arange(3))
    elif case == "no_row_splits":
        _save_npz(path, batch, **{"zz/values": np.arange(3)})
    elif case == "unknown_feature":
        _save_npz(path, batch, **{"zz/values": np.arange(3), "zz/row_splits": np.arange(4)})
    elif case == "missing_feature":
        _save_npz(path, {f: r for f, r in batch.items() if f != "f00"})
    elif case == "wrong_rows":
        short = batch["f01"]
        rows = tc.Ragged(short.values[: short.row_splits[10]], short.row_splits[:11])
        _save_npz(path, {**batch, "f01": rows})
    status = main(["limits", "--workload", "criteo", "--data", str(path)])
    assert status == 2
    err = capsys.readouterr().err
    assert "tilecore limits: error: --data" in err and message in err, err


@pytest.mark.parametrize("observed, limit, want", [
    ([0, 5], 8, 1), ([8], 8, 1), ([9], 8, 2), ([17, 3], 8, 4), ([24], 8, 4), ([33], 8, 8),
    ([640], 10, 64), ([641], 10, 128),
])
def test_minibatches_needed_rule(observed: list[int], limit: int, want: int) -> None:
    assert minibatches_needed(np.array([observed]), limit) == want


def test_tight_limits_need_minibatches_and_drop_ids() -> None:
    workload = stacked(batch_size=64)
    plan = tc.plan_stacking(workload.features, tc.Topology(global_devices=1, sc_per_device=4))
    batches = list(workload.batches(2))
    observed = report(plan, scan(plan, batches))["stacks"]
    name = next(iter(plan.stacks))
    most = observed[name]["observed"]["max_ids_per_partition"]
    tight = plan.with_stack_limits(name, max_ids_per_partition=-(-most // 3),
                                   max_unique_ids_per_partition=-(-most // 3))
    result = report(tight, scan(tight, batches))
    assert result["stacks"][name]["minibatches_needed_estimate"] == 4
    assert result["minibatches_needed_estimate"] == 4
    assert 0 < result["stacks"][name]["dropped_ids"] == result["dropped_ids"]


def test_skipped_bad_rows_are_counted_when_the_scan_stops_early(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`limits` reads --batches batches, so no pass over the file ends and the source's
    end-of-pass warning never said how many rows it skipped; the report says it."""
    path = data.write_sample(tmp_path, "criteo-tsv", rows=600, seed=1)
    lines = path.read_text().splitlines()
    for bad in (10, 50, 90):
        lines[bad] = "not a row"
    path.write_text("".join(f"{line}\n" for line in lines))
    out = tmp_path / "limits.json"
    with pytest.warns(data.BadRowsWarning):
        assert main(["limits", "--data", str(path), "--vocab-sizes", "1000", "--batch-size", "64",
                     "--batches", "2", "--skip-bad-rows", "--json", str(out)]) == 0
    assert "bad rows 3 skipped (unreadable rows of --data)" in capsys.readouterr().out
    assert json.loads(out.read_text())["bad_rows"] == 3
