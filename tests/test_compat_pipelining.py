"""tilecore.compat.embedding_pipelining_utils: a reference-style pipelined loop (ported
by changing the import) runs its stages on the reference's schedule and trains exactly
as `tilecore.pipelining` does on the same inputs."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tilecore.compat.flax._sparse import make_plan

import tilecore.pipelining as tcp
from _compat_cases import feature_specs as reference_feature_specs
from _compat_cases import native_batch
from tilecore import ops
from tilecore.compat import embedding, embedding_spec
from tilecore.compat import embedding_pipelining_utils as ep_utils

BATCH, SC, NUM_STEPS = 16, 2, 5
MESH = Mesh(np.asarray(jax.devices()[:1]), "x")


def test_public_names() -> None:
    for name in ep_utils.__all__:
        assert getattr(ep_utils, name) is not None, name
    assert ep_utils.get_pipeline_train_steps(7) == 9
    assert [ep_utils.is_output_valid(k, 3) for k in range(5)] == [False, True, True, True, False]


# --- the schedule, with toy stages that record what they see ---------------------------------


def toy_stages() -> tuple[Any, Any, Any]:
    """Stages over scalars: activations and gradients are the step's id, aux values tag it."""

    def sc_fwd(sparse: jax.Array, variables: jax.Array) -> tuple[jax.Array, jax.Array]:
        return sparse + 0 * variables, 10 * sparse  # activation = id; aux tags the step

    def tc(acts: jax.Array, dense: jax.Array, state: jax.Array, fwd_aux: jax.Array
           ) -> tuple[jax.Array, Any, jax.Array, jax.Array]:
        output = {"act": acts, "dense": dense, "fwd_aux": fwd_aux, "calls": state}
        return acts, output, state + 1, 100 * acts

    def sc_bwd(sparse: jax.Array, grads: jax.Array, variables: jax.Array, tc_aux: jax.Array
               ) -> tuple[jax.Array, Any]:
        return variables + grads * sparse, {"sparse": sparse, "tc_aux": tc_aux}

    return sc_fwd, tc, sc_bwd


def test_step_runs_the_reference_schedule() -> None:
    sc_fwd, tc, sc_bwd = toy_stages()

    def inputs(i: int) -> ep_utils.CurrentStepInput:
        return ep_utils.CurrentStepInput(sparse_inputs=jnp.float32(i + 1),
                                         dense_inputs=jnp.float32(-(i + 1)))

    state, variables = jnp.int32(0), jnp.float32(0)
    pipeline_state = ep_utils.get_initial_state(inputs(0), state, variables, sc_fwd, tc)
    run = jax.jit(functools.partial(ep_utils.step, sc_fwd_function=sc_fwd, tc_function=tc,
                                    sc_bwd_function=sc_bwd), static_argnames="fake_tc_step")
    outputs, bwd_aux = [], []
    for call in range(ep_utils.get_pipeline_train_steps(NUM_STEPS)):
        given = inputs(call) if call < NUM_STEPS else jax.tree.map(jnp.zeros_like, inputs(0))
        valid = ep_utils.is_output_valid(call, NUM_STEPS)
        out, aux, state, variables, pipeline_state = run(
            given, state, variables, pipeline_state, fake_tc_step=not valid)
        assert int(pipeline_state.pipeline_step) == call + 1
        if valid:
            outputs.append(jax.tree.map(float, out))
        else:
            assert jax.tree.map(float, out) == {"act": 0, "dense": 0, "fwd_aux": 0, "calls": 0}
        bwd_aux.append(jax.tree.map(float, aux))
    # Call k's outputs are step k−1's: its activations, dense inputs and SC forward aux.
    assert outputs == [{"act": i + 1, "dense": -(i + 1), "fwd_aux": 10 * (i + 1), "calls": i}
                       for i in range(NUM_STEPS)]
    # Call k's SC backward runs step k−2 with its TC aux; calls 0 and 1 see placeholders.
    assert bwd_aux[:2] == [{"sparse": 0, "tc_aux": 0}] * 2
    assert bwd_aux[2:] == [{"sparse": i + 1, "tc_aux": 100 * (i + 1)} for i in range(NUM_STEPS)]
    assert int(state) == NUM_STEPS
    assert float(variables) == sum((i + 1) ** 2 for i in range(NUM_STEPS))


# --- against tilecore.pipelining on embedding tables -----------------------------------------


def feature_specs() -> dict[str, embedding_spec.FeatureSpec]:
    return reference_feature_specs(BATCH, SC)


def loss_fn(params: Any, acts: Any, labels: jax.Array) -> jax.Array:
    x = jnp.concatenate([acts["item"], acts["user"]], axis=-1)
    return optax.sigmoid_binary_cross_entropy(x @ params["w"] + params["b"], labels).mean()


def reference_tc(tx: optax.GradientTransformation) -> Any:
    """A TC stage written the reference's way: `(grads, output, state, tc_aux)`."""

    def tc(acts: Any, labels: jax.Array, state: tcp.DenseState, fwd_aux: Any = None) -> Any:
        del fwd_aux
        loss, (param_grads, act_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, acts, labels)
        updates, opt_state = tx.update(param_grads, state.opt_state, state.params)
        return act_grads, loss, tcp.DenseState(optax.apply_updates(state.params, updates),
                                               opt_state), None

    return tc


def test_reference_loop_matches_tilecore_pipelining() -> None:
    specs, tx = feature_specs(), optax.adam(0.05)
    rng = np.random.default_rng(0)
    data = []
    for i in range(NUM_STEPS):
        ids = {"user": rng.integers(0, 64, (BATCH, 1)).astype(np.int32),
               "item": rng.integers(0, 96, (BATCH, 3)).astype(np.int32)}
        sparse, _ = embedding.preprocess_sparse_dense_matmul_input(
            ids, None, specs, 1, 1, num_sc_per_device=SC, batch_number=i)
        data.append((sparse, jnp.asarray(rng.integers(0, 2, BATCH), jnp.float32)))
    plan = make_plan(specs, 1, SC, "MOD", False, "test")
    variables = ops.init_tables(plan, jax.random.key(1))
    dense = tcp.DenseState.create({"w": jnp.asarray(rng.normal(size=12), jnp.float32) * 0.1,
                                   "b": jnp.float32(0)}, tx)

    # The reference's loop, as in its docs.
    sc_fwd = ep_utils.get_default_sc_fwd_function(specs, MESH, num_sc_per_device=SC)
    sc_bwd = ep_utils.get_default_sc_bwd_function(specs, MESH, num_sc_per_device=SC)
    tc = reference_tc(tx)
    first = ep_utils.CurrentStepInput(sparse_inputs=data[0][0], dense_inputs=data[0][1])
    sharded = NamedSharding(MESH, PartitionSpec("x"))
    pipeline_state = ep_utils.get_initial_state(first, dense, variables, sc_fwd, tc,
                                                dense_input_sharding=sharded,
                                                sparse_input_sharding=sharded)
    pipeline_state = jax.device_put(pipeline_state, ep_utils.get_pipeline_state_sharding(
        ep_utils.PipelineState, sharded, sharded, NamedSharding(MESH, PartitionSpec()), None))
    run = jax.jit(functools.partial(ep_utils.step, sc_fwd_function=sc_fwd, tc_function=tc,
                                    sc_bwd_function=sc_bwd), static_argnames="fake_tc_step")
    tables = {name: embedding.EmbeddingVariables(v.table, v.slots) for name, v in
              jax.tree.map(jnp.copy, variables).items()}
    state, losses = dense, []
    for call in range(ep_utils.get_pipeline_train_steps(NUM_STEPS)):
        given = (ep_utils.CurrentStepInput(sparse_inputs=data[call][0],
                                           dense_inputs=data[call][1])
                 if call < NUM_STEPS else jax.tree.map(jnp.zeros_like, first))
        valid = ep_utils.is_output_valid(call, NUM_STEPS)
        loss, _, state, tables, pipeline_state = run(given, state, tables, pipeline_state,
                                                     fake_tc_step=not valid)
        if valid:
            losses.append(float(loss))

    # tilecore.pipelining on the same batches, tables and dense state.
    step = tcp.TrainStep(stages=tcp.sparsecore_stages(plan, tcp.optax_tc(loss_fn, tx)),
                         pipelined=True, donate=False)
    batches = [tcp.StepInput(native_batch(plan, sparse), labels)
               for sparse, labels in data]
    native = tcp.run_loop(step, step.init(variables, dense, batches[0]), batches)
    want = [float(result.outputs) for result in native]

    np.testing.assert_allclose(losses, want, rtol=1e-6)
    for name in plan.stacks:
        np.testing.assert_allclose(tables[name].table, native.state.variables[name].table,
                                   rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(tables[name].slot[0], native.state.variables[name].slots[0],
                                   rtol=1e-6, atol=1e-7, err_msg=name)
        assert not np.allclose(tables[name].table, variables[name].table), "no update applied"
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 state.params, native.state.dense.params)


def test_default_stages_need_a_one_axis_mesh() -> None:
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    for make in (ep_utils.get_default_sc_fwd_function, ep_utils.get_default_sc_bwd_function):
        with pytest.raises(ValueError, match=r"must be 1-D .* got axes \{'a': 1, 'b': 1\}"):
            make(feature_specs(), mesh)


def test_fake_tc_step_must_be_a_bool() -> None:
    """'no' was taken for True: a fake TC step ran and its output was zeros."""
    from tilecore.compat import _pipelining

    with pytest.raises(TypeError, match="fake_tc_step must be True or False, got 'no'"):
        _pipelining.step(None, None, None, None, None, None, None,  # type: ignore[arg-type]
                         fake_tc_step="no")  # type: ignore[arg-type]


def test_stage_functions_returning_the_wrong_things_are_named() -> None:
    sc_fwd, tc, sc_bwd = toy_stages()
    given = ep_utils.CurrentStepInput(sparse_inputs=jnp.float32(1), dense_inputs=jnp.float32(-1))
    state, variables = jnp.int32(0), jnp.float32(0)
    pipeline_state = ep_utils.get_initial_state(given, state, variables, sc_fwd, tc)
    wrong = (
        ({"sc_fwd_function": lambda *a: sc_fwd(*a)[0]},
         r"sc_fwd_function must return \(embedding_activations, sc_fwd_aux\), got"),
        ({"tc_function": lambda *a: tuple(tc(*a))[:3]},
         r"tc_function must return \(embedding_gradients, output, tc_train_state, tc_aux\), "
         r"got a tuple of 3"),
        ({"sc_bwd_function": lambda *a: (sc_bwd(*a), 1, 2)},
         r"sc_bwd_function must return \(embedding_variables, sc_bwd_aux\), got a tuple of 3"),
    )
    for change, message in wrong:
        functions = {"sc_fwd_function": sc_fwd, "tc_function": tc, "sc_bwd_function": sc_bwd,
                     **change}
        with pytest.raises(TypeError, match=message):
            ep_utils.step(given, state, variables, pipeline_state, **functions,
                          fake_tc_step=False)
