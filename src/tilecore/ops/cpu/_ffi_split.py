"""Split calls: one kernel call run in parts on the thread pool XLA lends FFI handlers
(see `_ffi.FfiKernel`). The generated split handler and its tasks (`_ffi_source`) call
these: the call's shared state (`_malloc`ed, reference-counted), claiming parts, and
waiting for the parts claimed by others.
"""

from __future__ import annotations

import ctypes

from llvmlite import binding as llvm_binding

from ._ffi_abi import (
    _atomic_add,
    _free,
    _load_i64,
    _malloc,
    _njit,
    _pool_threads,
    _schedule,
    _store_i64,
    _symbol_address,
    _yield_cpu,
)

_ACTIVE_SPLITS = "tilecore_ffi_active_split_calls"
"""Process symbol of the count of split calls running now: a call splits into the pool's
threads divided by that count, so devices that share the pool (several CPU devices in one
process) do not each claim all of it."""
if "_ACTIVE_CELL" not in globals():  # a reload keeps the cell loaded handlers point to
    _ACTIVE_CELL = ctypes.c_int64(0)
    llvm_binding.add_symbol(_ACTIVE_SPLITS, ctypes.addressof(_ACTIVE_CELL))

_SPLIT_HEADER = 5
"""Words (int64) ahead of the buffers in a split call's `_malloc`ed state: references (the
call, and each run of its task: the one it makes itself and the ones it scheduled; the
last to let go frees it), the next unclaimed part, the number of parts, parts finished,
parts failed. Each buffer's address and dimensions follow."""


@_njit
def _split_begin(api, ctx, words):
    """A split call's state of `words` words, header written, and its number of parts:
    (0, 0) when out of memory."""
    active = _symbol_address(_ACTIVE_SPLITS)
    parts = max(_pool_threads(api, ctx) // (_atomic_add(active, 1) + 1), 1)
    state = _malloc(8 * words)
    if state == 0:
        _atomic_add(active, -1)
        return 0, 0
    _store_i64(state, parts + 1)
    _store_i64(state + 8, 0)
    _store_i64(state + 16, parts)
    _store_i64(state + 24, 0)
    _store_i64(state + 32, 0)
    return state, parts


@_njit
def _split_schedule(api, ctx, task, state, parts):
    """One `task(state)` per part past the first on XLA's pool."""
    for _ in range(parts - 1):
        if not _schedule(api, ctx, task, state):
            _atomic_add(state, -1)  # never to run: drop its reference


@_njit
def _split_claim(state):
    """The next unclaimed part, or −1 when every part is taken."""
    part = _atomic_add(state + 8, 1)
    return part if part < _load_i64(state + 16) else -1


@_njit
def _split_done(state, failed):
    """Record a claimed part as finished (`failed`: it raised or returned nonzero)."""
    if failed:
        _atomic_add(state + 32, 1)
    _atomic_add(state + 24, 1)


@_njit
def _split_release(state):
    """Let go of the state; the last holder frees it."""
    if _atomic_add(state, -1) == 1:
        _free(state)


@_njit
def _split_end(state, parts):
    """Wait for every part, let go of the state and of the call's share of the pool; the
    number of parts that failed."""
    while _atomic_add(state + 24, 0) < parts:
        _yield_cpu()
    failed = _atomic_add(state + 32, 0)
    _split_release(state)
    _atomic_add(_symbol_address(_ACTIVE_SPLITS), -1)
    return failed
