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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from _compat_cases import feature_specs as reference_feature_specs
from _compat_cases import native_batch
from tilecore import ops
from tilecore.compat import embedding_spec
from tilecore.compat.lib.flax._sparse import make_plan
from tilecore.compat.lib.flax.linen import embed, embed_optimizer
from tilecore.compat.lib.flax.nnx import embed as nnx_embed
from tilecore.compat.utils import utils

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
        acts = embed.SparseCoreEmbed(self.feature_specs, sharding_axis="x", _mesh=MESH,
                                     num_sc_per_device=SC)(inputs)
        x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
        return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))[:, 0]


def loss_of_acts(acts: Any, dense: Any, labels: jax.Array) -> jax.Array:
    """The dense head of `Model` on given activations, with its parameters passed in."""
    x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
    h = nn.relu(x @ dense["params"]["Dense_1"]["kernel"] + dense["params"]["Dense_1"]["bias"])
    return bce((h @ dense["params"]["Dense_0"]["kernel"])[:, 0]
               + dense["params"]["Dense_0"]["bias"][0], labels)


def test_linen_reference_loop_learns_and_matches_native_ops() -> None:
    specs = feature_specs()
    model = Model(specs)
    layer = embed.SparseCoreEmbed(specs, sharding_axis="x", _mesh=MESH, num_sc_per_device=SC)
    data = [(layer.preprocess_inputs(i, ids, None), labels)
            for i, (ids, labels) in enumerate(examples())]
    params = model.init(jax.random.key(0), data[0][0])
    boxed: Any = params["params"]["SparseCoreEmbed_0"]["sc_embedding_variables"]
    assert isinstance(boxed, embed.WithSparseCoreLayout) and boxed.names == ("x", None)
    tx = embed_optimizer.create_optimizer_for_sc_model(params, optax.adam(0.02))
    opt_state = tx.init(params)

    @functools.partial(jax.jit, out_shardings=(nn.meta.get_sharding(params, MESH), None, None),
                       donate_argnums=0)
    def train_step(params: Any, inputs: Any, labels: Any, opt_state: Any) -> Any:
        def forward(params: Any) -> jax.Array:
            logits: Any = model.apply(params, inputs)
            return bce(logits, labels)

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
        batch = native_batch(plan, inputs)
        dense: Any = {"params": {k: v for k, v in params["params"].items()
                                 if k.startswith("Dense")}}

        if step >= 2:  # compare with the (eager, slower) native ops on the first steps
            params, opt_state, loss = train_step(params, inputs, labels, opt_state)
            losses.append(float(loss))
            continue
        acts = ops.lookup(plan, batch, native)
        want = ops.lookup_grad(plan, batch, native, jax.grad(loss_of_acts)(acts, dense, labels), 0)
        want_loss = float(loss_of_acts(acts, dense, labels))
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

    shardings = (nnx_embed.get_named_sharding(model, MESH),
                 nnx_embed.get_named_sharding(optimizer, MESH), None, None)

    @nnx.jit(in_shardings=shardings)
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
        batch = native_batch(plan, inputs)
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
    layer = embed.SparseCoreEmbed(specs, sharding_axis="x", _mesh=MESH, num_sc_per_device=SC)
    inputs = layer.preprocess_inputs(0, examples(1)[0][0], None)
    with pytest.raises(ValueError, match="sc_embedding_variables' is missing"):
        model.apply({"params": {}}, inputs)
    with pytest.raises(ValueError, match=r"call it through model\.apply"):
        layer.apply_gradient({}, inputs)


def test_linen_reference_fields_and_layout_names() -> None:
    layer = embed.SparseCoreEmbed(feature_specs(), sharding_axis="x")  # _mesh, num_sc resolved
    assert layer.mesh.shape == {"x": jax.device_count()} and layer.num_shards == jax.device_count()
    assert layer.num_sc_per_device == utils.num_sparsecores_per_device(jax.devices()[0])
    assert embed.SparseCoreEmbed(feature_specs(), sharding_axis="x", _mesh=MESH,
                                 num_sc_per_device=SC).num_sc_per_device == SC
    assert layer.embedding_table_partition == PartitionSpec("x", None)
    assert layer.data_partition == PartitionSpec("x")
    fn: Any = lambda key: {"t": key}  # noqa: E731
    wrapped = embed.with_sparsecore_layout(fn, ("x", None), MESH)
    boxed = wrapped(jnp.ones((8, 2)))
    assert isinstance(boxed, embed.WithSparseCoreLayout)
    np.testing.assert_array_equal(boxed.unbox()["t"], jnp.ones((8, 2)))
    assert boxed.get_sharding(MESH) == NamedSharding(MESH, PartitionSpec("x", None))
    with pytest.raises(NotImplementedError, match="single mesh axis"):
        embed.SparseCoreEmbed(feature_specs(), sharding_axis=("x", "y"), _mesh=MESH)


def test_nnx_lookup_gradient_is_the_native_update_and_filters_split_state() -> None:
    specs = feature_specs()
    model = NnxModel(specs, nnx.Rngs(1))
    layer = model.embed
    assert layer.embedding_table.embedding_sharding == NamedSharding(
        MESH, PartitionSpec("x", None))
    def paths(state: Any) -> set[tuple[Any, ...]]:
        return {path for path, _ in nnx.to_flat_state(state)}

    assert paths(nnx.state(model, nnx_embed.is_embedding_variables)) == {
        ("embed", "embedding_table")}
    assert ("embed", "embedding_table") not in paths(
        nnx.state(model, nnx_embed.is_non_embedding_variables))
    inputs = layer.preprocess_inputs(0, examples(1)[0][0], None)
    grads = nnx.grad(lambda m: nnx_embed.embedding_lookup(m, inputs, step=3)["user"].sum())(layer)
    plan = make_plan(specs, 1, SC, "MOD", False, "test")
    before = layer.embedding_table.get_value()
    native = {s: ops.EmbeddingVariables(v.table, tuple(v.slot)) for s, v in before.items()}
    acts = ops.lookup(plan, native_batch(plan, inputs), native)
    want = ops.lookup_grad(plan, native_batch(plan, inputs), native,
                           {"user": jnp.ones_like(acts["user"]),
                            "item": jnp.zeros_like(acts["item"])}, 3)
    got = grads["embedding_table"].get_value()
    for s in plan.stacks:
        np.testing.assert_allclose(got[s].table, want[s].table, rtol=1e-6)
        np.testing.assert_allclose(got[s].slot.accumulator, want[s].slots[0], rtol=1e-6)


def test_linen_bfloat16_tables_give_bfloat16_activations_and_updates() -> None:
    specs = feature_specs()
    layer = embed.SparseCoreEmbed(specs, sharding_axis="x", _mesh=MESH, num_sc_per_device=SC)
    inputs = layer.preprocess_inputs(0, examples(1)[0][0], None)
    params = nn.meta.unbox(layer.init(jax.random.key(0), inputs))
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    acts = layer.apply(half, inputs)
    assert {a.dtype for a in jax.tree.leaves(acts)} == {jnp.dtype(jnp.bfloat16)}
    want = layer.apply(jax.tree.map(lambda x: x.astype(jnp.float32), half), inputs)
    for got, full in zip(jax.tree.leaves(acts), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), full, rtol=1e-2, atol=1e-3)
    grads = jax.grad(lambda p: sum(a.astype(jnp.float32).sum()
                                   for a in jax.tree.leaves(layer.apply(p, inputs))))(half)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    updated = layer.apply(half, jax.tree.map(jnp.ones_like, acts), inputs,
                          method=embed.SparseCoreEmbed.apply_gradient)
    assert {u.dtype for u in jax.tree.leaves(updated)} == {jnp.dtype(jnp.bfloat16)}


def test_integer_tables_are_refused() -> None:
    """Looked up in float32 and cast back to int32: truncated activations, no error."""
    mesh = Mesh(np.asarray(jax.devices()[:1]), "x")
    layer = embed.SparseCoreEmbed(reference_feature_specs(16, 2), sharding_axis="x", _mesh=mesh,
                                  num_sc_per_device=2)
    rng = np.random.default_rng(0)
    ids = {"user": rng.integers(0, 64, (16, 1)).astype(np.int32),
           "item": rng.integers(0, 96, (16, 3)).astype(np.int32)}
    inputs = layer.preprocess_inputs(0, ids, None)
    params = layer.init(jax.random.key(0), inputs)
    as_ints = jax.tree.map(lambda x: (x * 1000).astype(jnp.int32), params)
    with pytest.raises(ValueError, match=r"has dtype int32; tables and slots must be floating"):
        layer.apply(as_ints, inputs)


def test_linen_misuse_is_explained() -> None:
    specs = feature_specs()
    layer = embed.SparseCoreEmbed(specs, sharding_axis="x", _mesh=MESH, num_sc_per_device=SC)
    ids, _ = examples(1)[0]
    inputs = layer.preprocess_inputs(0, ids, None)
    with pytest.raises(ValueError, match=r"through model.init\(key, inputs\) or model.apply"):
        layer(inputs)
    params = layer.init(jax.random.key(0), inputs)
    acts: Any = layer.apply(params, inputs)
    transposed = {name: act.T for name, act in acts.items()}
    with pytest.raises(ValueError, match=r"Gradient of feature '\w+' has shape \(\d+, 32\); "
                                         r"expected its activations' shape \(32, \d+\)"):
        layer.apply(params, transposed, inputs, method=embed.SparseCoreEmbed.apply_gradient)
