"""Hostile cases at the specs ↔ plan boundary: what a plan is built from and what it promises.

A plan that contradicts itself, or needs integers past int32, used to be accepted and
fail later (IDs wrapping to negative values, a feature's IDs never checked). Each
case must be refused when the spec or the plan is built, naming the table, feature
or stack and the value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tilecore as tc
from tilecore import stacking

TOPOLOGY = tc.Topology(global_devices=1, sc_per_device=4)


def features(vocab: int = 1000, count: int = 2) -> list[tc.FeatureSpec]:
    tables = [tc.TableSpec(name=f"t{i}", vocab_size=vocab, embedding_dim=8) for i in range(count)]
    return [tc.FeatureSpec(name=f"f{i}", table=t, input_shape=(64, 4))
            for i, t in enumerate(tables)]


def test_stacked_rows_past_int32_are_refused() -> None:
    """Two tables of 2**31 − 8 rows each fit int32 alone, not stacked."""
    with pytest.raises(ValueError, match=r"Stack 't0_t1': its tables \['t0', 't1'\] stack to "
                                         r"4294967296 rows .* separate stacks"):
        stacking.stack_tables(features(2**31 - 8), TOPOLOGY, [["t0", "t1"]])


@pytest.mark.parametrize(("returned", "match"), [
    ((0, 5), r"max_ids_per_partition must be an integer in \[1, 2\*\*31\), got 0"),
    ((5, -1), r"max_unique_ids_per_partition must be an integer in \[1, 2\*\*31\), got -1"),
    ((2.5, 4), r"max_ids_per_partition must be an integer .* got 2.5"),
    (None, r"stack_limits must return \(max_ids_per_partition, max_unique_ids_per_partition\)"),
    ((1, 2, 3), r"stack_limits must return"),
])
def test_stack_limit_callbacks_returning_nonsense(returned: Any, match: str) -> None:
    def limits(name: str, samples: int) -> Any:
        return returned

    with pytest.raises(ValueError, match=r"Stack 't0_t1': " + match):
        stacking.stack_tables(features(), TOPOLOGY, [["t0", "t1"]], stack_limits=limits)


def test_stack_limit_callbacks_may_return_numpy_integers() -> None:
    def limits(name: str, samples: int) -> Any:
        return np.int64(24), np.int32(16)

    plan = stacking.stack_tables(features(), TOPOLOGY, [["t0", "t1"]], stack_limits=limits)
    stack = plan.stacks["t0_t1"]
    assert (stack.max_ids_per_partition, stack.max_unique_ids_per_partition) == (24, 16)
    assert type(stack.max_ids_per_partition) is int


@pytest.mark.parametrize("value", [1.5, 0, -3, True])
def test_per_sample_limit_must_be_a_positive_integer(value: Any) -> None:
    with pytest.raises(ValueError, match=r"max_ids_per_chip_per_sample must be an integer >= 1"):
        tc.SparseCoreConfig(max_ids_per_chip_per_sample=value)


def test_output_shape_contradicting_input_shape() -> None:
    table = tc.TableSpec(name="t", vocab_size=100, embedding_dim=8)
    with pytest.raises(ValueError, match=r"FeatureSpec 'f': input_shape=\(64, 4\) and "
                                         r"output_shape=\(32, 8\) disagree on the global "
                                         r"batch: 64 input rows, 32 activation rows"):
        tc.FeatureSpec(name="f", table=table, input_shape=(64, 4), output_shape=(32, 8))


def _edited(change: Callable[[tc.StackingPlan], dict[str, Any]]) -> None:
    plan = stacking.stack_tables(features(), TOPOLOGY)
    dataclasses.replace(plan, **change(plan))


def test_feature_in_no_stack_is_refused() -> None:
    """A feature whose stack is missing would get no buffers: its IDs never checked."""
    with pytest.raises(ValueError, match=r"Feature 'f1' \(table 't1'\) is in no stack of the "
                                         r"plan \(stacks: \['t0'\]\)"):
        _edited(lambda plan: {"stacks": {"t0": plan.stacks["t0"]}})


def test_stack_listing_a_table_placed_elsewhere_is_refused() -> None:
    def moved(plan: tc.StackingPlan) -> dict[str, Any]:
        setting = dataclasses.replace(plan.table_settings["t1"], stack_name="t0")
        return {"table_settings": {**plan.table_settings, "t1": setting}}

    with pytest.raises(ValueError, match=r"Stack 't1' lists table 't1', but the plan places "
                                         r"that table in stack 't0'"):
        _edited(moved)


@pytest.mark.parametrize("value", [0, -1, 2**31, 3.0])
def test_with_stack_limits_checks_its_values(value: Any) -> None:
    plan = stacking.stack_tables(features(), TOPOLOGY)
    with pytest.raises(ValueError, match=r"Stack 't0': max_ids_per_partition must be an integer"):
        plan.with_stack_limits("t0", max_ids_per_partition=value)


def test_coo_buffers_past_int32_offsets_are_refused() -> None:
    plan = stacking.stack_tables(features(), TOPOLOGY)
    stack = dataclasses.replace(plan.stacks["t0"], max_ids_per_partition=2**30)
    with pytest.raises(ValueError, match=r"Stack 't0': its COO buffer would hold 17179869184 "
                                         r"entries per device, past the int32 offsets"):
        tc.preprocessing.coo_buffer_size_per_device(stack, TOPOLOGY)
    with pytest.raises(ValueError, match=r"past the int32 offsets .*64 minibatches"):
        tc.preprocessing.coo_buffer_size_per_device(
            dataclasses.replace(stack, max_ids_per_partition=2**22), TOPOLOGY,
            enable_minibatching=True)


def test_a_local_agreement_in_a_multi_process_plan_is_refused() -> None:
    """Each process would split its rows alone: different minibatch counts, collectives
    that wait for each other forever."""
    topology = tc.Topology(global_devices=2, sc_per_device=4, local_devices=1)
    plan = tc.plan_stacking(features(), topology, tc.SparseCoreConfig(enable_minibatching=True))
    rows = {name: np.zeros((32, 4), np.int32) for name in plan.features}
    with pytest.raises(ValueError, match=r"spans 2 process\(es\) but the agreement "
                                         r"\(LocalAgreement\) speaks for 1"):
        tc.preprocess(plan, rows, agreement=tc.preprocessing.LocalAgreement())


def test_plan_and_statistics_arguments_of_the_wrong_type() -> None:
    """An AttributeError from inside before."""
    table = tc.TableSpec(name="t", vocab_size=32, embedding_dim=4)
    features = [tc.FeatureSpec(name="f", table=table, input_shape=(8, 2))]
    with pytest.raises(TypeError, match=r"plan_stacking: topology must be a tilecore.Topology, "
                                        r"got None"):
        tc.plan_stacking(features, None)  # type: ignore[arg-type]
    topology = tc.Topology(global_devices=1, sc_per_device=2)
    with pytest.raises(TypeError, match=r"config must be a tilecore.SparseCoreConfig or None, "
                                        r"got 'x'"):
        tc.plan_stacking(features, topology, "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"the statistics must be the PreprocessStats .* got str"):
        tc.update_preprocessing_parameters(tc.plan_stacking(features, topology),
                                           "junk")  # type: ignore[arg-type]


def test_converted_batch_sizes_and_reference_combiners_of_the_wrong_kind() -> None:
    """target_batch_size=16.5 was written as 16; row_gains' 'max' combiner computed sqrtn."""
    from tilecore.compat._checkpoint_targets import feature_specs_from_proto
    from tilecore.testing import row_gains

    for size in (16.5, True, 0):
        with pytest.raises(ValueError, match="target_batch_size must be an integer >= 1"):
            feature_specs_from_proto(None, size, keep_limits=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="combiner must be 'sum', 'mean' or 'sqrtn', got 'max'"):
        row_gains(np.arange(2), None, "max")
    with pytest.raises(ValueError, match=r"row_gains: \(1,\) weights for \(2,\) IDs"):
        row_gains(np.arange(2), np.ones(1), "sum")


def _stacked_plan() -> tc.StackingPlan:
    return stacking.stack_tables(features(), TOPOLOGY, [["t0", "t1"]])


@pytest.mark.parametrize(("field", "value", "error", "match"), [
    # Silent wrong answers: other activations, another update rule than plan.tables say.
    ("combiner", "mean", ValueError, r"combiner is 'mean' but its tables \['t0', 't1'\] "
                                     r"make it 'sum'"),
    ("optimizer", tc.Adam(learning_rate=0.1), ValueError,
     r"optimizer is Adam\(learning_rate=0.1.*\) but its tables \['t0', 't1'\] make it SGD"),
    ("weights_dtype", np.dtype(np.float16), ValueError,
     r"weights_dtype is dtype\('float16'\) but its tables .* make it dtype\('float32'\)"),
    ("quantization", tc.QuantizationConfig(min_value=-1.0, max_value=1.0), ValueError,
     r"quantization is QuantizationConfig\(.*\) but its tables .* make it None"),
    # Internal errors, KeyErrors and AttributeErrors deep in the ops.
    ("embedding_dim", 3, ValueError, r"embedding_dim is 3 but its tables .* make it 8"),
    ("vocab_size", 2000, ValueError, r"vocab_size is 2000 but its tables .* make it 2048"),
    ("total_sample_count", 0, ValueError, r"total_sample_count is 0 but its features' batches "
                                          r"make it 128"),
    ("total_sample_count", 256, ValueError, r"total_sample_count is 256 but .* make it 128"),
    ("combiner", "max", ValueError, r"combiner is 'max' but its tables .* make it 'sum'"),
    ("weights_dtype", "bfloat16", TypeError, r"weights_dtype must be a numpy dtype .* got str "
                                             r"'bfloat16'"),
    ("weights_dtype", "float32", TypeError, r"weights_dtype must be a numpy dtype"),
    ("optimizer", "sgd", TypeError, r"optimizer must be an OptimizerSpec .* got str 'sgd'"),
    ("vocab_size", 2048.0, TypeError, r"vocab_size must be an integer, got float 2048.0"),
    ("table_names", ("t1", "t0"), ValueError, r"table_names is \('t1', 't0'\) but its tables' "
                                              r"settings place them in the order \('t0', 't1'\)"),
    ("feature_names", ("f1", "f0"), ValueError, r"feature_names is \('f1', 'f0'\) but its "
                                                r"features' row offsets put them in the order "
                                                r"\('f0', 'f1'\)"),
    ("table_names", ["t0", "t1"], TypeError, r"table_names must be a tuple of names"),
])
def test_stack_fields_contradicting_its_tables_and_features_are_refused(
        field: str, value: Any, error: type[Exception], match: str) -> None:
    """dataclasses.replace(plan, stacks=...) with a StackSpec its tables do not make: a 'mean'
    stack over 'sum' tables gave other activations, an Adam stack over SGD tables another
    update; the rest failed inside the ops (INTERNAL, KeyError, AttributeError)."""
    plan = _stacked_plan()
    bad = dataclasses.replace(plan.stacks["t0_t1"], **{field: value})
    with pytest.raises(error, match=r"Stack 't0_t1': " + match):
        dataclasses.replace(plan, stacks={"t0_t1": bad})


def test_a_stack_filed_under_another_name_or_a_table_unlike_its_features_is_refused() -> None:
    plan = _stacked_plan()
    with pytest.raises(ValueError, match=r"holds stack 'x' under the name 't0_t1'"):
        dataclasses.replace(
            plan, stacks={"t0_t1": dataclasses.replace(plan.stacks["t0_t1"], name="x")})
    other = dataclasses.replace(plan.tables["t0"], combiner="mean")
    with pytest.raises(ValueError, match=r"Feature 'f0' looks up table 't0', but the plan's "
                                         r"tables hold another table of that name"):
        dataclasses.replace(plan, tables={**plan.tables, "t0": other})


def test_plans_whose_stacks_agree_with_their_tables_still_pass() -> None:
    plan = _stacked_plan()
    assert dataclasses.replace(plan).stacks == plan.stacks
    assert tc.plan_stacking(features(count=4), TOPOLOGY).stacks
    limits = dataclasses.replace(plan.stacks["t0_t1"], max_ids_per_partition=7,
                                 max_unique_ids_per_partition=5,
                                 suggested_coo_buffer_size_per_device=4096)
    replaced = dataclasses.replace(plan, stacks={"t0_t1": limits})
    assert replaced.stacks["t0_t1"].max_ids_per_partition == 7
    assert plan.with_stack_limits("t0_t1", max_ids_per_partition=9).stacks[
        "t0_t1"].max_ids_per_partition == 9
