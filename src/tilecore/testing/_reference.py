"""A plain numpy oracle of host preprocessing, computed straight from the plan.

Everything is spelled out one sample and one ID at a time, in the order the
reference system defines (REFERENCE.md §2; REFERENCE_FACTS.md facts 10–12 and
17–19), without any of tilecore's packing tricks. It is slow on purpose; use it
on small batches only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..preprocessing import PreprocessStats
from ..stacking import StackingPlan, StackSpec
from ._entries import DeviceSc, Entries
from ._rows import Row, rows_of

FILLER = 2**31 - 1
"""Embedding and sample ID of alignment filler (its gain is NaN)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ReferenceStack:
    """The oracle's view of one stack.

    Attributes:
      name: the stack.
      merged: per (local device, SparseCore), every deduplicated entry (before
        dropping), sorted by (partition, local row, sample).
      occurrences: per (device, SparseCore), raw ID occurrences behind each merged
        entry (parallel to `merged`).
      kept: per (device, SparseCore), the entries that land in the buffers: merged
        entries that pass the limits and fit the COO slot.
      origins: per (device, SparseCore), `(feature, local row)` of each sample index.
      row_pointers: `[local_devices, S·max(N, 8)]`, the expected row-pointer blocks.
      max_ids_per_partition / max_unique_ids_per_partition: `[local_devices, N]`.
      required_buffer_size_per_sc: `[local_devices, S]`.
      limit_drops: raw occurrences dropped by the limits.
      overflow: merged entries that passed the limits but did not fit the slot.
      exceeds_limits: whether some partition is over a limit (tilecore raises
        unless dropping is allowed).
    """

    name: str
    merged: Mapping[DeviceSc, Entries]
    occurrences: Mapping[DeviceSc, np.ndarray]
    kept: Mapping[DeviceSc, Entries]
    origins: Mapping[DeviceSc, tuple[tuple[str, int], ...]]
    row_pointers: np.ndarray
    max_ids_per_partition: np.ndarray
    max_unique_ids_per_partition: np.ndarray
    required_buffer_size_per_sc: np.ndarray
    limit_drops: int
    overflow: int
    exceeds_limits: bool

    @property
    def id_drop_counter(self) -> int:
        """What tilecore reports: raw limit drops plus merged entries lost to overflow."""
        return self.limit_drops + self.overflow


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ReferenceResult:
    """The oracle's output for every stack, plus the statistics tilecore should report."""

    stacks: Mapping[str, ReferenceStack]
    stats: PreprocessStats

    @property
    def exceeds_limits(self) -> bool:
        return any(s.exceeds_limits for s in self.stacks.values())

    @property
    def overflows(self) -> bool:
        return any(s.overflow for s in self.stacks.values())


def row_gains(ids: np.ndarray, weights: np.ndarray | None, combiner: str) -> np.ndarray:
    """float32 gain of each raw ID occurrence of one sample (before merging duplicates).

    Unit weights: 1, `1/n` or `1/√n`. Weighted: `w`, `w/Σw` (Σw summed in float32,
    in order) or `w/√Σw²` (Σw² accumulated with a float32 fused multiply-add).
    """
    if combiner not in ("sum", "mean", "sqrtn"):
        raise ValueError(f"row_gains: combiner must be 'sum', 'mean' or 'sqrtn', got {combiner!r}.")
    if weights is not None and np.shape(weights) != np.shape(ids):
        raise ValueError(f"row_gains: {np.shape(weights)} weights for {np.shape(ids)} IDs.")
    n = len(ids)
    one = np.float32(1.0)
    if n == 0:
        return np.zeros(0, np.float32)
    if weights is None:
        if combiner == "sum":
            return np.full(n, one, np.float32)
        if combiner == "mean":
            return np.full(n, one / np.float32(n), np.float32)
        return np.full(n, one / np.sqrt(np.float32(n)), np.float32)
    w = np.asarray(weights, np.float32)
    if combiner == "sum":
        return w.copy()
    total = np.float32(0.0)
    for x in w:
        if combiner == "mean":
            total = np.float32(total + x)
        else:  # fmaf(x, x, total): x·x is exact in float64, then one rounding to float32
            total = np.float32(np.float64(x) * np.float64(x) + np.float64(total))
    if total == 0:
        raise ValueError(f"the weights {w.tolist()} of a {combiner!r} sample sum to zero")
    scale = total if combiner == "mean" else np.sqrt(total)
    return np.array([x / scale for x in w], np.float32)


def _coo_slot(stack: StackSpec, sc_per_device: int, num_partitions: int) -> int:
    suggested = stack.suggested_coo_buffer_size_per_device
    if suggested is None:
        size = _round_up(stack.max_ids_per_partition, 8) * sc_per_device * num_partitions
    else:
        size = _round_up(suggested, 8 * sc_per_device)
    return size // sc_per_device


def _merge_sc(
    plan: StackingPlan, stack: StackSpec, rows: Mapping[str, list[Row]], device: int, sc: int
) -> tuple[dict[tuple[int, int, int], list[Any]], list[tuple[str, int]]]:
    """`(partition, local row, sample) → [gain, occurrences]` in insertion order."""
    topo = plan.topology
    n = topo.num_partitions
    slice_index = device * topo.sc_per_device + sc
    merged: dict[tuple[int, int, int], list[Any]] = {}
    origins: list[tuple[str, int]] = []
    for feature in plan.stack_features(stack.name):
        setting = plan.feature_settings[feature.name]
        feature_rows = rows[feature.name]
        per_sc = len(feature_rows) // (topo.num_local_devices * topo.sc_per_device)
        assert setting.row_offset % n == 0 and len(origins) == setting.row_offset // n
        for j in range(per_sc):
            row = slice_index * per_sc + j
            origins.append((feature.name, row))
            sample = setting.row_offset // n + j
            ids, weights = feature_rows[row]
            for raw, gain in zip(ids, row_gains(ids, weights, stack.combiner), strict=True):
                i = int(raw)
                if not 0 <= i < feature.table.vocab_size:
                    raise ValueError(f"Feature {feature.name!r}: ID {i} at row {row} is invalid")
                col = (i + setting.col_shift) % n + (i - i % n) + setting.col_offset
                key = (col % n, col // n, sample)
                if key in merged:
                    merged[key][0] = np.float32(merged[key][0] + gain)
                    merged[key][1] += 1
                else:
                    merged[key] = [np.float32(gain), 1]
    return merged, origins


def _reference_stack(
    plan: StackingPlan, stack: StackSpec, rows: Mapping[str, list[Row]]
) -> ReferenceStack:
    topo = plan.topology
    n, s_per, local = topo.num_partitions, topo.sc_per_device, topo.num_local_devices
    block = max(n, 8)
    slot = _coo_slot(stack, s_per, n)
    merged_out: dict[DeviceSc, Entries] = {}
    occurrences: dict[DeviceSc, np.ndarray] = {}
    kept_out: dict[DeviceSc, Entries] = {}
    origins_out: dict[DeviceSc, tuple[tuple[str, int], ...]] = {}
    pointers = np.zeros((local, s_per * block), np.int32)
    ids = np.zeros((local, s_per, n), np.int64)
    unique = np.zeros((local, s_per, n), np.int64)
    required = np.zeros((local, s_per), np.int64)
    limit_drops = overflow = 0
    for d in range(local):
        for sc in range(s_per):
            merged, origins = _merge_sc(plan, stack, rows, d, sc)
            keys = sorted(merged)
            merged_out[d, sc] = Entries.from_tuples([(*k, merged[k][0]) for k in keys])
            occurrences[d, sc] = np.array([merged[k][1] for k in keys], np.int64)
            origins_out[d, sc] = tuple(origins)
            kept: list[tuple[int, int, int, float]] = []
            pos = 0
            for p in range(n):
                pos = _round_up(pos, 8)
                in_p = [k for k in keys if k[0] == p]
                columns = sorted({k[1] for k in in_p})
                ids[d, sc, p], unique[d, sc, p] = len(in_p), len(columns)
                required[d, sc] += _round_up(len(in_p), 8)
                for index, key in enumerate(in_p):
                    rank = columns.index(key[1])
                    if index >= stack.max_ids_per_partition or (
                        rank >= stack.max_unique_ids_per_partition
                    ):
                        limit_drops += merged[key][1]
                    elif pos >= slot:
                        overflow += 1
                    else:
                        kept.append((*key, merged[key][0]))
                        pos += 1
                pointers[d, sc * block + p] = pos
            pointers[d, sc * block + n:(sc + 1) * block] = min(_round_up(pos, 8), slot)
            kept_out[d, sc] = Entries.from_tuples(kept)
    max_ids, max_unique = ids.max(axis=1), unique.max(axis=1)
    return ReferenceStack(
        name=stack.name, merged=merged_out, occurrences=occurrences, kept=kept_out,
        origins=origins_out, row_pointers=pointers,
        max_ids_per_partition=max_ids.astype(np.int32),
        max_unique_ids_per_partition=max_unique.astype(np.int32),
        required_buffer_size_per_sc=required.astype(np.int32),
        limit_drops=limit_drops, overflow=overflow,
        exceeds_limits=bool((max_ids > stack.max_ids_per_partition).any()
                            or (max_unique > stack.max_unique_ids_per_partition).any()),
    )


def preprocess_reference(
    plan: StackingPlan, inputs: Mapping[str, Any], weights: Mapping[str, Any] | None = None
) -> ReferenceResult:
    """What `tilecore.preprocess(plan, inputs, weights)` must produce, computed plainly.

    Returns, per stack, the merged entries of every (local device, SparseCore),
    the entries kept after the limits (keep an entry iff its index in its
    partition's (local row, sample) order is < max_ids and its row's rank among
    the partition's distinct rows is < max_unique) and after the COO slot fills
    up, the expected row pointers, and the statistics (counted before dropping).
    The kept entries are what tilecore writes when `allow_id_dropping` is on, or
    when no limit is exceeded.
    """
    weights = weights or {}
    rows = {name: rows_of(name, inputs[name], weights.get(name)) for name in plan.features}
    topo = plan.topology
    for name, feature_rows in rows.items():
        expected = plan.features[name].batch_size * topo.num_local_devices // topo.global_devices
        if len(feature_rows) != expected:
            raise ValueError(f"Feature {name!r}: {len(feature_rows)} rows, expected {expected}")
    stacks = {name: _reference_stack(plan, stack, rows) for name, stack in plan.stacks.items()}
    stats = PreprocessStats(
        max_ids_per_partition={k: s.max_ids_per_partition for k, s in stacks.items()},
        max_unique_ids_per_partition={k: s.max_unique_ids_per_partition
                                      for k, s in stacks.items()},
        required_buffer_size_per_sc={k: s.required_buffer_size_per_sc for k, s in stacks.items()},
        id_drop_counters={k: s.id_drop_counter for k, s in stacks.items()},
    )
    return ReferenceResult(stacks=stacks, stats=stats)
