"""Recycled memory for output buffers.

Every batch returns fresh arrays, but touching freshly mapped memory costs a page
fault per 4 KiB, which on virtualised hosts costs as much as packing the data.
Output arrays are therefore carved out of pooled blocks: a block goes back to the
pool only when every array carved from it has been garbage collected, so reuse
can never alias memory a caller still holds.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence

import numpy as np

_ALIGN = 64
_GRANULE = 1 << 16
MAX_POOLED_BYTES = 1 << 30

_lock = threading.Lock()
_free: dict[int, list[np.ndarray]] = {}
_pooled_bytes = 0


def _release(block: np.ndarray) -> None:
    global _pooled_bytes
    with _lock:
        if _pooled_bytes + block.nbytes <= MAX_POOLED_BYTES:
            _free.setdefault(block.nbytes, []).append(block)
            _pooled_bytes += block.nbytes


def _size_class(nbytes: int) -> int:
    """`nbytes` rounded up to one of four sizes per power of two (granule multiples),
    so arrays whose length varies a little from batch to batch share pooled blocks."""
    size = -(-max(nbytes, 1) // _GRANULE) * _GRANULE
    step = max(_GRANULE, 1 << max(0, size.bit_length() - 3))
    return -(-size // step) * step


def _acquire(nbytes: int) -> np.ndarray:
    global _pooled_bytes
    size = _size_class(nbytes)
    with _lock:
        blocks = _free.get(size)
        if blocks:
            _pooled_bytes -= size
            return blocks.pop()
    return np.empty(size, np.uint8)


class _Block(np.ndarray):
    """A pooled block's view that carved arrays keep alive (numpy stops collapsing
    view chains at a change of array type, so this object lives exactly as long as
    any carved array does)."""


def allocate(specs: Sequence[tuple[tuple[int, ...], type[np.generic]]]) -> list[np.ndarray]:
    """Uninitialised arrays of the given (shape, dtype)s, sharing one recycled block."""
    layout, total = [], 0
    for shape, dtype in specs:
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        layout.append((total, nbytes, shape, dt))
        total += -(-nbytes // _ALIGN) * _ALIGN
    block = _acquire(total)
    whole = block.view(_Block)
    weakref.finalize(whole, _release, block)
    return [
        whole[offset:offset + nbytes].view(dt).reshape(shape).view(np.ndarray)
        for offset, nbytes, shape, dt in layout
    ]
