"""HighwayHash64 (portable, scalar) and the minibatching bucket of a column ID.

The reference system assigns every transformed column ID to one of 64 buckets:
`HighwayHash64(col as 4 little-endian bytes, BUCKET_KEY) & 63`. Written from the
public algorithm description (state of four 64-bit lanes in v0, v1, mul0, mul1;
32-byte packets; a remainder packet; four permute-and-update rounds), checked
against the published test vectors and against the reference's buckets.
"""

from __future__ import annotations

import numba
import numpy as np

from .._numba import njit

NUM_BUCKETS = 64
BUCKET_BITS = 6
BUCKET_KEY = np.array(
    [0x4451E30F87DB9609, 0xCA7358A1FD2737F8, 0x4B2C991FCEE4FDEA, 0x0B2658E18326F6BA],
    dtype=np.uint64,
)

_jit = njit(nogil=True, cache=True)
_inline = numba.njit(inline="always")
_INIT_MUL0 = np.array(
    [0xDBE6D5D5FE4CCE2F, 0xA4093822299F31D0, 0x13198A2E03707344, 0x243F6A8885A308D3],
    dtype=np.uint64,
)
_INIT_MUL1 = np.array(
    [0x3BD39E10CB0EF593, 0xC0ACF169B5F18A8C, 0xBE5466CF34E90C6C, 0x452821E638D01377],
    dtype=np.uint64,
)


@_inline
def _rot32(x):
    return (x >> np.uint64(32)) | (x << np.uint64(32))


@_inline
def _zipper(v1, v0):
    """The byte shuffle that is added to the (add1, add0) pair: returns (add1, add0)."""
    b = np.uint64
    add0 = (
        (((v0 & b(0xFF000000)) | (v1 & b(0xFF00000000))) >> b(24))
        | (((v0 & b(0xFF0000000000)) | (v1 & b(0xFF000000000000))) >> b(16))
        | (v0 & b(0xFF0000)) | ((v0 & b(0xFF00)) << b(32))
        | ((v1 & b(0xFF00000000000000)) >> b(8)) | (v0 << b(56))
    )
    add1 = (
        (((v1 & b(0xFF000000)) | (v0 & b(0xFF00000000))) >> b(24))
        | (v1 & b(0xFF0000)) | ((v1 & b(0xFF0000000000)) >> b(16))
        | ((v1 & b(0xFF00)) << b(24)) | ((v0 & b(0xFF000000000000)) >> b(8))
        | ((v1 & b(0xFF)) << b(48)) | (v0 & b(0xFF00000000000000))
    )
    return add1, add0


@_inline
def _update(lanes, v0, v1, mul0, mul1):
    low = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    for i in range(4):
        v1[i] += mul0[i] + lanes[i]
        mul0[i] ^= (v1[i] & low) * (v0[i] >> s32)
        v0[i] += mul1[i]
        mul1[i] ^= (v0[i] & low) * (v1[i] >> s32)
    a1, a0 = _zipper(v1[1], v1[0])
    v0[1] += a1
    v0[0] += a0
    a1, a0 = _zipper(v1[3], v1[2])
    v0[3] += a1
    v0[2] += a0
    a1, a0 = _zipper(v0[1], v0[0])
    v1[1] += a1
    v1[0] += a0
    a1, a0 = _zipper(v0[3], v0[2])
    v1[3] += a1
    v1[2] += a0


@_inline
def _reset(key, v0, v1, mul0, mul1):
    for i in range(4):
        mul0[i] = _INIT_MUL0[i]
        mul1[i] = _INIT_MUL1[i]
        v0[i] = mul0[i] ^ key[i]
        v1[i] = mul1[i] ^ _rot32(key[i])


@_inline
def _read64(data, at):
    x = np.uint64(0)
    for j in range(8):
        x |= np.uint64(data[at + j]) << np.uint64(8 * j)
    return x


@_inline
def _finalize64(v0, v1, mul0, mul1):
    lanes = np.empty(4, np.uint64)
    for _ in range(4):
        lanes[0] = _rot32(v0[2])
        lanes[1] = _rot32(v0[3])
        lanes[2] = _rot32(v0[0])
        lanes[3] = _rot32(v0[1])
        _update(lanes, v0, v1, mul0, mul1)
    return v0[0] + v1[0] + mul0[0] + mul1[0]


@_jit
def highway_hash64(data, key):
    """HighwayHash64 of a uint8 array under a 4-lane uint64 key."""
    v0, v1 = np.empty(4, np.uint64), np.empty(4, np.uint64)
    mul0, mul1 = np.empty(4, np.uint64), np.empty(4, np.uint64)
    _reset(key, v0, v1, mul0, mul1)
    lanes = np.empty(4, np.uint64)
    size = data.shape[0]
    i = 0
    while i + 32 <= size:
        for j in range(4):
            lanes[j] = _read64(data, i + 8 * j)
        _update(lanes, v0, v1, mul0, mul1)
        i += 32
    rem = size & 31
    if rem:
        mod4 = rem & 3
        tail = i + (rem & ~3)
        packet = np.zeros(32, np.uint8)
        for j in range(4):
            v0[j] += (np.uint64(rem) << np.uint64(32)) + np.uint64(rem)
            lo = np.uint32(v1[j] & np.uint64(0xFFFFFFFF))
            hi = np.uint32(v1[j] >> np.uint64(32))
            lo = np.uint32((lo << np.uint32(rem)) | (lo >> np.uint32(32 - rem)))
            hi = np.uint32((hi << np.uint32(rem)) | (hi >> np.uint32(32 - rem)))
            v1[j] = np.uint64(lo) | (np.uint64(hi) << np.uint64(32))
        for j in range(tail - i):
            packet[j] = data[i + j]
        if rem & 16:
            for j in range(4):
                packet[28 + j] = data[tail + j + mod4 - 4]
        elif mod4:
            packet[16] = data[tail]
            packet[17] = data[tail + (mod4 >> 1)]
            packet[18] = data[tail + mod4 - 1]
        for j in range(4):
            lanes[j] = _read64(packet, 8 * j)
        _update(lanes, v0, v1, mul0, mul1)
    return _finalize64(v0, v1, mul0, mul1)


@_inline
def _lane(v0, v1, mul0, mul1, lane):
    """One lane of `_update`'s multiply step, on scalars."""
    low = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    v1 = v1 + mul0 + lane
    mul0 = mul0 ^ ((v1 & low) * (v0 >> s32))
    v0 = v0 + mul1
    mul1 = mul1 ^ ((v0 & low) * (v1 >> s32))
    return v0, v1, mul0, mul1


@_inline
def _update_scalar(s, l0, l1, l2, l3):
    """`_update` on a 16-tuple state (v0[4], v1[4], mul0[4], mul1[4]): no allocation."""
    a0, b0, m0, n0 = _lane(s[0], s[4], s[8], s[12], l0)
    a1, b1, m1, n1 = _lane(s[1], s[5], s[9], s[13], l1)
    a2, b2, m2, n2 = _lane(s[2], s[6], s[10], s[14], l2)
    a3, b3, m3, n3 = _lane(s[3], s[7], s[11], s[15], l3)
    x1, x0 = _zipper(b1, b0)
    a1 += x1
    a0 += x0
    x1, x0 = _zipper(b3, b2)
    a3 += x1
    a2 += x0
    x1, x0 = _zipper(a1, a0)
    b1 += x1
    b0 += x0
    x1, x0 = _zipper(a3, a2)
    b3 += x1
    b2 += x0
    return (a0, a1, a2, a3, b0, b1, b2, b3, m0, m1, m2, m3, n0, n1, n2, n3)


@_inline
def bucket_of(col, state):
    """The minibatching bucket of one transformed column ID.

    `state` is `bucket_state()` as a 16-tuple: the hash state after the key and the
    4-byte remainder bookkeeping, so only the packet update and finalisation remain.
    """
    s = _update_scalar(state, np.uint64(np.uint32(col)), np.uint64(0), np.uint64(0),
                       np.uint64(0))
    for _ in range(4):
        s = _update_scalar(s, _rot32(s[2]), _rot32(s[3]), _rot32(s[0]), _rot32(s[1]))
    return np.int64((s[0] + s[4] + s[8] + s[12]) & np.uint64(NUM_BUCKETS - 1))


def bucket_state() -> tuple[np.uint64, ...]:
    """`(v0[4], v1[4], mul0[4], mul1[4])` of BUCKET_KEY after a 4-byte remainder's setup."""
    return tuple(np.uint64(x) for x in _bucket_state(BUCKET_KEY))


@_jit
def _bucket_state(key):
    v0, v1 = np.empty(4, np.uint64), np.empty(4, np.uint64)
    mul0, mul1 = np.empty(4, np.uint64), np.empty(4, np.uint64)
    _reset(key, v0, v1, mul0, mul1)
    for j in range(4):
        v0[j] += (np.uint64(4) << np.uint64(32)) + np.uint64(4)
        lo = np.uint32(v1[j] & np.uint64(0xFFFFFFFF))
        hi = np.uint32(v1[j] >> np.uint64(32))
        lo = np.uint32((lo << np.uint32(4)) | (lo >> np.uint32(28)))
        hi = np.uint32((hi << np.uint32(4)) | (hi >> np.uint32(28)))
        v1[j] = np.uint64(lo) | (np.uint64(hi) << np.uint64(32))
    out = np.empty(16, np.uint64)
    for j in range(4):  # element by element: a slice assignment compiles a shape check and
        out[j] = v0[j]  # its error message, seconds of compile time for 16 words
        out[4 + j] = v1[j]
        out[8 + j] = mul0[j]
        out[12 + j] = mul1[j]
    return out


_BLOCK = 8  # columns hashed side by side: every state word is a SIMD row of _BLOCK lanes


@_inline
def _lane_block(s, lane, j, x):
    """`_lane` on column j of a block: `s` holds v0, v1, mul0, mul1 as rows of _BLOCK."""
    low = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    i0, i1, i2, i3 = lane * _BLOCK + j, (4 + lane) * _BLOCK + j, (8 + lane) * _BLOCK + j, (
        12 + lane) * _BLOCK + j
    v1 = s[i1] + s[i2] + x
    s[i2] = s[i2] ^ ((v1 & low) * (s[i0] >> s32))
    v0 = s[i0] + s[i3]
    s[i3] = s[i3] ^ ((v0 & low) * (v1 >> s32))
    s[i0] = v0
    s[i1] = v1


@_inline
def _zip_block(s, dst, src, j):
    """`(s[dst+1], s[dst]) += _zipper(s[src+1], s[src])` on column j of a block."""
    a1, a0 = _zipper(s[(src + 1) * _BLOCK + j], s[src * _BLOCK + j])
    s[(dst + 1) * _BLOCK + j] += a1
    s[dst * _BLOCK + j] += a0


@_jit
def hash_buckets(cols, state, out):
    """`out[i]` = the bucket of transformed column ID `cols[i]`, for all i.

    `state` is `bucket_state()` as a uint64 array. Columns are hashed _BLOCK at a
    time with the state held structure-of-arrays (word-major), so the compiler
    runs the independent hashes in SIMD lanes: ~1.6× the throughput of
    `bucket_of` per column (the 64-bit multiplies stay scalar).
    """
    n = cols.shape[0]
    s = np.empty(16 * _BLOCK, np.uint64)
    lanes = np.zeros(4 * _BLOCK, np.uint64)
    s32 = np.uint64(32)
    for start in range(0, n, _BLOCK):
        m = min(_BLOCK, n - start)
        for w in range(16):
            for j in range(_BLOCK):
                s[w * _BLOCK + j] = state[w]
        for j in range(_BLOCK):
            lanes[j] = np.uint64(np.uint32(cols[start + j])) if j < m else np.uint64(0)
            lanes[_BLOCK + j] = 0
            lanes[2 * _BLOCK + j] = 0
            lanes[3 * _BLOCK + j] = 0
        for r in range(5):  # the packet, then the four finalisation rounds
            if r > 0:
                for j in range(_BLOCK):
                    x0, x1, x2, x3 = s[j], s[_BLOCK + j], s[2 * _BLOCK + j], s[3 * _BLOCK + j]
                    lanes[j] = (x2 >> s32) | (x2 << s32)
                    lanes[_BLOCK + j] = (x3 >> s32) | (x3 << s32)
                    lanes[2 * _BLOCK + j] = (x0 >> s32) | (x0 << s32)
                    lanes[3 * _BLOCK + j] = (x1 >> s32) | (x1 << s32)
            for j in range(_BLOCK):
                for lane in range(4):
                    _lane_block(s, lane, j, lanes[lane * _BLOCK + j])
            for j in range(_BLOCK):
                _zip_block(s, 0, 4, j)
                _zip_block(s, 2, 6, j)
                _zip_block(s, 4, 0, j)
                _zip_block(s, 6, 2, j)
        for j in range(m):
            out[start + j] = np.int64(
                (s[j] + s[4 * _BLOCK + j] + s[8 * _BLOCK + j] + s[12 * _BLOCK + j])
                & np.uint64(NUM_BUCKETS - 1))


def buckets(cols: np.ndarray, state: tuple[np.uint64, ...]) -> np.ndarray:
    """Bucket of each transformed column ID (int64 array) → int64 array."""
    out = np.empty(cols.shape[0], np.int64)
    hash_buckets(np.ascontiguousarray(cols, np.int64), np.array(state, np.uint64), out)
    return out
