"""The Python source of an FFI handler, generated per kernel signature (see `_ffi`).

A handler checks every buffer XLA passes (dtype, rank), views each as a numpy array
and calls the kernel inside a `try` (a numba exception escaping a cfunc would read as
success). A split handler (`_ffi.FfiKernel`) instead runs the kernel in parts with the
`_split_*` helpers of `_ffi_split`: its generated module adds `task`, which views the
buffers from their addresses and dimensions copied into the call's state and claims
parts, calling the kernel, until none is left. The handler only checks the buffers,
fills the state, schedules the task on XLA's threads and runs it itself too, through
its address: so the kernel is compiled into the task alone, not into the handler as
well (a kernel linked into a function is compiled again with it). Names the source
uses come from `_ffi`'s namespace.
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


VARIADIC_GROUPS = {"operands": (_CF_ARGS, 1), "results": (_CF_RETS, 2)}
"""A variadic group's call-frame offset and its code for `_prologue`."""


def _int(value: int | str) -> str:
    """`value` as the source of a plain int64 argument to a call-frame helper.

    numba compiles a jitted function once for each combination of literal integers it is
    called with (`_buffer(frame, 56, 3)` and `_buffer(frame, 56, 4)` are two compiles), and
    the generated handlers pass a constant for every buffer, dtype code, rank and axis: a
    15-buffer handler compiled `_buffer` 15 times, ~0.1 s each. `np.int64(3)` is typed
    int64, so each helper compiles once per process.
    """
    return f"np.int64({value})"


def handler_source(name: str, args: Signature, rets: Signature, split: bool = False,
                   task_symbol: str = "", cache: bool = True, variadic: str | None = None
                   ) -> str:
    """The module source defining `handler` for kernel `name` (checks and views unrolled);
    a `split` one also defines `task`, the handler reading the task's address from the
    process symbol `task_symbol` (compiled with numba's cache if `cache`). `variadic`
    ("operands" or "results"): the last spec of that group stands for one or more
    buffers, which the kernel receives as one int64 table `[n, 1 + rank]` of each one's
    address and dimensions, in that group's place (after the fixed ones)."""
    fixed_args = list(args[:-1]) if variadic == "operands" else list(args)
    fixed_rets = list(rets[:-1]) if variadic == "results" else list(rets)
    code = VARIADIC_GROUPS[variadic][1] if variadic else 0
    head = ["def handler(frame):",
            f"    status = _prologue(frame, {_int(len(fixed_args) + (variadic == 'operands'))}, "
            f"{_int(len(fixed_rets) + (variadic == 'results'))}, {_int(code)})",
            "    if status != _RUN:",
            "        return status",
            "    api = _load_i64(frame + _CF_API)"]
    checks, views, names, stores, task_views = _buffers(name, fixed_args, fixed_rets)
    tail: list[str] = []
    more: list[str] = []
    words: int | str = _SPLIT_HEADER + len(stores)
    if variadic:
        group = VARIADIC_GROUPS[variadic][0]
        first, spec = (len(fixed_args), args[-1]) if variadic == "operands" else (
            len(fixed_rets), rets[-1])
        checks += _variadic_checks(name, group, variadic, first, spec)
        names.insert(len(fixed_args) if variadic == "operands" else len(names), "vt")
        tail = _variadic_table(group, first, spec[1])
        word, width = _SPLIT_HEADER + len(stores), 1 + spec[1]
        more = _variadic_stores(group, word, first, spec[1])
        words = f"{word + 1} + {width} * nvar"
        task_views.append(f"    vt = numba.carray(_voidptr(state + {8 * (word + 1)}), "
                          f"(_load_i64(state + {8 * word}), {width}), np.int64)")
    every = ", ".join(names)
    if not split:
        return "\n".join(head + checks + views + tail + _serial_call(name, every))
    return "\n".join(_task(every, task_views, cache) + head + checks
                     + _split_call(name, stores, words, task_symbol, more))


def _variadic_checks(name: str, group: int, label: str, first: int,
                     spec: tuple[np.dtype, int]) -> list[str]:
    """Count the variadic buffers (`nvar`, from the group's buffer `first` on) and check each."""
    dtype, ndim = spec
    message = (f"{name}: {label[:-1]} {first} and every one after it must be a {dtype.name} "
               f"array of rank {ndim}")
    return [f"    nvar = _load_i64(frame + {group} + _BUFS_N) - {first}",
            "    for i in range(nvar):",
            f"        if not _buffer_ok(_buffer(frame, {_int(group)}, {first} + i), "
            f"{_int(_DTYPE_CODES[dtype])}, {_int(ndim)}):",
            f"            return _make_error(api, {_ERR_INVALID_ARGUMENT}, {message!r})"]


def _variadic_table(group: int, first: int, ndim: int) -> list[str]:
    """The serial handler's table `vt` of the variadic buffers (address, then dimensions)."""
    return [f"    vt = np.empty((nvar, {1 + ndim}), np.int64)",
            "    for i in range(nvar):",
            f"        b = _buffer(frame, {_int(group)}, {first} + i)",
            "        vt[i, 0] = _load_i64(b + _BUF_DATA)",
            f"        for axis in range({ndim}):",
            "            vt[i, 1 + axis] = _dim(b, axis)"]


def _variadic_stores(group: int, word: int, first: int, ndim: int) -> list[str]:
    """A split handler's statements storing the variadic count at state word `word` and each
    buffer's address and dimensions after it."""
    width = 1 + ndim
    return [f"    _store_i64(state + {8 * word}, nvar)",
            "    for i in range(nvar):",
            f"        b = _buffer(frame, {_int(group)}, {first} + i)",
            f"        _store_i64(state + {8 * (word + 1)} + {8 * width} * i, "
            "_load_i64(b + _BUF_DATA))",
            f"        for axis in range({ndim}):",
            f"            _store_i64(state + {8 * (word + 2)} + {8 * width} * i + 8 * axis, "
            "_dim(b, axis))"]


def _buffers(name: str, args: Signature, rets: Signature
             ) -> tuple[list[str], list[str], list[str], list[str], list[str]]:
    """Per buffer: the handler's check and view, the view's name, the state words a split
    call stores for it (address, then dimensions) and the task's view of them."""
    checks: list[str] = []
    views: list[str] = []
    names: list[str] = []
    stores: list[str] = []
    task_views: list[str] = []
    for group, label, specs in ((_CF_ARGS, "operand", args), (_CF_RETS, "result", rets)):
        for i, (dtype, ndim) in enumerate(specs):
            buffer, view = f"{label[0]}{i}", f"v{len(names)}"
            message = f"{name}: {label} {i} must be a {dtype.name} array of rank {ndim}"
            element = "uint16" if dtype in _HALF_FLOATS else dtype.name
            shape = ", ".join(f"_dim({buffer}, {_int(axis)})" for axis in range(ndim))
            checks += [f"    {buffer} = _buffer(frame, {_int(group)}, {_int(i)})",
                       f"    if not _buffer_ok({buffer}, {_int(_DTYPE_CODES[dtype])}, "
                       f"{_int(ndim)}):",
                       f"        return _make_error(api, {_ERR_INVALID_ARGUMENT}, {message!r})"]
            views.append(f"    {view} = numba.carray(_data({buffer}), ({shape},), np.{element})")
            word = _SPLIT_HEADER + len(stores)
            stores += [f"_load_i64({buffer} + _BUF_DATA)",
                       *(f"_dim({buffer}, {_int(axis)})" for axis in range(ndim))]
            dims = ", ".join(f"_load_i64(state + {8 * (word + 1 + axis)})" for axis in range(ndim))
            task_views.append(f"    {view} = numba.carray(_voidptr(_load_i64(state + {8 * word})),"
                              f" ({dims},), np.{element})")
            names.append(view)
    return checks, views, names, stores, task_views


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


def _split_call(name: str, stores: list[str], words: int | str, task_symbol: str,
                more: Sequence[str] = ()) -> list[str]:
    return ["    ctx = _load_i64(frame + _CF_CTX)",
            f"    state, parts = _split_begin(api, ctx, {_int(words)})",
            "    if state == 0:",
            f"        return _make_error(api, {_ERR_INTERNAL}, "
            f"{name + ': no memory for the state of a split call'!r})",
            *(f"    _store_i64(state + {8 * (_SPLIT_HEADER + k)}, {value})"
              for k, value in enumerate(stores)),
            *more,
            f"    task = _load_symbol({task_symbol!r})",
            "    _split_schedule(api, ctx, task, state, parts)",
            "    _call_task(task, state)",
            "    if _split_end(state, parts) != 0:",
            f"        return _make_error(api, {_ERR_INTERNAL}, "
            f"{name + ': kernel raised or rejected its operands in a part'!r})",
            "    return 0"]


def _task(every: str, task_views: list[str], cache: bool) -> list[str]:
    return ["def task(state):",
            *task_views,
            "    parts = _load_i64(state + 16)",
            "    while True:",
            "        part = _split_claim(state)",
            "        if part < 0:",
            "            break",
            "        try:",
            f"            status = _kernel({every}, part, parts)",
            "        except Exception:",
            "            status = -1",
            "        _split_done(state, status != 0)",
            "    _split_release(state)",
            "",
            "",
            f"task = _cfunc(types.void(types.int64), cache={cache})(task)",
            "",
            ""]
