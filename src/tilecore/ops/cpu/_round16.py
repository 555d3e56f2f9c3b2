"""One 16-bit table value at a time, for the fused CPU update: widened to float32, and
written back with `tilecore.ops._rounding`'s stochastic rounding restated for numba.

The rule is the one `_rounding` states (same hash of seed, stack, step, global row and
column; same bit operations on the float32 pattern); `tests/test_ops_half.py` checks
the two bit for bit against the numpy oracle, so they cannot drift apart unseen.
Values are uint16 bit patterns (the FFI views bfloat16 and float16 buffers as uint16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..._numba import njit
from ._vector import BFLOAT16

_intrinsic = cast(Callable[[Callable[..., Any]], Callable[..., Any]], intrinsic)
_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)

_MASK = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B9)


@_intrinsic
def _f32_bits(typingctx, value):
    """The bit pattern of a float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@_intrinsic
def _bits_f32(typingctx, bits):
    """The float32 of a bit pattern."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@_intrinsic
def _f16_f32(typingctx, bits):
    """The float32 of a float16 bit pattern (exact)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@_jit
def _mix32(x):
    x = x & _MASK
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _MASK
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _MASK
    return x ^ (x >> np.uint64(16))


@_jit
def _combine(key, counter):
    return _mix32(key ^ _mix32(counter + _GOLDEN))


@_jit
def value_bits(key, row, column):
    """The uint32 random bits (as uint64) of one written value (`_rounding.rounding_bits`)."""
    return _combine(_combine(np.uint64(key) & _MASK, np.uint64(row) & _MASK),
                    np.uint64(column))


@_jit
def widen(value, source_format):
    """A stored bfloat16/float16 value (uint16 bits) as float32."""
    if source_format == BFLOAT16:
        return _bits_f32(np.uint32(value) << np.uint32(16))
    return _f16_f32(np.uint16(value))


@_jit
def narrow(value, source_format, bits):
    """float32 `value` rounded stochastically to bfloat16/float16 bits with `bits`."""
    pattern = np.uint64(_f32_bits(np.float32(value)))
    magnitude = pattern & np.uint64(0x7FFFFFFF)
    if source_format == BFLOAT16:
        if magnitude >= np.uint64(0x7F800000):  # inf, or NaN kept quiet
            quiet = np.uint64(0x40) if magnitude > np.uint64(0x7F800000) else np.uint64(0)
            return np.uint16((pattern >> np.uint64(16)) | quiet)
        return np.uint16((pattern + (bits >> np.uint64(16))) >> np.uint64(16))
    sign = (pattern >> np.uint64(16)) & np.uint64(0x8000)
    if magnitude >= np.uint64(0x7F800000):
        nan = np.uint64(0x200) if magnitude > np.uint64(0x7F800000) else np.uint64(0)
        return np.uint16(sign | np.uint64(0x7C00) | nan)
    if magnitude >= np.uint64(0x38800000):  # the normal range: 13 random bits below
        up = (magnitude + (bits >> np.uint64(19))) & np.uint64(0xFFFFE000)
        exponent = np.int64(up >> np.uint64(23)) - 112
        if exponent >= 31:
            return np.uint16(sign | np.uint64(0x7C00))
        return np.uint16(sign | (np.uint64(exponent) << np.uint64(10))
                         | ((up >> np.uint64(13)) & np.uint64(0x3FF)))
    biased = np.int64(magnitude >> np.uint64(23))
    m = magnitude & np.uint64(0x7FFFFF)
    if biased > 0:
        m |= np.uint64(0x800000)
    s = 126 - max(biased, 1)  # >= 14: m's bits below the 2^-24 grid
    k = np.uint64(0) if s >= 32 else m >> np.uint64(s)
    fraction = ((m << np.uint64(32 - s)) & _MASK if s <= 32  # s bits as a 32-bit fraction
                else m >> np.uint64(min(s - 32, 63)))
    carry = np.uint64(1) if fraction + bits > _MASK else np.uint64(0)
    return np.uint16(sign | (k + carry))
