"""The Pallas wing (`tilecore.ops.pallas`) on CPU, in Pallas's interpreter.

- The kernel's two uses against numpy on random entries: the pool (`pool_rows`):
  several blocks
  of output rows and a partial last one, empty segments, entries of segments out
  of range (negative, or the sentinel the ops give filler) whose rows and gains are
  the packed layout's filler (`FILLER_ID`, NaN), a width that is not a power of two,
  and bfloat16 / float16 tables widened to float32; the update's gradient sums per
  row (`row_gradients`): a hot row, filler.
- `ops.lookup` and `ops.lookup_grad` with `TILECORE_KERNELS=pallas-interpret` against
  the numpy oracle: stacked features, weights, dropped IDs, a bfloat16 stack, the
  plain and the minibatched buffer layouts; two training steps.
- The choice of wing: opt-in only, and `pallas` (Triton) refused off a GPU.
- Lowering to Triton IR runs on CPU (cross-platform lowering for CUDA); compiling and
  running the kernel needs a GPU, so that test is skipped here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from _ops_cases import (
    RICH,
    Case,
    assert_close,
    check_against_oracle,
    oracle_steps,
    preprocess,
    run_steps,
    table,
)
from tilecore import ops
from tilecore.ops._backend import wing
from tilecore.ops.pallas._segments import pool_rows, row_gradients
from tilecore.preprocessing._packed import FILLER_GAIN, FILLER_ID
from tilecore.testing import reference_lookup

SEGMENTS = 37  # 16 output rows per program at width 5 (8 lanes): 3 programs, the last partial


def _entries(dtype: Any, seed: int = 0, dim: int = 5, vocab: int = 23, size: int = 120
             ) -> tuple[np.ndarray, ...]:
    """`(table, rows, segments, gains)`; segments 3 and 30-36 have no entries, one segment
    many (a long loop for its block), a tenth of the entries are filler."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(vocab, dim)).astype(dtype)
    rows = rng.integers(0, vocab, size).astype(np.int32)
    segments = rng.choice([s for s in range(30) if s != 3], size).astype(np.int32)
    segments[:25] = 7
    gains = rng.uniform(-2.0, 2.0, size).astype(np.float32)
    filler = rng.random(size) < 0.1
    segments[filler] = np.where(rng.random(filler.sum()) < 0.5, SEGMENTS, -1)
    rows[filler], gains[filler] = FILLER_ID, FILLER_GAIN
    return values, rows, segments, gains


_ON_A_GPU = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="Triton compiles and runs the Pallas kernels on a GPU only (on CPU they run "
           "interpreted, in the same tests)")


INTERPRETED = [True, pytest.param(False, marks=_ON_A_GPU)]
"""Each kernel in Pallas's interpreter everywhere, and compiled by Triton on a GPU."""


def _numpy_pool(values: np.ndarray, rows: np.ndarray, segments: np.ndarray, gains: np.ndarray
                ) -> np.ndarray:
    """`Σ gain · table[row]` per segment in float64, segments out of range dropped."""
    out = np.zeros((SEGMENTS, values.shape[1]))
    kept = (segments >= 0) & (segments < SEGMENTS)
    np.add.at(out, segments[kept],
              gains[kept, None] * values[rows[kept]].astype(np.float64))
    return out


def _pooled(values: np.ndarray, rows: np.ndarray, segments: np.ndarray, gains: np.ndarray,
            interpret: bool = True) -> np.ndarray:
    run = jax.jit(lambda *a: pool_rows(*a, SEGMENTS, None, interpret=interpret))
    out = run(jnp.asarray(values), rows, segments, gains)
    assert out.dtype == jnp.float32 and out.shape == (SEGMENTS, values.shape[1])
    return np.asarray(out)


@pytest.mark.parametrize("interpret", INTERPRETED)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_pool_matches_numpy(dtype: Any, interpret: bool) -> None:
    values, rows, segments, gains = _entries(dtype)
    got = _pooled(values, rows, segments, gains, interpret)
    assert_close(got, _numpy_pool(values, rows, segments, gains))
    np.testing.assert_array_equal(got[[3, *range(30, SEGMENTS)]], 0.0)  # empty segments


@pytest.mark.parametrize("interpret", INTERPRETED)
def test_row_gradients_match_numpy(interpret: bool) -> None:
    """Distinct rows ascending, then the sentinel; a hot row (a long segment), invalid
    entries (filler) summed onto the sentinel, which the update drops."""
    grads, samples, rows, gains = _entries(np.float32, seed=1, vocab=SEGMENTS)
    valid = (rows >= 0) & (rows < SEGMENTS)  # the filler's rows are any, its gains NaN
    samples[~valid] = 0  # as `sample_segments` gives them
    sentinel = 99
    unique, sums, count = jax.jit(lambda *a: row_gradients(*a, sentinel, interpret=interpret))(
        rows, valid, samples, gains, grads)
    assert count is None
    distinct = np.unique(rows[valid])
    np.testing.assert_array_equal(unique[:len(distinct)], distinct)
    np.testing.assert_array_equal(unique[len(distinct):], sentinel)
    want = np.zeros((len(distinct), grads.shape[1]))
    np.add.at(want, np.searchsorted(distinct, rows[valid]),
              gains[valid, None] * grads[samples[valid]])
    assert_close(np.asarray(sums)[:len(distinct)], want)


# --- the public lookup with the Pallas wing -------------------------------------------------


@pytest.fixture(params=["pallas-interpret", pytest.param("pallas", marks=_ON_A_GPU)])
def pallas_interpret(request: pytest.FixtureRequest,
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`$TILECORE_KERNELS=pallas-interpret` for one test, and `pallas` (Triton) where a GPU
    is (the choice is cached: cleared before and after)."""
    monkeypatch.setenv("TILECORE_KERNELS", request.param)
    wing.cache_clear()
    yield
    monkeypatch.undo()
    wing.cache_clear()


def _mixed(limits: bool) -> Case:
    """a (mean) and b stack in float32, fa1 and fb weighted, c is a bfloat16 stack of its
    own; with `limits`, a's and b's small limits drop IDs (or split the batch into
    minibatches)."""
    return Case(
        "pallas-mixed",
        (table("a", 61, 5, "mean", limits=5 if limits else None),
         table("b", 35, 7, "mean", limits=4 if limits else None),
         dataclasses.replace(table("c", 40, 12, "sqrtn"), weights_dtype=jnp.bfloat16)),
        (("fa0", "a", 16), ("fa1", "a", 16), ("fb", "b", 16), ("fc", "c", 16)),
        weighted=("fa1", "fb"), allow_id_dropping=True, seed=21,
    )


@pytest.mark.parametrize("minibatched", [False, True])
def test_lookup_matches_oracle(minibatched: bool, pallas_interpret: None) -> None:
    case = _mixed(limits=True)
    plan = case.plan().with_config(enable_minibatching=minibatched)
    inputs, weights = case.batch(0)
    batch, _ = preprocess(plan, inputs, weights)
    assert (batch.num_minibatches > 1) == minibatched  # the limits split, nothing dropped
    values = case.table_values()
    values["c"] = values["c"].astype(ml_dtypes.bfloat16).astype(np.float32)  # exact in bf16
    tables = ops.shard(plan, values)
    variables = {name: jnp.asarray(tables[name].astype(stack.weights_dtype))
                 for name, stack in plan.stacks.items()}
    forward = jax.jit(lambda b, v: ops.lookup(plan, b, v))
    assert str(forward.trace(batch, variables).jaxpr).count("pallas_call") == len(plan.stacks)
    got = forward(batch, variables)
    want = reference_lookup(_mixed(limits=not minibatched).plan(), inputs, weights, values)
    for feature, expected in want.items():
        assert_close(got[feature], expected, feature)


def test_training_steps_match_oracle(pallas_interpret: None) -> None:
    """Two jitted lookup + lookup_grad steps (Adagrad) equal the oracle's; both halves
    call the kernel."""
    plan = RICH.plan()
    batch, _ = preprocess(plan, *RICH.batch(0))
    grads = RICH.activation_grads(0)
    variables = jax.eval_shape(lambda: ops.init_tables(plan, jax.random.key(0)))
    update = jax.make_jaxpr(lambda b, v: ops.lookup_grad(plan, b, v, grads, 0))(batch, variables)
    assert str(update).count("pallas_call") == len(plan.stacks)
    check_against_oracle(RICH, run_steps(RICH, steps=2), oracle_steps(RICH, steps=2))


# --- choosing the wing ----------------------------------------------------------------------


def test_pallas_is_opt_in_and_triton_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("TILECORE_KERNELS", "pallas")
        monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
        wing.cache_clear()
        with pytest.raises(RuntimeError, match=r"default backend is 'cpu'.*pallas-interpret"):
            wing()
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        wing.cache_clear()
        assert wing().name == "pallas"
        monkeypatch.setenv("TILECORE_KERNELS", "auto")  # slower than XLA: never the default
        wing.cache_clear()
        assert wing().name == "xla"
        monkeypatch.setenv("TILECORE_KERNELS", "triton")
        wing.cache_clear()
        with pytest.raises(ValueError, match="pallas or pallas-interpret; got 'triton'"):
            wing()
    finally:
        monkeypatch.undo()
        wing.cache_clear()


# --- Triton ---------------------------------------------------------------------------------


def test_kernel_lowers_to_triton() -> None:
    """The kernel passes Pallas's Triton lowering (power-of-two blocks, supported
    primitives), for CUDA, without a GPU; compiling it to PTX needs one."""
    values, rows, segments, gains = _entries(ml_dtypes.bfloat16)
    run = jax.jit(lambda *a: pool_rows(*a, SEGMENTS, None, interpret=False))
    try:
        lowered = run.trace(jnp.asarray(values), rows, segments, gains).lower(
            lowering_platforms=("cuda",))
    except (ImportError, NotImplementedError) as error:  # a jaxlib without Triton's dialect
        pytest.skip(f"this jaxlib cannot lower Pallas kernels for CUDA: {error}")
    except RuntimeError as error:  # jax >= 0.11 reads the GPU's model while lowering
        if "No supported GPU devices" not in str(error):
            raise
        pytest.skip(f"this jax lowers Pallas kernels for CUDA only with a GPU: {error}")
    assert "triton" in lowered.as_text()
