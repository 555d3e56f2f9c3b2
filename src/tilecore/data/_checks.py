"""The checks that several click-data readers share, each in one place.

Every reader (Criteo TSV, Parquet, `.npz` click files) holds labels and dense values
to one rule, and every place a vocabulary size or a batch index comes in (options,
`clicks.json`, Parquet metadata, `train_batch`) to one range; the callers say where
the value came from, so that the error names the file, key or row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..specs._numbers import is_integer

MAX_VOCAB_SIZE = 2**63 - 1
"""The most rows the readers hash IDs into (rows are int64). A table to train is held
to `TableSpec`'s own limit (`vocab_size < 2**31`) when it is made."""
LABEL_RULE = "the label must be 0 or 1"
DENSE_RULE = "dense values must be finite numbers (within float32's range)"


def check_integer(where: str, value: Any, low: int, high: int | None = None) -> int:
    """`value` when it is an integer (not a bool) in `[low, high]`; else a ValueError
    that says `where` it came from and what it is."""
    if is_integer(value) and low <= value and (high is None or value <= high):
        return int(value)
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{where} must be an integer {bounds}, got {value!r}.")


def check_vocab_size(where: str, value: Any) -> int:
    """A table's number of rows: an integer in [1, `MAX_VOCAB_SIZE`]."""
    return check_integer(where, value, 1, MAX_VOCAB_SIZE)


def check_index(what: str, value: Any) -> None:
    """A batch index (a training step, a held-out batch): an integer >= 0."""
    check_integer(what, value, 0)


def bad_labels(labels: np.ndarray) -> np.ndarray:
    """Mask of the labels (float64) that are not 0 or 1 (NaN included)."""
    return ~np.isin(labels, (0, 1))


def bad_dense(values: np.ndarray) -> np.ndarray:
    """Mask of the dense values that are not finite as the float32 the model reads (NaN,
    ±inf, and finite float64 values past float32's range, which would become inf)."""
    with np.errstate(over="ignore"):
        return ~np.isfinite(np.asarray(values, np.float32))
