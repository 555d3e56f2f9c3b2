"""A dense numpy oracle of the device ops: lookup, per-row gradients, fused update.

Computed straight from the raw ragged inputs, the specs and per-table `[vocab, dim]`
arrays, never from the packed buffers: a sample's activation is
`Σ_j gain_j · table[id_j]` over its raw IDs (duplicates included), with the
combiner's gains (REFERENCE.md §2) — sum `w`, mean `w/Σw`, sqrtn `w/√Σw²`, unit
weights when none are given. Arithmetic is float64. The only fact taken from
preprocessing is *which* (sample, ID) pairs survive the limits (dropping with
`allow_id_dropping`, or a full COO slot); that comes from the preprocessing
oracle `preprocess_reference`, and dropped pairs contribute nothing (their IDs
still count in the combiner's denominators, as on the device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..stacking import StackingPlan
from ._optimizers import reference_update
from ._reference import preprocess_reference
from ._rows import rows_of


@dataclasses.dataclass(frozen=True)
class _Occurrences:
    """Every raw ID occurrence of one feature, flattened (parallel arrays)."""

    samples: np.ndarray  # int64: the local row (sample) the ID belongs to
    ids: np.ndarray  # int64: the ID in the feature's table
    gains: np.ndarray  # float64: the combiner weight of this occurrence
    kept: np.ndarray  # bool: False if preprocessing dropped the (sample, ID) pair
    num_rows: int  # samples of the feature (this process's rows)


def combiner_gains(ids: np.ndarray, weights: np.ndarray | None, combiner: str) -> np.ndarray:
    """float64 gain of each raw ID of one sample: `w`, `w/Σw` or `w/√Σw²` (w = 1 if unweighted)."""
    w = np.ones(len(ids)) if weights is None else np.asarray(weights, np.float64)
    if combiner == "sum" or len(w) == 0:
        return w
    total = w.sum() if combiner == "mean" else np.sqrt((w * w).sum())
    if total == 0:
        raise ValueError(f"the weights {w.tolist()} of a {combiner!r} sample sum to zero")
    return w / total


def _kept_keys(plan: StackingPlan, inputs: Mapping[str, Any],
               weights: Mapping[str, Any]) -> dict[str, set[tuple[int, ...]]]:
    """Stack → `(device, SparseCore, partition, local row, sample)` of every kept entry."""
    result = preprocess_reference(plan, inputs, weights)
    return {
        name: {(d, sc, *key) for (d, sc), entries in stack.kept.items()
               for key in entries.coordinates()}
        for name, stack in result.stacks.items()
    }


def _occurrences(plan: StackingPlan, inputs: Mapping[str, Any],
                 weights: Mapping[str, Any] | None) -> dict[str, _Occurrences]:
    weights = dict(weights or {})
    kept_keys = _kept_keys(plan, inputs, weights)
    topo = plan.topology
    n, s = topo.num_partitions, topo.sc_per_device
    out = {}
    for name, feature in plan.features.items():
        setting = plan.feature_settings[name]
        kept_here = kept_keys[setting.stack_name]
        rows = rows_of(name, inputs[name], weights.get(name))
        per_sc = len(rows) // (topo.num_local_devices * s)
        samples, ids, gains, kept = [], [], [], []
        for row, (row_ids, row_weights) in enumerate(rows):
            device, sc = divmod(row // per_sc, s)
            sample = setting.row_offset // n + row % per_sc
            for i, gain in zip(row_ids, combiner_gains(row_ids, row_weights,
                                                       feature.table.combiner), strict=True):
                i = int(i)
                col = (i + setting.col_shift) % n + (i - i % n) + setting.col_offset
                samples.append(row)
                ids.append(i)
                gains.append(gain)
                kept.append((device, sc, col % n, col // n, sample) in kept_here)
        out[name] = _Occurrences(np.asarray(samples, np.int64), np.asarray(ids, np.int64),
                                 np.asarray(gains, np.float64), np.asarray(kept, bool), len(rows))
    return out


def reference_lookup(
    plan: StackingPlan,
    inputs: Mapping[str, Any],
    weights: Mapping[str, Any] | None,
    tables: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """What `lookup` must return: feature → float64 `[rows, dim]` pooled activations.

    `inputs`/`weights` are what was given to `tilecore.preprocess` (this process's
    rows); `tables` maps each table name to its `[vocab, dim]` values. Row b of a
    feature is `Σ gain·table[id]` over sample b's kept raw IDs; empty samples give 0.
    """
    missing = sorted(set(plan.tables) - set(tables))
    if missing:
        raise ValueError(f"reference_lookup: no values for tables {missing}; tables maps each "
                         f"of the plan's tables {sorted(plan.tables)} to its [vocab, dim] values.")
    out = {}
    for name, occ in _occurrences(plan, inputs, weights).items():
        table = plan.features[name].table
        values = np.asarray(tables[table.name], np.float64)
        if values.shape != (table.vocab_size, table.embedding_dim):
            raise ValueError(f"Table {table.name!r}: values of shape {values.shape}, expected "
                             f"{(table.vocab_size, table.embedding_dim)}.")
        pooled = np.zeros((occ.num_rows, table.embedding_dim))
        k = occ.kept
        np.add.at(pooled, occ.samples[k], occ.gains[k, None] * values[occ.ids[k]])
        out[name] = pooled
    return out


def reference_row_gradients(
    plan: StackingPlan,
    inputs: Mapping[str, Any],
    weights: Mapping[str, Any] | None,
    activation_grads: Mapping[str, np.ndarray],
) -> dict[str, dict[int, np.ndarray]]:
    """Table → {ID: float64 `[dim]` gradient} for every row the batch touched.

    A row's gradient is `Σ gain · activation_grad[feature][sample]` over every kept
    occurrence of it, in every feature that looks the table up. A touched row is
    listed even if its gradient is zero; untouched rows are absent.
    """
    missing = sorted(set(plan.features) - set(activation_grads))
    if missing:
        raise ValueError(f"reference_row_gradients: no activation gradients for features "
                         f"{missing}; pass one [batch, dim] array per feature of the plan.")
    out: dict[str, dict[int, np.ndarray]] = {name: {} for name in plan.tables}
    for name, occ in _occurrences(plan, inputs, weights).items():
        table = plan.features[name].table
        grads = np.asarray(activation_grads[name], np.float64).reshape(-1, table.embedding_dim)
        rows = out[table.name]
        for sample, i, gain in zip(occ.samples[occ.kept], occ.ids[occ.kept],
                                   occ.gains[occ.kept], strict=True):
            rows[int(i)] = rows.get(int(i), 0.0) + gain * grads[sample]
    return {name: dict(sorted(rows.items())) for name, rows in out.items()}


def reference_lookup_grad(
    plan: StackingPlan,
    inputs: Mapping[str, Any],
    weights: Mapping[str, Any] | None,
    tables: Mapping[str, np.ndarray],
    slots: Mapping[str, Sequence[np.ndarray]],
    activation_grads: Mapping[str, np.ndarray],
    step: int,
    *,
    clip: Mapping[str, tuple[float, float]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, ...]]]:
    """What `lookup_grad` must do, on per-table arrays: `(new tables, new slots)`.

    Each table's optimizer (`reference_update`, float64) is applied to the touched
    rows only, all of them at once with their summed gradients; every other row and
    slot is copied unchanged. `slots` maps table → its slot arrays (`[vocab, dim]`
    each, in the optimizer's `slot_names` order; tables without slots may be left
    out). `clip` maps *stack* name → (min, max), applied to updated table rows, never
    to slots (as `lookup_grad`'s `clip`). Results keep the inputs' dtypes, so
    float32 inputs are rounded to float32 after the update, like the device tables.
    """
    clip = dict(clip or {})
    unknown = sorted(set(clip) - set(plan.stacks))
    if unknown:
        raise ValueError(f"clip names unknown stacks {unknown}; stacks: {sorted(plan.stacks)}.")
    grads = reference_row_gradients(plan, inputs, weights, activation_grads)
    new_tables, new_slots = {}, {}
    for name, spec in plan.tables.items():
        table = np.array(tables[name], copy=True)
        table_slots = tuple(np.array(x, copy=True) for x in slots.get(name, ()))
        if len(table_slots) != len(spec.optimizer.slot_names):
            raise ValueError(f"Table {name!r}: {len(table_slots)} slot arrays given; its "
                             f"optimizer keeps {spec.optimizer.slot_names}.")
        touched = grads[name]
        if touched:
            rows = np.fromiter(touched, np.int64, len(touched))
            grad = np.stack([touched[int(r)] for r in rows])
            new_row, updated = reference_update(spec.optimizer, grad, table[rows],
                                                [x[rows] for x in table_slots], step)
            bounds = clip.get(plan.table_settings[name].stack_name)
            if bounds is not None:
                new_row = np.clip(new_row, bounds[0], bounds[1])
            table[rows] = new_row
            for array, value in zip(table_slots, updated, strict=True):
                array[rows] = value
        new_tables[name], new_slots[name] = table, table_slots
    return new_tables, new_slots
