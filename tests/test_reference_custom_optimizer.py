"""Differential: custom optimizers as StableHLO, and the optimizer-spec methods, vs the reference.

A module the reference's `lower_to_stablehlo` / `wrap_stablehlo_with_limits` writes
trains a table here (through compat's `tpu_sparse_dense_matmul_grad` and
`tilecore.ops`) as the numpy oracle of the Python rule says; a module tilecore
writes runs in the reference's own StableHLO call primitive with the same result;
`get_hyperparameters` and the float/bool parameters agree class by class.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import pathlib
from typing import Any

import numpy as np
import pytest

import tilecore as tc
from _custom_optimizer_cases import DIM, compat_custom, compat_step, normalised_momentum
from _ops_cases import RICH, assert_close, check_against_oracle, oracle_steps, run_steps
from _reference_peer import requires_reference, run_reference
from tilecore.compat.lib.nn import custom_optimizer_lowering, embedding_spec
from tilecore.optimizers import StableHLORule, update_rule
from tilecore.testing import reference_update

pytestmark = requires_reference

LIMITS = (-0.3, 0.3)
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGDOptimizerSpec", {"learning_rate": 0.5}),
    "adagrad": ("AdagradOptimizerSpec", {"learning_rate": 0.2, "initial_accumulator_value": 0.3}),
    "adam": ("AdamOptimizerSpec", {"learning_rate": 0.01, "beta_1": 0.8, "epsilon": 1e-4}),
    "adagrad_momentum": ("AdagradMomentumOptimizerSpec",
                         {"momentum": 0.7, "beta2": 0.9, "use_nesterov": True}),
    "ftrl": ("FTRLOptimizerSpec", {"l1_regularization_strength": 0.1, "beta": 0.2,
                                   "multiply_linear_by_learning_rate": True}),
    "laprop": ("LaPropOptimizerSpec", {"b1": 0.8, "b2": 0.9}),
    "f2a": ("F2AOptimizerSpec", {"rho": 0.3, "l2_regularization_strength": 0.01,
                                 "max_lr_multiplier": 50.0}),
}
STEPS = (None, 0, 3)


def _reference_side(workdir: pathlib.Path) -> None:
    """Lower the rule there, run our module there, and read its specs' parameters."""
    (workdir / "specs.json").write_text(json.dumps(SPECS))
    run_reference("from typing import Any\n" + inspect.getsource(normalised_momentum) + f"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax_tpu_embedding.sparsecore.lib.nn import custom_optimizer_lowering as col
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es

text = col.lower_to_stablehlo(normalised_momentum, embedding_dim={DIM}, num_slot_variables=1)
(WORKDIR / "reference.mlir").write_text(text)
(WORKDIR / "reference_clipped.mlir").write_text(
    es.CustomOptimizerSpec.wrap_stablehlo_with_limits(text, {DIM}, 1, 1, *{LIMITS!r}))

# tilecore's module, called through the reference's own StableHLO call primitive.
ours = (WORKDIR / "ours.mlir").read_text()
data = np.load(WORKDIR / "rows.npz")
row_aval = jax.core.ShapedArray((1, {DIM}), jnp.float32)
call = jax.jit(lambda *a: col._call_stablehlo_p.bind(
    *a, stablehlo_str=ours, out_avals=(row_aval, row_aval)))
outs = [call(*(data[k][i:i + 1] for k in ("grad", "row", "velocity")),
             jnp.full((1, {DIM}), data["lr"], jnp.float32))
        for i in range(len(data["grad"]))]
np.savez(WORKDIR / "ours_in_reference.npz", row=np.concatenate([o[0] for o in outs]),
         velocity=np.concatenate([o[1] for o in outs]))

# The reference's own F2A update computation: lowered (not compiled) on the CPU, its
# per-row function taken out of the module as a main of its own.
from jax.extend.mlir import ir
from jax.interpreters import mlir
from jax_tpu_embedding.sparsecore.lib.core.primitives import sparse_dense_matmul_grad_with_f2a as f2a
S = jax.ShapeDtypeStruct
i32, f32 = jnp.int32, jnp.float32
shapes = ([S((16,), i32), S((64,), i32), S((64,), i32), S((64,), f32), S((), i32)]
          + [S((32, {DIM}), f32)] * 3 + [S((16, {DIM}), f32)] + [S((), f32)] * 6)
lowered = jax.jit(lambda *a: f2a.tpu_sparse_dense_matmul_grad_with_f2a_primitive.bind(
    *a, max_ids_per_partition=8, max_unique_ids_per_partition=8)).lower(*shapes).as_text()
with mlir.make_ir_context():
    module = ir.Module.parse(lowered)
    [update] = [op for op in module.body.operations
                if ir.StringAttr(op.attributes["sym_name"]).value == "f2a_optimizer_update"]
    body = str(update).replace("private @f2a_optimizer_update", "@main")
(WORKDIR / "reference_f2a.mlir").write_text("module {{\\n" + body + "\\n}}\\n")

out = {{}}
for name, (cls, kwargs) in json.loads((WORKDIR / "specs.json").read_text()).items():
    spec = getattr(es, cls)(**kwargs)
    out[name] = {{
        "hyper": {{str(s): [float(np.asarray(v)) for v in spec.get_hyperparameters(s)]
                   for s in {STEPS!r}}},
        "float": spec.get_float_params(), "bool": spec.get_bool_params(),
    }}
(WORKDIR / "params.json").write_text(json.dumps(out))
""", workdir)


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("custom_optimizer")
    rng = np.random.default_rng(0)
    rows: dict[str, Any] = {k: rng.normal(size=(5, DIM)).astype(np.float32)
                            for k in ("grad", "row", "velocity")}
    np.savez(workdir / "rows.npz", lr=np.float32(0.2), **rows)
    (workdir / "ours.mlir").write_text(custom_optimizer_lowering.lower_to_stablehlo(
        normalised_momentum, embedding_dim=DIM, num_slot_variables=1))
    _reference_side(workdir)
    return workdir


@pytest.mark.parametrize("module", ["reference.mlir", "reference_clipped.mlir"])
def test_reference_module_trains_through_compat(exchanged: pathlib.Path, module: str,
                                                kernels: str) -> None:
    del kernels
    text = (exchanged / module).read_text()
    clipped = module == "reference_clipped.mlir"
    got, want, _ = compat_step(compat_custom(stablehlo=text),
                               compat_custom(custom_computation_fn=normalised_momentum))
    touched = np.any(want[1] != 0.25, axis=1, keepdims=True)  # the velocity moved
    assert 0 < touched.sum() < len(touched)
    want_table = np.where(touched, np.clip(want[0], *LIMITS), want[0]) if clipped else want[0]
    assert_close(got[0], want_table, "table")
    assert_close(got[1], want[1], "velocity")


def test_reference_module_trains_through_ops(exchanged: pathlib.Path, kernels: str) -> None:
    del kernels
    python = tc.CustomOptimizer(update_fn=normalised_momentum, learning_rate=0.2,
                                slot_initial_value_tuple=(0.25,))
    module = StableHLORule((exchanged / "reference.mlir").read_text(), num_slots=1)
    # RICH with both tables 8 wide: no padded columns, which a rule coupling a row's
    # columns (as this one does) would see in the stacked rows, not in the oracle's.
    wide = dataclasses.replace(RICH, tables=tuple(dataclasses.replace(t, embedding_dim=DIM)
                                                  for t in RICH.tables))
    case = wide.with_optimizer("reference-stablehlo", dataclasses.replace(python,
                                                                          update_fn=module))
    check_against_oracle(case, run_steps(case, steps=2),
                         oracle_steps(wide.with_optimizer("python", python), steps=2))


def test_our_module_runs_in_the_reference(exchanged: pathlib.Path) -> None:
    data = np.load(exchanged / "rows.npz")
    spec = tc.CustomOptimizer(update_fn=normalised_momentum, learning_rate=0.2)
    want_row, (want_velocity,) = reference_update(spec, data["grad"], data["row"],
                                                  [data["velocity"]], 0)
    there = np.load(exchanged / "ours_in_reference.npz")
    assert_close(there["row"], want_row)
    assert_close(there["velocity"], want_velocity)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_spec_methods_match_the_reference(exchanged: pathlib.Path, name: str) -> None:
    reference = json.loads((exchanged / "params.json").read_text())[name]
    cls, kwargs = SPECS[name]
    spec = getattr(embedding_spec, cls)(**kwargs)
    for step in STEPS:
        ours = [float(np.asarray(v)) for v in spec.get_hyperparameters(step)]
        # The reference folds Adam's bias correction in float32 (1 − β2 cancels); we
        # fold it in float64 and round once, so allow float32 cancellation error.
        np.testing.assert_allclose(ours, reference["hyper"][str(step)], rtol=2e-5,
                                   err_msg=f"{name} at step={step}")
    assert spec.get_float_params() == pytest.approx(reference["float"])
    assert spec.get_bool_params() == reference["bool"]


@pytest.mark.parametrize("step", [0, 1, 9])
def test_reference_f2a_computation_matches_ours(exchanged: pathlib.Path, step: int) -> None:
    """The reference's F2A per-row function (10 row arguments, one tuple result) run here
    as a StableHLO rule, against tilecore's F2A rule and the numpy oracle."""
    reference = StableHLORule((exchanged / "reference_f2a.mlir").read_text(), num_slots=2,
                              num_hyperparameters=6, name="reference f2a")
    assert reference.signature.tuple_result
    spec = tc.F2A(learning_rate=0.1, rho=0.6, l1_regularization_strength=0.02,
                  l2_regularization_strength=0.03, max_lr_multiplier=4.0)
    rng = np.random.default_rng(step)
    grad, row = (rng.normal(size=(6, DIM)).astype(np.float32) for _ in range(2))
    slots = (rng.uniform(0.05, 2.0, (6, DIM)).astype(np.float32),
             rng.integers(0, 12, (6, DIM)).astype(np.float32))
    there = reference(grad, row, *slots, *spec.hyperparameters(step))
    ours = update_rule(spec)(grad, row, *slots, *spec.hyperparameters(step))
    want_row, want_slots = reference_update(spec, grad, row, slots, step)
    for name, a, b, c in zip(("row", "accumulator", "local_step"), there, ours,
                             (want_row, *want_slots), strict=True):
        assert_close(a, c, f"reference {name} at step={step}")
        assert_close(b, a, f"tilecore {name} vs the reference's at step={step}")
