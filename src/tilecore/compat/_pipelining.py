"""The reference's pipelining functions as adapters over `tilecore.pipelining`.

`step` translates the reference's state and stage signatures to tilecore's
(`TrainState`, `Stages`) and runs `tilecore.pipelining.pipelined_step`, so both
schedules are one implementation: in call i, SC backward of step i−2, SC forward
of step i with the tables just updated, TC stage of step i−1.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, Sharding

from .. import pipelining as tcp
from ..pipelining._types import stage_result
from ._device_api import tpu_sparse_dense_matmul, tpu_sparse_dense_matmul_grad
from ._pipelining_types import (
    CurrentStepInput,
    LastStepInput,
    PipelineState,
    ScBwdStageFun,
    ScFwdStageFun,
    StepBeforeLastStepInput,
    TcStageFun,
)

_State = TypeVar("_State")


def get_pipeline_train_steps(num_steps: int) -> int:
    """Calls of `step` for `num_steps` real steps: two more, to fill and drain."""
    return tcp.pipeline_steps(num_steps)


def is_output_valid(pipeline_step: int, num_steps: int) -> bool:
    """Whether call `pipeline_step` runs the TC stage on a real step (1..num_steps).

    Pass `fake_tc_step=not is_output_valid(pipeline_step, num_steps)` to `step`.
    """
    return tcp.is_output_valid(pipeline_step, num_steps)


def _zeros(sharding: Sharding | None) -> Any:
    def zeros(x: Any) -> Any:
        value = jnp.zeros_like(x)  # numpy int64 (minibatch counts) → JAX's int32, silently
        return value if sharding is None or value.ndim == 0 else jax.device_put(value, sharding)

    return zeros


def get_initial_state(
    pipeline_input: CurrentStepInput,
    tc_train_state: Any,
    embedding_variables: Any,
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    dense_input_sharding: Sharding | None = None,
    sparse_input_sharding: Sharding | None = None,
) -> PipelineState:
    """The pipeline state before call 0: zeros in flight, shaped by tracing the stages.

    Only the shapes of `pipeline_input` are used. All-zero sparse inputs have all
    row pointers 0, so the SC backward stage of calls 0 and 1 touches no row.
    Placeholders with a leading dimension are placed with `sparse_input_sharding`
    (sparse inputs, activations, gradients) and `dense_input_sharding` (dense
    inputs) when given.
    """
    sparse = jax.tree.map(_zeros(sparse_input_sharding), pipeline_input.sparse_inputs)
    dense = jax.tree.map(_zeros(dense_input_sharding), pipeline_input.dense_inputs)
    acts, fwd_aux = jax.eval_shape(sc_fwd_function, sparse, embedding_variables)
    grads, output, _, tc_aux = jax.eval_shape(
        tc_function, acts, dense, tc_train_state, jax.tree.map(_zeros(None), fwd_aux))
    return PipelineState(
        pipeline_step=jnp.zeros((), jnp.int32),
        last_step_inputs=LastStepInput(
            sparse_inputs=sparse,
            embedding_activations=jax.tree.map(_zeros(sparse_input_sharding), acts),
            dense_inputs=dense,
            sc_fwd_aux=jax.tree.map(_zeros(None), fwd_aux),
        ),
        step_before_last_step_inputs=StepBeforeLastStepInput(
            sparse_inputs=jax.tree.map(jnp.copy, sparse),  # its own buffers, for donation
            embedding_gradients=jax.tree.map(_zeros(sparse_input_sharding), grads),
            tc_aux=jax.tree.map(_zeros(None), tc_aux),
        ),
        placeholder_output=jax.tree.map(_zeros(None), output),
        placeholder_tc_aux=jax.tree.map(_zeros(None), tc_aux),
    )


def _stages(sc_fwd: ScFwdStageFun, tc: TcStageFun, sc_bwd: ScBwdStageFun) -> tcp.Stages:
    """The reference's stage functions under tilecore's stage signatures."""

    def sc_forward(sparse: Any, variables: Any) -> tuple[Any, Any]:
        acts, aux = stage_result(sc_fwd(sparse, variables), "sc_fwd_function",
                                 ("embedding_activations", "sc_fwd_aux"))
        return acts, aux

    def tc_stage(train_state: Any, acts: Any, dense: Any, fwd_aux: Any) -> tcp.TcResult:
        grads, output, train_state, tc_aux = stage_result(
            tc(acts, dense, train_state, fwd_aux), "tc_function",
            ("embedding_gradients", "output", "tc_train_state", "tc_aux"))
        return tcp.TcResult(output, grads, train_state, tc_aux)

    def sc_backward(sparse: Any, variables: Any, grads: Any, step: jax.Array,
                    tc_aux: Any) -> tuple[Any, Any]:
        del step  # the reference's SC backward stage gets none (pass it in tc_aux)
        variables, aux = stage_result(sc_bwd(sparse, grads, variables, tc_aux),
                                      "sc_bwd_function", ("embedding_variables", "sc_bwd_aux"))
        return variables, aux

    return tcp.Stages(sc_forward=sc_forward, tc=tc_stage, sc_backward=sc_backward)


def step(
    pipeline_input: CurrentStepInput,
    tc_train_state: _State,
    embedding_variables: Any,
    pipeline_state: PipelineState,
    sc_fwd_function: ScFwdStageFun,
    tc_function: TcStageFun,
    sc_bwd_function: ScBwdStageFun,
    *,
    fake_tc_step: bool,
) -> tuple[Any, Any, _State, Any, PipelineState]:
    """One pipelined call; `fake_tc_step` must be static under `jit`.

    Returns `(output, sc_bwd_aux, tc_train_state, embedding_variables,
    pipeline_state)`: the output of step i−1 (zeros when `fake_tc_step`) and the
    SC backward aux of step i−2. Unlike the reference, a fake TC call hands zero
    gradients (not the previous ones) to the next SC backward stage; in a loop of
    `get_pipeline_train_steps(n)` calls the results are the same.
    """
    if not isinstance(fake_tc_step, bool | np.bool_):  # "no" was taken for True
        raise TypeError(f"fake_tc_step must be True or False, got {fake_tc_step!r}.")
    last, before = pipeline_state.last_step_inputs, pipeline_state.step_before_last_step_inputs
    # tilecore's state is typed for its own batches; the stages only pass these through.
    state = tcp.TrainState(
        step=pipeline_state.pipeline_step,
        variables=embedding_variables,
        dense=tc_train_state,
        pipeline=tcp.PipelineState(
            last=tcp.LastStepInput(cast(Any, last.sparse_inputs), last.embedding_activations,
                                   last.dense_inputs, last.sc_fwd_aux),
            before_last=tcp.StepBeforeLastStepInput(cast(Any, before.sparse_inputs),
                                                    before.embedding_gradients, before.tc_aux),
        ),
    )
    inputs = tcp.StepInput(cast(Any, pipeline_input.sparse_inputs), pipeline_input.dense_inputs)
    new, out = tcp.pipelined_step(_stages(sc_fwd_function, tc_function, sc_bwd_function), state,
                                  inputs, fake_tc_step=fake_tc_step)
    assert new.pipeline is not None
    new_last, new_before = new.pipeline
    pipeline_state = pipeline_state.replace(
        pipeline_step=new.step,
        last_step_inputs=LastStepInput(
            sparse_inputs=new_last.batch, embedding_activations=new_last.activations,
            dense_inputs=new_last.dense, sc_fwd_aux=new_last.sc_forward_aux),
        step_before_last_step_inputs=StepBeforeLastStepInput(
            sparse_inputs=new_before.batch, embedding_gradients=new_before.activation_grads,
            tc_aux=new_before.tc_aux),
    )
    return out.outputs, out.sc_backward_aux, new.dense, new.variables, pipeline_state


def _one_axis(mesh: Mesh, what: str) -> None:
    if len(mesh.shape) != 1:
        raise ValueError(
            f"{what}: global_mesh must be 1-D (one axis the tables and batches are split "
            f"over); got axes {dict(mesh.shape)}. Build the stages yourself for other meshes."
        )


def get_default_sc_fwd_function(feature_specs: Any, global_mesh: Mesh, *,
                                num_sc_per_device: int | None = None) -> ScFwdStageFun:
    """The SC forward stage: `tpu_sparse_dense_matmul` over the 1-D `global_mesh`.

    Activations are shaped like `feature_specs`; the aux value is None.
    `num_sc_per_device` (compat only; None: 4) must match preprocessing.
    """
    _one_axis(global_mesh, "get_default_sc_fwd_function")

    def sc_fwd(sparse_inputs: Any, embedding_variables: Any) -> tuple[Any, None]:
        acts = tpu_sparse_dense_matmul(
            sparse_inputs, embedding_variables, feature_specs,
            global_device_count=global_mesh.size, num_sc_per_device=num_sc_per_device,
            mesh=global_mesh)
        return acts, None

    return sc_fwd


def get_default_sc_bwd_function(feature_specs: Any, global_mesh: Mesh, *,
                                num_sc_per_device: int | None = None) -> ScBwdStageFun:
    """The SC backward stage: `tpu_sparse_dense_matmul_grad` over the 1-D `global_mesh`.

    Returns the updated variables and None. As in the reference it passes no
    step, so the optimizers see step 0 (Adam's and LaProp's bias correction,
    learning-rate schedules); write your own stage, with the step in `tc_aux`,
    where that matters.
    """
    _one_axis(global_mesh, "get_default_sc_bwd_function")

    def sc_bwd(sparse_inputs: Any, embedding_gradients: Any, embedding_variables: Any,
               tc_aux: Any = None) -> tuple[Any, None]:
        del tc_aux
        updated = tpu_sparse_dense_matmul_grad(
            embedding_gradients, sparse_inputs, embedding_variables, feature_specs,
            global_device_count=global_mesh.size, num_sc_per_device=num_sc_per_device,
            mesh=global_mesh)
        return updated, None

    return sc_bwd


def get_pipeline_state_sharding(
    pipeline_state_cls: Any,
    dense_input_sharding: Sharding,
    sparse_input_sharding: Sharding,
    pipeline_output_sharding: Any,
    tc_aux_sharding: Any,
) -> Any:
    """Shardings for a pipeline state: `jax.device_put(state, get_pipeline_state_sharding(...))`.

    Sparse inputs, activations and gradients take `sparse_input_sharding`, dense
    inputs and the SC forward aux `dense_input_sharding` (as the reference does);
    `pipeline_step` is None (left where it is).
    """
    return pipeline_state_cls(
        pipeline_step=None,
        last_step_inputs=LastStepInput(
            sparse_inputs=sparse_input_sharding, embedding_activations=sparse_input_sharding,
            dense_inputs=dense_input_sharding, sc_fwd_aux=dense_input_sharding),
        step_before_last_step_inputs=StepBeforeLastStepInput(
            sparse_inputs=sparse_input_sharding, embedding_gradients=sparse_input_sharding,
            tc_aux=tc_aux_sharding),
        placeholder_output=pipeline_output_sharding,
        placeholder_tc_aux=tc_aux_sharding,
    )
