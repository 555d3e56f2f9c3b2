"""Raw memory access inside numba kernels: loads, typed pointers, copies, prefetches.

For kernels that read numpy's own structures (see `_ragged_kernels`): each takes
an address as an integer. Nothing is checked; the callers check what they read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# Intrinsics are called without their typing context: to pyright, any callable.
_intrinsic = cast(Callable[[Callable[..., Any]], Callable[..., Any]], intrinsic)


def _element_type(token: types.Type) -> types.Type:
    """The scalar type a token names: a numpy scalar class or an array of that dtype."""
    return token.dtype if isinstance(token, types.Array) else token.instance_type  # type: ignore[attr-defined]


@_intrinsic
def load(typingctx, address, token):
    """The value of the token's scalar type stored at `address` (an integer)."""
    value = _element_type(token)

    def codegen(context, builder, signature, args):
        pointer_type = context.get_value_type(value).as_pointer()
        return builder.load(builder.inttoptr(args[0], pointer_type))

    return value(address, token), codegen


@_intrinsic
def pointer(typingctx, address, token):
    """`address` (an integer) as a typed pointer, for `numba.carray`."""
    result = types.CPointer(_element_type(token))

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(result))

    return result(address, token), codegen


@_intrinsic
def memcpy(typingctx, destination, source, size):
    """Copy `size` bytes from address `source` to address `destination` (no overlap)."""

    def codegen(context, builder, signature, args):
        byte_pointer = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], byte_pointer),
                           builder.inttoptr(args[1], byte_pointer), args[2], 1)
        return context.get_dummy_value()

    return types.none(destination, source, size), codegen


_PREFETCH = "llvm.prefetch.p0" if llvm_version_info >= (15,) else "llvm.prefetch.p0i8"


@_intrinsic
def prefetch(typingctx, address):
    """Ask the CPU to bring the cache line at `address` in (a hint: never faults)."""

    def codegen(context, builder, signature, args):
        byte_pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
            _PREFETCH)
        builder.call(function, [builder.inttoptr(args[0], byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(address), codegen
