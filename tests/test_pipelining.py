"""Pipelined and plain training steps against a numpy training loop.

The model is a tiny linear one, `pred = Σ_f act_f · w_f + b`, trained with a
squared loss and optax SGD; the tables use SGD or Adagrad. The numpy loop uses
the oracles of `tilecore.testing` (lookup, row gradients, every optimizer) and
hand-written gradients of the linear model, and follows the reference's schedule
literally: in call i, SC backward of step i−2, SC forward of step i, TC of step
i−1. The 2-device run happens in a subprocess (this file run as a script).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tilecore as tc
from _ops_cases import Case, assert_close, initial_slots, preprocess, shard_slots, table
from tilecore import ops
from tilecore import pipelining as pl
from tilecore.testing import reference_lookup, reference_lookup_grad

STEPS = 6
DENSE_LR = 0.05
AXIS = "sparsecore"
TABLE_OPTIMIZERS = {"sgd": tc.SGD(learning_rate=0.2),
                    "adagrad": tc.Adagrad(learning_rate=0.2, initial_accumulator_value=0.1)}
# Two tables, one of them looked up by two features; nothing dropped, so the result
# is the same on any number of devices.
BASE = Case("pipelining", (table("a", 37, 5), table("b", 23, 3, "mean")),
            (("fa0", "a", 16), ("fa1", "a", 16), ("fb", "b", 16)), sc_per_device=2, seed=11)


def _case(optimizer: str) -> Case:
    return BASE.with_optimizer(optimizer, TABLE_OPTIMIZERS[optimizer])


def _labels(case: Case, step: int) -> np.ndarray:
    return np.random.default_rng([case.seed, step, 3]).normal(size=16).astype(np.float32)


def _initial_params(case: Case) -> dict[str, Any]:
    rng = np.random.default_rng([case.seed, 5])
    dims = {t.name: t.embedding_dim for t in case.tables}
    return {"w": {f: rng.normal(size=dims[t]).astype(np.float32) for f, t, _ in case.features},
            "b": np.float32(0.1)}


def loss_fn(params: Any, activations: Any, labels: jax.Array) -> jax.Array:
    # `sum(a * w, -1)`, not `a @ w`: its gradient reduces over the batch, which a mesh
    # with explicit sharding accepts (a sharded contraction would need `out_sharding`).
    pred = sum(jnp.sum(activations[f] * w, -1) for f, w in params["w"].items()) + params["b"]
    return 0.5 * jnp.mean((pred - labels) ** 2)


# --- the numpy training loop ---------------------------------------------------------------


def _oracle_tc(params: Any, acts: Any, labels: np.ndarray) -> tuple[float, Any, Any]:
    """Loss, activation gradients and SGD-updated params of the linear model (float64)."""
    w = {f: np.asarray(x, np.float64) for f, x in params["w"].items()}
    r = sum(acts[f] @ w[f] for f in w) + float(params["b"]) - labels
    batch = len(labels)
    grads = {f: np.outer(r, w[f]) / batch for f in w}
    new = {"w": {f: w[f] - DENSE_LR * acts[f].T @ r / batch for f in w},
           "b": float(params["b"]) - DENSE_LR * r.mean()}
    return 0.5 * float(np.mean(r * r)), grads, new


@dataclasses.dataclass
class Trajectory:
    losses: list[float]
    tables: dict[str, np.ndarray]
    slots: dict[str, tuple[np.ndarray, ...]]
    params: Any


def oracle_loop(case: Case, *, pipelined: bool, steps: int = STEPS) -> Trajectory:
    plan = case.plan()
    tables, slots, params = case.table_values(), initial_slots(plan), _initial_params(case)
    batches = [case.batch(j) for j in range(steps)]
    losses: list[float] = []
    acts: dict[int, Any] = {}
    grads: dict[int, Any] = {}

    def backward(j: int) -> None:
        nonlocal tables, slots
        tables, slots = reference_lookup_grad(plan, *batches[j], tables, slots, grads.pop(j), j)

    def tc_stage(j: int) -> None:
        nonlocal params
        loss, grads[j], params = _oracle_tc(params, acts.pop(j), _labels(case, j))
        losses.append(loss)

    for call in range(pl.pipeline_steps(steps) if pipelined else steps):
        if pipelined:
            if call >= 2:
                backward(call - 2)
            if call < steps:
                acts[call] = reference_lookup(plan, *batches[call], tables)
            if pl.is_output_valid(call, steps):
                tc_stage(call - 1)
        else:
            acts[call] = reference_lookup(plan, *batches[call], tables)
            tc_stage(call)
            backward(call)
    assert not acts and not grads
    return Trajectory(losses, tables, slots, params)


# --- the device loop -----------------------------------------------------------------------


@contextlib.contextmanager
def count_compiles(step: pl.TrainStep) -> Iterator[list[str]]:
    """Collects one entry per XLA compilation of `step`'s program inside the block.

    Only the step's own programs count: eager work that happens to compile for the
    first time in this process inside the block (the CPU kernels' one-time self-test
    when the first step selects them, say) depends on which tests ran before.
    """
    compiles: list[str] = []
    name = f"jit({step.jitted.__name__})"

    def listen(event: str, duration_secs: float, **kwargs: str | int) -> None:
        del duration_secs
        if event == "/jax/core/compile/backend_compile_duration" and kwargs.get(
                "fun_name") == name:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _stages(plan: tc.StackingPlan, mesh: Any = None) -> pl.Stages:
    return pl.sparsecore_stages(plan, pl.optax_tc(loss_fn, optax.sgd(DENSE_LR)), mesh=mesh)


def _inputs(case: Case, plan: tc.StackingPlan, step: int) -> pl.StepInput:
    return pl.StepInput(preprocess(plan, *case.batch(step))[0], _labels(case, step))


def _variables(case: Case, plan: tc.StackingPlan) -> dict[str, ops.EmbeddingVariables]:
    tables, slots = ops.shard(plan, case.table_values()), shard_slots(plan, initial_slots(plan))
    return {n: ops.EmbeddingVariables(jnp.asarray(tables[n]), tuple(map(jnp.asarray, slots[n])))
            for n in plan.stacks}


def device_loop(case: Case, *, pipelined: bool, devices: int = 1, mesh: Any = None,
                steps: int = STEPS, place_inputs: bool = False) -> tuple[Trajectory, int]:
    """The loop through `run_loop`; also returns how many programs it compiled.

    With `place_inputs` every batch is put on the mesh before the step sees it,
    split by its leading dimension (as `tilecore train` does); else it stays numpy.
    """
    plan = case.plan(devices)
    step = pl.TrainStep(stages=_stages(plan, mesh), pipelined=pipelined)
    params = jax.tree.map(jnp.asarray, _initial_params(case))

    def inputs(j: int) -> pl.StepInput:
        host = _inputs(case, plan, j)
        if not place_inputs:
            return host
        split, replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s))
                             for s in ((AXIS,), ()))
        return jax.device_put(host, jax.tree.map(
            lambda x: split if np.ndim(x) else replicated, host))

    first = inputs(0)
    state = step.init(_variables(case, plan), pl.DenseState.create(params, optax.sgd(DENSE_LR)),
                      first)
    if mesh is not None:
        state = jax.device_put(state, pl.train_state_sharding(state, mesh))
    batches = (first if j == 0 else inputs(j) for j in range(steps))
    run = pl.run_loop(step, state, batches)
    with count_compiles(step) as compiles:
        results = list(run)
    assert [r.step for r in results] == list(range(steps))
    variables = run.state.variables
    if mesh is not None:  # still split by rows: the state was placed once, never gathered
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS, None))
        for v in jax.tree.leaves(variables):
            assert v.sharding.is_equivalent_to(rows, 2), v.sharding
    arrays = {k: [np.asarray(v.table), *map(np.asarray, v.slots)] for k, v in variables.items()}
    per_table = [ops.unshard(plan, {k: a[i] for k, a in arrays.items()})
                 for i in range(len(next(iter(arrays.values()))))]
    return Trajectory(
        [float(r.outputs) for r in results], per_table[0],
        {t: tuple(p[t] for p in per_table[1:]) for t in plan.tables},
        jax.tree.map(np.asarray, run.state.dense.params)), len(compiles)


def assert_same(got: Trajectory, want: Trajectory, what: str) -> None:
    assert_close(got.losses, want.losses, f"{what}: losses", rtol=1e-4)
    for name, expected in want.tables.items():
        assert_close(got.tables[name], expected, f"{what}: table {name}", rtol=1e-4)
        for k, slot in enumerate(want.slots[name]):
            assert_close(got.slots[name][k], slot, f"{what}: slot {k} of {name}", rtol=1e-4)
    jax.tree.map(lambda g, w: assert_close(g, w, f"{what}: dense params", rtol=1e-4),
                 got.params, want.params)


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", TABLE_OPTIMIZERS)
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "plain"])
def test_loop_matches_numpy_training(optimizer: str, pipelined: bool) -> None:
    """Losses, tables, slots and dense params after 6 steps equal the numpy loop's
    (pipelined: with the reference's one-step staleness), and one compiled program
    serves every real step (plus one for the fake TC calls when pipelined)."""
    case = _case(optimizer)
    got, compiles = device_loop(case, pipelined=pipelined)
    assert_same(got, oracle_loop(case, pipelined=pipelined), f"{case.name} {pipelined=}")
    assert compiles == (2 if pipelined else 1)


def test_staleness_changes_the_result() -> None:
    """The pipelined and plain numpy loops differ from step 1 on (so the staleness check
    can fail): step 1 sees step 0's table update only in the plain loop."""
    case = _case("sgd")
    stale, fresh = oracle_loop(case, pipelined=True), oracle_loop(case, pipelined=False)
    assert stale.losses[0] == pytest.approx(fresh.losses[0])
    assert not np.any(np.isclose(stale.losses[1:], fresh.losses[1:], rtol=1e-3))
    assert not np.allclose(stale.tables["a"], fresh.tables["a"], rtol=1e-6)


def test_plain_step_equals_training_update() -> None:
    """One plain step = `ops.training_update` then the optax update of the params."""
    case = _case("adagrad")
    plan = case.plan()
    inputs = _inputs(case, plan, 0)
    params = jax.tree.map(jnp.asarray, _initial_params(case))
    opt = optax.sgd(DENSE_LR)
    loss, grads, want = jax.jit(lambda batch, variables, params: ops.training_update(
        plan, batch, variables, lambda p, acts: loss_fn(p, acts, jnp.asarray(inputs.dense)),
        params))(inputs.batch, _variables(case, plan), params)
    updates, _ = opt.update(grads, opt.init(params), params)
    want_params = optax.apply_updates(params, updates)
    stages = _stages(plan)
    state = pl.initial_state(stages, _variables(case, plan), pl.DenseState.create(params, opt),
                             inputs, pipelined=False)
    new, out = jax.jit(lambda s, x: pl.plain_step(stages, s, x))(state, inputs)
    assert_close(out.outputs, loss)
    assert int(new.step) == 1 and out.sc_backward_aux is None
    for name, v in want.items():
        for x, y in zip((new.variables[name].table, *new.variables[name].slots),
                        (v.table, *v.slots), strict=True):
            assert_close(x, y, name)
    jax.tree.map(assert_close, new.dense.params, want_params)


def _state_arrays(state: pl.TrainState) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(state.variables)]


def test_fill_and_drain_calls_touch_no_row() -> None:
    """Adagrad touches even zero-gradient rows; the placeholder batch must touch none.
    Fill and drain calls on placeholders leave tables and slots bit-identical, the
    first real TC call too (its SC backward still sees placeholders), and the empty
    batch is exactly what preprocessing makes of samples without IDs."""
    case = _case("adagrad")
    plan = case.plan()
    step = pl.TrainStep(stages=_stages(plan), pipelined=True, donate=False)
    first = _inputs(case, plan, 0)
    params = jax.tree.map(jnp.asarray, _initial_params(case))
    state = step.init(_variables(case, plan), pl.DenseState.create(params, optax.sgd(0.1)),
                      first)
    before = _state_arrays(state)
    dummy = pl.placeholder_input(first)
    for fake in (True, False):
        after, out = step(state, dummy, fake_tc_step=fake)
        for x, y in zip(_state_arrays(after), before, strict=True):
            np.testing.assert_array_equal(x, y)
    state, out = step(state, first, fake_tc_step=True)  # call 0
    assert float(out.outputs) == 0.0
    state, out = step(state, _inputs(case, plan, 1))  # call 1: TC of step 0
    assert float(out.outputs) > 0.0
    for x, y in zip(_state_arrays(state), before, strict=True):
        np.testing.assert_array_equal(x, y)
    state, _ = step(state, _inputs(case, plan, 2))  # call 2: SC backward of step 0
    assert any(not np.array_equal(x, y) for x, y in zip(_state_arrays(state), before,
                                                        strict=True))

    samples = {f: tc.Ragged.from_rows([[] for _ in range(n)]) for f, _, n in case.features}
    empty = tc.preprocess(plan, samples)[0]
    for name, buffers in empty.stacks.items():
        placeholder = dummy.batch.stacks[name]
        np.testing.assert_array_equal(placeholder.row_pointers, 0)
        for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            np.testing.assert_array_equal(getattr(placeholder, field), getattr(buffers, field))
    acts = ops.lookup(plan, dummy.batch, state.variables)
    assert all(not np.any(np.asarray(a)) for a in acts.values())
    np.testing.assert_array_equal(dummy.dense, np.zeros(16, np.float32))


def test_aux_values_travel_with_their_step() -> None:
    """sc_forward_aux of step j reaches the TC call of step j; tc_aux of step j reaches
    the SC backward of step j, whose aux comes back two calls after the TC output."""
    case = _case("sgd")
    plan = case.plan()
    base = _stages(plan)

    def entries(batch: tc.PreprocessedBatch) -> jax.Array:
        return jnp.sum(jnp.stack([jnp.sum(b.row_pointers) for b in batch.stacks.values()]))

    def sc_forward(batch: Any, variables: Any) -> Any:
        return base.sc_forward(batch, variables)[0], entries(batch)

    def tc_stage(dense: Any, acts: Any, labels: Any, fwd_aux: Any) -> pl.TcResult:
        result = base.tc(dense, acts, labels, None)
        return result._replace(outputs=(result.outputs, fwd_aux), aux=fwd_aux * 10)

    def sc_backward(batch: Any, variables: Any, grads: Any, step: Any, tc_aux: Any) -> Any:
        return base.sc_backward(batch, variables, grads, step, None)[0], (tc_aux, step)

    stages = pl.Stages(sc_forward=sc_forward, tc=tc_stage, sc_backward=sc_backward)
    step = pl.TrainStep(stages=stages)
    inputs = [_inputs(case, plan, j) for j in range(3)]
    counts = [int(sum(np.sum(b.row_pointers) for b in x.batch.stacks.values())) for x in inputs]
    params = jax.tree.map(jnp.asarray, _initial_params(case))
    state = step.init(_variables(case, plan), pl.DenseState.create(params, optax.sgd(0.1)),
                      inputs[0])
    dummy = pl.placeholder_input(inputs[0])
    seen = []
    for call in range(pl.pipeline_steps(3)):
        x = inputs[call] if call < 3 else dummy
        state, out = step(state, x, fake_tc_step=not pl.is_output_valid(call, 3))
        seen.append((int(out.outputs[1]), int(out.sc_backward_aux[0]),
                     int(out.sc_backward_aux[1])))
    assert [s[0] for s in seen[1:4]] == counts
    assert [s[1] for s in seen[2:]] == [10 * c for c in counts]
    assert [s[2] for s in seen[2:]] == [0, 1, 2]  # the data step, as a plain loop counts


def test_schedule_helpers() -> None:
    assert [pl.is_output_valid(k, 3) for k in range(-1, 6)] == [False, False, True, True, True,
                                                                False, False]
    assert pl.pipeline_steps(0) == 2 and pl.pipeline_steps(6) == 8
    with pytest.raises(ValueError, match="num_steps=-1"):
        pl.pipeline_steps(-1)


def test_misuse_is_explained() -> None:
    case = _case("sgd")
    plan = case.plan()
    stages = _stages(plan)
    first = _inputs(case, plan, 0)
    dense = pl.DenseState.create(jax.tree.map(jnp.asarray, _initial_params(case)),
                                 optax.sgd(0.1))
    plain = pl.initial_state(stages, _variables(case, plan), dense, first, pipelined=False)
    with pytest.raises(ValueError, match="pipelined=True"):
        pl.pipelined_step(stages, plain, first)
    with pytest.raises(ValueError, match="fake_tc_step=False"):
        pl.plain_step(stages, plain, first, fake_tc_step=True)
    with pytest.raises(ValueError, match=r"init\(\)"):
        pl.TrainStep(stages=stages, pipelined=True)(plain, first)
    assert list(pl.run_loop(pl.TrainStep(stages=stages), plain._replace(
        pipeline=None), [])) == []
    # A TC stage that changes the dense state's structure would compile every call.
    retyped = dataclasses.replace(stages, tc=lambda *args: stages.tc(*args)._replace(
        dense_state=tuple(stages.tc(*args).dense_state)))
    with pytest.raises(ValueError, match=r"another structure.*DenseState"):
        pl.TrainStep(stages=retyped, pipelined=False)(plain, first)
    # Stage functions that return the wrong things are named, with what they returned.
    wrong = (
        (dataclasses.replace(stages, sc_forward=lambda b, v: stages.sc_forward(b, v)[0]),
         r"Stages.sc_forward must return \(activations, sc_forward_aux\), got dict"),
        (dataclasses.replace(stages, tc=lambda *args: tuple(stages.tc(*args))[:3]),
         r"Stages.tc must return TcResult\(.*\), got a tuple of 3"),
        (dataclasses.replace(stages, sc_backward=lambda *args: stages.sc_backward(*args)[0]),
         r"Stages.sc_backward must return \(variables, sc_backward_aux\), got dict"),
    )
    for bad, message in wrong:
        with pytest.raises(TypeError, match=message):
            pl.plain_step(bad, plain, first)
    with pytest.raises(TypeError, match=r"empty_batch: expected a PreprocessedBatch.*str"):
        pl.empty_batch("x")  # type: ignore[arg-type]
    inputs = {name: np.zeros((plan.features[name].batch_size, 1), np.int32)
              for name in plan.features}
    with pytest.raises(ValueError, match="reference_lookup: no values for tables"):
        reference_lookup(plan, inputs, None, {})


def test_public_names() -> None:
    for name in pl.__all__:
        assert getattr(pl, name) is not None, name


# --- two devices ---------------------------------------------------------------------------


# (mesh axis type, inputs placed on the mesh): the test's host inputs on jax.make_mesh's
# default explicit axes, and the placed inputs of `tilecore train` on its auto axes.
TWO_DEVICE_RUNS = {"explicit-host": (jax.sharding.AxisType.Explicit, False),
                   "auto-placed": (jax.sharding.AxisType.Auto, True)}
TWO_DEVICE_OPTIMIZER = "adagrad"  # one with a slot; SGD adds only run time


def worker(out: Path) -> None:
    """In the subprocess: the pipelined loop on 2-device meshes, saved as npz."""
    assert jax.device_count() == 2, jax.devices()
    for name, (axis_type, place_inputs) in TWO_DEVICE_RUNS.items():
        mesh = jax.make_mesh((2,), (AXIS,), axis_types=(axis_type,))
        got, compiles = device_loop(_case(TWO_DEVICE_OPTIMIZER), pipelined=True, devices=2,
                                    mesh=mesh, place_inputs=place_inputs)
        arrays = {"losses": np.asarray(got.losses), "compiles": np.asarray(compiles)}
        arrays.update({f"table/{n}": t for n, t in got.tables.items()})
        arrays.update({f"slot/{n}/{k}": s for n, slots in got.slots.items()
                       for k, s in enumerate(slots)})
        np.savez(out / f"{name}.npz", allow_pickle=False, **arrays)


def test_two_devices_equal_one_device(tmp_path: Path) -> None:
    """The pipelined loop on a 2-device mesh (state placed with `train_state_sharding`)
    equals the 1-device loop: losses, tables and slots; and, since every call's state
    comes back placed as it went in and the drain's placeholders are placed like the
    batches, the whole loop compiles two programs (real and fake TC), with host or
    placed inputs, on explicit or auto mesh axes."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TILECORE_KERNELS="xla", XLA_FLAGS=" ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]).strip())
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"worker failed:\n{done.stdout}\n{done.stderr}"
    one, _ = device_loop(_case(TWO_DEVICE_OPTIMIZER), pipelined=True)
    for run in TWO_DEVICE_RUNS:
        with np.load(tmp_path / f"{run}.npz") as two:
            assert int(two["compiles"]) == 2, f"{run}: {int(two['compiles'])} compilations"
            assert_close(two["losses"], one.losses, f"{run}: losses", rtol=1e-4)
            for name, t in one.tables.items():
                assert_close(two[f"table/{name}"], t, f"{run}: table {name}", rtol=1e-4)
                for k, s in enumerate(one.slots[name]):
                    assert_close(two[f"slot/{name}/{k}"], s, f"{run}: {name}[{k}]", rtol=1e-4)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    worker(Path(sys.argv[1]))


def test_inputs_that_are_not_step_inputs_are_refused() -> None:
    """A (batch, labels) tuple, a dict or a StepInput without a batch: AttributeErrors from
    inside the step before."""
    t = tc.TableSpec(name="user", vocab_size=64, embedding_dim=8, combiner="sum",
                     optimizer=tc.SGD(learning_rate=0.1))
    plan = tc.plan_stacking([tc.FeatureSpec(name="user", table=t, input_shape=(16, 1))],
                            tc.Topology(global_devices=1, sc_per_device=2))

    def loss(params: Any, acts: Any, labels: Any) -> Any:
        return jnp.mean((acts["user"] @ params - labels) ** 2)

    step = pl.TrainStep(stages=pl.sparsecore_stages(plan, pl.optax_tc(loss, optax.sgd(0.1))),
                        pipelined=False)
    batch = tc.preprocess(plan, {"user": np.arange(16).reshape(16, 1)})[0]
    dense = pl.DenseState.create(jnp.ones(8), optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"takes StepInput\(batch, dense\), got tuple"):
        step.init(ops.init_tables(plan, jax.random.key(0)), dense, (batch, jnp.zeros(16)))  # type: ignore[arg-type]
    state = step.init(ops.init_tables(plan, jax.random.key(0)), dense,
                      pl.StepInput(batch, jnp.zeros(16)))
    for bad, message in (({"batch": batch}, "got dict"),
                         (pl.StepInput(None, jnp.zeros(16)), "StepInput.batch must be the "  # type: ignore[arg-type]
                                                             "PreprocessedBatch .* got NoneType")):
        with pytest.raises(TypeError, match=message):
            list(pl.run_loop(step, state, [bad]))  # type: ignore[list-item]


@pytest.mark.parametrize("steps", [2.5, "3", True, -1])
def test_pipeline_steps_takes_a_count(steps: Any) -> None:
    with pytest.raises(ValueError, match="num_steps must be an integer ≥ 0"):
        pl.pipeline_steps(steps)


def _started(case: Case, plan: tc.StackingPlan, *, donate: bool = True, pipelined: bool = True,
             stages: pl.Stages | None = None) -> tuple[pl.TrainStep, pl.TrainState]:
    step = pl.TrainStep(stages=stages or _stages(plan), donate=donate, pipelined=pipelined)
    params = jax.tree.map(jnp.asarray, _initial_params(case))
    return step, step.init(_variables(case, plan),
                           pl.DenseState.create(params, optax.sgd(DENSE_LR)),
                           _inputs(case, plan, 0))


def _snapshot(state: pl.TrainState) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((state.variables, state.dense.params))]


def test_a_pipelined_run_left_early_finishes_its_last_step() -> None:
    """A `break` (then `finish()`) or batches that raise left the state mid-pipeline: the
    dense parameters had the last yielded step's update, the tables not. Now the state
    equals that of a run over just the batches whose steps were yielded."""
    case = _case("sgd")
    plan = case.plan(1)
    batches = [_inputs(case, plan, j) for j in range(5)]
    step, state = _started(case, plan)
    whole = pl.run_loop(step, state, batches[:3])
    assert [r.step for r in whole] == [0, 1, 2]
    want = _snapshot(whole.state)

    step, state = _started(case, plan)
    run = pl.run_loop(step, state, batches)
    for result in run:
        if result.step == 2:
            break
    assert run.finish() is run.state and list(run) == []
    for got, expected in zip(_snapshot(run.state), want, strict=True):
        np.testing.assert_array_equal(got, expected)

    def failing() -> Any:
        yield from batches[:4]  # the fourth is read ahead, its step not yielded
        raise OSError("the data file went away")

    step, state = _started(case, plan)
    run = pl.run_loop(step, state, failing())
    with pytest.raises(OSError, match="went away"):
        for _ in run:
            pass
    for got, expected in zip(_snapshot(run.state), want, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_failed_donating_step_says_its_state_is_gone() -> None:
    """A donating step that raised (here `check_finite` on NaN labels) left `run.state`
    pointing at deleted arrays, and the error did not say so."""
    case = _case("sgd")
    plan = case.plan(1)
    stages = pl.sparsecore_stages(plan, pl.optax_tc(loss_fn, optax.sgd(DENSE_LR)),
                                  options=ops.UpdateOptions(check_finite=True))
    bad = _inputs(case, plan, 1)
    bad = bad._replace(dense=np.full_like(bad.dense, np.nan))
    step, state = _started(case, plan, stages=stages, donate=False, pipelined=False)
    kept = _snapshot(state)
    with pytest.raises(Exception, match="NaN or Inf") as raised:
        step(step(state, _inputs(case, plan, 0))[0], bad)
    assert "donates" not in "".join(getattr(raised.value, "__notes__", []))  # nothing taken
    assert all(np.array_equal(a, b) for a, b in zip(_snapshot(state), kept, strict=True))
    step, state = _started(case, plan, stages=stages, pipelined=False)
    with pytest.raises(Exception, match="NaN or Inf") as raised:
        step(step(state, _inputs(case, plan, 0))[0], bad)
    assert "donates its state (donate=True)" in "".join(raised.value.__notes__)
