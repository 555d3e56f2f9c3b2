"""Minibatching: agree on a split of the batch, then pack every stack's minibatches.

Pass 1 (in `_preprocess`) sorted and counted each SparseCore's entries and packed
them speculatively as one minibatch (merging duplicates), right after the previous
SparseCore's when that one had finished, else into the SparseCore's fixed slot; it
keeps only what the packing lacks (`keep_sorted`): nothing when the packing holds
them all, else the sorted entries themselves (taken over from the thread's scratch,
not copied), and past a limit, where a split is certain, their buckets too. If no
partition of any stack exceeds its limits on any process (`Agreement`, round
"required"), the packings are only moved together (`_compact`). Otherwise pass 2
buckets the entries pass 1 did not (read back from the packing where it holds them
all) by a hash of their row, computes each partition's 63-bit split of the 64
buckets, ORs the splits over SparseCores, devices, stacks and processes (round
"split") and writes the entries into `popcount(split) + 1` minibatches of
contiguous buckets: where nothing is dropped, each merged entry straight to its
place from sorted order (`mk.scatter_pack`, the one packing of those entries).
Either way the device buffers get the minibatching layout (REFERENCE §3): per
device, segments packed SparseCore-major then by minibatch, partitions 8-aligned,
row pointers absolute.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _minibatch_kernels as mk
from ._agreement import Agreement
from ._bucket_memo import bucket_memo
from ._buffers import allocate
from ._errors import LimitExceededError, PeerPreprocessingError
from ._highway import NUM_BUCKETS, bucket_state
from ._kernels import SUM
from ._packed import FILLER_GAIN, FILLER_ID, align_up
from ._scratch import detach, scratch
from ._types import PreprocessStats, StackBuffers

_NO_GAINS = np.zeros(0, np.float32)


@functools.cache
def _bucket_state() -> np.ndarray:
    """The bucket hash's state after its key, made on first use: it is a numba call, and
    the first one in a process costs numba's start-up (0.3 to 0.5 s), which a process
    that imports tilecore and never minibatches (`tilecore --help`, a checkpoint export)
    need not pay."""
    return np.array(bucket_state(), np.uint64)


@dataclasses.dataclass(frozen=True, eq=False)
class Entries:
    """One SparseCore's entries of one stack in (partition, row, sample) order, as
    `_kernels.emit` takes them: duplicates not merged yet (the packing kernels merge
    them as they write), gains per entry when `weighted`, else per sample."""

    entries: np.ndarray
    gains: np.ndarray
    weighted: bool
    sample_gains: np.ndarray
    combiner: int


@dataclasses.dataclass(frozen=True, eq=False)
class Bucketed:
    """Each distinct row's bucket (in entry order), the `[2, N, 64]` per-(partition,
    bucket) counts of merged entries and of distinct rows, and the split those counts
    need."""

    row_buckets: np.ndarray
    counts: np.ndarray
    mask: int


@dataclasses.dataclass(frozen=True, eq=False)
class Sorted:
    """One SparseCore's pass 1 of one stack: its per-partition counts and where its
    speculative packing starts in the device buffer and ends in its slot.

    `in_slot`: the packing holds every merged entry (nothing was cut off by the end
    of the slot, no limit exceeded); the entries were let go (`_entries_of` reads them
    back). Otherwise `entries` are kept, and past a limit (the packing abandoned, a
    split certain) `bucketed` too.
    """

    ids: np.ndarray
    unique: np.ndarray
    start: int
    end: int
    in_slot: bool
    entries: Entries | None = None
    bucketed: Bucketed | None = None


@dataclasses.dataclass(frozen=True)
class StackKeys:
    """How one stack's entry keys are laid out (`rowbits`, `log2n`; `vocab_size`
    columns, the bucket memo's extent) and limited per partition."""

    rowbits: int
    log2n: int
    vocab_size: int
    max_ids: int
    max_unique: int


@dataclasses.dataclass(frozen=True)
class StackPacking:
    """What packing one stack needs: its limits, buffers and per-SparseCore entries."""

    name: str
    tables: tuple[str, ...]
    keys: StackKeys
    buffers: StackBuffers
    slot: int
    sorted: Sequence[Sorted]


@dataclasses.dataclass(frozen=True)
class _Grouping:
    """Each row's bucket, the buckets' minibatches and the per-(partition, bucket)
    merged-entry counts: where `mk.scatter_pack` puts each merged entry."""

    row_buckets: np.ndarray
    mb_of_bucket: np.ndarray
    ids_pb: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Segments:
    """One SparseCore's entries by (minibatch, partition) segment, `counts` `[M, N]`
    merged entries each. `within_limits`: no segment exceeds a limit (packing drops
    nothing). With `grouping` the entries are still in sorted order, regrouped as
    they are written (one pass fewer); without, grouped already."""

    entries: Entries
    counts: np.ndarray
    within_limits: bool
    grouping: _Grouping | None = None


Map = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]


def is_required(stacks: Sequence[StackPacking], stats: PreprocessStats) -> bool:
    """Whether some partition of some stack exceeds its limits on this process
    (`stats`: the batch's per-partition maxima, counted in pass 1)."""
    return any(
        int(stats.max_ids_per_partition[s.name].max(initial=0)) > s.keys.max_ids
        or int(stats.max_unique_ids_per_partition[s.name].max(initial=0)) > s.keys.max_unique
        for s in stacks
    )


def pack_minibatches(
    stacks: Sequence[StackPacking], *, sc_per_device: int, allow_id_dropping: bool,
    agreement: Agreement, batch_number: int, stats: PreprocessStats, parallel_map: Map,
) -> tuple[int, dict[str, int], dict[str, int]]:
    """Split (if any process needs it) and pack every stack into its buffers.

    Returns (number of minibatches, raw IDs dropped per stack, entries that did
    not fit the buffer per stack). Raises LimitExceededError when one bucket alone
    exceeds a limit and dropping is off.
    """
    required = agreement.all_reduce_or(batch_number, "required", int(is_required(stacks, stats)))
    tasks = [(stack, sc) for stack in stacks for sc in range(len(stack.sorted))]
    none = {s.name: 0 for s in stacks}
    if not required and all(m.in_slot for s in stacks for m in s.sorted):
        parallel_map(lambda t: _compact(t[0], t[1], sc_per_device),
                     [(s, d) for s in stacks for d in range(s.buffers.embedding_ids.shape[0])])
        return 1, none, dict(none)
    entries = parallel_map(lambda t: _entries_of(t[0], t[1], sc_per_device), tasks)
    if required:
        num_mb, segments = _split(tasks, entries, allow_id_dropping=allow_id_dropping,
                                  agreement=agreement, batch_number=batch_number, stats=stats,
                                  sc_per_device=sc_per_device, parallel_map=parallel_map)
    else:  # a slot was too small for its SparseCore: pack from the entries
        num_mb = 1
        segments = [_Segments(m, stack.sorted[sc].ids.reshape(1, -1), True)
                    for (stack, sc), m in zip(tasks, entries, strict=True)]
    dropped, overflow = _write(stacks, tasks, segments, num_mb, sc_per_device, parallel_map)
    return num_mb, dropped, overflow


def _split(tasks: Sequence[tuple[StackPacking, int]],
           entries: Sequence[Entries], *, allow_id_dropping: bool, agreement: Agreement,
           batch_number: int, stats: PreprocessStats, sc_per_device: int, parallel_map: Map
           ) -> tuple[int, list[_Segments]]:
    """Pass 2's split: every entry bucketed (pass 1 did those past a limit), the
    buckets' split agreed by every process, each SparseCore's entries by (minibatch,
    partition) segment. Raises on every process when a bucket alone exceeds a limit
    somewhere and dropping is off."""
    counted = parallel_map(lambda i: _bucketed(tasks[i], entries[i]), range(len(tasks)))
    local = 0
    for bucketed in counted:
        local |= bucketed.mask
    mb_of_bucket = mk.minibatch_of_buckets(agreement.all_reduce_or(batch_number, "split", local))
    num_mb = int(mb_of_bucket[-1]) + 1
    failure: LimitExceededError | None = None
    if not allow_id_dropping:
        try:
            _check_single_buckets(tasks, counted, mb_of_bucket, sc_per_device, stats)
        except LimitExceededError as error:
            failure = error
    # Every process learns whether any failed: one that raises alone would leave
    # the others waiting in the device collectives of a step it never runs.
    failed_anywhere = agreement.all_reduce_or(batch_number, "failed", int(failure is not None))
    if failure is not None:
        raise failure
    if failed_anywhere:
        raise PeerPreprocessingError(batch_number)
    segments = parallel_map(
        lambda i: _order(tasks[i][0], entries[i], counted[i], mb_of_bucket, num_mb),
        range(len(tasks)))
    return num_mb, segments


def _write(stacks: Sequence[StackPacking], tasks: Sequence[tuple[StackPacking, int]],
           segments: Sequence[_Segments], num_mb: int, sc_per_device: int, parallel_map: Map
           ) -> tuple[dict[str, int], dict[str, int]]:
    """Every SparseCore's segments packed after the previous one's on its device, the
    tails filled: (raw IDs dropped per stack, entries past the buffer per stack)."""
    sizes = parallel_map(lambda i: _size(tasks[i], segments[i], num_mb, sc_per_device),
                         range(len(tasks)))
    bases = _bases(tasks, sizes, sc_per_device)
    written = parallel_map(
        lambda i: _pack(tasks[i], segments[i], num_mb, sc_per_device, bases[i], True),
        range(len(tasks)))
    dropped: dict[str, int] = {s.name: 0 for s in stacks}
    overflow: dict[str, int] = {s.name: 0 for s in stacks}
    ends: dict[tuple[str, int], int] = {}
    for (stack, sc), (end, drop, over) in zip(tasks, written, strict=True):
        assert not (drop and stack.sorted[sc].in_slot), "within limits, yet dropped"
        dropped[stack.name] += drop
        overflow[stack.name] += over
        ends[stack.name, sc // sc_per_device] = end
    for stack in stacks:
        _fill_tails(stack, ends, num_mb, sc_per_device)
    return dropped, overflow


def _compact(stack: StackPacking, device: int, sc_per_device: int) -> None:
    """Move one device's speculative packings together: each SparseCore's single
    minibatch starts at the 8-aligned end of the previous one's (where pass 1
    already put it when the previous one had finished first), then fill the gaps."""
    b = stack.buffers
    packings = stack.sorted[device * sc_per_device:(device + 1) * sc_per_device]
    mk.compact(b.embedding_ids[device], b.sample_ids[device], b.gains[device],
               b.row_pointers[device], np.array([p.start for p in packings], np.int64),
               np.array([p.end for p in packings], np.int64),
               b.row_pointers.shape[1] // (NUM_BUCKETS * sc_per_device))


def keep_sorted(
    *, entries: np.ndarray, gains: np.ndarray, weighted: bool, sample_gains: np.ndarray,
    combiner: int, ids: np.ndarray, unique: np.ndarray, start: int, end: int, fits_slot: bool,
    exceeded: bool, keys: StackKeys,
) -> Sorted:
    """Pass 1's sorted entries (the `Sorted` fields) in a form that outlives its task.

    The sorted arrays are per-thread scratch (cache-warm), which the thread's next
    task overwrites. If the packing holds every merged entry nothing is kept: the
    usual case, no split, costs what packing without minibatching does. Otherwise
    the task takes the arrays over (`detach`, no copy); past a limit (the packing
    abandoned) it buckets them too, recounting `ids` and `unique`, while they are
    cache-warm.
    """
    in_slot = fits_slot and not exceeded
    if in_slot:
        return Sorted(ids=ids, unique=unique, start=start, end=end, in_slot=True)
    kept = Entries(detach(entries), detach(gains) if weighted else _NO_GAINS, weighted,
                   _NO_GAINS if weighted or combiner == SUM else detach(sample_gains),
                   combiner)
    bucketed = None
    if exceeded:
        bucketed = _bucketize(keys, kept, len(ids))
        bucketed.counts[0].sum(1, out=ids)
        bucketed.counts[1].sum(1, out=unique)
    return Sorted(ids=ids, unique=unique, start=start, end=end, in_slot=False, entries=kept,
                  bucketed=bucketed)


def _entries_of(stack: StackPacking, index: int, sc_per_device: int) -> Entries:
    """SparseCore `index`'s entries of `stack` (pass 2, before any packing): those
    pass 1 kept (sorted, not merged), or read back from its packing (`in_slot`),
    merged already. That packing stayed within the limits in every partition, hence in
    every minibatch, so pass 2 drops none of its entries (`pack_minibatches` checks it).
    """
    kept = stack.sorted[index]
    if kept.entries is not None:
        return kept.entries
    device, sc = divmod(index, sc_per_device)
    b = stack.buffers
    block = b.row_pointers.shape[1] // (NUM_BUCKETS * sc_per_device)
    slot = slice(kept.start, kept.start + stack.slot)
    size = int(kept.ids.sum())
    out_entries, out_gains = allocate([((size,), np.uint64), ((size,), np.float32)])
    m = mk.unpack(b.embedding_ids[device, slot], b.sample_ids[device, slot],
                  b.gains[device, slot], b.row_pointers[device, sc * block:(sc + 1) * block],
                  len(kept.ids), stack.keys.rowbits, out_entries, out_gains)
    assert m == size, f"read {m} entries back from a slot of {size}"
    return Entries(out_entries, out_gains, True, _NO_GAINS, SUM)


def _bucketed(task: tuple[StackPacking, int], entries: Entries) -> Bucketed:
    """SparseCore's entries bucketed: by pass 1 when it exceeded a limit, else now."""
    stack, index = task
    bucketed = stack.sorted[index].bucketed
    if bucketed is None:
        bucketed = _bucketize(stack.keys, entries, len(stack.sorted[index].ids))
    return bucketed


def _bucketize(keys: StackKeys, entries: Entries, num_partitions: int) -> Bucketed:
    size = len(entries.entries)
    (row_buckets,) = allocate([((size,), np.uint8)])
    counts = np.zeros((2, num_partitions, NUM_BUCKETS), np.int64)
    rows = mk.bucketize(
        entries.entries, keys.rowbits, keys.log2n, _bucket_state(), bucket_memo(keys.vocab_size),
        *(scratch(name, size, np.int64)
          for name in ("bucket_cols", "row_counts", "misses", "miss_cols", "miss_buckets")),
        row_buckets, counts[0], counts[1])
    mask = int(mk.split_mask(counts[0], counts[1], keys.max_ids, keys.max_unique))
    return Bucketed(row_buckets[:rows], counts, mask)


def _order(stack: StackPacking, entries: Entries, bucketed: Bucketed, mb_of_bucket: np.ndarray,
           num_mb: int) -> _Segments:
    counts = bucketed.counts
    # A row lives in one bucket: a segment's distinct rows are its buckets' summed.
    onehot = (mb_of_bucket[:, None] == np.arange(num_mb)[None, :]).astype(np.int64)
    seg_counts = np.ascontiguousarray((counts[0] @ onehot).T)
    if (int(seg_counts.max(initial=0)) <= stack.keys.max_ids
            and int((counts[1] @ onehot).max(initial=0)) <= stack.keys.max_unique):
        return _Segments(entries, seg_counts, True,
                         _Grouping(bucketed.row_buckets, mb_of_bucket, counts[0]))
    size = len(entries.entries)
    grouped, gains = allocate([((size,), np.uint64),
                               ((size if entries.weighted else 0,), np.float32)])
    mk.order_by_minibatch(entries.entries, entries.gains, entries.weighted, bucketed.row_buckets,
                          mb_of_bucket, num_mb, stack.keys.rowbits, counts.shape[1], grouped, gains)
    return _Segments(dataclasses.replace(entries, entries=grouped, gains=gains), seg_counts,
                     False)


def _size(task: tuple[StackPacking, int], seg: _Segments, num_mb: int, sc_per_device: int
          ) -> tuple[int, int, int]:
    """`_pack`'s (end, dropped, overflow) from base 0 without writing. Within the
    limits nothing is dropped and the end follows from the counts alone: every
    segment but the last takes its count rounded up to 8."""
    if not seg.within_limits:
        return _pack(task, seg, num_mb, sc_per_device, 0, False)
    counts = seg.counts.reshape(-1)
    end = int(align_up(counts[:-1]).sum() + counts[-1]) if counts.size else 0
    return end, 0, 0


def _pack(task: tuple[StackPacking, int], seg: _Segments, num_mb: int, sc_per_device: int,
          base: int, write: bool) -> tuple[int, int, int]:
    stack, index = task
    device, sc = divmod(index, sc_per_device)
    b = stack.buffers
    block = b.row_pointers.shape[1] // (NUM_BUCKETS * sc_per_device)
    rows = b.row_pointers[device, sc * num_mb * block:(sc + 1) * num_mb * block]
    e = seg.entries
    if write and seg.grouping is not None:
        g = seg.grouping
        end, overflow = mk.scatter_pack(
            e.entries, e.gains, e.weighted, e.sample_gains, e.combiner, g.row_buckets,
            g.mb_of_bucket, num_mb, stack.keys.rowbits, g.ids_pb, base, b.embedding_ids[device],
            b.sample_ids[device], b.gains[device], rows, block)
        return int(end), 0, int(overflow)
    end, dropped, overflow = mk.pack(
        e.entries, e.gains, e.weighted, e.sample_gains, e.combiner, seg.counts, stack.keys.rowbits,
        stack.keys.max_ids, stack.keys.max_unique, base, write, b.embedding_ids[device],
        b.sample_ids[device], b.gains[device], rows, block)
    return int(end), int(dropped), int(overflow)


def _bases(tasks: Sequence[tuple[StackPacking, int]], sizes: Sequence[tuple[int, int, int]],
           sc_per_device: int) -> list[int]:
    """Start of each SparseCore's segment: the aligned end of the previous one on its device."""
    bases = []
    base = 0
    for (_, index), (size, _, _) in zip(tasks, sizes, strict=True):
        if index % sc_per_device == 0:
            base = 0
        bases.append(base)
        base = align_up(base + size)
    return bases


def _fill_tails(stack: StackPacking, ends: dict[tuple[str, int], int], num_mb: int,
                sc_per_device: int) -> None:
    """Filler after each device's last segment; unused row-pointer blocks repeat its end."""
    b = stack.buffers
    capacity = b.embedding_ids.shape[1]
    used_rows = sc_per_device * num_mb * (b.row_pointers.shape[1] // (NUM_BUCKETS * sc_per_device))
    for device in range(b.embedding_ids.shape[0]):
        end = min(ends[stack.name, device], capacity)
        b.embedding_ids[device, end:] = FILLER_ID
        b.sample_ids[device, end:] = FILLER_ID
        b.gains[device, end:] = FILLER_GAIN
        b.row_pointers[device, used_rows:] = min(align_up(end), capacity)


def _check_single_buckets(
    tasks: Sequence[tuple[StackPacking, int]], counted: Sequence[Bucketed],
    mb_of_bucket: np.ndarray, sc_per_device: int, stats: PreprocessStats,
) -> None:
    """Raise for the first (minibatch, partition) segment still over a limit: a bucket
    the split cannot divide (every occurrence of a row stays in one bucket)."""
    num_mb = int(mb_of_bucket[-1]) + 1
    onehot = (mb_of_bucket[:, None] == np.arange(num_mb)[None, :]).astype(np.int64)
    for (stack, index), bucketed in zip(tasks, counted, strict=True):
        counts = bucketed.counts
        for kind, limit, allowed in ((0, "max_ids_per_partition", stack.keys.max_ids),
                                     (1, "max_unique_ids_per_partition", stack.keys.max_unique)):
            per_segment = counts[kind] @ onehot  # [N, M]
            over = np.argwhere(per_segment > allowed)
            if over.size:
                partition, mb = (int(x) for x in over[0])
                in_mb = np.flatnonzero(mb_of_bucket == mb)
                bucket = int(in_mb[np.argmax(counts[kind][partition, in_mb])])
                raise LimitExceededError(
                    stack=stack.name, tables=stack.tables, limit=limit,
                    device=index // sc_per_device, partition=partition,
                    observed=int(per_segment[partition, mb]), allowed=allowed,
                    num_exceeding=len(over), worst=int(per_segment.max()), stats=stats,
                    bucket=bucket,
                )
