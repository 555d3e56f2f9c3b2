"""Auto-tuning of limits: start from heuristics, observe with dropping allowed, settle."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Mapping

from ..preprocessing import (
    FeatureInput,
    IdDroppingWarning,
    PreprocessStats,
    preprocess,
    update_preprocessing_parameters,
)
from ..stacking import StackingPlan, round_up
from ._client import FdoClient

Batch = Mapping[str, FeatureInput]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackLimits:
    """One stack's limits (the fields of `StackSpec` that FDO tunes)."""

    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    suggested_coo_buffer_size_per_device: int | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneReport:
    """What `tune_limits` did.

    Attributes:
      rounds: passes over the batches (the last one dropped nothing).
      drops_per_round: raw IDs dropped in each round, over all batches and stacks.
      initial_limits: stack → the heuristic limits the first round used.
      limits: stack → the final limits (those of the returned plan).
    """

    rounds: int
    drops_per_round: tuple[int, ...]
    initial_limits: Mapping[str, StackLimits]
    limits: Mapping[str, StackLimits]


def limits_of(plan: StackingPlan) -> dict[str, StackLimits]:
    """Every stack's current limits."""
    return {
        name: StackLimits(
            max_ids_per_partition=s.max_ids_per_partition,
            max_unique_ids_per_partition=s.max_unique_ids_per_partition,
            suggested_coo_buffer_size_per_device=s.suggested_coo_buffer_size_per_device,
        )
        for name, s in plan.stacks.items()
    }


def heuristic_limits(plan: StackingPlan) -> StackingPlan:
    """A plan with the starting limits of the limit guide, per stack.

    With `b` the stack's samples per SparseCore (its features' global batches ÷
    N partitions): `max_ids_per_partition = ⌈0.4·b⌉`, `max_unique_ids_per_partition
    = ⌈0.1·b⌉`, and a COO buffer of `⌈0.4·b⌉` per SparseCore; each at least 8.
    """
    n, s = plan.topology.num_partitions, plan.topology.sc_per_device
    for name in plan.stacks:
        b = sum(f.batch_size // n for f in plan.stack_features(name))
        max_ids = max(8, math.ceil(0.4 * b))
        plan = plan.with_stack_limits(
            name, max_ids_per_partition=max_ids,
            max_unique_ids_per_partition=max(8, math.ceil(0.1 * b)),
            suggested_coo_buffer_size_per_device=max_ids * s,
        )
    return plan


def with_headroom(plan: StackingPlan, headroom: float) -> StackingPlan:
    """Every stack's limits and suggested buffer grown by the `headroom` fraction.

    Rounded up (100 with 10 % headroom gives 110, never 111); the buffer never grows
    past what the grown `max_ids_per_partition` can fill. The one headroom rule:
    `tune_limits` and `tilecore limits` both use it.
    """
    if not (math.isfinite(headroom) and headroom >= 0):
        raise ValueError(f"headroom must be a fraction >= 0, got {headroom!r}.")
    if headroom == 0:
        return plan
    n, s = plan.topology.num_partitions, plan.topology.sc_per_device

    def grow(value: int) -> int:  # the epsilon keeps e.g. 100·1.1 at 110
        return math.ceil(value * (1 + headroom) - 1e-9)

    for name, stack in plan.stacks.items():
        max_ids = grow(stack.max_ids_per_partition)
        coo = stack.suggested_coo_buffer_size_per_device
        plan = plan.with_stack_limits(
            name, max_ids_per_partition=max_ids,
            max_unique_ids_per_partition=grow(stack.max_unique_ids_per_partition),
            suggested_coo_buffer_size_per_device=(
                None if coo is None else min(grow(coo), round_up(max_ids, 8) * s * n)),
        )
    return plan


def _observe(plan: StackingPlan, batches: list[Batch], client: FdoClient | None,
             num_threads: int | None) -> tuple[PreprocessStats, int]:
    merged: PreprocessStats | None = None
    dropped = 0
    for batch in batches:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IdDroppingWarning)
            _, stats = preprocess(plan, batch, num_threads=num_threads)
        if client is not None:
            client.record(stats)
        dropped += stats.dropped_ids
        merged = stats if merged is None else merged.merge(stats)
    assert merged is not None
    return merged, dropped


def tune_limits(
    plan: StackingPlan,
    batches: Iterable[Batch],
    *,
    rounds: int = 4,
    headroom: float = 0.0,
    client: FdoClient | None = None,
    barrier: Callable[[], None] | None = None,
    num_threads: int | None = None,
) -> tuple[StackingPlan, TuneReport]:
    """Limits under which `batches` preprocess without dropping, found by observation.

    Starts from `heuristic_limits(plan)`; each round preprocesses every batch with
    `allow_id_dropping=True` (its `IdDroppingWarning`s silenced), merges the
    statistics (element-wise max), applies `update_preprocessing_parameters`, then
    grows each limit by the `headroom` fraction (rounded up). It stops after the
    first round that dropped nothing and raises if `rounds` pass without one.

    With a `client`, every batch's statistics are recorded into it, and each round
    publishes them, calls `barrier` (e.g. `jax.experimental.multihost_utils.
    sync_global_devices`, required with several processes) and updates from
    `client.load_for(plan)`, the maximum over every process — so all processes
    agree. Use an empty `base_dir`: files already there take part in the maximum,
    and one of another plan or topology, or corrupt, is an `FdoStatsError`.

    Returns the tuned plan (with `plan`'s own config) and a `TuneReport`.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("tune_limits: no batches given; pass at least one batch of inputs.")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"tune_limits: rounds must be an integer >= 1, got {rounds=}.")
    if not (math.isfinite(headroom) and headroom >= 0):
        raise ValueError(f"tune_limits: headroom must be a fraction >= 0, got {headroom=}.")
    work = heuristic_limits(plan.with_config(allow_id_dropping=True))
    initial = limits_of(work)
    drops: list[int] = []
    while len(drops) < rounds:
        stats, dropped = _observe(work, batches, client, num_threads)
        drops.append(dropped)
        if client is not None:
            client.publish()
            if barrier is not None:
                barrier()
            stats = client.load_for(work)
        work = with_headroom(update_preprocessing_parameters(work, stats), headroom)
        if dropped == 0:
            break
    else:
        raise RuntimeError(
            f"tune_limits: IDs were still dropped after {rounds} rounds ({drops=}); "
            "pass a larger `rounds`."
        )
    tuned = dataclasses.replace(work, config=plan.config)
    report = TuneReport(rounds=len(drops), drops_per_round=tuple(drops),
                        initial_limits=initial, limits=limits_of(tuned))
    return tuned, report
