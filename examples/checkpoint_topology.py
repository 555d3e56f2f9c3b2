"""Save a checkpoint on one topology, restore it on another.

A job trains for a few steps on 1 device × 4 SparseCores with the pipelined
step (`tilecore.pipelining`: the SparseCore work of step i overlaps the dense
work of step i−1), then saves its tables, optimizer slots and dense state with
`tilecore.checkpoint.save`. It then restores the checkpoint as a job on 2
devices × 2 SparseCores would, onto a 2-device mesh. The tables are mod-sharded
over 4 partitions either way, but the stacked layout differs: the k-th table of
a stack starts its shards at partition k·(SparseCores per device) mod 4, so
`items`, stacked after `users`, starts at 0 on 1×4 and at 2 on 2×2. `restore`
therefore unshards every table and slot to `[vocab, dim]` on the host and
reshards it for the new plan.

Checks: `export_tables` (the serving view: plain `[vocab, dim]` per table) is
bit-identical before the save, from the checkpoint directory and after the
restore, and so are the optimizer slots and the dense state; a lookup on the
restored tables, through the all-to-all of the 2-device mesh, matches the
one-device lookup before the save and a numpy oracle; the training loss went
down.

On a CPU the two devices are simulated (`--xla_force_host_platform_device_count`,
set below before JAX starts); on GPUs or TPUs the same code uses real ones.

    python examples/checkpoint_topology.py            # batch 1024, 20 steps
    python examples/checkpoint_topology.py --tiny     # seconds, as the test suite runs it
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import tilecore as tc

AXIS = "sparsecore"
SAVE_TOPOLOGY = tc.Topology(global_devices=1, sc_per_device=4)
RESTORE_TOPOLOGY = tc.Topology(global_devices=2, sc_per_device=2)
CYCLE = 4  # distinct batches, trained in turn


def feature_specs(batch: int) -> list[tc.FeatureSpec]:
    """Three tables: `users` and `items` (same width, optimizer and combiner) share a
    stack, `ads` (Adam) has its own; `items` serves two features."""
    users = tc.TableSpec(name="users", vocab_size=300, embedding_dim=8, combiner="mean",
                         optimizer=tc.Adagrad(learning_rate=0.2))
    items = tc.TableSpec(name="items", vocab_size=1000, embedding_dim=8, combiner="mean",
                         optimizer=tc.Adagrad(learning_rate=0.2))
    ads = tc.TableSpec(name="ads", vocab_size=200, embedding_dim=8,
                       optimizer=tc.Adam(learning_rate=0.02))
    return [tc.FeatureSpec(name="user", table=users, input_shape=(batch, 1)),
            tc.FeatureSpec(name="ad", table=ads, input_shape=(batch, 1)),
            tc.FeatureSpec(name="clicked", table=items, input_shape=(batch, 4)),
            tc.FeatureSpec(name="viewed", table=items, input_shape=(batch, 8))]


def make_plan(features: list[tc.FeatureSpec], topology: tc.Topology,
              batches: list[dict[str, np.ndarray]]) -> tc.StackingPlan:
    """The stacking plan for `topology`, with limits under which `batches` fit."""
    plan, _ = tc.tune_limits(tc.plan_stacking(features, topology), batches)
    return plan


def make_ids(features: list[tc.FeatureSpec], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f.name: rng.integers(0, f.table.vocab_size, f.input_shape) for f in features}


def train_and_save(features: list[tc.FeatureSpec], steps: int, directory: Path
                   ) -> tuple[list[float], tc.StackingPlan, dict[str, Any], Any]:
    """Pipelined training on `SAVE_TOPOLOGY` (one device), then `checkpoint.save`.

    Returns the losses, the plan, and the saved variables and dense state.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from tilecore import checkpoint, ops, pipelining

    rng = np.random.default_rng(0)
    distinct = [make_ids(features, rng) for _ in range(CYCLE)]  # cycled: the loss goes down
    plan = make_plan(features, SAVE_TOPOLOGY, distinct)
    inputs = []
    for step in range(steps):
        ids = distinct[step % len(distinct)]
        labels = ((ids["user"][:, 0] + ids["ad"][:, 0]) % 2).astype(np.float32)  # learnable
        inputs.append(pipelining.StepInput(tc.preprocess(plan, ids)[0], {"labels": labels}))

    def loss_fn(params: Any, acts: dict[str, jax.Array], dense: dict[str, jax.Array]
                ) -> jax.Array:
        x = jnp.concatenate([acts["user"], acts["ad"], acts["clicked"] * acts["viewed"]], -1)
        logits = jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
        return optax.sigmoid_binary_cross_entropy(logits, dense["labels"]).mean()

    k1, k2 = jax.random.split(jax.random.key(1))
    params = {"w1": 0.3 * jax.random.normal(k1, (24, 16)), "b1": jnp.zeros(16),
              "w2": 0.3 * jax.random.normal(k2, (16,)), "b2": jnp.zeros(())}
    dense_optimizer = optax.adam(0.02)
    stages = pipelining.sparsecore_stages(plan, pipelining.optax_tc(loss_fn, dense_optimizer))
    train_step = pipelining.TrainStep(stages=stages, pipelined=True)
    state = train_step.init(ops.init_tables(plan, jax.random.key(0)),
                            pipelining.DenseState.create(params, dense_optimizer), inputs[0])
    run = pipelining.run_loop(train_step, state, inputs)
    losses = [float(result.outputs) for result in run]
    variables, dense = run.state.variables, run.state.dense  # every update applied
    path = checkpoint.save(directory, plan, variables, step=steps, extra=dense)
    print(f"saved {SAVE_TOPOLOGY.global_devices}x{SAVE_TOPOLOGY.sc_per_device} "
          f"(stacks {sorted(plan.stacks)}) at step {steps}: {path}")
    return losses, plan, dict(variables), dense


def check_same(what: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Bit-identical per-name arrays (NaN-free float32: `array_equal` is exact)."""
    if set(got) != set(want):
        raise SystemExit(f"checkpoint_topology: {what}: names {sorted(got)} != {sorted(want)}")
    for name in want:
        if got[name].dtype != want[name].dtype or not np.array_equal(got[name], want[name]):
            raise SystemExit(f"checkpoint_topology: {what} {name!r} differs after the round "
                             f"trip (max |diff| {np.abs(got[name] - want[name]).max():.3g}).")


def slots_of(states: dict[str, Any]) -> dict[str, np.ndarray]:
    """`"table/slot i"` → the slot's `[vocab, dim]` values."""
    return {f"{table}/slot {i}": np.asarray(slot) for table, state in states.items()
            for i, slot in enumerate(state.slots)}


def restore_and_check(features: list[tc.FeatureSpec], directory: Path,
                      saved_plan: tc.StackingPlan, saved: dict[str, Any], saved_dense: Any
                      ) -> float:
    """Restore onto `RESTORE_TOPOLOGY` on a mesh; check tables, slots, dense state, lookup.

    Returns the largest |restored lookup − one-device lookup|.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from tilecore import checkpoint, ops
    from tilecore.testing import reference_lookup

    ids = make_ids(features, np.random.default_rng(7))  # a fresh batch for the lookups
    plan = make_plan(features, RESTORE_TOPOLOGY, [ids])
    mesh = jax.make_mesh((RESTORE_TOPOLOGY.global_devices,), (AXIS,),
                         devices=jax.devices()[: RESTORE_TOPOLOGY.global_devices])
    # The dense state comes back in the structure and placement of this target.
    replicated = NamedSharding(mesh, PartitionSpec())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                          saved_dense)
    restored = checkpoint.restore(directory, plan, mesh=mesh, axis=AXIS, extra=target)
    rotations = {t: (saved_plan.table_settings[t].shard_rotation,
                     plan.table_settings[t].shard_rotation) for t in plan.tables}
    print("shard rotation per table (saved, restored):", rotations)
    if all(before == after for before, after in rotations.values()):
        raise SystemExit("checkpoint_topology: the two layouts agree; nothing to convert.")
    rows = NamedSharding(mesh, PartitionSpec(AXIS, None))
    for name, var in restored.variables.items():
        if not all(a.sharding.is_equivalent_to(rows, 2) for a in (var.table, *var.slots)):
            raise SystemExit(f"checkpoint_topology: stack {name!r} is not split by rows over "
                             f"the mesh: {var.table.sharding}")

    # The serving view: in memory before the save, from the directory, after the restore.
    exported = checkpoint.export_tables(saved, saved_plan)
    check_same("table (checkpoint directory)", checkpoint.export_tables(directory), exported)
    check_same("table (restored)", checkpoint.export_tables(restored.variables, plan), exported)
    check_same("optimizer slot", slots_of(checkpoint.unshard_variables(plan, restored.variables)),
               slots_of(checkpoint.unshard_variables(saved_plan, saved)))
    dense_pairs = zip(jax.tree.leaves(restored.extra), jax.tree.leaves(saved_dense), strict=True)
    if not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in dense_pairs):
        raise SystemExit("checkpoint_topology: the dense state differs after the round trip.")
    print(f"restored {RESTORE_TOPOLOGY.global_devices}x{RESTORE_TOPOLOGY.sc_per_device} "
          f"on {mesh.devices.size} devices: tables {sorted(exported)}, slots and dense state "
          "bit-identical")

    # A lookup on the new mesh (IDs travel to the owning device and back) matches.
    new = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh, axis=AXIS))(
        tc.preprocess(plan, ids)[0], restored.variables)
    old_plan = make_plan(features, SAVE_TOPOLOGY, [ids])  # the saved layout, these limits
    old = jax.jit(lambda b, v: ops.lookup(old_plan, b, v))(tc.preprocess(old_plan, ids)[0],
                                                           saved)
    oracle = reference_lookup(plan, ids, None, exported)
    gap = 0.0
    for name in plan.features:
        got = np.asarray(new[name])
        np.testing.assert_allclose(got, np.asarray(old[name]), rtol=1e-6, atol=1e-6,
                                   err_msg=f"feature {name}: restored vs one-device lookup")
        np.testing.assert_allclose(got, oracle[name], rtol=1e-5, atol=1e-6,
                                   err_msg=f"feature {name}: restored lookup vs numpy")
        gap = max(gap, float(np.abs(got - np.asarray(old[name])).max()))
    return gap


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None,
                        help="checkpoint root (must not hold the step yet); default a temp dir")
    parser.add_argument("--tiny", action="store_true", help="batch 64, 8 steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.steps = 64, 2 * CYCLE
    if args.steps < 2 * CYCLE:
        parser.error(f"--steps must be at least {2 * CYCLE} (two passes over the "
                     f"{CYCLE} distinct batches, to see the loss go down); got {args.steps}.")
    if "jax" in sys.modules:
        raise SystemExit("checkpoint_topology: set the device count before JAX is imported.")
    devices = RESTORE_TOPOLOGY.global_devices
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        f"--xla_force_host_platform_device_count={devices}"])

    features = feature_specs(args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir if args.dir is not None else Path(tmp) / "checkpoints"
        losses, plan, saved, dense = train_and_save(features, args.steps, directory)
        for step, loss in enumerate(losses):
            print(f"step {step}: loss {loss:.5f}")
        gap = restore_and_check(features, directory, plan, saved, dense)
    print(f"lookup on the restored tables: max |difference| from one device {gap:.2e}")
    first, last = np.mean(losses[:CYCLE]), np.mean(losses[-CYCLE:])  # over the same batches
    if not last < first:
        raise SystemExit(f"checkpoint_topology: loss did not go down: {losses}")
    print(f"checkpoint_topology: OK (1x4 -> 2x2 bit-identical; "
          f"loss {first:.4f} -> {last:.4f})")


if __name__ == "__main__":
    main()
