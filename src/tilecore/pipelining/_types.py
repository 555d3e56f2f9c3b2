"""The three stages of a training step and the values that pass between them.

A step is split where the work changes hands between the SparseCore and the
TensorCore (REFERENCE.md §7):

- `sc_forward(batch, variables) -> (activations, sc_forward_aux)`: the lookup.
- `tc(dense_state, activations, dense_inputs, sc_forward_aux) -> TcResult`: the
  dense model's forward and backward pass and its optimizer (see `optax_tc`).
- `sc_backward(batch, variables, activation_grads, step, tc_aux)
  -> (variables, sc_backward_aux)`: the fused gradient and table update.

The aux values are the user's own pytrees (None when unused): `sc_forward_aux`
travels with the activations to the TC stage, `tc_aux` with the activation
gradients to the SC backward stage, and `sc_backward_aux` is returned for logging.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias

import jax

from ..ops import EmbeddingVariables
from ..preprocessing import PreprocessedBatch

Variables: TypeAlias = Mapping[str, EmbeddingVariables]
"""Stack name → the stack's table and optimizer slots."""
Activations: TypeAlias = Mapping[str, jax.Array]
"""Feature name → `[batch, dim]` (or whatever the SC forward stage returns)."""


class StepInput(NamedTuple):
    """The inputs of one training step (the reference's `CurrentStepInput`).

    Attributes:
      batch: the preprocessed sparse inputs (`tilecore.preprocess`).
      dense: the dense inputs (labels, dense features): any pytree of arrays.
    """

    batch: PreprocessedBatch
    dense: Any


def check_input(inputs: Any) -> None:
    """`inputs` is a `StepInput` whose batch is a `PreprocessedBatch` (an AttributeError
    from inside the step before)."""
    if not isinstance(inputs, StepInput):
        raise TypeError(f"A training step takes StepInput(batch, dense), got "
                        f"{type(inputs).__name__}.")
    if not isinstance(inputs.batch, PreprocessedBatch):
        raise TypeError("StepInput.batch must be the PreprocessedBatch that tilecore.preprocess "
                        f"returns, got {type(inputs.batch).__name__}.")


class TcResult(NamedTuple):
    """What the TC stage returns.

    Attributes:
      outputs: the step's outputs (loss, metrics): any pytree of arrays.
      activation_grads: gradients of the loss with respect to the activations,
        shaped like them; the SC backward stage turns them into table updates.
      dense_state: the dense parameters and optimizer state after the update.
      aux: `tc_aux`, handed to the SC backward stage with the gradients.
    """

    outputs: Any
    activation_grads: Any
    dense_state: Any
    aux: Any = None


class StepOutput(NamedTuple):
    """What one call of a step function returns besides the new state.

    In a pipelined call k, `outputs` belong to step k−1 (valid when
    `is_output_valid(k, n)`) and `sc_backward_aux` to step k−2; in a plain call
    both belong to the call's own step.
    """

    outputs: Any
    sc_backward_aux: Any


ScForward: TypeAlias = Callable[[PreprocessedBatch, Variables], tuple[Any, Any]]
TcStage: TypeAlias = Callable[[Any, Any, Any, Any], TcResult]
ScBackward: TypeAlias = Callable[[PreprocessedBatch, Variables, Any, jax.Array, Any],
                                 tuple[Variables, Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stages:
    """The three stage functions of a training step (see the module docstring).

    `sparsecore_stages` builds the SC stages from a stacking plan; `optax_tc`
    builds a TC stage from a loss function and an optax optimizer. Every stage
    must be traceable by `jax.jit`; all three are static parts of a step.
    """

    sc_forward: ScForward
    tc: TcStage
    sc_backward: ScBackward

    def forward(self, batch: PreprocessedBatch, variables: Variables) -> tuple[Any, Any]:
        """`sc_forward`, its result checked: `(activations, sc_forward_aux)`."""
        activations, aux = stage_result(self.sc_forward(batch, variables), "Stages.sc_forward",
                                        ("activations", "sc_forward_aux"))
        return activations, aux

    def dense(self, dense_state: Any, activations: Any, dense_inputs: Any,
              sc_forward_aux: Any) -> TcResult:
        """`tc`, its result checked: a `TcResult`."""
        result = self.tc(dense_state, activations, dense_inputs, sc_forward_aux)
        if not isinstance(result, TcResult):
            raise TypeError("Stages.tc must return TcResult(outputs, activation_grads, "
                            f"dense_state, aux), got {_described(result)}.")
        return result

    def backward(self, batch: PreprocessedBatch, variables: Variables, activation_grads: Any,
                 step: jax.Array, tc_aux: Any) -> tuple[Variables, Any]:
        """`sc_backward`, its result checked: `(variables, sc_backward_aux)`."""
        variables, aux = stage_result(
            self.sc_backward(batch, variables, activation_grads, step, tc_aux),
            "Stages.sc_backward", ("variables", "sc_backward_aux"))
        return variables, aux


def _described(value: Any) -> str:
    return (f"a {type(value).__name__} of {len(value)}" if isinstance(value, tuple | list)
            else type(value).__name__)


def stage_result(result: Any, stage: str, names: tuple[str, ...]) -> tuple[Any, ...]:
    """A stage function's result as the tuple `names` it must return: a TypeError naming
    the stage and what it returned otherwise (an unpacking error inside the step before)."""
    if not isinstance(result, tuple | list) or len(result) != len(names):
        raise TypeError(f"{stage} must return ({', '.join(names)}), got "
                        f"{_described(result)}.")
    return tuple(result)
