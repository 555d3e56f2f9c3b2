"""Shardings of the training state on a mesh, so it is placed once and never copied.

Tables and slots are split by rows over the embedding axis (as `init_tables`
places them); batches by their leading device dimension; activations,
activation gradients and dense inputs by their leading (batch) dimension;
scalars, aux values and the dense state are replicated unless you say otherwise.

The step keeps whatever placement it is given (`mesh_shardings`): a jitted
function's cache key includes its arguments' shardings, so a state that came
back placed differently from how it went in would compile the step again.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from ..ops import DEFAULT_AXIS
from ._state import LastStepInput, PipelineState, StepBeforeLastStepInput, TrainState

ShardingTree = Sharding | Any
"""One sharding for every array of a group, or a pytree of shardings matching it."""


def _fill(tree: Any, given: ShardingTree | None, default: Any) -> Any:
    if given is None:
        return jax.tree.map(default, tree)
    if isinstance(given, Sharding):
        return jax.tree.map(lambda _: given, tree)
    return given


def pipeline_state_sharding(
    pipeline: PipelineState,
    mesh: Mesh,
    *,
    axis: str = DEFAULT_AXIS,
    dense_inputs: ShardingTree | None = None,
    activations: ShardingTree | None = None,
    sc_forward_aux: ShardingTree | None = None,
    tc_aux: ShardingTree | None = None,
) -> PipelineState:
    """Shardings for `pipeline` (arrays or `jax.ShapeDtypeStruct`s).

    Defaults: batch buffers `P(axis)` (their minibatch count replicated); activations, their gradients and the dense
    inputs split over `axis` by their leading dimension (replicated if scalar);
    aux values replicated. Pass a sharding (or a matching pytree of them) to
    override a group; `activations` also applies to the activation gradients.
    """
    split, replicated = NamedSharding(mesh, PartitionSpec(axis)), NamedSharding(mesh,
                                                                                 PartitionSpec())

    def by_batch(x: Any) -> Sharding:
        return split if len(np.shape(x)) > 0 else replicated

    last, before = pipeline
    return PipelineState(
        last=LastStepInput(
            batch=_fill(last.batch, None, by_batch),
            activations=_fill(last.activations, activations, by_batch),
            dense=_fill(last.dense, dense_inputs, by_batch),
            sc_forward_aux=_fill(last.sc_forward_aux, sc_forward_aux, lambda _: replicated),
        ),
        before_last=StepBeforeLastStepInput(
            batch=_fill(before.batch, None, by_batch),
            activation_grads=_fill(before.activation_grads, activations, by_batch),
            tc_aux=_fill(before.tc_aux, tc_aux, lambda _: replicated),
        ),
    )


def train_state_sharding(
    state: TrainState,
    mesh: Mesh,
    *,
    axis: str = DEFAULT_AXIS,
    dense_state: ShardingTree | None = None,
    **pipeline_options: ShardingTree | None,
) -> TrainState:
    """Shardings for a whole `TrainState`: `jax.device_put(state, train_state_sharding(...))`.

    Tables and slots are split by rows over `axis`, the step counter and (by
    default) the dense state are replicated; `pipeline_options` go to
    `pipeline_state_sharding`.
    """
    rows = NamedSharding(mesh, PartitionSpec(axis, None))
    replicated = NamedSharding(mesh, PartitionSpec())
    # `_make`: a TrainState of shardings, not of arrays (its fields are typed for arrays).
    return TrainState._make((
        replicated,
        jax.tree.map(lambda _: rows, dict(state.variables)),
        _fill(state.dense, dense_state, lambda _: replicated),
        None if state.pipeline is None else pipeline_state_sharding(
            state.pipeline, mesh, axis=axis, **pipeline_options),
    ))


def mesh_shardings(tree: Any) -> Any:
    """The `NamedSharding` of every array of `tree` placed on a mesh; None for the others.

    None (host arrays, arrays on one device) means "unpinned" both as a jit
    `out_shardings` leaf and for `place_like`, so an unplaced state behaves as before.
    """
    return jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) and isinstance(
        x.sharding, NamedSharding) else None, tree)


def place_like(tree: Any, like: Any) -> Any:
    """`tree` with each leaf put where the matching leaf of `like` is, if on a mesh.

    For inputs made on the host (the drain's placeholders) that must reach the
    step placed like the real inputs, or the step would compile once more for them.
    """
    return jax.tree.map(lambda x, s: x if s is None else jax.device_put(x, s), tree,
                        mesh_shardings(like))
