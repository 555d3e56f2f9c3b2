"""The training step, pipelined and plain, with one calling convention.

Both are pure functions `(stages, state, inputs) -> (state, StepOutput)`, to be
jitted with `stages` static (see `TrainStep`), so a loop switches between them
by changing one flag.

Pipelined call i (REFERENCE.md §7), in this order:
  1. SC backward of step i−2 (its batch and activation gradients) → new tables;
  2. SC forward of step i with the tables just updated;
  3. TC stage of step i−1 (skipped with `fake_tc_step`: placeholders pass through);
  4. shift: step i becomes "last", step i−1 "before last".
So the activations of step i see the table updates of steps ≤ i−2: one step of
staleness, while the SC work of step i and the TC work of step i−1 are
independent and can overlap. The dense state is never stale.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._state import (
    LastStepInput,
    PipelineState,
    StepBeforeLastStepInput,
    TrainState,
    empty_batch,
    placeholder_input,
    zeros_of,
)
from ._types import Stages, StepInput, StepOutput, TcResult, Variables


def _tc_shapes(stages: Stages, dense_state: Any, activations: Any, dense: Any,
               sc_forward_aux: Any) -> TcResult:
    return jax.eval_shape(stages.dense, dense_state, activations, dense, sc_forward_aux)


def initial_state(stages: Stages, variables: Variables, dense_state: Any, example: StepInput,
                  *, pipelined: bool = True) -> TrainState:
    """The state before the first call: step 0 and, if `pipelined`, placeholders in flight.

    `example` fixes the shapes of the batches, dense inputs, activations and aux
    values (only its shapes and dtypes are used; the stages are traced, not run).
    Place the result on a mesh with `jax.device_put(state, train_state_sharding(...))`.
    """
    step = jnp.zeros((), jnp.int32)
    if not pipelined:
        return TrainState(step, dict(variables), dense_state)
    activations, fwd_aux = jax.eval_shape(stages.forward, example.batch, variables)
    tc = _tc_shapes(stages, dense_state, activations, example.dense, fwd_aux)
    placeholder = placeholder_input(example)
    pipeline = PipelineState(
        last=LastStepInput(placeholder.batch, zeros_of(activations), placeholder.dense,
                           zeros_of(fwd_aux)),
        before_last=StepBeforeLastStepInput(empty_batch(example.batch),
                                            zeros_of(tc.activation_grads), zeros_of(tc.aux)),
    )
    return TrainState(step, dict(variables), dense_state, pipeline)


def pipelined_step(stages: Stages, state: TrainState, inputs: StepInput, *,
                   fake_tc_step: bool = False) -> tuple[TrainState, StepOutput]:
    """One pipelined call (see the module docstring); `fake_tc_step` must be static.

    Returns the new state and a `StepOutput` whose `outputs` belong to the
    previous call's step (zeros when `fake_tc_step`) and whose `sc_backward_aux`
    belongs to the step before that. Use `is_output_valid` to tell real outputs.
    """
    if state.pipeline is None:
        raise ValueError("pipelined_step needs a pipelined state; build it with "
                         "initial_state(..., pipelined=True).")
    last, before_last = state.pipeline
    # The SC backward of call i updates with step i−2's data: the step index a plain
    # loop would pass for the same update (clamped: the first two calls touch no row).
    data_step = jnp.maximum(state.step - 2, 0)
    variables, bwd_aux = stages.backward(before_last.batch, state.variables,
                                         before_last.activation_grads, data_step,
                                         before_last.tc_aux)
    activations, fwd_aux = stages.forward(inputs.batch, variables)
    if fake_tc_step:
        shapes = _tc_shapes(stages, state.dense, last.activations, last.dense,
                            last.sc_forward_aux)
        tc = TcResult(zeros_of(shapes.outputs), zeros_of(shapes.activation_grads), state.dense,
                      zeros_of(shapes.aux))
    else:
        tc = stages.dense(state.dense, last.activations, last.dense, last.sc_forward_aux)
    pipeline = PipelineState(
        last=LastStepInput(inputs.batch, activations, inputs.dense, fwd_aux),
        before_last=StepBeforeLastStepInput(last.batch, tc.activation_grads, tc.aux),
    )
    new = TrainState(state.step + 1, variables, tc.dense_state, pipeline)
    return new, StepOutput(tc.outputs, bwd_aux)


def plain_step(stages: Stages, state: TrainState, inputs: StepInput, *,
               fake_tc_step: bool = False) -> tuple[TrainState, StepOutput]:
    """One non-pipelined step: SC forward, TC stage and SC backward on the same inputs.

    With `sparsecore_stages` and `optax_tc` this computes what `tc.ops.training_update`
    followed by the optax update does. `fake_tc_step` is accepted for a uniform
    signature and must be False (a plain loop has no fill or drain calls).
    """
    if fake_tc_step:
        raise ValueError("plain_step has no fill or drain calls; pass fake_tc_step=False "
                         "(or use pipelined_step).")
    activations, fwd_aux = stages.forward(inputs.batch, state.variables)
    tc = stages.dense(state.dense, activations, inputs.dense, fwd_aux)
    variables, bwd_aux = stages.backward(inputs.batch, state.variables, tc.activation_grads,
                                         state.step, tc.aux)
    new = TrainState(state.step + 1, variables, tc.dense_state, state.pipeline)
    return new, StepOutput(tc.outputs, bwd_aux)
