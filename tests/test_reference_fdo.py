"""FDO files of jax-tpu-embedding 0.2.0's clients and of tilecore.compat's, read by both.

Each scenario records the same statistics in the reference (in its venv) and in
compat, one client per simulated process; each side then loads both sides'
directories. Every load must give the same keys, shapes, dtypes and values, and
the CSV files must be byte-identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from _reference_peer import requires_reference, run_reference
from tilecore.compat import _fdo
from tilecore.compat.lib.fdo import csv_file_fdo_client, file_fdo_client
from tilecore.compat.lib.nn import embedding

pytestmark = requires_reference

FIELDS = ("max_ids_per_partition", "max_unique_ids_per_partition",
          "required_buffer_size_per_sc", "id_drop_counters")


def steps(seed: int, count: int, n: int = 8, s: int = 4) -> list[dict]:
    """`count` steps of statistics as preprocessing gives them, as JSON-able lists."""
    rng = np.random.default_rng(seed)
    return [{
        "max_ids_per_partition": {t: rng.integers(0, 300, n).tolist() for t in ("a", "bb")},
        "max_unique_ids_per_partition": {t: rng.integers(0, 60, n).tolist() for t in ("a", "bb")},
        "required_buffer_size_per_sc": {t: rng.integers(0, 900, s).tolist() for t in ("a", "bb")},
        "id_drop_counters": {t: int(rng.integers(0, 9)) for t in ("a", "bb")},
    } for _ in range(count)]


# name → (format, retain_history, [(process index, steps)] in publishing order)
SCENARIOS: dict[str, tuple[str, bool, list[tuple[int, list[dict]]]]] = {
    "npz_one_step": ("npz", True, [(0, steps(1, 1))]),
    "npz_history": ("npz", True, [(0, steps(2, 3))]),
    "npz_processes": ("npz", True, [(0, steps(3, 2)), (1, steps(4, 3)), (0, steps(5, 2)),
                                    (2, steps(6, 1))]),
    "csv_history": ("csv", True, [(0, steps(7, 3))]),
    "csv_processes": ("csv", True, [(1, steps(8, 2)), (0, steps(9, 4)), (1, steps(10, 3))]),
    "csv_no_history": ("csv", False, [(0, steps(11, 4)), (1, steps(12, 2))]),
}
# Written by compat only: the reference's CSV client fails to write a drop counter
# recorded once (a 0-d array); compat writes it as a one-value row.
COMPAT_ONLY = {"csv_one_step": ("csv", True, [(0, steps(13, 1))])}

REFERENCE = """
import json
import jax
import numpy as np
from jax_tpu_embedding.sparsecore.lib.fdo import csv_file_fdo_client, file_fdo_client
from jax_tpu_embedding.sparsecore.lib.nn import embedding

def make(step):
    return embedding.SparseDenseMatmulInputStats(**{
        field: {t: (int(v) if field == "id_drop_counters" else np.asarray(v, np.int32))
                for t, v in tables.items()} for field, tables in step.items()})

def client(kind, retain, folder):
    if kind == "npz":
        return file_fdo_client.NPZFileFDOClient(folder)
    return csv_file_fdo_client.CSVFileFDOClient(folder, retain_history=retain)

def save(stats, path):
    np.savez(path, **{f"{field}/{t}": np.asarray(v) for field in %(fields)r
                      for t, v in getattr(stats, field).items()})

scenarios, compat_only = json.loads((WORKDIR / "scenarios.json").read_text())
for name, (kind, retain, runs) in compat_only.items():
    save(client(kind, retain, WORKDIR / "compat" / name).load(),
         WORKDIR / f"compat_{name}_by_reference.npz")
for name, (kind, retain, runs) in scenarios.items():
    folder = WORKDIR / "reference" / name
    folder.mkdir(parents=True)
    for process, records in runs:
        jax.process_index = lambda process=process: process
        writer = client(kind, retain, folder)
        for step in records:
            writer.record(make(step))
        writer.publish()
    for side in ("reference", "compat"):
        save(client(kind, retain, WORKDIR / side / name).load(),
             WORKDIR / f"{side}_{name}_by_reference.npz")
"""


def make(step: dict) -> embedding.SparseDenseMatmulInputStats:
    def arrays(field: str) -> dict[str, np.ndarray]:
        return {t: np.asarray(v, np.int32) for t, v in step[field].items()}

    return embedding.SparseDenseMatmulInputStats(
        max_ids_per_partition=arrays("max_ids_per_partition"),
        max_unique_ids_per_partition=arrays("max_unique_ids_per_partition"),
        required_buffer_size_per_sc=arrays("required_buffer_size_per_sc"),
        id_drop_counters={t: int(v) for t, v in step["id_drop_counters"].items()})


def client(kind: str, retain: bool, folder: Path) -> _fdo.FileFDOClient:
    if kind == "npz":
        return file_fdo_client.NPZFileFDOClient(folder)
    return csv_file_fdo_client.CSVFileFDOClient(folder, retain_history=retain)


def assert_same(got: embedding.SparseDenseMatmulInputStats, path: Path) -> None:
    """`got` equals the loaded statistics saved at `path`: keys, shapes, dtypes, values."""
    with np.load(path) as saved:
        want = {key: saved[key] for key in saved.files}
    ours = {f"{field}/{t}": np.asarray(v) for field in FIELDS for t, v in getattr(got, field).items()}
    assert sorted(ours) == sorted(want), path.name
    for key, value in want.items():
        assert (ours[key].shape, ours[key].dtype) == (value.shape, value.dtype), (path.name, key)
        np.testing.assert_array_equal(ours[key], value, err_msg=f"{path.name} {key}")


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both sides wrote every scenario; the reference loaded both sides' files."""
    workdir = tmp_path_factory.mktemp("fdo")
    (workdir / "scenarios.json").write_text(json.dumps([SCENARIOS, COMPAT_ONLY]))
    with pytest.MonkeyPatch.context() as patch:
        for name, (kind, retain, runs) in {**SCENARIOS, **COMPAT_ONLY}.items():
            for process, records in runs:
                patch.setattr(_fdo, "process_index", lambda process=process: process)
                writer = client(kind, retain, workdir / "compat" / name)
                for step in records:
                    writer.record(make(step))
                writer.publish()
    run_reference(REFERENCE % {"fields": FIELDS}, workdir)
    return workdir


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_compat_loads_reference_files_exactly(exchanged: Path, name: str) -> None:
    kind, retain, _ = SCENARIOS[name]
    loaded = client(kind, retain, exchanged / "reference" / name).load()
    assert_same(loaded, exchanged / f"reference_{name}_by_reference.npz")


@pytest.mark.parametrize("name", sorted({**SCENARIOS, **COMPAT_ONLY}))
def test_reference_loads_compat_files_exactly(exchanged: Path, name: str) -> None:
    kind, retain, _ = {**SCENARIOS, **COMPAT_ONLY}[name]
    loaded = client(kind, retain, exchanged / "compat" / name).load()
    assert_same(loaded, exchanged / f"compat_{name}_by_reference.npz")
    if name in SCENARIOS:
        assert_same(loaded, exchanged / f"reference_{name}_by_reference.npz")


@pytest.mark.parametrize("name", sorted(n for n in SCENARIOS if n.startswith("csv")))
def test_csv_files_are_byte_identical(exchanged: Path, name: str) -> None:
    def contents(side: str) -> list[bytes]:
        files = sorted((exchanged / side / name).iterdir(), key=lambda p: (
            int(p.stem.split("_")[3]), p.name))  # publishing order
        return [p.read_bytes() for p in files]

    assert contents("compat") == contents("reference")


@pytest.mark.parametrize("name", sorted(n for n in SCENARIOS if n.startswith("npz")))
def test_npz_files_hold_identical_arrays(exchanged: Path, name: str) -> None:
    def contents(side: str) -> list[dict[str, tuple]]:
        files = sorted((exchanged / side / name).iterdir(), key=lambda p: int(p.stem.split("_")[3]))
        out = []
        for path in files:
            with np.load(path) as z:
                out.append({k: (z[k].shape, z[k].dtype, z[k].tolist()) for k in z.files})
        return out

    assert contents("compat") == contents("reference")
