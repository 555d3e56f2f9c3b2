"""Preprocessing outputs as JAX pytrees (host code cannot import JAX to do this itself).

`PreprocessedBatch.num_minibatches` is a *leaf*, not static metadata: under `jit`
it is a traced int32 scalar, so batches with different minibatch counts share one
compiled step. Host integers (Python or numpy, of any width) are flattened as
`np.int32`, so the compiled signature does not depend on how the host spelled it.
`made_for` (the packing plan's signature) is static metadata: the ops check it
while tracing.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.tree_util import GetAttrKey

from ..preprocessing import PreprocessedBatch, StackBuffers

jax.tree_util.register_dataclass(
    StackBuffers,
    data_fields=["row_pointers", "embedding_ids", "sample_ids", "gains"],
    meta_fields=[],
)


def _as_leaf(num_minibatches: Any) -> Any:
    if isinstance(num_minibatches, (int, np.integer)) or (
            isinstance(num_minibatches, np.ndarray) and num_minibatches.shape == ()):
        return np.int32(num_minibatches)
    return num_minibatches  # already a JAX value (a tracer or device array): left as is


def _flatten_with_keys(batch: PreprocessedBatch) -> tuple[tuple[Any, ...], Any]:
    return ((GetAttrKey("stacks"), batch.stacks),
            (GetAttrKey("num_minibatches"), _as_leaf(batch.num_minibatches))), batch.made_for


def _flatten(batch: PreprocessedBatch) -> tuple[tuple[Any, ...], Any]:
    return (batch.stacks, _as_leaf(batch.num_minibatches)), batch.made_for


def _unflatten(made_for: Any, children: Any) -> PreprocessedBatch:
    stacks, num_minibatches = children
    return PreprocessedBatch(stacks=stacks, num_minibatches=num_minibatches, made_for=made_for)


jax.tree_util.register_pytree_with_keys(
    PreprocessedBatch, _flatten_with_keys, _unflatten, _flatten)
