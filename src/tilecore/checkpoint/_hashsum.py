"""A checksum of an array that any process can take from the shards it holds.

`hashsum64(array)` is the sum, mod 2**64, over every element of a 64-bit hash of
the element's flat index in the whole (global) array and its bytes:

    hashsum64(a) = Σ_i h(i, bytes(a.flat[i]))  mod 2**64
    h(i, b) = mix(… mix(mix(i · φ) ^ w_0) ^ w_1 …)   (w_k: b's little-endian 64-bit words)

with `mix` the splitmix64 finalizer, a bijection of 64-bit integers. A sum does not
depend on the order of its terms, so it is the same whatever shards the array is
cut into (rows, columns, any mesh, any device or process count): each process sums
the elements of the shards it holds (`local_sum`, one replica of each), and the
processes add their sums (`process_sums`). Damage to the bytes of one element always
changes the sum (its term is a bijection of each word); damage to several is missed
with probability about 2**-64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_CHUNK_WORDS = 1 << 20
"""Elements hashed at a time (bounds the temporary memory to a few MiB)."""
MOD = 1 << 64


def _mix(x: np.ndarray) -> None:
    """splitmix64's finalizer, in place."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31


def _words(block: np.ndarray) -> np.ndarray:
    """`block`'s elements as little-endian 64-bit words, zero-padded: `[n, k]`."""
    flat = np.ascontiguousarray(block).reshape(-1)
    size = flat.dtype.itemsize
    if size in (1, 2, 4, 8):
        return flat.view(f"<u{size}").astype(np.uint64).reshape(-1, 1)
    raw = flat.view(np.uint8).reshape(len(flat), size)
    padded = np.zeros((len(flat), -(-size // 8) * 8), np.uint8)
    padded[:, :size] = raw
    return padded.view("<u8")


def _c_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


def block_sum(block: np.ndarray, start: Sequence[int], shape: Sequence[int]) -> int:
    """The sum over `block`, the part of a `shape` array starting at index `start`."""
    block = np.asarray(block)
    if block.dtype.byteorder == ">":
        block = block.astype(block.dtype.newbyteorder("<"))
    if block.ndim == 0:
        block, start, shape = block.reshape(1), (0,), (1,)
    if block.size == 0:
        return 0
    strides = _c_strides(shape)
    inner = np.zeros(block.shape[1:], np.uint64)
    for axis, (first, n) in enumerate(zip(start[1:], block.shape[1:], strict=True), 1):
        offsets = (np.arange(first, first + n, dtype=np.uint64) * np.uint64(strides[axis]))
        inner += offsets.reshape((n,) + (1,) * (block.ndim - 1 - axis))
    inner = inner.reshape(-1)
    rows = max(1, _CHUNK_WORDS // max(1, inner.size))
    total = 0
    for r in range(0, block.shape[0], rows):
        part = block[r:r + rows]
        row_index = np.arange(start[0] + r, start[0] + r + len(part), dtype=np.uint64)
        h = (row_index * np.uint64(strides[0]))[:, None] + inner[None, :]
        h = h.reshape(-1)
        h *= _GOLDEN
        _mix(h)
        for word in _words(part).T:
            h ^= word
            _mix(h)
        total += int(h.sum(dtype=np.uint64))
    return total % MOD


def local_sum(value: Any) -> int:
    """This process's part of `value`'s sum: all of a host array, or the shards of a
    jax array on this process's devices, each replicated shard counted once
    (`replica_id == 0`: held by exactly one device of the job)."""
    if not isinstance(value, jax.Array):
        return block_sum(np.asarray(value), (0,) * np.ndim(value), np.shape(value))
    total = 0
    for shard in value.addressable_shards:
        if shard.replica_id != 0:
            continue
        start = [0 if s.start is None else s.start for s in shard.index]
        start += [0] * (value.ndim - len(start))
        total += block_sum(np.asarray(shard.data), start, value.shape)
    return total % MOD


def process_sums(parts: Sequence[int]) -> list[int]:
    """Each of `parts` summed over every process of the job (a collective: every
    process calls it with as many parts, in the same order)."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1 or not parts:
        return [p % MOD for p in parts]
    halves = np.array([[p & 0xFFFFFFFF, (p >> 32) & 0xFFFFFFFF] for p in parts], np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(halves))  # [process, part, 2]
    return [sum(int(lo) | int(hi) << 32 for lo, hi in gathered[:, i]) % MOD
            for i in range(len(parts))]


def hashsum64(value: Any) -> int:
    """`value`'s sum, whole: added over processes when `value` spans several (then a
    collective, which every process must call for the same array)."""
    part = local_sum(value)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return process_sums([part])[0]
    return part
