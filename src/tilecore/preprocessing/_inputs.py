"""Turning every accepted input form into validated CSR arrays per feature."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from ..specs import FeatureSpec
from ._kernels import row_length_range
from ._object_rows import ID_DTYPES, WEIGHT_DTYPES, read_rows
from ._ragged_kernels import all_one
from ._types import Ragged

_ID_DTYPES = (np.int32, np.int64)
_DTYPE = operator.attrgetter("dtype")
_NDIM = operator.attrgetter("ndim")
_WIDENED = {np.dtype(ml_dtypes.bfloat16): np.dtype(np.float32)}
"""Weight dtypes numpy does not class as real numbers (kind 'V') → the float type that
holds each of their values exactly (bfloat16 is float32 with the low 16 bits cut)."""


@dataclasses.dataclass(frozen=True)
class Csr:
    """One feature's local rows as CSR: IDs `values`, offsets `splits`, optional weights."""

    values: np.ndarray  # int32 or int64, contiguous
    splits: np.ndarray  # int64, len rows + 1
    weights: np.ndarray | None  # float32 like values
    width: int = -1  # IDs per row when all rows have as many, else -1

    @property
    def num_rows(self) -> int:
        return len(self.splits) - 1


def native_order(array: np.ndarray) -> np.ndarray:
    """`array` in this machine's byte order: itself if it is, else a copy (`'>i4'` on a
    little-endian host). Kernels that read raw buffers, jit's dispatch and pyarrow all
    take the bytes as native ones; the values are the same either way."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _is_scipy_sparse(value: object) -> bool:
    return hasattr(value, "tocsr") and hasattr(value, "nnz")


def _unmasked(feature: str, values: Any, what: str) -> Any:
    """`values`, refused when it is a NumPy masked array with entries masked: `np.asarray`
    would hand on the masked entries as if they were data."""
    if isinstance(values, np.ma.MaskedArray) and np.ma.is_masked(values):
        raise TypeError(
            f"Feature {feature!r}: the {what} are a masked array with {np.ma.count_masked(values)} "
            "entries masked, and masks are not read: pass only the entries that count (e.g. "
            "a tilecore.Ragged of each row's unmasked IDs).")
    return values


def _ids(feature: str, values: Any, where: str) -> np.ndarray:
    values = np.asarray(_unmasked(feature, values, f"IDs ({where})"))
    if values.size == 0 and values.dtype.kind in "iufb":  # no IDs: the dtype says nothing
        return np.zeros(values.shape, np.int32)
    if values.dtype.kind not in "iu":
        raise TypeError(
            f"Feature {feature!r}: IDs must be integers (int32 or int64), got dtype "
            f"{values.dtype} in {where}. Cast them, e.g. ids.astype(np.int32)."
        )
    values = native_order(values)
    if values.dtype.type not in _ID_DTYPES:
        if values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
            raise ValueError(f"Feature {feature!r}: ID {values.max()} is out of range.")
        values = values.astype(np.int64)
    return np.ascontiguousarray(values)


def _weights(feature: str, weights: Any, shape: tuple[int, ...], where: str) -> np.ndarray:
    weights = np.asarray(_unmasked(feature, weights, f"weights ({where})"))
    if weights.dtype in _WIDENED:  # e.g. bfloat16 (jax's or ml_dtypes'): widened exactly
        weights = weights.astype(_WIDENED[weights.dtype])
    if weights.dtype.kind not in "fiu":
        raise TypeError(
            f"Feature {feature!r}: weights must be real numbers, got dtype {weights.dtype} "
            f"in {where}. Cast them, e.g. weights.astype(np.float32)."
        )
    if weights.shape != shape:
        raise ValueError(
            f"Feature {feature!r}: weights have shape {weights.shape} but the IDs have shape "
            f"{shape} ({where}); give one weight per ID."
        )
    if weights.dtype.kind == "f" and weights.dtype.itemsize > 4:
        flat = weights.reshape(-1)
        big = np.flatnonzero(np.isfinite(flat) & (np.abs(flat) > np.finfo(np.float32).max))
        if big.size:  # float32 would make it inf, and the error name inf, not this value
            raise ValueError(
                f"Feature {feature!r}: weight {float(flat[big[0]])!r} (entry {big[0]} "
                f"of {where}) does not fit float32, the type weights are combined in.")
    return np.ascontiguousarray(weights, dtype=np.float32)


def check_splits(feature: str, splits: np.ndarray, num_values: int) -> tuple[np.ndarray, int]:
    """Validated int64 row splits, and the IDs per row if all rows have as many (else -1)."""
    splits = np.asarray(splits)
    if splits.dtype.kind not in "iu":
        raise TypeError(
            f"Feature {feature!r}: row_splits must be integers, got dtype {splits.dtype}."
        )
    splits = np.ascontiguousarray(splits, dtype=np.int64)
    if splits.ndim != 1 or len(splits) < 1:
        raise ValueError(f"Feature {feature!r}: row_splits must be 1-D with >= 1 entry.")
    if splits[0] != 0 or splits[-1] != num_values:
        raise ValueError(
            f"Feature {feature!r}: row_splits must start at 0 and end at len(values)="
            f"{num_values}, got {splits[0]} … {splits[-1]}."
        )
    if len(splits) < 2:
        return splits, -1
    shortest, longest, row = row_length_range(splits)
    if shortest < 0:
        raise ValueError(
            f"Feature {feature!r}: row_splits decrease at row {row} "
            f"({splits[row]} > {splits[row + 1]})."
        )
    return splits, shortest if shortest == longest else -1


def _row_lengths(feature: str, rows: np.ndarray, what: str) -> np.ndarray:
    """Each row's length, once every row is 1-D: `len` of a 2-D row counts its rows, not
    its values, and its values would be handed to the samples after it."""
    try:
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    except TypeError:  # a row without a length (a scalar, None): name it
        _refuse_rows_not_1d(feature, rows, what, deep=True)
        raise
    _refuse_rows_not_1d(feature, rows, what, deep=False)
    return lengths


def _refuse_rows_not_1d(feature: str, rows: Any, what: str, *, deep: bool) -> None:
    """Raise naming the first row that is not a 1-D sequence. Rows with an `ndim` (numpy
    or jax arrays) are all checked; others (lists) only when `deep`, as `np.ndim`
    converts them (the joined rows' shape catches nested lists first)."""
    try:
        if set(map(_NDIM, rows)) <= {1}:  # every row an array, all 1-D: at C speed
            return
    except AttributeError:  # some row is not an array: row by row
        pass
    for index, row in enumerate(rows):
        ndim = getattr(row, "ndim", None)
        if ndim is None and deep:
            try:
                ndim = np.ndim(row)
            except ValueError:  # rows of nested lists of different lengths
                ndim = -1
        if ndim is not None and ndim != 1:
            raise ValueError(
                f"Feature {feature!r}: row {index} of the ragged {what} is not a 1-D sequence "
                f"(got {type(row).__name__} of shape {_shape(row)}). Give each sample's "
                f"{what} as one 1-D array or list, e.g. row.reshape(-1).") from None


def _shape(row: Any) -> str:
    try:
        return str(np.shape(row))
    except ValueError:
        return "(nested rows of different lengths)"


def _concatenate(feature: str, rows: np.ndarray, total: int, what: str) -> np.ndarray:
    """The rows (each 1-D, `_row_lengths`) back to back. Rows that are numpy arrays of one
    dtype are joined as raw bytes (3× faster than np.concatenate, whose cost is per row,
    not per ID)."""
    if not total:
        return np.zeros(0, np.int32)
    try:
        dtypes = set(map(_DTYPE, rows))
    except AttributeError:  # some row is not an array (e.g. a list): the general path
        dtypes = set()
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    if dtype is not None and dtype.kind in "iuf":
        try:
            joined = b"".join(rows)
        except (TypeError, BufferError):  # not contiguous: take the general path
            pass
        else:
            if len(joined) == total * dtype.itemsize:
                return np.frombuffer(joined, dtype)
    try:
        flat = np.concatenate([r for r in rows if len(r)])  # empty rows carry no dtype
    except ValueError as error:
        _refuse_rows_not_1d(feature, rows, what, deep=True)
        raise ValueError(f"Feature {feature!r}: the ragged rows of {what} do not join: {error}."
                         " Every row must be a 1-D sequence of numbers.") from None
    if flat.ndim != 1 or flat.size != total:
        _refuse_rows_not_1d(feature, rows, what, deep=True)
        raise ValueError(f"Feature {feature!r}: every ragged row of {what} must be 1-D.")
    return flat


def _from_rows(rows: Any, weights: Any, threads: int = 1) -> Csr | None:
    """The fast route for ragged rows (see `_object_rows`); None: take the general path."""
    ids = read_rows(rows, ID_DTYPES, threads)
    if ids is None:
        return None
    w = None if weights is None else read_rows(weights, WEIGHT_DTYPES, threads)
    if weights is not None and (w is None or not np.array_equal(w.lengths, ids.lengths)):
        return None  # the general path names the mismatch
    splits = ids.splits()
    values = ids.values(splits) if splits[-1] else np.zeros(0, np.int32)
    if w is None or w.all_one():  # weights of one: dropped, as `to_csr` does
        return Csr(values, splits, None)
    return Csr(values, splits, w.values(splits, np.dtype(np.float32)))


def _from_object_array(feature: str, rows: np.ndarray, weights: Any, threads: int) -> Csr:
    fast = _from_rows(rows, weights, threads)
    return fast if fast is not None else _general_object_array(feature, rows, weights)


def _general_object_array(feature: str, rows: np.ndarray, weights: Any) -> Csr:
    """Any object array of rows (lists, arrays of mixed dtypes): the oracle of `_from_rows`."""
    lengths = _row_lengths(feature, rows, "IDs")
    splits = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=splits[1:])
    values = _ids(feature, _concatenate(feature, rows, int(splits[-1]), "IDs"), "the ragged rows")
    if weights is None:
        return Csr(values, splits, None)
    if isinstance(weights, list | tuple):  # one object per row, even if all rows are as long
        weights = np.fromiter(weights, dtype=object, count=len(weights))
    elif not isinstance(weights, np.ndarray):
        weights = np.asarray(weights, dtype=object)
    if weights.shape != rows.shape:
        raise ValueError(
            f"Feature {feature!r}: {weights.shape[0] if weights.ndim else 0} weight rows for "
            f"{len(rows)} ID rows."
        )
    mismatch = np.flatnonzero(_row_lengths(feature, weights, "weights") != lengths)
    if mismatch.size:
        r = mismatch[0]
        raise ValueError(
            f"Feature {feature!r}: row {r} has {lengths[r]} IDs but {len(weights[r])} weights."
        )
    flat = _concatenate(feature, weights, int(splits[-1]), "weights")
    return Csr(values, splits, _weights(feature, flat, values.shape, "the ragged weights"))


def to_csr(feature: FeatureSpec, value: Any, weights: Any, *, num_threads: int = 1) -> Csr:
    """Validate one feature's input (any accepted form) and return it as CSR (object
    arrays of many rows are read by up to `num_threads` threads)."""
    csr = _to_csr(feature, value, weights, num_threads)
    if csr.weights is not None and bool(all_one(csr.weights)):
        # Gains from weights of one equal the unweighted gains bit for bit; the
        # unweighted path is faster.
        csr = Csr(csr.values, csr.splits, None, csr.width)
    if csr.width < 0:
        splits, width = check_splits(feature.name, csr.splits, len(csr.values))
        csr = Csr(csr.values, splits, csr.weights, width)
    return csr


def _as_numpy(value: Any) -> Any:
    """`value` as a numpy array if it is an array-like other than one (a `jax.Array`, a
    pandas Series: anything with `__array__`), so that it is read as the numpy array it
    converts to; other values unchanged. Preprocessing runs on the host, on numpy arrays."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__array__"):
        return value
    return np.asarray(value)


def _to_csr(feature: FeatureSpec, value: Any, weights: Any, threads: int) -> Csr:
    name = feature.name
    if isinstance(value, Ragged):
        if weights is not None and value.weights is not None:
            raise ValueError(f"Feature {name!r}: weights given both in Ragged and separately.")
        values = _ids(name, value.values, "Ragged.values")
        if values.ndim != 1:
            raise ValueError(f"Feature {name!r}: Ragged.values must be 1-D, got {values.shape}.")
        splits = np.asarray(value.row_splits)
        w = value.weights if value.weights is not None else weights
        return Csr(values, splits, None if w is None else _weights(name, w, values.shape, "weights"))
    if _is_scipy_sparse(value):
        if weights is not None:
            raise ValueError(
                f"Feature {name!r}: a sparse matrix carries its weights as its data; "
                "do not pass separate weights."
            )
        csr = value.tocsr()  # (samples × vocab); duplicate entries are summed
        values = _ids(name, csr.indices, "the sparse matrix's column indices")
        return Csr(values, np.asarray(csr.indptr, np.int64),
                   _weights(name, csr.data, values.shape, "the sparse matrix's data"))
    value = _as_numpy(value)
    if isinstance(value, np.ndarray) and value.dtype == object:
        if value.ndim != 1:
            raise ValueError(f"Feature {name!r}: a ragged object array must be 1-D.")
        return _from_object_array(name, value, weights, threads)
    if isinstance(value, list | tuple):
        try:
            value = np.asarray(value)
        except ValueError:  # rows of different lengths: ragged Python rows
            fast = _from_rows(value, weights, threads)
            if fast is not None:
                return fast
            rows = np.empty(len(value), dtype=object)
            rows[:] = [np.asarray(r) for r in value]
            return _from_object_array(name, rows, weights, threads)
        if value.dtype == object:
            return _from_object_array(name, value, weights, threads)
    if isinstance(value, np.ndarray):
        dense = _ids(name, value, "the dense input")
        if dense.ndim == 1:
            dense = dense[:, None]
            weights = None if weights is None else np.reshape(weights, (-1, 1))
        if dense.ndim != 2:
            raise ValueError(
                f"Feature {name!r}: dense input must be 2-D [batch, ids], got shape {dense.shape}."
            )
        rows, width = dense.shape
        splits = np.arange(rows + 1, dtype=np.int64) * width
        w = None
        if weights is not None:
            w = _weights(name, weights, dense.shape, "the dense weights").reshape(-1)
        return Csr(dense.reshape(-1), splits, w, width)
    raise TypeError(
        f"Feature {name!r}: unsupported input type {type(value).__name__}. Pass a "
        "tilecore.Ragged, a dense 2-D integer array, a numpy object array of 1-D arrays, or "
        "a scipy.sparse matrix (samples × vocab)."
    )


def check_feature_names(
    expected: Mapping[str, FeatureSpec], given: Mapping[str, Any], what: str
) -> None:
    """Inputs must name exactly the plan's features."""
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    if missing or extra:
        raise ValueError(
            f"The {what} do not match the plan's features: missing {missing}, unknown {extra}."
        )


def checked_names(features: Mapping[str, FeatureSpec], inputs: Mapping[str, Any],
                  weights: Mapping[str, Any] | None) -> dict[str, Any]:
    """The weights as a dict, once the inputs name exactly the plan's features and the
    weights some of them (both paths of preprocessing check names first, alike)."""
    for what, given in (("inputs", inputs), ("weights", weights)):
        if not isinstance(given, Mapping) and (what == "inputs" or given is not None):
            raise TypeError(f"The {what} must map each feature's name to its {what}, got "
                            f"{type(given).__name__}.")
    check_feature_names(features, inputs, "inputs")
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(features))
    if unknown:
        raise ValueError(f"Weights given for unknown features {unknown}.")
    return weights
