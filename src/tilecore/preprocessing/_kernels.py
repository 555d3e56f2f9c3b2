"""Compiled hot loops of host preprocessing (numba, GIL released).

One SparseCore's share of one stack is processed as: count (validate IDs, build
radix histograms) → stage (ID transform, combiner gains, first radix scatter) →
remaining radix passes → emit (merge duplicate (sample, ID) pairs, count, apply
limits, write the packed slot). An entry is one uint64,
`key << SAMPLE_BITS | sample` with `key = partition << rowbits | local row`, plus
a float32 gain when the input is weighted (unweighted gains depend only on the
sample, so they are looked up per sample instead of moved). The sort is a stable
LSD radix sort on the key digits, so entries of one key keep sample order, the
order the reference system's (key, sample) sort produces.
"""

from __future__ import annotations

import numba
import numpy as np

from .._numba import njit
from ._packed import aligned, fill

SUM, MEAN, SQRTN = 0, 1, 2
SAMPLE_BITS = 26

# Error codes returned by `stage` (the offending position is returned beside).
OK, BAD_WEIGHT, ZERO_WEIGHT_SUM, INFINITE_WEIGHT_SUM = 0, 2, 3, 4

_jit = njit(nogil=True, cache=True, error_model="numpy")


@numba.njit(inline="always")
def _place(value, sample, shift, col_offset, log2n, rowbits, digit_bits, cursor, entries):
    """Append one ID at the cursor of its lowest key digit; returns its position."""
    mask = (1 << log2n) - 1
    v = np.int64(value)
    col = ((v + shift) & mask) + (v - (v & mask)) + col_offset
    key = ((col & mask) << rowbits) | (col >> log2n)
    d = key & ((1 << digit_bits) - 1)
    pos = cursor[d]
    cursor[d] = pos + 1
    entries[pos] = np.uint64((key << SAMPLE_BITS) | sample)
    return pos


@_jit
def count(values, splits, r0, r1, vocab, shift, col_offset, log2n, rowbits, digit_bits,
          num_passes, hist):
    """Histogram each radix digit of the keys of rows [r0, r1); -1 or the first bad index."""
    mask = (1 << log2n) - 1
    dmask = (1 << digit_bits) - 1
    h0 = hist[0]
    h1 = hist[min(1, num_passes - 1)]
    h2 = hist[min(2, num_passes - 1)]
    for i in range(splits[r0], splits[r1]):
        v = np.int64(values[i])
        if v < 0 or v >= vocab:
            return i
        col = ((v + shift) & mask) + (v - (v & mask)) + col_offset
        key = ((col & mask) << rowbits) | (col >> log2n)
        h0[key & dmask] += 1
        if num_passes > 1:
            h1[(key >> digit_bits) & dmask] += 1
            if num_passes > 2:
                h2[(key >> (2 * digit_bits)) & dmask] += 1
    return -1


@_jit
def prefix_sums(counts, cursor):
    """`cursor[d]` = the sum of `counts[:d]` (where digit d's entries start); returns the total."""
    total = 0
    for d in range(counts.shape[0]):
        cursor[d] = total
        total += counts[d]
    return total


@_jit
def row_length_range(splits):
    """(shortest, longest, first row of the shortest) over the rows `splits` delimit
    (at least one row)."""
    shortest = longest = splits[1] - splits[0]
    at = 0
    for r in range(1, splits.shape[0] - 1):
        length = splits[r + 1] - splits[r]
        if length < shortest:
            shortest = length
            at = r
        elif length > longest:
            longest = length
    return shortest, longest, at


@_jit
def stage(values, splits, weights, has_weights, width, r0, r1, sample_base, shift, col_offset,
          log2n, rowbits, digit_bits, combiner, cursor, entries, gains, sample_gains):
    """Transform rows [r0, r1) and scatter them by the lowest key digit.

    Weighted: each entry's gain goes to `gains`. Unweighted: the sample's gain goes
    to `sample_gains[sample]` (not needed for `sum`, whose gains are all 1).
    `width` is the IDs per row when every row has the same count, else -1.
    Returns (error code, row or position).
    """
    if has_weights:
        return _stage_weighted(values, splits, weights, r0, r1, sample_base, shift, col_offset,
                               log2n, rowbits, digit_bits, combiner, cursor, entries, gains)
    one = np.float32(1.0)
    if combiner != SUM:
        for r in range(r0, r1):
            n = np.float32(splits[r + 1] - splits[r])
            sample_gains[sample_base + r - r0] = (
                one / n if combiner == MEAN else one / np.float32(np.sqrt(n))
            )
    start = splits[r0]
    end = splits[r1]
    if width == 1:  # one ID per row: no row bookkeeping in the hot loop
        for i in range(start, end):
            _place(values[i], sample_base + i - start, shift, col_offset, log2n, rowbits,
                   digit_bits, cursor, entries)
        return OK, 0
    r = r0
    row_end = splits[r0 + 1]
    sample = sample_base
    for i in range(start, end):
        while i >= row_end:
            r += 1
            row_end = splits[r + 1]
            sample += 1
        _place(values[i], sample, shift, col_offset, log2n, rowbits, digit_bits, cursor, entries)
    return OK, 0


FLOAT32_MAX = float(np.finfo(np.float32).max)


@_jit
def _duplicates_overflow(values, weights, s, e):
    """Whether the weights of one ID repeated in row `[s, e)`, added in float32 in the row's
    order (as `emit` merges a sum's duplicates), pass float32's max (a gain of inf)."""
    for i in range(s, e):
        seen = False
        for j in range(s, i):
            seen = seen or values[j] == values[i]
        if seen:
            continue
        total = np.float32(0.0)
        for j in range(i, e):
            if values[j] == values[i]:
                total += weights[j]
        if not np.isfinite(total):
            return True
    return False


@_jit
def _stage_weighted(values, splits, weights, r0, r1, sample_base, shift, col_offset, log2n,
                    rowbits, digit_bits, combiner, cursor, entries, gains):
    for r in range(r0, r1):
        s = splits[r]
        e = splits[r + 1]
        sample = sample_base + (r - r0)
        total = np.float32(0.0)
        magnitude = 0.0  # sum: Σ|w| in float64, which bounds every sum of the row's duplicates
        for i in range(s, e):
            w = weights[i]
            if not np.isfinite(w):
                return BAD_WEIGHT, i
            if combiner == MEAN:
                total += w
            elif combiner == SQRTN:
                # A fused multiply-add, as the reference accumulates Σw² (exact in f64).
                total = np.float32(np.float64(w) * np.float64(w) + np.float64(total))
            else:
                magnitude += abs(np.float64(w))
        if magnitude > FLOAT32_MAX and _duplicates_overflow(values, weights, s, e):
            return INFINITE_WEIGHT_SUM, r
        scale = np.float32(1.0)
        if combiner != SUM and e > s:
            if total == 0:
                return ZERO_WEIGHT_SUM, r
            if not np.isfinite(total):  # finite weights whose Σw or Σw² passes float32's max
                return INFINITE_WEIGHT_SUM, r
            scale = total if combiner == MEAN else np.float32(np.sqrt(total))
        for i in range(s, e):
            pos = _place(values[i], sample, shift, col_offset, log2n, rowbits, digit_bits,
                         cursor, entries)
            gains[pos] = weights[i] / scale if combiner != SUM else weights[i]
    return OK, 0


@_jit
def radix_pass(entries, gains, entries_out, gains_out, has_weights, shift, digit_bits, counts):
    """One stable scatter of all entries by the key digit at `shift`; `counts` is its histogram."""
    dmask = np.uint64((1 << digit_bits) - 1)
    sh = np.uint64(shift + SAMPLE_BITS)
    cursor = np.empty(counts.shape[0], dtype=np.int64)
    total = 0
    for d in range(counts.shape[0]):
        cursor[d] = total
        total += counts[d]
    for i in range(entries.shape[0]):
        x = entries[i]
        d = (x >> sh) & dmask
        pos = cursor[d]
        cursor[d] = pos + 1
        entries_out[pos] = x
        if has_weights:
            gains_out[pos] = gains[i]


@_jit
def emit(entries, gains, has_weights, sample_gains, combiner, rowbits, num_partitions, max_ids, max_unique,
         eids, sids, out_gains, row_pointers, ids_out, unique_out, speculative=False):
    """Merge, count, limit and pack sorted entries into one SparseCore's slot.

    Writes every slot entry (kept entries, then NaN/INT32_MAX filler) and every row
    pointer. Returns (required buffer size, dropped raw IDs, IDs that did not fit
    the slot). Entries past a limit are dropped; the caller decides whether a
    limit overrun is an error. `speculative` (minibatching's pass 1, whose packing
    is discarded once a limit is exceeded, and whose packings are moved together
    and the gaps filled afterwards) returns (-1, 0, 0) at the first overrun, the
    counts and the slot left incomplete, and leaves the slot past the last
    partition's end unwritten.
    """
    n = entries.shape[0]
    slot = eids.shape[0]
    sample_mask = np.uint64((1 << SAMPLE_BITS) - 1)
    sb = np.uint64(SAMPLE_BITS)
    row_mask = np.uint64((1 << rowbits) - 1)
    part_shift = np.uint64(rowbits + SAMPLE_BITS)
    i = 0
    pos = 0
    required = 0
    dropped = 0
    overflow = 0
    for p in range(num_partitions):
        start = aligned(pos)
        fill(eids, sids, out_gains, pos, start)
        pos = start
        ids = 0
        uniq = 0
        last_key = np.uint64(0xFFFFFFFFFFFFFFFF)
        while i < n and (entries[i] >> part_shift) == p:
            x = entries[i]
            key = x >> sb
            sample = np.int32(x & sample_mask)
            if has_weights:
                gain = gains[i]
            elif combiner == SUM:
                gain = np.float32(1.0)
            else:
                gain = sample_gains[sample]
            step = gain
            raw = 1
            i += 1
            while i < n and entries[i] == x:
                gain += gains[i] if has_weights else step
                raw += 1
                i += 1
            if key != last_key:
                uniq += 1
                last_key = key
            ids += 1
            if ids > max_ids or uniq > max_unique:
                if speculative:
                    return -1, 0, 0
                dropped += raw
            elif pos >= slot:
                overflow += 1  # counted once per merged entry, as the reference does
            else:
                eids[pos] = np.int32(key & row_mask)
                sids[pos] = sample
                out_gains[pos] = gain
                pos += 1
        ids_out[p] = ids
        unique_out[p] = uniq
        required += aligned(ids)
        row_pointers[p] = pos
    end = min(aligned(pos), slot)
    for p in range(num_partitions, row_pointers.shape[0]):
        row_pointers[p] = end
    if not speculative:
        fill(eids, sids, out_gains, pos, slot)
    return required, dropped, overflow
