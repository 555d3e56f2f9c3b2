"""A process-wide memo of minibatching buckets, one byte per transformed column ID.

A column's bucket (`_highway`) never changes, and hashing it costs ~100 ns while
reading a byte costs a few: with skewed (power-law) IDs most rows of a batch were
seen before, so minibatching hashes only the rows new to the process.
The memo grows to the largest stack vocabulary seen, at most `MAX_MEMO_COLUMNS`
bytes; columns past it are hashed every time. Threads share it: concurrent
writers of one entry write the same byte (and what a thread remembers in a memo
another has just outgrown is only hashed again later).
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
    """The memoised bucket of column `col`, or UNKNOWN where it is not known yet."""
    return memo[col] if col < memo.shape[0] else UNKNOWN


@njit(nogil=True, cache=True, inline="always")
def remember_bucket(memo, col, bucket):
    """Memoise column `col`'s bucket (columns past the memo's cap are not kept)."""
    if col < memo.shape[0]:
        memo[col] = np.uint8(bucket)
