"""State carried between calls of a step function, and the placeholders that fill it.

Pipelining keeps two steps in flight: the inputs and activations of step i−1
wait for the TC stage, and the inputs and activation gradients of step i−2 wait
for the SC backward stage. Before the first real steps and after the last one
those slots hold placeholders: an *empty batch* (every row pointer 0, so every
partition is empty and no table row or slot is read or written, whatever the
optimizer) and zeros for everything else.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..preprocessing import PreprocessedBatch, StackBuffers
from ..specs._numbers import is_integer
from ._types import StepInput, Variables

_FILLER_ID = 2**31 - 1
"""What preprocessing writes outside the pointed ranges (DESIGN.md, host output)."""


class LastStepInput(NamedTuple):
    """Step i−1, waiting for the TC stage: its inputs and the activations of its batch."""

    batch: PreprocessedBatch
    activations: Any
    dense: Any
    sc_forward_aux: Any


class StepBeforeLastStepInput(NamedTuple):
    """Step i−2, waiting for the SC backward stage: its batch and activation gradients."""

    batch: PreprocessedBatch
    activation_grads: Any
    tc_aux: Any


class PipelineState(NamedTuple):
    """The two steps in flight between pipelined calls."""

    last: LastStepInput
    before_last: StepBeforeLastStepInput


class TrainState(NamedTuple):
    """Everything a step function updates, as one pytree (donate it when jitting).

    Attributes:
      step: int32 scalar, the number of calls made so far.
      variables: stack name → embedding table and slots.
      dense: the TC stage's state (e.g. `DenseState(params, opt_state)`).
      pipeline: the steps in flight; None for the plain (non-pipelined) step.
    """

    step: jax.Array
    variables: Variables
    dense: Any
    pipeline: PipelineState | None = None


def is_deleted(state: TrainState) -> bool:
    """Whether an array of `state` is deleted: a donating step took it (and then failed,
    if the caller still holds it)."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))


def empty_batch(like: PreprocessedBatch) -> PreprocessedBatch:
    """A batch shaped like `like` that holds no IDs (numpy, on the host).

    Every row pointer is 0, so every partition is empty: the lookup gives zero
    activations and the gradient step touches no row, slot optimizers included.
    This is what `tilecore.preprocess` returns for samples without IDs.
    """
    if not isinstance(like, PreprocessedBatch):
        raise TypeError(f"empty_batch: expected a PreprocessedBatch to take the shapes of, got "
                        f"{type(like).__name__}.")

    def empty(buffers: StackBuffers) -> StackBuffers:
        def full(x: Any, value: Any) -> np.ndarray:
            return np.full(np.shape(x), value, x.dtype)

        return StackBuffers(
            row_pointers=full(buffers.row_pointers, 0),
            embedding_ids=full(buffers.embedding_ids, _FILLER_ID),
            sample_ids=full(buffers.sample_ids, _FILLER_ID),
            gains=full(buffers.gains, np.nan),
        )

    # `int`: a fresh host value even when `like` is on the devices, so that no buffer of
    # the placeholder is one of `like`'s (a state holding it could not be donated).
    return PreprocessedBatch(stacks={name: empty(b) for name, b in like.stacks.items()},
                             num_minibatches=int(like.num_minibatches), made_for=like.made_for)


def placeholder_input(like: StepInput) -> StepInput:
    """Dummy inputs for the drain calls: an empty batch and zero dense inputs."""
    return StepInput(empty_batch(like.batch), jax.tree.map(_zeros_like, like.dense))


def _zeros_like(x: Any) -> np.ndarray:
    return np.zeros(np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def zeros_of(shapes: Any) -> Any:
    """Zeros for every `jax.ShapeDtypeStruct` leaf of `shapes` (e.g. from `jax.eval_shape`)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def is_output_valid(call: int, num_steps: int) -> bool:
    """Whether pipelined call `call` (0-based) runs the TC stage on a real step.

    Calls 1..num_steps do (call k's outputs are step k−1's); call 0 only fills the
    pipeline and call num_steps+1 only drains it. Pass `fake_tc_step=not
    is_output_valid(call, num_steps)` to the pipelined step.
    """
    return 1 <= call <= num_steps


def pipeline_steps(num_steps: int) -> int:
    """Calls a pipelined loop makes for `num_steps` real steps: two more, to fill and drain."""
    if not is_integer(num_steps) or num_steps < 0:
        raise ValueError(f"num_steps must be an integer ≥ 0; got {num_steps=}.")
    return num_steps + 2
