"""Row arithmetic for the CPU kernels, written as explicit 16-lane vector operations.

LLVM vectorises a numba loop `for d in range(dim): out[o, d] += g * table[r, d]`
with a body of 64 floats (four 16-lane vectors) and a scalar remainder, because
`dim` is only known at run time and `out` may alias `table`: at the common widths
(16, 32, 48) every element then takes the scalar remainder. `add_scaled` does the
same arithmetic (a multiply, then an add: no fused multiply-add, so results are
bit-identical to the scalar loop) on whole 16-lane vectors, loading each before
storing, and finishes the last `dim % 16` elements one at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..._numba import njit
from ...preprocessing._pointers import prefetch

# Intrinsics are called without their typing context: to pyright, any callable.
_intrinsic = cast(Callable[[Callable[..., Any]], Callable[..., Any]], intrinsic)

LANES = 16
"""float32 lanes of one vector operation (one AVX-512 register; two AVX2 ones)."""


def _widened(builder: Any, address: Any, lanes: int, source: str) -> Any:
    """`lanes` values at `address` as float32 (a vector, or a scalar for 1 lane): float32
    loaded as is, bfloat16 bits shifted into the high half of a float32, float16 widened
    by the CPU's conversion (exact: every half value is a float32)."""
    def of(element: Any) -> Any:
        return ir.VectorType(element, lanes) if lanes > 1 else element

    if source == "f32":
        return builder.load(builder.inttoptr(address, of(ir.FloatType()).as_pointer()), align=4)
    if source == "f16":
        half = builder.load(builder.inttoptr(address, of(ir.HalfType()).as_pointer()), align=2)
        return builder.fpext(half, of(ir.FloatType()))
    bits = builder.load(builder.inttoptr(address, of(ir.IntType(16)).as_pointer()), align=2)
    wide = builder.zext(bits, of(ir.IntType(32)))
    sixteen = ir.Constant(of(ir.IntType(32)), [16] * lanes if lanes > 1 else 16)
    return builder.bitcast(builder.shl(wide, sixteen), of(ir.FloatType()))


def _axpy_codegen(lanes: int, source_format: str = "f32") -> Callable[..., Any]:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        kind = ir.VectorType(f32, lanes) if lanes > 1 else f32
        destination = builder.inttoptr(args[0], kind.as_pointer())
        scaled = _widened(builder, args[1], lanes, source_format)
        gain = args[2]
        if lanes > 1:
            gain = builder.insert_element(ir.Constant(kind, ir.Undefined), gain,
                                          ir.Constant(ir.IntType(32), 0))
            gain = builder.shuffle_vector(gain, ir.Constant(kind, ir.Undefined),
                                          ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                                      [0] * lanes))
        total = builder.fadd(builder.load(destination, align=4), builder.fmul(gain, scaled))
        builder.store(total, destination, align=4)
        return context.get_dummy_value()

    return codegen


@_intrinsic
def _axpy16(typingctx, destination, source, gain):
    """`dst[0:16] += gain · src[0:16]` (float32 at integer addresses), one vector each."""
    return types.none(types.int64, types.int64, types.float32), _axpy_codegen(LANES)


@_intrinsic
def _axpy1(typingctx, destination, source, gain):
    """`dst[0] += gain · src[0]` (float32 at integer addresses)."""
    return types.none(types.int64, types.int64, types.float32), _axpy_codegen(1)


@_intrinsic
def _axpy16_bf16(typingctx, destination, source, gain):
    """`dst[0:16] += gain · src[0:16]`, `src` bfloat16 (as uint16 bits)."""
    return types.none(types.int64, types.int64, types.float32), _axpy_codegen(LANES, "bf16")


@_intrinsic
def _axpy1_bf16(typingctx, destination, source, gain):
    return types.none(types.int64, types.int64, types.float32), _axpy_codegen(1, "bf16")


@_intrinsic
def _axpy16_f16(typingctx, destination, source, gain):
    """`dst[0:16] += gain · src[0:16]`, `src` float16."""
    return types.none(types.int64, types.int64, types.float32), _axpy_codegen(LANES, "f16")


@_intrinsic
def _axpy1_f16(typingctx, destination, source, gain):
    return types.none(types.int64, types.int64, types.float32), _axpy_codegen(1, "f16")


_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)
jit_inline = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False, inline="always")
"""For the helpers a kernel calls once per entry or row. numba calls another jitted function
out of line, and its row loop then runs for an unknown width: inlined, with straight-line
code at the common widths, criteo26's forward kernels take 4.7 ms instead of 6.1 on one
core (AMD Zen 4)."""


@jit_inline
def add_scaled(destination, source, gain, width):
    """`dst[0:width] += gain · src[0:width]`: float32 runs at integer addresses (rows of
    C-contiguous arrays), 16 lanes at a time. The runs must not overlap partially.
    Rows of 16 or 32 take straight-line code: a two-trip loop per row cost a third of a
    forward entry's time."""
    gain = numba.float32(gain)
    if width == 2 * LANES:
        _axpy16(destination, source, gain)
        _axpy16(destination + 4 * LANES, source + 4 * LANES, gain)
        return
    if width == LANES:
        _axpy16(destination, source, gain)
        return
    step = LANES * 4
    end = (width - width % LANES) * 4
    for offset in range(0, end, step):
        _axpy16(destination + offset, source + offset, gain)
    for offset in range(end, width * 4, 4):
        _axpy1(destination + offset, source + offset, gain)


FLOAT32, BFLOAT16, FLOAT16 = 0, 1, 2
"""Formats of a table's rows (`add_scaled_from`'s `source_format`)."""

TABLE_FORMATS: dict[np.dtype, tuple[str, int]] = {
    np.dtype(np.float32): ("", FLOAT32),
    np.dtype(ml_dtypes.bfloat16): ("_bf16", BFLOAT16),
    np.dtype(np.float16): ("_f16", FLOAT16),
}
"""Table dtype → (the suffix of its kernels' FFI names, its format in the kernels)."""


@jit_inline
def add_scaled_from(destination, source, gain, width, source_format):
    """`add_scaled` from a row stored as float32, bfloat16 or float16 (2-byte values at
    `source`), widened to float32 lane by lane: the same sums as from the float32 row."""
    if source_format == FLOAT32:
        add_scaled(destination, source, gain, width)
    elif source_format == BFLOAT16:
        _add_scaled_half(destination, source, gain, width, BFLOAT16)
    else:
        _add_scaled_half(destination, source, gain, width, FLOAT16)


@jit_inline
def _add_scaled_half(destination, source, gain, width, source_format):
    gain = numba.float32(gain)
    if width == 2 * LANES:  # straight-line code for the common width, as in `add_scaled`
        _axpy16_half(destination, source, gain, source_format)
        _axpy16_half(destination + 4 * LANES, source + 2 * LANES, gain, source_format)
        return
    end = width - width % LANES
    for k in range(0, end, LANES):
        _axpy16_half(destination + 4 * k, source + 2 * k, gain, source_format)
    for k in range(end, width):
        if source_format == BFLOAT16:
            _axpy1_bf16(destination + 4 * k, source + 2 * k, gain)
        else:
            _axpy1_f16(destination + 4 * k, source + 2 * k, gain)


@jit_inline
def _axpy16_half(destination, source, gain, source_format):
    if source_format == BFLOAT16:
        _axpy16_bf16(destination, source, gain)
    else:
        _axpy16_f16(destination, source, gain)


@_jit
def copy_table(destination, source, part=0, parts=1, period=0):
    """`destination[:] = source` for 2-D arrays of one shape (the callers' contract), or the
    rows a split kernel's `part` of `parts` owns: in every block of `period` rows (the whole
    table for 0), rows `[period·part/parts, period·(part+1)/parts)` of the block. A plain
    loop, which numba compiles without the broadcasting check of a slice assignment and
    the error message it formats (seconds of compile time in every kernel that had one)."""
    rows, width = min(destination.shape[0], source.shape[0]), min(destination.shape[1],
                                                                    source.shape[1])
    block = period if period > 0 else max(rows, 1)
    for start in range(0, rows, block):
        for r in range(start + block * part // parts, min(start + block * (part + 1) // parts,
                                                          rows)):
            for d in range(width):
                destination[r, d] = source[r, d]


@_intrinsic
def zero_bytes(typingctx, destination, size):
    """`memset(dst, 0, size)` at an integer address (LLVM's memset: the C library's at
    large sizes)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        cgutils.memset(builder, pointer, args[1], 0)
        return context.get_dummy_value()

    return types.none(types.int64, types.int64), codegen


@jit_inline
def row_address(array, r):
    """The address of row `r` of a 2-D C-contiguous array (or element `r` of a 1-D one)."""
    return array.ctypes.data + r * array.strides[0]


@jit_inline
def prefetch_row(array, r):
    """Ask for row `r` of a 2-D C-contiguous array to be brought into the cache (every
    cache line of it; a hint: an address outside the array never faults)."""
    prefetch_row_at(row_address(array, r), array.shape[1] * array.itemsize)


@jit_inline
def prefetch_row_at(address, size):
    """`prefetch_row` of the `size` bytes at `address`: straight-line code where the size
    is a constant."""
    for offset in range(0, size, 64):
        prefetch(address + offset)
