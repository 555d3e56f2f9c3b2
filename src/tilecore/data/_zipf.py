"""Bounded Zipf sampling: fast inverse-CDF draws of ranks, scattered over a vocabulary.

Rank r ∈ [0, vocab) is drawn with probability ∝ (r + 1)^−exponent. Each rank owns
the interval [r, r+1) of a continuous variable x, with its mass spread evenly, so
the CDF of x is piecewise linear and its inverse G(u) is too. G is tabulated at
2¹⁶ + 1 evenly spaced u and a draw interpolates linearly between two table
entries: ranks heavier than 2⁻¹⁶ are drawn exactly, lighter ranks (the tail, where
the density barely changes across one table cell) within a relative error far
below sampling noise. The CDF is summed exactly over the first min(vocab, 2²⁰)
ranks; beyond that the tail's mass is the integral of (x + ½)^−exponent, whose
midpoint rule matches the discrete sum to O(r⁻²).

A draw then costs one 32-bit random number (16 bits pick the cell, 16 bits the
position in it), two gathers from a 256 KiB table, and a multiply and an add, in one
compiled pass (`_draw`). Ranks become IDs through `(rank·multiplier + offset) mod
vocab`, a bijection of [0, vocab) when gcd(multiplier, vocab) = 1, so the hot IDs land
on arbitrary partitions instead of all at the start of the table.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .._numba import njit

TABLE_BITS = 16
"""log2 of the number of cells of the inverse-CDF table."""
EXACT_RANKS = 2**20
"""Ranks whose probabilities are summed exactly; the rest use the integral."""


def _tail_mass(lo: float, hi: float, exponent: float) -> float:
    """∫_lo^hi x^−exponent dx."""
    if exponent == 1.0:
        return math.log(hi / lo)
    return (lo ** (1.0 - exponent) - hi ** (1.0 - exponent)) / (exponent - 1.0)


def _tail_inverse(lo: float, mass: np.ndarray, exponent: float) -> np.ndarray:
    """The x ≥ lo at which ∫_lo^x t^−exponent dt equals `mass`."""
    if exponent == 1.0:
        return lo * np.exp(mass)
    base = lo ** (1.0 - exponent) - (exponent - 1.0) * mass
    return np.maximum(base, 0.0) ** (1.0 / (1.0 - exponent))


@functools.lru_cache(maxsize=256)
def inverse_cdf_table(vocab_size: int, exponent: float) -> tuple[np.ndarray, np.ndarray]:
    """`(start, width)` of the 2¹⁶ cells of G: cell j covers x ∈ [start[j], start[j] + width[j]).

    float32 while vocab ≤ 2²⁴ (exact integers), float64 beyond. Cached per
    (vocab_size, exponent): the table is built once, in a few milliseconds.
    """
    if vocab_size < 1:
        raise ValueError(f"Zipf: vocab_size must be >= 1, got {vocab_size=}.")
    if not (math.isfinite(exponent) and exponent > 0):
        raise ValueError(f"Zipf: exponent must be a finite number > 0, got {exponent=}.")
    exact = min(vocab_size, EXACT_RANKS)
    weights = np.arange(1, exact + 1, dtype=np.float64) ** -exponent
    cdf = np.zeros(exact + 1)
    np.cumsum(weights, out=cdf[1:])
    head = float(cdf[-1])
    # Rank r ≥ exact has weight (r+1)^−s ≈ ∫ t^−s dt over t ∈ [r+½, r+1½): x = t − ½.
    tail = _tail_mass(exact + 0.5, vocab_size + 0.5, exponent) if vocab_size > exact else 0.0
    u = np.linspace(0.0, head + tail, (1 << TABLE_BITS) + 1)
    x = np.empty_like(u)
    in_head = u < head
    rank = np.minimum(np.searchsorted(cdf, u[in_head], side="right") - 1, exact - 1)
    x[in_head] = rank + (u[in_head] - cdf[rank]) / weights[rank]
    if tail:
        x[~in_head] = _tail_inverse(exact + 0.5, u[~in_head] - head, exponent) - 0.5
    else:
        x[~in_head] = vocab_size
    np.clip(x, 0.0, vocab_size, out=x)
    dtype = np.float32 if vocab_size <= 2**24 else np.float64
    start, width = x[:-1].astype(dtype), np.diff(x).astype(dtype)
    start.flags.writeable = width.flags.writeable = False  # shared through the cache
    return start, width


def coprime_multiplier(vocab_size: int, rng: np.random.Generator) -> int:
    """A random multiplier in [vocab/3, vocab) coprime to `vocab_size` (1 if vocab ≤ 2)."""
    if vocab_size <= 2:
        return 1
    while True:
        m = int(rng.integers(max(1, vocab_size // 3), vocab_size))
        if math.gcd(m, vocab_size) == 1:
            return m


def sample_ids(
    rng: np.random.Generator,
    n: int,
    *,
    vocab_size: int,
    exponent: float,
    multiplier: int,
    offset: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """`n` int32 IDs in [0, vocab_size): Zipf ranks mapped by `(r·multiplier + offset) mod vocab`.

    Written into `out` (int32, length n) if given. Releases the GIL, so threads drawing
    different blocks run in parallel.
    """
    start, width = inverse_cdf_table(vocab_size, exponent)
    # Two 32-bit draws per 64-bit output of the bit generator (little-endian halves).
    raw = rng.bit_generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
    if out is None:
        out = np.empty(n, dtype=np.int32)
    elif out.shape != (n,) or out.dtype != np.int32:
        raise ValueError(f"sample_ids: out must be int32 of shape ({n},), got {out.dtype} "
                         f"{out.shape}.")
    _draw(raw, start, width, start.dtype == np.float32, multiplier, offset, vocab_size, out)
    return out


@njit(nogil=True, cache=True, error_model="numpy")
def _draw(raw, start, width, single, multiplier, offset, vocab_size, out):
    """Each 32-bit draw: its top 16 bits pick a cell of G, the low 16 bits the position
    in it, and the rank maps to an ID. One pass, the arithmetic of the table's dtype
    (float32 while `single`), rounded as numpy's step-by-step ufuncs round it: a
    float32 product, then a float32 sum, truncated."""
    cell_shift = np.uint32(32 - TABLE_BITS)
    low_bits = np.uint32((1 << (32 - TABLE_BITS)) - 1)
    scale = 2.0 ** -(32 - TABLE_BITS)
    inverse = 1.0 / vocab_size
    for i in range(raw.shape[0]):
        r = raw[i]
        c = np.int64(r >> cell_shift)
        f = np.float64(r & low_bits) * scale  # exact: 16 bits
        if single:
            rank = np.int64(start[c] + np.float32(f) * width[c])
        else:
            rank = np.int64(start[c] + f * width[c])
        out[i] = _mod(rank * multiplier + offset, vocab_size, inverse)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _mod(x, m, inverse):
    """`x mod m` for 0 <= x < 2⁶² and 1 <= m < 2³¹ (`_draw`'s x is below m² + m), without a
    division, which took a third of a draw: the quotient from `x · (1/m)` in float64 is
    within one of the true one (its rounding errors add up to far less than one), and
    the remainder's range check corrects it."""
    r = x - np.int64(x * inverse) * m
    if r < 0:
        r += m
    elif r >= m:
        r -= m
    return r
