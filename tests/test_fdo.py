"""FDO: file clients (NPZ, CSV) round-trip and merge by max; tune_limits settles limits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tilecore as tc
from tilecore import data, fdo

CLIENTS = [fdo.NpzFdoClient, fdo.CsvFdoClient]
STACKS = ("a", "b")
N, S, LOCAL = 8, 4, 2


def random_stats(seed: int, stacks: tuple[str, ...] = STACKS) -> tc.PreprocessStats:
    rng = np.random.default_rng(seed)
    return tc.PreprocessStats(
        max_ids_per_partition={k: rng.integers(0, 500, (LOCAL, N)).astype(np.int32) for k in stacks},
        max_unique_ids_per_partition={
            k: rng.integers(0, 100, (LOCAL, N)).astype(np.int32) for k in stacks},
        required_buffer_size_per_sc={
            k: rng.integers(0, 4000, (LOCAL, S)).astype(np.int32) for k in stacks},
        id_drop_counters={k: int(rng.integers(0, 50)) for k in stacks},
    )


def expected_max(all_stats: list[tc.PreprocessStats]) -> dict[str, dict[str, np.ndarray]]:
    """Per stack: the max over steps and devices, shaped [1, width]; drops the max count."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for k in all_stats[0].max_ids_per_partition:
        out[k] = {
            "ids": np.max([s.max_ids_per_partition[k] for s in all_stats], axis=(0, 1))[None],
            "unique": np.max([s.max_unique_ids_per_partition[k] for s in all_stats],
                             axis=(0, 1))[None],
            "required": np.max([s.required_buffer_size_per_sc[k] for s in all_stats],
                               axis=(0, 1))[None],
            "drops": np.array(max(s.id_drop_counters[k] for s in all_stats)),
        }
    return out


def assert_stats_equal(got: tc.PreprocessStats, want: dict[str, dict[str, np.ndarray]]) -> None:
    assert sorted(got.max_ids_per_partition) == sorted(want)
    for k, w in want.items():
        np.testing.assert_array_equal(got.max_ids_per_partition[k], w["ids"])
        np.testing.assert_array_equal(got.max_unique_ids_per_partition[k], w["unique"])
        np.testing.assert_array_equal(got.required_buffer_size_per_sc[k], w["required"])
        assert got.id_drop_counters[k] == int(w["drops"])


@pytest.mark.parametrize("client_type", CLIENTS)
def test_round_trip_is_the_recorded_max(tmp_path: Path, client_type: type[fdo.FileFdoClient]
                                        ) -> None:
    client = client_type(tmp_path)
    steps = [random_stats(i) for i in range(5)]
    for s in steps:
        client.record(s)
    path = client.publish()
    assert path.parent == tmp_path and path.name.startswith("fdo_stats_0_")
    assert path.suffix == f".{client.extension}"
    assert_stats_equal(client_type(tmp_path).load(), expected_max(steps))


@pytest.mark.parametrize("client_type", CLIENTS)
def test_files_keep_one_row_per_step_with_the_reference_keys(
        tmp_path: Path, client_type: type[fdo.FileFdoClient]) -> None:
    client = client_type(tmp_path)
    for i in range(3):
        client.record(random_stats(i))
    path = client.publish()
    keys = {f"{k}_{f}" for k in STACKS
            for f in ("max_ids", "max_unique_ids", "required_buffer_size", "id_drop_counters")}
    if client_type is fdo.NpzFdoClient:
        with np.load(path) as z:
            assert set(z.files) == keys
            assert z["a_max_ids"].shape == (3, N) and z["a_max_ids"].dtype == np.int64
            assert z["a_required_buffer_size"].shape == (3, S)
            assert z["a_id_drop_counters"].shape == (3, 1)
    else:
        lines = path.read_text().splitlines()
        assert lines[0] == "key,values"
        rows = [line.split(",") for line in lines[1:]]
        assert {r[0] for r in rows} == keys
        assert sum(r[0] == "a_max_ids" for r in rows) == 3
        first = next(r for r in rows if r[0] == "a_max_ids")
        assert first[1].split() == [str(v) for v in random_stats(0).max_ids_per_partition["a"]
                                    .max(0)]


@pytest.mark.parametrize("client_type", CLIENTS)
def test_two_processes_merge_by_max(tmp_path: Path, client_type: type[fdo.FileFdoClient]) -> None:
    p0, p1 = client_type(tmp_path, process_index=0), client_type(tmp_path, process_index=1)
    s0, s1 = [random_stats(i) for i in range(3)], [random_stats(10 + i) for i in range(2)]
    for s in s0:
        p0.record(s)
    for s in s1:
        p1.record(s)
    p0.publish()
    p1.publish()
    want = expected_max(s0 + s1)
    assert_stats_equal(p0.load(), want)
    assert_stats_equal(p1.load(), want)


def test_csv_without_history_keeps_only_the_max(tmp_path: Path) -> None:
    client = fdo.CsvFdoClient(tmp_path, retain_history=False)
    steps = [random_stats(i) for i in range(4)]
    for s in steps:
        client.record(s)
    path = client.publish()
    rows = [line.split(",")[0] for line in path.read_text().splitlines()[1:]]
    assert len(rows) == len(set(rows)) == 4 * len(STACKS)  # one row per key
    assert_stats_equal(client.load(), expected_max(steps))


@pytest.mark.parametrize("client_type", CLIENTS)
def test_latest_file_per_process_wins(tmp_path: Path, client_type: type[fdo.FileFdoClient]
                                      ) -> None:
    big, small = random_stats(1), random_stats(2)
    big = tc.PreprocessStats(  # larger than `small` everywhere
        max_ids_per_partition={k: v + 1000 for k, v in big.max_ids_per_partition.items()},
        max_unique_ids_per_partition=big.max_unique_ids_per_partition,
        required_buffer_size_per_sc=big.required_buffer_size_per_sc,
        id_drop_counters=big.id_drop_counters,
    )
    old = client_type(tmp_path)
    old.record(big)
    old.publish()
    new = client_type(tmp_path)
    new.record(small)
    new.publish()
    assert len(new.latest_files()) == 1
    assert_stats_equal(new.load(), expected_max([small]))


@pytest.mark.parametrize("client_type", CLIENTS)
def test_truncated_file_is_a_clear_error(tmp_path: Path, client_type: type[fdo.FileFdoClient]
                                         ) -> None:
    client = client_type(tmp_path)
    client.record(random_stats(0))
    path = client.publish()
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 3])
    with pytest.raises(ValueError, match=f"{path.name}.*(truncated|corrupt)"):
        client.load()
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=path.name):
        client.load()


@pytest.mark.parametrize("client_type", CLIENTS)
def test_files_of_different_stacks_are_a_clear_error(
        tmp_path: Path, client_type: type[fdo.FileFdoClient]) -> None:
    p0, p1 = client_type(tmp_path, process_index=0), client_type(tmp_path, process_index=1)
    p0.record(random_stats(0, ("a", "b")))
    p1.record(random_stats(1, ("a", "c")))
    p0.publish()
    path = p1.publish()
    with pytest.raises(ValueError, match=rf"{path.name}.*stacks.*\['a', 'c'\].*only in"):
        p0.load()


def test_recording_other_stacks_is_an_error(tmp_path: Path) -> None:
    client = fdo.NpzFdoClient(tmp_path)
    client.record(random_stats(0, ("a",)))
    with pytest.raises(ValueError, match="one client per stacking plan"):
        client.record(random_stats(0, ("b",)))


@pytest.mark.parametrize("client_type", CLIENTS)
def test_no_files_and_nothing_recorded_are_clear_errors(
        tmp_path: Path, client_type: type[fdo.FileFdoClient]) -> None:
    client = client_type(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="publish"):
        client.load()
    with pytest.raises(ValueError, match="record"):
        client.publish()


@pytest.mark.parametrize("client_type", CLIENTS)
def test_writes_are_atomic(tmp_path: Path, client_type: type[fdo.FileFdoClient],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    client = client_type(tmp_path)
    client.record(random_stats(0))
    for _ in range(3):
        client.publish()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 3 and all(n.startswith("fdo_stats_0_") for n in names)

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(client, "_write", fail)
    with pytest.raises(OSError, match="disk full"):
        client.publish()
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no temp or partial file


def test_fdo_imports_no_jax() -> None:
    code = ("import sys, tilecore.fdo; "
            "print(sorted(m for m in ('jax', 'hypothesis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def criteo() -> tuple[tc.StackingPlan, list]:
    workload = data.get_workload("criteo", batch_size=256)
    plan = tc.plan_stacking(list(workload.features), tc.Topology(global_devices=1, sc_per_device=4))
    return plan, list(workload.batches(3))


def test_heuristic_limits_follow_the_guide(criteo: tuple[tc.StackingPlan, list]) -> None:
    plan, _ = criteo
    start = fdo.heuristic_limits(plan)
    for name, stack in start.stacks.items():
        b = sum(f.batch_size // 4 for f in plan.stack_features(name))
        assert stack.max_ids_per_partition == max(8, -(-4 * b // 10))
        assert stack.max_unique_ids_per_partition == max(8, -(-b // 10))
        assert stack.suggested_coo_buffer_size_per_device == 4 * stack.max_ids_per_partition


@pytest.mark.parametrize("client_type", [None, *CLIENTS])
def test_tune_limits_settles_so_nothing_drops(
        tmp_path: Path, criteo: tuple[tc.StackingPlan, list], client_type: type | None) -> None:
    plan, batches = criteo
    client = None if client_type is None else client_type(tmp_path)
    tuned, report = fdo.tune_limits(plan, batches, client=client, num_threads=2)
    assert report.initial_limits == fdo.limits_of(fdo.heuristic_limits(plan))
    assert report.drops_per_round[0] > 0  # the heuristics are too small for criteo
    assert report.drops_per_round[-1] == 0 and report.rounds == len(report.drops_per_round)
    assert report.limits == fdo.limits_of(tuned)
    assert tuned.config == plan.config and not tuned.config.allow_id_dropping
    for batch in batches:  # raises LimitExceededError if anything is over
        _, stats = tc.preprocess(tuned, batch)
        assert stats.dropped_ids == 0
    if client is not None:
        assert len(list(tmp_path.iterdir())) == report.rounds
    again, _ = fdo.tune_limits(plan, batches, num_threads=1)
    assert fdo.limits_of(again) == report.limits  # deterministic


def test_tune_limits_headroom_rounds_up(criteo: tuple[tc.StackingPlan, list]) -> None:
    plan, batches = criteo
    base, _ = fdo.tune_limits(plan, batches)
    grown, report = fdo.tune_limits(plan, batches, headroom=0.25)
    for name, limits in report.limits.items():
        b = base.stacks[name]
        assert limits.max_ids_per_partition == -(-b.max_ids_per_partition * 5 // 4)
        assert limits.max_unique_ids_per_partition == -(-b.max_unique_ids_per_partition * 5 // 4)
        assert grown.stacks[name].max_ids_per_partition == limits.max_ids_per_partition


def test_tune_limits_rejects_bad_arguments(criteo: tuple[tc.StackingPlan, list]) -> None:
    plan, batches = criteo
    with pytest.raises(ValueError, match="no batches"):
        fdo.tune_limits(plan, [])
    with pytest.raises(ValueError, match="rounds"):
        fdo.tune_limits(plan, batches, rounds=0)
    with pytest.raises(ValueError, match="headroom"):
        fdo.tune_limits(plan, batches, headroom=-0.1)
    with pytest.raises(RuntimeError, match="still dropped after 1 rounds"):
        fdo.tune_limits(plan, batches, rounds=1)


def test_one_headroom_rule_for_tune_limits_and_the_limits_command() -> None:
    """100 with 10 % headroom is 110 (not 111, the float product's ceiling) everywhere."""
    from tilecore_apps._common import calibrate

    table = tc.TableSpec(name="t", vocab_size=1000, embedding_dim=8, max_ids_per_partition=100,
                         max_unique_ids_per_partition=50)
    plan = tc.stacking.stack_tables([tc.FeatureSpec(name="f", table=table, input_shape=(64, 1))],
                                    tc.Topology(global_devices=1, sc_per_device=4))
    grown = tc.fdo.with_headroom(plan, 0.1).stacks["t"]
    assert (grown.max_ids_per_partition, grown.max_unique_ids_per_partition) == (110, 55)
    with pytest.raises(ValueError, match="headroom must be a fraction >= 0"):
        tc.fdo.with_headroom(plan, -0.5)
    calibrated, stats = calibrate(plan, [{"f": tc.Ragged.from_rows([[1]] * 64)}], headroom=0.1)
    observed = tc.update_preprocessing_parameters(plan, stats).stacks["t"]
    assert calibrated.stacks["t"] == tc.fdo.with_headroom(
        tc.update_preprocessing_parameters(plan, stats), 0.1).stacks["t"]
    assert calibrated.stacks["t"].max_ids_per_partition >= observed.max_ids_per_partition
