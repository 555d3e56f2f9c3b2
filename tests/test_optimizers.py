"""Optimizer rules and the fused sparse update, against the numpy oracle on random data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
from tilecore.ops._sparse_update import apply_sparse_update
from tilecore.ops._variables import EmbeddingVariables
from tilecore.optimizers import init_slots, update_rule
from tilecore.testing import reference_update


def _schedule(step: Any) -> Any:
    """A learning-rate schedule written with traceable arithmetic."""
    return 0.05 / (1.0 + 0.1 * step)


SPECS: dict[str, tc.OptimizerSpec] = {
    "sgd": tc.SGD(),
    "sgd-lr": tc.SGD(learning_rate=0.3),
    "sgd-schedule": tc.SGD(learning_rate=_schedule),
    "adagrad": tc.Adagrad(),
    "adagrad-custom": tc.Adagrad(learning_rate=0.2, initial_accumulator_value=0.5),
    "adagrad_momentum": tc.AdagradMomentum(),
    "adagrad_momentum-nesterov": tc.AdagradMomentum(learning_rate=0.05, use_nesterov=True),
    "adagrad_momentum-beta2-nesterov": tc.AdagradMomentum(
        learning_rate=0.05, momentum=0.5, beta2=0.95, epsilon=1e-5, exponent=3.0,
        use_nesterov=True, initial_accumulator_value=0.3, initial_momentum_value=0.2),
    "adagrad_momentum-beta2": tc.AdagradMomentum(beta2=0.9, exponent=4.0),
    "adam": tc.Adam(),
    "adam-custom": tc.Adam(learning_rate=0.01, beta_1=0.5, beta_2=0.9, epsilon=1e-3),
    "adam-schedule": tc.Adam(learning_rate=_schedule),
    "ftrl": tc.FTRL(),
    "ftrl-mlr": tc.FTRL(multiply_linear_by_learning_rate=True),
    "ftrl-l1": tc.FTRL(learning_rate=0.1, learning_rate_power=-0.7,
                       l1_regularization_strength=0.5, l2_regularization_strength=0.1,
                       beta=0.2, initial_accumulator_value=0.3, initial_linear_value=0.1),
    "ftrl-l1-mlr": tc.FTRL(learning_rate=0.1, learning_rate_power=-0.7,
                           l1_regularization_strength=0.5, l2_regularization_strength=0.1,
                           beta=0.2, multiply_linear_by_learning_rate=True),
    "laprop": tc.LaProp(),
    "laprop-custom": tc.LaProp(learning_rate=0.02, b1=0.5, b2=0.8, eps=1e-8,
                               initial_slot_value=0.1),
    "f2a": tc.F2A(),
    "f2a-regularized": tc.F2A(learning_rate=0.05, rho=0.7, l1_regularization_strength=0.01,
                              l2_regularization_strength=0.02, initial_accumulator_value=0.3,
                              initial_local_step_value=2.0),
    "f2a-capped": tc.F2A(learning_rate=_schedule, rho=1.0, max_lr_multiplier=3.0),
}
STEPS = (0, 1, 2, 7, 1000)
POSITIVE_SLOTS = frozenset({"accumulator", "velocity", "nu"})
COUNT_SLOTS = frozenset({"local_step"})  # F2A: how often each row was updated
RTOL, ATOL = 1e-5, 1e-6


def random_state(spec: tc.OptimizerSpec, rng: np.random.Generator, shape: tuple[int, ...]
                 ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """A random row block and slots in each slot's valid range (accumulators > 0)."""
    row = rng.normal(size=shape).astype(np.float32)
    slots = tuple(
        (rng.uniform(0.05, 2.0, size=shape) if name in POSITIVE_SLOTS
         else rng.integers(0, 20, size=shape) if name in COUNT_SLOTS
         else rng.normal(size=shape)).astype(np.float32)
        for name in spec.slot_names
    )
    return row, slots


def assert_close(actual: Any, expected: Any, err_msg: str = "") -> None:
    """Equal to float32 precision: `rtol`, plus an `atol` at the array's own scale (a
    float32 formula that cancels terms of size X is only accurate to ~X·2⁻²³)."""
    expected = np.asarray(expected)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=RTOL, atol=ATOL * scale,
                               err_msg=err_msg)


# --- rules ---------------------------------------------------------------------------------


MODES = ("host", "traced-step", "traced-hyperparameters")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SPECS)
def test_rule_matches_oracle_over_steps(name: str, mode: str) -> None:
    """host: Python-float hyperparameters (flags branch in Python); traced-step: the
    step is traced under jit; traced-hyperparameters: every hyperparameter, flags
    included, is a traced scalar (flags branch with `jnp.where`)."""
    spec = SPECS[name]
    rule = update_rule(spec)
    rng = np.random.default_rng(0)
    row, slots = random_state(spec, rng, (16, 8))

    @jax.jit
    def at_traced_step(step: jax.Array, grad: jax.Array, row: jax.Array, *slots: jax.Array
                       ) -> Any:
        return rule(grad, row, *slots, *spec.hyperparameters(step))

    @jax.jit
    def with_traced_hyperparameters(hyper: tuple[jax.Array, ...], grad: jax.Array,
                                    row: jax.Array, *slots: jax.Array) -> Any:
        return rule(grad, row, *slots, *hyper)

    for step in STEPS:
        grad = rng.normal(size=row.shape).astype(np.float32)
        if mode == "traced-step":
            new_row, *new_slots = at_traced_step(jnp.int32(step), grad, row, *slots)
        elif mode == "traced-hyperparameters":
            hyper = tuple(jnp.float32(h) for h in spec.hyperparameters(step))
            new_row, *new_slots = with_traced_hyperparameters(hyper, grad, row, *slots)
        else:
            new_row, *new_slots = rule(jnp.asarray(grad), jnp.asarray(row),
                                       *map(jnp.asarray, slots), *spec.hyperparameters(step))
        want_row, want_slots = reference_update(spec, grad, row, slots, step)
        assert_close(new_row, want_row, f"{name} row at step={step}")
        assert len(new_slots) == len(want_slots)
        for slot_name, got, want in zip(spec.slot_names, new_slots, want_slots, strict=True):
            assert_close(got, want, f"{name} {slot_name} at step={step}")
        row, slots = np.asarray(new_row), tuple(np.asarray(s) for s in new_slots)
    if mode != "host":
        assert (at_traced_step if mode == "traced-step" else with_traced_hyperparameters
                )._cache_size() == 1  # pyright: ignore[reportAttributeAccessIssue]


def test_f2a_hand_checked_values() -> None:
    """One row, worked by hand: n' = 4, f = min((16/4)^0.5, cap), a' = 0.1 + 0.25 = 0.35,
    w' = 1 − 0.1·(f·0.5/√0.35 + 0.01·sign(1) + 0.02·1)."""
    grad, row, acc, local = (np.array([[v]], np.float32) for v in (0.5, 1.0, 0.1, 3.0))
    for cap, boost in ((1e6, 2.0), (1.5, 1.5)):
        spec = tc.F2A(learning_rate=0.1, rho=0.5, l1_regularization_strength=0.01,
                      l2_regularization_strength=0.02, max_lr_multiplier=cap)
        new_row, new_acc, new_local = update_rule(spec)(grad, row, acc, local,
                                                        *spec.hyperparameters(16))
        want = 1.0 - 0.1 * (boost * 0.5 / np.sqrt(0.35) + 0.01 + 0.02)
        np.testing.assert_allclose(np.asarray(new_row), [[want]], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(new_acc), [[0.35]], rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(new_local), [[4.0]])
    assert want == pytest.approx(0.87023, abs=1e-5)  # the capped case, 1.5 instead of 2
    # Step 0 counts as 1: a row seen for the first time gets no boost (f = (1/1)^rho).
    spec = tc.F2A(learning_rate=0.1)
    new_row, *_ = update_rule(spec)(grad, row, acc, np.zeros_like(local),
                                    *spec.hyperparameters(0))
    np.testing.assert_allclose(np.asarray(new_row), [[1.0 - 0.1 * 0.5 / np.sqrt(0.35)]],
                               rtol=1e-6)


def test_ftrl_l1_zeroes_some_weights_but_not_all() -> None:
    spec = SPECS["ftrl-l1"]
    row, slots = random_state(spec, np.random.default_rng(1), (32, 8))
    grad = np.random.default_rng(2).normal(size=row.shape).astype(np.float32)
    new_row = np.asarray(update_rule(spec)(grad, row, *slots, *spec.hyperparameters(0))[0])
    assert 0 < np.count_nonzero(new_row == 0) < new_row.size


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("step", [0, 1, 5, 1000])
def test_hyperparameters_at_traced_step_equal_host_values(name: str, step: int) -> None:
    spec = SPECS[name]
    traced = jax.jit(spec.hyperparameters)(jnp.int32(step))
    host = spec.hyperparameters(step)
    assert len(traced) == len(host)
    np.testing.assert_allclose(np.asarray(traced, np.float64), np.asarray(host), rtol=2e-5)


def test_every_spec_has_a_rule_and_unknown_specs_are_rejected() -> None:
    for spec in SPECS.values():
        assert callable(update_rule(spec))

    class Mystery(tc.OptimizerSpec):
        pass

    with pytest.raises(TypeError, match=r"No update rule for optimizer spec Mystery.*CustomOptimizer"):
        update_rule(Mystery())


@pytest.mark.parametrize("name", SPECS)
def test_init_slots_are_constant_and_placed(name: str) -> None:
    spec = SPECS[name]
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    slots = init_slots(spec, (6, 8), sharding=sharding)
    assert len(slots) == len(spec.slot_names)
    for slot, value in zip(slots, spec.slot_initial_values(), strict=True):
        assert slot.shape == (6, 8) and slot.dtype == jnp.float32 and slot.sharding == sharding
        np.testing.assert_array_equal(np.asarray(slot), np.float32(value))


# --- the fused sparse update ---------------------------------------------------------------

VOCAB, DIM, TOUCHED, PADDING = 64, 8, 24, 8


def random_variables(spec: tc.OptimizerSpec, rng: np.random.Generator) -> EmbeddingVariables:
    table, slots = random_state(spec, rng, (VOCAB, DIM))
    return EmbeddingVariables(jnp.asarray(table), tuple(map(jnp.asarray, slots)))


def random_rows(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Unique touched rows plus out-of-range sentinels, shuffled; and the touched rows."""
    touched = rng.choice(VOCAB, TOUCHED, replace=False)
    sentinels = np.array([VOCAB, VOCAB + 3, 2**31 - 1, VOCAB, 2**31 - 1, VOCAB + 100,
                          VOCAB, 2**31 - 1])[:PADDING]
    rows = np.concatenate([touched, sentinels]).astype(np.int32)
    rng.shuffle(rows)
    return rows, touched


def check_sparse_update(spec: tc.OptimizerSpec, jitted: Callable[..., EmbeddingVariables],
                        clip: tuple[float, float] | None, seed: int) -> None:
    """Several steps of `jitted(variables, rows, grads, step)` against the oracle."""
    rng = np.random.default_rng(seed)
    variables = random_variables(spec, rng)
    for step in (0, 1, 2):
        rows, touched = random_rows(rng)
        grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
        grads[np.flatnonzero(rows == touched[0])] = 0.0  # listed with zero gradient: updated
        before = [np.array(a) for a in (variables.table, *variables.slots)]
        variables = jitted(variables, jnp.asarray(rows), jnp.asarray(grads), step)
        after = [np.asarray(a) for a in (variables.table, *variables.slots)]

        order = np.argsort(rows)[:TOUCHED]  # the real rows, in index order
        idx = rows[order]
        want_row, want_slots = reference_update(
            spec, grads[order], before[0][idx], [b[idx] for b in before[1:]], step)
        if clip is not None:
            want_row = np.clip(want_row, *clip)
        for name, got, want in zip(("table", *spec.slot_names), after,
                                   (want_row, *want_slots), strict=True):
            assert_close(got[idx], want, f"{name} at step={step}")
        untouched = np.setdiff1d(np.arange(VOCAB), touched)
        for name, got, old in zip(("table", *spec.slot_names), after, before, strict=True):
            assert got.dtype == np.float32
            assert np.array_equal(got[untouched], old[untouched]), f"{name} changed untouched rows"


@pytest.mark.parametrize("name", SPECS)
def test_sparse_update_matches_oracle_with_donation(name: str) -> None:
    spec = SPECS[name]

    def step_fn(variables: EmbeddingVariables, rows: jax.Array, grads: jax.Array,
                step: Any) -> EmbeddingVariables:
        return apply_sparse_update(variables, rows, grads, spec, step)

    jitted = jax.jit(step_fn, donate_argnums=0)
    check_sparse_update(spec, jitted, None, seed=3)
    assert jitted._cache_size() == 1  # pyright: ignore[reportAttributeAccessIssue]


def test_sparse_update_eager_matches_oracle() -> None:
    spec = SPECS["ftrl-l1-mlr"]
    check_sparse_update(spec, lambda v, r, g, s: apply_sparse_update(v, r, g, spec, s), None, 4)


@pytest.mark.parametrize("name", ["sgd-lr", "adagrad-custom", "adam-custom"])
def test_clip_applies_to_the_table_only(name: str) -> None:
    spec, clip = SPECS[name], (-0.2, 0.3)
    jitted = jax.jit(lambda v, r, g, s: apply_sparse_update(v, r, g, spec, s, clip=clip))
    check_sparse_update(spec, jitted, clip, seed=5)
    # The check is meaningful: slots do leave the clip range.
    variables = random_variables(spec, np.random.default_rng(5))
    rows, _ = random_rows(np.random.default_rng(6))
    grads = jnp.asarray(np.random.default_rng(7).normal(size=(rows.size, DIM)), jnp.float32)
    out = jitted(variables, jnp.asarray(rows), grads, 0)
    touched = rows[rows < VOCAB]
    assert np.all(np.abs(np.asarray(out.table)[touched]) <= 0.3)
    assert all(np.any(np.abs(np.asarray(s)[touched]) > 0.3) for s in out.slots)


def test_donated_variables_are_consumed_without_warnings() -> None:
    spec = SPECS["adam"]
    variables = random_variables(spec, np.random.default_rng(8))
    rows, _ = random_rows(np.random.default_rng(9))
    grads = jnp.ones((rows.size, DIM), jnp.float32)
    jitted = jax.jit(lambda v, r, g, s: apply_sparse_update(v, r, g, spec, s), donate_argnums=0)
    out = jitted(variables, jnp.asarray(rows), grads, 0)
    assert variables.table.is_deleted() and all(s.is_deleted() for s in variables.slots)
    assert not out.table.is_deleted()


def test_second_step_does_not_recompile() -> None:
    spec = SPECS["adam-schedule"]
    traces = []

    def step_fn(variables: EmbeddingVariables, rows: jax.Array, grads: jax.Array,
                step: Any) -> EmbeddingVariables:
        traces.append(step)
        return apply_sparse_update(variables, rows, grads, spec, step)

    jitted = jax.jit(step_fn, donate_argnums=0)
    rng = np.random.default_rng(10)
    variables = random_variables(spec, rng)
    for step in range(4):  # Python ints: weak int32 scalars, one signature
        rows, _ = random_rows(rng)
        grads = jnp.asarray(rng.normal(size=(rows.size, DIM)), jnp.float32)
        variables = jitted(variables, jnp.asarray(rows), grads, step)
    assert len(traces) == 1
    assert jitted._cache_size() == 1  # pyright: ignore[reportAttributeAccessIssue]


def test_custom_optimizer_rule() -> None:
    def heavy_ball(grad: Any, row: Any, velocity: Any, lr: Any, mu: Any) -> tuple[Any, Any]:
        new_velocity = mu * velocity + grad
        return row - lr * new_velocity, new_velocity

    spec = tc.CustomOptimizer(update_fn=heavy_ball, learning_rate=0.1,
                              slot_initial_value_tuple=(0.25,), extra_hyperparameters=(0.9,))
    rng = np.random.default_rng(11)
    table = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
    variables = EmbeddingVariables(jnp.asarray(table), init_slots(spec, (VOCAB, DIM)))
    rows, _ = random_rows(rng)
    grads = rng.normal(size=(rows.size, DIM)).astype(np.float32)
    jitted = jax.jit(lambda v, r, g, s: apply_sparse_update(v, r, g, spec, s))
    out = jitted(variables, jnp.asarray(rows), jnp.asarray(grads), 0)

    expected_table, expected_velocity = table.copy(), np.full((VOCAB, DIM), 0.25, np.float32)
    for row, grad in zip(rows, grads, strict=True):
        if row < VOCAB:
            expected_velocity[row] = 0.9 * 0.25 + grad
            expected_table[row] = table[row] - 0.1 * expected_velocity[row]
    assert_close(out.table, expected_table)
    assert_close(out.slots[0], expected_velocity)
    # The oracle calls the user's rule on numpy arrays of the touched rows.
    real = rows < VOCAB
    want_row, (want_velocity,) = reference_update(
        spec, grads[real], table[rows[real]], [np.full((TOUCHED, DIM), 0.25, np.float32)], 0)
    assert_close(np.asarray(out.table)[rows[real]], want_row)
    assert_close(np.asarray(out.slots[0])[rows[real]], want_velocity)


def test_mismatched_slots_and_rule_outputs_are_explained() -> None:
    spec = SPECS["adam"]
    rows = jnp.arange(4, dtype=jnp.int32)
    grads = jnp.ones((4, DIM), jnp.float32)
    table = jnp.zeros((VOCAB, DIM), jnp.float32)
    with pytest.raises(ValueError, match=r"keeps slots \('momentum', 'velocity'\).*init_slots"):
        apply_sparse_update(EmbeddingVariables(table, ()), rows, grads, spec, 0)
    with pytest.raises(ValueError, match=r"grads \[U, 8\]"):
        apply_sparse_update(EmbeddingVariables(table, init_slots(spec, table.shape)), rows,
                            grads[:2], spec, 0)
    bad = tc.CustomOptimizer(update_fn=lambda g, w, lr: (w, w))
    with pytest.raises(ValueError, match=r"returned 2 arrays; expected a tuple \(new_row, \*new_slots\) of 1 array\."):
        apply_sparse_update(EmbeddingVariables(table, ()), rows, grads, bad, 0)
