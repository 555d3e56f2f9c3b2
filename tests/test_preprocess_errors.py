"""Bad inputs and exceeded limits give clear errors that name the feature, stack or value."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given

import tilecore as tc
from tilecore.testing import PreprocessCase, preprocess_cases, preprocess_reference, unpack

TOPOLOGY = tc.Topology(global_devices=1, sc_per_device=2)


def make_plan(combiner: str = "sum", *, batch: int = 4, width: int = 3, vocab: int = 16,
              topology: tc.Topology = TOPOLOGY, config: tc.SparseCoreConfig | None = None,
              **limits: Any) -> tc.StackingPlan:
    table = tc.TableSpec(name="tab", vocab_size=vocab, embedding_dim=8, combiner=combiner,  # type: ignore[arg-type]
                         **limits)
    feature = tc.FeatureSpec(name="feat", table=table, input_shape=(batch, width))
    return tc.plan_stacking([feature], topology, config)


GOOD = np.arange(12).reshape(4, 3)


def object_rows(rows: list[list[float]], dtype: Any = np.int64) -> np.ndarray:
    out = np.empty(len(rows), object)
    out[:] = [np.asarray(r, dtype) for r in rows]
    return out


def snapshot(plan: tc.StackingPlan, inputs: Any, weights: Any = None) -> list[bytes]:
    batch, stats = tc.preprocess(plan, inputs, weights)
    arrays = [getattr(b, f.name).tobytes() for b in batch.stacks.values()
              for f in dataclasses.fields(b)]
    return [*arrays, repr(stats).encode()]


# --- malformed IDs and weights -----------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 16, 2**40])
def test_ids_outside_the_vocabulary(bad: int) -> None:
    ids = GOOD.copy()
    ids[2, 1] = bad
    with pytest.raises(ValueError, match=rf"Feature 'feat': ID {bad} at row 2 .*\[0, 16\).*'tab'"):
        tc.preprocess(make_plan(), {"feat": ids})


def test_ids_outside_the_vocabulary_in_ragged_and_sparse_inputs() -> None:
    plan = make_plan()
    ragged = tc.Ragged.from_rows([[1], [], [3, 99], [4]])
    with pytest.raises(ValueError, match=r"'feat': ID 99 at row 2"):
        tc.preprocess(plan, {"feat": ragged})
    with pytest.raises(ValueError, match=r"'feat': ID -5 at row 3"):
        tc.preprocess(plan, {"feat": object_rows([[1], [2], [], [-5]])})
    wide = scipy.sparse.csr_matrix((np.ones(1), [17], [0, 0, 1, 1, 1]), shape=(4, 20))
    with pytest.raises(ValueError, match=r"'feat': ID 17 at row 1"):
        tc.preprocess(plan, {"feat": wide})


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.bool_, np.complex64])
def test_non_integer_ids(dtype: Any) -> None:
    with pytest.raises(TypeError, match=rf"Feature 'feat': IDs must be integers.*{np.dtype(dtype)}"):
        tc.preprocess(make_plan(), {"feat": GOOD.astype(dtype)})


def test_non_integer_ids_in_ragged_forms() -> None:
    plan = make_plan()
    with pytest.raises(TypeError, match=r"Feature 'feat': IDs must be integers.*float64"):
        tc.preprocess(plan, {"feat": object_rows([[1.5], [2], [3], [1]], np.float64)})
    with pytest.raises(TypeError, match=r"Feature 'feat': IDs must be integers.*float"):
        tc.preprocess(plan, {"feat": tc.Ragged(np.array([1.0, 2.0]), np.array([0, 1, 1, 2, 2]))})


def test_uint64_ids_beyond_int64() -> None:
    with pytest.raises(ValueError, match=r"Feature 'feat': ID 9223372036854775813"):
        tc.preprocess(make_plan(), {"feat": np.full((4, 3), 2**63 + 5, np.uint64)})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_non_finite_weights(bad: float, combiner: str) -> None:
    weights = np.ones((4, 3))
    weights[1, 2] = bad
    with pytest.raises(ValueError, match=rf"Feature 'feat': weight {bad} at row 1 .*not finite"):
        tc.preprocess(make_plan(combiner), {"feat": GOOD}, {"feat": weights})


def test_non_finite_weights_in_ragged_and_sparse_inputs() -> None:
    plan = make_plan()
    ragged = tc.Ragged(np.array([1, 2, 3]), np.array([0, 1, 1, 3, 3]),
                       np.array([1, 1, np.nan], np.float32))
    with pytest.raises(ValueError, match=r"'feat': weight nan at row 2"):
        tc.preprocess(plan, {"feat": ragged})
    matrix = scipy.sparse.csr_matrix(([1.0, np.inf], [3, 4], [0, 0, 0, 1, 2]), shape=(4, 16))
    with pytest.raises(ValueError, match=r"'feat': weight inf at row 3"):
        tc.preprocess(plan, {"feat": matrix})


def test_weights_that_are_not_numbers() -> None:
    with pytest.raises(TypeError, match="Feature 'feat': weights must be real numbers"):
        tc.preprocess(make_plan(), {"feat": GOOD}, {"feat": np.full((4, 3), "x")})


def test_bfloat16_weights_are_widened_like_float16() -> None:
    """bfloat16 (numpy kind 'V') was refused as "not real numbers"; every bfloat16 is a
    float32, so it is widened exactly, from ml_dtypes or from jax."""
    import jax.numpy as jnp
    import ml_dtypes

    plan = make_plan("mean")
    weights = np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(4, 3)
    narrow = weights.astype(ml_dtypes.bfloat16)
    want = snapshot(plan, {"feat": GOOD}, {"feat": narrow.astype(np.float32)})
    assert snapshot(plan, {"feat": GOOD}, {"feat": narrow}) == want
    assert snapshot(plan, {"feat": GOOD}, {"feat": jnp.asarray(narrow)}) == want
    ragged = tc.Ragged(GOOD.ravel(), np.arange(0, 13, 3), narrow.ravel())
    assert snapshot(plan, {"feat": ragged}) == want


def test_dense_array_likes_are_read_as_numpy() -> None:
    """A dense jax.Array of IDs was "unsupported input type ArrayImpl"; anything with
    `__array__` is read as the numpy array it converts to."""
    import jax.numpy as jnp

    plan = make_plan()
    want = snapshot(plan, {"feat": GOOD})
    assert snapshot(plan, {"feat": jnp.asarray(GOOD)}) == want
    with pytest.raises(TypeError, match="Feature 'feat': IDs must be integers"):
        tc.preprocess(plan, {"feat": jnp.asarray(GOOD, jnp.float32)})


def test_weights_beyond_float32_name_their_value() -> None:
    """1e300 (float64) would be inf in float32, and the error would name inf."""
    weights = np.ones((4, 3))
    weights[2, 1] = -1e300
    with pytest.raises(ValueError, match=r"Feature 'feat': weight -1e\+300 \(entry 7 of the dense "
                                         r"weights\) does not fit float32"):
        tc.preprocess(make_plan(), {"feat": GOOD}, {"feat": weights})


def test_masked_arrays_with_entries_masked_are_refused() -> None:
    """`np.asarray` drops a mask: the masked IDs would have been looked up."""
    mask = GOOD % 2 == 0
    plan = make_plan()
    with pytest.raises(TypeError, match=r"Feature 'feat': the IDs \(the dense input\) are a masked "
                                        r"array with 6 entries masked"):
        tc.preprocess(plan, {"feat": np.ma.masked_array(GOOD, mask=mask)})
    with pytest.raises(TypeError, match=r"the weights \(the dense weights\) are a masked array"):
        tc.preprocess(plan, {"feat": GOOD}, {"feat": np.ma.masked_array(np.ones((4, 3)), mask=mask)})
    ragged = tc.Ragged(values=np.ma.masked_array(GOOD.ravel(), mask=mask.ravel()),
                       row_splits=np.arange(0, 13, 3))
    with pytest.raises(TypeError, match=r"the IDs \(Ragged.values\) are a masked array"):
        tc.preprocess(plan, {"feat": ragged})
    assert snapshot(plan, {"feat": np.ma.masked_array(GOOD)}) == snapshot(plan, {"feat": GOOD})


@pytest.mark.parametrize("inputs", [[GOOD], None, GOOD])
def test_inputs_that_are_not_a_mapping(inputs: Any) -> None:
    with pytest.raises(TypeError, match=f"The inputs must map each feature's name to its inputs, "
                                        f"got {type(inputs).__name__}"):
        tc.preprocess(make_plan(), inputs)
    with pytest.raises(TypeError, match="The weights must map each feature's name to its weights, "
                                        "got list"):
        tc.preprocess(make_plan(), {"feat": GOOD}, [np.ones((4, 3))])


def test_weight_shape_mismatch_dense() -> None:
    with pytest.raises(ValueError, match=r"Feature 'feat': weights have shape \(4, 2\).*\(4, 3\)"):
        tc.preprocess(make_plan(), {"feat": GOOD}, {"feat": np.ones((4, 2))})


def test_weight_shape_mismatch_ragged() -> None:
    plan = make_plan()
    ragged = tc.Ragged.from_rows([[1], [2, 3], [], [4]])
    with pytest.raises(ValueError, match=r"Feature 'feat': weights have shape \(3,\).*\(4,\)"):
        tc.preprocess(plan, {"feat": ragged}, {"feat": np.ones(3)})
    inside = dataclasses.replace(ragged, weights=np.ones(5, np.float32))
    with pytest.raises(ValueError, match=r"Feature 'feat': weights have shape \(5,\)"):
        tc.preprocess(plan, {"feat": inside})
    with pytest.raises(ValueError, match="Feature 'feat': weights given both"):
        tc.preprocess(plan, {"feat": dataclasses.replace(ragged, weights=np.ones(4))},
                      {"feat": np.ones(4)})


def test_weight_shape_mismatch_object_rows() -> None:
    plan = make_plan()
    ids = object_rows([[1], [2, 3], [], [4]])
    with pytest.raises(ValueError, match="Feature 'feat': row 1 has 2 IDs but 1 weights"):
        tc.preprocess(plan, {"feat": ids}, {"feat": object_rows([[1], [2], [], [4]], float)})
    with pytest.raises(ValueError, match="Feature 'feat': 3 weight rows for 4 ID rows"):
        tc.preprocess(plan, {"feat": ids}, {"feat": object_rows([[1], [2, 3], []], float)})


def test_sparse_matrix_with_separate_weights() -> None:
    matrix = scipy.sparse.csr_matrix(np.eye(4, 16))
    with pytest.raises(ValueError, match="Feature 'feat': a sparse matrix carries its weights"):
        tc.preprocess(make_plan(), {"feat": matrix}, {"feat": np.ones(4)})


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_weights_summing_to_zero(combiner: str) -> None:
    weights = np.ones((4, 3))
    weights[2] = [1.0, -1.0, 0.0] if combiner == "mean" else [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=rf"Feature 'feat': the weights of row 2 sum to zero.*"
                                         rf"'{combiner}' combiner of table 'tab'"):
        tc.preprocess(make_plan(combiner), {"feat": GOOD}, {"feat": weights})


def test_sqrtn_weights_whose_squares_underflow() -> None:
    """Weights of 1e-30 sum to 3e-30, but their squares are 0 in float32: the error said
    "the weights sum to zero"."""
    weights = np.ones((4, 3), np.float32)
    weights[1] = [1e-30, -1e-30, 0.0]
    message = ("Feature 'feat': the sum of the squared weights of row 1 (largest magnitude "
               "1e-30) is zero in float32, where the 'sqrtn' combiner of table 'tab' sums "
               "them: weights below ~2.6e-23 in magnitude square to 0")
    with pytest.raises(ValueError, match=re.escape(message)):
        tc.preprocess(make_plan("sqrtn"), {"feat": GOOD}, {"feat": weights})


@pytest.mark.parametrize(("combiner", "row"), [("mean", [1.0, 3e38, 3e38]),
                                               ("sqrtn", [2e19, 1.0, 1.0])])
def test_finite_weights_whose_sum_overflows(combiner: str, row: list[float]) -> None:
    """Σw (mean) or Σw² (sqrtn) past float32's max made every gain of the row 0: its
    activation was zeros, in silence."""
    weights = np.ones((4, 3))
    weights[1] = row
    message = (f"Feature 'feat': the weights of row 1 (largest magnitude {max(row):g}) overflow "
               f"float32 when the '{combiner}' combiner of table 'tab'")
    with pytest.raises(ValueError, match=re.escape(message)):
        tc.preprocess(make_plan(combiner), {"feat": GOOD}, {"feat": weights})


def test_duplicates_whose_summed_weights_overflow() -> None:
    """The 'sum' combiner merges an ID repeated in a row by adding its weights: past
    float32's max its gain was inf, in silence. Two IDs of such weights are no merge."""
    ids = np.array([[1, 2, 3], [4, 5, 4], [6, 7, 8], [9, 10, 11]])
    weights = np.ones((4, 3))
    weights[1] = [3e38, 1.0, 3e38]
    message = ("Feature 'feat': the weights of an ID repeated in row 1 (largest magnitude "
               "3e+38) overflow float32 when the 'sum' combiner of table 'tab' merges its "
               "duplicates")
    with pytest.raises(ValueError, match=re.escape(message)):
        tc.preprocess(make_plan("sum"), {"feat": ids}, {"feat": weights})
    weights[1] = [3e38, 3e38, 1.0]  # IDs 4 and 5: each its own entry
    tc.preprocess(make_plan("sum"), {"feat": ids}, {"feat": weights})


def test_zero_weights_are_fine_for_sum_and_for_empty_rows() -> None:
    tc.preprocess(make_plan("sum"), {"feat": GOOD}, {"feat": np.zeros((4, 3))})
    ragged = tc.Ragged(np.array([1, 2]), np.array([0, 1, 1, 2, 2]), np.ones(2, np.float32))
    tc.preprocess(make_plan("mean"), {"feat": ragged})


# --- malformed batches -------------------------------------------------------------------


def test_missing_and_unknown_features() -> None:
    plan = make_plan()
    with pytest.raises(ValueError, match=r"missing \['feat'\]"):
        tc.preprocess(plan, {})
    with pytest.raises(ValueError, match=r"unknown \['other'\]"):
        tc.preprocess(plan, {"feat": GOOD, "other": GOOD})
    with pytest.raises(ValueError, match=r"Weights given for unknown features \['other'\]"):
        tc.preprocess(plan, {"feat": GOOD}, {"other": GOOD})


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_wrong_number_of_rows(rows: int) -> None:
    ids = np.zeros((rows, 3), np.int32)
    with pytest.raises(ValueError, match=rf"Feature 'feat': got {rows} rows, expected 4"):
        tc.preprocess(make_plan(), {"feat": ids})


def test_wrong_number_of_rows_multi_process() -> None:
    """With 2 of 4 devices local, a process passes half the global batch."""
    plan = make_plan(batch=16, topology=tc.Topology(global_devices=4, sc_per_device=2,
                                                     local_devices=2))
    tc.preprocess(plan, {"feat": np.zeros((8, 3), np.int32)})
    with pytest.raises(ValueError, match="Feature 'feat': got 16 rows, expected 8"):
        tc.preprocess(plan, {"feat": np.zeros((16, 3), np.int32)})


@pytest.mark.parametrize(("global_devices", "sc", "batch"), [(1, 4, 6), (2, 2, 6), (4, 1, 2)])
def test_batch_not_divisible_over_sparsecores(global_devices: int, sc: int, batch: int) -> None:
    plan = make_plan(batch=batch, topology=tc.Topology(global_devices=global_devices,
                                                        sc_per_device=sc))
    with pytest.raises(ValueError, match=rf"Feature 'feat': its global batch of {batch} rows "
                                         rf"does not split evenly.*multiple of {global_devices * sc}"):
        tc.preprocess(plan, {"feat": np.zeros((batch, 3), np.int32)})


@pytest.mark.parametrize(("splits", "message"), [
    ([1, 1, 1, 2, 2], "start at 0"),
    ([0, 1, 1, 2, 3], "end at len"),
    ([0, 2, 1, 2, 2], "decrease at row 1"),
    ([[0, 1], [2, 2]], "1-D"),
    ([], "1-D"),
])
def test_malformed_row_splits(splits: list[int], message: str) -> None:
    ragged = tc.Ragged(np.array([1, 2]), np.array(splits, np.int64))
    with pytest.raises(ValueError, match=f"Feature 'feat': row_splits .*{message}"):
        tc.preprocess(make_plan(), {"feat": ragged})


def test_float_row_splits() -> None:
    ragged = tc.Ragged(np.array([1, 2]), np.array([0, 1.5, 1, 2, 2]))
    with pytest.raises(TypeError, match="Feature 'feat': row_splits"):
        tc.preprocess(make_plan(), {"feat": ragged})


def test_ragged_python_lists_are_ragged_rows() -> None:
    rows = [[1, 2], [3], [4], []]
    got, _ = tc.preprocess(make_plan(), {"feat": rows})
    want, _ = tc.preprocess(make_plan(), {"feat": tc.Ragged.from_rows(rows)})
    for field in ("row_pointers", "embedding_ids", "sample_ids"):
        np.testing.assert_array_equal(getattr(got.stacks["tab"], field),
                                      getattr(want.stacks["tab"], field))


def test_ragged_python_rows_of_floats_name_the_feature() -> None:
    with pytest.raises(TypeError, match="Feature 'feat'"):
        tc.preprocess(make_plan(), {"feat": [[1.5, 2.0], [3.0], [4.0], []]})


def test_object_dtype_rows_name_the_feature() -> None:
    rows = object_rows([[1, 2], [3], [4], [5]], object)
    try:  # accepting the integers is as good as naming the feature
        tc.preprocess(make_plan(), {"feat": rows})
    except (TypeError, ValueError) as error:
        assert "Feature 'feat'" in str(error)


def test_two_dimensional_object_rows_name_the_feature() -> None:
    rows = object_rows([[1, 2], [3], [4], [5]])
    rows[0] = np.array([[1, 2]])
    with pytest.raises(ValueError, match="Feature 'feat'"):
        tc.preprocess(make_plan(), {"feat": rows})


def test_two_dimensional_rows_whose_total_matches_are_refused() -> None:
    """Rows [[3, 7]] (1 × 2) and an empty (1, 0): len() says one ID each, the element
    total (2) agrees, and ID 7 was handed to sample 1; so were 2-D weight rows' values."""
    plan = make_plan(batch=2, width=2)
    ids = object_rows([[0], [0]])
    ids[0], ids[1] = np.array([[3, 7]]), np.zeros((1, 0), np.int64)
    with pytest.raises(ValueError, match=re.escape(
            "Feature 'feat': row 0 of the ragged IDs is not a 1-D sequence (got ndarray of "
            "shape (1, 2))")):
        tc.preprocess(plan, {"feat": ids}, num_threads=1)
    weights = object_rows([[0.0], [0.0]], float)
    weights[0], weights[1] = np.array([[1.0, 2.0]]), np.zeros((1, 0))
    with pytest.raises(ValueError, match=re.escape(
            "Feature 'feat': row 0 of the ragged weights is not a 1-D sequence (got ndarray "
            "of shape (1, 2))")):
        tc.preprocess(plan, {"feat": object_rows([[3], [4]])}, {"feat": weights}, num_threads=1)
    nested = [[[3, 7]], [4]]  # Python rows: a nested list is no 1-D row either
    with pytest.raises(ValueError, match="Feature 'feat': row 0 of the ragged IDs is not a 1-D"):
        tc.preprocess(plan, {"feat": nested}, num_threads=1)


def _big_endian(array: np.ndarray) -> np.ndarray:
    return array.astype(array.dtype.newbyteorder(">"))


def _forms(ids: np.ndarray, weights: np.ndarray, swap: Any) -> dict[str, tuple[Any, Any]]:
    """The inputs `ids` (dense [4, 3]) and `weights` in every form preprocess takes,
    each array passed through `swap`."""
    splits = np.arange(0, ids.size + 1, ids.shape[1])

    def rows(arrays: Any, dtype: Any) -> np.ndarray:
        out = np.empty(len(arrays), object)
        out[:] = [swap(a.astype(dtype)) for a in arrays]
        return out

    return {
        "dense": (swap(ids), swap(weights)),
        "dense int64/float64": (swap(ids.astype(np.int64)), swap(weights.astype(np.float64))),
        "ragged": (tc.Ragged(swap(ids.ravel()), swap(splits), swap(weights.ravel())), None),
        "object rows": (rows(ids, np.int32), rows(weights, np.float32)),
        "object rows int64": (rows(ids, np.int64), rows(weights, np.float64)),
        "sparse": (scipy.sparse.csr_matrix((swap(weights.ravel()), swap(ids.ravel()),
                                            swap(splits)), shape=(4, 16)), None),
    }


def test_big_endian_inputs_preprocess_like_native() -> None:
    """Byte-swapped IDs, splits and weights ('>i4', '>f4', …) in every form give the
    buffers of native ones (the object-row fast path hands them to the general path)."""
    ids = np.array([[1, 2, 3], [4, 5, 4], [6, 7, 8], [9, 10, 11]], np.int32)
    weights = np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(4, 3)
    plan = make_plan("mean")
    native = _forms(ids, weights, lambda a: a)
    for form, (value, w) in _forms(ids, weights, _big_endian).items():
        want_value, want_w = native[form]
        assert snapshot(plan, {"feat": value}, None if w is None else {"feat": w}) == snapshot(
            plan, {"feat": want_value}, None if want_w is None else {"feat": want_w}), form


def test_ragged_values_not_1d() -> None:
    ragged = tc.Ragged(np.zeros((2, 2), np.int32), np.array([0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match=r"Feature 'feat': Ragged.values must be 1-D"):
        tc.preprocess(make_plan(), {"feat": ragged})


def test_dense_input_not_2d() -> None:
    with pytest.raises(ValueError, match=r"Feature 'feat': dense input must be 2-D.*\(4, 3, 1\)"):
        tc.preprocess(make_plan(), {"feat": np.zeros((4, 3, 1), np.int32)})


@pytest.mark.parametrize("value", [{"a": 1}, "abc", None, 3.5, {1, 2}])
def test_unsupported_input_types(value: Any) -> None:
    with pytest.raises(TypeError, match=rf"Feature 'feat': unsupported input type "
                                        rf"{type(value).__name__}.*Ragged"):
        tc.preprocess(make_plan(), {"feat": value})


def test_bad_thread_counts() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_threads must be an integer >= 1"):
            tc.preprocess(make_plan(), {"feat": GOOD}, num_threads=bad)  # type: ignore[arg-type]


# --- limits, dropping and buffers --------------------------------------------------------

# Partition 0 of SparseCore 0 gets 9 IDs (8 distinct); limits of 2 are exceeded.
OVER = {"feat": np.array([[0, 2, 4, 6, 8, 10, 12, 14], [0] * 8,
                          [1, 3, 5, 7, 9, 11, 13, 15], [1] * 8])}


def test_limit_exceeded_names_stack_device_partition_and_values() -> None:
    plan = make_plan(width=8, vocab=64, max_ids_per_partition=2, max_unique_ids_per_partition=2)
    with pytest.raises(tc.LimitExceededError) as info:
        tc.preprocess(plan, OVER)
    error = info.value
    assert isinstance(error, ValueError)
    assert (error.stack, error.device, error.partition, error.observed, error.allowed,
            error.limit) == ("tab", 0, 0, 9, 2, "max_ids_per_partition")
    message = str(error)
    for part in ("Stack 'tab'", "local device 0", "9 IDs", "partition 0",
                 "max_ids_per_partition=2", "update_preprocessing_parameters",
                 "allow_id_dropping"):
        assert part in message, part
    ref = preprocess_reference(plan, OVER).stats
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition",
                  "required_buffer_size_per_sc"):
        np.testing.assert_array_equal(getattr(error.stats, field)["tab"], getattr(ref, field)["tab"])


def test_unique_limit_exceeded_alone() -> None:
    plan = make_plan(width=8, vocab=64, max_ids_per_partition=64, max_unique_ids_per_partition=3)
    with pytest.raises(tc.LimitExceededError, match="max_unique_ids_per_partition=3") as info:
        tc.preprocess(plan, OVER)
    assert (info.value.limit, info.value.observed) == ("max_unique_ids_per_partition", 8)


def test_limit_error_stats_tune_the_plan() -> None:
    plan = make_plan(width=8, vocab=64, max_ids_per_partition=2, max_unique_ids_per_partition=2)
    with pytest.raises(tc.LimitExceededError) as info:
        tc.preprocess(plan, OVER)
    tuned = tc.update_preprocessing_parameters(plan, info.value.stats)
    assert tuned.stacks["tab"].max_ids_per_partition == 9
    assert tuned.stacks["tab"].max_unique_ids_per_partition == 8
    batch, stats = tc.preprocess(tuned, OVER)
    assert stats.dropped_ids == 0
    ref = preprocess_reference(tuned, OVER)
    got = unpack(batch, tuned)["tab"]
    assert all(got[k].bit_equal(v) for k, v in ref.stacks["tab"].kept.items())
    assert plan.stacks["tab"].max_ids_per_partition == 2  # the old plan is unchanged


@given(preprocess_cases(small_limits=True))
def test_limit_errors_match_the_reference(case: PreprocessCase) -> None:
    plan = case.plan()
    ref = preprocess_reference(plan, case.inputs, case.weights)
    if not ref.exceeds_limits:
        tc.preprocess(plan, case.inputs, case.weights)
        return
    with pytest.raises(tc.LimitExceededError) as info:
        tc.preprocess(plan, case.inputs, case.weights)
    error = info.value
    observed = getattr(ref.stats, error.limit)[error.stack]
    assert observed[error.device, error.partition] == error.observed > error.allowed
    assert error.allowed == getattr(plan.stacks[error.stack], error.limit)
    assert f"Stack {error.stack!r}" in str(error)
    tuned = tc.update_preprocessing_parameters(plan, error.stats)
    batch, stats = tc.preprocess(tuned, case.inputs, case.weights)
    assert stats.dropped_ids == 0
    ref_tuned = preprocess_reference(tuned, case.inputs, case.weights)
    got = unpack(batch, tuned)
    for name, stack in ref_tuned.stacks.items():
        assert all(got[name][k].bit_equal(v) for k, v in stack.kept.items())


def test_dropping_warns_and_counts_like_the_reference() -> None:
    """REFERENCE.md §2: SC0 rows {6,2,4} and {2,0,4,4} in partition 0, limits 3 and 2."""
    plan = make_plan(vocab=32, max_ids_per_partition=3, max_unique_ids_per_partition=2,
                     config=tc.SparseCoreConfig(allow_id_dropping=True))
    inputs = {"feat": tc.Ragged.from_rows([[6, 2, 4], [2, 0, 4, 4], [], []])}
    with pytest.warns(tc.IdDroppingWarning, match=r"Dropped IDs.*'tab': 4"):
        batch, stats = tc.preprocess(plan, inputs)
    assert stats.id_drop_counters == {"tab": 4}
    assert preprocess_reference(plan, inputs).stats.id_drop_counters == {"tab": 4}
    kept = unpack(batch, plan)["tab"][0, 0]
    assert [(r, s) for _, r, s in kept.coordinates()] == [(0, 1), (1, 0), (1, 1)]
    assert stats.max_ids_per_partition["tab"].tolist() == [[6, 0]]  # counted before dropping


def test_no_warning_when_nothing_is_dropped() -> None:
    plan = make_plan(config=tc.SparseCoreConfig(allow_id_dropping=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, stats = tc.preprocess(plan, {"feat": GOOD})
    assert stats.id_drop_counters == {"tab": 0}


def test_max_ids_per_chip_per_sample() -> None:
    config = tc.SparseCoreConfig(max_ids_per_chip_per_sample=4)
    plan = make_plan(width=8, vocab=64, config=config)
    ids = np.zeros((4, 8), np.int32)
    tc.preprocess(plan, {"feat": tc.Ragged.from_rows([[1, 2, 3, 4]] * 4)})
    with pytest.raises(ValueError, match=r"Sample 0 has 8 IDs.*'feat'.*max_ids_per_chip_per_sample=4"):
        tc.preprocess(plan, {"feat": ids})


def test_suggested_buffer_too_small() -> None:
    plan = make_plan(width=8, vocab=64, suggested_coo_buffer_size_per_device=16)
    inputs = {"feat": np.arange(32).reshape(4, 8)}
    with pytest.raises(ValueError, match=r"Stack 'tab': a SparseCore needs 16 COO entries but "
                                         r"the buffer holds 8.*suggested_coo_buffer_size"):
        tc.preprocess(plan, inputs)
    dropping = plan.with_config(allow_id_dropping=True)
    with pytest.warns(tc.IdDroppingWarning):
        _, stats = tc.preprocess(dropping, inputs)
    assert stats.id_drop_counters == preprocess_reference(dropping, inputs).stats.id_drop_counters
    assert stats.id_drop_counters["tab"] > 0


def test_suggested_buffer_larger_than_the_limits_allow() -> None:
    plan = make_plan(max_ids_per_partition=8, suggested_coo_buffer_size_per_device=10_000)
    with pytest.raises(ValueError, match=r"Stack 'tab': suggested_coo_buffer_size_per_device="
                                         r"10000 exceeds .*32"):
        tc.preprocess(plan, {"feat": GOOD})


# --- failed calls leave nothing behind ---------------------------------------------------


def test_failed_calls_leave_no_state() -> None:
    plan = make_plan(width=8, vocab=64, max_ids_per_partition=2, max_unique_ids_per_partition=2)
    dropping = plan.with_config(allow_id_dropping=True)
    inputs = {"feat": np.arange(32).reshape(4, 8) % 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tc.IdDroppingWarning)
        before = snapshot(dropping, inputs)
        failures: list[tuple[Any, Any]] = [
            ({"feat": np.full((4, 8), 99)}, None),
            ({"feat": inputs["feat"]}, {"feat": np.full((4, 8), np.nan)}),
            ({"feat": inputs["feat"][:2]}, None),
            ({"feat": "oops"}, None),
        ]
        for bad, weights in failures:
            with pytest.raises((ValueError, TypeError)):
                tc.preprocess(dropping, bad, weights)
            assert snapshot(dropping, inputs) == before
        with pytest.raises(tc.LimitExceededError):
            tc.preprocess(plan, OVER)
        assert snapshot(dropping, inputs) == before


@given(preprocess_cases())
def test_failed_call_between_good_calls(case: PreprocessCase) -> None:
    plan = case.plan()
    before = snapshot(plan, case.inputs, case.weights)
    # The last feature's last row gets an ID outside its vocabulary.
    feature = case.features[-1]
    ragged = case.inputs[feature.name]
    bad_values = np.append(ragged.values, feature.table.vocab_size)
    bad_splits = ragged.row_splits.copy()
    bad_splits[-1] += 1
    bad_weights = dict(case.weights)
    if feature.name in bad_weights:
        bad_weights[feature.name] = np.append(bad_weights[feature.name], np.float32(1))
    bad = {**case.inputs, feature.name: tc.Ragged(bad_values, bad_splits)}
    row = ragged.num_rows - 1
    with pytest.raises(ValueError, match=re.escape(
            f"Feature {feature.name!r}: ID {feature.table.vocab_size} at row {row}")):
        tc.preprocess(plan, bad, bad_weights, num_threads=2)
    assert snapshot(plan, case.inputs, case.weights) == before


def test_batch_numbers_and_agreements_of_the_wrong_kind() -> None:
    """Accepted before ('a', -1, 2**70, None); the agreement class itself failed inside."""
    plan = make_plan(config=tc.SparseCoreConfig(enable_minibatching=True))
    for number in ("a", -1, 2**70, None, 1.5):
        with pytest.raises(ValueError, match="batch_number must be an integer in"):
            tc.preprocess(plan, {"feat": GOOD}, batch_number=number)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="agreement must implement"):
        tc.preprocess(plan, {"feat": GOOD}, agreement=tc.preprocessing.LocalAgreement)  # type: ignore[arg-type]
