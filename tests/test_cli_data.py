"""`tilecore data`, and `train --data` / `limits --data` on every format it writes."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tilecore import data
from tilecore_apps.cli import main

TINY = ["--steps", "2", "--eval-every", "2", "--sc-per-device", "2", "--embedding-dim", "4",
        "--eval-batches", "1", "--tune-batches", "1", "--no-pipelining", "--threads", "1",
        "--batch-size", "64"]


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("samples")
    assert main(["data", "--out", str(out), "--rows", "400", "--batch-size", "100"]) == 0
    return out


def test_data_writes_every_format(samples: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(p.name for p in samples.iterdir()) == [
        "clicks-npz", "clicks.parquet", "clicks.tsv", "clicks.tsv.gz"]
    assert len((samples / "clicks.tsv").read_text().splitlines()) == 400
    assert len(list((samples / "clicks-npz" / "train").glob("*.npz"))) == 3
    assert main(["data", "--out", str(samples), "--format", "criteo-tsv", "--rows", "400"]) == 0
    assert "wrote" in capsys.readouterr().out  # writing again replaces the sample


def test_train_on_criteo_tsv_reports_its_bad_rows(
        samples: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = (samples / "clicks.tsv").read_text().splitlines(keepends=True)
    path = tmp_path / "clicks.tsv.gz"  # batches of 64: held out, training batches 0 and 1
    path.write_bytes(gzip.compress("".join([*lines[:100], "bad\n", *lines[100:150],
                                            "1\tbad\n", *lines[150:]]).encode()))
    out = tmp_path / "run"
    with pytest.warns(data.BadRowsWarning, match="line 101"):
        assert main(["train", "--data", str(path), "--vocab-sizes", "50", *TINY, "--out",
                     str(out), "--skip-bad-rows"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["batch_size"] == 64
    assert len(summary["limits"]) >= 1 and summary["loss"] > 0
    assert summary["bad_rows"] == 2 and "bad rows      2 skipped" in capsys.readouterr().out


def test_train_on_parquet_with_held_out_file(samples: Path, tmp_path: Path) -> None:
    held_out = data.write_sample(tmp_path / "later", "parquet", rows=100, held_out=True)
    with pytest.raises(ValueError, match="hold their own held-out batches"):
        data.write_sample(tmp_path / "later", "npz", held_out=True)
    out = tmp_path / "run"
    assert main(["train", "--data", str(samples / "clicks.parquet"), "--eval-data",
                 str(held_out), *TINY, "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["batch_size"] == 64


@pytest.mark.parametrize("path, extra", [
    ("clicks-npz", []),  # the directory train reads
    ("clicks-npz/train/00000.npz", []),  # one batch written for train
    ("clicks.tsv", ["--vocab-sizes", "1000", "--batch-size", "100"]),
    ("clicks.parquet", ["--batch-size", "100", "--skip-bad-rows"]),
])
def test_limits_reads_what_train_reads(samples: Path, tmp_path: Path, path: str,
                                       extra: list[str]) -> None:
    out = tmp_path / "limits.json"
    assert main(["limits", "--data", str(samples / path), "--batches", "2", *extra,
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["source"] == str(samples / path) and result["batch_size"] == 100
    assert result["topologies"][0]["stacks"]


def test_reading_flags_are_checked(samples: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--skip-bad-rows", "--steps", "1"]) == 2
    assert "--skip-bad-rows read --data files; pass --data PATH too" in capsys.readouterr().err
    assert main(["train", "--data", str(samples / "clicks-npz"), "--batch-size", "8"]) == 2
    assert "fix the batch size" in capsys.readouterr().err
    bad = samples / "bad.tsv"
    bad.write_text("1\t2\n")
    assert main(["limits", "--data", str(bad)]) == 2
    assert f"{bad}, line 1: 2 tab-separated fields" in capsys.readouterr().err
    bad.unlink()
    parquet = str(samples / "clicks.parquet")
    assert main(["limits", "--data", parquet, "--sparse-columns", "label"]) == 2
    err = capsys.readouterr().err
    assert "columns ['label'] have more than one role" in err and "--label-column, default" in err


def test_shared_tables_from_the_command_line(samples: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from tilecore_apps.cli import _train
    from tilecore_apps.cli._main import build_parser

    limits = ["limits", "--data", str(samples / "clicks.parquet"), "--batches", "1",
              "--batch-size", "100", "--shared-table", "pair=c00,c01"]
    assert main(limits) == 2  # the sample's schema gives c00 1000 rows, c01 5000
    assert "share table 'pair' but have vocabulary sizes" in capsys.readouterr().err
    out = tmp_path / "limits.json"
    assert main([*limits, "--vocab-sizes", "1000", "--json", str(out)]) == 0
    stacks = json.loads(out.read_text())["topologies"][0]["stacks"].values()
    pair = next(s for s in stacks if "pair" in s["tables"])
    assert {"c00", "c01"} <= set(pair["features"]) and "c00" not in pair["tables"]
    assert main([*limits, "--shared-table", "pair=c02"]) == 2
    assert "names tables ['pair'] more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*limits[:-1], "c00,c01"])
    assert "must be TABLE=COLUMN,COLUMN,..." in capsys.readouterr().err
    parser = build_parser()  # `train --devices N` reruns itself with the same tables
    args = parser.parse_args(["train", "--data", "x.parquet", "--shared-table", "t=a,b",
                              "--shared-table", "u=c"])
    again = parser.parse_args(_train._argv(args, _train._topology(args)))
    assert again.shared_tables == args.shared_tables == [("t", ("a", "b")), ("u", ("c",))]
