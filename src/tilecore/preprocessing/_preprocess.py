"""Host preprocessing entry point: inputs of every feature → per-stack packed buffers."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ..specs import FeatureSpec, Topology
from ..specs._numbers import is_integer
from ..stacking import StackingPlan
from . import _kernels as k
from ._agreement import Agreement, LocalAgreement
from ._buffers import allocate
from ._errors import IdDroppingWarning
from ._highway import NUM_BUCKETS
from ._input_errors import raise_input_error
from ._inputs import Csr, checked_names, to_csr
from ._layout import PlanLayout, StackPreprocessing, plan_layout
from ._limits import check_limits, coo_buffer_size_per_device
from ._minibatching import Sorted, StackKeys, StackPacking, keep_sorted, pack_minibatches
from ._packed import align_up
from ._scratch import scratch
from ._threads import pool, resolve_num_threads
from ._types import PreprocessedBatch, PreprocessStats, Ragged, StackBuffers

FeatureInput = Ragged | np.ndarray | Any
"""A `Ragged`, a dense 2-D integer array, an object array of 1-D arrays, or a
scipy.sparse matrix of shape (samples, vocab) whose data are the weights."""

_NO_WEIGHTS = np.zeros(0, np.float32)
_BAD_ID = -1


@dataclasses.dataclass(frozen=True)
class _StackJob:
    """One stack's share of this batch: the plan's layout of it, this batch's inputs,
    and the arrays its tasks (one per local SparseCore) write."""

    layout: StackPreprocessing
    csrs: tuple[Csr, ...]
    """The inputs of `layout.features`, in that order."""
    weighted: bool
    minibatching: bool
    buffers: StackBuffers
    counts: np.ndarray
    """[2, local devices, S, N] int64: the IDs and distinct IDs each SparseCore sends to
    each partition (before dropping); the task of SparseCore (d, s) fills [:, d, s]."""
    packed_ends: np.ndarray
    """[local devices, S] with minibatching: the aligned end of each SparseCore's
    pass-1 packing once it is known to sit where `_compact` puts it, else -1."""
    keys: StackKeys
    """The stack's key layout and limits, as minibatching takes them."""


@dataclasses.dataclass(frozen=True)
class _TaskResult:
    error: tuple[int, FeatureSpec, Csr, int] | None
    required: int = 0
    dropped: int = 0
    overflow: int = 0
    sorted: Sorted | None = None


def _make_job(layout: StackPreprocessing, csrs: tuple[Csr, ...], topology: Topology,
              minibatching: bool) -> _StackJob:
    rows, eids, sids, gains = allocate(layout.buffers)
    local, s = topology.num_local_devices, topology.sc_per_device
    return _StackJob(
        layout=layout, csrs=csrs, weighted=any(csr.weights is not None for csr in csrs),
        minibatching=minibatching,
        buffers=StackBuffers(row_pointers=rows, embedding_ids=eids, sample_ids=sids, gains=gains),
        counts=np.zeros((2, local, s, topology.num_partitions), np.int64),
        packed_ends=np.full((local, s), -1, np.int64),
        keys=StackKeys(layout.rowbits, layout.log2n, layout.stack.vocab_size,
                       layout.stack.max_ids_per_partition,
                       layout.stack.max_unique_ids_per_partition),
    )


def _run_task(job: _StackJob, device: int, sc: int, num_partitions: int, sc_per_device: int
              ) -> _TaskResult:
    """Count, sort, merge and pack one SparseCore's entries of one stack."""
    layout, weighted = job.layout, job.weighted
    slice_index = device * sc_per_device + sc
    hist = scratch("hist", layout.passes << layout.digit_bits, np.int32).reshape(layout.passes, -1)
    hist.fill(0)
    failed = _count(job, slice_index, hist)
    if failed is not None:
        return failed
    cursor = scratch("cursor", hist.shape[1], np.int64)
    total = k.prefix_sums(hist[0], cursor)
    entries, gains, sample_gains, entries2, gains2 = _sort_buffers(layout, total, weighted)
    failed = _stage(job, slice_index, cursor, entries, gains, sample_gains)
    if failed is not None:
        return failed
    for p in range(1, layout.passes):
        k.radix_pass(entries, gains, entries2, gains2, weighted, p * layout.digit_bits,
                     layout.digit_bits, hist[p])
        entries, gains, entries2, gains2 = entries2, gains2, entries, gains
    return _emit(job, device, sc, num_partitions, sc_per_device, entries, gains, sample_gains)


def _count(job: _StackJob, slice_index: int, hist: np.ndarray) -> _TaskResult | None:
    """The first radix digit's histogram of the SparseCore's entries into `hist`; the
    first out-of-vocabulary ID as a failed result."""
    layout = job.layout
    for part, csr in zip(layout.features, job.csrs, strict=True):
        r0 = slice_index * part.rows_per_sc
        bad = k.count(csr.values, csr.splits, r0, r0 + part.rows_per_sc,
                      part.feature.table.vocab_size, part.shift, part.col_offset, layout.log2n,
                      layout.rowbits, layout.digit_bits, layout.passes, hist)
        if bad >= 0:
            return _TaskResult((_BAD_ID, part.feature, csr, bad))
    return None


def _stage(job: _StackJob, slice_index: int, cursor: np.ndarray, entries: np.ndarray,
           gains: np.ndarray, sample_gains: np.ndarray) -> _TaskResult | None:
    """The SparseCore's entries (and their gains) into place by the first digit; the
    first non-finite weight or zero weight sum as a failed result."""
    layout, weighted = job.layout, job.weighted
    for part, csr in zip(layout.features, job.csrs, strict=True):
        r0 = slice_index * part.rows_per_sc
        weights = csr.weights
        if weighted and weights is None:
            weights = np.ones(len(csr.values), np.float32)
        code, where = k.stage(
            csr.values, csr.splits, _NO_WEIGHTS if weights is None else weights,
            weighted, csr.width, r0, r0 + part.rows_per_sc, part.sample_base, part.shift,
            part.col_offset, layout.log2n, layout.rowbits, layout.digit_bits, layout.combiner,
            cursor, entries, gains, sample_gains,
        )
        if code != k.OK:
            return _TaskResult((code, part.feature, csr, where))
    return None


def _emit(job: _StackJob, device: int, sc: int, n: int, sc_per_device: int,
          entries: np.ndarray, gains: np.ndarray, sample_gains: np.ndarray) -> _TaskResult:
    """Merge the sorted entries and pack them into the SparseCore's part of the buffers
    (with minibatching: speculatively, keeping what pass 2 may need)."""
    layout, weighted = job.layout, job.weighted
    ids, unique = job.counts[0, device, sc], job.counts[1, device, sc]
    b = job.buffers
    start, packed = sc * layout.slot, False
    if job.minibatching:
        # Pass 1's packing is speculative: this SparseCore's only minibatch goes
        # right after the previous SparseCore's if that one is packed already, else
        # to its own slot, moved there later if no split is needed
        # (`pack_minibatches`). Past a limit a split is certain: packing stops and
        # the sorted entries are kept, bucketed, for pass 2 instead.
        block = b.row_pointers.shape[1] // (NUM_BUCKETS * sc_per_device)
        previous = int(job.packed_ends[device, sc - 1]) if sc else 0
        start, packed = (previous, True) if previous >= 0 else (start, False)
    else:
        block = b.row_pointers.shape[1] // sc_per_device
    slot = slice(start, start + layout.slot)
    row_pointers = b.row_pointers[device, sc * block:(sc + 1) * block]
    stack = layout.stack
    required, dropped, overflow = k.emit(
        entries, gains, weighted, sample_gains, layout.combiner, layout.rowbits, n,
        stack.max_ids_per_partition, stack.max_unique_ids_per_partition,
        b.embedding_ids[device, slot], b.sample_ids[device, slot], b.gains[device, slot],
        row_pointers, ids, unique, job.minibatching,
    )
    if job.minibatching:
        end = int(row_pointers[n - 1]) if n else 0
        if packed and required >= 0 and not overflow:
            job.packed_ends[device, sc] = align_up(start + end)
        sorted_entries = keep_sorted(
            entries=entries, gains=gains, weighted=weighted, sample_gains=sample_gains,
            combiner=layout.combiner, ids=ids, unique=unique, start=start, end=end,
            fits_slot=not overflow, exceeded=required < 0, keys=job.keys)
        if required < 0:
            required = int(align_up(ids).sum())
        return _TaskResult(None, int(required), sorted=sorted_entries)
    return _TaskResult(None, int(required), int(dropped), int(overflow))


def _sort_buffers(layout: StackPreprocessing, total: int, weighted: bool) -> list[np.ndarray]:
    """(entries, gains, sample_gains, entries2, gains2): the radix sort's ping-pong
    arrays, per-thread scratch (cache-warm: every task of the thread reuses them).
    With minibatching, what pass 2 may need of them is kept by `keep_sorted`."""
    n_gains = total if weighted else 0
    return [
        scratch("entries", total, np.uint64), scratch("gains", n_gains, np.float32),
        scratch("sample_gains", 0 if weighted else layout.samples_per_sc, np.float32),
        scratch("entries2", total if layout.passes > 1 else 0, np.uint64),
        scratch("gains2", n_gains if layout.passes > 1 else 0, np.float32),
    ]


def _task_size(job: _StackJob, device: int, sc: int, sc_per_device: int) -> int:
    slice_index = device * sc_per_device + sc
    return sum(
        int(csr.splits[(slice_index + 1) * p.rows_per_sc] - csr.splits[slice_index * p.rows_per_sc])
        for p, csr in zip(job.layout.features, job.csrs, strict=True)
    )


def _feature_csr(plan: StackingPlan, layout: PlanLayout, feature: FeatureSpec,
                 inputs: Mapping[str, Any], weights: Mapping[str, Any], threads: int) -> Csr:
    """One feature's validated CSR rows, checked against the rows the plan expects."""
    csr = to_csr(feature, inputs[feature.name], weights.get(feature.name), num_threads=threads)
    expected = layout.local_rows[feature.name]
    if csr.num_rows != expected:
        raise ValueError(
            f"Feature {feature.name!r}: got {csr.num_rows} rows, expected {expected} (its global "
            f"batch {feature.batch_size} × {plan.topology.num_local_devices} local ÷ "
            f"{plan.topology.global_devices} global devices)."
        )
    return csr


def _check_ids_per_sample(plan: StackingPlan, csrs: Mapping[str, Csr]) -> None:
    limit = plan.config.max_ids_per_chip_per_sample
    if limit is None:
        return
    by_rows: dict[int, list[str]] = {}
    for name, csr in csrs.items():
        by_rows.setdefault(csr.num_rows, []).append(name)
    for names in by_rows.values():
        per_sample = np.zeros(len(csrs[names[0]].splits) - 1, np.int64)
        for name in names:
            per_sample += np.diff(csrs[name].splits)
        worst = int(np.argmax(per_sample))
        if per_sample[worst] > limit:
            parts = {name: int(np.diff(csrs[name].splits)[worst]) for name in names}
            raise ValueError(
                f"Sample {worst} has {per_sample[worst]} IDs over features {parts}, above "
                f"max_ids_per_chip_per_sample={limit}. Raise the limit in SparseCoreConfig "
                "or set it to None."
            )


def _check_buffers(plan: StackingPlan, stats: PreprocessStats, overflow: Mapping[str, int]) -> None:
    for name, stack in plan.stacks.items():
        if overflow[name]:
            required = int(stats.required_buffer_size_per_sc[name].max())
            raise ValueError(
                f"Stack {name!r}: a SparseCore needs {required} COO entries but the buffer holds "
                f"{coo_buffer_size_per_device(stack, plan.topology, enable_minibatching=plan.config.enable_minibatching) // plan.topology.sc_per_device}"
                f" per SparseCore (suggested_coo_buffer_size_per_device="
                f"{stack.suggested_coo_buffer_size_per_device}). Raise it (e.g. "
                "tilecore.update_preprocessing_parameters) or leave it None."
            )


def check_counts(plan: StackingPlan, stats: PreprocessStats, overflow: Mapping[str, int], *,
                 minibatched: bool, stacklevel: int) -> None:
    """Act on a batch's counts: raise `LimitExceededError` (unless minibatching split the
    batch to fit) or the buffer error, or, with dropping allowed, warn that IDs were
    dropped (`stacklevel` is the warning's, counted from this function). The device path
    calls it with the counts the device made."""
    if not plan.config.allow_id_dropping:
        if not minibatched:
            # Nothing is dropped when the call raises: report the counts, not the drops.
            check_limits(plan, dataclasses.replace(
                stats, id_drop_counters=dict.fromkeys(stats.id_drop_counters, 0)))
        _check_buffers(plan, stats, overflow)
    elif stats.dropped_ids:
        dropped = {name: c for name, c in stats.id_drop_counters.items() if c}
        warnings.warn(
            IdDroppingWarning(
                f"Dropped IDs over the limits (allow_id_dropping=True): {dropped}. Raise the "
                "limits with tilecore.update_preprocessing_parameters(plan, stats) to keep them."
            ),
            stacklevel=stacklevel,
        )


def preprocess(
    plan: StackingPlan,
    inputs: Mapping[str, FeatureInput],
    weights: Mapping[str, Any] | None = None,
    *,
    has_leading_dimension: bool = True,
    num_threads: int | None = None,
    batch_number: int = 0,
    agreement: Agreement | None = None,
) -> tuple[PreprocessedBatch, PreprocessStats]:
    """Partition, sort, merge and pack one batch of sparse inputs for every stack.

    Args:
      plan: the stacking plan (its stacks' limits size the buffers; its config
        decides whether IDs over the limits are dropped or raise).
      inputs: feature name → this process's rows of that feature (the global batch
        of its FeatureSpec × local devices ÷ global devices).
      weights: optional feature name → per-ID weights shaped like the IDs.
      has_leading_dimension: buffers shaped `[local_devices, size]` (True) or flat.
      num_threads: worker threads; default $TILECORE_NUM_THREADS, else the CPU count
        (at most one thread per 65,536 of the batch's possible IDs).
      batch_number: the batch's number, identical on every process (minibatching
        agrees on its split per batch).
      agreement: how processes agree on minibatching (`tilecore.distributed`
        provides one over JAX's distributed runtime); default `LocalAgreement()`
        for a single-process plan. Only used with `enable_minibatching`.

    Returns:
      The packed buffers and the batch's statistics (counted before any dropping;
      with minibatching, those of the whole batch, before it is split).

    Raises:
      ValueError / TypeError: malformed inputs (names, shapes, dtypes, IDs outside
        the vocabulary, non-finite weights), naming the feature and the value.
      LimitExceededError: a partition exceeds its limits and dropping is off
        (with minibatching: one hash bucket alone exceeds them).
    """
    weights = checked_names(plan.features, inputs, weights)
    # A key of the processes' agreement, alike everywhere.
    if not is_integer(batch_number) or not 0 <= batch_number < 2**63:
        raise ValueError(f"batch_number must be an integer in [0, 2**63), got {batch_number!r}.")
    topo = plan.topology
    layout = plan_layout(plan)
    threads = resolve_num_threads(num_threads, max_ids=layout.max_ids)
    if plan.config.enable_minibatching:
        agreement = _resolve_agreement(plan, agreement)
    s, local = topo.sc_per_device, topo.num_local_devices
    executor = pool(threads) if threads > 1 else None
    jobs, results = _run_stacks(plan, layout, inputs, weights, threads, executor)
    for result in results:
        if result.error is not None:
            raise_input_error(*result.error)
    stats, overflow = _collect_stats(jobs, results, local, s)
    num_minibatches = 1
    if plan.config.enable_minibatching:
        assert agreement is not None  # resolved above
        num_minibatches, stats, overflow = _pack_minibatches(
            plan, jobs, results, stats, agreement, batch_number, executor)
    check_counts(plan, stats, overflow, minibatched=plan.config.enable_minibatching,
                 stacklevel=3)
    stacks = {job.layout.stack.name: job.buffers for job in jobs}
    if not has_leading_dimension:
        stacks = {
            name: StackBuffers(**{f.name: getattr(b, f.name).reshape(-1)
                                  for f in dataclasses.fields(b)})
            for name, b in stacks.items()
        }
    return PreprocessedBatch(stacks=stacks, num_minibatches=num_minibatches,
                             made_for=layout.signature(plan)), stats


def _run_stacks(plan: StackingPlan, layout: PlanLayout, inputs: Mapping[str, FeatureInput],
                weights: Mapping[str, Any], threads: int, executor: ThreadPoolExecutor | None
                ) -> tuple[list[_StackJob], list[_TaskResult]]:
    """Every stack's job and its tasks' results (one task per local device and SparseCore).

    Stack by stack: convert the stack's inputs (Python-bound, holds the GIL), then hand
    its tasks to the workers, which sort and pack (GIL released) while the next stack's
    inputs are converted; without an executor the tasks run here, after the conversions.
    """
    topo = plan.topology
    n, s, local = topo.num_partitions, topo.sc_per_device, topo.num_local_devices

    def run(task: tuple[_StackJob, int, int]) -> _TaskResult:
        return _run_task(task[0], task[1], task[2], n, s)

    csrs: dict[str, Csr] = {}
    jobs: list[_StackJob] = []
    tasks: list[tuple[_StackJob, int, int]] = []
    futures: dict[int, Future[_TaskResult]] = {}
    try:
        for name in plan.stacks:
            features = layout.stack_features[name]
            for feature in features:
                csrs[feature.name] = _feature_csr(plan, layout, feature, inputs, weights, threads)
            job = _make_job(layout.stack(plan, name), tuple(csrs[f.name] for f in features),
                            topo, plan.config.enable_minibatching)
            jobs.append(job)
            first = len(tasks)
            tasks.extend((job, d, sc) for d in range(local) for sc in range(s))
            if executor is not None:  # largest first, so no worker ends with a big one
                for i in sorted(range(first, len(tasks)),
                                key=lambda i: -_task_size(*tasks[i], sc_per_device=s)):
                    futures[i] = executor.submit(run, tasks[i])
        _check_ids_per_sample(plan, csrs)
    except BaseException:
        wait(futures.values())  # workers write into this call's buffers: let them finish
        raise
    if executor is None:
        return jobs, [run(t) for t in tasks]
    return jobs, [futures[i].result() for i in range(len(tasks))]


def _resolve_agreement(plan: StackingPlan, agreement: Agreement | None) -> Agreement:
    topo = plan.topology
    if agreement is None:
        if topo.num_local_devices != topo.global_devices:
            raise ValueError(
                f"Minibatching in a multi-process job (topology {topo}: "
                f"{topo.num_local_devices} of {topo.global_devices} devices are local) needs "
                "every process to agree on the split: pass agreement=... from "
                "tilecore.distributed to tilecore.preprocess."
            )
        return LocalAgreement()
    if isinstance(agreement, type) or not isinstance(agreement, Agreement):
        raise TypeError(
            f"agreement must implement tilecore.preprocessing.Agreement (process_count and "
            f"all_reduce_or), got {type(agreement).__name__}."
        )
    processes = topo.global_devices // topo.num_local_devices
    if agreement.process_count < processes:
        # Processes that split their rows alone pick different minibatch counts: their
        # collectives would then wait for each other forever.
        raise ValueError(
            f"The plan's topology {topo} spans {processes} process(es) but the agreement "
            f"({type(agreement).__name__}) speaks for {agreement.process_count}: every process "
            "must agree on the minibatch split. Pass a tilecore.distributed."
            "DistributedAgreement built on every process of the job.")
    return agreement


def _pack_minibatches(
    plan: StackingPlan, jobs: list[_StackJob], results: list[_TaskResult],
    stats: PreprocessStats, agreement: Agreement, batch_number: int,
    executor: ThreadPoolExecutor | None,
) -> tuple[int, PreprocessStats, dict[str, int]]:
    """Split and pack every stack (pass 2); the stats gain the drops."""
    per_stack = plan.topology.num_local_devices * plan.topology.sc_per_device
    packings = []
    for j, job in enumerate(jobs):
        merged = [r.sorted for r in results[j * per_stack:(j + 1) * per_stack]]
        assert all(m is not None for m in merged)
        layout, stack = job.layout, job.layout.stack
        packings.append(StackPacking(
            name=stack.name, tables=stack.table_names, keys=job.keys, buffers=job.buffers,
            slot=layout.slot, sorted=[m for m in merged if m is not None],
        ))

    def parallel_map(fn: Any, items: Any) -> list[Any]:
        items = list(items)
        if executor is None or len(items) < 2:
            return [fn(x) for x in items]
        return list(executor.map(fn, items))

    num_minibatches, dropped, overflow = pack_minibatches(
        packings, sc_per_device=plan.topology.sc_per_device,
        allow_id_dropping=plan.config.allow_id_dropping, agreement=agreement,
        batch_number=batch_number, stats=stats, parallel_map=parallel_map)
    drops = {name: dropped[name] + overflow[name] for name in dropped}
    return num_minibatches, dataclasses.replace(stats, id_drop_counters=drops), overflow


def _collect_stats(jobs: list[_StackJob], results: list[_TaskResult], local: int, s: int
                   ) -> tuple[PreprocessStats, dict[str, int]]:
    max_ids, max_unique, required, drops, overflow = {}, {}, {}, {}, {}
    per_stack = local * s
    for j, job in enumerate(jobs):
        chunk = results[j * per_stack:(j + 1) * per_stack]
        name = job.layout.stack.name
        max_ids[name] = job.counts[0].max(1).astype(np.int32)
        max_unique[name] = job.counts[1].max(1).astype(np.int32)
        required[name] = np.array([r.required for r in chunk], np.int32).reshape(local, s)
        drops[name] = sum(r.dropped + r.overflow for r in chunk)
        overflow[name] = sum(r.overflow for r in chunk)
    stats = PreprocessStats(
        max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique,
        required_buffer_size_per_sc=required, id_drop_counters=drops,
    )
    return stats, overflow
