"""Hostile FDO statistics files: each is refused (or warned about) before it changes a limit.

The plan has two stacks on topology 1x4 (N=4 partitions, S=4 SparseCores, one
local device): `a` (vocab 64: 16 rows per partition) and `b` (vocab 100, padded to
128: 32 rows per partition), each fed by one feature of batch 32 (8 samples per
SparseCore). Every error is an `FdoStatsError` (a ValueError) whose message
names the file, the stack and the value.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import IO

import numpy as np
import pytest

import tilecore as tc
from tilecore import fdo
from tilecore.compat import _fdo
from tilecore.compat.lib.fdo import csv_file_fdo_client, file_fdo_client
from tilecore.compat.lib.nn import embedding

FIELDS = ("max_ids", "max_unique_ids", "required_buffer_size", "id_drop_counters")
NAME = "fdo_stats_0_1"


def make_plan(topology: tc.Topology | None = None, vocab_a: int = 64) -> tc.StackingPlan:
    topology = topology or tc.Topology(global_devices=1, sc_per_device=4)
    a = tc.TableSpec(name="a", vocab_size=vocab_a, embedding_dim=8)
    b = tc.TableSpec(name="b", vocab_size=100, embedding_dim=16)
    features = [tc.FeatureSpec(name="fa", table=a, input_shape=(32, 2)),
                tc.FeatureSpec(name="fb", table=b, input_shape=(32, 3))]
    return tc.plan_stacking(features, topology)


@pytest.fixture(scope="module")
def plan() -> tc.StackingPlan:
    built = make_plan()
    assert sorted(built.stacks) == ["a", "b"]
    return built


def good(stack: str, n: int = 4, s: int = 4) -> dict[str, np.ndarray]:
    """One step of plausible statistics of `stack` as a tilecore client writes them."""
    return {f"{stack}_max_ids": np.arange(5, 5 + n).reshape(1, n),
            f"{stack}_max_unique_ids": np.arange(1, 1 + n).reshape(1, n),
            f"{stack}_required_buffer_size": np.full((1, s), 32),
            f"{stack}_id_drop_counters": np.zeros((1, 1), np.int64)}


def write_npz(folder: Path, arrays: dict[str, np.ndarray], name: str = NAME) -> Path:
    path = folder / f"{name}.npz"
    np.savez(path, **arrays)  # pyright: ignore[reportArgumentType]
    return path


def write_csv(folder: Path, text: str) -> Path:
    path = folder / f"{NAME}.csv"
    path.write_bytes(text.encode())
    return path


def refused(client: fdo.FileFdoClient, file: Path, *parts: str) -> str:
    """Loading raises FdoStatsError whose message names `file` and every one of `parts`."""
    with pytest.raises(fdo.FdoStatsError) as info:
        client.load()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert file.name in message, message
    for part in parts:
        assert part in message, (part, message)
    return message


def test_a_good_file_loads_and_sets_limits_without_warnings(tmp_path: Path,
                                                            plan: tc.StackingPlan) -> None:
    write_npz(tmp_path, {**good("a"), **good("b")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = fdo.NpzFdoClient(tmp_path, plan=plan).load()
    tuned = tc.update_preprocessing_parameters(plan, stats)
    assert tuned.stacks["a"].max_ids_per_partition == 8
    assert tuned.stacks["b"].suggested_coo_buffer_size_per_device == 32 * 4


def test_stack_missing_warns_naming_it_and_keeps_its_limits(tmp_path: Path,
                                                            plan: tc.StackingPlan) -> None:
    file = write_npz(tmp_path, good("a"))
    with pytest.warns(fdo.FdoStatsWarning, match=rf"{file.name}.*stack 'b'.*keeps its limits "
                      rf"max_ids_per_partition={plan.stacks['b'].max_ids_per_partition}"):
        stats = fdo.NpzFdoClient(tmp_path, plan=plan).load()
    tuned = tc.update_preprocessing_parameters(plan, stats)
    assert tuned.stacks["b"] == plan.stacks["b"]
    assert tuned.stacks["a"].max_ids_per_partition == 8


def test_unknown_stack_is_refused(tmp_path: Path, plan: tc.StackingPlan) -> None:
    file = write_npz(tmp_path, {**good("a"), **good("b"), **good("zz")})
    refused(fdo.NpzFdoClient(tmp_path, plan=plan), file, "stack 'zz'", "['a', 'b']")


def test_negative_count_is_refused(tmp_path: Path, plan: tc.StackingPlan) -> None:
    arrays = {**good("a"), **good("b"), "a_max_ids": np.array([[5, -3, 7, 8]])}
    file = write_npz(tmp_path, arrays)
    refused(fdo.NpzFdoClient(tmp_path, plan=plan), file, "stack 'a' (max_ids)", "-3")


def test_wrong_width_is_refused(tmp_path: Path, plan: tc.StackingPlan) -> None:
    arrays = {**good("a"), **good("b"), "b_max_unique_ids": np.array([[1, 2, 3]])}
    file = write_npz(tmp_path, arrays)
    refused(fdo.NpzFdoClient(tmp_path, plan=plan), file, "stack 'b'", "max_unique_ids=3",
            "topology 1x4", "max_unique_ids=4")


def test_absurd_counts_are_refused_not_allocated(tmp_path: Path, plan: tc.StackingPlan) -> None:
    client = fdo.NpzFdoClient(tmp_path, plan=plan)
    file = write_npz(tmp_path, {**good("a"), **good("b"), "a_max_ids": np.full((1, 4), 2**40)})
    refused(client, file, "stack 'a' (max_ids)", str(2**40))  # beyond int32: any plan
    file = write_npz(tmp_path, {**good("a"), **good("b"), "a_max_ids": np.full((1, 4), 10**6)})
    refused(client, file, "stack 'a' max_ids holds 1000000", "more than 128",
            "8 samples per SparseCore × 16 rows")  # the plan's bound
    file = write_npz(tmp_path, {**good("a"), **good("b"),
                                "b_max_unique_ids": np.array([[1, 2, 33, 4]])})
    refused(client, file, "stack 'b' max_unique_ids holds 33", "more than 32")
    file = write_npz(tmp_path, {**good("a"), **good("b"),
                                "a_required_buffer_size": np.full((1, 4), 2**30)})
    refused(client, file, "stack 'a' required_buffer_size holds 1073741824",
            "max_ids up to 8 can fill")


def test_buffer_that_int32_cannot_index_is_refused(tmp_path: Path) -> None:
    big = make_plan(vocab_a=2**28)  # 2**26 rows per partition: max_ids may reach 2**29
    arrays = {**good("a"), **good("b"), "a_max_ids": np.full((1, 4), 2**29),
              "a_required_buffer_size": np.full((1, 4), 2**30)}
    file = write_npz(tmp_path, arrays)
    refused(fdo.NpzFdoClient(tmp_path, plan=big), file,
            "stack 'a' required_buffer_size holds 1073741824", "int32")


@pytest.mark.parametrize(("kind", "content", "parts"), [
    ("npz", {"a_max_ids": np.array([[1.5, np.nan, 2, 3]])}, ["stack 'a' (max_ids)", "float64"]),
    ("csv", "key,values\r\na_max_ids,1 nan 2 3\r\n", ["stack 'a' (max_ids)", "'1 nan 2 3'"]),
    ("csv", "key,values\r\na_max_ids,1 2.5 2 3\r\n", ["stack 'a' (max_ids)", "'1 2.5 2 3'"]),
])
def test_nan_and_float_counts_are_refused(tmp_path: Path, plan: tc.StackingPlan, kind: str,
                                          content: object, parts: list[str]) -> None:
    if kind == "npz":
        assert isinstance(content, dict)
        file = write_npz(tmp_path, {**good("a"), **good("b"), **content})
        refused(fdo.NpzFdoClient(tmp_path, plan=plan), file, *parts)
    else:
        assert isinstance(content, str)
        file = write_csv(tmp_path, content)
        refused(fdo.CsvFdoClient(tmp_path, plan=plan), file, *parts)


@pytest.mark.parametrize(("kind", "content", "part"), [
    ("npz", b"", "not an .npz archive"),
    ("csv", b"", "truncated"),
    ("csv", b"key,values\r\n", "holds no statistics"),
])
def test_empty_files_are_refused(tmp_path: Path, plan: tc.StackingPlan, kind: str,
                                 content: bytes, part: str) -> None:
    file = tmp_path / f"{NAME}.{kind}"
    file.write_bytes(content)
    client_type = fdo.NpzFdoClient if kind == "npz" else fdo.CsvFdoClient
    refused(client_type(tmp_path, plan=plan), file, part)


def test_truncated_npz_is_refused(tmp_path: Path, plan: tc.StackingPlan) -> None:
    file = write_npz(tmp_path, {**good("a"), **good("b")})
    raw = file.read_bytes()
    file.write_bytes(raw[: len(raw) // 2])
    refused(fdo.NpzFdoClient(tmp_path, plan=plan), file, "truncated or corrupt")


@pytest.mark.parametrize(("line", "parts"), [
    ("a_max_ids,1 2 x 4", ["line 2", "stack 'a' (max_ids)", "'1 2 x 4'"]),
    ("garbage without a comma", ["line 2", "'garbage without a comma'"]),
    ("a_max_ids,1 2 3 4\r\na_max_ids,1 2", ["line 3", "stack 'a' (max_ids)", "2 values"]),
])
def test_garbage_csv_lines_are_refused(tmp_path: Path, plan: tc.StackingPlan, line: str,
                                       parts: list[str]) -> None:
    file = write_csv(tmp_path, f"key,values\r\n{line}\r\n")
    refused(fdo.CsvFdoClient(tmp_path, plan=plan), file, *parts)


@pytest.mark.parametrize("client_type", [fdo.NpzFdoClient, fdo.CsvFdoClient])
def test_file_for_another_device_count_is_refused(tmp_path: Path, plan: tc.StackingPlan,
                                                  client_type: type[fdo.FileFdoClient]) -> None:
    writer = client_type(tmp_path)  # a 2-device job: N=8 partitions
    writer.record(tc.PreprocessStats(
        max_ids_per_partition={k: np.full((2, 8), 3, np.int32) for k in "ab"},
        max_unique_ids_per_partition={k: np.full((2, 8), 2, np.int32) for k in "ab"},
        required_buffer_size_per_sc={k: np.full((2, 4), 64, np.int32) for k in "ab"},
        id_drop_counters=dict.fromkeys("ab", 0)))
    file = writer.publish()
    message = refused(client_type(tmp_path, plan=plan), file, "stack 'a'", "max_ids=8",
                      "topology 1x4", "another topology")
    assert "max_ids=4" in message


def test_reference_layout_of_several_local_devices_loads(tmp_path: Path) -> None:
    two = make_plan(tc.Topology(global_devices=2, sc_per_device=4))  # N=8, 2 local devices
    writer = file_fdo_client.NPZFileFDOClient(tmp_path)  # rows flattened over local devices
    writer.record(embedding.SparseDenseMatmulInputStats(
        max_ids_per_partition={k: np.full(16, 3, np.int32) for k in "ab"},
        max_unique_ids_per_partition={k: np.full(16, 2, np.int32) for k in "ab"},
        required_buffer_size_per_sc={k: np.full(8, 24, np.int32) for k in "ab"},
        id_drop_counters=dict.fromkeys("ab", 0)))
    writer.publish()
    stats = fdo.NpzFdoClient(tmp_path, plan=two).load()
    assert stats.max_ids_per_partition["a"].shape == (1, 16)
    with pytest.raises(fdo.FdoStatsError, match=r"stack 'a' has max_ids=16.*topology 1x4"):
        fdo.NpzFdoClient(tmp_path).load_for(make_plan())


def test_tune_limits_refuses_a_stale_file_of_another_plan(tmp_path: Path,
                                                          plan: tc.StackingPlan) -> None:
    stale = write_npz(tmp_path, {**good("a"), **good("b"),  # another process's, another plan
                                 "a_max_unique_ids": np.array([[1, 99, 3, 4]])}, "fdo_stats_1_1")
    rng = np.random.default_rng(0)
    batch = {"fa": rng.integers(0, 64, (32, 2), np.int32),
             "fb": rng.integers(0, 100, (32, 3), np.int32)}
    with pytest.raises(fdo.FdoStatsError, match=rf"{re.escape(stale.name)}: stack 'a' "
                       "max_unique_ids holds 99"):
        fdo.tune_limits(plan, [batch], client=fdo.NpzFdoClient(tmp_path), num_threads=1)


class _Handed(fdo.FdoClient):
    """A client (not file-backed) that loads whatever it was given."""

    def __init__(self, stats: tc.PreprocessStats) -> None:
        self.stats = stats

    def record(self, stats: tc.PreprocessStats) -> None:
        del stats

    def publish(self) -> None:
        return None

    def load(self) -> tc.PreprocessStats:
        return self.stats


def stats(ids: np.ndarray, stacks: str = "ab") -> tc.PreprocessStats:
    """Statistics built by hand, as a client's `load()` could return them: `ids` as every
    named stack's `max_ids`, plausible other fields."""
    return tc.PreprocessStats(
        max_ids_per_partition=dict.fromkeys(stacks, ids),
        max_unique_ids_per_partition={k: np.ones((1, 4), np.int32) for k in stacks},
        required_buffer_size_per_sc={k: np.full((1, 4), 8, np.int32) for k in stacks},
        id_drop_counters=dict.fromkeys(stacks, 0))


def test_any_client_is_checked_by_load_for(plan: tc.StackingPlan) -> None:
    with pytest.raises(fdo.FdoStatsError, match=r"_Handed.load\(\).*stack 'a' \(max_ids\).*float"):
        _Handed(stats(np.array([[1.0, np.nan, 2, 3]]))).load_for(plan)
    with pytest.raises(fdo.FdoStatsError, match=r"_Handed.load\(\).*stack 'a' has max_ids=2"):
        _Handed(stats(np.ones((1, 2), np.int64))).load_for(plan)
    with pytest.warns(fdo.FdoStatsWarning, match="stack 'b'"):
        _Handed(stats(np.ones((1, 4), np.int64), "a")).load_for(plan)


def test_update_preprocessing_parameters_checks_statistics_it_is_handed(
        plan: tc.StackingPlan) -> None:
    # Statistics from anywhere (here built by hand, as a client's `load()` could return
    # them without `load_for`) are checked before a limit changes: nothing is applied.
    where = r"update_preprocessing_parameters: the statistics"
    with pytest.raises(fdo.FdoStatsError, match=where + r": stack 'a' \(max_ids\) holds the "
                       r"count -3"):
        tc.update_preprocessing_parameters(plan, stats(np.array([[1, -3, 2, 3]])))
    with pytest.raises(fdo.FdoStatsError,
                       match=where + r": stack 'a' has max_ids=2, .* values per step"):
        tc.update_preprocessing_parameters(plan, stats(np.ones((1, 2), np.int64)))
    with pytest.raises(fdo.FdoStatsError, match=where + r": stack 'a' max_unique_ids holds"):
        huge = stats(np.ones((1, 4), np.int64))
        huge.max_unique_ids_per_partition["a"] = np.full((1, 4), 10**6, np.int64)
        tc.update_preprocessing_parameters(plan, huge)
    with pytest.raises(fdo.FdoStatsError, match=r"stack 'z' is not one of the plan's stacks"):
        tc.update_preprocessing_parameters(plan, stats(np.ones((1, 4), np.int64), "z"))
    # Statistics of some stacks only: the others keep their limits, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuned = tc.update_preprocessing_parameters(plan, stats(np.full((1, 4), 7, np.int64), "a"))
    assert tuned.stacks["a"].max_ids_per_partition == 7
    assert tuned.stacks["b"] == plan.stacks["b"]


def test_update_preprocessing_parameters_takes_statistics_held_as_lists(
        plan: tc.StackingPlan) -> None:
    """Counts as Python lists were a bare AttributeError ('list' object has no attribute
    'max'): they are read as arrays, and what is no array of counts is named."""
    arrays = stats(np.array([[7, 3, 2, 5]]))
    as_lists = tc.PreprocessStats(
        max_ids_per_partition={k: v.tolist() for k, v in arrays.max_ids_per_partition.items()},
        max_unique_ids_per_partition={
            k: v.tolist() for k, v in arrays.max_unique_ids_per_partition.items()},
        required_buffer_size_per_sc={
            k: v.tolist() for k, v in arrays.required_buffer_size_per_sc.items()},
        id_drop_counters=dict(arrays.id_drop_counters))
    tuned = tc.update_preprocessing_parameters(plan, as_lists)
    assert tuned == tc.update_preprocessing_parameters(plan, arrays)
    assert tuned.stacks["a"].max_ids_per_partition == 7
    where = r"update_preprocessing_parameters: the statistics: stack 'a' \(max_ids\)"
    with pytest.raises(fdo.FdoStatsError, match=where + r" is not an array of counts"):
        tc.update_preprocessing_parameters(plan, stats([[1, 2], [3]]))  # type: ignore[arg-type]
    with pytest.raises(fdo.FdoStatsError, match=where + r" has dtype float64"):
        tc.update_preprocessing_parameters(plan, stats([[1.5, 2, 3, 4]]))  # type: ignore[arg-type]
    with pytest.raises(fdo.FdoStatsError, match=where + r" holds the count -1"):
        tc.update_preprocessing_parameters(plan, stats([[1, -1, 3, 4]]))  # type: ignore[arg-type]


@pytest.mark.parametrize("client_type", [file_fdo_client.NPZFileFDOClient,
                                         csv_file_fdo_client.CSVFileFDOClient])
def test_compat_publish_is_atomic(tmp_path: Path, client_type: type[_fdo.FileFDOClient],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    client = client_type(tmp_path)
    client.record(embedding.SparseDenseMatmulInputStats(
        max_ids_per_partition={"a": np.arange(4)}, max_unique_ids_per_partition={"a": np.ones(4)}))
    client.publish()
    before = sorted(p.name for p in tmp_path.iterdir())

    def fail(file: IO[bytes], arrays: object) -> None:
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(client_type, "_write", staticmethod(fail))
    with pytest.raises(OSError, match="disk full"):
        client.publish()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no partial or temp file


def test_a_file_given_as_the_statistics_directory_is_named(tmp_path: Path) -> None:
    path = tmp_path / "stats.npz"
    path.write_bytes(b"x")
    client = file_fdo_client.NPZFileFDOClient(path)
    client.record({"max_ids_per_partition": {"t": np.array([1, 2])},
                   "max_unique_ids_per_partition": {"t": np.array([1, 2])}})
    for call in (client.publish, client.load):
        with pytest.raises(NotADirectoryError, match=f"FDO base_dir {re.escape(str(path))} is a "
                                                     "file, not a directory"):
            call()
