"""One process of a job whose processes disagree, then fail (started by test_hostile_processes.py).

`python _together_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR FAILING`, with XLA_FLAGS
giving this process its CPU devices. It joins the JAX distributed runtime (gloo collectives), then:

1. disagree: the last process's plan has another learning rate; the first `ops.lookup`
   must raise the same ValueError on every process (recorded in `seen-<process>.json`);
2. agree: with the same plan the lookup runs on the global mesh;
3. fail: process FAILING writes `failed-at` and raises an uncaught RuntimeError; the
   others enter a collective it never joins. Every process must exit non-zero within a
   bounded time (the failed one with 1, its peers with 71), never hang.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import tilecore as tc
from _distributed_worker import AXIS, OPS_CASE, multi_process_plan
from _ops_cases import preprocess


def main(me: int, count: int, port: int, out: Path, failing: int) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from tilecore import distributed, ops

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=count,
                               process_id=me, initialization_timeout=60,
                               heartbeat_timeout_seconds=120)
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    seen: dict[str, Any] = {}

    def record(key: str, value: Any) -> None:
        seen[key] = value
        (out / f"seen-{me}.json").write_text(json.dumps(seen))

    plan = multi_process_plan(OPS_CASE)
    batch, _ = preprocess(plan, *distributed.local_inputs(*OPS_CASE.batch(0), mesh=mesh,
                                                           axis=AXIS))
    batch = distributed.global_batch(batch, mesh, AXIS)
    variables = ops.init_tables(plan, jax.random.key(0), mesh=mesh, axis=AXIS)

    # 1. The last process trains table "a" with another learning rate.
    table = plan.tables["a"]
    other = tc.SGD(learning_rate=0.5)
    mine = plan
    if me == count - 1:
        mine = tc.stacking.stack_tables(
            [f if f.table.name != "a" else tc.FeatureSpec(
                name=f.name, table=tc.TableSpec(**{**vars(table), "optimizer": other}),
                input_shape=f.input_shape, output_shape=f.output_shape)
             for f in plan.features.values()], plan.topology)
    try:
        ops.lookup(mine, batch, variables, mesh=mesh, axis=AXIS)
        record("disagree", None)
    except ValueError as error:
        record("disagree", str(error))

    # 2. The same plan everywhere runs.
    activations = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh, axis=AXIS))(
        batch, variables)
    record("agree", sorted(activations))

    # 3. One process fails; the others wait for it in a collective.
    multihost_utils.sync_global_devices("before the failure")
    if me == failing:
        (out / "failed-at").write_text(str(time.time()))
        raise RuntimeError(f"empty batch on process {me} (on purpose)")
    record("waiting_since", time.time())
    time.sleep(1.0)  # the failing process is gone by now
    total = jax.jit(lambda x: jnp.sum(x))(
        multihost_utils.host_local_array_to_global_array(
            jnp.ones((1,)), mesh, jax.sharding.PartitionSpec(AXIS)))
    multihost_utils.sync_global_devices("never reached")
    record("collective_returned", float(total))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]),
         int(sys.argv[5]))
