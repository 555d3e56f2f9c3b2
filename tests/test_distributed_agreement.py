"""DistributedAgreement in one process: threads play the processes over an in-memory
key-value store with the semantics of JAX's (blocking get with a deadline, directory
listing, delete). Fast checks of the protocol; test_distributed.py runs it for real."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tilecore as tc
from _distributed_worker import OPS_CASE
from tilecore.distributed import DistributedAgreement, max_over_processes
from tilecore.distributed._arrays import _slice_rows


class MemoryStore:
    """JAX's key-value store, in memory: a deadline error names DEADLINE_EXCEEDED."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self._changed = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self._changed:
            if key in self.data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.data[key] = value
            self._changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self.data, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.data[key]

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        with self._changed:
            return [(k, v) for k, v in self.data.items() if k.startswith(key)]

    def key_value_delete(self, key: str) -> None:
        with self._changed:
            self.data.pop(key, None)


def plan_for(processes: int) -> tc.StackingPlan:
    plan = OPS_CASE.plan(4)
    return dataclasses.replace(plan, topology=tc.Topology(
        global_devices=4, sc_per_device=OPS_CASE.sc_per_device, local_devices=4 // processes))


def run_processes(count: int, body: Callable[[int, MemoryStore], Any], store: MemoryStore
                  ) -> list[Any]:
    """`body(process, store)` on `count` threads; each result or the exception raised."""
    results: list[Any] = [None] * count

    def run(p: int) -> None:
        try:
            results[p] = body(p, store)
        except Exception as error:
            results[p] = error

    threads = [threading.Thread(target=run, args=(p,)) for p in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a process hung"
    return results


def agreement(p: int, store: MemoryStore, count: int, plan: tc.StackingPlan | None = None,
              name: str = "t", timeout_s: float = 60.0) -> DistributedAgreement:
    """One simulated process's agreement; its rounds wait `timeout_s` (generous: the threads
    share a test worker's core with the suite's other workers, and once took 10 s)."""
    return DistributedAgreement(plan or plan_for(count), timeout_s=timeout_s, name=name,
                                store=store, process_id=p, process_count=count)


@pytest.mark.parametrize("count", [2, 4])
def test_or_over_processes_and_bounded_keys(count: int) -> None:
    store = MemoryStore()

    def body(p: int, store: MemoryStore) -> list[int]:
        a = agreement(p, store, count)
        return [a.all_reduce_or(b, "required", (1 << p) | (1 << 63 if b == 5 else 0))
                for b in range(30)]

    results = run_processes(count, body, store)
    expected = [(1 << count) - 1 | (1 << 63 if b == 5 else 0) for b in range(30)]
    assert results == [expected] * count
    assert len(store.data) <= 2 * count  # only the last calls' keys remain


def test_a_new_store_never_inherits_a_freed_stores_agreement_count() -> None:
    """Agreements are numbered per store: a store made at a freed store's address (as
    CPython reuses them) starts afresh. Numbered by `id(store)`, two processes of a
    4-process job continued a freed 2-process store's count and all four timed out
    (seen in CI: processes [0, 1] and [2, 3] each waited for the other pair)."""
    def one_job(count: int) -> list[Any]:
        return run_processes(count, lambda p, s: agreement(p, s, count)
                             .all_reduce_or(0, "required", 1 << p), MemoryStore())

    for count in [2, 4] * 4:  # without the fix, a 4-process job here soon times out (60 s)
        assert one_job(count) == [(1 << count) - 1] * count


def test_single_process_needs_no_store() -> None:
    a = DistributedAgreement(OPS_CASE.plan(1))
    assert a.process_count == 1
    assert a.all_reduce_or(3, "split", 5) == 5
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        a.all_reduce_or(3, "split", 1 << 64)


def test_plan_topology_must_match_the_process_count() -> None:
    with pytest.raises(ValueError, match="local_devices=4"):
        DistributedAgreement(plan_for(2), process_id=0, process_count=1)
    with pytest.raises(RuntimeError, match=r"jax\.distributed\.initialize"):
        DistributedAgreement(plan_for(2), process_id=0, process_count=2)


def test_different_tables_name_process_and_field() -> None:
    store = MemoryStore()
    base = OPS_CASE.feature_specs()
    changed = [dataclasses.replace(f, table=dataclasses.replace(f.table, combiner="sum"))
               if f.table.name == "b" else f for f in base]
    other = tc.plan_stacking(changed, plan_for(2).topology)
    results = run_processes(
        2, lambda p, s: agreement(p, s, 2, other if p == 1 else plan_for(2)), store)
    for error in results:
        assert isinstance(error, ValueError)
        assert "process 1 vs process 0, table 'b': spec.combiner: \"sum\" vs \"sqrtn\"" in str(
            error)


def test_timeout_names_the_missing_process() -> None:
    store = MemoryStore()

    started = threading.Barrier(4)

    def body(p: int, store: MemoryStore) -> float:
        # The threads begin together and compare no plan first: on a busy machine, their
        # start alone could outlast the 0.3 s the rounds are given.
        a = DistributedAgreement(None, timeout_s=0.3, name="t", store=store, process_id=p,
                                 process_count=4)
        started.wait()
        a.all_reduce_or(0, "required", 1)
        if p == 1:
            return 0.0  # leaves before batch 1
        start = time.monotonic()
        a.all_reduce_or(1, "required", 1)
        return time.monotonic() - start

    results = run_processes(4, body, store)
    for p in (0, 2, 3):
        assert isinstance(results[p], TimeoutError)
        assert "processes [1] did not reach batch 1, round 'required' within 0.3 s" in str(
            results[p])


def test_round_mismatch_raises_on_both() -> None:
    results = run_processes(2, lambda p, s: agreement(p, s, 2).all_reduce_or(
        4, "required" if p == 0 else "split", 1), MemoryStore())
    assert all(isinstance(e, ValueError) and "round 'split'" in str(e)
               and "round 'required'" in str(e) for e in results)


def test_max_over_processes() -> None:
    inputs, weights = OPS_CASE.batch(0)

    def body(p: int, store: MemoryStore) -> tuple[tc.PreprocessStats, tc.PreprocessStats]:
        local_in, local_w = {}, {}
        for f, v in inputs.items():
            rows = v.num_rows // 2
            local_in[f], w = _slice_rows(f, v, slice(p * rows, (p + 1) * rows), weights.get(f))
            if w is not None:
                local_w[f] = w
        _, stats = tc.preprocess(plan_for(2), local_in, local_w)
        return stats, max_over_processes(stats, agreement(p, store, 2), batch_number=0)

    (s0, m0), (s1, m1) = run_processes(2, body, MemoryStore())
    for stack in s0.max_ids_per_partition:
        want = np.maximum(s0.max_ids_per_partition[stack], s1.max_ids_per_partition[stack])
        np.testing.assert_array_equal(m0.max_ids_per_partition[stack], want)
        np.testing.assert_array_equal(m1.max_ids_per_partition[stack], want)


def test_minibatching_split_agreed_and_buffers_equal_one_process() -> None:
    """Two processes' buffers, concatenated, are one process's buffers on every device."""
    plan = plan_for(1).with_config(enable_minibatching=True)
    for stack in plan.stacks:
        plan = plan.with_stack_limits(stack, max_ids_per_partition=6,
                                      max_unique_ids_per_partition=6)
    local_plan = dataclasses.replace(plan, topology=plan_for(2).topology)
    inputs, weights = OPS_CASE.batch(1)
    whole, _ = tc.preprocess(plan, inputs, weights)

    def body(p: int, store: MemoryStore) -> tc.PreprocessedBatch:
        local_in, local_w = {}, {}
        for f, v in inputs.items():
            rows = v.num_rows // 2
            local_in[f], w = _slice_rows(f, v, slice(p * rows, (p + 1) * rows), weights.get(f))
            if w is not None:
                local_w[f] = w
        return tc.preprocess(local_plan, local_in, local_w, batch_number=1,
                             agreement=agreement(p, store, 2, local_plan))[0]

    parts = run_processes(2, body, MemoryStore())
    assert whole.num_minibatches > 1
    for stack, buffers in whole.stacks.items():
        assert all(part.num_minibatches == whole.num_minibatches for part in parts)
        for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            np.testing.assert_array_equal(
                np.concatenate([getattr(part.stacks[stack], field) for part in parts]),
                getattr(buffers, field), f"{stack}.{field}")


def test_slice_rows_of_every_input_form() -> None:
    ragged = tc.Ragged.from_rows([[1], [2, 3], [], [4, 5, 6]])
    flat_w = np.arange(6, dtype=np.float32)
    part, w = _slice_rows("f", ragged, slice(1, 3), flat_w)
    assert isinstance(part, tc.Ragged)
    assert part.values.tolist() == [2, 3] and part.row_splits.tolist() == [0, 2, 2]
    assert w is not None and w.tolist() == [1.0, 2.0]
    dense = np.arange(12).reshape(4, 3)
    part, w = _slice_rows("f", dense, slice(2, 4), dense * 0.5)
    np.testing.assert_array_equal(part, dense[2:])
    np.testing.assert_array_equal(w, dense[2:] * 0.5)
    with pytest.raises(TypeError, match="Feature 'f'"):
        _slice_rows("f", [[1]], slice(0, 1), None)


def test_local_inputs_refuses_weights_of_features_it_lacks() -> None:
    """Weights under a misspelt feature name were left out in silence."""
    import jax
    from jax.sharding import Mesh

    from tilecore.distributed import local_inputs

    mesh = Mesh(np.array(jax.devices()[:1]), ("sparsecore",))
    ids = {"user": np.arange(8).reshape(8, 1)}
    with pytest.raises(ValueError, match=r"local_inputs: weights given for features \['usr'\] "
                                         r"that the inputs lack \(features: \['user'\]\)"):
        local_inputs(ids, {"usr": np.ones((8, 1))}, mesh=mesh)
    inputs, weights = local_inputs(ids, {"user": np.ones((8, 1))}, mesh=mesh)
    assert set(inputs) == set(weights) == {"user"}


def test_process_rows_checks_its_count_and_the_mesh_axis() -> None:
    """slice(0, -4), slice(0.0, 16.0) and a bare KeyError before."""
    import jax
    from jax.sharding import Mesh

    from tilecore.distributed import process_rows

    mesh = Mesh(np.array(jax.devices()[:1]), ("sparsecore",))
    for rows in (-4, 16.0, True):
        with pytest.raises(ValueError, match="global_rows must be an integer >= 0"):
            process_rows(rows, mesh)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"the mesh has axes \('sparsecore',\), not 'x'"):
        process_rows(16, mesh, axis="x")
    assert process_rows(16, mesh) == slice(0, 16)
