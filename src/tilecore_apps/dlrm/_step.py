"""The click model's training stages (for `tilecore.pipelining`) and its evaluation step.

A training step has the three stages of the SparseCore design: SparseCore
forward (`lookup`), TensorCore forward/backward (the dense model, its optax
update and the activation gradients), SparseCore backward (`lookup_grad`, the
tables' fused sparse update). `tilecore.pipelining.TrainStep` runs them in
sequence or pipelined across steps. Each stage runs under a `jax.named_scope`,
so the stages are named in a profile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from tilecore import ops
from tilecore.pipelining import Stages, optax_tc, sparsecore_stages
from tilecore.preprocessing import PreprocessedBatch
from tilecore.stacking import StackingPlan

from ._model import Params, bce_loss, logits


class DenseInputs(NamedTuple):
    """The dense half of a batch: dense features `[B, D]` and labels `[B]`."""

    features: jax.Array | np.ndarray
    labels: jax.Array | np.ndarray


class DeviceBatch(NamedTuple):
    """A batch for evaluation: preprocessed IDs plus the dense inputs."""

    sparse: PreprocessedBatch
    dense: DenseInputs


class StepMetrics(NamedTuple):
    """Per-step outputs: the loss, and whether each feature's activations were finite."""

    loss: jax.Array
    finite: dict[str, jax.Array]


def _scoped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        with jax.named_scope(name):
            return fn(*args)

    return run


def _loss(features: Sequence[str]) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    def loss(params: Params, activations: Mapping[str, jax.Array], dense: DenseInputs
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        value = bce_loss(logits(params, [activations[f] for f in features], dense.features),
                         dense.labels)
        return value, {f: jnp.all(jnp.isfinite(activations[f])) for f in features}

    return loss


def click_stages(plan: StackingPlan, optimizer: optax.GradientTransformation, *,
                 mesh: Mesh | None = None) -> Stages:
    """The three stages of a click-model step; the TC stage outputs `(loss, finite)`."""
    tc = optax_tc(_loss(list(plan.features)), optimizer, has_aux=True)
    stages = sparsecore_stages(plan, tc, mesh=mesh)
    return Stages(sc_forward=_scoped("sc_forward", stages.sc_forward),
                  tc=_scoped("tc_forward_backward", stages.tc),
                  sc_backward=_scoped("sc_backward", stages.sc_backward))


def make_eval_step(plan: StackingPlan, *, mesh: Mesh | None = None
                   ) -> Callable[[Params, Mapping[str, ops.EmbeddingVariables], DeviceBatch],
                                 jax.Array]:
    """`jit(eval)`: `(params, variables, batch) -> [B] logits` (nothing is updated)."""
    features = list(plan.features)

    def evaluate(params: Params, variables: Mapping[str, ops.EmbeddingVariables],
                 batch: DeviceBatch) -> jax.Array:
        with jax.named_scope("eval"):
            activations = ops.lookup(plan, batch.sparse, variables, mesh=mesh)
            return logits(params, [activations[f] for f in features], batch.dense.features)

    return jax.jit(evaluate)
