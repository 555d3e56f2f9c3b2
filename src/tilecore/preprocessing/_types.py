"""Inputs and outputs of host preprocessing."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Ragged:
    """Ragged IDs of one feature: sample i holds `values[row_splits[i]:row_splits[i+1]]`.

    `weights`, if given, has the shape of `values` (one float per ID).
    """

    values: np.ndarray
    row_splits: np.ndarray
    weights: np.ndarray | None = None

    @classmethod
    def from_rows(
        cls, rows: Sequence[Sequence[int]], weights: Sequence[Sequence[float]] | None = None
    ) -> Ragged:
        """Build from per-sample lists (convenient for small inputs and tests)."""
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        splits = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=splits[1:])
        values = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(splits[-1]))
        w = None
        if weights is not None:
            w = np.fromiter((x for r in weights for x in r), dtype=np.float32)
        return cls(values, splits, w)

    @property
    def num_rows(self) -> int:
        return len(self.row_splits) - 1

    def to_object_array(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The reference system's ragged form: object arrays of per-sample arrays."""
        ids = np.empty(self.num_rows, dtype=object)
        ids[:] = np.split(self.values, self.row_splits[1:-1])
        if self.weights is None:
            return ids, None
        w = np.empty(self.num_rows, dtype=object)
        w[:] = np.split(self.weights, self.row_splits[1:-1])
        return ids, w


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackBuffers:
    """One stack's packed CSR-wrapped COO buffers, per local device.

    Shapes are `[local_devices, size]` (or flat `[local_devices·size]` when
    preprocessing was asked for no leading dimension). Per device and SparseCore
    `s`: `row_pointers[s·P : (s+1)·P]` (P = max(N, 8)) holds the exclusive end of
    each partition relative to the SparseCore's COO slot; partitions start on
    multiples of 8; entries outside the pointed ranges are filler
    (`id = sample = 2³¹−1`, `gain = NaN`).

    With `enable_minibatching` (even for one minibatch) the layout is the
    reference's minibatching one: per device, `64·S` blocks of P row pointers;
    block `sc·M + mb` holds the **absolute** exclusive ends (in the device's COO
    buffer) of minibatch `mb` of SparseCore `sc`; segments are packed SparseCore-
    major then by minibatch, partitions 8-aligned; blocks past `S·M` repeat the
    last aligned end and the buffer tail holds filler.
    """

    row_pointers: np.ndarray
    embedding_ids: np.ndarray
    sample_ids: np.ndarray
    gains: np.ndarray


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessedBatch:
    """Device-ready buffers of every stack, plus the number of minibatches.

    `num_minibatches` is 1 unless `enable_minibatching` split the batch; then it
    is `popcount(split) + 1`, the same for every stack and process. `made_for` is
    the signature of the plan that packed it (`batch_signature`; None for batches
    built by hand): the device ops refuse a batch made for another plan.
    """

    stacks: Mapping[str, StackBuffers]
    num_minibatches: int = 1
    made_for: tuple[tuple[str, str], ...] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessStats:
    """What one batch needed, per stack (counted after per-sample dedupe, before dropping).

    Attributes:
      max_ids_per_partition: `[local_devices, N]`: most IDs any SparseCore of the
        device sends to each partition.
      max_unique_ids_per_partition: `[local_devices, N]`, the same for distinct IDs.
      required_buffer_size_per_sc: `[local_devices, S]`: COO entries (partitions
        padded to 8) each SparseCore needs.
      id_drop_counters: raw ID occurrences dropped per stack.
    """

    max_ids_per_partition: Mapping[str, np.ndarray]
    max_unique_ids_per_partition: Mapping[str, np.ndarray]
    required_buffer_size_per_sc: Mapping[str, np.ndarray]
    id_drop_counters: Mapping[str, int]

    @property
    def dropped_ids(self) -> int:
        """Raw ID occurrences dropped over all stacks."""
        return sum(self.id_drop_counters.values())

    def merge(self, other: PreprocessStats) -> PreprocessStats:
        """Element-wise maximum (drop counters summed): statistics of both batches."""
        if self.max_ids_per_partition.keys() != other.max_ids_per_partition.keys():
            raise ValueError(
                "Cannot merge statistics of different stacks: "
                f"{sorted(self.max_ids_per_partition)} vs {sorted(other.max_ids_per_partition)}."
            )

        def maximum(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> dict:
            return {k: np.maximum(a[k], b[k]) for k in a}

        return PreprocessStats(
            max_ids_per_partition=maximum(self.max_ids_per_partition, other.max_ids_per_partition),
            max_unique_ids_per_partition=maximum(
                self.max_unique_ids_per_partition, other.max_unique_ids_per_partition
            ),
            required_buffer_size_per_sc=maximum(
                self.required_buffer_size_per_sc, other.required_buffer_size_per_sc
            ),
            id_drop_counters={
                k: self.id_drop_counters[k] + other.id_drop_counters[k]
                for k in self.id_drop_counters
            },
        )
