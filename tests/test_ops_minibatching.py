"""The device loop over minibatches: minibatched buffers give the single-pass results.

Minibatched batches are built from single-pass ones with
`tilecore.testing.repack_minibatched` (every stacked row assigned to one minibatch),
and the minibatched plan's `max_ids_per_partition` is lowered to what one
minibatch's partitions hold, so the ops read tight windows, as they would after
host minibatching. Because rows are disjoint across minibatches, activations and
updated variables must equal the single pass (and the numpy oracle). The mesh
tests run in a subprocess with 4 fake CPU devices (this file run as a script).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import tilecore as tc
from _ops_cases import CASES, OPTIMIZERS, RICH, Case, assert_close, initial_slots, shard_slots
from tilecore.testing import reference_lookup, reference_lookup_grad, repack_minibatched

MB_CASES = {
    "stacked": CASES["table-stacking-sqrtn"],
    "three-stacks": CASES["mixed-no-stacking"],
    "feature-stacking": CASES["feature-stacking-mean"],
}
UPDATE_CASES = {
    name: dataclasses.replace(
        RICH.with_optimizer(name, OPTIMIZERS[name]), allow_id_dropping=False,
        tables=tuple(t.with_limits(max_ids_per_partition=256, max_unique_ids_per_partition=256)
                     for t in RICH.with_optimizer(name, OPTIMIZERS[name]).tables))
    for name in ("sgd", "adagrad", "adam")
}


def _hashed(num_minibatches: int, seed: int = 0) -> Any:
    """A random-looking row → minibatch map (a fixed permutation of rows, mod M)."""
    return lambda stack, rows: (rows.astype(np.int64) * 2654435761 + seed) % 1000003 % num_minibatches


def minibatched(case: Case, step: int, num_minibatches: int, devices: int = 1, *,
                buffer_size: int | None = None
                ) -> tuple[tc.StackingPlan, tc.PreprocessedBatch, tc.StackingPlan,
                           tc.PreprocessedBatch]:
    """(plan, single-pass batch, minibatched plan, minibatched batch) of one step."""
    plan = case.plan(devices)
    inputs, weights = case.batch(step)
    batch, stats = tc.preprocess(plan, inputs, weights)
    assert stats.dropped_ids == 0
    mbatch, most = repack_minibatched(plan, batch, num_minibatches, _hashed(num_minibatches),
                                      buffer_size=buffer_size)
    mplan = plan.with_config(enable_minibatching=True)
    for stack, count in most.items():
        mplan = mplan.with_stack_limits(stack, max_ids_per_partition=max(count, 1))
    return plan, batch, mplan, mbatch


def _variables(case: Case, plan: tc.StackingPlan) -> dict[str, Any]:
    import jax.numpy as jnp

    from tilecore import ops

    tables = ops.shard(plan, case.table_values())
    slots = shard_slots(plan, initial_slots(plan))
    return {name: ops.EmbeddingVariables(jnp.asarray(tables[name]),
                                         tuple(jnp.asarray(x) for x in slots[name]))
            for name in plan.stacks}


@pytest.mark.parametrize("num_minibatches", [1, 5])
@pytest.mark.parametrize("name", MB_CASES)
def test_lookup_equals_single_pass_and_oracle(name: str, num_minibatches: int,
                                              kernels: str) -> None:
    import jax

    from tilecore import ops

    case = MB_CASES[name]
    plan, batch, mplan, mbatch = minibatched(case, 0, num_minibatches)
    assert mplan.stacks != plan.stacks  # the windows follow the lowered limits
    tables = {k: v.table for k, v in _variables(case, plan).items()}
    single = ops.lookup(plan, batch, tables)
    got = jax.jit(lambda b, t: ops.lookup(mplan, b, t))(mbatch, tables)
    inputs, weights = case.batch(0)
    oracle = reference_lookup(plan, inputs, weights, case.table_values())
    assert got.keys() == oracle.keys()
    for feature, expected in oracle.items():
        assert_close(got[feature], expected, f"{name}: {feature} vs oracle")
        assert_close(got[feature], single[feature], f"{name}: {feature} vs single pass")


@pytest.mark.parametrize(("name", "num_minibatches"), [("sgd", 6), ("adagrad", 1), ("adam", 6)])
def test_lookup_grad_equals_single_pass(name: str, num_minibatches: int, kernels: str) -> None:
    """lookup_grad (at steps 3 and 4): tables and slots equal the single pass and the
    oracle; rows no minibatch touched keep their bits."""
    import jax

    from tilecore import ops

    case = UPDATE_CASES[name]
    plan = case.plan()
    single, multi = _variables(case, plan), _variables(case, plan)
    tables, slots = case.table_values(), initial_slots(plan)

    def update(plan: tc.StackingPlan, *args: Any) -> Any:
        return jax.jit(lambda *a: ops.lookup_grad(plan, *a))(*args)

    for step in (3, 4):
        _, batch, mplan, mbatch = minibatched(case, step, num_minibatches)
        grads = case.activation_grads(step)
        before = {k: np.asarray(v.table) for k, v in multi.items()}
        single = update(plan, batch, single, grads, step)
        multi = update(mplan, mbatch, multi, grads, step)
        inputs, weights = case.batch(step)
        tables, slots = reference_lookup_grad(plan, inputs, weights, tables, slots, grads, step)
        for stack in plan.stacks:
            for k, (a, b) in enumerate(zip(multi[stack], single[stack], strict=False)):
                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
                    assert_close(x, y, f"{name}: {stack}[{k}] at step {step}")
            after = np.asarray(multi[stack].table)
            same = np.all(after == before[stack], axis=1)
            assert 0 < same.sum() < len(same)  # some rows updated, others untouched
        got = ops.unshard(plan, {k: v.table for k, v in multi.items()})
        for table, expected in tables.items():
            assert_close(got[table], expected, f"{name}: table {table} vs oracle")


def test_changing_the_minibatch_count_does_not_recompile() -> None:
    import jax

    from tilecore import ops

    case = MB_CASES["stacked"]
    _, _, mplan, first = minibatched(case, 0, 1, buffer_size=4096)
    _, _, _, second = minibatched(case, 0, 7, buffer_size=4096)
    variables = _variables(case, case.plan())
    traces = {"lookup": 0, "lookup_grad": 0}

    def forward(batch: tc.PreprocessedBatch, variables: Any) -> Any:
        traces["lookup"] += 1
        return ops.lookup(mplan, batch, variables)

    def backward(batch: tc.PreprocessedBatch, variables: Any, grads: Any) -> Any:
        traces["lookup_grad"] += 1
        return ops.lookup_grad(mplan, batch, variables, grads)

    forward_jit, backward_jit = jax.jit(forward), jax.jit(backward)
    grads = case.activation_grads(0)
    results = []
    for batch in (first, second, first):
        results.append(forward_jit(batch, variables))
        backward_jit(batch, _variables(case, case.plan()), grads)
    assert traces == {"lookup": 1, "lookup_grad": 1}
    assert forward_jit._cache_size() == 1 and backward_jit._cache_size() == 1
    for feature in results[0]:
        assert_close(results[1][feature], results[0][feature], feature)


def test_training_update_through_minibatches() -> None:
    """embed + jax.grad + lookup_grad (training_update) equal the single pass."""
    import jax.numpy as jnp

    from tilecore import ops

    case = UPDATE_CASES["adagrad"]
    plan, batch, mplan, mbatch = minibatched(case, 0, 5)

    def loss(params: Any, activations: dict[str, Any]) -> Any:
        return sum(jnp.sum(jnp.tanh(a) * params) for a in activations.values())

    out = [ops.training_update(p, b, _variables(case, plan), loss, jnp.float32(0.5))
           for p, b in ((plan, batch), (mplan, mbatch))]
    assert_close(out[1][0], out[0][0], "loss")
    assert_close(out[1][1], out[0][1], "dense gradient")
    for stack in plan.stacks:
        assert_close(out[1][2][stack].table, out[0][2][stack].table, stack)


def test_repacked_layout() -> None:
    """The helper's buffers follow the layout contract: 64·S pointer blocks of max(N, 8),
    segments back to back SC-major then by minibatch, 8-aligned, filler elsewhere."""
    case = MB_CASES["stacked"]
    plan, batch, _, mbatch = minibatched(case, 0, 3)
    (stack,) = plan.stacks
    rp = np.asarray(mbatch.stacks[stack].row_pointers)[0]
    ids = np.asarray(mbatch.stacks[stack].embedding_ids)[0]
    n, s = plan.num_partitions, plan.topology.sc_per_device
    assert rp.shape == (max(n, 8) * 64 * s,) and mbatch.num_minibatches == 3
    blocks = rp.reshape(64 * s, max(n, 8))
    covered = np.zeros(ids.shape, bool)
    previous = 0
    for k in range(3 * s):
        for p in range(n):
            start = -(-previous // 8) * 8
            covered[start:blocks[k, p]] = True
            previous = blocks[k, p]
        assert np.all(blocks[k, n:] == -(-previous // 8) * 8)
    assert np.all(blocks[3 * s:] == -(-previous // 8) * 8)
    assert np.all(ids[~covered] == 2**31 - 1) and np.all(ids[covered] != 2**31 - 1)
    assert covered.sum() == np.sum(np.asarray(batch.stacks[stack].embedding_ids) != 2**31 - 1)


def test_buffer_entries_decode_the_layout() -> None:
    """Every position's validity, partition and SparseCore equal a numpy walk of the blocks."""
    import jax.numpy as jnp

    from tilecore.ops._layout import stack_layouts
    from tilecore.ops._minibatching import buffer_entries
    from tilecore.ops._per_device import flat_buffers

    case, m = MB_CASES["three-stacks"], 3
    _, _, mplan, mbatch = minibatched(case, 0, m)
    n, s = mplan.num_partitions, mplan.topology.sc_per_device
    assert s > 1
    for name, layout in stack_layouts(mplan).items():
        flat = flat_buffers(mbatch.stacks[name])
        entries, source = buffer_entries(*flat, layout, jnp.int32(m))
        rp = np.asarray(flat[0]).reshape(64 * s, max(n, 8))
        valid = np.zeros(flat[1].shape, bool)
        partition, sc = np.zeros(valid.shape, np.int64), np.zeros(valid.shape, np.int64)
        previous = 0
        for k in range(64 * s):
            for p in range(max(n, 8)):
                start, end = -(-previous // 8) * 8, rp[k, p]
                if p < n and k < m * s:
                    valid[start:end], partition[start:end], sc[start:end] = True, p, k // m
                previous = end
        assert valid.any() and not valid.all(), name
        np.testing.assert_array_equal(np.asarray(entries.valid), valid, err_msg=name)
        np.testing.assert_array_equal(np.asarray(entries.partitions)[valid], partition[valid])
        np.testing.assert_array_equal(np.asarray(source)[valid], sc[valid], err_msg=name)
        gains = np.asarray(entries.gains)
        assert np.all(gains[~valid] == 0) and np.all(gains[valid] == np.asarray(flat[3])[valid])


def test_one_device_update_does_not_loop(kernels: str) -> None:
    """On one device with XLA ops the update reads every minibatch in one pass (no while
    loop carrying the tables); the CPU kernels keep their per-minibatch loop."""
    import jax

    from tilecore import ops

    case = UPDATE_CASES["adagrad"]
    plan, _, mplan, mbatch = minibatched(case, 0, 4)
    text = jax.jit(lambda b, v, g: ops.lookup_grad(mplan, b, v, g)).lower(
        mbatch, _variables(case, plan), case.activation_grads(0)).as_text()
    assert ("stablehlo.while" in text) == (kernels == "ffi")


def test_wrong_pointer_count_names_the_stack() -> None:
    from tilecore import ops

    case = MB_CASES["stacked"]
    plan, batch, _, _ = minibatched(case, 0, 1)
    tables = {k: v.table for k, v in _variables(case, plan).items()}
    mplan = plan.with_config(enable_minibatching=True)
    with pytest.raises(ValueError, match=r"another plan; layout: plain \(batch\) vs "
                                         r"minibatched \(plan\)"):
        ops.lookup(mplan, batch, tables)
    # A batch built by hand (no signature) is still measured against the layout.
    bare = dataclasses.replace(batch, made_for=None)
    with pytest.raises(ValueError, match=r"Stack 'a_b_c'.*row_pointers must hold"):
        ops.lookup(mplan, bare, tables)


# --- on a mesh of fake CPU devices (in a subprocess) -----------------------------------------


MESH_RUNS = (("adam", 2, 5), ("sgd", 2, 1), ("adagrad", 4, 6), ("three-stacks", 4, 5))
"""(case, devices, minibatches) of the mesh test."""


def worker() -> None:
    """Run in the subprocess: each of MESH_RUNS on its mesh; assert equal to single pass."""
    import jax

    from tilecore import ops

    assert jax.device_count() == 4, jax.devices()
    cases = {**UPDATE_CASES, "three-stacks": MB_CASES["three-stacks"]}
    for name, devices, m in MESH_RUNS:
        mesh = jax.make_mesh((devices,), ("sparsecore",), devices=jax.devices()[:devices])
        case = cases[name]
        plan, batch, mplan, mbatch = minibatched(case, 0, m, devices)
        grads = case.activation_grads(0)
        out = []
        for p, b in ((plan, batch), (mplan, mbatch)):
            variables = _variables(case, plan)
            out.append(jax.jit(lambda b, v, g, p=p, mesh=mesh: (  # one program per plan: fast
                ops.lookup(p, b, v, mesh=mesh),
                ops.lookup_grad(p, b, v, g, 0, mesh=mesh)))(b, variables, grads))
        inputs, weights = case.batch(0)
        oracle = reference_lookup(plan, inputs, weights, case.table_values())
        where = f"{name} G={devices} M={m}"
        for feature, expected in oracle.items():
            assert_close(out[1][0][feature], expected, f"{where}: {feature}")
        for stack in plan.stacks:
            for x, y in zip(jax.tree.leaves(out[1][1][stack]),
                            jax.tree.leaves(out[0][1][stack]), strict=True):
                assert_close(x, y, f"{where}: {stack}")
        print("ok", where, flush=True)


@pytest.mark.parametrize("kernels", ["auto", "xla"])
def test_on_a_mesh(kernels: str) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TILECORE_KERNELS=kernels, XLA_FLAGS=" ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip())
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600, check=False, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, f"worker failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.count("ok ") == len(MESH_RUNS)


if __name__ == "__main__":
    worker()
