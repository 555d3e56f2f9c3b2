"""The Python source of an FFI handler, generated per kernel signature (see `_ffi`).

A handler checks every buffer XLA passes (dtype, rank), views each as a numpy array
and calls the kernel inside a `try` (a numba exception escaping a cfunc would read as
success). A split handler (`_ffi.FfiKernel`) instead runs the kernel in parts with the
`_split_*` helpers of `_ffi_split`: its generated module adds `run` (claim parts and call
the kernel until none is left) and `task` (the same, on one of XLA's threads, from the
buffers' addresses and dimensions copied into the call's state). Names the source uses
come from `_ffi`'s namespace.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._ffi_abi import (
    _CF_ARGS,
    _CF_RETS,
    _DTYPE_CODES,
    _ERR_INTERNAL,
    _ERR_INVALID_ARGUMENT,
    _HALF_FLOATS,
)
from ._ffi_split import _SPLIT_HEADER

Signature = Sequence[tuple[np.dtype, int]]  # (dtype, rank) of each operand or result


def handler_source(name: str, args: Signature, rets: Signature, split: bool = False,
                   task_symbol: str = "", cache: bool = True) -> str:
    """The module source defining `handler` for kernel `name` (checks and views unrolled);
    a `split` one also defines `run` and `task`, the handler reading the task's address
    from the process symbol `task_symbol` (compiled with numba's cache if `cache`)."""
    head = ["def handler(frame):",
            f"    status = _prologue(frame, {len(args)}, {len(rets)})",
            "    if status != _RUN:",
            "        return status",
            "    api = _load_i64(frame + _CF_API)"]
    checks, views, stores, task_views = _buffers(name, args, rets)
    every = ", ".join(views)
    if not split:
        return "\n".join(head + checks + _serial_call(name, every))
    words = _SPLIT_HEADER + len(stores)
    return "\n".join(_split_functions(every, task_views, cache) + head + checks
                     + _split_call(name, every, stores, words, task_symbol))


def _buffers(name: str, args: Signature, rets: Signature
             ) -> tuple[list[str], list[str], list[str], list[str]]:
    """Per buffer: the handler's check and view, the state words a split call stores for it
    (address, then dimensions) and the task's view of them."""
    checks: list[str] = []
    views: list[str] = []
    stores: list[str] = []
    task_views: list[str] = []
    for group, label, specs in ((_CF_ARGS, "operand", args), (_CF_RETS, "result", rets)):
        for i, (dtype, ndim) in enumerate(specs):
            buffer, view = f"{label[0]}{i}", f"v{len(views)}"
            message = f"{name}: {label} {i} must be a {dtype.name} array of rank {ndim}"
            element = "uint16" if dtype in _HALF_FLOATS else dtype.name
            shape = ", ".join(f"_dim({buffer}, {axis})" for axis in range(ndim))
            checks += [f"    {buffer} = _buffer(frame, {group}, {i})",
                       f"    if not _buffer_ok({buffer}, {_DTYPE_CODES[dtype]}, {ndim}):",
                       f"        return _make_error(api, {_ERR_INVALID_ARGUMENT}, {message!r})",
                       f"    {view} = numba.carray(_data({buffer}), ({shape},), np.{element})"]
            word = _SPLIT_HEADER + len(stores)
            stores += [f"_load_i64({buffer} + _BUF_DATA)",
                       *(f"_dim({buffer}, {axis})" for axis in range(ndim))]
            dims = ", ".join(f"_load_i64(state + {8 * (word + 1 + axis)})" for axis in range(ndim))
            task_views.append(f"    {view} = numba.carray(_voidptr(_load_i64(state + {8 * word})),"
                              f" ({dims},), np.{element})")
            views.append(view)
    return checks, views, stores, task_views


def _serial_call(name: str, every: str) -> list[str]:
    # The views are made before the `try`, which then holds the one call: numba lowers
    # every call inside a `try` with its own exception branches, and a `try` around the
    # views' calls too cost 4 of the 6.5 s a 15-buffer handler took to compile.
    return ["    try:",
            f"        status = _kernel({every})",
            "    except Exception:",
            f"        return _make_error(api, {_ERR_INTERNAL}, {name + ': kernel raised'!r})",
            "    if status != 0:",
            f"        return _make_error(api, {_ERR_INVALID_ARGUMENT}, "
            f"{name + ': kernel rejected its operands (shape mismatch)'!r})",
            "    return 0"]


def _split_call(name: str, every: str, stores: list[str], words: int, task_symbol: str
                ) -> list[str]:
    return ["    ctx = _load_i64(frame + _CF_CTX)",
            f"    state, parts = _split_begin(api, ctx, {words})",
            "    if state == 0:",
            f"        return _make_error(api, {_ERR_INTERNAL}, "
            f"{name + ': no memory for the state of a split call'!r})",
            *(f"    _store_i64(state + {8 * (_SPLIT_HEADER + k)}, {value})"
              for k, value in enumerate(stores)),
            f"    _split_schedule(api, ctx, _load_symbol({task_symbol!r}), state, parts)",
            f"    run(state, {every})",
            "    if _split_end(state, parts) != 0:",
            f"        return _make_error(api, {_ERR_INTERNAL}, "
            f"{name + ': kernel raised or rejected its operands in a part'!r})",
            "    return 0"]


def _split_functions(every: str, task_views: list[str], cache: bool) -> list[str]:
    return [f"def run(state, {every}):",
            "    parts = _load_i64(state + 16)",
            "    while True:",
            "        part = _split_claim(state)",
            "        if part < 0:",
            "            return",
            "        try:",
            f"            status = _kernel({every}, part, parts)",
            "        except Exception:",
            "            status = -1",
            "        _split_done(state, status != 0)",
            "",
            "",
            "def task(state):",
            *task_views,
            f"    run(state, {every})",
            "    _split_release(state)",
            "",
            "",
            f"run = numba.njit(nogil=True, cache={cache}, error_model='numpy')(run)",
            f"task = numba.cfunc(types.void(types.int64), cache={cache})(task)",
            "",
            ""]
