"""tilecore.compat.lib.fdo: the reference's NPZ and CSV FDO clients, on tilecore's FDO files."""

from __future__ import annotations

import inspect
import io
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tilecore import fdo
from tilecore.compat import _fdo
from tilecore.compat.lib.fdo import csv_file_fdo_client, fdo_client, file_fdo_client
from tilecore.compat.lib.nn import embedding, embedding_spec
from tilecore.fdo import _formats

CLIENTS = [file_fdo_client.NPZFileFDOClient, csv_file_fdo_client.CSVFileFDOClient]
FIELDS = ("max_ids_per_partition", "max_unique_ids_per_partition",
          "required_buffer_size_per_sc", "id_drop_counters")
Client = type[_fdo.FileFDOClient]


def stats(seed: int, tables: tuple[str, ...] = ("a", "b"), n: int = 8, s: int = 4
          ) -> embedding.SparseDenseMatmulInputStats:
    """Statistics shaped as preprocessing returns them: flat int32 per table, int drops."""
    rng = np.random.default_rng(seed)
    return embedding.SparseDenseMatmulInputStats(
        max_ids_per_partition={t: rng.integers(0, 500, n).astype(np.int32) for t in tables},
        max_unique_ids_per_partition={t: rng.integers(0, 90, n).astype(np.int32) for t in tables},
        required_buffer_size_per_sc={t: rng.integers(0, 4000, s).astype(np.int32) for t in tables},
        id_drop_counters={t: int(rng.integers(0, 50)) for t in tables},
    )


def stacked(steps: list[embedding.SparseDenseMatmulInputStats], field: str, table: str
            ) -> np.ndarray:
    return np.vstack([np.asarray(getattr(s, field)[table], np.int64) for s in steps])


def only_file(path: Path) -> Path:
    (file,) = path.iterdir()
    return file


def test_clients_are_fdo_clients_with_the_reference_signatures() -> None:
    assert issubclass(file_fdo_client.NPZFileFDOClient, fdo_client.FDOClient)
    assert issubclass(csv_file_fdo_client.CSVFileFDOClient, fdo_client.FDOClient)
    with pytest.raises(TypeError, match="abstract"):
        fdo_client.FDOClient()  # type: ignore[abstract]
    assert str(inspect.signature(file_fdo_client.NPZFileFDOClient)) == (
        "(base_dir: 'str | os.PathLike[str]') -> 'None'")
    assert list(inspect.signature(csv_file_fdo_client.CSVFileFDOClient).parameters.items())[
        1][1].default is True
    with pytest.raises(TypeError, match="base_dir must be a path"):
        file_fdo_client.NPZFileFDOClient(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("client_type", CLIENTS)
def test_history_round_trips_with_the_reference_layout(tmp_path: Path, client_type: Client
                                                       ) -> None:
    client = client_type(tmp_path)
    steps = [stats(i) for i in range(3)]
    for s in steps:
        client.record(s)
    assert client.publish() is None
    file = only_file(tmp_path)
    assert re.fullmatch(rf"fdo_stats_0_\d+\.{client._extension}", file.name)
    loaded = client_type(tmp_path).load()
    assert isinstance(loaded, embedding.SparseDenseMatmulInputStats)
    for field in FIELDS:  # one process: the history as stored, [steps, width] int64
        for table in ("a", "b"):
            got = getattr(loaded, field)[table]
            assert got.dtype == np.int64
            want = stacked(steps, field, table)
            np.testing.assert_array_equal(got, want.reshape(3, -1), err_msg=f"{field} {table}")
    if client_type is csv_file_fdo_client.CSVFileFDOClient:
        raw = file.read_bytes().decode()
        assert raw.startswith("key,values\r\na_max_ids,") and raw.endswith("\r\n")
        assert raw.count("\r\na_max_ids,") == 3
    else:
        with np.load(file) as z:
            assert sorted(z.files) == sorted(f"{t}_{k}" for t in "ab" for k in (
                "max_ids", "max_unique_ids", "required_buffer_size", "id_drop_counters"))


@pytest.mark.parametrize("client_type", CLIENTS)
def test_one_step_keeps_its_shape(tmp_path: Path, client_type: Client) -> None:
    client = client_type(tmp_path)
    client.record(stats(0))
    client.publish()
    loaded = client.load()
    np.testing.assert_array_equal(loaded.max_ids_per_partition["a"],
                                  stats(0).max_ids_per_partition["a"])
    drops = np.asarray(loaded.id_drop_counters["a"])
    # The reference's NPZ keeps a 0-d count; a CSV row reads back as one value.
    assert drops.shape == (() if client_type is file_fdo_client.NPZFileFDOClient else (1,))
    assert drops.item() == stats(0).id_drop_counters["a"]


@pytest.mark.parametrize("client_type", CLIENTS)
def test_processes_merge_by_elementwise_max_of_their_latest_files(
        tmp_path: Path, client_type: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    old = client_type(tmp_path)
    old.record(stats(99))
    old.record(embedding.SparseDenseMatmulInputStats(  # larger than everything below
        max_ids_per_partition={t: np.full(8, 10**6) for t in "ab"},
        max_unique_ids_per_partition={t: np.full(8, 10**6) for t in "ab"},
        required_buffer_size_per_sc={t: np.full(4, 10**6) for t in "ab"},
        id_drop_counters={t: 10**6 for t in "ab"}))
    old.publish()  # superseded by process 0's next file
    p0, p1 = client_type(tmp_path), client_type(tmp_path)
    s0, s1 = [stats(i) for i in range(3)], [stats(10 + i) for i in range(2)]
    for s in s0:
        p0.record(s)
    p0.publish()
    monkeypatch.setattr(_fdo, "process_index", lambda: 1)
    for s in s1:
        p1.record(s)
    p1.publish()
    for loaded in (p0.load(), p1.load()):
        for field in FIELDS:
            for table in "ab":
                want = stacked(s0 + s1, field, table).reshape(5, -1).max(0)
                np.testing.assert_array_equal(getattr(loaded, field)[table], want)


def test_csv_without_history_keeps_the_running_max(tmp_path: Path) -> None:
    client = csv_file_fdo_client.CSVFileFDOClient(tmp_path, retain_history=False)
    steps = [stats(i) for i in range(4)]
    for s in steps:
        client.record(s)
    client.publish()
    rows = only_file(tmp_path).read_text().splitlines()[1:]
    assert len(rows) == 8  # one row per key
    loaded = client.load()
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(loaded, field)["a"],
                                      stacked(steps, field, "a").reshape(4, -1).max(0))


@pytest.mark.parametrize("client_type", CLIENTS)
def test_loaded_stats_become_the_history(tmp_path: Path, client_type: Client) -> None:
    client = client_type(tmp_path)
    client.record(stats(0))
    client.publish()
    client.load()
    client.record(stats(1))  # stacked under the loaded values, as in the reference
    client.publish()
    np.testing.assert_array_equal(client.load().max_ids_per_partition["b"],
                                  stacked([stats(0), stats(1)], "max_ids_per_partition", "b"))


def test_native_clients_read_the_reference_layout(tmp_path: Path) -> None:
    client = file_fdo_client.NPZFileFDOClient(tmp_path)
    client.record(stats(0))
    client.publish()
    native = fdo.NpzFdoClient(tmp_path).load()
    np.testing.assert_array_equal(native.max_ids_per_partition["a"],
                                  stats(0).max_ids_per_partition["a"][None])
    assert native.id_drop_counters["a"] == stats(0).id_drop_counters["a"]


def test_update_preprocessing_parameters_from_a_loaded_client(tmp_path: Path) -> None:
    table = embedding_spec.TableSpec(
        name="t", vocabulary_size=256, embedding_dim=8, initializer=None,
        optimizer=embedding_spec.SGDOptimizerSpec(learning_rate=0.1), combiner="sum")
    features = {"f": embedding_spec.FeatureSpec(name="f", table_spec=table, input_shape=[32, 4],
                                                output_shape=[32, 8])}
    embedding.prepare_feature_specs_for_training(features, 1, 4)
    before = features["f"].table_spec.stacked_table_spec
    ids = {"f": np.random.default_rng(0).integers(0, 256, (32, 4)).astype(np.int32)}
    _, observed = embedding.preprocess_sparse_dense_matmul_input(ids, None, features, 1, 1,
                                                                 num_sc_per_device=4)
    client = file_fdo_client.NPZFileFDOClient(tmp_path)
    client.record(observed)
    client.publish()
    embedding.update_preprocessing_parameters(features, client.load(), num_sc_per_device=4)
    after = features["f"].table_spec.stacked_table_spec
    assert after.max_ids_per_partition == observed.max_ids_per_partition["t"].max()
    assert after.max_unique_ids_per_partition == observed.max_unique_ids_per_partition["t"].max()
    assert after.max_ids_per_partition != before.max_ids_per_partition
    assert after.suggested_coo_buffer_size_per_device == max(
        32, 4 * observed.required_buffer_size_per_sc["t"].max())


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    file = path / "fdo_stats_0_1.npz"
    np.savez(file, **arrays)  # pyright: ignore[reportArgumentType]
    return file


def good(width: int = 4) -> dict[str, np.ndarray]:
    return {"t_max_ids": np.arange(width), "t_max_unique_ids": np.arange(width),
            "t_required_buffer_size": np.array([8, 16]), "t_id_drop_counters": np.array(0)}


@pytest.mark.parametrize(("change", "message"), [
    ({"t_max_ids": np.array([1, -5, 2, 3])}, r"stack 't' \(max_ids\) holds the count -5"),
    ({"t_max_ids": np.array([1, 2**40, 2, 3])}, r"count 1099511627776, outside"),
    ({"t_max_ids": np.array([1.5, 2, 3, 4])}, r"dtype float64"),
    ({"t_max_unique_ids": np.arange(6)}, r"stack 't'.*shape \(4,\).*\(6,\)"),
    ({"t_required_buffer_size": np.arange(3)}, r"stack 't'.*3 values per step.*does not divide"),
    ({"t_id_drop_counters": np.arange(2)}, r"stack 't': id_drop_counters has shape \(2,\)"),
    ({"t_bogus": np.arange(2)}, r"unexpected key 't_bogus'"),
    ({"t_max_ids": np.zeros((2, 2, 2), np.int64)}, r"dtype int64 and shape \(2, 2, 2\)"),
])
def test_hostile_npz_values_name_the_file_stack_and_value(tmp_path: Path, change: dict,
                                                          message: str) -> None:
    file = write_npz(tmp_path, {**good(), **change})
    with pytest.raises(ValueError, match=rf"{file.name}.*{message}"):
        file_fdo_client.NPZFileFDOClient(tmp_path).load()


def test_npz_missing_field_truncation_and_huge_headers(tmp_path: Path) -> None:
    arrays = good()
    del arrays["t_max_unique_ids"]
    file = write_npz(tmp_path, arrays)
    client = file_fdo_client.NPZFileFDOClient(tmp_path)
    with pytest.raises(ValueError, match=r"stack 't' lacks \['max_unique_ids'\]"):
        client.load()
    write_npz(tmp_path, good())
    raw = file.read_bytes()
    file.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=rf"{file.name}.*(truncated|corrupt)"):
        client.load()
    header = io.BytesIO()  # an .npy member declaring 2**40 elements, holding 8 bytes
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False,
                                                  "shape": (2**20, 2**20)})
    with zipfile.ZipFile(file, "w") as z:
        z.writestr("t_max_ids.npy", header.getvalue() + bytes(8))
    with pytest.raises(ValueError, match=r"stack 't' \(max_ids\) declares .*1048576"):
        client.load()


@pytest.mark.parametrize(("text", "message"), [
    ("key,values\r\nt_max_ids,1 2\r\nt_max_unique_ids,1 2", "truncated"),
    ("kee,values\r\n", "header 'kee,values'"),
    ("key,values\r\nt_max_ids,1 x\r\n", r"stack 't' \(max_ids\) has values '1 x'"),
    ("key,values\r\nt_max_ids,1 2\r\nt_max_ids,1 2 3\r\n", r"line 3.*3 values.*earlier rows 2"),
    ("key,values\r\nt_max_ids,1 -2\r\nt_max_unique_ids,1 2\r\n", "holds the count -2"),
    ("key,values\r\nt_max_ids,1 99999999999999999999\r\n", "count beyond int64"),
    ("key,values\r\nt_max_ids,1 2\r\n", r"stack 't' lacks \['max_unique_ids'\]"),
    ("key,values\r\nnocomma\r\n", "expected '<key>,<values>'"),
])
def test_hostile_csv_files_are_clear_errors(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "fdo_stats_0_1.csv"
    file.write_text(text, newline="")
    with pytest.raises(ValueError, match=rf"{file.name}.*{message}"):
        csv_file_fdo_client.CSVFileFDOClient(tmp_path).load()


@pytest.mark.parametrize("client_type", CLIENTS)
def test_files_that_disagree_are_clear_errors(tmp_path: Path, client_type: Client,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    p0 = client_type(tmp_path)
    p0.record(stats(0, ("a", "b")))
    p0.publish()
    monkeypatch.setattr(_fdo, "process_index", lambda: 1)
    p1 = client_type(tmp_path)
    p1.record(stats(1, ("a",)))
    p1.publish()
    with pytest.raises(ValueError, match=r"only in fdo_stats_1.*\[\].*only in fdo_stats_0.*b_max"):
        p0.load()
    for file in tmp_path.glob("fdo_stats_1_*"):
        file.unlink()
    p1 = client_type(tmp_path)
    p1.record(stats(1, ("a", "b"), n=16, s=8))  # a different topology
    p1.publish()
    with pytest.raises(ValueError, match=r"fdo_stats_1.*16 values per step, earlier 8"):
        p0.load()


@pytest.mark.parametrize("client_type", CLIENTS)
def test_bad_records_and_empty_dirs_are_clear_errors(tmp_path: Path, client_type: Client
                                                     ) -> None:
    client = client_type(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"No stats files found.*publish"):
        client.load()
    with pytest.raises(TypeError, match="expected a SparseDenseMatmulInputStats, got int"):
        client.record(3)  # type: ignore[arg-type]
    bad = embedding.SparseDenseMatmulInputStats(
        max_ids_per_partition={"t": np.array([1, -1])}, max_unique_ids_per_partition={})
    with pytest.raises(ValueError, match=r"max_ids_per_partition of table 't' holds the count -1"):
        client.record(bad)
    client.record(stats(0, ("t",)))
    with pytest.raises(ValueError, match=r"table 't' has 3 values per step, earlier 8"):
        client.record(embedding.SparseDenseMatmulInputStats(
            max_ids_per_partition={"t": np.array([1, 2, 3])}, max_unique_ids_per_partition={}))
    with pytest.raises(TypeError, match="dtype <U1"):
        client.record({"id_drop_counters": {"t": "x"}})  # type: ignore[arg-type]


def test_fdo_clients_import_no_jax() -> None:
    code = ("import sys; from tilecore.compat.lib.fdo import file_fdo_client, "
            "csv_file_fdo_client; print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "False"


def test_csv_reads_any_spacing_and_refuses_oversized_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "fdo_stats_0_1.csv"
    file.write_text('key,values\n"t,x_max_ids", 1  2\t3 \n\n"t,x_max_unique_ids",1 2 3\n')
    loaded = csv_file_fdo_client.CSVFileFDOClient(tmp_path).load()
    np.testing.assert_array_equal(loaded.max_ids_per_partition["t,x"], [1, 2, 3])
    monkeypatch.setattr(_formats, "_MAX_CSV_BYTES", 16)
    with pytest.raises(ValueError, match=rf"{file.name} has \d+ bytes, more than the 16"):
        csv_file_fdo_client.CSVFileFDOClient(tmp_path).load()
