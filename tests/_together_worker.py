"""One process of a job whose processes disagree, then fail (started by test_hostile_processes.py).

`python _together_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR FAILING HOW AGREE`, with
XLA_FLAGS giving this process its CPU devices. It joins the JAX distributed runtime (gloo
collectives), installs `fail_together` (polling every 0.5 s; with HOW=kill a peer silent for
`SILENT_S` counts as dead), then:

1. disagree: the last process's plan has another learning rate. AGREE=ops: the first
   `ops.lookup` must raise the same ValueError on every process; AGREE=plans (three
   processes, whose devices no power-of-two topology spans): `agree_on_plan` must.
   What each saw goes to `seen-<process>.json`;
2. agree: with the same plan the lookup runs on the global mesh (ops), or the plans
   agree (plans). AGREE=none skips 1 and 2: nothing to compile;
3. fail: HOW=raise: process FAILING writes `failed-at` and raises an uncaught
   RuntimeError. HOW=kill: once every peer has read its liveness count, process FAILING
   writes `ready` and sleeps; the test kills it (SIGKILL). The others enter a collective
   it never joins (gloo raises when it dies), except that with HOW=kill the last process
   returns from `main` at once: its `done` must spare it from being taken for dead, and
   it must watch on in JAX's shutdown barrier, which waits for every peer (nothing
   raises). HOW=short: process FAILING returns after 2 training steps (`note_step`), the
   others begin a third and enter a collective it never joins. Every process must exit
   non-zero within a bounded time (the failed one with 1, or the signal, its peers with
   71; after HOW=short the finished one too, 71), never hang.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import tilecore as tc

SILENT_S = 4.0
"""The survivors' `silent_s`: small, so that the test waits seconds, not the default 30."""
POLL_S = 0.5
"""How often each process beats and reads its peers' beats (`fail_together`'s `poll_s`)."""


def main(me: int, count: int, port: int, out: Path, failing: int, how: str,
         agree: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from _distributed_worker import AXIS
    from tilecore import distributed

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=count,
                               process_id=me, initialization_timeout=60,
                               heartbeat_timeout_seconds=120)
    distributed.fail_together(poll_s=POLL_S, silent_s=SILENT_S if how == "kill" else 30.0)
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    seen: dict[str, Any] = {}

    def record(key: str, value: Any) -> None:
        seen[key] = value
        (out / f"seen-{me}.json").write_text(json.dumps(seen))

    if agree == "ops":
        run_lookups(me, count, mesh, record)
    elif agree == "plans":
        compare_plans(me, count, record)

    # 3. One process fails; the others wait for it in a collective.
    multihost_utils.sync_global_devices("before the failure")
    if how == "short":  # it ends normally after fewer training steps than its peers begin
        from tilecore.distributed._together import note_step

        for _ in range(2 if me == failing else 3):
            note_step()
        if me == failing:
            record("finished", time.time())
            (out / "failed-at").write_text(str(time.time()))
            return
    if me == failing and how == "raise":
        (out / "failed-at").write_text(str(time.time()))
        raise RuntimeError(f"empty batch on process {me} (on purpose)")
    if how == "kill" and me == count - 1 != failing:
        record("finished", time.time())
        return  # a normal exit: `done`, then JAX's shutdown barrier waits for every peer
    if me == failing:
        wait_until_peers_heard_me(me, count)
        (out / "ready").write_text(str(time.time()))
        time.sleep(300)  # killed here
    record("waiting_since", time.time())
    time.sleep(1.0)  # the failing process is gone by now
    total = jax.jit(lambda x: jnp.sum(x))(
        multihost_utils.host_local_array_to_global_array(
            jnp.ones((1,)), mesh, jax.sharding.PartitionSpec(AXIS)))
    multihost_utils.sync_global_devices("never reached")
    record("collective_returned", float(total))


def other_learning_rate(plan: tc.StackingPlan) -> tc.StackingPlan:
    """`plan` with table "a" trained at another learning rate."""
    table = plan.tables["a"]
    other = tc.SGD(learning_rate=0.5)
    return tc.stacking.stack_tables(
        [f if f.table.name != "a" else tc.FeatureSpec(
            name=f.name, table=tc.TableSpec(**{**vars(table), "optimizer": other}),
            input_shape=f.input_shape, output_shape=f.output_shape)
         for f in plan.features.values()], plan.topology)


def run_lookups(me: int, count: int, mesh: Any, record: Any) -> None:
    """Phases 1 and 2 through the ops: a plan that differs on the last process, then the
    same plan."""
    import jax

    from _distributed_worker import AXIS, OPS_CASE, multi_process_plan
    from _ops_cases import preprocess
    from tilecore import distributed, ops

    plan = multi_process_plan(OPS_CASE)
    batch, _ = preprocess(plan, *distributed.local_inputs(*OPS_CASE.batch(0), mesh=mesh,
                                                           axis=AXIS))
    batch = distributed.global_batch(batch, mesh, AXIS)
    variables = ops.init_tables(plan, jax.random.key(0), mesh=mesh, axis=AXIS)

    # 1. The last process trains table "a" with another learning rate.
    mine = other_learning_rate(plan) if me == count - 1 else plan
    try:
        ops.lookup(mine, batch, variables, mesh=mesh, axis=AXIS)
        record("disagree", None)
    except ValueError as error:
        record("disagree", str(error))

    # 2. The same plan everywhere runs.
    activations = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh, axis=AXIS))(
        batch, variables)
    record("agree", sorted(activations))


def compare_plans(me: int, count: int, record: Any) -> None:
    """Phases 1 and 2 through `agree_on_plan`, with a plan for four devices (processes
    compare plans; the plan need not fit this job's devices)."""
    from _distributed_worker import OPS_CASE
    from tilecore import distributed

    plan = OPS_CASE.plan(4)
    try:
        distributed.agree_on_plan(other_learning_rate(plan) if me == count - 1 else plan)
        record("disagree", None)
    except ValueError as error:
        record("disagree", str(error))
    distributed.agree_on_plan(plan)
    record("agree", sorted(plan.features))


def wait_until_peers_heard_me(me: int, count: int) -> None:
    """Return once every peer's watchdog has read this process's liveness count: two more
    beats of a peer, after the count is in the store, include one full read; a peer that
    is done beats no more but reads on, as often."""
    from tilecore.distributed._exchange import jax_store
    from tilecore.distributed._together import ALIVE_KEY, DONE

    store = jax_store()
    assert store is not None

    def counts() -> dict[str, str]:
        return {key.rsplit("/", 1)[-1]: value for key, value in store.key_value_dir_get(ALIVE_KEY)}

    while str(me) not in counts():
        time.sleep(0.05)
    start = counts()

    def heard(now: dict[str, str], peer: str) -> bool:
        return DONE in (start.get(peer), now.get(peer)) or (
            int(now.get(peer, "0")) >= int(start.get(peer, "0")) + 2)

    while not all(heard(counts(), str(p)) for p in range(count) if p != me):
        time.sleep(0.05)
    time.sleep(1.0)  # two polls of the peers that are done


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]),
         int(sys.argv[5]), sys.argv[6], sys.argv[7])
