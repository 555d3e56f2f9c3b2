"""The XLA typed-FFI C ABI as seen from numba: struct offsets, raw memory access, and
the call-frame helpers every generated handler inlines (see `_ffi`).

Offsets come from ctypes mirrors of `xla/ffi/api/c_api.h` (FFI API 0.3, as shipped
in jaxlib 0.10's `jax.ffi.include_dir()`); ctypes applies the platform ABI, so no
offset is written by hand.
"""

from __future__ import annotations

import ctypes
from typing import Any

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic as _numba_intrinsic

# --------------------------------------------------------------------------------------
# ABI: ctypes mirrors of xla/ffi/api/c_api.h (XLA_FFI_API_MAJOR 0, XLA_FFI_API_MINOR 3).
# Enums are C `int`s; only the fields this module touches need exact types.
# --------------------------------------------------------------------------------------
API_MAJOR, API_MINOR = 0, 3
_p, _i32, _i64, _size = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t


class _ExtensionBase(ctypes.Structure):  # XLA_FFI_Extension_Base
    _fields_ = (("struct_size", _size), ("type", _i32), ("next", _p))


class _ApiVersion(ctypes.Structure):  # XLA_FFI_Api_Version
    _fields_ = (("struct_size", _size), ("extension_start", _p),
                ("major_version", _i32), ("minor_version", _i32))


class _Metadata(ctypes.Structure):  # XLA_FFI_Metadata
    _fields_ = (("struct_size", _size), ("api_version", _ApiVersion), ("traits", ctypes.c_uint32),
                ("state_type_id", _i64))


class _MetadataExtension(ctypes.Structure):  # XLA_FFI_Metadata_Extension
    _fields_ = (("extension_base", _ExtensionBase), ("metadata", _p))


class _Buffers(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets (same layout)
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("size", _i64),
                ("types", _p), ("ptrs", _p))


class _Attrs(ctypes.Structure):  # XLA_FFI_Attrs
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("size", _i64),
                ("types", _p), ("names", _p), ("attrs", _p))


class _CallFrame(ctypes.Structure):  # XLA_FFI_CallFrame
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("api", _p), ("ctx", _p),
                ("stage", _i32), ("args", _Buffers), ("rets", _Buffers), ("attrs", _Attrs),
                ("future", _p))


class _Buffer(ctypes.Structure):  # XLA_FFI_Buffer
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("dtype", _i32),
                ("data", _p), ("rank", _i64), ("dims", _p))


class _Api(ctypes.Structure):  # XLA_FFI_Api, up to the last function used here
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("api_version", _ApiVersion),
                ("internal_api", _p), ("error_create", _p), ("error_get_message", _p),
                ("error_destroy", _p), ("handler_register", _p), ("stream_get", _p),
                ("type_register", _p), ("execution_context_get", _p), ("state_set", _p),
                ("state_get", _p), ("device_memory_allocate", _p), ("device_memory_free", _p),
                ("thread_pool_schedule", _p), ("thread_pool_num_threads", _p))


class _ThreadPoolScheduleArgs(ctypes.Structure):  # XLA_FFI_ThreadPool_Schedule_Args
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("ctx", _p), ("task", _p),
                ("data", _p))


class _ThreadPoolNumThreadsArgs(ctypes.Structure):  # XLA_FFI_ThreadPool_NumThreads_Args
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("ctx", _p),
                ("num_threads", _p))


class _ErrorCreateArgs(ctypes.Structure):  # XLA_FFI_Error_Create_Args
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("message", _p),
                ("errc", _i32))


class _ErrorDestroyArgs(ctypes.Structure):  # XLA_FFI_Error_Destroy_Args
    _fields_ = (("struct_size", _size), ("extension_start", _p), ("error", _p))


def _off(struct: Any, *path: str) -> int:
    """Byte offset of a (nested) field."""
    offset = 0
    for name in path:
        field = getattr(struct, name)
        offset += field.offset
        struct = dict(struct._fields_)[name]
    return offset


def _struct_size(struct: Any, last: str) -> int:
    """`XLA_FFI_STRUCT_SIZE(struct, last)`: the size XLA puts in `struct_size`."""
    return getattr(struct, last).offset + getattr(struct, last).size


# Offsets (x86-64 / aarch64 LP64): frame: ext 8, api 16, stage 32, args 40 (+16 size,
# +24 types, +32 ptrs), rets 80; buffer: dtype 16, data 24, rank 32, dims 40.
_CF_SIZE = _struct_size(_CallFrame, "attrs")  # 168
_CF_EXT, _CF_API, _CF_STAGE = (_off(_CallFrame, f) for f in ("extension_start", "api", "stage"))
_CF_ARGS, _CF_RETS = _off(_CallFrame, "args"), _off(_CallFrame, "rets")
_BUFS_SIZE = _struct_size(_Buffers, "ptrs")  # 40
_BUFS_N, _BUFS_TYPES, _BUFS_PTRS = (_off(_Buffers, f) for f in ("size", "types", "ptrs"))
_BUF_SIZE = _struct_size(_Buffer, "dims")  # 48
_BUF_DTYPE, _BUF_DATA, _BUF_RANK, _BUF_DIMS = (_off(_Buffer, f)
                                               for f in ("dtype", "data", "rank", "dims"))
_EXT_TYPE = _off(_ExtensionBase, "type")
_MDX_SIZE = _struct_size(_MetadataExtension, "metadata")  # 32
_MDX_METADATA = _off(_MetadataExtension, "metadata")
_MD_SIZE = _struct_size(_Metadata, "traits")  # 36
_MD_VERSION = _off(_Metadata, "api_version")
_MD_MAJOR = _off(_Metadata, "api_version", "major_version")
_MD_MINOR = _off(_Metadata, "api_version", "minor_version")
_MD_TRAITS, _MD_STATE = _off(_Metadata, "traits"), _off(_Metadata, "state_type_id")
_VERSION_SIZE = _struct_size(_ApiVersion, "minor_version")  # 24
_API_ERROR_CREATE = _off(_Api, "error_create")  # 48
_API_SCHEDULE = _off(_Api, "thread_pool_schedule")  # 136
_API_NUM_THREADS = _off(_Api, "thread_pool_num_threads")  # 144
_CF_CTX = _off(_CallFrame, "ctx")  # 24
_API_ERROR_DESTROY = _off(_Api, "error_destroy")  # 64
_DESTROY_SIZE = _struct_size(_ErrorDestroyArgs, "error")  # 24
_SCHEDULE_SIZE = _struct_size(_ThreadPoolScheduleArgs, "data")  # 40
_NUM_THREADS_SIZE = _struct_size(_ThreadPoolNumThreadsArgs, "num_threads")  # 32
_ERR_ARGS_SIZE = _struct_size(_ErrorCreateArgs, "errc")  # 28
_ERR_MESSAGE, _ERR_ERRC = _off(_ErrorCreateArgs, "message"), _off(_ErrorCreateArgs, "errc")

_EXTENSION_METADATA = 1  # XLA_FFI_Extension_Metadata
_STAGE_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_TYPE_BUFFER = 1  # XLA_FFI_ArgType_BUFFER == XLA_FFI_RetType_BUFFER
_ERR_INVALID_ARGUMENT, _ERR_FAILED_PRECONDITION, _ERR_INTERNAL = 3, 9, 13
_DTYPE_CODES = {  # numpy dtype -> XLA_FFI_DataType
    np.dtype(np.bool_): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
    np.dtype(np.int64): 5, np.dtype(np.uint8): 6, np.dtype(np.uint16): 7,
    np.dtype(np.uint32): 8, np.dtype(np.uint64): 9, np.dtype(np.float16): 10,
    np.dtype(np.float32): 11, np.dtype(np.float64): 12, np.dtype(ml_dtypes.bfloat16): 16,
}
_HALF_FLOATS = frozenset({np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})
"""16-bit floats: kernels see them as uint16 arrays (numba has no bfloat16, and converts
them explicitly: `_vector.add_scaled_half`)."""

# --------------------------------------------------------------------------------------
# Raw memory access for numba: addresses are int64.
# --------------------------------------------------------------------------------------
_I64, _I32 = ir.IntType(64), ir.IntType(32)
intrinsic: Any = _numba_intrinsic  # called from numba code without the `typingctx` argument


@intrinsic
def _load_i64(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.load(builder.inttoptr(args[0], _I64.as_pointer()))
    return types.int64(types.int64), codegen


@intrinsic
def _load_i32(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.sext(builder.load(builder.inttoptr(args[0], _I32.as_pointer())), _I64)
    return types.int64(types.int64), codegen


@intrinsic
def _store_i64(typingctx, addr, value):
    def codegen(context, builder, sig, args):
        builder.store(args[1], builder.inttoptr(args[0], _I64.as_pointer()))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def _store_i32(typingctx, addr, value):
    def codegen(context, builder, sig, args):
        builder.store(builder.trunc(args[1], _I32), builder.inttoptr(args[0], _I32.as_pointer()))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def _voidptr(typingctx, addr):
    """int64 address -> `void*`, what `numba.carray(ptr, shape, dtype)` takes."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@intrinsic(prefer_literal=True)
def _make_error(typingctx, api, errc, message):
    """`api->XLA_FFI_Error_Create({message, errc})` with a compile-time constant message."""
    if not isinstance(message, types.StringLiteral):
        return None
    text = message.literal_value

    def codegen(context, builder, sig, args):
        api_addr, code = args[0], args[1]
        slot = cgutils.alloca_once(builder, ir.ArrayType(_I64, 4))  # XLA_FFI_Error_Create_Args
        base = builder.ptrtoint(slot, _I64)

        def field(offset, ty):
            return builder.inttoptr(builder.add(base, _I64(offset)), ty.as_pointer())

        builder.store(_I64(_ERR_ARGS_SIZE), field(0, _I64))
        builder.store(_I64(0), field(8, _I64))  # extension_start
        msg = context.insert_const_string(builder.module, text)
        builder.store(builder.ptrtoint(msg, _I64), field(_ERR_MESSAGE, _I64))
        builder.store(builder.trunc(code, _I32), field(_ERR_ERRC, _I32))
        fn_addr = builder.load(builder.inttoptr(builder.add(api_addr, _I64(_API_ERROR_CREATE)),
                                                _I64.as_pointer()))
        fn = builder.inttoptr(fn_addr, ir.FunctionType(_I64, [_I64]).as_pointer())
        return builder.call(fn, [base])
    return types.int64(types.int64, types.int64, message), codegen


@intrinsic
def _call_api(typingctx, function, args):
    """`((XLA_FFI_Error* (*)(void*)) function)(args)`: one API function on its args struct."""
    def codegen(context, builder, sig, args):
        fn = builder.inttoptr(args[0], ir.FunctionType(_I64, [_I64]).as_pointer())
        return builder.call(fn, [args[1]])
    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _call_task(typingctx, function, state):
    """`((void (*)(int64_t)) function)(state)`: a split call's task, run in this thread."""
    def codegen(context, builder, sig, args):
        fn = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [_I64]).as_pointer())
        builder.call(fn, [args[1]])
        return context.get_dummy_value()
    return types.none(types.int64, types.int64), codegen


@intrinsic
def _atomic_add(typingctx, addr, value):
    """Add `value` to the int64 at `addr` atomically (sequentially consistent); the old value."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", builder.inttoptr(args[0], _I64.as_pointer()), args[1],
                                  "seq_cst")
    return types.int64(types.int64, types.int64), codegen


def _libc(builder: Any, name: str, result: Any, arguments: list[Any]) -> Any:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, arguments),
                                          name)


@intrinsic
def _malloc(typingctx, size):
    """libc `malloc(size)` as an address (0 if out of memory): memory no thread owns."""
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(builder.call(_libc(builder, "malloc", cgutils.voidptr_t, [_I64]),
                                             [args[0]]), _I64)
    return types.int64(types.int64), codegen


@intrinsic
def _free(typingctx, addr):
    """libc `free` of an address `_malloc` returned."""
    def codegen(context, builder, sig, args):
        builder.call(_libc(builder, "free", ir.VoidType(), [cgutils.voidptr_t]),
                     [builder.inttoptr(args[0], cgutils.voidptr_t)])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@intrinsic
def _yield_cpu(typingctx):
    """`sched_yield()`: let another thread run while this one waits."""
    def codegen(context, builder, sig, args):
        builder.call(_libc(builder, "sched_yield", ir.IntType(32), []), [])
        return context.get_dummy_value()
    return types.void(), codegen


def _symbol_cell(builder: Any, symbol: str) -> Any:
    """The external int64 `symbol` (declared once per module)."""
    cell = builder.module.globals.get(symbol)
    if cell is None:
        cell = ir.GlobalVariable(builder.module, _I64, symbol)
        cell.linkage = "external"
    return cell


@intrinsic(prefer_literal=True)
def _symbol_address(typingctx, name):
    """The address of the process symbol `name` (see `_load_symbol`)."""
    if not isinstance(name, types.StringLiteral):
        return None
    symbol = name.literal_value

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(_symbol_cell(builder, symbol), _I64)
    return types.int64(name), codegen


@intrinsic(prefer_literal=True)
def _load_symbol(typingctx, name):
    """The int64 stored at the process symbol `name` (registered with `llvmlite.binding.
    add_symbol` before the code that reads it is loaded): a value set at run time in every
    process, which cached machine code reaches by relocation, never as a constant."""
    if not isinstance(name, types.StringLiteral):
        return None
    symbol = name.literal_value

    def codegen(context, builder, sig, args):
        return builder.load(_symbol_cell(builder, symbol))
    return types.int64(name), codegen


# --------------------------------------------------------------------------------------
# Call-frame helpers shared by every handler (inlined into each cfunc).
# --------------------------------------------------------------------------------------
_njit = numba.njit(nogil=True, error_model="numpy")
_RUN = 1  # `_prologue` result meaning "execute the kernel"; 0 = return NULL; else an error


@_njit
def _can_report(frame):
    """Whether `frame->api` is new enough to hold `XLA_FFI_Error_Create`."""
    api = _load_i64(frame + _CF_API)
    return api != 0 and _load_i64(api) >= _API_ERROR_CREATE + 8


@_njit
def _prologue(frame, nargs, nrets, variadic):
    """Answer the metadata query / skip other stages / check the frame before execution:
    `nargs` operands and `nrets` results (at least that many operands where `variadic` is
    1, results where it is 2)."""
    # struct_size smaller than our mirror: an older XLA. On the metadata query this leaves
    # the version unset (0.0), so XLA refuses the registration instead of calling us later.
    if _load_i64(frame) < _CF_SIZE:
        return 0 if not _can_report(frame) else _make_error(
            _load_i64(frame + _CF_API), _ERR_FAILED_PRECONDITION,
            "tilecore FFI: XLA_FFI_CallFrame is smaller than expected (XLA too old)")
    api = _load_i64(frame + _CF_API)
    ext = _load_i64(frame + _CF_EXT)
    if ext != 0 and _load_i32(ext + _EXT_TYPE) == _EXTENSION_METADATA:
        md = _load_i64(ext + _MDX_METADATA)
        if _load_i64(ext) < _MDX_SIZE or md == 0 or _load_i64(md) < _MD_SIZE:
            return _make_error(api, _ERR_FAILED_PRECONDITION,
                               "tilecore FFI: unexpected XLA_FFI_Metadata layout")
        # Same fields XLA's C++ `PopulateMetadata` writes: API version of our layout
        # mirror, no traits, stateless (type id 0).
        _store_i64(md + _MD_VERSION, _VERSION_SIZE)
        _store_i64(md + _MD_VERSION + 8, 0)
        _store_i32(md + _MD_MAJOR, API_MAJOR)
        _store_i32(md + _MD_MINOR, API_MINOR)
        _store_i32(md + _MD_TRAITS, 0)
        _store_i64(md + _MD_STATE, 0)
        return 0
    if _load_i32(frame + _CF_STAGE) != _STAGE_EXECUTE:
        return 0
    if (_load_i64(frame + _CF_ARGS) < _BUFS_SIZE or _load_i64(frame + _CF_RETS) < _BUFS_SIZE
            or _load_i64(frame + _CF_ARGS + _BUFS_N) < nargs
            or _load_i64(frame + _CF_RETS + _BUFS_N) < nrets
            or (variadic != 1 and _load_i64(frame + _CF_ARGS + _BUFS_N) != nargs)
            or (variadic != 2 and _load_i64(frame + _CF_RETS + _BUFS_N) != nrets)):
        return _make_error(api, _ERR_INVALID_ARGUMENT,
                           "tilecore FFI: wrong number of operands or results")
    return _RUN


@_njit
def _buffer(frame, group, i):
    """Address of the i-th XLA_FFI_Buffer of `group` (args or rets), or 0 if not a buffer."""
    types_addr = _load_i64(frame + group + _BUFS_TYPES)
    if _load_i32(types_addr + 4 * i) != _TYPE_BUFFER:
        return 0
    buf = _load_i64(_load_i64(frame + group + _BUFS_PTRS) + 8 * i)
    return buf if buf != 0 and _load_i64(buf) >= _BUF_SIZE else 0


@_njit
def _buffer_ok(buf, dtype_code, ndim):
    return (buf != 0 and _load_i32(buf + _BUF_DTYPE) == dtype_code
            and _load_i64(buf + _BUF_RANK) == ndim)


@_njit
def _data(buf):
    return _voidptr(_load_i64(buf + _BUF_DATA))


@_njit
def _dim(buf, axis):
    return _load_i64(_load_i64(buf + _BUF_DIMS) + 8 * axis)


@_njit
def _destroy_error(api, error):
    """`api->XLA_FFI_Error_Destroy(error)`: an error this code got and will not return."""
    if _load_i64(api) < _API_ERROR_DESTROY + 8:
        return
    args = np.empty(3, np.int64)
    args[0], args[1], args[2] = _DESTROY_SIZE, 0, error
    _call_api(_load_i64(api + _API_ERROR_DESTROY), args.ctypes.data)


@_njit
def _pool_threads(api, ctx):
    """Threads of the pool XLA runs this call's work on (`XLA_FFI_ThreadPool_NumThreads`):
    1 where the API or the call has none."""
    if ctx == 0 or _load_i64(api) < _API_NUM_THREADS + 8:
        return 1
    count = np.zeros(1, np.int64)
    args = np.empty(4, np.int64)
    args[0], args[1], args[2], args[3] = _NUM_THREADS_SIZE, 0, ctx, count.ctypes.data
    error = _call_api(_load_i64(api + _API_NUM_THREADS), args.ctypes.data)
    if error != 0:
        _destroy_error(api, error)
        return 1
    return max(count[0], 1)


@_njit
def _schedule(api, ctx, task, data):
    """`XLA_FFI_ThreadPool_Schedule(task, data)`: whether XLA took the task (it may run it on
    any of its threads, in this one, or later than this call returns)."""
    if ctx == 0 or task == 0 or _load_i64(api) < _API_SCHEDULE + 8:
        return False
    args = np.empty(5, np.int64)
    args[0], args[1], args[2], args[3], args[4] = _SCHEDULE_SIZE, 0, ctx, task, data
    error = _call_api(_load_i64(api + _API_SCHEDULE), args.ctypes.data)
    if error != 0:
        _destroy_error(api, error)
        return False
    return True
