"""Reference input forms that tilecore's preprocessing does not take directly."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..preprocessing import Ragged
from ..preprocessing._coo_kernels import row_splits


def as_input(value: Any) -> Any:
    """Array-likes (e.g. `jax.Array`) as numpy arrays; other input forms unchanged.

    A `[batch, 1]` object array (one ragged row per sample, as data loaders that keep
    a trailing feature axis build it) is squeezed to `[batch]`, as the reference does.
    """
    if isinstance(value, np.ndarray) and value.dtype == object and value.ndim == 2 \
            and value.shape[1] == 1:
        return value.reshape(-1)
    if isinstance(value, np.ndarray | Ragged) or not hasattr(value, "__array__"):
        return value
    if hasattr(value, "tocsr") and hasattr(value, "nnz"):  # scipy.sparse
        return value
    return np.asarray(value)


def coo_to_ragged(feature: str, indices: Any, values: Any, dense_shape: Any) -> Ragged:
    """A TF-style sparse tensor (`indices [n, 2]`, `values [n]`, `dense_shape`) as Ragged IDs.

    Row `indices[i, 0]` holds ID `values[i]`; the column index is ignored, as in
    the reference. `dense_shape[0]` is the number of (process-local) rows.
    """
    values = np.asarray(values)
    indices = np.asarray(indices)
    shape = np.asarray(dense_shape).reshape(-1)
    if values.ndim != 1:
        raise ValueError(f"Feature {feature!r}: values must be 1-D, got shape {values.shape}.")
    if shape.size < 1:
        raise ValueError(f"Feature {feature!r}: dense_shape must hold the batch size first.")
    batch = int(shape[0])
    if batch < 0:
        raise ValueError(f"Feature {feature!r}: dense_shape[0] (the batch) must be >= 0, got "
                         f"{batch}.")
    if indices.size == 0 and values.size == 0:
        rows = np.zeros(0, np.int64)
    elif indices.ndim != 2 or indices.shape[0] != values.shape[0] or indices.shape[1] < 1:
        raise ValueError(
            f"Feature {feature!r}: indices must have shape [{values.shape[0]}, 2] (one "
            f"(row, column) pair per value), got {indices.shape}."
        )
    else:
        rows = _row_indices(indices)
    splits, bad, order = row_splits(rows, batch)
    if bad >= 0:
        raise ValueError(
            f"Feature {feature!r}: sparse row index {int(rows[bad])} is outside [0, {batch}) given "
            f"by dense_shape[0]={batch}."
        )
    return Ragged(values=values if order is None else values[order], row_splits=splits)


def _row_indices(indices: np.ndarray) -> np.ndarray:
    """`indices[:, 0]` as the native int32 or int64 the kernel reads: a strided view when
    it already is one, else converted (other dtypes, and big-endian ones: `>i8`'s type
    is `np.int64` too, so the byte order is checked apart)."""
    rows = indices[:, 0]
    if rows.dtype.type not in (np.int32, np.int64) or not rows.dtype.isnative:
        rows = rows.astype(np.int64)
    return rows
