"""The fast routes for ragged rows (object arrays, lists of rows) against the general path.

The general path (`_inputs._general_object_array` and the per-row conversion of
Python rows) is the oracle: on any input, the fast routes must give exactly the
same CSR (dtypes, bytes, weights dropped or kept) or exactly the same error.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import tilecore as tc
from tilecore import data
from tilecore.compat._inputs import coo_to_ragged
from tilecore.preprocessing import _inputs, _object_rows
from tilecore_apps.bench._preprocess import INPUT_FORMS, input_form
from tilecore_apps.cli import main

TABLE = tc.TableSpec(name="tab", vocab_size=2000, embedding_dim=4)
FEATURE = tc.FeatureSpec(name="feat", table=TABLE, input_shape=(8, 4))

# Row kinds: mostly ones the compiled route takes, some it must hand back.
ID_KINDS = ["int32"] * 6 + ["int64"] * 3 + ["strided", "list", "tuple", "int16", "uint64",
                                            "float64", "bool", "2d", "scalar", "swapped"]
WEIGHT_KINDS = ["float32"] * 6 + ["float64"] * 3 + ["strided", "list", "int32", "swapped",
                                                    "2d"]


def make_row(kind: str, values: list[int] | list[float], dtype: Any) -> Any:
    """One row of `values` in the given form."""
    if kind == "list":
        return list(values)
    if kind == "tuple":
        return tuple(values)
    if kind == "strided":  # every other element of a twice-as-long array
        return np.repeat(np.asarray(values, dtype), 2)[::2]
    if kind == "swapped":
        return np.asarray(values, np.dtype(dtype).newbyteorder(">"))
    if kind == "2d":
        return np.asarray(values, dtype)[None, :]
    if kind == "scalar":
        return np.asarray(values[0] if values else 0, dtype)
    return np.asarray(values, kind)


def object_array(rows: list[Any]) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        out[i] = row
    return out


@st.composite
def ragged_inputs(draw: st.DrawFn) -> tuple[Any, Any]:
    """(IDs, weights or None): an object array or list of rows of mixed kinds."""
    base = draw(st.sampled_from(["int32", "int64", "list"]))
    num_rows = draw(st.integers(0, 10))
    lengths = draw(st.lists(st.integers(0, 5), min_size=num_rows, max_size=num_rows))
    odd = st.sampled_from(ID_KINDS)
    ids = [make_row(draw(odd) if draw(st.integers(0, 9)) == 0 else base,
                    draw(st.lists(st.integers(0, 1999), min_size=n, max_size=n)), np.int32)
           for n in lengths]
    container = draw(st.sampled_from(["array", "array", "list"]))
    rows = object_array(ids) if container == "array" else ids
    weights = None
    if draw(st.booleans()):
        ones = draw(st.booleans())
        wbase = draw(st.sampled_from(["float32", "float64", "list"]))
        wodd = st.sampled_from(WEIGHT_KINDS)
        wrows = []
        for n in lengths:
            n += 1 if draw(st.integers(0, 19)) == 0 else 0  # now and then a length mismatch
            values = [1.0] * n if ones else draw(st.lists(
                st.floats(-4, 4, width=32) | st.just(1.0), min_size=n, max_size=n))
            wrows.append(make_row(draw(wodd) if draw(st.integers(0, 9)) == 0 else wbase,
                                  values, np.float32))
        weights = object_array(wrows) if draw(st.booleans()) else wrows
    return rows, weights


@contextlib.contextmanager
def general_path_only() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_inputs, "_from_rows", lambda *args: None)
        yield


def outcome(call: Callable[[], _inputs.Csr]) -> tuple[Any, ...]:
    """The CSR as bytes and dtypes, or the error's type and message."""
    try:
        csr = call()
    except (TypeError, ValueError) as error:
        return ("error", type(error).__name__, str(error))
    weights = None if csr.weights is None else (csr.weights.dtype, csr.weights.tobytes())
    return ("csr", csr.values.dtype, csr.values.tobytes(), csr.splits.dtype,
            csr.splits.tobytes(), weights, csr.width)


def test_the_array_header_layout_holds_here() -> None:
    """The compiled route is live on this interpreter and numpy (not silently off)."""
    assert _object_rows.header_offsets() is not None


@given(ragged_inputs(), st.sampled_from([1, 3]))
def test_fast_routes_match_the_general_path(case: tuple[Any, Any], threads: int) -> None:
    """With 3 threads, object arrays are read in parts of 2+ rows (on the pool)."""
    rows, weights = case
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_object_rows, "ROWS_PER_PART", 2)
        fast = outcome(lambda: _inputs.to_csr(FEATURE, rows, weights, num_threads=threads))
        taken = _inputs._from_rows(rows, weights, threads) is not None
    with general_path_only():
        general = outcome(lambda: _inputs.to_csr(FEATURE, rows, weights))
    event("error" if fast[0] == "error" else "csr")
    event("fast route taken" if taken else "general")
    assert fast == general


@pytest.mark.parametrize("rows", [
    object_array([np.array([1, 2], np.int32), np.array([], np.int32), np.array([3], np.int32)]),
    object_array([np.arange(8, dtype=np.int64)[::3], np.array([5], np.int64)]),
    object_array([np.array([1, 2], np.int32), np.array([], np.float64)]),  # empty: any dtype
    object_array([[1, 2], (3,), []]),
    [[1, 2], [3], []],
    object_array([np.array([i, i + 1], np.int32) for i in range(6)])[::-2],  # negative stride
])
def test_the_fast_route_is_taken_for_the_forms_it_serves(rows: Any) -> None:
    assert _inputs._from_rows(rows, None) is not None
    fast = outcome(lambda: _inputs.to_csr(FEATURE, rows, None))
    with general_path_only():
        assert outcome(lambda: _inputs.to_csr(FEATURE, rows, None)) == fast


@pytest.mark.parametrize("row", [
    np.frombuffer(bytes(13), np.int32, count=3, offset=1),  # not aligned
    np.array([1, 2], ">i4"),  # byte-swapped
    np.array([1, 2], np.int16),
    np.ma.masked_array([1, 2]),  # a subclass
    np.array([[1, 2]], np.int32),  # 2-D
    [1, 2],  # a list among arrays
])
def test_rows_the_compiled_route_hands_back(row: Any) -> None:
    rows = object_array([np.array([7], np.int32), row])
    with general_path_only():
        want = outcome(lambda: _inputs.to_csr(FEATURE, rows, None))
    assert _object_rows._array_rows(rows, _object_rows.ID_DTYPES, 1) is None
    assert outcome(lambda: _inputs.to_csr(FEATURE, rows, None)) == want


def test_weights_that_round_to_one_are_dropped_as_before() -> None:
    rows = object_array([np.array([1, 2], np.int32), np.array([3], np.int32)])
    near = object_array([np.array([1 + 1e-12, 1.0]), np.array([1.0])])  # float32: all 1.0
    assert _inputs.to_csr(FEATURE, rows, near).weights is None
    kept = object_array([np.array([1.0, 0.5], np.float32), np.array([1.0], np.float32)])
    np.testing.assert_array_equal(_inputs.to_csr(FEATURE, rows, kept).weights, [1.0, 0.5, 1.0])


def test_object_arrays_preprocess_like_ragged() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, 32)
    values = rng.integers(0, TABLE.vocab_size, int(lengths.sum())).astype(np.int32)
    weights = rng.uniform(0.5, 2, values.size).astype(np.float32)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    feature = tc.FeatureSpec(name="feat", table=TABLE, input_shape=(32, 4))
    plan = tc.plan_stacking([feature], tc.Topology(global_devices=1, sc_per_device=2))
    rows = object_array([values[a:b].copy() for a, b in itertools.pairwise(splits)])
    wrows = object_array([weights[a:b].copy() for a, b in itertools.pairwise(splits)])
    got, _ = tc.preprocess(plan, {"feat": rows}, {"feat": wrows}, num_threads=1)
    want, _ = tc.preprocess(plan, {"feat": tc.Ragged(values, splits, weights)}, num_threads=1)
    for name, stack in want.stacks.items():
        for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
            np.testing.assert_array_equal(getattr(got.stacks[name], field),
                                          getattr(stack, field), err_msg=f"{name}.{field}")


@pytest.mark.parametrize("form", ["object-array", "dense"])
def test_bench_preprocess_input_forms(form: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "preprocess", "--workload", "criteo", "--input-form", form,
                 "--threads", "1", "--repeats", "1", "--warmup", "0", "--batches", "1",
                 "--batch-size", "64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["input_form"] == form and result["ids_per_s"] > 0


def test_input_forms_hold_the_same_batch() -> None:
    workload = data.get_workload("criteo", batch_size=16)
    batch = workload.batch(0)
    plan = tc.plan_stacking(workload.features, tc.Topology(global_devices=1, sc_per_device=1))
    plan = plan.with_config(allow_id_dropping=True)
    results = {}
    for form in INPUT_FORMS:
        ids, weights = input_form(workload, batch, form)
        kinds = {type(v).__name__ + str(getattr(v, "dtype", "")) for v in ids.values()}
        assert kinds == {"ragged": {"Ragged"}, "object-array": {"ndarrayobject"},
                         "dense": {"ndarrayobject", "ndarrayint32"}}[form]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tc.IdDroppingWarning)
            results[form] = tc.preprocess(plan, ids, weights, num_threads=1)[0]
    for form in ("object-array", "dense"):
        for name, stack in results["ragged"].stacks.items():
            np.testing.assert_array_equal(results[form].stacks[name].embedding_ids,
                                          stack.embedding_ids, err_msg=f"{form} {name}")


@st.composite
def coo_inputs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    batch = draw(st.integers(0, 6))
    n = draw(st.integers(0, 12))
    low, high = (-1, batch) if draw(st.integers(0, 4)) == 0 else (0, max(batch - 1, 0))
    rows = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    if draw(st.booleans()):
        rows.sort()
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint8, np.float64]))
    if dtype is np.uint8:
        rows = [max(r, 0) for r in rows]
    indices = np.stack([np.asarray(rows, dtype), np.zeros(n, dtype)], axis=1)
    return indices.reshape(n, 2), np.arange(100, 100 + n, dtype=np.int32), batch


@given(coo_inputs())
def test_coo_rows_match_a_stable_sort(case: tuple[np.ndarray, np.ndarray, int]) -> None:
    indices, values, batch = case
    rows = indices[:, 0].astype(np.int64)
    outside = rows[(rows < 0) | (rows >= batch)]
    if outside.size:
        with pytest.raises(ValueError, match=rf"sparse row index {outside[0]} is outside"):
            coo_to_ragged("f", indices, values, [batch, 9])
        return
    ragged = coo_to_ragged("f", indices, values, [batch, 9])
    order = np.argsort(rows, kind="stable")
    np.testing.assert_array_equal(ragged.values, values[order])
    counts = np.bincount(rows, minlength=batch)
    np.testing.assert_array_equal(ragged.row_splits, np.concatenate([[0], np.cumsum(counts)]))
