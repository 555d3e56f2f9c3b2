"""One feature's batch for one device → CSR-wrapped COO buffers, by tilecore's preprocessing.

The reference's `lib.core.input_preprocessing` is a readable model of its packer
for a lone, unstacked feature given as this device's rows. Here the same buffers
come from `tilecore.preprocessing.preprocess` on a one-table plan whose topology
has this device as its only local one: rows split over its SparseCores, IDs
partitioned by `id mod N` and stored as `id div N`, duplicate (ID, sample) pairs
merged with their weights summed, partitions 8-aligned in each SparseCore's slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import specs as native
from ..preprocessing import PreprocessedBatch, Ragged, preprocess
from ..preprocessing._packed import FILLER_ID
from ..stacking import plan_stacking, round_up

_NAME = "feature"


def _is_dense(features: Any) -> bool:
    return hasattr(features, "ndim") and features.ndim == 2 and np.asarray(features).dtype != object


def _rows(values: Any, what: str) -> list[np.ndarray]:
    try:
        return [np.asarray(row).reshape(-1) for row in values]
    except TypeError:
        raise TypeError(f"{what} must be a 2-D array or a sequence of per-sample sequences, "
                        f"got {type(values).__name__}.") from None


def _native_input(features: Any, weights: Any) -> tuple[Any, Any]:
    """Dense `(ids, weights)` arrays, or one `Ragged` holding both."""
    if _is_dense(features):
        ids = np.asarray(features)
        gains = np.asarray(weights, dtype=np.float32)
        if gains.shape != ids.shape:
            raise ValueError(f"features_weights has shape {gains.shape} but features has shape "
                             f"{ids.shape}; give one weight per ID.")
        return ids, gains
    id_rows = _rows(features, "features")
    weight_rows = _rows(weights, "features_weights")
    for sample, (ids, gains) in enumerate(zip(id_rows, weight_rows, strict=True)):
        if ids.shape != gains.shape:
            raise ValueError(f"Sample {sample} has {ids.size} IDs but {gains.size} weights; give "
                             "one weight per ID.")
    return Ragged.from_rows([r.tolist() for r in id_rows], [r.tolist() for r in weight_rows]), None


def _vocab_size(native_ids: Any) -> int:
    values = native_ids.values if isinstance(native_ids, Ragged) else native_ids
    if values.size and not np.issubdtype(values.dtype, np.integer):
        raise TypeError(f"features must hold integer IDs, got dtype {values.dtype}.")
    return int(values.max()) + 1 if values.size else 1


def preprocess_one_device(
    features: Any,
    features_weights: Any,
    *,
    global_device_count: int,
    num_sc_per_device: int,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(row_pointers, embedding_ids, sample_ids, gains)` of this device's batch (numpy)."""
    if len(features) != len(features_weights):
        raise ValueError(f"features and features_weights must have the same length, got "
                         f"{len(features)} and {len(features_weights)}.")
    ids, weights = _native_input(features, features_weights)
    batch = len(features)
    table = native.TableSpec(
        name=_NAME, vocab_size=_vocab_size(ids), embedding_dim=8,
        max_ids_per_partition=max_ids_per_partition,
        max_unique_ids_per_partition=max_unique_ids_per_partition,
    )
    width = ids.shape[1] if isinstance(ids, np.ndarray) else 1
    feature = native.FeatureSpec(name=_NAME, table=table,
                                 input_shape=(batch * global_device_count, max(width, 1)))
    topology = native.Topology(global_devices=global_device_count,
                               sc_per_device=num_sc_per_device, local_devices=1)
    plan = plan_stacking([feature], topology)
    batch_out, _ = preprocess(plan, {_NAME: ids}, None if weights is None else {_NAME: weights},
                              has_leading_dimension=False)
    return _only_stack(batch_out)


def _only_stack(batch: PreprocessedBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    (buffers,) = batch.stacks.values()
    return buffers.row_pointers, buffers.embedding_ids, buffers.sample_ids, buffers.gains



def pack_minibatches(
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    num_sc_per_device: int, num_partitions: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Minibatches' one-device buffers in the reference's minibatched layout.

    Each part has one slot per SparseCore, partition `p` of it at
    `[round8(end[p-1]), end[p])`. The result runs, per SparseCore, over the
    minibatches and then their partitions, each 8-aligned, from one global index;
    the row pointers (each SparseCore's `max(N, 8)` per minibatch) are ends
    relative to the start of the buffer. The buffers hold `len(parts)` times one
    part's entries.
    """
    size = parts[0][1].size
    slot = size // num_sc_per_device
    rows_per_sc = max(num_partitions, 8)
    embedding_ids = np.full(size * len(parts), FILLER_ID, np.int32)
    sample_ids = np.full_like(embedding_ids, FILLER_ID)
    gains = np.full(embedding_ids.shape, np.nan, np.float32)
    row_pointers: list[int] = []
    at = 0
    for sc in range(num_sc_per_device):
        at = round_up(at, 8)
        for pointers, ids, samples, weights in parts:
            ends = np.asarray(pointers).reshape(num_sc_per_device, rows_per_sc)[sc]
            start = 0
            for p in range(num_partitions):
                end = int(ends[p])
                n = end - start
                src = slice(sc * slot + start, sc * slot + end)
                embedding_ids[at:at + n] = ids[src]
                sample_ids[at:at + n] = samples[src]
                gains[at:at + n] = weights[src]
                at += n
                row_pointers.append(at)
                at = round_up(at, 8)
                start = round_up(end, 8)
            row_pointers.extend([at] * (rows_per_sc - num_partitions))
    return np.asarray(row_pointers, np.int32), embedding_ids, sample_ids, gains
