"""A process-wide memo of minibatching buckets, one byte per transformed column ID.

A column's bucket (`_highway`) never changes, and hashing it costs ~100 ns while
reading a byte costs a few: with skewed (power-law) IDs most rows of a batch were
seen before, so pass 2 of minibatching hashes only the rows new to the process.
The memo grows to the largest stack vocabulary seen, at most `MAX_MEMO_COLUMNS`
bytes; columns past it are hashed every time. Threads share it: concurrent
writers of one entry write the same byte.
"""

from __future__ import annotations

import threading

import numpy as np

from .._numba import njit
from ._highway import hash_buckets

MAX_MEMO_COLUMNS = 1 << 26  # 64 MiB
UNKNOWN = np.uint8(0xFF)

_lock = threading.Lock()
_memo = np.zeros(0, np.uint8)


def bucket_memo(num_columns: int) -> np.ndarray:
    """The memo, grown (filled with UNKNOWN) to cover `num_columns` columns or the cap."""
    global _memo
    size = min(num_columns, MAX_MEMO_COLUMNS)
    with _lock:
        if _memo.size < size:
            grown = np.full(size, UNKNOWN, np.uint8)
            grown[:_memo.size] = _memo
            _memo = grown
        return _memo


def clear_bucket_memo() -> None:
    """Forget every memoised bucket (for measuring the cost of unseen rows)."""
    global _memo
    with _lock:
        _memo = np.zeros(0, np.uint8)


@njit(nogil=True, cache=True)
def memo_buckets(cols, memo, state, misses, miss_buckets, out):
    """`out[i]` = the bucket of column `cols[i]`: read from `memo`, else hashed (all
    misses in one `hash_buckets` call) and remembered. `misses`/`miss_buckets` are
    scratch as long as `cols`."""
    n_miss = 0
    size = memo.shape[0]
    for i in range(cols.shape[0]):
        c = cols[i]
        if c < size and memo[c] != UNKNOWN:
            out[i] = memo[c]
        else:
            misses[n_miss] = c
            out[i] = -1 - n_miss
            n_miss += 1
    if n_miss == 0:
        return 0
    hash_buckets(misses[:n_miss], state, miss_buckets[:n_miss])
    for i in range(cols.shape[0]):
        if out[i] < 0:
            b = miss_buckets[-1 - out[i]]
            out[i] = b
            c = cols[i]
            if c < size:
                memo[c] = np.uint8(b)
    return n_miss
