"""Per-thread scratch arrays reused across calls.

Sorting needs a few arrays as large as one SparseCore's entries. Allocating them
afresh every call costs a page fault per 4 KiB touched, which on virtualised
hosts is as expensive as the sort itself; each worker thread keeps its own
grow-only arrays instead, carved from the recycled blocks of `_buffers`. A task
whose result must outlive it takes its arrays over (`detach`): the thread's next
request gets another recycled block, and the taken one returns to the pool once
the result is dropped.
"""

from __future__ import annotations

import threading

import numpy as np

from ._buffers import allocate

_local = threading.local()


def _thread_buffers() -> dict[str, np.ndarray]:
    """This thread's scratch arrays by name."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    return buffers


def scratch(name: str, size: int, dtype: type[np.generic]) -> np.ndarray:
    """A `size`-element array of `dtype`, private to this thread, contents undefined."""
    buffers = _thread_buffers()
    buffer = buffers.get(name)
    if buffer is None or buffer.size < size or buffer.dtype != dtype:
        (buffer,) = allocate([((max(size, int(size * 1.25), 1024),), dtype)])
        buffers[name] = buffer
    return buffer[:size]


def detach(array: np.ndarray) -> np.ndarray:
    """`array`, a `scratch` array of this thread, made the caller's: the scratch it
    came from is no longer handed out (nothing is copied)."""
    buffers = _thread_buffers()
    for name, buffer in list(buffers.items()):
        if np.may_share_memory(buffer, array):  # distinct blocks: bounds tell them apart
            del buffers[name]
    return array
