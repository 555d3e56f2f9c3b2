"""Device-op extras: autodiff through the lookup, quantization, checks, serialization."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
from _xla_flags import xla_flags
from tilecore import ops
from tilecore.stacking import memory_estimates


def _plan(quantization: tc.QuantizationConfig | None = None) -> tc.StackingPlan:
    a = tc.TableSpec(name="a", vocab_size=40, embedding_dim=6, quantization=quantization,
                     optimizer=tc.Adagrad(learning_rate=0.1), max_ids_per_partition=64,
                     max_unique_ids_per_partition=64)
    b = tc.TableSpec(name="b", vocab_size=30, embedding_dim=6, combiner="mean",
                     optimizer=tc.Adagrad(learning_rate=0.1), max_ids_per_partition=64,
                     max_unique_ids_per_partition=64)
    features = [tc.FeatureSpec(name="fa", table=a, input_shape=(16, 3)),
                tc.FeatureSpec(name="fb", table=b, input_shape=(16, 2))]
    return tc.plan_stacking(features, tc.Topology(global_devices=1, sc_per_device=2),
                            tc.SparseCoreConfig(disable_table_stacking=True))


def _batch(plan: tc.StackingPlan, seed: int = 0) -> tc.PreprocessedBatch:
    rng = np.random.default_rng(seed)
    inputs = {name: rng.integers(0, f.table.vocab_size, f.input_shape)
              for name, f in plan.features.items()}
    return tc.preprocess(plan, inputs)[0]


def _tables(plan: tc.StackingPlan, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=(t.vocab_size, t.embedding_dim)).astype(np.float32)
            for name, t in plan.tables.items()}


def _loss(params: jax.Array, acts: dict[str, jax.Array]) -> jax.Array:
    return jnp.sum((acts["fa"] @ params) ** 2) + jnp.sum(jnp.sin(acts["fb"] @ params))


def test_grad_through_embed_is_the_activation_gradient() -> None:
    plan, params = _plan(), jnp.asarray(np.random.default_rng(2).normal(size=(6, 1)), jnp.float32)
    batch, variables = _batch(plan), ops.init_tables(plan, jax.random.key(0))
    acts = ops.lookup(plan, batch, variables)
    want = jax.grad(lambda a: _loss(params, a))(acts)
    got = jax.grad(lambda probe: _loss(params, ops.embed(plan, batch, variables, probe)))(
        ops.activation_probe(plan))
    for name in want:  # GPUs add a segment's entries with atomics, in no fixed order
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_training_update_equals_lookup_grad_of_the_activation_gradients() -> None:
    plan, params = _plan(), jnp.asarray(np.random.default_rng(2).normal(size=(6, 1)), jnp.float32)
    batch, variables = _batch(plan), ops.init_tables(plan, jax.random.key(0))
    acts = ops.lookup(plan, batch, variables)
    grads = jax.grad(lambda a: _loss(params, a))(acts)
    want = ops.lookup_grad(plan, batch, variables, grads, 3)
    loss, param_grads, got = jax.jit(
        lambda b, v, p: ops.training_update(plan, b, v, _loss, p, 3))(batch, variables, params)
    np.testing.assert_allclose(loss, _loss(params, acts), rtol=1e-5)
    np.testing.assert_allclose(param_grads, jax.grad(lambda p: _loss(p, acts))(params), rtol=1e-5)
    for name in want:
        np.testing.assert_allclose(got[name].table, want[name].table, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got[name].slots[0], want[name].slots[0], rtol=1e-6)


def test_simulated_quantization_rounds_rows_to_levels() -> None:
    config = tc.QuantizationConfig(min_value=-0.5, max_value=0.5, num_buckets=5)
    plan = _plan(config)
    rng = np.random.default_rng(0)
    inputs = {name: rng.integers(0, f.table.vocab_size, f.input_shape)
              for name, f in plan.features.items()}
    batch, _ = tc.preprocess(plan, inputs)
    tables = _tables(plan)
    variables = {k: ops.EmbeddingVariables(jnp.asarray(v)) for k, v in ops.shard(plan, tables).items()}
    acts = ops.lookup(plan, batch, variables)
    levels = np.linspace(-0.5, 0.5, 5)
    clipped = np.clip(tables["a"], -0.5, 0.5)
    quantized = levels[np.abs(clipped[..., None] - levels).argmin(-1)]
    np.testing.assert_allclose(acts["fa"], quantized[inputs["fa"]].sum(1), atol=1e-6)
    # An unquantized table in the same plan is untouched by it.
    np.testing.assert_allclose(acts["fb"], tables["b"][inputs["fb"]].mean(1), rtol=1e-5)


def test_serialized_stacks_give_the_same_update() -> None:
    plan = _plan()
    batch, variables = _batch(plan), ops.init_tables(plan, jax.random.key(0))
    grads = {k: jnp.asarray(np.random.default_rng(3).normal(size=a.shape), jnp.float32)
             for k, a in ops.lookup(plan, batch, variables).items()}
    plain = ops.lookup_grad(plan, batch, variables, grads, 0)
    options = ops.UpdateOptions(serialize_stacks=True)
    serial = jax.jit(lambda b, v, g: ops.lookup_grad(plan, b, v, g, 0, options=options))(
        batch, variables, grads)
    for name in plain:
        np.testing.assert_allclose(serial[name].table, plain[name].table, rtol=1e-6, atol=1e-7)


def test_nan_check_names_the_stack() -> None:
    plan = _plan()
    batch, variables = _batch(plan), ops.init_tables(plan, jax.random.key(0))
    grads = {k: jnp.ones_like(a) for k, a in ops.lookup(plan, batch, variables).items()}
    grads["fb"] = grads["fb"].at[0, 0].set(jnp.nan)
    step = jax.jit(lambda b, v, g: ops.lookup_grad(
        plan, b, v, g, 0, options=ops.UpdateOptions(check_finite=True)))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="FloatingPointError: Stack 'b': updated variables contain NaN"):
        jax.block_until_ready(step(batch, variables, grads))
    ok = {k: jnp.ones_like(a) for k, a in grads.items()}
    jax.block_until_ready(step(batch, variables, ok))
    jax.block_until_ready(ops.lookup(plan, batch, variables, check_finite=True))


def test_memory_estimates_follow_the_formulas() -> None:
    plan = _plan()
    estimates = memory_estimates(plan)
    n = plan.num_partitions
    a = estimates["a"]
    assert a.forward_hbm_stack_bytes == (2 * 8 + 1) * 64 * n * 4
    assert a.backward_hbm_stack_bytes == 3 * 8 * 64 * n * 4
    assert a.table_bytes == plan.stacks["a"].vocab_size * 8 * 4
    assert a.padding_overhead == pytest.approx(1 - 40 * 6 / (plan.stacks["a"].vocab_size * 8))


def test_auto_and_explicit_meshes_both_work() -> None:
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import jax, numpy as np, tilecore as tc
        from jax.sharding import Mesh
        from tilecore import ops
        t = tc.TableSpec(name="t", vocab_size=64, embedding_dim=8)
        plan = tc.plan_stacking([tc.FeatureSpec(name="f", table=t, input_shape=(8, 1))],
                                tc.Topology(global_devices=2, sc_per_device=1))
        batch, _ = tc.preprocess(plan, {"f": np.arange(8).reshape(8, 1)})
        results = []
        for mesh in (Mesh(np.array(jax.devices()[:2]), ("sparsecore",)),
                     jax.make_mesh((2,), ("sparsecore",))):
            v = ops.init_tables(plan, jax.random.key(0), mesh=mesh)
            eager = ops.lookup(plan, batch, v, mesh=mesh)["f"]
            jitted = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh))(batch, v)["f"]
            assert np.array_equal(np.asarray(eager), np.asarray(jitted))
            results.append(np.asarray(eager))
        assert np.array_equal(results[0], results[1])
        print("ok")
    """)
    env = dict(os.environ, XLA_FLAGS=xla_flags(2), TILECORE_KERNELS="xla", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_eager_calls_run_as_one_compiled_program() -> None:
    # Outside jit an op would run primitive by primitive: one small XLA program each
    # (hundreds on a mesh). Eager calls go through one jitted program per plan instead,
    # compiled once and equal to the user's own jit of the same call.
    plan = _plan()
    tables = {n: jnp.asarray(t) for n, t in ops.shard(plan, _tables(plan)).items()}
    variables = ops.init_tables(plan, jax.random.key(0))
    grads = {name: jnp.ones((16, 6), jnp.float32) for name in plan.features}
    jitted_lookup = jax.jit(lambda b, t: ops.lookup(plan, b, t))
    jitted_grad = jax.jit(lambda b, v, g: ops.lookup_grad(plan, b, v, g, 3))
    jitted_lookup(_batch(plan), tables)  # the kernels' one-time set-up, if any, happens here
    jitted_grad(_batch(plan), variables, grads)
    compiled: list[str] = []

    def listen(event: str, duration_secs: float, **kwargs: str | int) -> None:
        del duration_secs
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(str(kwargs.get("fun_name")))

    # The same program: the same bits on CPUs; GPUs add a segment's entries with atomics,
    # in no fixed order, so there the last bits may differ.
    same = np.array_equal if jax.default_backend() == "cpu" else np.allclose
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for seed in range(2):
            batch = _batch(plan, seed)
            eager = ops.lookup(plan, batch, tables)
            assert jax.tree.all(jax.tree.map(same, eager, jitted_lookup(batch, tables)))
            eager_update = ops.lookup_grad(plan, batch, variables, grads, 3)
            assert jax.tree.all(jax.tree.map(same, eager_update,
                                             jitted_grad(batch, variables, grads)))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert sorted(compiled) == ["jit(_compiled_lookup)", "jit(_compiled_lookup_grad)"]
    with jax.disable_jit():  # op by op, as asked (the jitted call would recurse)
        batch = _batch(plan)
        assert jax.tree.all(jax.tree.map(np.allclose, ops.lookup(plan, batch, tables),
                                         jitted_lookup(batch, tables)))
        assert jax.tree.all(jax.tree.map(np.allclose, ops.lookup_grad(plan, batch, variables,
                                                                      grads, 3),
                                         jitted_grad(batch, variables, grads)))


def test_update_options_refuse_a_reversed_clip_range() -> None:
    with pytest.raises(ValueError, match=r"clip\['s'\] must be \(min, max\)"):
        ops.UpdateOptions(clip={"s": (1.0, -1.0)})
