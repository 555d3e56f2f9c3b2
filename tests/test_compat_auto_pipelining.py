"""tilecore.compat.lib.auto_pipelining: a plain train step (compat lookup → dense model →
compat update), wrapped by `auto_pipelining`, trains exactly as the hand-written
one-step-stale loop and as `embedding_pipelining_utils.step` (tilecore.pipelining) do;
the steps it cannot split fail with errors that say why.

Run as `python tests/test_compat_auto_pipelining.py multidevice` (with 2 fake CPU
devices) it checks the same on a 2-device mesh; `test_two_devices` does that.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from _xla_flags import xla_flags
from tilecore.compat import embedding, embedding_spec
from tilecore.compat.lib.auto_pipelining import auto_pipelining as ap
from tilecore.compat.lib.auto_pipelining import decompose, preprocess, utils

HERE = Path(__file__).resolve()
BATCH, SC, STEPS = 8, 2, 4


class Carry(NamedTuple):
    tables: Any
    w: jax.Array
    steps: jax.Array  # the global step, handed to the update as `step=`


@dataclasses.dataclass
class Case:
    specs: dict[str, Any]
    mesh: Mesh
    carry: Carry
    data: list[tuple[Any, jax.Array]]

    @property
    def devices(self) -> int:
        return self.mesh.size

    def fresh_carry(self) -> Carry:
        return jax.tree.map(jnp.copy, self.carry)


def make_case(optimizer: str, devices: int = 1, steps: int = STEPS) -> Case:
    """Two tables (user: sum, dim 8; item: mean, dim 4) with SGD or Adagrad, prepared
    for `devices`; `steps` batches of IDs and regression targets."""
    init = jax.nn.initializers.uniform(0.1)
    opt = (embedding_spec.SGDOptimizerSpec(learning_rate=0.5) if optimizer == "sgd"
           else embedding_spec.AdagradOptimizerSpec(learning_rate=0.3))
    user = embedding_spec.TableSpec(name="user", vocabulary_size=64, embedding_dim=8,
                                    initializer=init, optimizer=opt, combiner="sum")
    item = embedding_spec.TableSpec(name="item", vocabulary_size=96, embedding_dim=4,
                                    initializer=init, optimizer=opt, combiner="mean")
    specs = {
        "user": embedding_spec.FeatureSpec(name="user", table_spec=user, input_shape=[BATCH, 1],
                                           output_shape=[BATCH, 8]),
        "item": embedding_spec.FeatureSpec(name="item", table_spec=item, input_shape=[BATCH, 3],
                                           output_shape=[BATCH, 4]),
    }
    embedding.prepare_feature_specs_for_training(specs, global_device_count=devices,
                                                 num_sc_per_device=SC)
    mesh = Mesh(np.array(jax.devices()[:devices]), "x")
    tables = embedding.init_embedding_variables(
        jax.random.key(1), embedding.get_table_specs(specs),
        NamedSharding(mesh, PartitionSpec("x", None)), SC)
    rng = np.random.default_rng(0)
    data = []
    for _ in range(steps):
        ids = {"user": rng.integers(0, 64, (BATCH, 1)).astype(np.int32),
               "item": rng.integers(0, 96, (BATCH, 3)).astype(np.int32)}
        sparse, _ = embedding.preprocess_sparse_dense_matmul_input(
            ids, None, specs, devices, devices, num_sc_per_device=SC)
        data.append((sparse, jnp.asarray(rng.normal(size=BATCH), jnp.float32)))
    w = jnp.asarray(rng.normal(size=12), jnp.float32) * 0.3
    return Case(specs, mesh, Carry(tables, w, jnp.int32(0)), data)


def sc_functions(case: Case, style: str) -> tuple[Any, Any]:
    """`lookup(sparse, tables)` and `update(grads, sparse, tables, step)` written the
    reference's way (per device in shard_map) or on global arrays."""
    kw = {"feature_specs": case.specs, "global_device_count": case.devices,
          "num_sc_per_device": SC}
    lookup = functools.partial(embedding.tpu_sparse_dense_matmul, **kw)
    update = functools.partial(embedding.tpu_sparse_dense_matmul_grad, **kw)
    if style == "global":
        mesh = {"mesh": case.mesh} if case.devices > 1 else {}
        return (functools.partial(lookup, **mesh),
                lambda g, x, v, step: update(g, x, v, step=step, **mesh))
    x, rep = PartitionSpec("x"), PartitionSpec()
    return (jax.shard_map(lookup, mesh=case.mesh, in_specs=(x, x), out_specs=x,
                          check_vma=False),
            jax.shard_map(lambda g, s, v, step: update(g, s, v, step=step), mesh=case.mesh,
                          in_specs=(x, x, x, rep), out_specs=x, check_vma=False))


def dense(w: jax.Array, acts: Any, labels: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
    """The dense model: a linear regression on both features; SGD on `w`."""

    def loss_fn(w: jax.Array, acts: Any) -> jax.Array:
        x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
        return jnp.mean((x @ w - labels) ** 2)

    loss, (gw, ga) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w, acts)
    return loss, w - 0.1 * gw, ga


def make_step(case: Case, style: str = "global") -> Any:
    """The plain, unpipelined train step a user writes."""
    lookup, update = sc_functions(case, style)

    def train_step(carry: Carry, sparse: Any, labels: jax.Array) -> tuple[Carry, jax.Array]:
        acts = lookup(sparse, carry.tables)
        loss, w, grads = dense(carry.w, acts, labels)
        tables = update(grads, sparse, carry.tables, carry.steps)
        return Carry(tables, w, carry.steps + 1), loss

    return train_step


def stale_loop(case: Case, style: str = "global") -> tuple[list[jax.Array], Carry]:
    """The schedule by hand: the lookup of step i sees the updates of steps ≤ i−2."""
    lookup, update = sc_functions(case, style)
    lookup, update, run_dense = jax.jit(lookup), jax.jit(update), jax.jit(dense)
    start = case.fresh_carry()
    tables, w, pending, losses = start.tables, start.w, None, []
    for i, (sparse, labels) in enumerate(case.data):
        acts = lookup(sparse, tables)
        if pending is not None:  # step i−1's update, after step i's lookup
            tables = update(pending[0], pending[1], tables, pending[2])
        loss, w, grads = run_dense(w, acts, labels)
        pending = (grads, sparse, jnp.int32(i))
        losses.append(loss)
    assert pending is not None
    tables = update(pending[0], pending[1], tables, pending[2])
    return losses, Carry(tables, w, jnp.int32(len(case.data)))


def run_pipelined(case: Case, step: Any, **kwargs: Any) -> tuple[list[Any], Carry]:
    """Every result the pipelined loop returns (one per call, then finalize's)."""
    fn = ap.auto_pipelining(step, out_shardings=None, **kwargs)
    state, carry, results = ap.init_state(), case.fresh_carry(), []
    for sparse, labels in case.data:
        state, (carry, loss) = fn(state, carry, sparse, labels)
        results.append(loss)
    state, (carry, loss) = ap.finalize_pipelining(fn, state, carry)
    assert state.activations_1 is None and state.updates_0 is None
    return [*results, loss], carry


@functools.cache
def pipelined(optimizer: str) -> tuple[Case, list[Any], Carry, int]:
    """A 1-device case, its pipelined results and final carry, and how often the
    step was traced (dumping the part jaxprs to $TEST_UNDECLARED_OUTPUTS_DIR if set)."""
    case = make_case(optimizer)
    step, traces = make_step(case), []

    def counted(carry: Carry, sparse: Any, labels: jax.Array) -> Any:
        traces.append(1)
        return step(carry, sparse, labels)

    results, carry = run_pipelined(case, counted)
    return case, results, carry, len(traces)


def assert_same(got: Any, want: Any) -> None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)


def test_public_names() -> None:
    from tilecore.compat.lib import auto_pipelining as package

    assert set(package.__all__) == {"auto_pipelining", "decompose", "preprocess", "utils"}
    for name in ("EmbeddingPipeliningState", "PipeliningFunction", "init_state",
                 "finalize_pipelining", "auto_pipelining", "dump_jaxpr", "FunctionArgs",
                 "FunctionResults"):
        assert getattr(package.auto_pipelining, name) is not None, name
    assert ap.init_state() == ap.EmbeddingPipeliningState(None, None, None)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_pipelined_step_is_the_one_step_stale_loop(optimizer: str) -> None:
    case, results, carry, traces = pipelined(optimizer)
    want_losses, want = stale_loop(case)
    assert results[0] is None  # call 1 only looks step 1 up
    assert_same(results[1:], want_losses)
    assert_same(carry, want)
    assert int(carry.steps) == STEPS
    # Calls 1–3 see three state structures, later calls reuse call 3's program; the
    # two finalize calls add two: no step compiles twice.
    assert traces == 3 + 2
    if optimizer == "adagrad":
        return
    # The staleness is real: the plain loop (no pipelining) ends elsewhere.
    plain, plain_step = case.fresh_carry(), jax.jit(make_step(case))
    for sparse, labels in case.data:
        plain, _ = plain_step(plain, sparse, labels)
    assert not np.allclose(plain.w, carry.w)


def test_matches_tilecore_explicit_pipelining() -> None:
    from tilecore.compat.lib.nn import embedding_pipelining_utils as ep

    case, results, carry, _ = pipelined("adagrad")
    lookup, update = sc_functions(case, "global")

    def sc_fwd(sparse: Any, tables: Any) -> tuple[Any, None]:
        return lookup(sparse, tables), None

    def tc(acts: Any, labels: jax.Array, state: Any, aux: Any = None) -> Any:
        loss, w, grads = dense(state[0], acts, labels)
        return grads, loss, (w, state[1] + 1), state[1]  # tc_aux: the step, for the update

    def sc_bwd(sparse: Any, grads: Any, tables: Any, step: Any = None, /) -> tuple[Any, None]:
        return update(grads, sparse, tables, step), None

    first = ep.CurrentStepInput(sparse_inputs=case.data[0][0], dense_inputs=case.data[0][1])
    start = case.fresh_carry()
    tc_state, tables = (start.w, start.steps), start.tables
    pipeline = ep.get_initial_state(first, tc_state, tables, sc_fwd, tc)
    run = jax.jit(functools.partial(ep.step, sc_fwd_function=sc_fwd, tc_function=tc,
                                    sc_bwd_function=sc_bwd), static_argnames="fake_tc_step")
    losses = []
    for call in range(ep.get_pipeline_train_steps(STEPS)):
        given = (ep.CurrentStepInput(sparse_inputs=case.data[call][0],
                                     dense_inputs=case.data[call][1])
                 if call < STEPS else jax.tree.map(jnp.zeros_like, first))
        valid = ep.is_output_valid(call, STEPS)
        loss, _, tc_state, tables, pipeline = run(given, tc_state, tables, pipeline,
                                                  fake_tc_step=not valid)
        losses += [loss] if valid else []
    assert_same(results[1:], losses)
    w, steps = typing.cast(Any, tc_state)
    assert_same(carry, Carry(tables, w, steps))


def test_reference_style_shard_map_step() -> None:
    case = make_case("adagrad")
    results, carry = run_pipelined(case, make_step(case, "shard_map"))
    want_losses, want = stale_loop(case, "shard_map")
    assert_same(results[1:], want_losses)
    assert_same(carry, want)


def test_static_arguments_are_python_values_and_follow_their_step() -> None:
    case = make_case("sgd", steps=3)
    lookup, update = sc_functions(case, "global")

    def train_step(carry: Carry, sparse: Any, labels: jax.Array, scale: float
                   ) -> tuple[Carry, jax.Array]:
        assert isinstance(scale, float)
        acts = lookup(sparse, carry.tables)
        loss, w, grads = dense(carry.w, acts, labels)
        grads = jax.tree.map(lambda g: g * scale, grads)
        return Carry(update(grads, sparse, carry.tables, carry.steps), w, carry.steps + 1), loss

    fn = ap.auto_pipelining(train_step, out_shardings=None, static_argnums=(3,))
    state, carry = ap.init_state(), case.fresh_carry()
    for i, (sparse, labels) in enumerate(case.data):
        state, (carry, _) = fn(state, carry, sparse, labels, 1.0 if i % 2 else 2.0)
    _, (carry, _) = ap.finalize_pipelining(fn, state, carry)
    # By hand: step i's gradients scaled by its own static value.
    lookup_j, update_j = jax.jit(lookup), jax.jit(update)
    tables, w, pending = case.fresh_carry().tables, case.carry.w, None
    for i, (sparse, labels) in enumerate(case.data):
        acts = lookup_j(sparse, tables)
        if pending is not None:
            tables = update_j(pending[0], pending[1], tables, pending[2])
        _, w, grads = dense(w, acts, labels)
        grads = jax.tree.map(lambda g, s=1.0 if i % 2 else 2.0: g * s, grads)
        pending = (grads, sparse, jnp.int32(i))
    assert pending is not None
    tables = update_j(pending[0], pending[1], tables, pending[2])
    assert_same(carry, Carry(tables, w, jnp.int32(3)))


def test_decomposed_parts() -> None:
    """The four jaxprs: lookups only in lookup/update_lookup, updates only in
    update/update_lookup, neither in dense."""
    case = make_case("adagrad")
    sparse, labels = case.data[0]
    from tilecore.compat import _auto_pipelining as private

    runner = private.build_runner(make_step(case), (), case.carry, (sparse, labels))
    parts = ("lookup_jaxpr", "dense_jaxpr", "update_jaxpr", "update_lookup_jaxpr")

    def count(part: str, kind: Any) -> int:
        return sum(kind(e) for e in getattr(runner, part).eqns)

    assert [count(p, utils.is_embedding_lookup) for p in parts] == [1, 0, 0, 1]
    assert [count(p, utils.is_embedding_update) for p in parts] == [0, 0, 1, 1]
    assert runner.activations_len == 2  # one activation per feature
    acts = runner.embedding_lookup(case.carry, sparse, labels)
    updates, carry, loss = runner.dense(acts, case.carry, sparse, labels)
    assert all(a is b for a, b in zip(jax.tree.leaves(carry.tables),  # passed through
                                      jax.tree.leaves(case.carry.tables), strict=True))
    assert float(loss) > 0 and len(updates) == runner.update_params_len


def test_dump_jaxpr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case("sgd", steps=1)
    monkeypatch.setenv("TEST_UNDECLARED_OUTPUTS_DIR", str(tmp_path))
    fn = ap.auto_pipelining(make_step(case), out_shardings=None)
    fn(ap.init_state(), case.fresh_carry(), *case.data[0])
    for part in ("lookup", "dense", "update", "update_lookup"):
        text = (tmp_path / f"jaxpr_{part}.txt").read_text()
        assert ("tilecore_embedding_lookup" in text) == (part in ("lookup", "update_lookup"))
        assert ("tilecore_embedding_update" in text) == (part in ("update", "update_lookup"))
    ap.dump_jaxpr(jax.make_jaxpr(jnp.sin)(1.0), "mine")
    assert "sin" in (tmp_path / "jaxpr_mine.txt").read_text()
    monkeypatch.delenv("TEST_UNDECLARED_OUTPUTS_DIR")
    ap.dump_jaxpr(jax.make_jaxpr(jnp.cos)(1.0), "not_written")
    assert not (tmp_path / "jaxpr_not_written.txt").exists()


# --- steps built from the Flax layers ---------------------------------------------------------


def nnx_step(case: Case) -> tuple[Any, Any]:
    """The nnx program: `SparseCoreEmbed` + the dense model as nnx parameters, the
    step splitting and merging the model and `PartitionedOptimizer` (the carry is
    their nnx state); the layer's update sees the optimizer's step count."""
    import flax.nnx as nnx
    import optax

    from tilecore.compat.lib.flax.nnx import embed as nnx_embed

    class Model(nnx.Module):
        def __init__(self) -> None:
            self.embed = nnx_embed.SparseCoreEmbed(case.specs, "x", case.mesh, nnx.Rngs(0),
                                                   num_sc_per_device=SC)
            self.embed.embedding_table.set_value(case.fresh_carry().tables)
            self.w = nnx.Param(jnp.copy(case.carry.w))  # the carry is donated

    model = Model()
    graphdef, state = nnx.split((model, nnx_embed.PartitionedOptimizer(model, optax.sgd(0.1))))

    def step(state: Any, sparse: Any, labels: jax.Array) -> tuple[Any, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model: Any) -> jax.Array:
            acts = model.embed(sparse, optimizer.step[...])
            x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
            return jnp.mean((x @ model.w[...] - labels) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def as_carry(state: Any) -> Carry:
        model, optimizer = nnx.merge(graphdef, state)
        return Carry(model.embed.embedding_table.get_value(), model.w[...],
                     optimizer.step[...])

    return step, state, as_carry


def linen_step(case: Case) -> tuple[Any, Any]:
    """The linen program: `SparseCoreEmbed` + the dense model's `w` in one module,
    optax through `embed_optimizer` (the carry is `(params, opt_state, step)`)."""
    import flax.linen as nn
    import optax
    from flax.core import meta

    from tilecore.compat.lib.flax.linen import embed, embed_optimizer

    class Model(nn.Module):
        @nn.compact
        def __call__(self, sparse: Any) -> jax.Array:
            acts = embed.SparseCoreEmbed(case.specs, sharding_axis="x", _mesh=case.mesh,
                                         num_sc_per_device=SC)(sparse)
            x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
            return x @ self.param("w", lambda _: jnp.copy(case.carry.w))

    model = Model()
    # Jitted: run eagerly, the layer's shard_map compiles each of its operations alone.
    params = meta.unbox(jax.jit(model.init)(jax.random.key(0), case.data[0][0])["params"])
    params["SparseCoreEmbed_0"][embed.EMBEDDING_PARAM_NAME] = case.fresh_carry().tables
    tx = embed_optimizer.create_optimizer_for_sc_model(params, optax.sgd(0.1))

    def step(carry: Any, sparse: Any, labels: jax.Array) -> tuple[Any, jax.Array]:
        params, opt_state, count = carry

        def loss_fn(params: Any) -> jax.Array:
            return jnp.mean((model.apply({"params": params}, sparse) - labels) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (embed_optimizer.apply_updates_for_sc_model(params, updates), opt_state,
                count + 1), loss

    def as_carry(carry: Any) -> Carry:
        params, _, count = carry
        return Carry(params["SparseCoreEmbed_0"][embed.EMBEDDING_PARAM_NAME], params["w"],
                     count)

    return step, (params, tx.init(params), jnp.int32(0)), as_carry


def check_flax_step(case: Case, make: Any,
                    stale: tuple[list[jax.Array], Carry] | None = None) -> None:
    """The pipelined Flax step trains as the hand-written one-step-stale loop (`stale`,
    that loop's result on `case`, if already computed)."""
    step, carry, as_carry = make(case)
    fn = ap.auto_pipelining(step, out_shardings=None)
    state, results = ap.init_state(), []
    for sparse, labels in case.data:
        state, (carry, loss) = fn(state, carry, sparse, labels)
        results.append(loss)
    _, (carry, loss) = ap.finalize_pipelining(fn, state, carry)
    want_losses, want = stale or stale_loop(case)
    assert results[0] is None
    assert_same([*results[1:], loss], want_losses)
    assert_same(as_carry(carry), want)


@pytest.mark.parametrize("make", [nnx_step, linen_step], ids=["nnx", "linen"])
def test_flax_layer_steps_pipeline(make: Any) -> None:
    check_flax_step(make_case("adagrad"), make)


# --- steps that cannot be pipelined -----------------------------------------------------------


@pytest.fixture(scope="module")
def case() -> Case:
    return make_case("adagrad", steps=2)


def first_call(case: Case, step: Any, *args: Any, **kwargs: Any) -> Any:
    sparse, labels = case.data[0]
    fn = ap.auto_pipelining(step, out_shardings=None, **kwargs)
    return fn(ap.init_state(), case.fresh_carry(), sparse, labels, *args)


def test_step_without_lookup(case: Case) -> None:
    def train_step(carry: Carry, sparse: Any, labels: jax.Array) -> Any:
        return carry._replace(w=carry.w * 2), labels.sum()

    with pytest.raises(ValueError, match="has no embedding lookup; call tpu_sparse_dense_matmul"):
        first_call(case, train_step)


def test_two_lookups_of_the_same_tables(case: Case) -> None:
    lookup, update = sc_functions(case, "global")

    def train_step(carry: Carry, sparse: Any, labels: jax.Array) -> Any:
        acts = lookup(sparse, carry.tables)
        again = lookup(sparse, carry.tables)
        loss, _, grads = dense(carry.w, jax.tree.map(jnp.add, acts, again), labels)
        return carry._replace(tables=update(grads, sparse, carry.tables, carry.steps)), loss

    with pytest.raises(ValueError, match=r"two embedding lookups use the same tables "
                                         r"\(carry\.tables\['item'\]\.table"):
        first_call(case, train_step)


def test_lookup_without_update(case: Case) -> None:
    lookup, _ = sc_functions(case, "global")

    def train_step(carry: Carry, sparse: Any, labels: jax.Array) -> Any:
        loss, w, _ = dense(carry.w, lookup(sparse, carry.tables), labels)
        return carry._replace(w=w), loss

    with pytest.raises(ValueError, match="has no embedding update"):
        first_call(case, train_step)


def test_tables_outside_the_carry(case: Case) -> None:
    lookup, update = sc_functions(case, "global")

    def train_step(carry: Carry, sparse: Any, labels: jax.Array, tables: Any) -> Any:
        loss, w, grads = dense(carry.w, lookup(sparse, tables), labels)
        update(grads, sparse, tables, carry.steps)
        return carry._replace(w=w), loss

    with pytest.raises(ValueError, match=r"come from the step's arguments.*keep them in the carry"):
        first_call(case, train_step, case.fresh_carry().tables)


def test_dense_part_reading_tables(case: Case) -> None:
    lookup, update = sc_functions(case, "global")

    def train_step(carry: Carry, sparse: Any, labels: jax.Array) -> Any:
        loss, w, grads = dense(carry.w, lookup(sparse, carry.tables), labels)
        loss = loss + 1e-3 * jnp.sum(carry.tables["user"].table)  # a regularizer on a table
        return carry._replace(tables=update(grads, sparse, carry.tables, carry.steps), w=w), loss

    with pytest.raises(ValueError, match=r"dense part reads embedding variables "
                                         r"\(carry\.tables\['user'\]\.table\)"):
        first_call(case, train_step)


def test_lookup_under_jit_or_cond(case: Case) -> None:
    lookup, update = sc_functions(case, "global")

    def train_step(carry: Carry, sparse: Any, labels: jax.Array) -> Any:
        acts = jax.jit(lookup)(sparse, carry.tables)
        loss, _, grads = dense(carry.w, acts, labels)
        return carry._replace(tables=update(grads, sparse, carry.tables, carry.steps)), loss

    with pytest.raises(ValueError, match="tpu_sparse_dense_matmul is called inside a 'jit'"):
        first_call(case, train_step)


def test_python_flag_that_should_be_static(case: Case) -> None:
    step = make_step(case)

    def train_step(carry: Carry, sparse: Any, labels: jax.Array, double: bool) -> Any:
        carry, loss = step(carry, sparse, labels)
        return carry, (loss * 2 if double else loss)

    with pytest.raises(TypeError, match=r"concrete value of a traced argument.*static_argnums"
                                        r".*Traced positions now: \[1, 2, 3\]"):
        first_call(case, train_step, True)
    with pytest.raises(TypeError, match=r"argument 3 holds a str .* list position 3 in "
                                        r"static_argnums"):
        first_call(case, train_step, "yes")
    state, (_, loss) = first_call(case, train_step, True, static_argnums=(3,))
    assert loss is None and state.args_1[-1] == ap._ap.Static(True)


def test_bad_calls(case: Case) -> None:
    step = make_step(case)
    with pytest.raises(ValueError, match=r"static_argnums=\(0,\) holds \[0\].*position 0 is "
                                         r"the carry"):
        ap.auto_pipelining(step, out_shardings=None, static_argnums=(0,))
    fn = ap.auto_pipelining(step, out_shardings=None)
    sparse, labels = case.data[0]
    with pytest.raises(TypeError, match=r"positionally .* got keywords \['labels'\]"):
        fn(ap.init_state(), case.fresh_carry(), sparse, labels=labels)
    with pytest.raises(TypeError, match="must be the EmbeddingPipeliningState"):
        fn(None, case.fresh_carry(), sparse, labels)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="no step has run"):
        ap.finalize_pipelining(fn, ap.init_state(), case.fresh_carry())
    with pytest.raises(TypeError, match="train_step is not wrapped by auto_pipelining"):
        ap.finalize_pipelining(step, ap.init_state(), case.fresh_carry())

    def not_a_tuple(carry: Carry, sparse: Any, labels: jax.Array) -> Any:
        return step(carry, sparse, labels)[0]

    with pytest.raises(TypeError, match=r"must return a tuple \(carry, \*results\); got "
                                        r"Carry \(the carry alone"):
        first_call(case, not_a_tuple)
    with pytest.raises(TypeError, match=r"must return a tuple \(carry, \*results\); got an array"):
        first_call(case, lambda *a: step(*a)[1])


def test_preprocess_inlines_custom_vjp_and_rejects_mixed_equations(case: Case) -> None:
    lookup, update = sc_functions(case, "global")
    sparse, labels = case.data[0]

    @jax.custom_vjp
    def wrapped(tables: Any, sparse: Any) -> Any:
        return lookup(sparse, tables)

    wrapped.defvjp(lambda t, s: (wrapped(t, s), None), lambda _, g: (None, None))
    from tilecore.compat._auto_pipelining_hook import marking

    with marking():
        closed = jax.make_jaxpr(lambda t, s: wrapped(t, s))(case.carry.tables, sparse)
    assert [e.primitive.name for e in closed.jaxpr.eqns] == ["custom_vjp_call"]
    assert [utils.is_embedding_lookup(e) for e in preprocess.preprocess(closed.jaxpr).eqns] == [
        True]
    with marking():
        both = jax.make_jaxpr(jax.jit(lambda t, s, g: (lookup(s, t), update(g, s, t, 0))))(
            case.carry.tables, sparse, dense(case.carry.w, lookup(sparse, case.carry.tables),
                                             labels)[2])
    with pytest.raises(ValueError, match="holds both tpu_sparse_dense_matmul and"):
        preprocess.validate_jaxpr(both.jaxpr)
    assert decompose.FunctionRunner.__dataclass_fields__.keys() >= {"lookup_jaxpr", "dense_jaxpr"}


# --- two devices ------------------------------------------------------------------------------


def _multidevice() -> None:
    assert len(jax.devices()) == 2, jax.devices()
    for style in ("shard_map",):  # the reference's way; global arrays go the same path
        case = make_case("adagrad", devices=2, steps=3)
        results, carry = run_pipelined(case, make_step(case, style))
        want_losses, want = stale_loop(case, style)
        assert_same(results[1:], want_losses)
        assert_same(carry, want)
        assert carry.tables["user"].table.sharding.is_equivalent_to(
            case.carry.tables["user"].table.sharding, 2), style
    case = make_case("adagrad", devices=2, steps=3)  # each step copies the carry it trains
    stale = stale_loop(case)
    for make in (nnx_step, linen_step):  # the layers shard_map over the mesh themselves
        check_flax_step(case, make, stale)
    print("multidevice ok")


def test_two_devices() -> None:
    env = {**os.environ, "XLA_FLAGS": xla_flags(2),
           "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(HERE), "multidevice"], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "multidevice ok" in result.stdout


if __name__ == "__main__" and sys.argv[1:] == ["multidevice"]:
    _multidevice()


def test_finalizing_a_drained_pipeline_is_refused() -> None:
    """A second finalize_pipelining returned (state, (carry, None)) as if it had results."""
    case = make_case("adagrad", steps=2)
    fn = ap.auto_pipelining(make_step(case), out_shardings=None)
    state, (carry, _) = fn(ap.init_state(), case.fresh_carry(), *case.data[0])
    state, (carry, _) = fn(state, carry, *case.data[1])
    state, (carry, _) = ap.finalize_pipelining(fn, state, carry)
    with pytest.raises(ValueError, match="the pipeline is drained already"):
        ap.finalize_pipelining(fn, state, carry)
