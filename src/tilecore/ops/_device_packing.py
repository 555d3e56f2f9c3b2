"""The jitted program of device preprocessing: flat IDs → one stack's packed buffers.

The same steps as the host kernels (`preprocessing._kernels`), vectorised over every
SparseCore of every local device at once, with shapes fixed by the plan:

1. each ID's row (a scatter of the row starts and a cumulative sum), SparseCore,
   sample, mod-sharding transform (partition, local row) and gain;
2. one stable sort by (SparseCore, partition, local row, sample), so the IDs of one
   (sample, ID) pair stay in input order, as the host's stable radix sort keeps them;
3. duplicates merged by adding their gains one after another in that order (a loop
   over the position within the pair, as many rounds as the most repeated pair);
4. counts per (SparseCore, partition), the limits (a merged entry is kept while its
   rank and its distinct-ID rank are within them), partitions placed at 8-aligned
   offsets (a scan over the partitions), kept entries scattered into filler.

Float operations are the host's, in its order, so gains are equal to the bit on every
backend (divisions and square roots correctly rounded, see `_divide`):
`1/n` and `1/√n` per sample (unweighted); per row the sum of weights (`mean`) or of
their squares (`sqrtn`, accumulated in float64 and rounded to float32 per step, as
the host does, hence the program is traced with 64-bit types enabled), then
`w / scale`; merged gains summed left to right.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..preprocessing._kernels import MEAN, SUM
from ..preprocessing._packed import FILLER_GAIN, FILLER_ID, align_up

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class FeatureStatic:
    """Where one feature's rows go (`preprocessing._layout.FeatureLayout`), and whether
    it carries weights."""

    rows_per_sc: int
    sample_base: int
    shift: int
    col_offset: int
    vocab_size: int
    weighted: bool


@dataclasses.dataclass(frozen=True)
class StackStatic:
    """Everything about one stack the program's shapes and constants depend on (the
    limits are arguments: new limits in a buffer of the same size compile nothing)."""

    features: tuple[FeatureStatic, ...]
    combiner: int
    num_partitions: int
    sc_per_device: int
    local_devices: int
    slot: int
    pointers: int
    row_bits: int
    sample_bits: int

    @property
    def slices(self) -> int:
        return self.local_devices * self.sc_per_device


def _feature_entries(st: StackStatic, f: FeatureStatic, ids: jax.Array, splits: jax.Array,
                     weights: jax.Array | None) -> tuple[jax.Array, ...]:
    """(slice, partition, local row, sample, gain, bad) of every position of `ids`;
    positions past the IDs get slice = `st.slices` (sorted last, never packed)."""
    cap, rows = ids.shape[0], splits.shape[0] - 1
    n = st.num_partitions
    log2n = n.bit_length() - 1
    pos = jnp.arange(cap, dtype=_I32)
    valid = pos < splits[rows]
    starts = jnp.zeros(cap + 1, _I32).at[splits[1:rows]].add(1)
    row = jnp.minimum(jnp.cumsum(starts, dtype=_I32)[:cap], rows - 1)
    slice_ = jnp.where(valid, row // f.rows_per_sc, st.slices).astype(_I32)
    sample = (f.sample_base + row % f.rows_per_sc).astype(_I32)
    v = jnp.where(valid, ids, 0)
    bad = valid & ((ids < 0) | (ids >= f.vocab_size))
    mask = n - 1
    col = ((v + f.shift) & mask) + (v - (v & mask)) + f.col_offset
    part, local_row = col & mask, col >> log2n
    lengths = splits[1:] - splits[:-1]
    if weights is None:
        count = lengths.astype(jnp.float32)
        one = jnp.float32(1)
        per_row = (jnp.ones_like(count) if st.combiner == SUM
                   else _divide(one, count) if st.combiner == MEAN
                   else _divide(one, _sqrt(count)))
        gain = per_row[row]
    else:
        bad = bad | (valid & ~jnp.isfinite(weights))
        if st.combiner == SUM:
            gain = weights
        else:
            total = _row_sums(st.combiner, weights, splits[:-1], lengths)
            # A row with an ID is not empty; a sum past float32's max leaves no gain.
            bad = bad | (valid & ((total == 0) | ~jnp.isfinite(total))[row])
            scale = total if st.combiner == MEAN else _sqrt(total)
            gain = _divide(weights, scale[row])
    return slice_, part.astype(_I32), local_row.astype(_I32), sample, gain, bad


def _divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a / b` in float32, correctly rounded on every backend (as numpy's): XLA divides
    float32 on NVIDIA GPUs with `div.full.f32`, up to 1 ulp off. Divided in float64 and
    rounded once more instead, which gives the correctly rounded float32 (53 ≥ 2·24 + 2
    bits: double rounding is innocuous for a quotient, Figueroa 1995)."""
    return (a.astype(jnp.float64) / b.astype(jnp.float64)).astype(jnp.float32)


def _sqrt(x: jax.Array) -> jax.Array:
    """`√x` in float32, correctly rounded on every backend, through float64 as `_divide`
    (which also keeps XLA from turning `a / √x` into the approximate `a · rsqrt(x)`)."""
    return jnp.sqrt(x.astype(jnp.float64)).astype(jnp.float32)


def _row_sums(combiner: int, weights: jax.Array, starts: jax.Array, lengths: jax.Array
              ) -> jax.Array:
    """Per row, Σw (mean) or Σw² (sqrtn: each step in float64, rounded to float32, as the
    host kernel's fused multiply-add), left to right as the host adds them."""
    last = weights.shape[0] - 1

    def step(j: jax.Array, total: jax.Array) -> jax.Array:
        w = weights[jnp.minimum(starts + j, last)]
        if combiner == MEAN:
            new = total + w
        else:
            w64 = w.astype(jnp.float64)
            new = (w64 * w64 + total.astype(jnp.float64)).astype(jnp.float32)
        return jnp.where(j < lengths, new, total)

    longest = jnp.max(lengths, initial=0)
    return lax.fori_loop(0, longest, step, jnp.zeros(lengths.shape, jnp.float32))


def _exclusive_rank(flags: jax.Array, first: jax.Array) -> jax.Array:
    """1-based count of `flags` up to each position since the last `first` position."""
    inclusive = jnp.cumsum(flags, dtype=_I32)
    base = lax.cummax(jnp.where(first, inclusive - flags, 0), axis=0)
    return inclusive - base


def _sort(st: StackStatic, segment: jax.Array, local_row: jax.Array, sample: jax.Array,
          gain: jax.Array) -> tuple[jax.Array, ...]:
    """Stable sort by (segment, local row, sample): one uint64 key where the three fit
    (as the host's radix sort keys; a single-key sort is several times faster), else
    three keys."""
    rb, sb = st.row_bits, st.sample_bits
    if (st.slices * st.num_partitions).bit_length() + rb + sb > 64:
        return tuple(lax.sort((segment, local_row, sample, gain), num_keys=3, is_stable=True))
    u64 = jnp.uint64
    key = ((segment.astype(u64) << (rb + sb)) | (local_row.astype(u64) << sb)
           | sample.astype(u64))
    key, gain = lax.sort((key, gain), num_keys=1, is_stable=True)
    return ((key >> (rb + sb)).astype(_I32), ((key >> sb) & ((1 << rb) - 1)).astype(_I32),
            (key & ((1 << sb) - 1)).astype(_I32), gain)


def _runs(segment: jax.Array, local_row: jax.Array, sample: jax.Array, gain: jax.Array,
          valid: jax.Array, unit_gains: bool) -> tuple[jax.Array, ...]:
    """The sorted entries' runs: (first of a partition, first of a (partition, row) key,
    first of an entry, the entry's run length, its merged gain). Entry i's gain is
    gain[i] + gain[i+1] + ... over its run, left to right (as the host adds them): a
    loop as long as the longest run (on a GPU XLA copies each iteration's test to the
    host: 1,766 device-to-host copies in the profile of 2026-11-27). Where every gain is
    one (`unit_gains`: a sum of unweighted features) the sum is the run's length,
    exactly, and there is no loop."""
    size = segment.shape[0]
    index = jnp.arange(size, dtype=_I32)

    def changed(x: jax.Array) -> jax.Array:
        return jnp.concatenate([jnp.ones(1, bool), x[1:] != x[:-1]])

    new_part = changed(segment)
    new_key = new_part | changed(local_row)
    entry = (new_key | changed(sample)) & valid
    next_entry = lax.cummin(jnp.where(entry | ~valid, index, size), axis=0, reverse=True)
    run = jnp.concatenate([next_entry[1:], jnp.full(1, size, _I32)]) - index
    run = jnp.where(entry, run, 0)
    if unit_gains:
        return new_part, new_key, entry, run, run.astype(gain.dtype)
    merged = lax.fori_loop(
        1, jnp.max(run, initial=1),
        lambda r, acc: jnp.where(r < run, acc + gain[jnp.minimum(index + r, size - 1)], acc),
        gain)
    return new_part, new_key, entry, run, merged


def _places(st: StackStatic, kept: jax.Array, segment: jax.Array, rank: jax.Array,
            keep: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where the kept entries go: (row pointers `[slices, pointers]`, each entry's flat
    position in the `[slices · slot]` buffers (past the end: not written), entries that
    did not fit a slot). Each partition starts aligned after the previous one."""
    n, g_count, slot = st.num_partitions, st.slices, st.slot

    def place(end: jax.Array, kept_p: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        start = align_up(end)
        end = jnp.minimum(start + kept_p, slot)
        return end, (start, end)

    last, (starts, ends) = lax.scan(place, jnp.zeros(g_count, _I32), kept.T)
    overflow = jnp.sum(kept, dtype=_I32) - jnp.sum(ends - starts, dtype=_I32)
    tail = jnp.minimum(align_up(last), slot)
    pointers = jnp.concatenate(
        [ends.T, jnp.broadcast_to(tail[:, None], (g_count, st.pointers - n))], axis=1)
    g = jnp.minimum(segment // n, g_count - 1)
    where = starts.T[g, segment % n] + rank - 1
    written = keep & (where < slot)
    return pointers, jnp.where(written, g * slot + where, g_count * slot), overflow


def pack_stack(st: StackStatic, limits: jax.Array, ids: tuple[jax.Array, ...],
               splits: tuple[jax.Array, ...], weights: tuple[jax.Array | None, ...]
               ) -> dict[str, Any]:
    """One stack's buffers `[local devices, size]`, its counts and its error flag;
    `limits` = [max_ids_per_partition, max_unique_ids_per_partition]."""
    n, g_count, slot = st.num_partitions, st.slices, st.slot
    parts = [_feature_entries(st, f, i, s, w)
             for f, i, s, w in zip(st.features, ids, splits, weights, strict=True)]
    slice_, part, local_row, sample, gain, bad = (jnp.concatenate(x) for x in zip(*parts,
                                                                                strict=True))
    segment = slice_ * n + part
    segment, local_row, sample, gain = _sort(st, segment, local_row, sample, gain)
    valid = segment < g_count * n
    unit_gains = st.combiner == SUM and all(w is None for w in weights)
    new_part, new_key, entry, run, merged = _runs(segment, local_row, sample, gain, valid,
                                                  unit_gains)
    rank = _exclusive_rank(entry, new_part)
    unique_rank = _exclusive_rank(new_key & valid, new_part)
    keep = entry & (rank <= limits[0]) & (unique_rank <= limits[1])
    # Where each (slice, partition) segment starts among the sorted entries (the invalid
    # ones sort last): counts are differences of running sums at these bounds. A
    # scatter-add would send every entry of a segment to one counter (on GPUs, atomics
    # serialised on a few addresses: 1x1 has a single segment).
    bounds = jnp.searchsorted(jnp.where(valid, segment, g_count * n),
                              jnp.arange(g_count * n + 1, dtype=_I32), side="left")

    def per_segment(x: jax.Array) -> jax.Array:
        running = jnp.concatenate([jnp.zeros(1, _I32), jnp.cumsum(x, dtype=_I32)])
        return (running[bounds[1:]] - running[bounds[:-1]]).reshape(g_count, n)

    ids_count, unique_count, kept = (per_segment(x) for x in (entry, new_key & valid, keep))
    dropped = jnp.sum(jnp.where(entry & ~keep, run, 0), dtype=_I32)
    pointers, at, overflow = _places(st, kept, segment, rank, keep)

    def scatter(filler: Any, values: jax.Array) -> jax.Array:
        out = jnp.full(g_count * slot, filler, values.dtype)
        out = out.at[at].set(values, mode="drop", unique_indices=True)
        return out.reshape(st.local_devices, st.sc_per_device * slot)

    local, s = st.local_devices, st.sc_per_device
    return {
        "row_pointers": pointers.reshape(local, s * st.pointers).astype(_I32),
        "embedding_ids": scatter(FILLER_ID, local_row),
        "sample_ids": scatter(FILLER_ID, sample),
        "gains": scatter(FILLER_GAIN, merged.astype(jnp.float32)),
        "max_ids": ids_count.reshape(local, s, n).max(1),
        "max_unique": unique_count.reshape(local, s, n).max(1),
        "required": jnp.sum(align_up(ids_count), axis=1, dtype=_I32).reshape(local, s),
        "dropped": dropped + overflow,
        "overflow": overflow,
        # A sum's duplicates whose weights add past float32's max: the host's error.
        "bad": jnp.any(bad) | jnp.any(entry & ~jnp.isfinite(merged)),
    }


def _program(stacks: tuple[StackStatic, ...], limits: tuple[jax.Array, ...],
             ids: tuple[tuple[jax.Array, ...], ...], splits: tuple[tuple[jax.Array, ...], ...],
             weights: tuple[tuple[jax.Array | None, ...], ...]) -> list[dict[str, Any]]:
    return [pack_stack(*args) for args in zip(stacks, limits, ids, splits, weights, strict=True)]


program = jax.jit(_program, static_argnums=0)
"""Every stack's `pack_stack`, one compiled program per plan structure and capacities.
Call it with 64-bit types enabled (`jax.enable_x64(True)`)."""

