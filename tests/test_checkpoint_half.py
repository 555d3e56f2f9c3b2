"""Checkpoints of half-precision tables: the dtype is recorded, restored bit for bit on
any topology, and converted (exactly up, to nearest down) into a plan of another dtype."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilecore as tc
import tilecore.checkpoint as ck
import tilecore.ops as ops


def _plan(sc: int, a: Any = jnp.bfloat16, b: Any = jnp.float16) -> tc.StackingPlan:
    ta = tc.TableSpec(name="a", vocab_size=30, embedding_dim=6, weights_dtype=a,
                      optimizer=tc.Adagrad(learning_rate=0.1))
    tb = tc.TableSpec(name="b", vocab_size=20, embedding_dim=8, weights_dtype=b,
                      optimizer=tc.Adam())
    features = [tc.FeatureSpec(name="fa", table=ta, input_shape=(8, 2)),
                tc.FeatureSpec(name="fb", table=tb, input_shape=(8, 2))]
    return tc.plan_stacking(features, tc.Topology(sc_per_device=sc))


def _variables(plan: tc.StackingPlan) -> dict[str, ops.EmbeddingVariables]:
    """Random tables in their dtype; random float32 slots."""
    rng = np.random.default_rng(0)

    def draw(spec: Any, dtype: Any) -> jax.Array:
        return jnp.asarray(rng.standard_normal((spec.vocab_size, spec.embedding_dim)), dtype)

    return {name: ops.EmbeddingVariables(draw(spec, spec.weights_dtype), tuple(
        draw(spec, jnp.float32) for _ in spec.optimizer.slot_names))
        for name, spec in plan.stacks.items()}


def _tables(plan: tc.StackingPlan, variables: Any) -> dict[str, np.ndarray]:
    return ops.unshard(plan, {n: v.table for n, v in variables.items()})


def test_dtype_recorded_and_restored_bit_for_bit(tmp_path: Path) -> None:
    plan = _plan(2)
    variables = _variables(plan)
    ck.save(tmp_path, plan, variables, step=3)
    assert ck.verify(tmp_path) == 3
    meta = ck.read_metadata(tmp_path)
    assert {n: t["weights_dtype"] for n, t in meta["tables"].items()} == {
        "a": "bfloat16", "b": "float16"}
    assert sorted(s["weights_dtype"] for s in meta["stacks"]) == ["bfloat16", "float16"]
    restored = ck.restore(tmp_path, plan).variables
    for name, var in variables.items():
        got = restored[name]
        assert got.table.dtype == var.table.dtype == plan.stacks[name].weights_dtype
        np.testing.assert_array_equal(np.asarray(got.table).view(np.uint16),
                                      np.asarray(var.table).view(np.uint16))
        for g, w in zip(got.slots, var.slots, strict=True):
            assert g.dtype == np.float32
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_restore_onto_another_topology(tmp_path: Path) -> None:
    plan = _plan(2)
    variables = _variables(plan)
    ck.save(tmp_path, plan, variables, step=0)
    other = _plan(4)
    restored = ck.restore(tmp_path, other).variables
    for name, spec in other.stacks.items():
        assert restored[name].table.dtype == spec.weights_dtype
    for name, want in _tables(plan, variables).items():
        got = _tables(other, restored)[name]
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize(("saved", "wanted"), [(jnp.bfloat16, jnp.float32),
                                                (jnp.float32, jnp.bfloat16),
                                                (jnp.float16, jnp.bfloat16)])
def test_restore_into_another_dtype_converts(tmp_path: Path, saved: Any, wanted: Any) -> None:
    plan = _plan(2, a=saved)
    variables = _variables(plan)
    ck.save(tmp_path, plan, variables, step=0)
    target = _plan(2, a=wanted)
    restored = ck.restore(tmp_path, target).variables
    stack = target.table_settings["a"].stack_name
    assert restored[stack].table.dtype == wanted
    want = _tables(plan, variables)["a"].astype(np.float32).astype(wanted)  # to nearest
    np.testing.assert_array_equal(_tables(target, restored)["a"], want)


@pytest.mark.parametrize(("saved", "wanted", "value"), [(jnp.float32, jnp.float16, 1e5),
                                                         (jnp.float32, jnp.bfloat16, 3.4e38),
                                                         (jnp.bfloat16, jnp.float16, 1e30)])
def test_restore_into_a_dtype_too_narrow_for_the_values_is_refused(
        tmp_path: Path, saved: Any, wanted: Any, value: float) -> None:
    """Values the narrower dtype cannot hold became inf (float16 with numpy's anonymous
    overflow warning, bfloat16 in silence)."""
    plan = _plan(2, a=saved)
    variables = _variables(plan)
    stack = plan.table_settings["a"].stack_name
    table = np.asarray(variables[stack].table).copy()
    table[3, 2] = value
    variables[stack] = ops.EmbeddingVariables(jnp.asarray(table), variables[stack].slots)
    ck.save(tmp_path, plan, variables, step=0)
    with pytest.raises(ValueError, match=rf"Table 'a': 1 of its values do not fit its stack's "
                                         rf"weights_dtype {np.dtype(wanted).name} .* would "
                                         r"become inf"):
        ck.restore(tmp_path, _plan(2, a=wanted))


def test_export_tables_is_float32(tmp_path: Path) -> None:
    plan = _plan(2)
    variables = _variables(plan)
    ck.save(tmp_path, plan, variables, step=0)
    for source in (tmp_path, variables):
        exported = ck.export_tables(source, plan)
        for name, want in _tables(plan, variables).items():
            assert exported[name].dtype == np.float32
            np.testing.assert_array_equal(exported[name], want.astype(np.float32))


def test_metadata_json_is_plain(tmp_path: Path) -> None:
    """The dtype is a name in the JSON, not a repr."""
    plan = _plan(2)
    ck.save(tmp_path, plan, _variables(plan), step=0)
    text = json.dumps(ck.read_metadata(tmp_path))
    assert "dtype(" not in text and '"weights_dtype": "bfloat16"' in text
