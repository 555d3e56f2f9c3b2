"""Numba-compiled CPU kernels as XLA typed-FFI custom calls (no C compiler needed).

XLA:CPU calls a typed-FFI handler as `XLA_FFI_Error* handler(XLA_FFI_CallFrame*)`.
`register_kernel` wraps a plain `@numba.njit` kernel that takes numpy arrays
(operands first, then results) into such a handler: a numba `@cfunc` that reads
the call frame by byte offset, answers XLA's metadata query, ignores
non-execute stages, checks every buffer's dtype and rank, views the buffers as
`numba.carray`s and calls the kernel. Errors go back to XLA through the API's
`XLA_FFI_Error_Create`, so XLA raises them in Python instead of crashing.

The byte offsets come from ctypes mirrors of `xla/ffi/api/c_api.h` (FFI API
0.3, as shipped in jaxlib 0.10's `jax.ffi.include_dir()`); ctypes applies the
platform ABI, so no offset is written by hand. Guards against a mismatched
XLA: the handler checks the `struct_size` of every struct before reading past
its header (XLA only ever appends fields within a major version), reports API
0.3 to XLA's metadata query (XLA refuses the registration if it no longer
supports it), and `unavailable_reason()` runs a probe kernel once per process
and compares its output before any op relies on this path. The CPU backend is
initialised before registering so a refused registration raises here instead
of failing backend start-up for the whole process.

Kernels must not raise (a numba exception in a cfunc would be swallowed and
reported as success) and must treat out-of-range indices as data to skip: they
run on XLA's worker threads, possibly several at once (one per device).

XLA:CPU runs the custom calls of one program one after another, so a kernel alone
would use one core. A kernel registered `split` is run in parts instead, one per
thread of the pool XLA lends FFI handlers (`XLA_FFI_ThreadPool_Schedule`, API 0.3):
the handler and the tasks it schedules claim parts from a shared counter until none
is left, and the handler returns when every part has finished. The handler takes
parts itself, so a pool with no free thread (or one thread) only makes it slower; the
shared state is freed by whichever of the handler and its tasks lets go last, so a
task XLA starts after the call returned finds nothing to do and touches nothing else.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import inspect
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import jax
import numba
import numpy as np
from llvmlite import binding as llvm_binding
from numba import types
from numpy.typing import DTypeLike

from ..._numba import cfunc as _cfunc  # noqa: F401  (generated handlers use it)
from ..._numba import compile_lock, njit, source_stamp
from ._ffi_abi import (  # noqa: F401  (generated handlers use these names)
    _API_ERROR_CREATE,
    _BUF_DATA,
    _BUF_SIZE,
    _BUFS_N,
    _BUFS_SIZE,
    _CF_API,
    _CF_ARGS,
    _CF_CTX,
    _CF_RETS,
    _CF_SIZE,
    _DTYPE_CODES,
    _ERR_ARGS_SIZE,
    _ERR_INTERNAL,
    _ERR_INVALID_ARGUMENT,
    _EXT_TYPE,
    _EXTENSION_METADATA,
    _HALF_FLOATS,
    _MD_MAJOR,
    _MD_MINOR,
    _MD_SIZE,
    _MD_VERSION,
    _MDX_METADATA,
    _MDX_SIZE,
    _RUN,
    _STAGE_EXECUTE,
    _TYPE_BUFFER,
    _VERSION_SIZE,
    _Api,
    _ApiVersion,
    _Attrs,
    _Buffer,
    _buffer,
    _buffer_ok,
    _Buffers,
    _call_task,
    _CallFrame,
    _can_report,
    _data,
    _dim,
    _ErrorCreateArgs,
    _ExtensionBase,
    _load_i32,
    _load_i64,
    _load_symbol,
    _make_error,
    _Metadata,
    _MetadataExtension,
    _njit,
    _off,
    _prologue,
    _store_i32,
    _store_i64,
    _struct_size,
    _voidptr,
)
from ._ffi_source import Signature, handler_source
from ._ffi_split import (  # noqa: F401  (generated split handlers use these names)
    _split_begin,
    _split_claim,
    _split_done,
    _split_end,
    _split_release,
    _split_schedule,
)
from ._vector import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    TABLE_FORMATS,
    add_scaled_from,
    copy_table,
    row_address,
)

# --------------------------------------------------------------------------------------
# Handler generation and registration.
# --------------------------------------------------------------------------------------
Spec = tuple[DTypeLike, int]  # (dtype, rank >= 1) of one operand or result


CACHE_DIR_ENV = "TILECORE_CACHE_DIR"


def _cache_dir() -> pathlib.Path | None:
    """Where generated handler modules (and numba's cache of them) live, if writable."""
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tilecore")
    path = pathlib.Path(base) / "ffi"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def _kernel_sources(kernel: Any) -> list[str]:
    """Every source a compiled handler depends on: the kernel's file and all of
    tilecore's numba code (`source_stamp`; a helper the kernel calls, changed, must
    change the key: numba's own cache only watches the generated handler file)."""
    py_func = getattr(kernel, "py_func", kernel)
    kernel_file = pathlib.Path(inspect.getsourcefile(py_func) or __file__)
    return [f"{kernel_file.name}\n{kernel_file.read_text()}", source_stamp()]


def _task_symbol(name: str) -> str:
    """The process symbol through which `name`'s handler finds its task (`_load_symbol`)."""
    return f"tilecore_ffi_task_{name}"


def _compiled_handler(name: str, kernel: Any, args: Signature, rets: Signature,
                      split: bool = False, variadic: str | None = None) -> Any:
    """The cfunc handler of `kernel`, compiled from a generated module numba can cache.

    The handler's source is generated per signature. Written to a file named by the
    hash of everything it depends on, numba caches its machine code across
    processes (compiling a handler costs 1 to 6 s cold); without a writable cache
    directory, or for a kernel that is not a module-level name, the source is
    compiled in memory instead. A `split` handler's task address differs in every
    process, so it is never compiled in: the handler reads it from a cell registered
    as a process symbol before the handler is loaded, set once the task is.
    """
    symbol = _task_symbol(name)
    if split:
        cell = _TASK_CELLS.setdefault(name, ctypes.c_int64(0))
        llvm_binding.add_symbol(symbol, ctypes.addressof(cell))
    py_func = getattr(kernel, "py_func", kernel)
    directory = _cache_dir()
    importable = (py_func.__qualname__ == py_func.__name__
                  and getattr(sys.modules.get(py_func.__module__), py_func.__name__, None)
                  is kernel)
    if directory is None or not importable:
        body = handler_source(name, args, rets, split, symbol, cache=False, variadic=variadic)
        scope = dict(globals(), _kernel=kernel)
        exec(compile(body, f"<tilecore ffi handler {name}>", "exec"), scope)
        if split:
            _TASK_CELLS[name].value = scope["task"].address
            _TASKS[name] = scope["task"]
        return numba.cfunc(types.int64(types.int64))(scope["handler"])
    body = handler_source(name, args, rets, split, symbol, variadic=variadic)
    header = (
        "import numba\nimport numpy as np\nfrom numba import types\n"
        "import tilecore.ops.cpu._ffi as _ffi\n"
        "globals().update({k: v for k, v in vars(_ffi).items() if k.startswith('_')"
        " and not k.startswith('__')})\n"
        f"from {py_func.__module__} import {py_func.__name__} as _kernel\n\n"
    )
    source = header + body + "\n\nhandler = _cfunc(types.int64(types.int64), cache=True)(handler)\n"
    digest = hashlib.sha256("\0".join([
        source, *_kernel_sources(py_func), numba.__version__, jax.__version__]
    ).encode()).hexdigest()[:16]
    path = directory / f"{name}_{digest}.py"
    write_source(path, source)
    spec = importlib.util.spec_from_file_location(f"_tilecore_ffi_{name}_{digest}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba finds (and re-imports) a cached function's module
    with compile_lock(str(path.with_suffix(".lock"))):  # one process compiles, the rest load
        spec.loader.exec_module(module)
    if split:
        _TASK_CELLS[name].value = module.task.address
    return module.handler


def write_source(path: pathlib.Path, source: str) -> None:
    """Make the generated module `path` in the cache directory hold `source`.

    Its name is a digest of `source`, so a file there with other text is damage (a
    truncated or emptied file, a directory in its place): it is replaced, saying so,
    where importing it failed in every later process. Written atomically: concurrent
    processes may race here.
    """
    try:
        if path.read_text() == source:
            return
        damaged = True
    except FileNotFoundError:
        damaged = False
    except (OSError, UnicodeDecodeError):
        damaged = True
    if damaged:
        warnings.warn(f"tilecore: the generated kernel module {path} is damaged; writing it "
                      "again.", RuntimeWarning, stacklevel=3)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        f.write(source)
    os.replace(f.name, path)


class FfiKernel:
    """A numba kernel that jitted JAX code calls as the typed-FFI target `name`.

    `kernel(*operands, *results) -> int` receives C-contiguous numpy views of the XLA
    buffers and returns 0, or nonzero to make XLA raise. Compilation and
    registration happen on first use, once per process.

    A `split` kernel takes two more arguments, `(part, parts)`, and must write only its
    own share of the results, the `parts` calls together writing all of them (disjoint
    output rows, say): the handler runs one part per thread of XLA's pool
    (`XLA_FFI_ThreadPool_Schedule`), this thread taking parts too, so every part runs
    even if no other thread is ever free, and returns when all have finished. XLA runs
    the calls of one program one after another, so without this a kernel uses one core.

    A kernel `variadic` in its "operands" (or "results") takes one or more of them for the
    last spec of that group, as many as the call passes: the kernel receives them as one
    int64 array `[n, 1 + rank]` of each one's address and dimensions, in their place
    (every feature's activations written, or its gradients read, in one pass, say, where
    XLA would otherwise copy them out of or into one block).
    """

    def __init__(self, name: str, kernel: Callable[..., Any], args: Sequence[Spec],
                 rets: Sequence[Spec], split: bool = False, variadic: str | None = None):
        self.name = name
        self.kernel = kernel
        self.split = split
        self.variadic = variadic
        self.args = tuple((np.dtype(d), int(n)) for d, n in args)
        self.rets = tuple((np.dtype(d), int(n)) for d, n in rets)
        if any(n < 1 for _, n in self.args + self.rets):
            raise ValueError("FFI kernel operands and results must have rank >= 1")
        if variadic not in (None, "operands", "results"):
            raise ValueError(f"variadic must be None, 'operands' or 'results', got {variadic!r}")
        if variadic and not (self.args if variadic == "operands" else self.rets):
            raise ValueError(f"a kernel variadic in its {variadic} needs their last spec")

    def ensure_registered(self) -> None:
        with _LOCK:
            known = _REGISTERED.get(self.name)
            if known is not None:
                if known[0] != (self.args, self.rets, self.variadic):
                    raise ValueError(f"FFI target {self.name!r} is already registered with "
                                     "different operand or result types")
                return
            handler = _compiled_handler(self.name, self.kernel, self.args, self.rets,
                                        self.split, self.variadic)
            jax.devices("cpu")  # start the backend so a refused handler raises right here
            jax.ffi.register_ffi_target(self.name, jax.ffi.pycapsule(handler.address),
                                        platform="cpu")
            # XLA keeps the raw function pointer forever: so must we (the cfunc owns the code).
            _REGISTERED[self.name] = ((self.args, self.rets, self.variadic), handler)

    def __call__(self, *operands: Any, results: Sequence[jax.ShapeDtypeStruct],
                 input_output_aliases: dict[int, int] | None = None) -> Any:
        """Call the kernel (inside or outside `jax.jit`); returns a list of result arrays."""
        args, rets = self.args, self.rets
        if self.variadic == "operands":  # the last spec, once per operand from there on
            args = _repeat_last(self.name, "operands", args, len(operands))
        if self.variadic == "results":
            rets = _repeat_last(self.name, "results", rets, len(results))
        for label, values, specs in (("operand", operands, args),
                                     ("result", results, rets)):
            if len(values) != len(specs):
                raise TypeError(f"{self.name} takes {len(specs)} {label}s, got {len(values)}")
            for i, (value, (dtype, ndim)) in enumerate(zip(values, specs, strict=True)):
                if np.dtype(value.dtype) != dtype or len(value.shape) != ndim:
                    raise TypeError(f"{self.name}: {label} {i} must be {dtype.name} of rank "
                                    f"{ndim}, got {np.dtype(value.dtype).name}{list(value.shape)}")
        self.ensure_registered()
        # Under `jax.vmap` the kernel runs once per batch element (its buffers know no
        # batch axis); without a method JAX refused to vmap it at all, where XLA's ops map.
        call = jax.ffi.ffi_call(self.name, list(results), vmap_method="sequential",
                                input_output_aliases=input_output_aliases)
        return call(*operands)


def _repeat_last(name: str, label: str, specs: tuple[tuple[np.dtype, int], ...], count: int
                 ) -> tuple[tuple[np.dtype, int], ...]:
    """A variadic group's specs for a call with `count` buffers in it."""
    if count < len(specs):
        raise TypeError(f"{name} takes at least {len(specs)} {label}, got {count}")
    return specs + specs[-1:] * (count - len(specs))


# Survives `importlib.reload` (same module dict): a reload must neither re-register a name
# nor drop the only reference to a cfunc whose address XLA still holds.
_REGISTERED: dict[str, tuple[Any, Any]] = globals().get("_REGISTERED", {})
_LOCK: threading.Lock = globals().get("_LOCK") or threading.Lock()
_TASK_CELLS: dict[str, ctypes.c_int64] = globals().get("_TASK_CELLS", {})
"""Target name → the cell its split handler reads its task's address from (a registered
process symbol: kept for the life of the process, as XLA keeps the handler)."""
_TASKS: dict[str, Any] = globals().get("_TASKS", {})
"""Tasks compiled in memory (no cache directory), kept alive for the same reason."""


def register_kernel(name: str, kernel: Callable[..., Any], args: Sequence[Spec],
                    rets: Sequence[Spec], split: bool = False, variadic: str | None = None
                    ) -> FfiKernel:
    """Declare `kernel` as typed-FFI target `name` (compiled and registered on first call);
    `split`: run in parts on XLA's threads; `variadic` ("operands" or "results"): that
    group's last spec repeats (see `FfiKernel`)."""
    return FfiKernel(name, kernel, args, rets, split, variadic)


# --------------------------------------------------------------------------------------
# Kernels.
# --------------------------------------------------------------------------------------
_kernel_jit = njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@_kernel_jit
def _gather_pool_kernel(table, row, seg, w, out):
    """out[seg[i]] += w[i] * table[row[i]]; entries with seg or row out of range are skipped."""
    return _gather_pool(table, row, seg, w, out, FLOAT32)


@_kernel_jit
def _gather_pool_bf16(table, row, seg, w, out):
    """`_gather_pool_kernel` of a bfloat16 table (its uint16 bits)."""
    return _gather_pool(table, row, seg, w, out, BFLOAT16)


@_kernel_jit
def _gather_pool_f16(table, row, seg, w, out):
    """`_gather_pool_kernel` of a float16 table (its uint16 bits)."""
    return _gather_pool(table, row, seg, w, out, FLOAT16)


@_kernel_jit
def _gather_pool(table, row, seg, w, out, source_format):
    num_rows, dim = table.shape
    num_segments = out.shape[0]
    if out.shape[1] != dim:
        return 1
    out[:] = 0.0
    for i in range(min(row.shape[0], seg.shape[0], w.shape[0])):
        s, r = seg[i], row[i]
        if s < 0 or s >= num_segments or r < 0 or r >= num_rows:
            continue
        add_scaled_from(row_address(out, s), row_address(table, r), w[i], dim, source_format)
    return 0


@_kernel_jit
def _scatter_add_rows_kernel(table, rows, delta, out):
    """out = table with out[rows[i]] += delta[i]; in place when `out` aliases `table`."""
    num_rows, dim = table.shape
    if out.shape[0] != num_rows or out.shape[1] != dim or delta.shape[1] != dim:
        return 1
    if out.ctypes.data != table.ctypes.data:  # not aliased (never expected): copy first
        copy_table(out, table)
    for i in range(min(rows.shape[0], delta.shape[0])):
        r = rows[i]
        if 0 <= r < num_rows:
            for d in range(dim):
                out[r, d] += delta[i, d]
    return 0


_f32, _i32t = np.float32, np.int32
_POOL_KERNELS = {FLOAT32: _gather_pool_kernel, BFLOAT16: _gather_pool_bf16,
                 FLOAT16: _gather_pool_f16}
GATHER_POOL = {t: register_kernel(
    f"tilecore_gather_pool{suffix}", _POOL_KERNELS[source_format],
    args=[(t, 2), (_i32t, 1), (_i32t, 1), (_f32, 1)], rets=[(_f32, 2)])
    for t, (suffix, source_format) in TABLE_FORMATS.items()}
"""Table dtype → the pooling kernel of its rows (float32, bfloat16, float16)."""
SCATTER_ADD_ROWS = register_kernel("tilecore_scatter_add_rows", _scatter_add_rows_kernel,
                                   args=[(_f32, 2), (_i32t, 1), (_f32, 2)], rets=[(_f32, 2)])


def gather_pool(table: jax.Array, row: jax.Array, seg: jax.Array, w: jax.Array,
                num_segments: int) -> jax.Array:
    """`segment_sum(table[row] * w[:, None], seg, num_segments)` without the [n, D] gather.

    Entries with `seg` outside `[0, num_segments)` (e.g. -1 padding) or `row` outside
    the table contribute nothing.
    """
    out = jax.ShapeDtypeStruct((num_segments, table.shape[1]), np.float32)
    return GATHER_POOL[np.dtype(table.dtype)](table, row, seg, w, results=[out])[0]


def scatter_add_rows(table: jax.Array, rows: jax.Array, delta: jax.Array) -> jax.Array:
    """`table.at[rows].add(delta, mode="drop")`, in place when `table` is donated."""
    out = jax.ShapeDtypeStruct(table.shape, table.dtype)
    return SCATTER_ADD_ROWS(table, rows, delta, results=[out], input_output_aliases={0: 0})[0]


# --------------------------------------------------------------------------------------
# Availability.
# --------------------------------------------------------------------------------------
@cache
def unavailable_reason() -> str | None:
    """None when the FFI route works in this process, else why not (callers fall back to XLA).

    Checks the platform, the jax API, then runs both kernels once on tiny inputs and
    compares with numpy (a layout mismatch shows up as an XLA error or a wrong answer).
    """
    if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return "needs a 64-bit little-endian host"
    if not all(hasattr(jax.ffi, f) for f in ("ffi_call", "register_ffi_target", "pycapsule")):
        return f"jax {jax.__version__} lacks jax.ffi.ffi_call/register_ffi_target"
    try:
        # A device of this process: with several processes `jax.devices()` lists every
        # process's devices, and process 0's device cannot run this process's probe.
        cpu = jax.local_devices(backend="cpu")[0]
        rng = np.random.default_rng(0)
        table = rng.standard_normal((5, 3)).astype(np.float32)
        row = np.array([0, 4, 2, 1], np.int32)
        seg = np.array([1, -1, 0, 1], np.int32)
        w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
        # Evaluate now even when first asked while a jit is being traced.
        with jax.ensure_compile_time_eval(), jax.default_device(cpu):
            pooled = np.asarray(jax.jit(gather_pool, static_argnums=4)(table, row, seg, w, 2))
            added = np.asarray(jax.jit(scatter_add_rows)(table, row[:2], table[:2]))
        expected_pool = np.stack([3 * table[2], table[0] + 4 * table[1]])
        expected_add = table.copy()
        expected_add[[0, 4]] += table[:2]
        if not (np.allclose(pooled, expected_pool, atol=1e-5)
                and np.allclose(added, expected_add, atol=1e-5)):
            return "the FFI probe kernels returned wrong values (XLA FFI layout mismatch?)"
    except Exception as error:  # any failure means: use the XLA path
        return f"XLA FFI registration or probe call failed: {type(error).__name__}: {error}"
    return None
