"""tilecore.layers: the linen and nnx embedding layers train a small DLRM-style model
(Adagrad tables, optax adam dense) in one jitted step, and each step equals
`tilecore.ops.lookup`/`lookup_grad` and the numpy oracle.

The same checks run on 2 fake CPU devices in a subprocess (this file run as a
script), since JAX fixes the device count when it starts. Everything that touches
the mesh runs under `jit`: outside it, a sharded op runs primitive by primitive,
each compiled for the mesh on its own, which took minutes. A step compiles once:
the second and later steps must not compile at all.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import tilecore as tc
from tilecore import layers, ops
from tilecore.testing import reference_lookup, reference_lookup_grad

BATCH, STEPS, AXIS = 32, 20, "sparsecore"


def make_plan(devices: int = 1) -> tc.StackingPlan:
    """Two Adagrad tables (sum, mean), three features, one table feature-stacked."""
    user = tc.TableSpec(name="user", vocab_size=64, embedding_dim=8, combiner="sum",
                        optimizer=tc.Adagrad(learning_rate=0.3))
    item = tc.TableSpec(name="item", vocab_size=96, embedding_dim=4, combiner="mean",
                        optimizer=tc.Adagrad(learning_rate=0.3))
    features = [tc.FeatureSpec(name="user", table=user, input_shape=(BATCH, 1)),
                tc.FeatureSpec(name="item_a", table=item, input_shape=(BATCH, 3)),
                tc.FeatureSpec(name="item_b", table=item, input_shape=(BATCH, 3))]
    return tc.plan_stacking(features, tc.Topology(global_devices=devices, sc_per_device=2))


def data(plan: tc.StackingPlan, count: int = 4) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Random IDs; the label is a hidden per-ID score's sign, so the model can learn it."""
    rng = np.random.default_rng(0)
    score = {name: rng.normal(size=t.vocab_size) for name, t in plan.tables.items()}
    out = []
    for _ in range(count):
        ids = {name: rng.integers(0, f.table.vocab_size, f.input_shape)
               for name, f in plan.features.items()}
        logit = sum(score[plan.features[n].table.name][x].mean(1) for n, x in ids.items())
        out.append((ids, (logit > 0).astype(np.float32)))
    return out


def bce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def dense_input(acts: dict[str, jax.Array]) -> jax.Array:
    return jnp.concatenate([acts[name] for name in sorted(acts)], axis=-1)


class LinenDLRM(nn.Module):
    plan: tc.StackingPlan
    mesh: Any = None

    @nn.compact
    def __call__(self, batch: tc.PreprocessedBatch) -> jax.Array:
        acts = layers.LinenEmbed(self.plan, mesh=self.mesh, name="embed")(batch)
        return nn.Dense(1)(nn.relu(nn.Dense(16)(dense_input(acts))))[:, 0]


class NnxDLRM(nnx.Module):
    def __init__(self, plan: tc.StackingPlan, rngs: nnx.Rngs, mesh: Any = None) -> None:
        self.embed = layers.NnxEmbed(plan, rngs=rngs, mesh=mesh)
        width = sum(f.table.embedding_dim for f in plan.features.values())
        self.hidden = nnx.Linear(width, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, batch: tc.PreprocessedBatch) -> jax.Array:
        return self.out(nnx.relu(self.hidden(dense_input(self.embed(batch)))))[:, 0]


def linen_train_step(model: LinenDLRM, tx: optax.GradientTransformation) -> Any:
    """The train step of the `tilecore.layers._linen` docstring, plus its activation grads."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(variables: Any, opt_state: Any, batch: Any, labels: Any, step: Any) -> Any:
        def loss_fn(params: Any, probes: Any) -> jax.Array:
            return bce(model.apply({**variables, "params": params, "probes": probes}, batch),
                       labels)

        loss, (grads, act_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            variables["params"], variables["probes"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        embeddings = layers.update_embeddings(model, variables, act_grads, step, batch)
        params = optax.apply_updates(variables["params"], updates)
        new = {**variables, "params": params, "embeddings": embeddings}
        return new, opt_state, loss, act_grads["embed"]["activations"]

    return train_step


def nnx_train_step() -> Any:
    """The train step of the `tilecore.layers._nnx` docstring, plus its activation grads."""

    @nnx.jit
    def train_step(model: NnxDLRM, optimizer: layers.EmbedOptimizer, batch: Any,
                   labels: Any) -> tuple[jax.Array, Any]:
        def loss_fn(model: NnxDLRM) -> jax.Array:
            return bce(model(batch), labels)

        grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, layers.PARAMS_AND_PROBES))
        loss, grads = grad_fn(model)
        optimizer.update(model, grads, batch)
        return loss, grads["embed"]["probe"].get_value()

    return train_step


def _numpy(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[float]]:
    """Collects the duration of every XLA compilation inside the block."""
    durations: list[float] = []

    def listener(event: str, duration_secs: float, **_: str | int) -> None:
        if event == _BACKEND_COMPILE:
            durations.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield durations
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def on_mesh(tree: Any, mesh: Any) -> Any:
    """Replicates over `mesh` the leaves left on one device (dense params, optimizer state).

    A step's outputs come back on the mesh; inputs left on one device would make
    the second step compile again. Sharded leaves (the tables) stay as they are.
    """
    if mesh is None:
        return tree
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding)
                        else jax.device_put(x, replicated), tree)


def check_step(plan: tc.StackingPlan, inputs: dict[str, np.ndarray], batch: Any, before: Any,
               after: Any, acts: Any, act_grads: Any, mesh: Any) -> dict[str, np.ndarray]:
    """One step of a layer against ops and the oracle; returns the arrays compared."""
    want_acts = jax.jit(functools.partial(ops.lookup, plan, mesh=mesh))(batch, before)
    want_after = jax.jit(functools.partial(ops.lookup_grad, plan, mesh=mesh))(
        batch, before, act_grads, 0)
    tables = ops.unshard(plan, {s: v.table for s, v in before.items()})
    slots = {t: (ops.unshard(plan, {s: v.slots[0] for s, v in before.items()})[t],)
             for t in plan.tables}
    oracle_acts = reference_lookup(plan, inputs, None, tables)
    oracle_tables, oracle_slots = reference_lookup_grad(
        plan, inputs, None, tables, slots, _numpy(act_grads), 0)
    got_tables = ops.unshard(plan, {s: v.table for s, v in after.items()})
    got_slots = ops.unshard(plan, {s: v.slots[0] for s, v in after.items()})
    out = {}
    for f in plan.features:
        out[f"act/{f}"] = np.stack([np.asarray(acts[f]), np.asarray(want_acts[f]),
                                    oracle_acts[f].astype(np.float32)])
    for s in plan.stacks:
        out[f"stack/{s}"] = np.stack([np.asarray(after[s].table),
                                      np.asarray(want_after[s].table)])
    for t in plan.tables:
        out[f"table/{t}"] = np.stack([got_tables[t], oracle_tables[t]])
        out[f"slot/{t}"] = np.stack([got_slots[t], oracle_slots[t][0]])
    return out


def make_mesh(devices: int) -> Any:
    if devices == 1:
        return None
    return jax.make_mesh((devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def rows_sharded(tables: Any, mesh: Any) -> np.ndarray:
    """Whether every table and slot is split by rows over the mesh (vacuously, on one device)."""
    return np.asarray(mesh is None or all(
        x.sharding.spec[:1] == (AXIS,) for x in jax.tree.leaves(tables)))


def run_linen(devices: int, steps: int = STEPS) -> dict[str, np.ndarray]:
    plan = make_plan(devices)
    mesh = make_mesh(devices)
    model = LinenDLRM(plan, mesh)
    examples = data(plan)
    batches = [layers.LinenEmbed(plan).preprocess(ids)[0] for ids, _ in examples]
    variables = on_mesh(jax.jit(model.init)(jax.random.key(0), batches[0]), mesh)
    tx = optax.adam(0.02)
    opt_state = on_mesh(tx.init(variables["params"]), mesh)
    step_fn = linen_train_step(model, tx)
    out = {"rows_sharded": rows_sharded(variables["embeddings"], mesh)}
    first = jax.tree.map(jnp.copy, layers.embedding_variables(variables, "embed"))  # step donates
    acts = jax.jit(layers.LinenEmbed(plan, mesh=mesh).apply)({"embeddings": {"tables": first}},
                                                             batches[0])
    losses, compiles = [], []
    for step in range(steps):
        k = step % len(batches)
        with counting_compiles() as compiled:
            variables, opt_state, loss, act_grads = step_fn(
                variables, opt_state, batches[k], jnp.asarray(examples[k][1]), step)
        compiles.append(len(compiled))
        losses.append(float(loss))
        if step == 0:
            out.update(check_step(plan, examples[0][0], batches[0], first,
                                  layers.embedding_variables(variables), acts, act_grads,
                                  mesh))
    out["losses"] = np.asarray(losses)
    out["compiles"] = np.asarray(compiles)
    return out


def run_nnx(devices: int, steps: int = STEPS) -> dict[str, np.ndarray]:
    plan = make_plan(devices)
    mesh = make_mesh(devices)
    model = NnxDLRM(plan, nnx.Rngs(0), mesh)
    optimizer = layers.EmbedOptimizer(model, optax.adam(0.02))
    nnx.update((model, optimizer), on_mesh(nnx.state((model, optimizer)), mesh))
    examples = data(plan)
    batches = [model.embed.preprocess(ids)[0] for ids, _ in examples]
    step_fn = nnx_train_step()
    out = {"rows_sharded": rows_sharded(model.embed.tables.get_value(), mesh)}
    before = jax.tree.map(jnp.copy, model.embed.tables.get_value())
    acts = nnx.jit(layers.NnxEmbed.__call__)(model.embed, batches[0])
    losses, compiles = [], []
    for step in range(steps):
        k = step % len(batches)
        with counting_compiles() as compiled:
            loss, act_grads = step_fn(model, optimizer, batches[k], jnp.asarray(examples[k][1]))
        compiles.append(len(compiled))
        losses.append(float(loss))
        if step == 0:
            out.update(check_step(plan, examples[0][0], batches[0], before,
                                  model.embed.tables.get_value(), acts, act_grads, mesh))
    out["losses"] = np.asarray(losses)
    out["compiles"] = np.asarray(compiles)
    out["steps"] = np.asarray(optimizer.step[...])
    return out


def assert_results(out: dict[str, np.ndarray]) -> None:
    losses = out["losses"]
    assert np.all(np.isfinite(losses))
    assert out["rows_sharded"]
    assert out["compiles"][0] > 0 and not out["compiles"][1:].any(), out["compiles"]
    assert losses[-4:].mean() < losses[:4].mean() - 0.05, losses
    for key, stacked in out.items():
        if key.startswith("act/"):
            np.testing.assert_array_equal(stacked[0], stacked[1], key)  # layer == ops.lookup
            np.testing.assert_allclose(stacked[0], stacked[2], rtol=1e-5, atol=1e-6, err_msg=key)
        elif key.startswith("stack/"):
            np.testing.assert_allclose(stacked[0], stacked[1], rtol=1e-6, atol=1e-7, err_msg=key)
        elif key.startswith(("table/", "slot/")):
            np.testing.assert_allclose(stacked[0], stacked[1], rtol=1e-5, atol=1e-6, err_msg=key)
    assert any(k.startswith("table/") for k in out)


# --- one device here, two in a subprocess ---------------------------------------------------


def test_linen_trains_and_matches_ops_and_oracle() -> None:
    assert_results(run_linen(1))


def test_nnx_trains_and_matches_ops_and_oracle() -> None:
    out = run_nnx(1)
    assert int(out["steps"]) == STEPS
    assert_results(out)


@pytest.mark.parametrize("run", [run_linen, run_nnx], ids=["linen", "nnx"])
def test_second_step_does_not_compile(run: Any) -> None:
    """The first call of a fresh jitted step compiles; later steps (new batch, labels and
    step number, donated state) reuse it."""
    compiles = run(1, steps=3)["compiles"]
    assert compiles[0] > 0, "counting_compiles saw no compilation of a fresh step"
    np.testing.assert_array_equal(compiles[1:], 0, f"later steps compiled: {compiles}")


def worker(out_dir: Path) -> None:
    assert jax.device_count() == 2, jax.devices()
    np.savez(out_dir / "linen.npz", **run_linen(2))  # an Auto mesh needs no jax.set_mesh
    np.savez(out_dir / "nnx.npz", **run_nnx(2))


def _run_worker(out: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"]).strip())
    done = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, f"worker failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def two_devices(made_once: Callable[[str, Callable[[Path], object]], Path]) -> Path:
    return made_once("layers-two-devices", _run_worker)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_two_devices(two_devices: Path, kind: str) -> None:
    with np.load(two_devices / f"{kind}.npz") as arrays:
        assert_results({k: arrays[k] for k in arrays.files})


if __name__ == "__main__":
    worker(Path(sys.argv[1]))


# --- errors -------------------------------------------------------------------------------


def test_errors_name_the_problem() -> None:
    plan = make_plan()
    ids, _ = data(plan, 1)[0]
    layer = layers.LinenEmbed(plan)
    batch, _ = layer.preprocess(ids)
    variables = layer.init(jax.random.key(0), batch)
    with pytest.raises(ValueError, match="lack the 'embeddings' collection"):
        layer.apply({}, batch)  # apply before init / without the tables
    with pytest.raises(ValueError, match="missing \\['user'\\]"):
        layer.apply({"embeddings": {"tables": {"item": variables["embeddings"]["tables"]["item"]}}},
                    batch)
    grads = {"user": jnp.zeros((BATCH, 8)), "item_a": jnp.zeros((BATCH, 4)),
             "item_c": jnp.zeros((BATCH, 4))}
    with pytest.raises(ValueError, match=r"missing \['item_b'\], unknown \['item_c'\]"):
        layer.apply(variables, batch, grads, method="update", mutable=[layers.EMBEDDINGS])
    with pytest.raises(ValueError, match=r"needs apply\(\.\.\., mutable"):
        layer.apply(variables, batch, {f: jnp.zeros((BATCH, plan.features[f].table.embedding_dim))
                                       for f in plan.features}, method="update")
    with pytest.raises(ValueError, match="holds no layer's activation gradients"):
        layers.update_embeddings(layer, variables, {"params": {}}, 0, batch)
    for step in (1.5, 2**40):  # 1.5 was taken for step 1
        with pytest.raises(ValueError, match="step must be"):
            layers.update_embeddings(layer, variables, {"params": {}}, step, batch)
    other = tc.plan_stacking([tc.FeatureSpec(name="x", table=plan.tables["user"],
                                             input_shape=(BATCH, 1))],
                             tc.Topology(global_devices=1, sc_per_device=2))
    with pytest.raises(ValueError, match="preprocess with this layer's plan"):
        layer.apply(variables, layers.LinenEmbed(other).preprocess({"x": ids["user"]})[0])
    model = NnxDLRM(plan, nnx.Rngs(0))
    optimizer = layers.EmbedOptimizer(model, optax.sgd(0.1))
    grads_params = nnx.grad(lambda m: bce(m(batch), jnp.zeros(BATCH)))(model)
    with pytest.raises(ValueError, match="no activation gradients for the NnxEmbed at 'embed'"):
        optimizer.update(model, grads_params, batch)
    with pytest.raises(ValueError, match="pass the batch"):
        optimizer.update(model, grads_params)


class _TwoEmbeds(nn.Module):
    plan: tc.StackingPlan

    @nn.compact
    def __call__(self, batch: tc.PreprocessedBatch) -> jax.Array:
        a = layers.LinenEmbed(self.plan, name="left")(batch)
        b = layers.LinenEmbed(self.plan, name="right")(batch)
        return dense_input(a) + dense_input(b)


def test_embedding_variables_finds_each_linen_layer() -> None:
    plan = make_plan()
    ids, _ = data(plan, 1)[0]
    batch, _ = layers.LinenEmbed(plan).preprocess(ids)
    root = layers.LinenEmbed(plan).init(jax.random.key(0), batch)
    assert layers.embedding_variables(root) is not None  # the layer at the root
    assert set(layers.embedding_variables(root)) == set(plan.stacks)
    nested = LinenDLRM(plan).init(jax.random.key(1), batch)
    found = layers.embedding_variables(nested)
    assert found == layers.embedding_variables(nested, "embed")
    assert all(v is nested["embeddings"]["embed"]["tables"][s] for s, v in found.items())
    two = _TwoEmbeds(plan).init(jax.random.key(2), batch)
    left, right = (layers.embedding_variables(two, n) for n in ("left", "right"))
    assert not np.array_equal(np.asarray(left[next(iter(plan.stacks))].table),
                              np.asarray(right[next(iter(plan.stacks))].table))
    with pytest.raises(KeyError, match=r"2 LinenEmbed layers \(\['left', 'right'\]\); name one"):
        layers.embedding_variables(two)
    with pytest.raises(KeyError, match=r"no LinenEmbed at 'middle'; .* \['left', 'right'\]"):
        layers.embedding_variables(two, "middle")
    with pytest.raises(KeyError, match=r"no 'embeddings' collection .* \['params'\]"):
        layers.embedding_variables({"params": {}})
