"""Tables on transparent huge pages (Linux): one TLB entry per 2 MiB instead of per 4 KiB.

A lookup or update reads rows at random all over a table. On 4 KiB pages a table
larger than the TLB's reach (a few MiB) misses it on almost every row, and each miss
walks the page tables; on 2 MiB pages the TLB covers gigabytes. XLA allocates the
buffers, so the pages are asked for afterwards: `madvise(MADV_HUGEPAGE)` marks the
range, `madvise(MADV_COLLAPSE)` (Linux 6.1) moves it onto huge pages now, copying it
(about 2.5 s per GB on an AMD EPYC VM). Pages stay huge as long as the buffer does:
the training step donates the tables and this wing updates them in place.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator
from functools import cache
from typing import Any

import jax

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_THP = "/sys/kernel/mm/transparent_hugepage"


@cache
def _huge_page_bytes() -> int:
    """The size of a transparent huge page, or 0 where the kernel offers none."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open(f"{_THP}/enabled") as f:
            if "[never]" in f.read():
                return 0
        with open(f"{_THP}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


@cache
def _madvise() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def _cpu_buffers(trees: tuple[Any, ...]) -> Iterator[tuple[int, int]]:
    """(address, bytes) of every CPU buffer of the arrays in `trees`."""
    for leaf in jax.tree.leaves(trees):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform == "cpu" and shard.data.nbytes:
                yield shard.data.unsafe_buffer_pointer(), shard.data.nbytes


def collapse_to_huge_pages(*trees: Any) -> int:
    """Move the CPU buffers of the arrays in `trees` onto huge pages; the bytes moved.

    Only whole huge pages inside a buffer move (a buffer under 2 MiB stays as it is). 0
    where there are none to move to: not Linux, transparent huge pages off, or a kernel
    before 6.1 (then the ranges are still marked, for the kernel's background daemon).
    """
    size = _huge_page_bytes()
    if size == 0:
        return 0
    madvise = _madvise()
    moved = 0
    for address, nbytes in _cpu_buffers(trees):
        start = -(-address // size) * size
        stop = (address + nbytes) // size * size
        if stop <= start:
            continue
        if madvise(start, stop - start, _MADV_HUGEPAGE) != 0:
            continue
        if madvise(start, stop - start, _MADV_COLLAPSE) == 0:
            moved += stop - start
        elif ctypes.get_errno() == getattr(os, "EINVAL", 22):
            return moved  # no MADV_COLLAPSE in this kernel: the rest would fail alike
    return moved
