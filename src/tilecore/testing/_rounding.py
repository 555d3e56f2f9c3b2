"""A numpy oracle of stochastic rounding into half-precision tables (no JAX).

Written from the definition, not from the device's bit tricks: a float32 value `x`
lies between two neighbours of the format, `lo` (toward zero) and `lo + ulp` (away
from zero); it rounds away from zero when `n` random bits and the `n`-bit fraction
`(|x| - |lo|)/ulp` carry past `2^n`, so with probability that fraction. `n` is the
number of float32 bits the format drops: 16 for bfloat16, 13 for float16's normal
range, and 32 in float16's subnormal range (where the fraction is truncated to 32
bits). Computed in float64, which holds every float32 value and gap exactly.

The random bits are the device's hash of `(seed, stack, step, global row, column)`
restated here, so the oracle predicts the device's tables bit for bit.
"""

from __future__ import annotations

import zlib
from typing import Any

import ml_dtypes
import numpy as np

_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


def _mix32(x: Any) -> np.ndarray:
    x = np.asarray(x, np.uint64) & _MASK32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _MASK32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _MASK32
    return x ^ (x >> np.uint64(16))


def _combine(key: Any, counter: Any) -> np.ndarray:
    return _mix32(np.asarray(key, np.uint64) ^ _mix32(np.asarray(counter, np.uint64) + _GOLDEN))


def reference_rounding_bits(seed: int, stack: str, step: int, rows: Any, dim: int
                            ) -> np.ndarray:
    """`uint32[len(rows), dim]` bits for writing `dim` columns of each global row."""
    key = _mix32(np.uint64(zlib.crc32(stack.encode()) + _GOLDEN))
    for word in (seed & _MASK32, seed >> 32):
        key = _mix32(key ^ _mix32(np.uint64(word + _GOLDEN)))
    key = _combine(key, step)
    per_row = _combine(key, np.asarray(rows, np.uint64))
    out = _combine(per_row[:, None], np.arange(dim, dtype=np.uint64)[None, :])
    return out.astype(np.uint32)


def half_ulp_gap(values: Any, dtype: Any) -> np.ndarray:
    """float64 gap between the two `dtype` neighbours of each float32 value (its unit
    in the last place in `dtype`, or the smallest subnormal below the normal range)."""
    info = ml_dtypes.finfo(dtype)
    magnitude = np.abs(np.asarray(values, np.float64))
    exponent = np.floor(np.log2(np.maximum(magnitude, float(info.smallest_normal))))
    return np.exp2(exponent - info.nmant)


def reference_stochastic_round(values: Any, dtype: Any, bits: Any) -> np.ndarray:
    """float32 `values` rounded stochastically to `dtype` with uint32 `bits`."""
    dtype = np.dtype(dtype)
    given = np.asarray(values, np.float32)
    finite = np.isfinite(given)
    x = np.where(finite, given, 0.0).astype(np.float64)
    bits = np.asarray(bits, np.uint64)
    info = ml_dtypes.finfo(dtype)
    gap = half_ulp_gap(x, dtype)
    lo = np.floor(np.abs(x) / gap) * gap
    fraction = (np.abs(x) - lo) / gap  # in [0, 1), exact
    if dtype == np.float16:
        subnormal = np.abs(x) < float(info.smallest_normal)
        n = np.where(subnormal, 32, 13).astype(np.uint64)
    else:
        n = np.full(x.shape, 16, np.uint64)
    scaled = np.floor(np.ldexp(fraction, n.astype(np.int64))).astype(np.uint64)
    drawn = bits >> (np.uint64(32) - n)
    up = (drawn + scaled) >= (np.uint64(1) << n)
    rounded = np.copysign(lo + up * gap, x)
    with np.errstate(over="ignore"):  # exact, or ±inf past the largest finite value
        return np.where(finite, rounded.astype(dtype), given.astype(dtype))
