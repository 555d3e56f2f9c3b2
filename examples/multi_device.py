"""Training on several devices with the native API, checked against one device.

Every table is mod-sharded over `devices × sc_per_device` logical SparseCores;
device d of a 1-D mesh holds the shards of its SparseCores, IDs travel to the
owning shard by all-to-all and pooled rows travel back. On a CPU the devices are
simulated (`--xla_force_host_platform_device_count`, set below before JAX starts);
on GPUs or TPUs the same code uses the real ones.

The script trains two tables (Adam and Adagrad, one of them serving two
features) and an optax dense model for a few steps on the mesh, then repeats the
run on one device from the same initial values: the losses and the final tables
agree (up to float summation order). The limits of both plans are tuned on the
batches first (`tilecore.fdo.tune_limits`): the default limits are a heuristic,
and a batch over them would raise `LimitExceededError`.

    python examples/multi_device.py                 # 4 devices x 4 SparseCores, batch 1024
    python examples/multi_device.py --devices 4 --sc-per-device 2 --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

import numpy as np

import tilecore as tc
from tilecore.fdo import tune_limits

AXIS = "sparsecore"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--sc-per-device", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024, help="global batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="batch 64, 6 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.steps = 64, 6
    return args


def feature_specs(batch: int) -> list[tc.FeatureSpec]:
    users = tc.TableSpec(name="users", vocab_size=500, embedding_dim=8,
                         optimizer=tc.Adam(learning_rate=0.1))
    items = tc.TableSpec(name="items", vocab_size=2000, embedding_dim=16, combiner="mean",
                         optimizer=tc.Adagrad(learning_rate=0.2))
    return [tc.FeatureSpec(name="user", table=users, input_shape=(batch, 1)),
            tc.FeatureSpec(name="clicked", table=items, input_shape=(batch, 4)),
            tc.FeatureSpec(name="viewed", table=items, input_shape=(batch, 8))]


def make_batches(features: list[tc.FeatureSpec], steps: int) -> list[dict[str, np.ndarray]]:
    """Deterministic IDs for every step, plus a label per sample."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        ids: dict[str, np.ndarray] = {
            f.name: rng.integers(0, f.table.vocab_size, size=f.input_shape)
            for f in features}
        ids["label"] = (ids["user"][:, 0] % 2).astype(np.float32)  # learnable from the user
        out.append(ids)
    return out


def plans(args: argparse.Namespace
          ) -> tuple[tc.StackingPlan, tc.StackingPlan, list[dict[str, np.ndarray]]]:
    """The mesh's plan, the one-device plan and the batches; both plans' limits tuned on
    the batches, so that none of them exceeds a limit."""
    features = feature_specs(args.batch)
    batches = make_batches(features, args.steps)
    sparse = [{name: ids[name] for name in (f.name for f in features)} for ids in batches]
    tuned = []
    for devices in (args.devices, 1):
        topology = tc.Topology(global_devices=devices, sc_per_device=args.sc_per_device)
        plan, _ = tune_limits(tc.plan_stacking(features, topology), sparse, num_threads=1)
        tuned.append(plan)
    return tuned[0], tuned[1], batches


def train(plan: tc.StackingPlan, tables: dict[str, np.ndarray], batches: list[dict[str, Any]],
          mesh: Any) -> tuple[list[float], dict[str, np.ndarray]]:
    """`len(batches)` jitted steps of `ops.training_update` + optax Adam on `mesh` (or one
    device when None), from per-table initial values; returns losses and final tables."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from tilecore import ops

    rows = None if mesh is None else NamedSharding(mesh, PartitionSpec(AXIS))
    variables = {name: v._replace(table=jax.device_put(ops.shard(plan, tables)[name], rows))
                 for name, v in ops.init_tables(plan, jax.random.key(0), mesh=mesh).items()}
    k1, k2 = jax.random.split(jax.random.key(2))
    params = {"w1": 0.3 * jax.random.normal(k1, (24, 16)), "b1": jnp.zeros(16),
              "w2": 0.3 * jax.random.normal(k2, (16,)), "b2": jnp.zeros(())}
    dense = optax.adam(0.05)
    opt_state = dense.init(params)

    def loss_fn(params: Any, acts: dict[str, jax.Array], labels: jax.Array) -> jax.Array:
        x = jnp.concatenate([acts["user"], acts["clicked"] * acts["viewed"]], axis=-1)
        logits = jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    @jax.jit
    def step_fn(batch: Any, labels: Any, variables: Any, params: Any, opt_state: Any,
                step: Any) -> tuple[Any, ...]:
        loss, grads, variables = ops.training_update(
            plan, batch, variables, lambda p, a: loss_fn(p, a, labels), params, step,
            mesh=mesh, axis=AXIS)
        updates, opt_state = dense.update(grads, opt_state, params)
        return loss, variables, optax.apply_updates(params, updates), opt_state

    losses = []
    # Under the mesh, the dense model's batch-sharded matmuls know where their results go.
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        for step, ids in enumerate(batches):
            batch, _ = tc.preprocess(plan, {name: ids[name] for name in plan.features})
            labels = jax.device_put(ids["label"], rows)
            loss, variables, params, opt_state = step_fn(batch, labels, variables, params,
                                                         opt_state, jnp.int32(step))
            losses.append(float(loss))
    stacked = {name: np.asarray(v.table) for name, v in variables.items()}
    return losses, ops.unshard(plan, stacked)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("multi_device: set the device count before JAX is imported.")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        f"--xla_force_host_platform_device_count={args.devices}"])
    import jax

    from tilecore import ops

    plan, single, batches = plans(args)
    mesh = jax.make_mesh((args.devices,), (AXIS,), devices=jax.devices()[: args.devices])
    print(f"{args.devices} devices x {args.sc_per_device} SparseCores = "
          f"{plan.topology.num_partitions} partitions; stacks {sorted(plan.stacks)}")

    # Initial values from init_tables on the mesh, reused for the one-device run.
    initial = {name: np.asarray(v.table)
               for name, v in ops.init_tables(plan, jax.random.key(1), mesh=mesh).items()}
    tables = ops.unshard(plan, initial)
    losses, final = train(plan, tables, batches, mesh)
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.5f}")

    single_losses, single_final = train(single, tables, batches, None)
    np.testing.assert_allclose(losses, single_losses, rtol=1e-4)
    for name in final:
        np.testing.assert_allclose(final[name], single_final[name], rtol=1e-4, atol=1e-5,
                                   err_msg=f"table {name}")
    gap = max(float(np.abs(final[n] - single_final[n]).max()) for n in final)
    print(f"one device: losses {[round(x, 5) for x in single_losses]}; "
          f"max |table difference| {gap:.2e}")
    if not losses[-1] < losses[0]:
        raise SystemExit(f"multi_device: loss did not go down: {losses}")
    print(f"multi_device: OK ({args.devices} devices match 1 device; "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
