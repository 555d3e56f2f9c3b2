"""Custom optimizers as Python rules and as StableHLO, the optimizer-spec methods, F2A.

A rule lowered to StableHLO must update tables exactly as the Python rule does under
the numpy oracle, through `tilecore.ops` and compat's `tpu_sparse_dense_matmul_grad`,
on both kernel paths; bad modules get errors that name the optimizer and table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.mlir import ir
from jax.interpreters import mlir

import tilecore as tc
from _custom_optimizer_cases import DIM, compat_custom, compat_step, normalised_momentum
from _ops_cases import OPTIMIZERS, RICH, assert_close, check_against_oracle, oracle_steps, run_steps
from tilecore.compat import embedding_spec
from tilecore.compat.lib.nn import custom_optimizer_lowering as lowering
from tilecore.optimizers import StableHLORule, lower_rule, update_rule
from tilecore.testing import reference_update


def python_spec() -> tc.CustomOptimizer:
    return tc.CustomOptimizer(update_fn=normalised_momentum, learning_rate=0.2,
                              slot_initial_value_tuple=(0.25,))


def random_rows(rng: np.random.Generator, rows: int, dim: int = DIM) -> list[np.ndarray]:
    return [rng.normal(size=(rows, dim)).astype(np.float32) for _ in range(3)]


# --- the rule itself -------------------------------------------------------------------------


def test_stablehlo_rule_matches_the_python_rule_under_the_oracle() -> None:
    rule = StableHLORule(lower_rule(normalised_momentum, dim=DIM, num_slots=1), num_slots=1)
    grad, row, velocity = random_rows(np.random.default_rng(0), 7)
    want_row, (want_velocity,) = reference_update(python_spec(), grad, row, [velocity], 3)
    for call in (rule, jax.jit(rule)):
        new_row, new_velocity = call(grad, row, velocity, 0.2)
        assert_close(new_row, want_row)
        assert_close(new_velocity, want_velocity)


def test_every_module_form_runs_the_same_rule() -> None:
    """Text, text bytes, MLIR bytecode, an ir.Module, and a main returning one tuple."""
    text = lower_rule(normalised_momentum, dim=DIM, num_slots=1)
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        bytecode = _bytecode(module)
    grad, row, velocity = random_rows(np.random.default_rng(1), 5)
    want = StableHLORule(text, num_slots=1)(grad, row, velocity, 0.2)
    for form in (text.encode(), bytecode, module, _tuple_returning(text)):
        got = StableHLORule(form, num_slots=1)(grad, row, velocity, 0.2)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _bytecode(module: ir.Module) -> bytes:
    import io

    buffer = io.BytesIO()
    module.operation.write_bytecode(buffer)
    return buffer.getvalue()


def _tuple_returning(text: str) -> str:
    """`text`'s main rewritten by hand to return `tuple<row, slot>` (the reference's own
    built-in optimizers return one tuple)."""
    row = f"tensor<1x{DIM}xf32>"
    head, body = text.split("{\n", 1)[1].split(") -> (", 1)
    args = head.split("@main(", 1)[1]
    ops_text = body.split("{\n", 1)[1].rsplit("return", 1)[0]
    results = body.split("{\n", 1)[1].rsplit("return", 1)[1].split(":")[0].strip()
    return (f"module {{\n  func.func public @main({args}) -> tuple<{row}, {row}> {{\n{ops_text}"
            f"    %t = stablehlo.tuple {results} : tuple<{row}, {row}>\n"
            f"    return %t : tuple<{row}, {row}>\n  }}\n}}\n")


def test_lowering_keeps_unused_arguments_and_clips() -> None:
    def ignores_lr(grad: Any, row: Any, lr: Any) -> tuple[Any]:
        return (row - 0.5 * grad,)

    text = lowering.lower_to_stablehlo(ignores_lr, embedding_dim=4, min_value=-0.1,
                                       max_value=0.2)
    rule = StableHLORule(text, num_slots=0)
    assert rule.signature.args == ((1, 4),) * 3
    grad, row, _ = random_rows(np.random.default_rng(2), 3, 4)
    (new_row,) = rule(grad, row, 0.1)
    np.testing.assert_allclose(np.asarray(new_row), np.clip(row - 0.5 * grad, -0.1, 0.2),
                               rtol=1e-6)
    wrapped = lowering.wrap_stablehlo_with_limits(
        lowering.lower_to_stablehlo(ignores_lr, embedding_dim=4), 4, 0, 1, max_value=0.0)
    (capped,) = StableHLORule(wrapped)(grad, row, 0.1)
    np.testing.assert_allclose(np.asarray(capped), np.minimum(row - 0.5 * grad, 0.0), rtol=1e-6)
    assert lowering.wrap_stablehlo_with_limits(text.encode(), 4, 0, 1) == text
    np.testing.assert_array_equal(
        np.asarray(lowering.apply_clipping(jnp.arange(4.0), min_value=1.5)), [1.5, 1.5, 2, 3])


# --- through the ops -------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["python", "stablehlo"])
def test_ops_lookup_grad_matches_the_oracle(form: str, kernels: str) -> None:
    """The shared custom rule (two hyperparameters) on the one-stack case (padded dim 8)."""
    del kernels
    spec = OPTIMIZERS["custom"]
    assert isinstance(spec, tc.CustomOptimizer)
    if form == "stablehlo":
        text = lower_rule(spec.update_fn, dim=DIM, num_slots=1, num_hyperparameters=2)
        spec = dataclasses.replace(spec, update_fn=StableHLORule(text, num_slots=1,
                                                                 num_hyperparameters=2))
    case = RICH.with_optimizer(form, spec)
    run = run_steps(case, steps=2)
    assert run.traces == {"lookup": 1, "lookup_grad": 1}
    oracle = oracle_steps(RICH.with_optimizer("python", OPTIMIZERS["custom"]), steps=2)
    check_against_oracle(case, run, oracle)


@pytest.mark.parametrize("form", ["custom_computation_fn", "stablehlo"])
def test_compat_grad_with_a_custom_optimizer_matches_the_oracle(form: str, kernels: str) -> None:
    del kernels
    rule: Any = normalised_momentum
    if form == "stablehlo":
        rule = embedding_spec.CustomOptimizerSpec.lower_to_stablehlo(
            normalised_momentum, embedding_dim=DIM, num_slot_variables=1)
    got, want, before = compat_step(compat_custom(**{form: rule}),
                                    compat_custom(custom_computation_fn=normalised_momentum))
    for name, a, b in zip(("table", "velocity"), got, want, strict=True):
        assert_close(a, b, name)
    moved = np.any(got[0] != before, axis=1)
    assert 0 < moved.sum() < len(moved)  # touched rows only


# --- errors ----------------------------------------------------------------------------------


def _native(spec: embedding_spec.OptimizerSpec) -> tc.OptimizerSpec:
    from tilecore.compat._optimizers import native_optimizer

    return native_optimizer("t", spec)


def test_bad_stablehlo_is_explained() -> None:
    text = lower_rule(normalised_momentum, dim=DIM, num_slots=1)
    prefix = r"TableSpec 't': StableHLO rule of optimizer 'mine'"
    with pytest.raises(ValueError, match=prefix + r": the StableHLO module does not parse"):
        _native(compat_custom(stablehlo="module { func.func @main( }"))
    with pytest.raises(ValueError, match=prefix + r": main takes 4 arguments and returns 2 "
                                              r"results; with 0 slots"):
        _native(embedding_spec.CustomOptimizerSpec(stablehlo=text, short_name_str="mine"))
    with pytest.raises(ValueError, match=prefix + r": the StableHLO module has no function "
                                              r"named main"):
        _native(compat_custom(stablehlo=text.replace("@main", "@rule")))
    f32, f16 = (jax.ShapeDtypeStruct((1, DIM), t) for t in (jnp.float32, jnp.float16))
    half = jax.jit(lambda g, w, v, lr: (w - g, v)).lower(f32, f32, f16, f32).as_text()
    with pytest.raises(ValueError, match=prefix + r": every argument .* float32 tensor; argument 2 is tensor<1x8xf16>"):
        _native(compat_custom(stablehlo=half))
    wide = lower_rule(lambda g, w, v, lr: (w - g, v), dim=DIM, num_slots=1).replace(
        "%arg0: tensor<1x8xf32>", "%arg0: tensor<1x8xf32>, %extra: tensor<2x8xf32>")
    with pytest.raises(ValueError, match=prefix + r": main takes 5 arguments"):
        _native(compat_custom(stablehlo=wide))
    with pytest.raises(TypeError, match="stablehlo must be a str, bytes"):
        _native(compat_custom(stablehlo=3.5))
    with pytest.raises(ValueError, match="either stablehlo or custom_computation_fn"):
        _native(compat_custom())
    # A module for rows of dim 4 on a table of dim 8: named when the update is traced.
    narrow = compat_custom(stablehlo=lower_rule(normalised_momentum, dim=4, num_slots=1))
    with pytest.raises(ValueError, match=r"'mine'.*rows of dim 4.*embedding_dim"):
        compat_step(narrow, narrow)
    rule = StableHLORule(text, num_slots=1)
    with pytest.raises(ValueError, match="got 2 hyperparameters after 1 slots; the module takes 1"):
        rule(*random_rows(np.random.default_rng(5), 2), 0.1, 0.2)


# --- the reference's optimizer-spec methods --------------------------------------------------


def test_get_hyperparameters_follow_the_reference_order() -> None:
    def values(spec: embedding_spec.OptimizerSpec, step: Any = None) -> list[float]:
        out = spec.get_hyperparameters(step)
        assert all(isinstance(v, jax.Array) and v.shape == () for v in out)
        return [float(v) for v in out]

    assert values(embedding_spec.SGDOptimizerSpec(learning_rate=0.5)) == [0.5]
    adam = values(embedding_spec.AdamOptimizerSpec(), 0)
    np.testing.assert_allclose(adam, [1e-3 * np.sqrt(1 - 0.999) / 0.1, 0.9, 0.999,
                                      1e-8 * np.sqrt(1 - 0.999)], rtol=1e-6)
    assert values(embedding_spec.AdamOptimizerSpec()) == adam  # None is step 0
    momentum = embedding_spec.AdagradMomentumOptimizerSpec(use_nesterov=True)
    *floats, nesterov = momentum.get_hyperparameters()
    assert nesterov.dtype == jnp.bool_ and bool(nesterov)
    np.testing.assert_allclose([float(v) for v in floats], [1e-3, 0.9, 1.0, 1e-10, 2.0])
    np.testing.assert_allclose(values(embedding_spec.FTRLOptimizerSpec(beta=0.5)),
                               [0.01, -0.5, 0.0, 0.0, 0.5])
    laprop = embedding_spec.LaPropOptimizerSpec()
    assert float(laprop.get_decay_rate()) == pytest.approx(0.95)
    assert float(laprop.get_decay_rate(3)) == pytest.approx(0.95 * (1 - 0.95**3) / (1 - 0.95**4))
    np.testing.assert_allclose(values(laprop, 3)[2], float(laprop.get_decay_rate(3)))
    f2a = embedding_spec.F2AOptimizerSpec(rho=0.25, max_lr_multiplier=9.0)
    np.testing.assert_allclose(values(f2a, 12), [0.01, 0.25, 0.0, 0.0, 9.0, 12.0])
    assert values(f2a)[-1] == 0.0
    schedule = embedding_spec.SGDOptimizerSpec(learning_rate=lambda step: 1.0 / (1 + step))
    assert values(schedule, 3) == [0.25]
    assert values(compat_custom(custom_computation_fn=normalised_momentum), 1) == [
        pytest.approx(0.2)]
    traced = jax.jit(lambda s: f2a.get_hyperparameters(s))(jnp.int32(12))
    np.testing.assert_allclose([float(v) for v in traced], values(f2a, 12), rtol=1e-6)


def test_get_optimizer_primitive_applies_the_update() -> None:
    grad, row, acc = random_rows(np.random.default_rng(6), 4)
    acc, local = np.abs(acc) + 0.1, np.full_like(acc, 2.0)
    f2a = embedding_spec.F2AOptimizerSpec(learning_rate=0.1, l2_regularization_strength=0.1)
    rule = f2a.get_optimizer_primitive()
    assert rule is update_rule(tc.F2A())
    new = rule(grad, row, acc, local, *f2a.to_native().hyperparameters(5))
    want_row, want_slots = reference_update(f2a.to_native(), grad, row, [acc, local], 5)
    for a, b in zip(new, (want_row, *want_slots), strict=True):
        assert_close(a, b)
    text = lower_rule(normalised_momentum, dim=DIM, num_slots=1)
    custom = compat_custom(stablehlo=text).get_optimizer_primitive()
    assert isinstance(custom, StableHLORule) and custom.name == "mine"


def test_float_and_bool_params_round_trip() -> None:
    ftrl = embedding_spec.FTRLOptimizerSpec(learning_rate=0.3, beta=0.2,
                                            multiply_linear_by_learning_rate=True)
    floats, bools = ftrl.get_float_params(), ftrl.get_bool_params()
    assert floats == {"learning_rate_power": -0.5, "l1_regularization_strength": 0.0,
                      "l2_regularization_strength": 0.0, "beta": 0.2,
                      "initial_accumulator_value": 0.1, "initial_linear_value": 0.0}
    assert bools == {"multiply_linear_by_learning_rate": True}
    again = embedding_spec.FTRLOptimizerSpec.from_float_and_bool_params(
        {**floats, "unknown": 1.0}, bools, 0.3)
    assert again == ftrl
    assert embedding_spec.SGDOptimizerSpec().get_float_params() == {}
    assert set(embedding_spec.F2AOptimizerSpec().get_float_params()) == {
        "rho", "initial_accumulator_value", "initial_local_step_value",
        "l1_regularization_strength", "l2_regularization_strength", "max_lr_multiplier"}


def test_f2a_spec_and_placeholder() -> None:
    f2a = embedding_spec.F2AOptimizerSpec(learning_rate=0.05, initial_local_step_value=1.0)
    assert f2a.to_native() == tc.F2A(learning_rate=0.05, initial_local_step_value=1.0)
    slots = f2a.slot_variables_initializers()
    assert type(slots).__name__ == "F2ASlotVariables"
    assert float(slots[1](None, (1,), jnp.float32)[0]) == 1.0  # local_step
    placeholder = embedding_spec.CallablePlaceholder("my.schedule")
    spec = embedding_spec.AdagradOptimizerSpec(learning_rate=placeholder)
    with pytest.raises(RuntimeError, match=r"my\.schedule"):
        spec.get_learning_rate(3)
