"""Shared-memory slots that carry the input workers' batches to the main process.

What crosses: a worker pickles a batch's device-bound part with protocol 5 and
out-of-band buffers. The pickle itself (structure, dtypes, shapes: a few hundred
bytes) and the buffers' offsets go over the pipe; the arrays' bytes are copied
once, by the worker, into a slot (64-byte aligned). The main process unpickles
with read-only views of the slot as the buffers, so its arrays are views: no
copy, no pickling of array data. Pickle is the descriptor so that no hand-kept
list of `HostBatch`'s arrays can drift from the real one.

Where: files in a private directory (`/dev/shm` where it exists, else the
temporary directory), mapped with `mmap`. Not `multiprocessing.shared_memory`:
the workers are not `multiprocessing` children, and before Python 3.13 every
`SharedMemory`, attached or created, registers with a resource tracker process
that unlinks or warns about segments at its own exit. A directory of our own is
one thing to remove on every exit path, and a file can be unlinked as soon as
the main process has mapped it: after that no name is left to leak.

Lifetime (the rule): the main process lends a free slot with each request, the
worker writes the batch into it, and the slot becomes free again only when the
last array viewing it is gone (weak references to the byte arrays that the
batch's arrays were unpickled from, which they keep alive through their
`base`), not when a transfer returns: `jax.device_put` on CPU aliases
aligned host memory, even with `may_alias=False` (jax-ml/jax#37830), so device
arrays may view the slot for as long as they live; on a GPU, JAX holds the host
arrays until the copy is done. A worker never writes into memory that anything
can still read. Whoever keeps a batch keeps its slot; the next request then gets
a new slot (the ring grows, it never waits), so holding batches costs memory but
cannot deadlock or corrupt.

Sizes: a batch larger than its slot gets a new, 25% larger file for that slot. A
batch over `max_bytes`, or one that finds no space (`ENOSPC`: a small `/dev/shm`,
as in containers), travels inside the pickle instead (copied, slower, same
result). numpy and the standard library only: the workers import this module.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import pickle
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np

ALIGN = 64
"""Byte alignment of each array in a slot (what XLA's CPU client needs to alias it)."""


class Sent(NamedTuple):
    """What the worker sends for one batch: `meta` is the pickle; with a `name` its
    arrays lie in slot `slot`'s file at `spans` (offset, bytes), else inside `meta`."""

    slot: int
    name: str | None
    spans: tuple[tuple[int, int], ...]
    meta: bytes


class SlotWriter:
    """The worker's side: its slots' files under `directory`, written in place."""

    def __init__(self, directory: str, worker: int, *, max_bytes: int) -> None:
        self._directory, self._worker, self._max_bytes = directory, worker, max_bytes
        self._maps: dict[int, tuple[str, mmap.mmap]] = {}
        self._files = 0

    def write(self, slot: int, obj: Any) -> Sent:
        """`obj` written into `slot` (which the main process has lent, so no one reads it)."""
        buffers: list[pickle.PickleBuffer] = []
        meta = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        spans, end = [], 0
        for raw in raws:
            start = -(-end // ALIGN) * ALIGN
            spans.append((start, raw.nbytes))
            end = start + raw.nbytes
        try:
            name, memory = self._reserve(slot, end)
        except OSError:  # no room (over max_bytes, or ENOSPC): inside the pickle
            return Sent(slot, None, (), pickle.dumps(obj, protocol=5))
        with memoryview(memory) as view:
            for (start, size), raw in zip(spans, raws, strict=True):
                view[start:start + size] = raw
        return Sent(slot, name, tuple(spans), meta)

    def _reserve(self, slot: int, size: int) -> tuple[str, mmap.mmap]:
        """Slot `slot`'s file and mapping, made anew if it holds fewer than `size` bytes."""
        held = self._maps.get(slot)
        if held is not None and len(held[1]) >= size:
            return held
        if size > self._max_bytes:
            raise OSError(f"{size} bytes is over the slot limit of {self._max_bytes}")
        capacity = max(size + size // 4, mmap.PAGESIZE)
        self._files += 1
        name = f"w{self._worker}-{self._files}"
        path = os.path.join(self._directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):  # ENOSPC now, not SIGBUS at the first write
                os.posix_fallocate(fd, 0, capacity)
            else:
                os.ftruncate(fd, capacity)
            memory = mmap.mmap(fd, capacity)
        except OSError:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        self.drop(slot)
        self._maps[slot] = (name, memory)
        return name, memory

    def drop(self, slot: int) -> None:
        """Unmap slot `slot` and remove its file (if the main process has not yet)."""
        held = self._maps.pop(slot, None)
        if held is not None:
            _unlink(os.path.join(self._directory, held[0]))
            held[1].close()

    def close(self) -> None:
        """Drop every slot, and the directory if it is empty (the main process was killed)."""
        for slot in list(self._maps):
            self.drop(slot)
        with contextlib.suppress(OSError):
            os.rmdir(self._directory)


class SlotReader:
    """The main process's side of one worker's slots: lends them, maps them, takes them back."""

    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._views: dict[int, tuple[str, memoryview]] = {}
        self._free: collections.deque[int] = collections.deque()  # appended by any thread
        self._count = 0
        self._leases: dict[int, _Lease] = {}

    @property
    def slots(self) -> int:
        """Slots lent so far (the ring's size)."""
        return self._count

    @property
    def held(self) -> int:
        """Slots lent, not yet free: in the worker, or viewed by arrays still alive."""
        return self._count - len(self._free)

    def lend(self) -> int:
        """A free slot for the next request (a new one if none is free)."""
        try:
            return self._free.popleft()
        except IndexError:
            self._count += 1
            return self._count - 1

    def read(self, sent: Sent) -> Any:
        """The object `sent` describes; its arrays view the slot, which is free again once
        none of them is referenced any more."""
        if sent.name is None:
            self._free.append(sent.slot)
            return pickle.loads(sent.meta)
        held = self._views.get(sent.slot)
        if held is None or held[0] != sent.name:
            held = self._views[sent.slot] = (sent.name, self._map(sent.name))
        view = held[1]
        # A byte array per buffer: numpy exports it as itself, so every array unpickled
        # from it (and every view of those) keeps it alive; a PickleBuffer would not be.
        buffers = [np.frombuffer(view, np.uint8, size, start) for start, size in sent.spans]
        obj = pickle.loads(sent.meta, buffers=buffers)
        lease = _Lease(self, sent.slot)
        lease.watch(buffers)
        return obj

    def _map(self, name: str) -> memoryview:
        path = os.path.join(self._directory, name)
        fd = os.open(path, os.O_RDONLY)
        try:
            memory = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        _unlink(path)  # mapped by both sides now: no name left to leak
        return memoryview(memory)  # read-only; the old mapping lives on in views still alive

    def _release(self, lease: _Lease) -> None:
        self._leases.pop(lease.slot, None)
        self._free.append(lease.slot)


class _Lease:
    """Slot `slot` while arrays view it: frees it when the last of `buffers` dies."""

    def __init__(self, reader: SlotReader, slot: int) -> None:
        self.slot, self._reader = slot, reader
        self._lock = threading.Lock()
        self._refs: list[weakref.ref[np.ndarray]] = []
        self._left = 0

    def watch(self, buffers: list[np.ndarray]) -> None:
        self._reader._leases[self.slot] = self  # alive until released
        self._left = len(buffers)
        self._refs = [weakref.ref(b, self._dead) for b in buffers]
        if not buffers:
            self._reader._release(self)

    def _dead(self, _: object) -> None:
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            self._reader._release(self)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
