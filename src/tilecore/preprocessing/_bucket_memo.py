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


@njit(nogil=True, cache=True, inline="always")
def known_bucket(memo, col):
    """The memoised bucket of column `col`, or -1 where it is not known yet."""
    if col < memo.shape[0] and memo[col] != UNKNOWN:
        return np.int64(memo[col])
    return np.int64(-1)


@njit(nogil=True, cache=True, inline="always")
def remember_bucket(memo, col, bucket):
    """Memoise column `col`'s bucket (columns past the memo's cap are not kept)."""
    if col < memo.shape[0]:
        memo[col] = np.uint8(bucket)
