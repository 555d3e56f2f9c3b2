"""Minibatched buffers built from a single-pass batch, for testing the device loop.

`repack_minibatched` moves every entry of a standard-layout batch into the
minibatch its table row is assigned to and packs the result in the minibatched
layout (REFERENCE.md §3): per device, segments SparseCore-major then by
minibatch, back to back, every partition 8-aligned, absolute exclusive ends in
pointer block `k = sc·M + mb` of `max(N, 8)`, `64·S` blocks, unused pointers
repeating the last aligned end, filler `id = sample = 2³¹−1`, `gain = NaN`.
Because a row lives in exactly one minibatch, the minibatched ops must give the
single-pass results exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..preprocessing import PreprocessedBatch, StackBuffers
from ..stacking import StackingPlan, round_up
from ._reference import FILLER

MAX_MINIBATCHES = 64

MinibatchOf = Callable[[str, np.ndarray], np.ndarray]
"""`(stack, stacked table rows) -> minibatch of each row` (ints in `[0, M)`)."""


def _device_entries(rp: np.ndarray, size: int, s: int, per_sc: int, n: int
                    ) -> list[list[np.ndarray]]:
    """Positions of each (SparseCore, partition) of one standard-layout device."""
    slot = size // s
    out = []
    for sc in range(s):
        previous, parts = 0, []
        for p in range(n):
            end = int(rp[sc * per_sc + p])
            start = round_up(previous, 8)
            parts.append(sc * slot + np.arange(start, min(end, slot)))
            previous = end
        out.append(parts)
    return out


def repack_minibatched(
    plan: StackingPlan,
    batch: PreprocessedBatch,
    num_minibatches: int,
    minibatch_of: MinibatchOf,
    *,
    buffer_size: int | None = None,
) -> tuple[PreprocessedBatch, dict[str, int]]:
    """`batch` (standard layout, from `plan`) in the minibatched layout with M minibatches.

    Args:
      plan: the plan `batch` was preprocessed with (its limits size nothing here).
      batch: single-pass buffers, `[local_devices, size]` or flat.
      num_minibatches: M, 1 to 64.
      minibatch_of: assigns each stacked table row (`partition·R + local row`) its
        minibatch; every occurrence of a row therefore lands in one minibatch.
      buffer_size: COO entries per device of the result (default: the input's size,
        or the smallest multiple of 8·S that holds every device's entries if larger).

    Returns:
      The minibatched batch (`num_minibatches = M`, same leading-dimension form as
      `batch`) and, per stack, the most entries any (device, SparseCore,
      minibatch, partition) holds: the `max_ids_per_partition` it needs.
    """
    if not 1 <= num_minibatches <= MAX_MINIBATCHES:
        raise ValueError(f"num_minibatches must be in [1, 64]; got {num_minibatches}.")
    topo = plan.topology
    n, local = topo.num_partitions, topo.num_local_devices
    stacks, most = {}, {}
    for name, buffers in batch.stacks.items():
        shape = np.shape(buffers.embedding_ids)
        rp_all = np.asarray(buffers.row_pointers).reshape(local, -1)
        arrays = [np.asarray(x).reshape(local, -1) for x in
                  (buffers.embedding_ids, buffers.sample_ids, buffers.gains)]
        rows_per_shard = plan.stacks[name].vocab_size // n
        layouts = [_device_layout(name, rp_all[d], arrays[0][d], topo.sc_per_device, n,
                                  num_minibatches, minibatch_of, rows_per_shard)
                   for d in range(local)]
        most[name] = max(m for *_, m in layouts)
        needed = max(round_up(cursor, 8 * topo.sc_per_device) for _, _, cursor, _ in layouts)
        size = max(shape[-1] // (local if len(shape) == 1 else 1), needed)
        if buffer_size is not None:
            if buffer_size < needed:
                raise ValueError(f"Stack {name!r}: buffer_size={buffer_size} cannot hold the "
                                 f"{needed} entries (with alignment) of the minibatched layout.")
            size = buffer_size
        out = [np.empty((local, size), dtype) for dtype in (np.int32, np.int32, np.float32)]
        out[0][:], out[1][:], out[2][:] = FILLER, FILLER, np.nan
        for d, (_, order, _, _) in enumerate(layouts):
            for start, chosen in order:
                for target, source in zip(out, arrays, strict=True):
                    target[d, start:start + len(chosen)] = source[d][chosen]
        rps = np.stack([ends for ends, *_ in layouts])
        flat = len(shape) == 1
        stacks[name] = StackBuffers(
            row_pointers=rps.reshape(-1) if flat else rps,
            embedding_ids=out[0].reshape(-1) if flat else out[0],
            sample_ids=out[1].reshape(-1) if flat else out[1],
            gains=out[2].reshape(-1) if flat else out[2],
        )
    return PreprocessedBatch(stacks=stacks, num_minibatches=num_minibatches), most


def _device_layout(name: str, rp: np.ndarray, eids: np.ndarray, s: int, n: int,
                   num_minibatches: int, minibatch_of: MinibatchOf, rows_per_shard: int
                   ) -> tuple[np.ndarray, list[tuple[int, np.ndarray]], int, int]:
    """One device's minibatched layout: (its row pointers, where each (SparseCore,
    minibatch, partition) segment starts with the standard-layout positions it takes,
    its end, the most entries a segment holds)."""
    per_sc = max(n, 8)
    positions = _device_entries(rp, eids.shape[0], s, per_sc, n)
    order, ends = [], np.zeros(per_sc * MAX_MINIBATCHES * s, np.int32)
    cursor, most = 0, 0
    for sc in range(s):
        groups = []
        for p in range(n):
            pos = positions[sc][p]
            mb = np.asarray(minibatch_of(name, p * rows_per_shard + eids[pos]))
            if mb.shape != pos.shape or np.any((mb < 0) | (mb >= num_minibatches)):
                raise ValueError(f"minibatch_of({name!r}, ...) must give one minibatch "
                                 f"in [0, {num_minibatches}) per row; got {mb!r}.")
            groups.append([pos[mb == m] for m in range(num_minibatches)])
        for m in range(num_minibatches):
            block = (sc * num_minibatches + m) * per_sc
            for p in range(n):
                chosen = groups[p][m]
                start = round_up(cursor, 8)
                order.append((start, chosen))
                cursor = start + len(chosen)
                ends[block + p] = cursor
                most = max(most, len(chosen))
            ends[block + n:block + per_sc] = round_up(cursor, 8)
    ends[(s * num_minibatches) * per_sc:] = round_up(cursor, 8)
    return ends, order, cursor, most
