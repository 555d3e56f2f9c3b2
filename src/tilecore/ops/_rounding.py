"""Stochastic rounding of updated rows into a half-precision table (bfloat16, float16).

A row is updated in float32 and written back rounded *down or up* to a neighbouring
value of the table's format, up with probability equal to the fraction of the gap
the float32 value covers, so the rounded value's expectation is the float32 value:
many updates each smaller than half a unit in the last place still add up, where
round-to-nearest would drop every one of them (FBGEMM's `stochastic_rounding`).

Random bits come from a counter-based hash of `(seed, stack, step, global row,
column)`, not from a random state: the same seed gives bit-identical tables, every
value written in a step gets bits of its own, and a row's bits do not depend on
which device holds it (another device count rounds the same float32 value the same
way). The hash is `mix32` (Wellons' lowbias32) chained over the counters.

Rounding works on the float32 bit pattern with integer operations only, so it is
exact and the same on every backend (no float arithmetic that a backend might flush
to zero):

- bfloat16: add 16 random bits to the low half of the pattern, keep the high half.
- float16, normal range (|x| >= 2^-14): add 13 random bits below float16's 10-bit
  mantissa, drop them, rebias the exponent; past the largest finite half the value
  overflows to ±inf, as round-to-nearest does from 65520 up.
- float16, subnormal range: the grid is k·2^-24; k is the value's fixed-point
  integer part, plus one when 32 random bits and the 32-bit fraction carry.

NaN and ±inf are converted as they are.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = 0x9E3779B9
_MASK32 = 0xFFFFFFFF


def _mix32_int(x: int) -> int:
    """`mix32` on a Python int (for the static part of the key)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def mix32(x: jax.Array) -> jax.Array:
    """Wellons' lowbias32 integer hash of uint32 values (a bijection)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def combine(key: jax.Array, counter: jax.Array) -> jax.Array:
    """A new uint32 key from `key` and a counter: `mix32(key ^ mix32(counter + φ))`."""
    counter = jnp.asarray(counter).astype(jnp.uint32)
    return mix32(key ^ mix32(counter + jnp.uint32(_GOLDEN)))


def stack_seed(seed: int, stack: str) -> int:
    """The static uint32 seed of one stack: the 64-bit seed and the stack's name mixed."""
    out = _mix32_int(zlib.crc32(stack.encode()) + _GOLDEN)
    for word in (seed & _MASK32, seed >> 32):
        out = _mix32_int(out ^ _mix32_int(word + _GOLDEN))
    return out


class Rounding(NamedTuple):
    """Where one device's writes into a half-precision table take their random bits.

    Attributes:
      key: uint32 scalar, the seed, stack and step mixed (`rounding_key`).
      row_offset: the global row of this device's first table row (int32 scalar).
    """

    key: jax.Array
    row_offset: Any = 0


def rounding_key(seed: int, stack: str, step: Any) -> jax.Array:
    """uint32 key of one stack's writes at `step` (traced steps need no recompile)."""
    return combine(jnp.uint32(stack_seed(seed, stack)), step)


def rounding_bits(rounding: Rounding, rows: jax.Array, dim: int) -> jax.Array:
    """`uint32[U, dim]` random bits for writing `dim` columns of each listed row."""
    global_rows = jnp.asarray(rows).astype(jnp.uint32) + jnp.asarray(
        rounding.row_offset).astype(jnp.uint32)
    per_row = combine(rounding.key, global_rows)
    return combine(per_row[:, None], jnp.arange(dim, dtype=jnp.uint32)[None, :])


def moves_as_bits(dtype: Any) -> bool:
    """Whether a table of `dtype` is gathered and scattered as uint16 bit patterns
    (`as_bits`): bfloat16 on XLA:CPU, which has no bfloat16 scatter and converts the
    whole table to float32 and back around one (measured on a 4M x 16 table: 296 ms a
    scatter of 200k rows, 134 ms through the bit patterns, 3 ms for float32). float16
    scatters natively there, and accelerators handle both."""
    return np.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"


def as_bits(half: jax.Array) -> jax.Array:
    """A bfloat16/float16 array's uint16 bit patterns (same width, no rounding)."""
    return jax.lax.bitcast_convert_type(half, jnp.uint16)


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
    """uint16 bit patterns as a `dtype` (bfloat16/float16) array (the inverse of `as_bits`)."""
    return jax.lax.bitcast_convert_type(bits, dtype)


def take_rows(array: jax.Array, rows: jax.Array, mode: str) -> jax.Array:
    """`array.at[rows].get(mode=mode)`, through the bit patterns where the dtype
    `moves_as_bits`: the one way every wing's XLA code gathers table rows."""
    if moves_as_bits(array.dtype):
        return from_bits(as_bits(array).at[rows].get(mode=mode), array.dtype)
    return array.at[rows].get(mode=mode)


def stochastic_round(values: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
    """float32 `values` rounded stochastically to `dtype` (bfloat16 or float16) with
    uint32 `bits` of the same shape; float32 passes through."""
    dtype = np.dtype(dtype)
    values = jnp.asarray(values, jnp.float32)
    if dtype == np.float32:
        return values
    pattern = jax.lax.bitcast_convert_type(values, jnp.uint32)
    if dtype == jnp.bfloat16:
        kept = ((pattern + (bits >> 16)) >> 16).astype(jnp.uint16)
    elif dtype == np.float16:
        kept = _float16_bits(pattern, bits)
    else:
        raise ValueError(f"stochastic_round: no rounding to {dtype}; tables are stored as "
                         "float32, bfloat16 or float16.")
    rounded = jax.lax.bitcast_convert_type(kept, dtype)
    return jnp.where(jnp.isfinite(values), rounded, values.astype(dtype))


def _float16_bits(pattern: jax.Array, bits: jax.Array) -> jax.Array:
    """uint16 float16 patterns of float32 `pattern`s rounded up with the carry of `bits`."""
    sign = (pattern >> 16) & jnp.uint32(0x8000)
    magnitude = pattern & jnp.uint32(0x7FFFFFFF)
    # Normal float16 range: 13 random bits below the kept mantissa.
    up = (magnitude + (bits >> 19)) & jnp.uint32(0xFFFFE000)
    exponent = (up >> 23).astype(jnp.int32) - 112
    normal = jnp.where(exponent >= 31, jnp.uint32(0x7C00),
                       (exponent.astype(jnp.uint32) << 10) | ((up >> 13) & jnp.uint32(0x3FF)))
    # Subnormal float16 range: |x| = m·2^(e-150) = k·2^-24 + fraction, s = 126 - e bits
    # of m below the grid (a float32 subnormal: e = 1, no implicit bit).
    biased = (magnitude >> 23).astype(jnp.int32)
    m = (magnitude & jnp.uint32(0x7FFFFF)) | jnp.where(biased > 0, jnp.uint32(0x800000), 0)
    s = 126 - jnp.maximum(biased, 1)  # >= 14 here
    k = jnp.where(s >= 32, jnp.uint32(0), m >> jnp.minimum(s, 31).astype(jnp.uint32))
    fraction = jnp.where(  # the s dropped bits as a 32-bit fraction (truncated past 32)
        s <= 32, m << (32 - jnp.minimum(s, 32)).astype(jnp.uint32),
        m >> jnp.minimum(s - 32, 31).astype(jnp.uint32))
    carry = (fraction + bits) < bits
    subnormal = k + carry.astype(jnp.uint32)  # 1024 is the smallest normal: seamless
    half = jnp.where(magnitude >= jnp.uint32(0x38800000), normal, subnormal)
    return (half | sign).astype(jnp.uint16)
