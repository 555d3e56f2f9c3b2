"""One process of a multi-process run (started by tests/test_distributed.py).

`python _distributed_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR PARTS`, with
XLA_FLAGS giving this process its CPU devices. It joins the JAX distributed runtime
(gloo collectives), then:

1. ops (and minibatching, when `tc.preprocess` takes an agreement): preprocesses
   its own rows of the global batch, runs `lookup` and `lookup_grad` on the mesh
   spanning all processes for a few steps, and saves its rows of the activations
   and the full updated tables
   (`ops-<plain|minibatching>-<process>.npz`);
2. agreement: OR over processes, key clean-up, statistics merged over processes,
   then a mismatched plan, a mismatched batch number and (last) a process that
   exits mid-step; what each process saw goes to `agreement-<process>.json`;
3. checkpoint: saves the case's tables (rows split over every process's devices, no
   process holds a whole one) and a sharded `extra` array at step 0, the tables + 1
   at step 1, restores step 0, then process 0 copies step 0's table files over step
   1's (valid files of other values: only the checksums can tell) and every process
   restores step 1; then the same for an `extra` leaf every process holds whole (a
   CRC-32 record, as one process saves), read onto every process's devices (steps 2
   and 3); what each saw goes to `checkpoint-<process>.json`.

PARTS is a comma-separated subset of `ops,minibatching,agreement,checkpoint`. It ends with
`os._exit(0)`: after a peer has died, JAX's shutdown barrier would wait for it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import tilecore as tc
from _ops_cases import Case, initial_slots, preprocess, shard_slots, table

AXIS = "sparsecore"
STEPS = 2
OPS_CASE = Case(
    "sgd-adagrad",
    (table("a", 37, 5, "mean", optimizer=tc.SGD(learning_rate=0.3)),
     table("b", 53, 11, "sqrtn", optimizer=tc.Adagrad(learning_rate=0.1))),
    (("fa", "a", 32), ("fb0", "b", 32), ("fb1", "b", 64)),
    weighted=("fa", "fb1"), seed=11,
)
"""Two stacks (SGD and Adagrad), feature stacking, weights, two combiners; small, since
every process compiles the ops for every case."""
MINIBATCH_LIMIT = 6
"""Per-partition limits of the minibatching case: small enough to force 4-5 minibatches
per step, large enough for every single hash bucket."""


def multi_process_plan(case: Case, minibatching: bool = False) -> tc.StackingPlan:
    """The case's plan for the global mesh, as this process preprocesses it."""
    import jax

    plan = case.plan(jax.device_count())
    plan = dataclasses.replace(plan, topology=tc.Topology(
        global_devices=jax.device_count(), sc_per_device=case.sc_per_device,
        local_devices=jax.local_device_count()))
    if minibatching:
        plan = plan.with_config(enable_minibatching=True)
        for stack in plan.stacks:
            plan = plan.with_stack_limits(stack, max_ids_per_partition=MINIBATCH_LIMIT,
                                          max_unique_ids_per_partition=MINIBATCH_LIMIT)
    return plan


def row_sharded_variables(plan: tc.StackingPlan, case: Case, rows: Any
                          ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The case's tables in the plan's shard layout (host arrays), and its variables (tables
    and initial slots) placed row-sharded by `rows` over the global mesh."""
    import jax

    from tilecore import ops

    tables = ops.shard(plan, case.table_values())
    slots = shard_slots(plan, initial_slots(plan))
    return tables, {n: ops.EmbeddingVariables(jax.device_put(tables[n], rows),
                                              tuple(jax.device_put(s, rows) for s in slots[n]))
                    for n in plan.stacks}


def run_ops(name: str, case: Case, mesh: Any, out: Path, minibatching: bool = False) -> None:
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from tilecore import distributed, ops
    from tilecore.ops._backend import wing

    plan = multi_process_plan(case, minibatching)
    agreement = distributed.DistributedAgreement(plan, timeout_s=60, name=f"ops-{name}")
    rows = NamedSharding(mesh, PartitionSpec(AXIS))
    _, variables = row_sharded_variables(plan, case, rows)
    forward = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh, axis=AXIS))
    backward = jax.jit(lambda b, v, g, t: ops.lookup_grad(plan, b, v, g, t, mesh=mesh, axis=AXIS),
                       donate_argnums=1)
    saved: dict[str, np.ndarray] = {}
    for step in range(STEPS):
        inputs, weights = distributed.local_inputs(*case.batch(step), mesh=mesh, axis=AXIS)
        if minibatching:
            batch, _ = tc.preprocess(plan, inputs, weights, batch_number=step,  # type: ignore[call-arg]
                                     agreement=agreement)
        else:
            batch, _ = preprocess(plan, inputs, weights)
        saved[f"{step}/num_minibatches"] = np.asarray(batch.num_minibatches)
        batch = distributed.global_batch(batch, mesh, AXIS)
        activations = forward(batch, variables)
        saved.update({f"{step}/act/{f}": a for f, a in distributed.to_local(activations).items()})
        grads = {f: g[distributed.process_rows(len(g), mesh, AXIS)]
                 for f, g in case.activation_grads(step).items()}
        variables = backward(batch, variables, distributed.to_global(grads, mesh, AXIS), step)
        for stack, v in variables.items():
            for k, array in enumerate((v.table, *v.slots)):
                saved[f"{step}/after/{stack}/{k}"] = np.asarray(
                    multihost_utils.process_allgather(array, tiled=True))
    saved["cpu_kernels"] = np.asarray(wing().name == "cpu")  # decided while tracing `forward`
    np.savez(out / f"ops-{name}-{jax.process_index()}.npz", allow_pickle=False, **saved)


def run_agreement(out: Path) -> None:
    """The agreement scenarios; each process records what it saw (errors included)."""
    import jax

    from tilecore import distributed
    from tilecore.distributed._exchange import jax_store

    me, count = jax.process_index(), jax.process_count()
    plan = multi_process_plan(OPS_CASE)
    seen: dict[str, Any] = {}
    path = out / f"agreement-{me}.json"

    def record(key: str, value: Any) -> None:
        seen[key] = value
        path.write_text(json.dumps(seen))

    agreement = distributed.DistributedAgreement(plan, timeout_s=30, name="main")
    record("or", agreement.all_reduce_or(0, "required", 1 << me))
    record("split", agreement.all_reduce_or(0, "split", 1 << 63 if me == count - 1 else 0))
    for batch in range(1, 21):
        agreement.all_reduce_or(batch, "required", 0)
    store = jax_store()
    assert store is not None
    mine = [k for k, _ in store.key_value_dir_get("tilecore/agreement/main/")
            if k.endswith(f"/{me}")]
    record("own_keys_after_22_calls", len(mine))
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    _, stats = preprocess(plan, *distributed.local_inputs(*OPS_CASE.batch(0),
                                                         mesh=mesh, axis=AXIS))
    merged = distributed.max_over_processes(stats, agreement, batch_number=21)
    record("stats", {
        f"{tag}/{field}": {k: np.asarray(v).tolist() for k, v in getattr(s, field).items()}
        for tag, s in (("local", stats), ("merged", merged))
        for field in ("max_ids_per_partition", "max_unique_ids_per_partition",
                      "required_buffer_size_per_sc", "id_drop_counters")})

    other = plan.with_stack_limits(next(iter(plan.stacks)), max_ids_per_partition=100)
    try:
        distributed.DistributedAgreement(other if me == count - 1 else plan, timeout_s=30,
                                         name="plans")
        record("plan_error", None)
    except ValueError as error:
        record("plan_error", str(error))

    skewed = distributed.DistributedAgreement(plan, timeout_s=30, name="batches")
    try:
        skewed.all_reduce_or(7 if me == 0 else 8, "required", 1)
        record("batch_error", None)
    except ValueError as error:
        record("batch_error", str(error))

    dying = distributed.DistributedAgreement(plan, timeout_s=2.0, name="exit")
    dying.all_reduce_or(0, "required", 1)
    if me == count - 1:
        (out / f"done-{me}").write_text("left mid-step on purpose")
        os._exit(0)  # gone mid-step: its peers must name it, not hang
    start = time.monotonic()
    try:
        dying.all_reduce_or(1, "required", 1)
        record("timeout_error", None)
    except TimeoutError as error:
        record("timeout_error", str(error))
    record("timeout_after_s", time.monotonic() - start)


def _swapped_error(root: Path, item: str, source: int, damaged: int,
                   restore: Callable[[], Any]) -> str | None:
    """Process 0 copies step `source`'s `item` files over step `damaged`'s (valid files
    of other values: only the checksums can tell); then every process restores: the
    error it raises (None: none)."""
    import shutil

    import jax
    from jax.experimental import multihost_utils

    import tilecore.checkpoint as ck

    multihost_utils.sync_global_devices(f"{item} saved")
    if jax.process_index() == 0:
        shutil.rmtree(root / str(damaged) / item)
        shutil.copytree(root / str(source) / item, root / str(damaged) / item)
    multihost_utils.sync_global_devices(f"{item} damaged")
    try:
        restore()
    except ck.CheckpointCorruptError as error:
        return str(error)
    return None


def run_checkpoint(mesh: Any, out: Path) -> None:
    """Save, restore, swap files, restore again, on every process."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    import tilecore.checkpoint as ck

    me = jax.process_index()
    plan = multi_process_plan(OPS_CASE)
    rows = NamedSharding(mesh, PartitionSpec(AXIS))
    tables, variables = row_sharded_variables(plan, OPS_CASE, rows)
    dense = np.arange(jax.device_count() * 3, dtype=np.float32).reshape(-1, 3)
    extra = {"dense": jax.device_put(dense, rows)}
    root = out / "checkpoint"
    seen: dict[str, Any] = {"spans_processes": not variables["a"].table.is_fully_addressable}
    ck.save(root, plan, variables, step=0, extra=extra)
    ck.save(root, plan, {n: v._replace(table=v.table + 1) for n, v in variables.items()},
            step=1)
    checksums = ck.read_metadata(root, step=0)["checksums"]
    seen["records"] = [sorted(checksums["embeddings"]["a"]["table"]),
                       sorted(checksums["extra"]["dense"])]
    restored = ck.restore(root, plan, step=0, mesh=mesh, axis=AXIS,
                          extra={"dense": jax.ShapeDtypeStruct(dense.shape, jnp.float32,
                                                               sharding=rows)})
    seen["restored_equal"] = bool(np.array_equal(
        multihost_utils.process_allgather(restored.variables["a"].table, tiled=True),
        tables["a"]) and np.array_equal(
        multihost_utils.process_allgather(restored.extra["dense"], tiled=True), dense))
    seen["error"] = _swapped_error(root, "embeddings", 0, 1, lambda: ck.restore(
        root, plan, step=1, mesh=mesh, axis=AXIS))
    # An `extra` leaf every process holds whole (as one process saves it): a CRC-32
    # record, checked when it is read onto devices of several processes.
    target = {"host": jax.ShapeDtypeStruct(dense.shape, jnp.float32, sharding=rows)}
    for step, values in ((2, dense), (3, dense + 1)):
        ck.save(root, plan, variables, step=step, extra={"host": values})
    seen["host_record"] = sorted(ck.read_metadata(root, step=2)["checksums"]["extra"]["host"])
    host = ck.restore(root, plan, step=3, mesh=mesh, axis=AXIS, extra=target).extra["host"]
    seen["host_restored_equal"] = bool(not host.is_fully_addressable and np.array_equal(
        multihost_utils.process_allgather(host, tiled=True), dense + 1))
    seen["host_error"] = _swapped_error(root, "extra", 3, 2, lambda: ck.restore(
        root, plan, step=2, mesh=mesh, axis=AXIS, extra=target))
    # Processes that save different steps, or per-process host values in `extra` (Orbax
    # writes process 0's), are told so on every process before anything is written.
    for key, save in (("step_error", lambda: ck.save(root, plan, variables, step=4 + me)),
                      ("extra_error", lambda: ck.save(root, plan, variables, step=6,
                                                      extra={"position": np.int64(1000 + me)}))):
        try:
            save()
            seen[key] = None
        except ValueError as error:
            seen[key] = str(error)
    seen["steps_after"] = list(ck.available_steps(root))
    (out / f"checkpoint-{me}.json").write_text(json.dumps(seen))


def main(process_id: int, num_processes: int, port: int, out: Path, parts: list[str]) -> None:
    import jax

    started = time.monotonic()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=60, heartbeat_timeout_seconds=60)
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    if "ops" in parts:
        run_ops("plain", OPS_CASE, mesh, out)
    if "minibatching" in parts:
        run_ops("minibatching", OPS_CASE, mesh, out, minibatching=True)
    ops_done = time.monotonic()
    if "checkpoint" in parts:
        run_checkpoint(mesh, out)
    if "agreement" in parts:
        run_agreement(out)
    (out / f"done-{process_id}").write_text(json.dumps(
        {"ops_s": ops_done - started, "total_s": time.monotonic() - started}))
    if process_id == 0:
        # Process 0 hosts the coordination service: a peer still working when it
        # goes is aborted by JAX ("another task died"). Leave only once all are done.
        deadline = time.monotonic() + 60
        while (time.monotonic() < deadline
               and not all((out / f"done-{p}").exists() for p in range(num_processes))):
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]),
         sys.argv[5].split(","))
