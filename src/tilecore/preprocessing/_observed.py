"""Limits from observed statistics: checked against the plan, then applied.

`update_preprocessing_parameters` turns statistics into limits. Whatever their
source (a batch's `PreprocessStats`, an FDO file, a client's `load`), they are
checked first against the plan (its stacks, topology and batch sizes), so
statistics of another plan or corrupt counts are an `FdoStatsError` naming where
they came from, the stack, the field and the value, never silently applied limits
or a huge buffer allocation:

- every stack must be one of the plan's;
- widths must be the topology's: per step, `max_ids` and `max_unique_ids` hold
  one count per partition (N = global devices × SparseCores per device),
  `required_buffer_size` one per SparseCore of a device (S) and
  `id_drop_counters` one. tilecore's clients write the maximum over local
  devices (widths N, N, S, 1); the reference's layout (jax-tpu-embedding 0.2.0)
  flattens the local devices (widths L·N, L·N, L·S, 1 with L local devices);
- counts must be integers in [0, 2**31 − 1] (`check_counts`) and no larger than
  any batch of the plan can need, per stack with r = vocab_size ÷ N rows per
  partition and b = ⌈total_sample_count ÷ N⌉ samples per SparseCore:
  `max_unique_ids` ≤ r (a partition has r rows); `max_ids` ≤ b·r (IDs are
  deduplicated per sample, so a sample sends at most r IDs to a partition);
  `required_buffer_size` ≤ N·roundup8(M)·(64 with minibatching), M the largest
  `max_ids` of the same statistics (the most `coo_buffer_size_per_device`
  accepts for those limits, ÷ S), and roundup8(it) × S must stay below 2**31
  (a device's COO buffer is indexed by int32 row pointers).

A stack of the plan that the statistics lack keeps its current limits; loaded from
FDO files, with an `FdoStatsWarning` naming it (`warn_missing`).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping

import numpy as np

from ..stacking import StackingPlan, round_up
from ._errors import FdoStatsError, FdoStatsWarning
from ._limits import MINIBATCHING_FACTOR
from ._types import PreprocessStats

FIELDS = ("max_ids", "max_unique_ids", "required_buffer_size", "id_drop_counters")
"""The statistics' fields, in the order of the reference's `SparseDenseMatmulInputStats`."""

MAX_COUNT = 2**31 - 1
"""Counts are int32 on the device; a larger one is corrupt."""


def check_counts(array: np.ndarray, where: str, fix: str) -> np.ndarray:
    """`array` as int64 if it holds 0-, 1- or 2-d counts in [0, MAX_COUNT], else FdoStatsError.

    `where` names the file and key (or the table) in the message; `fix` ends it.
    """
    if not np.issubdtype(array.dtype, np.integer) or array.ndim > 2:
        raise FdoStatsError(f"{where} has dtype {array.dtype} and shape {array.shape}; expected "
                            f"0-, 1- or 2-d integers. {fix}")
    if array.ndim and array.shape[-1] == 0:
        raise FdoStatsError(f"{where} has shape {array.shape}: no values. {fix}")
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > MAX_COUNT:
            bad = low if low < 0 else high
            raise FdoStatsError(f"{where} holds the count {bad}, outside [0, {MAX_COUNT}]. {fix}")
    return array.astype(np.int64, copy=False)


def as_rows(array: np.ndarray) -> np.ndarray:
    """Checked counts as `[steps, width]`: a 0-d array is `[1, 1]`, a 1-d one `[1, width]`."""
    return array.reshape(-1, array.shape[-1] if array.ndim else 1)


Fields = Mapping[str, np.ndarray]
"""A stack's statistics: field (`max_ids`, …) → `[steps, width]` int64 counts."""

_FIX = ("The statistics come from another stacking plan or topology, or are corrupt: delete "
        "the file they came from and publish again (one base_dir per plan).")
_STATS_FIELDS = {"max_ids": "max_ids_per_partition",
                 "max_unique_ids": "max_unique_ids_per_partition",
                 "required_buffer_size": "required_buffer_size_per_sc"}
"""The fields that set limits → their `PreprocessStats` attributes."""


def check_stacks(plan: StackingPlan, stacks: Mapping[str, Fields], where: str) -> None:
    """Raise `FdoStatsError` unless every stack of `stacks` may set `plan`'s limits.

    `where` names the file (or the source) in the message. Every stack must be one
    of the plan's, with the topology's widths and counts the plan can produce.
    """
    for name, fields in stacks.items():
        if name not in plan.stacks:
            raise FdoStatsError(
                f"{where}: stack {name!r} is not one of the plan's stacks {sorted(plan.stacks)}. "
                f"{_FIX}")
        _check_widths(plan, name, fields, where)
        _check_magnitudes(plan, name, fields, where)


def warn_missing(plan: StackingPlan, present: Collection[str], where: str) -> None:
    """Warn (`FdoStatsWarning`) for each stack of `plan` not in `present`: it keeps its limits."""
    for name in sorted(set(plan.stacks) - set(present)):
        stack = plan.stacks[name]
        warnings.warn(FdoStatsWarning(
            f"{where} hold no statistics for stack {name!r} (tables {list(stack.table_names)}); "
            f"it keeps its limits max_ids_per_partition={stack.max_ids_per_partition}, "
            f"max_unique_ids_per_partition={stack.max_unique_ids_per_partition}, "
            "suggested_coo_buffer_size_per_device="
            f"{stack.suggested_coo_buffer_size_per_device}. Record and publish the statistics "
            "of every stack of the plan (one client per plan) to tune it."), stacklevel=3)


def check_stats(plan: StackingPlan, stats: PreprocessStats, where: str, *,
                warn: bool = True) -> PreprocessStats:
    """`stats` if they may set `plan`'s limits, else an `FdoStatsError` naming `where`.

    For statistics from any source (e.g. an `FdoClient.load`): each stack's three
    limit fields are checked (`check_counts`, then `check_stacks`), and with `warn`
    each stack of the plan they lack is an `FdoStatsWarning` (it keeps its limits).
    """
    checked_fields(plan, stats, where, warn=warn)
    return stats


def checked_fields(plan: StackingPlan, stats: PreprocessStats, where: str, *,
                   warn: bool = True) -> dict[str, dict[str, np.ndarray]]:
    """Each stack's limit fields of `stats` as checked int64 `[steps, width]` arrays, or an
    `FdoStatsError` naming `where` (`check_stats`). Limits are taken from these arrays,
    not from `stats`, whose values may be any array-like (e.g. lists)."""
    if not isinstance(stats, PreprocessStats):
        raise TypeError(f"{where} must be the PreprocessStats that preprocess returns (or "
                        f"an FdoClient loads), got {type(stats).__name__}.")
    stacks = {name: _fields_of(stats, name, where) for name in stats.max_ids_per_partition}
    check_stacks(plan, stacks, where)
    if warn:
        warn_missing(plan, stacks, where)
    return stacks


def _fields_of(stats: PreprocessStats, name: str, where: str) -> dict[str, np.ndarray]:
    """One stack's limit fields of `stats`, checked as counts, as `[rows, width]`."""
    fields: dict[str, np.ndarray] = {}
    for field, attribute in _STATS_FIELDS.items():
        values = getattr(stats, attribute)
        if name not in values:
            raise FdoStatsError(f"{where}: stack {name!r} has max_ids_per_partition but no "
                                f"{attribute}. {_FIX}")
        label = f"{where}: stack {name!r} ({field})"
        fields[field] = as_rows(check_counts(_as_array(values[name], label), label, _FIX))
    return fields


def _as_array(value: object, where: str) -> np.ndarray:
    """`value` (an array, or a list of counts) as a numpy array, or an `FdoStatsError`
    naming `where` when numpy cannot make one (e.g. nested lists of different lengths)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as error:
        raise FdoStatsError(f"{where} is not an array of counts ({type(value).__name__}: "
                            f"{error}). Give one list or array of integer counts per "
                            "step.") from None


def _check_widths(plan: StackingPlan, name: str, fields: Fields, where: str) -> None:
    """Widths of tilecore's layout (N, N, S, 1) or the reference's (L·N, L·N, L·S, 1)."""
    topology = plan.topology
    n, s, local = topology.num_partitions, topology.sc_per_device, topology.num_local_devices
    widths = {field: int(array.shape[-1]) for field, array in fields.items()}
    layouts = [{"max_ids": k * n, "max_unique_ids": k * n, "required_buffer_size": k * s,
                "id_drop_counters": 1} for k in sorted({1, local})]
    if any(all(width == layout[field] for field, width in widths.items()) for layout in layouts):
        return

    def listed(layout: Mapping[str, int]) -> str:
        return ", ".join(f"{field}={layout[field]}" for field in FIELDS if field in widths)

    reference = f" (or {listed(layouts[1])}, one row per local device)" if local > 1 else ""
    raise FdoStatsError(
        f"{where}: stack {name!r} has {listed(widths)} values per step, but topology {topology} "
        f"(N={n} partitions, S={s} SparseCores per device) gives {listed(layouts[0])}{reference}. "
        "The statistics were written for another topology (device count or SparseCores per "
        "device): load them with that topology's plan, or delete the file and publish again.")


def _check_magnitudes(plan: StackingPlan, name: str, fields: Fields, where: str) -> None:
    """Counts no larger than the plan's batches can need (see the module docstring)."""
    stack, n, s = plan.stacks[name], plan.topology.num_partitions, plan.topology.sc_per_device
    rows = -(-stack.vocab_size // n)
    samples = -(-stack.total_sample_count // n)
    _at_most(fields, "max_unique_ids", rows, f"the {rows} rows of a partition (vocab_size "
             f"{stack.vocab_size} ÷ N={n})", name, where)
    _at_most(fields, "max_ids", samples * rows, f"{samples} samples per SparseCore × {rows} rows "
             "per partition (IDs are deduplicated per sample)", name, where)
    most = max(1, int(fields["max_ids"].max(initial=0))) if "max_ids" in fields else 1
    minibatches = MINIBATCHING_FACTOR if plan.config.enable_minibatching else 1
    _at_most(fields, "required_buffer_size", n * round_up(most, 8) * minibatches,
             f"the largest buffer per SparseCore that max_ids up to {most} can fill: N={n} "
             f"partitions × roundup8({most})"
             + (f" × {minibatches} minibatches" if minibatches > 1 else ""), name, where)
    _at_most(fields, "required_buffer_size", MAX_COUNT // (8 * s) * 8, "the most whose device "
             f"buffer (roundup8 × S={s} SparseCores) int32 offsets can index", name, where)


def _at_most(fields: Fields, field: str, bound: int, why: str, name: str, where: str) -> None:
    """Raise `FdoStatsError` naming the first count of `field` above `bound`."""
    array = fields.get(field)
    if array is None:
        return
    over = np.argwhere(array > bound)
    if over.size:
        step, column = (int(i) for i in over[0])
        raise FdoStatsError(
            f"{where}: stack {name!r} {field} holds {int(array[step, column])} (step {step}, "
            f"column {column}), more than {bound}: {why}. No batch of this plan needs that. {_FIX}")


def update_preprocessing_parameters(plan: StackingPlan, stats: PreprocessStats) -> StackingPlan:
    """A plan whose stack limits are the maxima observed in `stats`.

    `max_ids_per_partition` and `max_unique_ids_per_partition` become the largest
    observed counts (at least 1); the suggested COO buffer becomes the largest
    per-SparseCore requirement × SparseCores per device; stacks the statistics do
    not name keep their limits. In a multi-process job, merge the statistics of all
    processes first so every process agrees. Statistics that cannot be this plan's
    (another plan's stacks or topology, negative or impossible counts) raise
    `FdoStatsError` (`check_stats`) before any limit changes.
    """
    stacks = checked_fields(plan, stats, "update_preprocessing_parameters: the statistics",
                            warn=False)
    s = plan.topology.sc_per_device
    for name, fields in stacks.items():
        plan = plan.with_stack_limits(
            name,
            max_ids_per_partition=max(1, int(fields["max_ids"].max(initial=0))),
            max_unique_ids_per_partition=max(1, int(fields["max_unique_ids"].max(initial=0))),
            suggested_coo_buffer_size_per_device=max(
                8 * s, int(fields["required_buffer_size"].max(initial=0)) * s
            ),
        )
    return plan
