"""tilecore.compat.flax: the reference's linen and nnx training loops, ported by changing
the import, run, learn, and match tilecore's native ops step by step."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from tilecore.compat.flax._sparse import make_plan, native_batch
from tilecore.compat.flax.linen import embed, embed_optimizer
from tilecore.compat.flax.nnx import embed as nnx_embed

from _compat_cases import feature_specs as reference_feature_specs
from tilecore import ops
from tilecore.compat import embedding_spec

BATCH, STEPS, SC = 32, 12, 2


def feature_specs() -> dict[str, embedding_spec.FeatureSpec]:
    return reference_feature_specs(BATCH, SC)


def examples(count: int = 3) -> list[tuple[dict[str, np.ndarray], jax.Array]]:
    rng = np.random.default_rng(0)
    score = {"user": rng.normal(size=64), "item": rng.normal(size=96)}
    out = []
    for _ in range(count):
        ids = {"user": rng.integers(0, 64, (BATCH, 1)).astype(np.int32),
               "item": rng.integers(0, 96, (BATCH, 3)).astype(np.int32)}
        logit = score["user"][ids["user"]].mean(1) + score["item"][ids["item"]].mean(1)
        out.append((ids, jnp.asarray((logit > 0).astype(np.float32))))
    return out


def bce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


MESH = Mesh(np.asarray(jax.devices()[:1]), "x")


class Model(nn.Module):
    feature_specs: Any

    @nn.compact
    def __call__(self, inputs: Any) -> jax.Array:
        acts = embed.SparseCoreEmbed(self.feature_specs, sharding_axis="x", mesh=MESH,
                                     num_sc_per_device=SC)(inputs)
        x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
        return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))[:, 0]


def test_linen_reference_loop_learns_and_matches_native_ops() -> None:
    specs = feature_specs()
    model = Model(specs)
    layer = embed.SparseCoreEmbed(specs, sharding_axis="x", mesh=MESH, num_sc_per_device=SC)
    data = [(layer.preprocess_inputs(i, ids, None), labels)
            for i, (ids, labels) in enumerate(examples())]
    params = model.init(jax.random.key(0), data[0][0])
    tx = embed_optimizer.create_optimizer_for_sc_model(params, optax.adam(0.02))
    opt_state = tx.init(params)

    @functools.partial(jax.jit, out_shardings=(nn.meta.get_sharding(params, MESH), None, None),
                       donate_argnums=0)
    def train_step(params: Any, inputs: Any, labels: Any, opt_state: Any) -> Any:
        def forward(params: Any) -> jax.Array:
            return bce(model.apply(params, inputs), labels)

        loss, grads = jax.value_and_grad(forward, allow_int=True)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return embed_optimizer.apply_updates_for_sc_model(params, updates), opt_state, loss

    plan = make_plan(specs, 1, SC, "MOD", False, "test")
    losses = []
    for step in range(STEPS):
        inputs, labels = data[step % len(data)]
        path = ("params", "SparseCoreEmbed_0", "sc_embedding_variables")
        before = jax.tree.map(jnp.array, nn.meta.unbox(params[path[0]][path[1]][path[2]]))
        native = {s: ops.EmbeddingVariables(v.table, tuple(v.slot)) for s, v in before.items()}
        batch = native_batch(plan, inputs, "test")
        dense = {"params": {k: v for k, v in params["params"].items() if k.startswith("Dense")}}

        def loss_of_acts(acts: Any, dense: Any = dense, labels: Any = labels) -> jax.Array:
            x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
            h = nn.relu(x @ dense["params"]["Dense_1"]["kernel"] + dense["params"]["Dense_1"]["bias"])
            return bce((h @ dense["params"]["Dense_0"]["kernel"])[:, 0]
                       + dense["params"]["Dense_0"]["bias"][0], labels)

        if step >= 2:  # compare with the (eager, slower) native ops on the first steps
            params, opt_state, loss = train_step(params, inputs, labels, opt_state)
            losses.append(float(loss))
            continue
        acts = ops.lookup(plan, batch, native)
        want = ops.lookup_grad(plan, batch, native, jax.grad(loss_of_acts)(acts), 0)
        want_loss = float(loss_of_acts(acts))
        params, opt_state, loss = train_step(params, inputs, labels, opt_state)
        losses.append(float(loss))
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
        got = nn.meta.unbox(params[path[0]][path[1]][path[2]])
        for s in plan.stacks:
            np.testing.assert_allclose(got[s].table, want[s].table, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got[s].slot.accumulator, want[s].slots[0], rtol=1e-5)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.02, losses


class NnxModel(nnx.Module):
    def __init__(self, specs: Any, rngs: nnx.Rngs) -> None:
        self.embed = nnx_embed.SparseCoreEmbed(specs, "x", MESH, rngs, num_sc_per_device=SC)
        self.hidden = nnx.Linear(12, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, inputs: Any) -> jax.Array:
        acts = self.embed(inputs)
        x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
        return self.out(nnx.relu(self.hidden(x)))[:, 0]


def test_nnx_reference_loop_learns_and_updates_like_native_ops() -> None:
    specs = feature_specs()
    model = NnxModel(specs, nnx.Rngs(0))
    optimizer = nnx_embed.PartitionedOptimizer(model, optax.adam(0.02))
    data = [(model.embed.preprocess_inputs(i, ids, None), labels)
            for i, (ids, labels) in enumerate(examples())]

    @nnx.jit
    def train_step(model: NnxModel, optimizer: Any, inputs: Any, labels: Any) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: bce(m(inputs), labels))(model)
        optimizer.update(model, grads)
        return loss

    plan = make_plan(specs, 1, SC, "MOD", False, "test")
    losses = []
    for step in range(STEPS):
        inputs, labels = data[step % len(data)]
        before = jax.tree.map(jnp.array, model.embed.embedding_table.get_value())
        native = {s: ops.EmbeddingVariables(v.table, tuple(v.slot)) for s, v in before.items()}
        batch = native_batch(plan, inputs, "test")
        acts = ops.lookup(plan, batch, native)
        np.testing.assert_array_equal(model.embed(inputs)["user"], acts["user"])
        losses.append(float(train_step(model, optimizer, inputs, labels)))
        touched = model.embed.embedding_table.get_value()
        for s in plan.stacks:  # only rows of this batch changed, and they did change
            changed = np.any(np.asarray(touched[s].table) != np.asarray(before[s].table), axis=1)
            assert changed.any() and not changed.all(), s
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.02, losses


def test_compat_errors() -> None:
    specs = feature_specs()
    unprepared = {"f": embedding_spec.FeatureSpec(
        name="f", table_spec=embedding_spec.TableSpec(
            name="t", vocabulary_size=8, embedding_dim=8, initializer=None,
            optimizer=embedding_spec.SGDOptimizerSpec(), combiner="sum"),
        input_shape=[BATCH, 1], output_shape=[BATCH, 8])}
    with pytest.raises(ValueError, match="prepare_feature_specs_for_training"):
        nnx_embed.SparseCoreEmbed(unprepared, "x", MESH, nnx.Rngs(0))
    model = Model(specs)
    layer = embed.SparseCoreEmbed(specs, sharding_axis="x", mesh=MESH, num_sc_per_device=SC)
    inputs = layer.preprocess_inputs(0, examples(1)[0][0], None)
    with pytest.raises(ValueError, match="sc_embedding_variables' is missing"):
        model.apply({"params": {}}, inputs)
    with pytest.raises(ValueError, match=r"call it through model\.apply"):
        layer.apply_gradient({}, inputs)
