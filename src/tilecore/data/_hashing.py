"""Categorical values → rows of a table: the one hash every click-data reader uses.

The row of a value in a table of `vocab_size` rows is `key(value) mod vocab_size`:

- an integer ID is its own key: IDs in range keep their row, others wrap (−3 → vocab_size − 3);
- a string of 1 to 16 hexadecimal digits (a categorical value of the Criteo logs) is the
  number it writes, `int(value, 16)`: the TSV and Parquet readers agree on it;
- any other string (empty too): the first 8 bytes of the BLAKE2b digest of its UTF-8
  bytes, as a little-endian unsigned integer.

Pure functions of the value: the same in every run, process and machine (Python's
`hash` of a string is salted per process, and is never used).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import numpy as np

_HEX = re.compile("[0-9a-fA-F]{1,16}").fullmatch


def _digest_key(value: str) -> int:
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def string_key(value: str) -> int:
    """The hash key of a string value (an unsigned 64-bit integer, see the module docstring)."""
    return int(value, 16) if _HEX(value) else _digest_key(value)


def string_ids(values: Iterable[str], count: int, vocab_size: int) -> np.ndarray:
    """The rows (int64) of the `count` string `values` in a table of `vocab_size` rows."""
    return np.fromiter((string_key(v) % vocab_size for v in values), np.int64, count)


def hex_ids(values: Iterable[str], count: int, vocab_size: int) -> np.ndarray:
    """`string_ids` of values already checked to be 1 to 16 hexadecimal digits (the
    Criteo reader's, checked line by line): the same rows, without checking again."""
    return np.fromiter((int(v, 16) % vocab_size for v in values), np.int64, count)


def integer_ids(values: np.ndarray, vocab_size: int) -> np.ndarray:
    """The rows (int64) of integer IDs in a table of `vocab_size` rows: each ID modulo the
    vocabulary, as a number (unsigned IDs at or above 2**63 too, which int64 would wrap)."""
    if values.dtype == np.uint64:
        return np.mod(values, np.uint64(vocab_size)).astype(np.int64)
    return np.mod(values.astype(np.int64, copy=False), vocab_size)
