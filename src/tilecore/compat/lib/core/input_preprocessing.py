"""The reference's one-feature preprocessing (`jax_tpu_embedding.sparsecore.lib.core.input_preprocessing`).

Port by changing the import to `from tilecore.compat.lib.core import input_preprocessing`.
The reference's module is a readable model of its packer; here the buffers come
from tilecore's own preprocessing (the work behind
`tilecore.compat.embedding.preprocess_sparse_dense_matmul_input`), on a plan of
one table that this device's rows look up.

With `enable_minibatching=True` the caller gives a sequence of minibatches; each
is partitioned on its own and packed after the previous one in every
SparseCore's run of the buffer, as the reference's packer lays them out.

Differences worth knowing: the device count is `mesh.size` (the reference takes
`len(mesh.devices)`, the first mesh axis, which differs only for meshes of more
than one axis); IDs must be integers >= 0, limits exceeded raise
`tilecore.LimitExceededError` (a `ValueError`), and malformed minibatch sequences
raise `ValueError` (the reference asserts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..._preprocessing import check_options
from ..._utils_core_preprocessing import pack_minibatches, preprocess_one_device
from ...utils import utils

ArrayLike = jnp.ndarray | np.ndarray
Sample = Sequence[int]
SampleWeight = Sequence[float]
Feature2D = ArrayLike
Weight2D = ArrayLike
FeatureBatch = Feature2D | Sequence[Sample]
WeightBatch = Weight2D | Sequence[SampleWeight]
MinibatchedFeatures = Sequence[FeatureBatch]
MinibatchedWeights = Sequence[WeightBatch]
FeatureInput = FeatureBatch | MinibatchedFeatures
WeightInput = WeightBatch | MinibatchedWeights

__all__ = ["preprocess_sparse_dense_matmul_input"]


def _ndim(features: FeatureInput) -> int:
    if isinstance(features, np.ndarray | jax.Array):
        return features.ndim
    try:
        return np.asarray(features, dtype=object).ndim
    except ValueError:
        return 1


def preprocess_sparse_dense_matmul_input(
    features: FeatureInput,
    features_weights: WeightInput,
    mesh: jax.sharding.Mesh,
    *,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    num_sc_per_device: int = -1,
    sharding_strategy: str = "MOD",
    enable_minibatching: bool = False,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One device's batch of one feature → `(row_pointers, col_ids, row_ids, gains)`.

    Args:
      features: this device's samples: a 2-D ID array or a sequence of ID lists.
      features_weights: one weight per ID, shaped like `features`.
      mesh: the mesh whose devices the table is mod-sharded over.
      max_ids_per_partition / max_unique_ids_per_partition: the partition limits
        (also the size of the buffers: `roundup8(max_ids) · S · N` entries).
      num_sc_per_device: SparseCores per device (<= 0: those of the mesh's first
        device, `utils.num_sparsecores_per_device`).
      sharding_strategy: only "MOD".
      enable_minibatching: `features` and `features_weights` are sequences of
        minibatches (split by the caller), packed one after another per SparseCore.

    Returns:
      Row pointers (per SparseCore, the end of each of its `max(N, 8)` partitions
      relative to its slot), the IDs as stored on their SparseCore (`id div N`),
      their samples (row within the SparseCore's share) and summed weights; unused
      entries hold `constants.PADDING_VALUE` / NaN.
    """
    if max_ids_per_partition <= 0:
        raise ValueError(f"max_ids_per_partition must be positive, got {max_ids_per_partition}.")
    if max_unique_ids_per_partition <= 0:
        raise ValueError("max_unique_ids_per_partition must be positive, got "
                         f"{max_unique_ids_per_partition}.")
    check_options(sharding_strategy, "preprocess_sparse_dense_matmul_input")
    if not enable_minibatching and _ndim(features) not in (1, 2):
        raise ValueError(f"features must be 1D or 2D, got {_ndim(features)}D.")
    if num_sc_per_device <= 0:
        num_sc_per_device = utils.num_sparsecores_per_device(mesh.devices.item(0))
    feature_batches = _batches(features, enable_minibatching, "features")
    weight_batches = _batches(features_weights, enable_minibatching, "features_weights")
    if len(feature_batches) != len(weight_batches):
        raise ValueError(f"{len(feature_batches)} minibatches of features but "
                         f"{len(weight_batches)} of features_weights; give one weight batch "
                         "per feature batch.")
    parts = [preprocess_one_device(
        batch, weights, global_device_count=int(mesh.size),
        num_sc_per_device=num_sc_per_device, max_ids_per_partition=max_ids_per_partition,
        max_unique_ids_per_partition=max_unique_ids_per_partition,
    ) for batch, weights in zip(feature_batches, weight_batches, strict=True)]
    buffers = parts[0] if not enable_minibatching else pack_minibatches(
        parts, num_sc_per_device, int(mesh.size) * num_sc_per_device)
    return tuple(jnp.asarray(b) for b in buffers)  # type: ignore[return-value]


def _batches(inputs: Any, enable_minibatching: bool, what: str) -> Sequence[Any]:
    """The one batch, or (minibatching) the caller's sequence of minibatches."""
    if not enable_minibatching:
        return [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, str):
        raise ValueError(f"With enable_minibatching=True, {what} must be a sequence (list or "
                         f"tuple) of minibatches, got {type(inputs).__name__}.")
    if not inputs:
        raise ValueError(f"With enable_minibatching=True, {what} must hold at least one "
                         "minibatch, got none.")
    return inputs
