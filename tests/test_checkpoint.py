"""Checkpoints: save/restore through Orbax, topology conversion, export and errors.

Values are random per-table arrays (tables and every slot); after any conversion the
real rows must come back bit for bit. Multi-device meshes run in one subprocess
started with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (this file run as
a script), which asserts and exits non-zero on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
import tilecore.checkpoint as ck
import tilecore.ops as ops
from _xla_flags import xla_flags

AXIS = "sparsecore"
HERE = Path(__file__)


def _schedule(step: Any) -> Any:
    return 0.01 / (1.0 + step)


def features(*, adam: tc.OptimizerSpec | None = None, vocab_a: int = 20, dim_b: int = 10,
             with_c: bool = True, with_e: bool = False,
             d_optimizer: tc.OptimizerSpec | None = None) -> list[tc.FeatureSpec]:
    """Four tables: a and b (Adam, stacked together), c (SGD, no slots), d (FTRL)."""
    adam = adam or tc.Adam()
    a = tc.TableSpec(name="a", vocab_size=vocab_a, embedding_dim=12, optimizer=adam)
    b = tc.TableSpec(name="b", vocab_size=37, embedding_dim=dim_b, optimizer=adam)
    c = tc.TableSpec(name="c", vocab_size=11, embedding_dim=3)
    d = tc.TableSpec(name="d", vocab_size=50, embedding_dim=8,
                     optimizer=d_optimizer or tc.FTRL(learning_rate=_schedule))
    out = [tc.FeatureSpec(name="fa", table=a, input_shape=(16, 2)),
           tc.FeatureSpec(name="fb1", table=b, input_shape=(16, 2)),
           tc.FeatureSpec(name="fb2", table=b, input_shape=(16, 3)),
           tc.FeatureSpec(name="fd", table=d, input_shape=(16, 3))]
    if with_c:
        out.append(tc.FeatureSpec(name="fc", table=c, input_shape=(16, 1)))
    if with_e:
        e = tc.TableSpec(name="e", vocab_size=9, embedding_dim=4)
        out.append(tc.FeatureSpec(name="fe", table=e, input_shape=(16, 1)))
    return out


def plan_for(devices: int, sc: int, *, stacking: bool = True, **kwargs: Any) -> tc.StackingPlan:
    config = tc.SparseCoreConfig(disable_table_stacking=not stacking)
    return tc.plan_stacking(features(**kwargs), tc.Topology(global_devices=devices,
                                                            sc_per_device=sc), config)


def random_states(plan: tc.StackingPlan, seed: int = 0) -> dict[str, ck.TableState]:
    rng = np.random.default_rng(seed)
    states = {}
    for name, t in plan.tables.items():
        shape = (t.vocab_size, t.embedding_dim)
        states[name] = ck.TableState(
            rng.standard_normal(shape).astype(np.float32),
            tuple(rng.random(shape).astype(np.float32) + 0.5 for _ in t.optimizer.slot_names))
    return states


def random_stacked(plan: tc.StackingPlan, seed: int = 0) -> dict[str, ops.EmbeddingVariables]:
    """Stacked numpy variables, random everywhere (padding too), for any device count."""
    rng = np.random.default_rng(seed)

    def draw(spec: Any) -> Any:
        return jnp.asarray(rng.standard_normal((spec.vocab_size, spec.embedding_dim)),
                           jnp.float32)

    return {name: ops.EmbeddingVariables(draw(spec), tuple(draw(spec) for _ in
                                                           spec.optimizer.slot_names))
            for name, spec in plan.stacks.items()}


def assert_states_equal(actual: dict[str, ck.TableState], expected: dict[str, ck.TableState]
                        ) -> None:
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        got = actual[name]
        np.testing.assert_array_equal(got.table, want.table, err_msg=name)
        assert len(got.slots) == len(want.slots), name
        for g, w in zip(got.slots, want.slots, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=name)


def real_rows(plan: tc.StackingPlan) -> dict[str, np.ndarray]:
    """Stack → mask of the stacked array's entries that hold real (unpadded) values."""
    ones = {t: np.ones((s.vocab_size, s.embedding_dim)) for t, s in plan.tables.items()}
    return {name: mask == 1.0 for name, mask in ops.shard(plan, ones, fill=0.0).items()}


def assert_padding_sane(plan: tc.StackingPlan, variables: dict[str, Any]) -> None:
    """Padding holds finite values; slot padding its optimizer's initial value."""
    for name, real in real_rows(plan).items():
        spec = plan.stacks[name]
        assert np.isfinite(np.asarray(variables[name].table)).all(), name
        for slot, initial in zip(variables[name].slots, spec.optimizer.slot_initial_values(),
                                 strict=True):
            assert (np.asarray(slot)[~real] == np.float32(initial)).all(), name


def lookup_matches(plan: tc.StackingPlan, variables: dict[str, Any],
                   states: dict[str, ck.TableState], mesh: Any = None) -> None:
    """Looked-up activations on `variables` equal row sums of the per-table arrays."""
    rng = np.random.default_rng(1)
    inputs = {f.name: rng.integers(0, f.table.vocab_size, f.input_shape)
              for f in plan.features.values()}
    batch, _ = tc.preprocess(plan, inputs)
    import jax

    act = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh, axis=AXIS))(batch, variables)
    for f in plan.features.values():
        want = states[f.table.name].table[inputs[f.name]].sum(axis=1)
        np.testing.assert_allclose(np.asarray(act[f.name]), want, rtol=1e-6, atol=1e-6,
                                   err_msg=f.name)


# --------------------------------------------------------------------------- same topology


def test_save_restore_same_plan_is_exact_including_padding(tmp_path: Path) -> None:
    plan = plan_for(1, 4)
    variables = random_stacked(plan)
    path = ck.save(tmp_path, plan, variables, step=7)
    assert path == tmp_path / "7"
    restored = ck.restore(tmp_path, plan)
    assert restored.step == 7 and restored.extra is None
    assert restored.variables.keys() == variables.keys()
    for name, var in variables.items():
        got = restored.variables[name]
        np.testing.assert_array_equal(np.asarray(got.table), np.asarray(var.table))
        for g, w in zip(got.slots, var.slots, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_extra_pytree_restored_with_and_without_target(tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    plan = plan_for(1, 2)
    variables = ck.shard_variables(plan, random_states(plan))
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    opt_state = optax.adam(1e-3).init(params)
    extra = {"params": params, "opt_state": opt_state, "step": 11}
    ck.save(tmp_path, plan, variables, step=11, extra=extra)

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                          if isinstance(x, jax.Array) else x, extra)
    got = ck.restore(tmp_path, plan, extra=target).extra
    assert jax.tree.structure(got) == jax.tree.structure(extra)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(extra), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    raw = ck.restore(tmp_path, plan).extra  # no target: Orbax's containers, numpy arrays
    np.testing.assert_array_equal(raw["params"]["w"], np.asarray(params["w"]))
    assert isinstance(raw["params"]["w"], np.ndarray) and raw["step"] == 11


def test_keep_n_latest_and_steps(tmp_path: Path) -> None:
    plan = plan_for(1, 2)
    states = [random_states(plan, seed) for seed in range(3)]
    for step, s in enumerate(states):
        ck.save(tmp_path, plan, ck.shard_variables(plan, s), step=step * 10, max_to_keep=2)
    assert ck.available_steps(tmp_path) == (10, 20)
    assert ck.restore(tmp_path, plan).step == 20
    earlier = ck.restore(tmp_path, plan, step=10)
    assert_states_equal(ck.unshard_variables(plan, earlier.variables), states[1])
    with pytest.raises(ValueError, match="step 20 already exists"):
        ck.save(tmp_path, plan, earlier.variables, step=20)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        ck.save(tmp_path, plan, earlier.variables, step=-1)


def test_save_rejects_variables_of_another_plan(tmp_path: Path) -> None:
    variables = ck.shard_variables(plan_for(1, 2), random_states(plan_for(1, 2)))
    with pytest.raises(ValueError, match=r"Stack 'a_b': table has shape \(80, 16\); the plan expects \(128, 16\)"):
        ck.save(tmp_path, plan_for(1, 8), variables, step=0)
    assert ck.available_steps(tmp_path) == ()


def test_save_refuses_a_step_older_than_the_newest(tmp_path: Path) -> None:
    """Orbax skipped such a step and returned False; save returned its path anyway."""
    plan = plan_for(1, 2)
    variables = ck.shard_variables(plan, random_states(plan))
    ck.save(tmp_path, plan, variables, step=6)
    with pytest.raises(ValueError, match=r"save: step 5 is older than step 6, the newest in "
                                         r".*; steps must increase"):
        ck.save(tmp_path, plan, variables, step=5)
    assert ck.available_steps(tmp_path) == (6,)


# --------------------------------------------------------------------------- other topologies


@pytest.mark.parametrize(("src", "dst"), [
    (dict(devices=1, sc=4), dict(devices=1, sc=8)),
    (dict(devices=1, sc=8), dict(devices=1, sc=1)),
    (dict(devices=1, sc=4), dict(devices=1, sc=4, stacking=False)),
    (dict(devices=1, sc=2, stacking=False), dict(devices=1, sc=4)),
])
def test_restore_onto_other_topology_keeps_every_row(tmp_path: Path, src: dict[str, Any],
                                                     dst: dict[str, Any]) -> None:
    before, after = plan_for(**src), plan_for(**dst)
    states = random_states(before)
    ck.save(tmp_path, before, ck.shard_variables(before, states), step=1)
    restored = ck.restore(tmp_path, after)
    assert_states_equal(ck.unshard_variables(after, restored.variables), states)
    assert_padding_sane(after, restored.variables)
    lookup_matches(after, restored.variables, states)


def test_in_memory_conversion_round_trip() -> None:
    plans = [plan_for(1, 4), plan_for(1, 8, stacking=False), plan_for(1, 1), plan_for(1, 4)]
    states = random_states(plans[0], seed=3)
    variables = ck.shard_variables(plans[0], states)
    for plan in plans[1:]:
        variables = ck.shard_variables(plan, ck.unshard_variables(plans[0], variables))
        plans[0] = plan
    assert_states_equal(ck.unshard_variables(plans[0], variables), states)


def test_shard_variables_checks_slots_and_mesh() -> None:
    plan = plan_for(1, 2)
    states = random_states(plan)
    states["a"] = ck.TableState(states["a"].table)
    with pytest.raises(ValueError, match=r"Table 'a': 0 slot arrays.*\('momentum', 'velocity'\)"):
        ck.shard_variables(plan, states)
    with pytest.raises(ValueError, match=r"spans 2 devices \(2x2\); pass the mesh"):
        ck.shard_variables(plan_for(2, 2), random_states(plan))


def _run_multidevice(root: Path) -> None:
    """In a process with 8 CPU devices: 1x4 → 2x2 → 1x8 → 4x2 on meshes, and a save
    read straight onto more devices (same layout)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert jax.device_count() == 8, jax.device_count()

    def mesh_of(devices: int) -> Mesh | None:
        return Mesh(np.array(jax.devices()[:devices]), (AXIS,)) if devices > 1 else None

    chain = [(1, 4), (2, 2), (1, 8), (4, 2)]
    plan = plan_for(*chain[0])
    states = random_states(plan, seed=5)
    variables = ck.shard_variables(plan, states)
    for step, (devices, sc) in enumerate(chain[1:], start=1):
        ck.save(root / "chain", plan, variables, step=step)
        plan, mesh = plan_for(devices, sc), mesh_of(devices)
        variables = ck.restore(root / "chain", plan, mesh=mesh, axis=AXIS).variables
        assert_states_equal(ck.unshard_variables(plan, variables), states)
        if mesh is not None:
            want = NamedSharding(mesh, PartitionSpec(AXIS, None))
            for var in variables.values():
                for array in (var.table, *var.slots):
                    assert array.sharding.is_equivalent_to(want, 2), array.sharding
        if (devices, sc) == (2, 2):  # activations through the all-to-all on the new mesh
            lookup_matches(plan, variables, states, mesh)

    # Single-table stacks have rotation 0: 1x4 and 2x2 share the layout, so the arrays
    # are read straight onto the 2-device mesh, padding included.
    one, two = plan_for(1, 4, stacking=False), plan_for(2, 2, stacking=False)
    saved = random_stacked(one, seed=2)
    ck.save(root / "same", one, saved, step=0)
    from tilecore.checkpoint._compare import same_layout
    from tilecore.checkpoint._store import read_layout

    assert same_layout(read_layout(root / "same", 0)[1], two)
    mesh = mesh_of(2)
    assert mesh is not None
    restored = ck.restore(root / "same", two, mesh=mesh, axis=AXIS).variables
    for name, var in saved.items():
        for got, want in zip((restored[name].table, *restored[name].slots),
                             (var.table, *var.slots), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        assert restored[name].table.sharding.is_equivalent_to(
            NamedSharding(mesh, PartitionSpec(AXIS, None)), 2)


def test_restore_across_device_counts_on_meshes(tmp_path: Path) -> None:
    env = {**os.environ, "XLA_FLAGS": xla_flags(8),
           "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(HERE), "multidevice", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "multidevice ok" in result.stdout


# --------------------------------------------------------------------------- atomicity


def _kill_during_save(root: Path) -> None:
    """Save step 1, then die (SIGKILL) in the middle of saving step 2."""
    import orbax.checkpoint as ocp

    plan = plan_for(1, 2)
    ck.save(root, plan, ck.shard_variables(plan, random_states(plan, seed=1)), step=1)

    async def die(self: Any, x: Any, directory: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    ocp.JsonCheckpointHandler._save_fn = die  # type: ignore[method-assign]
    ck.save(root, plan, ck.shard_variables(plan, random_states(plan, seed=2)), step=2)


def test_killed_save_leaves_previous_checkpoint_intact(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(HERE), "kill", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == -signal.SIGKILL, result.stderr[-4000:]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("1",)]
    assert leftovers and all("tmp" in name for name in leftovers), leftovers  # died midway
    plan = plan_for(1, 2)
    assert ck.available_steps(tmp_path) == (1,)
    restored = ck.restore(tmp_path, plan)
    assert restored.step == 1
    assert_states_equal(ck.unshard_variables(plan, restored.variables), random_states(plan, 1))
    ck.save(tmp_path, plan, restored.variables, step=2)  # a new save goes through
    assert ck.available_steps(tmp_path) == (1, 2)


def test_failed_save_raises_and_keeps_previous(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import orbax.checkpoint as ocp

    plan = plan_for(1, 2)
    states = random_states(plan, seed=4)
    ck.save(tmp_path, plan, ck.shard_variables(plan, states), step=1)

    async def fail(self: Any, x: Any, directory: Any) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", fail)
    with pytest.raises(OSError, match="injected"):
        ck.save(tmp_path, plan, ck.shard_variables(plan, random_states(plan, 9)), step=2)
    monkeypatch.undo()
    assert ck.available_steps(tmp_path) == (1,)
    assert_states_equal(ck.unshard_variables(plan, ck.restore(tmp_path, plan).variables), states)


# --------------------------------------------------------------------------- metadata, export


def test_metadata_records_specs_plan_and_what_was_not_serialized(tmp_path: Path) -> None:
    plan = plan_for(2, 2)
    ck.save(tmp_path, plan, _host_variables(plan), step=3)
    meta = ck.read_metadata(tmp_path)
    assert meta["step"] == 3 and meta["topology"]["global_devices"] == 2
    adam = meta["tables"]["a"]["optimizer"]
    assert adam["type"] == "Adam" and adam["slot_names"] == ["momentum", "velocity"]
    assert adam["learning_rate"] == 1e-3 and adam["hyperparameters"]["beta_2"] == 0.999
    ftrl = meta["tables"]["d"]["optimizer"]
    assert ftrl["learning_rate"] is None and ftrl["learning_rate_schedule"].endswith("_schedule")
    assert any("'d': learning-rate schedule" in n for n in meta["not_serialized"])
    assert [s["name"] for s in meta["stacks"]] == list(plan.stacks)
    assert meta["features"]["fb2"] == {"table": "b", "input_shape": [16, 3],
                                       "output_shape": [16, 10]}
    assert meta["feature_settings"]["fb1"]["col_shift"] == 2


def _host_variables(plan: tc.StackingPlan) -> dict[str, Any]:
    """Stacked numpy variables of `random_states(plan)` for any device count (no mesh)."""
    states = random_states(plan)
    tables = ops.shard(plan, {t: s.table for t, s in states.items()})
    slots = [ops.shard(plan, {t: s.slots[i] if i < len(s.slots) else s.table
                              for t, s in states.items()}) for i in range(2)]
    return {name: ops.EmbeddingVariables(
        jnp.asarray(tables[name]), tuple(jnp.asarray(slots[i][name]) for i in range(len(spec.optimizer.slot_names))))
        for name, spec in plan.stacks.items()}


def test_export_tables_from_path_and_variables(tmp_path: Path) -> None:
    plan = plan_for(2, 2)  # written by a 2-device job, read here on one device
    ck.save(tmp_path / "ckpt", plan, _host_variables(plan), step=5)
    states = random_states(plan)
    npz = tmp_path / "tables.npz"
    tables = ck.export_tables(tmp_path / "ckpt", npz_path=npz)
    assert tables.keys() == states.keys()
    for name, state in states.items():
        np.testing.assert_array_equal(tables[name], state.table)
    with np.load(npz) as data:
        assert sorted(data.files) == sorted(states)
        np.testing.assert_array_equal(data["d"], states["d"].table)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    one = plan_for(1, 4)
    in_memory = ck.export_tables(ck.shard_variables(one, states), one)
    for name, state in states.items():
        np.testing.assert_array_equal(in_memory[name], state.table)
    with pytest.raises(ValueError, match="pass the plan"):
        ck.export_tables(ck.shard_variables(one, states))
    with pytest.raises(ck.CheckpointMismatchError, match="vocab_size saved=20, expected=24"):
        ck.export_tables(tmp_path / "ckpt", plan_for(1, 4, vocab_a=24))


# --------------------------------------------------------------------------- errors


def test_mismatch_error_lists_every_difference(tmp_path: Path) -> None:
    plan = plan_for(1, 2)
    ck.save(tmp_path, plan, ck.shard_variables(plan, random_states(plan)), step=0)
    other = plan_for(1, 2, vocab_a=24, dim_b=9, with_c=False, with_e=True,
                     d_optimizer=tc.Adagrad())
    with pytest.raises(ck.CheckpointMismatchError) as info:
        ck.restore(tmp_path, other)
    found = {(m.table, m.field) for m in info.value.mismatches}
    assert found == {("a", "vocab_size"), ("b", "embedding_dim"), ("c", "table"),
                     ("d", "optimizer"), ("e", "table")}
    message = str(info.value)
    for part in ("table 'a': vocab_size saved=20, expected=24",
                 "table 'b': embedding_dim saved=10, expected=9",
                 "table 'c': in the checkpoint (vocab_size=11, embedding_dim=3) but not in the",
                 "table 'd': optimizer saved=FTRL (slots ['accumulator', 'linear']), "
                 "expected=Adagrad (slots ['accumulator'])",
                 "table 'e': in the model (vocab_size=9, embedding_dim=4) but not in the checkpoint",
                 "5 mismatch(es)", "step 0"):
        assert part in message, (part, message)


def test_changed_hyperparameters_restore_fine(tmp_path: Path) -> None:
    plan = plan_for(1, 2)
    states = random_states(plan)
    ck.save(tmp_path, plan, ck.shard_variables(plan, states), step=0)
    resumed = plan_for(1, 2, adam=tc.Adam(learning_rate=0.05, beta_1=0.5),
                       d_optimizer=tc.FTRL(learning_rate=0.2))
    restored = ck.restore(tmp_path, resumed)
    assert_states_equal(ck.unshard_variables(resumed, restored.variables), states)


def test_missing_checkpoint_errors(tmp_path: Path) -> None:
    plan = plan_for(1, 2)
    with pytest.raises(ck.CheckpointNotFoundError, match="does not exist"):
        ck.restore(tmp_path / "nowhere", plan)
    with pytest.raises(ck.CheckpointNotFoundError, match="holds no finished checkpoint"):
        ck.restore(tmp_path, plan)
    with pytest.raises(FileNotFoundError):  # also catchable as the builtin
        ck.export_tables(tmp_path)
    ck.save(tmp_path, plan, ck.shard_variables(plan, random_states(plan)), step=4)
    with pytest.raises(ck.CheckpointNotFoundError, match=r"step=5 .*saved steps: \[4\]"):
        ck.restore(tmp_path, plan, step=5)


@pytest.mark.parametrize(("content", "why"), [
    ("{not json", "cannot be read"),
    (json.dumps({"format": "something-else"}), "format is 'something-else'"),
    ("[1, 2]", "expected a JSON object"),
])
def test_corrupted_metadata_errors(tmp_path: Path, content: str, why: str) -> None:
    plan = plan_for(1, 2)
    ck.save(tmp_path, plan, ck.shard_variables(plan, random_states(plan)), step=0)
    (tmp_path / "0" / "tilecore" / "metadata").write_text(content)
    with pytest.raises(ck.CheckpointCorruptError, match=why) as info:
        ck.restore(tmp_path, plan)
    assert "step 0 is damaged" in str(info.value) and "saved steps: [0]" in str(info.value)
    with pytest.raises(ck.CheckpointCorruptError):
        ck.read_metadata(tmp_path)


def test_metadata_missing_a_field_is_corrupt(tmp_path: Path) -> None:
    plan = plan_for(1, 2)
    ck.save(tmp_path, plan, ck.shard_variables(plan, random_states(plan)), step=0)
    path = tmp_path / "0" / "tilecore" / "metadata"
    meta = json.loads(path.read_text())
    del meta["table_settings"]["b"]
    path.write_text(json.dumps(meta))
    with pytest.raises(ck.CheckpointCorruptError, match="malformed"):
        ck.restore(tmp_path, plan)


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "multidevice":
        _run_multidevice(root)
        print("multidevice ok")
    elif mode == "kill":
        _kill_during_save(root)
