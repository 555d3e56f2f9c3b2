"""The reference's pipelining state and stage signatures (`embedding_pipelining_utils`).

Field names follow the reference, so code that reads or `replace`s them ports
unchanged; `tilecore.compat._pipelining` maps them onto `tilecore.pipelining`'s
state, which does the work.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import jax
from flax import struct

_Sparse = TypeVar("_Sparse")
_Dense = TypeVar("_Dense")
_Activations = TypeVar("_Activations")
_Gradients = TypeVar("_Gradients")
_ScFwdAux = TypeVar("_ScFwdAux")
_TcAux = TypeVar("_TcAux")
_Output = TypeVar("_Output")


class ScFwdStageFun(Protocol):
    """`sc_fwd(sparse_inputs, embedding_variables) -> (activations, sc_fwd_aux)`."""

    def __call__(self, sparse_inputs: Any, embedding_variables: Any, /) -> tuple[Any, Any]: ...


class TcStageFun(Protocol):
    """`tc(activations, dense_inputs, train_state, sc_fwd_aux)
    -> (activation_gradients, output, train_state, tc_aux)`."""

    def __call__(self, embedding_activations: Any, dense_inputs: Any, train_state: Any,
                 sc_fwd_aux: Any = None, /) -> tuple[Any, Any, Any, Any]: ...


class ScBwdStageFun(Protocol):
    """`sc_bwd(sparse_inputs, activation_gradients, embedding_variables, tc_aux)
    -> (embedding_variables, sc_bwd_aux)`; the variables returned are the updated ones."""

    def __call__(self, sparse_inputs: Any, embedding_gradients: Any, embedding_variables: Any,
                 tc_aux: Any = None, /) -> tuple[Any, Any]: ...


class CurrentStepInput(struct.PyTreeNode, Generic[_Sparse, _Dense]):
    """Step i's inputs: the sparse ones feed the SC forward stage now, the dense ones
    the TC stage in the next call."""

    sparse_inputs: _Sparse
    dense_inputs: _Dense


class LastStepInput(struct.PyTreeNode, Generic[_Sparse, _Dense, _Activations, _ScFwdAux]):
    """Step i−1, waiting for the TC stage: its inputs and its activations."""

    sparse_inputs: _Sparse
    embedding_activations: _Activations
    dense_inputs: _Dense
    sc_fwd_aux: _ScFwdAux


class StepBeforeLastStepInput(struct.PyTreeNode, Generic[_Sparse, _Gradients, _TcAux]):
    """Step i−2, waiting for the SC backward stage: its sparse inputs and gradients."""

    sparse_inputs: _Sparse
    embedding_gradients: _Gradients
    tc_aux: _TcAux


class PipelineState(struct.PyTreeNode, Generic[_Sparse, _Dense, _Activations, _Gradients,
                                               _TcAux, _ScFwdAux, _Output]):
    """The two steps in flight between calls of `step`.

    Attributes:
      pipeline_step: the number of `step` calls made so far (0-based pipeline
        step, not the training step).
      last_step_inputs: step i−1, for the TC stage.
      step_before_last_step_inputs: step i−2, for the SC backward stage.
      placeholder_output: zeros shaped like the TC stage's output.
      placeholder_tc_aux: zeros shaped like the TC stage's aux value.
    """

    pipeline_step: jax.Array
    last_step_inputs: LastStepInput[_Sparse, _Dense, _Activations, _ScFwdAux]
    step_before_last_step_inputs: StepBeforeLastStepInput[_Sparse, _Gradients, _TcAux]
    placeholder_output: _Output
    placeholder_tc_aux: _TcAux
