"""tilecore.compat's device functions: a reference-style training script, ported by
changing its import, runs and matches tilecore's native API.

The script (`reference_style_run`) is written as a reference user writes it: specs,
auto-stacking, `init_embedding_variables` with a `NamedSharding`, preprocessing,
then `tpu_sparse_dense_matmul` and `tpu_sparse_dense_matmul_grad` wrapped in
`shard_map` over the mesh and `jit`. It runs here on the devices this process
has, and on 4 CPU devices in a subprocess (this file run as a script), since JAX
fixes the device count when it starts.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tilecore as tc
from _xla_flags import xla_flags
from tilecore import ops
from tilecore.compat import embedding, embedding_spec

BATCH = 32
STEPS = 3
OPTIMIZERS = {
    "sgd": lambda: embedding_spec.SGDOptimizerSpec(learning_rate=0.5),
    "adagrad": lambda: embedding_spec.AdagradOptimizerSpec(learning_rate=0.5),
    "adam": lambda: embedding_spec.AdamOptimizerSpec(learning_rate=0.1),
    "laprop": lambda: embedding_spec.LaPropOptimizerSpec(learning_rate=0.1),
    "f2a": lambda: embedding_spec.F2AOptimizerSpec(learning_rate=0.1),
}


def feature_specs(optimizer: str) -> dict[str, embedding_spec.FeatureSpec]:
    """Two tables (dims 8 and 12), three features, one feature-stacked, a sum and a mean."""
    opt = OPTIMIZERS[optimizer]
    init = jax.nn.initializers.uniform(0.1)
    user = embedding_spec.TableSpec(name="user", vocabulary_size=200, embedding_dim=8,
                                    initializer=init, optimizer=opt(), combiner="sum")
    item = embedding_spec.TableSpec(name="item", vocabulary_size=300, embedding_dim=12,
                                    initializer=init, optimizer=opt(), combiner="mean")
    return {
        "user": embedding_spec.FeatureSpec(name="user", table_spec=user, input_shape=[BATCH, 1],
                                           output_shape=[BATCH, 8]),
        "item_a": embedding_spec.FeatureSpec(name="item_a", table_spec=item,
                                             input_shape=[BATCH, 3], output_shape=[BATCH, 12]),
        "item_b": embedding_spec.FeatureSpec(name="item_b", table_spec=item,
                                             input_shape=[BATCH, 3], output_shape=[BATCH, 12]),
    }


def batches(specs: dict[str, Any], seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        out.append({name: rng.integers(0, f.table_spec.vocabulary_size,
                                       size=tuple(f.input_shape)).astype(np.int32)
                    for name, f in specs.items()})
    return out


def loss_grads(activations: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A dense "model": gradients of Σ_f ½‖act_f − 1‖² (just act − 1)."""
    return {name: a - 1.0 for name, a in activations.items()}


def reference_style_run(optimizer: str, devices: int, sc: int = 2) -> dict[str, Any]:
    """The reference's training loop, with the import changed to tilecore.compat."""
    specs = feature_specs(optimizer)
    mesh = Mesh(np.array(jax.devices()[:devices]), "x")
    embedding.auto_stack_tables(specs, global_device_count=mesh.size, num_sc_per_device=sc)
    embedding.prepare_feature_specs_for_training(specs, global_device_count=mesh.size,
                                                 num_sc_per_device=sc)
    sharding = NamedSharding(mesh, P("x", None))
    variables = embedding.init_embedding_variables(
        jax.random.key(7), embedding.get_table_specs(specs), sharding, sc)
    initial = jax.tree.map(np.asarray, variables)

    matmul = functools.partial(embedding.tpu_sparse_dense_matmul, feature_specs=specs,
                               global_device_count=mesh.size, num_sc_per_device=sc)
    matmul = jax.jit(jax.shard_map(matmul, mesh=mesh, in_specs=(P("x"), P("x")),
                                   out_specs=P("x"), check_vma=False))
    update = functools.partial(embedding.tpu_sparse_dense_matmul_grad, feature_specs=specs,
                               global_device_count=mesh.size, num_sc_per_device=sc)
    grad = jax.jit(jax.shard_map(lambda g, x, v, step: update(g, x, v, step=step), mesh=mesh,
                                 in_specs=(P("x"), P("x"), P("x"), P()), out_specs=P("x"),
                                 check_vma=False), donate_argnums=2)
    activations = []
    for step, ids in enumerate(batches(specs)):
        inputs, _ = embedding.preprocess_sparse_dense_matmul_input(
            ids, None, specs, local_device_count=mesh.size, global_device_count=mesh.size,
            num_sc_per_device=sc)
        acts = matmul(inputs, variables)
        activations.append(jax.tree.map(np.asarray, acts))
        variables = grad(loss_grads(acts), inputs, variables, jnp.int32(step))
    return {"specs": specs, "initial": initial, "activations": activations,
            "final": jax.tree.map(np.asarray, variables)}


def native_run(specs: dict[str, Any], initial: dict[str, Any], devices: int, sc: int = 2
               ) -> dict[str, Any]:
    """The same steps with tilecore's native API, from the same initial variables."""
    from tilecore.compat._native import build_plan

    plan = build_plan(specs, global_devices=devices, sc_per_device=sc)
    mesh = None if devices == 1 else jax.make_mesh((devices,), (ops.DEFAULT_AXIS,))
    sharding = None if mesh is None else NamedSharding(mesh, P(ops.DEFAULT_AXIS))
    variables = {name: ops.EmbeddingVariables(jax.device_put(v.table, sharding),
                                              tuple(jax.device_put(s, sharding) for s in v.slot))
                 for name, v in initial.items()}
    lookup = jax.jit(lambda b, v: ops.lookup(plan, b, v, mesh=mesh))
    update = jax.jit(lambda b, v, g, step: ops.lookup_grad(plan, b, v, g, step, mesh=mesh))
    activations = []
    for step, ids in enumerate(batches(specs)):
        batch, _ = tc.preprocess(plan, {name: ids[name] for name in plan.features})
        acts = lookup(batch, variables)
        activations.append({k: np.asarray(a) for k, a in acts.items()})
        variables = update(batch, variables, loss_grads(acts), jnp.int32(step))
    return {"activations": activations,
            "final": {k: (np.asarray(v.table), [np.asarray(s) for s in v.slots])
                      for k, v in variables.items()}}


def assert_runs_match(compat: dict[str, Any], native: dict[str, Any]) -> None:
    for step, (a, b) in enumerate(zip(compat["activations"], native["activations"],
                                      strict=True)):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step} feature {name}")
    for name, v in compat["final"].items():
        table, slots = native["final"][name]
        np.testing.assert_allclose(v.table, table, rtol=1e-5, atol=1e-6, err_msg=name)
        assert len(v.slot) == len(slots)
        for x, y in zip(v.slot, slots, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_ported_script_matches_native_api(optimizer: str) -> None:
    compat = reference_style_run(optimizer, devices=1)
    assert_runs_match(compat, native_run(compat["specs"], compat["initial"], devices=1))
    # The tables moved, and touched rows only.
    for name, v in compat["final"].items():
        changed = np.any(v.table != compat["initial"][name].table, axis=1)
        assert 0 < changed.sum() < len(changed), name
        slot_type = {"sgd": "SGDSlotVariables", "adagrad": "AdagradSlotVariables",
                     "adam": "AdamSlotVariables", "laprop": "LaPropSlotVariables",
                     "f2a": "F2ASlotVariables"}[optimizer]
        assert type(v.slot).__name__ == slot_type


def test_init_follows_the_reference_layout() -> None:
    """Each partition's shard of each table comes from `init(key_p, shard_shape)`."""
    specs = feature_specs("adagrad")
    embedding.auto_stack_tables(specs, global_device_count=1, num_sc_per_device=4)
    embedding.prepare_feature_specs_for_training(specs, global_device_count=1,
                                                 num_sc_per_device=4)
    mesh = Mesh(np.array(jax.devices()[:1]), "x")
    rng = jax.random.key(3)
    variables = embedding.init_embedding_variables(
        rng, embedding.get_table_specs(specs), NamedSharding(mesh, P("x", None)), 4)
    table_specs = embedding.get_table_specs(specs)
    stacks: dict[str, list[Any]] = {}
    for name in sorted(table_specs):  # jax.tree.leaves order of the dict
        t = table_specs[name]
        stacks.setdefault(t.setting_in_stack.stack_name, []).append(t)
    assert list(variables) == list(stacks)
    keys = jax.random.split(rng, 4 * len(stacks))
    init = jax.nn.initializers.uniform(0.1)
    for i, (stack_name, tables) in enumerate(stacks.items()):
        tables.sort(key=lambda t: t.setting_in_stack.row_offset_in_shard)
        expected = np.concatenate([
            np.asarray(init(keys[4 * i + p], (t.setting_in_stack.padded_vocab_size // 4,
                                              t.setting_in_stack.padded_embedding_dim)))
            for p in range(4) for t in tables
        ])
        v = variables[stack_name]
        np.testing.assert_array_equal(np.asarray(v.table), expected)
        assert type(v.slot).__name__ == "AdagradSlotVariables"
        np.testing.assert_array_equal(np.asarray(v.slot.accumulator),
                                      np.full(expected.shape, 0.1, np.float32))
    # Native ops read the same layout: unshard gives each table's logical rows.
    from tilecore.compat._native import build_plan

    plan = build_plan(specs, global_devices=1, sc_per_device=4)
    per_table = ops.unshard(plan, {name: np.asarray(v.table) for name, v in variables.items()})
    assert per_table["user"].shape == (200, 8) and per_table["item"].shape == (300, 12)


def test_global_arrays_outside_shard_map() -> None:
    """Outside shard_map compat takes global (flat) buffers and tables."""
    specs = feature_specs("adam")
    embedding.auto_stack_tables(specs, 1, 2)
    embedding.prepare_feature_specs_for_training(specs, 1, 2)
    mesh = Mesh(np.array(jax.devices()[:1]), "x")
    variables = embedding.init_embedding_variables(
        jax.random.key(0), embedding.get_table_specs(specs), NamedSharding(mesh, P("x", None)), 2)
    ids = batches(specs)[0]
    inputs, _ = embedding.preprocess_sparse_dense_matmul_input(ids, None, specs, 1, 1,
                                                               num_sc_per_device=2)
    acts = embedding.tpu_sparse_dense_matmul(inputs, variables, specs, global_device_count=1,
                                             num_sc_per_device=2)
    stacked = embedding.tpu_sparse_dense_matmul(inputs, variables, specs, global_device_count=1,
                                                num_sc_per_device=2, perform_unstacking=False)
    again = embedding.unstack_embedding_activations(stacked, specs, 1, 2)
    for name in specs:
        assert acts[name].shape == (BATCH, specs[name].output_shape[1])
        np.testing.assert_array_equal(acts[name], again[name])
    grads = loss_grads(acts)
    stacked_grads = embedding.stack_embedding_gradients(grads, specs, 2)
    a = embedding.tpu_sparse_dense_matmul_grad(grads, inputs, variables, specs,
                                               global_device_count=1, num_sc_per_device=2,
                                               step=4, embedding_var_limits={})
    b = embedding.tpu_sparse_dense_matmul_grad(stacked_grads, inputs, variables, specs,
                                               global_device_count=1, num_sc_per_device=2,
                                               step=4, perform_stacking=False)
    for name in a:
        np.testing.assert_array_equal(a[name].table, b[name].table)
    clipped = embedding.tpu_sparse_dense_matmul_grad(
        grads, inputs, variables, specs, global_device_count=1, num_sc_per_device=2,
        embedding_var_limits={name: (-0.01, 0.01) for name in variables})
    for name, v in clipped.items():
        touched = np.any(np.asarray(v.table) != np.asarray(variables[name].table), axis=1)
        assert np.abs(np.asarray(v.table)[touched]).max() <= 0.01


def test_errors_name_the_fix() -> None:
    specs = feature_specs("sgd")
    embedding.prepare_feature_specs_for_training(specs, 2, 2)
    mesh = Mesh(np.array(jax.devices()[:1]), "x")
    with pytest.raises(ValueError, match="PartitionSpec"):
        embedding.init_embedding_variables(jax.random.key(0), embedding.get_table_specs(specs),
                                           NamedSharding(mesh, P(None, "x")), 2)
    inputs = embedding.PreprocessedInput(embedding.SparseDenseMatmulInput({}, {}, {}, {}))
    with pytest.raises(ValueError, match="feature specs define"):
        embedding.tpu_sparse_dense_matmul(inputs, {}, specs, global_device_count=2)
    with pytest.raises(ValueError, match="minibatch count"), pytest.warns(DeprecationWarning):
        embedding.tpu_sparse_dense_matmul(inputs.sparse_dense_matmul_input, {}, specs,
                                          global_device_count=2, enable_minibatching=True)


def test_shard_map_on_four_devices(tmp_path: Path) -> None:
    """The ported script under shard_map over 4 CPU devices equals the native API on 4."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compat on 4 devices matches native" in result.stdout


def _main() -> None:
    assert jax.device_count() >= 4, "run with --xla_force_host_platform_device_count=4"
    for optimizer in ("adagrad", "adam"):
        compat = reference_style_run(optimizer, devices=4)
        assert_runs_match(compat, native_run(compat["specs"], compat["initial"], devices=4))
        for acts in compat["activations"]:
            for name, spec in compat["specs"].items():
                assert acts[name].shape == tuple(spec.output_shape)
    print("compat on 4 devices matches native")


if __name__ == "__main__":
    _main()


def test_steps_limits_and_statistics_are_checked_like_the_native_ones() -> None:
    """The compat API handed these to the ops unchecked: a float or huge step trained with
    another step's rates, (1, -1) limits clamped every row to -1, and negative or 2**40
    counts became the specs' limits."""
    from tilecore.fdo import FdoStatsError

    specs = feature_specs("adam")
    embedding.prepare_feature_specs_for_training(specs, global_device_count=1, num_sc_per_device=2)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), "x"), P("x", None))
    variables = embedding.init_embedding_variables(
        jax.random.key(7), embedding.get_table_specs(specs), sharding, 2)
    inputs, stats = embedding.preprocess_sparse_dense_matmul_input(
        batches(specs)[0], None, specs, local_device_count=1, global_device_count=1,
        num_sc_per_device=2)
    acts = embedding.tpu_sparse_dense_matmul(inputs, variables, specs, global_device_count=1,
                                             num_sc_per_device=2)
    grad = functools.partial(embedding.tpu_sparse_dense_matmul_grad, loss_grads(acts), inputs,
                             variables, specs, global_device_count=1, num_sc_per_device=2)
    for step, message in ((3.7, "step must be an integer scalar"),
                          (2**40, r"step must be in \[0, 2\*\*31 - 1\)"), (-5, "step must be in")):
        with pytest.raises(ValueError, match=message):
            grad(step=step)
    stack = next(iter(embedding.get_stacked_table_specs(specs)))
    for limits in ((1.0, -1.0), (float("nan"), 1.0), (0.0, 1.0, 2.0)):
        with pytest.raises(ValueError, match=rf"embedding_var_limits\['{stack}'\] must be "
                                             r"\(min, max\) with min <= max"):
            grad(step=1, embedding_var_limits={stack: limits})
    for bad, message in (({stack: np.array([-5, 1])}, "holds the count -5"),
                         ({stack: np.array([2**40, 1])}, "holds the count 1099511627776"),
                         ({"zzz": np.array([1, 1])}, "stack 'zzz', which is not one of")):
        with pytest.raises(FdoStatsError, match=message):
            embedding.update_preprocessing_parameters(
                specs, stats.replace(max_ids_per_partition=bad), 2)
    with pytest.raises(FdoStatsError, match="must be the SparseDenseMatmulInputStats"):
        embedding.update_preprocessing_parameters(specs, {}, 2)  # type: ignore[arg-type]
    embedding.update_preprocessing_parameters(specs, stats, 2)  # its own statistics: fine


def test_inputs_that_are_not_preprocessed_inputs_are_refused() -> None:
    """An AttributeError ('... has no attribute lhs_row_pointers') before."""
    specs = feature_specs("sgd")
    embedding.prepare_feature_specs_for_training(specs, global_device_count=1, num_sc_per_device=2)
    _, stats = embedding.preprocess_sparse_dense_matmul_input(
        batches(specs)[0], None, specs, local_device_count=1, global_device_count=1,
        num_sc_per_device=2)
    for wrong in (None, stats):
        with pytest.raises(TypeError, match="tpu_sparse_dense_matmul: preprocessed_inputs must be "
                                            "the PreprocessedInput"):
            embedding.tpu_sparse_dense_matmul(wrong, {}, specs, global_device_count=1,  # type: ignore[arg-type]
                                              num_sc_per_device=2)
