"""Specs are frozen, validated values whose errors name the offending field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

import tilecore as tc


def table(**changes: Any) -> tc.TableSpec:
    return tc.TableSpec(**{"name": "t", "vocab_size": 10, "embedding_dim": 4, **changes})


# --- TableSpec ---------------------------------------------------------------------------


def test_table_defaults_follow_the_reference() -> None:
    t = table()
    assert (t.combiner, t.max_ids_per_partition, t.max_unique_ids_per_partition) == ("sum", 256, 256)
    assert t.optimizer == tc.SGD() and t.initializer is None and t.quantization is None
    assert t.suggested_coo_buffer_size_per_device is None


@pytest.mark.parametrize(("field", "value"), [
    ("vocab_size", 0), ("vocab_size", -3), ("vocab_size", 3.0), ("vocab_size", True),
    ("vocab_size", 2**31), ("embedding_dim", 0), ("embedding_dim", "4"),
    ("max_ids_per_partition", 0), ("max_unique_ids_per_partition", -1),
    ("suggested_coo_buffer_size_per_device", 0), ("combiner", "max"), ("combiner", "SUM"),
])
def test_table_rejects_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"TableSpec 't': {field}"):
        table(**{field: value})


@pytest.mark.parametrize("name", ["", None, 3])
def test_table_rejects_bad_names(name: Any) -> None:
    with pytest.raises(ValueError, match="TableSpec: name must be a non-empty string"):
        table(name=name)


@pytest.mark.parametrize(("field", "value"), [
    ("optimizer", "sgd"), ("optimizer", tc.SGD), ("initializer", 3),
])
def test_table_rejects_bad_types(field: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"TableSpec 't': {field} must be"):
        table(**{field: value})


def test_specs_are_frozen() -> None:
    t = table()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.vocab_size = 20  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tc.Topology().sc_per_device = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tc.SGD().learning_rate = 0.1  # type: ignore[misc]


def test_with_limits_returns_a_new_table() -> None:
    t = table()
    u = t.with_limits(max_ids_per_partition=7, suggested_coo_buffer_size_per_device=64)
    assert (u.max_ids_per_partition, u.max_unique_ids_per_partition,
            u.suggested_coo_buffer_size_per_device) == (7, 256, 64)
    assert t.max_ids_per_partition == 256
    with pytest.raises(ValueError, match="max_unique_ids_per_partition"):
        t.with_limits(max_unique_ids_per_partition=-2)


# --- FeatureSpec -------------------------------------------------------------------------


def test_feature_shapes() -> None:
    f = tc.FeatureSpec(name="f", table=table(), input_shape=[8, 2])  # type: ignore[arg-type]
    assert f.input_shape == (8, 2) and f.output_shape == (8, 4) and f.batch_size == 8
    g = tc.FeatureSpec(name="g", table=table(), input_shape=(8, 2), output_shape=(2, 4, 4))
    assert g.batch_size == 8


@pytest.mark.parametrize(("changes", "match"), [
    ({"name": ""}, "FeatureSpec: name must be a non-empty string"),
    ({"input_shape": ()}, "FeatureSpec 'f': input_shape must be positive integers"),
    ({"input_shape": (0, 3)}, "FeatureSpec 'f': input_shape must be positive integers"),
    ({"input_shape": (8, 2.5)}, "FeatureSpec 'f': input_shape must be positive integers"),
    ({"output_shape": (8,)}, "FeatureSpec 'f': output_shape must be >= 2 positive integers"),
    ({"output_shape": (8, -4)}, "FeatureSpec 'f': output_shape must be >= 2 positive integers"),
    ({"output_shape": (8, 5)}, r"FeatureSpec 'f': output_shape\[-1\]=5 differs from the "
                               r"embedding_dim=4 of table 't'"),
])
def test_feature_rejects_bad_values(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tc.FeatureSpec(**{"name": "f", "table": table(), "input_shape": (8, 2), **changes})


def test_feature_rejects_a_non_table() -> None:
    with pytest.raises(TypeError, match="FeatureSpec 'f': table must be a TableSpec, got str"):
        tc.FeatureSpec(name="f", table="t", input_shape=(8, 2))  # type: ignore[arg-type]


def test_feature_rejects_a_scalar_input_shape_by_name() -> None:
    with pytest.raises(ValueError, match="FeatureSpec 'f': input_shape"):
        tc.FeatureSpec(name="f", table=table(), input_shape=8)  # type: ignore[arg-type]


# --- Topology and SparseCoreConfig --------------------------------------------------------


def test_topology_properties() -> None:
    topo = tc.Topology(global_devices=4, sc_per_device=2, local_devices=2)
    assert (topo.num_partitions, topo.num_local_devices, topo.num_processes) == (8, 2, 2)
    assert str(topo) == "4x2, local 2" and str(tc.Topology(global_devices=2)) == "2x4"
    assert tc.Topology().num_local_devices == 1 and tc.Topology().sc_per_device == 4


@pytest.mark.parametrize(("changes", "match"), [
    ({"global_devices": 0}, "global_devices must be an integer >= 1"),
    ({"global_devices": 2.0}, "global_devices must be an integer >= 1"),
    ({"sc_per_device": 0}, "sc_per_device must be an integer >= 1"),
    ({"sc_per_device": True}, "sc_per_device must be an integer >= 1"),
    ({"sc_per_device": 3}, "sc_per_device must be a power of two"),
    ({"global_devices": 3, "sc_per_device": 1}, "global_devices × sc_per_device must be a power"),
    ({"global_devices": 6, "sc_per_device": 2}, "global_devices × sc_per_device must be a power"),
    ({"global_devices": 4, "local_devices": 3}, "local_devices must divide global_devices=4"),
    ({"global_devices": 4, "local_devices": 0}, "local_devices must divide"),
    ({"global_devices": 2, "local_devices": 4}, "local_devices must divide"),
])
def test_topology_rejects_bad_values(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"Topology: {match}"):
        tc.Topology(**changes)


@pytest.mark.parametrize(("changes", "match"), [
    ({"max_ids_per_chip_per_sample": 0}, "max_ids_per_chip_per_sample must be an integer >= 1"),
    ({"max_ids_per_table": {"t": 0}}, r"max_ids_per_table\['t'\] must be an integer >= 1"),
    ({"max_unique_ids_per_table": {"t": True}}, r"max_unique_ids_per_table\['t'\]"),
    ({"max_unique_ids_per_table": {"t": 2.5}}, r"max_unique_ids_per_table\['t'\]"),
    ({"activation_mem_bytes_limit": 0}, "activation_mem_bytes_limit must be >= 1"),
])
def test_config_rejects_bad_values(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"SparseCoreConfig: {match}"):
        tc.SparseCoreConfig(**changes)


def test_config_defaults() -> None:
    config = tc.SparseCoreConfig()
    assert not config.disable_table_stacking and not config.allow_id_dropping
    assert config.max_ids_per_chip_per_sample is None
    assert config.activation_mem_bytes_limit == 2 * 1024 * 1024


# --- optimizers --------------------------------------------------------------------------


def test_optimizer_defaults_follow_the_reference() -> None:
    assert tc.SGD().learning_rate == 1e-3
    assert (tc.Adagrad().learning_rate, tc.Adagrad().initial_accumulator_value) == (1e-3, 0.1)
    adam = tc.Adam()
    assert (adam.beta_1, adam.beta_2, adam.epsilon) == (0.9, 0.999, 1e-8)
    am = tc.AdagradMomentum()
    assert (am.momentum, am.beta2, am.epsilon, am.exponent, am.use_nesterov,
            am.initial_accumulator_value, am.initial_momentum_value) == (
        0.9, 1.0, 1e-10, 2.0, False, 0.1, 0.0)
    ftrl = tc.FTRL()
    assert (ftrl.learning_rate, ftrl.learning_rate_power, ftrl.initial_accumulator_value,
            ftrl.multiply_linear_by_learning_rate) == (0.01, -0.5, 0.1, False)
    laprop = tc.LaProp()
    assert (laprop.b1, laprop.b2, laprop.eps, laprop.rms_clip_threshold) == (0.9, 0.95, 1e-30, None)
    f2a = tc.F2A()
    assert (f2a.learning_rate, f2a.rho, f2a.initial_accumulator_value,
            f2a.initial_local_step_value, f2a.l1_regularization_strength,
            f2a.l2_regularization_strength, f2a.max_lr_multiplier) == (
        0.01, 0.5, 0.1, 0.0, 0.0, 0.0, 1e6)


def test_slots() -> None:
    assert tc.SGD().slot_names == () and tc.SGD().slot_initial_values() == ()
    assert tc.Adagrad(initial_accumulator_value=0.5).slot_initial_values() == (0.5,)
    assert tc.Adam().slot_names == ("momentum", "velocity")
    assert tc.AdagradMomentum().slot_names == ("accumulator", "momentum")
    assert tc.FTRL().slot_names == ("accumulator", "linear")
    assert tc.FTRL().slot_initial_values() == (0.1, 0.0)
    assert tc.LaProp(initial_slot_value=0.2).slot_initial_values() == (0.2, 0.2)
    assert tc.F2A().slot_names == ("accumulator", "local_step")
    assert tc.F2A(initial_local_step_value=3.0).slot_initial_values() == (0.1, 3.0)
    custom = tc.CustomOptimizer(update_fn=lambda *a: a, slot_initial_value_tuple=(1.0, 2.0))
    assert custom.slot_names == ("slot_0", "slot_1")
    assert custom.slot_initial_values() == (1.0, 2.0)


def test_hyperparameters() -> None:
    assert tc.SGD(learning_rate=lambda step: 0.1 * (step + 1)).hyperparameters(2) == (
        pytest.approx(0.3),)
    alpha, b1, b2, eps = tc.Adam().hyperparameters(0)
    assert alpha == pytest.approx(1e-3 * math.sqrt(1 - 0.999) / (1 - 0.9))
    assert eps == pytest.approx(1e-8 * math.sqrt(1 - 0.999)) and (b1, b2) == (0.9, 0.999)
    assert tc.LaProp().hyperparameters(0)[2] == 0.0  # the decay is 0 at step 0
    assert tc.LaProp().hyperparameters(3)[2] == pytest.approx(
        0.95 * (1 - 0.95**3) / (1 - 0.95**4))
    # F2A: the reference's order, the global step last.
    assert tc.F2A(rho=0.3, max_lr_multiplier=5.0).hyperparameters(7) == (
        0.01, 0.3, 0.0, 0.0, 5.0, 7)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: tc.SGD(learning_rate=0), "SGD: learning_rate must be a finite number > 0"),
    (lambda: tc.SGD(learning_rate=-1e-3), "SGD: learning_rate"),
    (lambda: tc.Adagrad(learning_rate=float("nan")), "Adagrad: learning_rate"),
    (lambda: tc.Adam(learning_rate=float("inf")), "Adam: learning_rate"),
    (lambda: tc.SGD(learning_rate="fast"), "SGD: learning_rate"),  # type: ignore[arg-type]
    (lambda: tc.Adagrad(initial_accumulator_value=float("nan")),
     "Adagrad: initial_accumulator_value must be a finite number"),
    (lambda: tc.Adam(beta_1=1.0), r"Adam: beta_1 must be in \[0, 1\)"),
    (lambda: tc.Adam(beta_2=-0.1), r"Adam: beta_2 must be in \[0, 1\)"),
    (lambda: tc.Adam(epsilon=0.0), "Adam: epsilon must be a finite number > 0"),
    (lambda: tc.AdagradMomentum(exponent=0.0), "AdagradMomentum: exponent"),
    (lambda: tc.AdagradMomentum(momentum=float("nan")), "AdagradMomentum: momentum"),
    (lambda: tc.AdagradMomentum(epsilon=float("inf")), "AdagradMomentum: epsilon"),
    (lambda: tc.FTRL(learning_rate_power=0.5), "FTRL: learning_rate_power must be <= 0"),
    (lambda: tc.FTRL(l1_regularization_strength=-1.0), "FTRL: l1_regularization_strength"),
    (lambda: tc.FTRL(l2_regularization_strength=float("inf")), "FTRL: l2_regularization_strength"),
    (lambda: tc.FTRL(beta=-1.0), "FTRL: beta must be finite and >= 0"),
    (lambda: tc.FTRL(initial_accumulator_value=0.0), "FTRL: initial_accumulator_value"),
    (lambda: tc.FTRL(initial_linear_value=float("nan")), "FTRL: initial_linear_value"),
    (lambda: tc.LaProp(rms_clip_threshold=1.0), "LaProp: rms_clip_threshold is not supported"),
    (lambda: tc.LaProp(b1=1.0), r"LaProp: b1 must be in \[0, 1\)"),
    (lambda: tc.LaProp(b2=1.5), r"LaProp: b2 must be in \[0, 1\)"),
    (lambda: tc.LaProp(eps=0.0), "LaProp: eps"),
    (lambda: tc.F2A(rho=float("nan")), "F2A: rho must be a finite number"),
    (lambda: tc.F2A(l1_regularization_strength=-0.1), "F2A: l1_regularization_strength"),
    (lambda: tc.F2A(initial_local_step_value=-1.0), "F2A: initial_local_step_value"),
    (lambda: tc.F2A(initial_accumulator_value=0.0), "F2A: initial_accumulator_value"),
    (lambda: tc.F2A(max_lr_multiplier=0.0), "F2A: max_lr_multiplier"),
    (lambda: tc.CustomOptimizer(update_fn=lambda *a: a, slot_initial_value_tuple=(float("inf"),)),
     "CustomOptimizer: slot_initial_value_tuple"),
    (lambda: tc.CustomOptimizer(update_fn=lambda *a: a, extra_hyperparameters=(0.5, float("nan"))),
     r"CustomOptimizer: extra_hyperparameters must be a finite number, got .*nan"),
    (lambda: tc.CustomOptimizer(update_fn=lambda *a: a, extra_hyperparameters=("x",)),
     r"CustomOptimizer: extra_hyperparameters must be a finite number, got .*'x'"),
])
def test_optimizer_rejects_bad_values(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_custom_optimizer_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="CustomOptimizer: update_fn must be callable"):
        tc.CustomOptimizer(update_fn=3)  # type: ignore[arg-type]


def test_schedule_returning_non_finite() -> None:
    opt = tc.SGD(learning_rate=lambda step: float("nan"))
    with pytest.raises(ValueError, match="SGD: the learning-rate schedule returned nan at step=3"):
        opt.learning_rate_at(3)


def test_ftrl_rejects_nan_learning_rate_power() -> None:
    with pytest.raises(ValueError, match="FTRL: learning_rate_power"):
        tc.FTRL(learning_rate_power=float("nan"))


def test_adam_rejects_a_string_beta_by_name() -> None:
    with pytest.raises(ValueError, match="Adam: beta_1"):
        tc.Adam(beta_1="x")  # type: ignore[arg-type]


# --- QuantizationConfig ------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "match"), [
    ({"min_value": 1.0, "max_value": 0.0}, "min_value must be < max_value"),
    ({"min_value": 0.0, "max_value": float("inf")}, "bounds must be finite"),
    ({"min_value": 0.0, "max_value": 1.0, "num_buckets": 1}, "num_buckets must be an integer >= 2"),
])
def test_quantization_rejects_bad_values(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"QuantizationConfig: {match}"):
        tc.QuantizationConfig(**changes)


@pytest.mark.parametrize(("schedule", "message"), [
    (lambda step: np.float32("nan"), "returned nan at step=3; it must return a finite number >= 0"),
    (lambda step: -0.1, "returned -0.1 at step=3; it must return a finite number >= 0"),
    (lambda step: np.array([0.1]), r"returned array\(\[0.1\]\) at step=3; it must return a scalar"),
    (lambda step: "0.1", "returned '0.1' at step=3; it must return a scalar"),
    (lambda step: True, "returned True at step=3; it must return a scalar"),
    (lambda step: None, "returned None at step=3; it must return a scalar"),
])
def test_schedule_returning_a_non_rate(schedule: Any, message: str) -> None:
    with pytest.raises(ValueError, match=f"SGD: the learning-rate schedule {message}"):
        tc.SGD(learning_rate=schedule).learning_rate_at(3)


def test_a_schedule_rate_is_a_float_whatever_its_number_type() -> None:
    import jax
    import jax.numpy as jnp

    for schedule in (lambda step: 1, lambda step: np.int64(1), lambda step: jnp.int32(1),
                     lambda step: np.array(1.0), lambda step: 0):
        rate = tc.SGD(learning_rate=schedule).learning_rate_at(3)
        assert type(rate) is float and rate == float(schedule(3))
    traced = jax.jit(lambda step: tc.SGD(learning_rate=lambda s: s + 1).learning_rate_at(step))
    assert traced(jnp.int32(2)).dtype == jnp.float32 and float(traced(jnp.int32(2))) == 3.0


def test_numpy_numbers_are_taken_as_the_python_numbers_they_are() -> None:
    """A size computed with NumPy (`ids.max() + 1`) is an integer: accepted, and held as a
    Python int (the message once said `must be an integer >= 1, got np.int64(16)`)."""
    items = tc.TableSpec(name="t", vocab_size=np.int64(16), embedding_dim=np.int32(4),
                         max_ids_per_partition=np.uint16(9),
                         optimizer=tc.Adagrad(learning_rate=np.float32(0.5),
                                              initial_accumulator_value=np.float64(0.25)))
    feature = tc.FeatureSpec(name="f", table=items, input_shape=(np.int64(8), np.int64(2)))
    topology = tc.Topology(global_devices=np.int64(2), sc_per_device=np.int8(2))
    config = tc.SparseCoreConfig(max_ids_per_table={"t": np.int64(10)})
    held = (items.vocab_size, items.embedding_dim, items.max_ids_per_partition,
            items.optimizer.learning_rate, items.optimizer.initial_accumulator_value,
            *feature.input_shape, topology.global_devices, topology.sc_per_device,
            topology.num_local_devices, config.max_ids_per_table["t"])
    assert held == (16, 4, 9, 0.5, 0.25, 8, 2, 2, 2, 2, 10)
    assert [type(v) for v in held] == [int, int, int, float, float, int, int, int, int, int, int]
    assert items == tc.TableSpec(name="t", vocab_size=16, embedding_dim=4, max_ids_per_partition=9,
                                 optimizer=tc.Adagrad(learning_rate=0.5,
                                                      initial_accumulator_value=0.25))
    for not_a_count in (np.True_, True, 16.0, np.float64(16.0)):
        with pytest.raises(ValueError, match="vocab_size must be an integer >= 1"):
            table(vocab_size=not_a_count)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: tc.Adagrad(initial_accumulator_value=0.0),
     "Adagrad: initial_accumulator_value must be a finite number > 0"),
    (lambda: tc.Adagrad(initial_accumulator_value=-1.0),
     "Adagrad: initial_accumulator_value must be a finite number > 0"),
    (lambda: tc.AdagradMomentum(initial_accumulator_value=-0.5),
     "AdagradMomentum: initial_accumulator_value must be >= 0"),
    (lambda: tc.AdagradMomentum(epsilon=-1e-3), "AdagradMomentum: epsilon must be >= 0"),
])
def test_accumulators_that_would_make_nan(make: Any, match: str) -> None:
    """Adagrad has no epsilon: its first update divides by √(a + g²), which is 0 for a row
    whose gradient sums to 0 when a = 0, and imaginary for small ones when a < 0."""
    with pytest.raises(ValueError, match=match):
        make()
