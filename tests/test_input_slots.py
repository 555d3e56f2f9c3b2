"""Input workers' batches through shared memory (`tilecore_apps.dlrm._slots`, `ProcessBatches`):
equal to the thread path's bit for bit, slots reused only once unreferenced, batches of
any size, and no shared memory left behind on any exit path."""

from __future__ import annotations

import dataclasses
import gc
import io
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import _input_worker_sources
import tilecore as tc
from tilecore import data
from tilecore_apps import dlrm as training
from tilecore_apps.dlrm import _input, _slots, _workers


def _source(**options: object) -> _input_worker_sources.CheckedSource:
    base = data.clicks(seed=0, batch_size=64, vocab_sizes=(40, 300, 200, 60), multi_hot={2: 4})
    return _input_worker_sources.CheckedSource(base, **options)  # type: ignore[arg-type]


def _config(**changes: object) -> training.TrainConfig:
    base = dict(steps=4, eval_every=4, eval_batches=1, tune_batches=1, num_threads=1,
                topology=tc.Topology(global_devices=1, sc_per_device=2),
                model=training.ModelConfig(embedding_dim=8))
    return training.TrainConfig(**{**base, **changes})  # type: ignore[arg-type]


def _plan(source: _input_worker_sources.CheckedSource) -> tc.StackingPlan:
    config = _config()
    return tc.plan_stacking(training.click_features(source, config),  # type: ignore[arg-type]
                            config.topology)


def _bits(tree: object) -> list[bytes]:
    """Every array leaf's bytes (NaN filler compared bit for bit)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _ours() -> set[str]:
    """This process's slot directories in the shared-memory root."""
    root = _workers._shm_root()
    return {n for n in os.listdir(root) if n.startswith(f"tilecore-input-{os.getpid()}-")}


# The slots on their own, in one process.

@pytest.fixture
def slot_dir(tmp_path: Path) -> str:
    (tmp_path / "slots").mkdir()
    return str(tmp_path / "slots")


def _arrays() -> dict[str, np.ndarray]:
    frozen = np.arange(5, dtype=np.int32)
    frozen.flags.writeable = False
    return {"f32": np.linspace(0, 1, 1000, dtype=np.float32).reshape(10, 100),
            "fortran": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
            "strided": np.arange(20, dtype=np.int32)[::3],  # not contiguous: in the pickle
            "empty": np.zeros((3, 0), np.float32), "frozen": frozen,
            "nan": np.full(7, np.nan, np.float32)}


def test_slots_round_trip_every_kind_of_array(slot_dir: str) -> None:
    writer, reader = _slots.SlotWriter(slot_dir, 0, max_bytes=1 << 20), _slots.SlotReader(slot_dir)
    want = _arrays()
    got = reader.read(writer.write(reader.lend(), want))
    assert _bits(got) == _bits(want) and not os.listdir(slot_dir)  # unlinked once mapped
    assert [k for k, x in got.items() if x.flags.writeable] == ["strided"]  # the others: views
    writer.close()
    assert not os.path.exists(slot_dir)


def test_a_slot_is_lent_again_only_when_nothing_views_it(slot_dir: str) -> None:
    writer, reader = _slots.SlotWriter(slot_dir, 0, max_bytes=1 << 20), _slots.SlotReader(slot_dir)
    first = reader.read(writer.write(reader.lend(), np.arange(100, dtype=np.int32)))
    view = first[10:20]
    del first
    second_slot = reader.lend()
    assert second_slot == 1 and reader.held == 2  # a view of slot 0 lives: not lent again
    second = reader.read(writer.write(second_slot, np.full(100, -1, np.int32)))
    np.testing.assert_array_equal(view, np.arange(10, 20))  # untouched by the second batch
    del view, second
    assert reader.held == 0 and reader.lend() in (0, 1) and reader.slots == 2
    writer.close()


def test_a_batch_larger_than_its_slot_gets_a_larger_one(slot_dir: str) -> None:
    writer, reader = _slots.SlotWriter(slot_dir, 0, max_bytes=1 << 20), _slots.SlotReader(slot_dir)
    for size in (10, 50_000, 10, 60_000, 200_000):  # grows, shrinks (kept), grows again
        want = np.arange(size, dtype=np.float32)
        sent = writer.write(reader.lend(), want)
        assert sent.name is not None
        np.testing.assert_array_equal(reader.read(sent), want)
    assert reader.slots == 1
    big = np.arange(300_000, dtype=np.float32)  # over max_bytes: inside the pickle
    sent = writer.write(reader.lend(), big)
    assert sent.name is None and sent.spans == ()
    np.testing.assert_array_equal(reader.read(sent), big)
    assert reader.held == 0
    writer.close()


# Through worker processes.

def test_worker_batches_equal_the_thread_paths_bit_for_bit_and_outlive_later_ones() -> None:
    # Every batch is kept (on the devices, which on CPU alias the slots) until all are
    # taken: were a slot reused while an array still viewed it, a later batch would
    # overwrite an earlier one and the comparison below would fail.
    source = _source()
    inputs = _input.Inputs(source, _config(), _plan(source), None)
    with training.ProcessBatches(source, inputs.plan, start=1, stop=12, processes=2, depth=2,
                                 num_threads=1) as batches:
        kept = [inputs._worker_batch(batches, step) for step in range(1, 12)]
        if jax.default_backend() == "cpu":  # device arrays alias the slots: none is free
            assert max(n for n, _ in batches.slots) >= 5
        for step in range(1, 12):
            _check_prepared(kept[step - 1], inputs.train_batch(step))
        del kept
        gc.collect()
        assert all(held == 0 for _, held in batches.slots)  # nothing in the making or alive
    assert not _ours()


def _check_prepared(got: _input.Prepared, want: _input.Prepared) -> None:
    assert _bits(got[0]) == _bits(want[0]) and len(_bits(want[0])) > 6
    assert _bits(dataclasses.asdict(got[1])) == _bits(dataclasses.asdict(want[1]))
    assert got[2] == want[2]


def test_the_trainer_frees_each_slot_it_has_used() -> None:
    source = _source()
    plan = _plan(source)
    with training.ProcessBatches(source, plan, start=0, stop=20, processes=2, depth=2,
                                 num_threads=1) as batches:
        for step in range(20):  # as the trainer does: put on the devices, then let go
            host = batches.take(step)
            jax.block_until_ready(jax.device_put((host.sparse, host.dense, host.labels)))
        assert all(n <= 4 for n, _ in batches.slots)  # reused, not one per batch


@pytest.mark.parametrize("max_bytes", [_workers._MAX_SLOT_BYTES, 200_000])
def test_batches_of_changing_sizes_arrive_whole(monkeypatch: pytest.MonkeyPatch,
                                                max_bytes: int) -> None:
    # Steps 3 and 6 have 60x (~60 KB) and 500x (~500 KB) the dense bytes; with a 200 KB
    # limit the second travels inside the pickle.
    monkeypatch.setattr(_workers, "_MAX_SLOT_BYTES", max_bytes)
    source = _source(wide=((3, 60), (6, 500)))
    plan = _plan(source)
    with training.ProcessBatches(source, plan, start=1, stop=10, processes=2, depth=2,
                                 num_threads=1) as batches:
        for step in range(1, 10):
            got, want = batches.take(step), source.train_batch(step)
            assert got.dense.shape == want.dense.shape
            assert _bits((got.dense, got.labels)) == _bits((want.dense, want.labels))
            assert _bits(got.sparse) == _bits(tc.preprocess(plan, want.sparse)[0])


# Nothing left behind.

def test_a_crashed_worker_leaves_no_shared_memory() -> None:
    source = _source(crash_at=3)
    batches = training.ProcessBatches(source, _plan(source), start=0, stop=8, processes=2,
                                      depth=2, num_threads=1)
    directory = batches.slot_directory
    with pytest.raises(training.InputWorkerError, match="exited with status 7"), batches:
        assert [batches.take(i).labels.shape for i in range(3)] == [(64,)] * 3
        batches.take(3)
    assert not os.path.exists(directory) and not _ours()


def test_an_exception_in_the_trainer_leaves_no_shared_memory() -> None:
    # The eval batches are read after the workers have started.
    with pytest.raises(RuntimeError, match="no held-out data"):
        training.train(_source(fail_eval=True), _config(input_processes=2),
                       progress=io.StringIO())
    assert not _ours()
    with pytest.raises(ValueError, match="bad batch 2"):  # a worker's error, raised as itself
        training.train(_source(fail_at=2), _config(input_processes=2), progress=io.StringIO())
    assert not _ours()


def test_ctrl_c_leaves_no_shared_memory() -> None:
    source = _source(sleep_s=0.2)
    batches = training.ProcessBatches(source, _plan(source), start=0, stop=100, processes=2,
                                      depth=4, num_threads=1)
    directory, kept = batches.slot_directory, batches.take(0)
    with pytest.raises(KeyboardInterrupt), batches:
        batches.take(1)
        raise KeyboardInterrupt
    assert not os.path.exists(directory) and not _ours()
    np.testing.assert_array_equal(kept.labels, source.train_batch(0).labels)  # still valid


_KILLED_MAIN = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import _input_worker_sources, tilecore as tc
from tilecore import data
from tilecore_apps import dlrm
base = data.clicks(seed=0, batch_size=64, vocab_sizes=(40, 300), multi_hot=dict())
source = _input_worker_sources.CheckedSource(base)
config = dlrm.TrainConfig(topology=tc.Topology(global_devices=1, sc_per_device=2))
plan = tc.plan_stacking(dlrm.click_features(source, config), config.topology)
batches = dlrm.ProcessBatches(source, plan, start=0, stop=50, processes=2, depth=4, num_threads=1)
batches.take(0), batches.take(1)
print(batches.slot_directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_remove_their_slots_when_the_main_process_is_killed() -> None:
    script = _KILLED_MAIN.format(tests=str(Path(__file__).parent))
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(script)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    directory = child.stdout.strip()
    deadline = time.monotonic() + 60  # the orphaned workers see their stdin close, and exit
    while os.path.exists(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert directory.startswith(_workers._shm_root()) and not os.path.exists(directory)


def test_the_descriptor_is_small() -> None:
    # What crosses the pipe per batch: the pickle of structure, dtypes and shapes, not
    # the arrays' bytes.
    source = _source()
    plan = _plan(source)
    sparse, _ = tc.preprocess(plan, source.train_batch(0).sparse)
    batch = source.train_batch(0)
    with tempfile.TemporaryDirectory() as directory:
        writer = _slots.SlotWriter(directory, 0, max_bytes=1 << 20)
        sent = writer.write(0, (sparse, batch.dense, batch.labels))
        writer.close()
    array_bytes = sum(x.nbytes for x in jax.tree.leaves((sparse, batch.dense, batch.labels)))
    assert len(pickle.dumps(tuple(sent))) * 10 < array_bytes


def test_a_stopped_worker_is_ended_and_named_after_the_silence_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker stopped (SIGSTOP) or hung stalled training for ever."""
    monkeypatch.setattr(_workers, "SILENCE_S", 2.0)
    source = _source()
    with pytest.raises(training.InputWorkerError, match=r"Input worker \d \(pid \d+\) sent "
                                                        r"nothing for 2 s while preparing "
                                                        r"training batch \d+ \(stopped or hung\)"), \
            training.ProcessBatches(source, _plan(source), start=0, stop=30, processes=1,
                                    depth=1, num_threads=1) as batches:
        batches.take(0)
        for pid in batches.pids:
            os.kill(pid, signal.SIGSTOP)
        for step in range(1, 30):
            batches.take(step)
