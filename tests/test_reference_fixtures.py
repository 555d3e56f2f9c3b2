"""Bit-exact agreement with golden outputs of the reference system (tools/make_reference_fixtures.py)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

import tilecore as tc

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "reference"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
REFERENCE_STACK_LIMITS = lambda name, samples: (256, 256)  # noqa: E731 (the reference's default)


def load(case: str, folder: pathlib.Path = FIXTURES) -> tuple[dict, dict[str, np.ndarray]]:
    spec = json.loads((folder / f"{case}.json").read_text())
    with np.load(folder / f"{case}.npz") as z:
        return spec, dict(z)


def assert_stats_equal(stats: tc.PreprocessStats, expected: dict, name: str) -> None:
    """One stack's statistics equal the reference's (flattened row-major)."""
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition",
                  "required_buffer_size_per_sc"):
        np.testing.assert_array_equal(getattr(stats, field)[name].ravel(), expected[field],
                                      err_msg=f"{name}.{field}")
    assert stats.id_drop_counters[name] == expected["id_drop_counters"]


def build_plan(spec: dict) -> tc.StackingPlan:
    optimizers = {"sgd": tc.SGD(), "adagrad": tc.Adagrad()}
    tables = {
        t["name"]: tc.TableSpec(
            name=t["name"], vocab_size=t["vocab_size"], embedding_dim=t["embedding_dim"],
            combiner=t["combiner"], optimizer=optimizers[t["optimizer"]],
            max_ids_per_partition=t["max_ids_per_partition"],
            max_unique_ids_per_partition=t["max_unique_ids_per_partition"],
            suggested_coo_buffer_size_per_device=t["suggested_coo_buffer_size_per_device"],
        )
        for t in spec["tables"]
    }
    features = [
        tc.FeatureSpec(name=f["name"], table=tables[f["table"]], input_shape=tuple(f["input_shape"]),
                       output_shape=tuple(f["output_shape"]))
        for f in spec["features"]
    ]
    topology = tc.Topology(**spec["topology"])
    config = tc.SparseCoreConfig(allow_id_dropping=spec["allow_id_dropping"])
    stacking = spec["stacking"]
    if stacking == "none":
        return tc.stack_tables(features, topology, config=config)
    if stacking == "auto":
        limit = spec["activation_mem_bytes_limit"] or tc.specs.DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
        return tc.auto_stack_tables(features, topology, activation_mem_bytes_limit=limit,
                                    stack_limits=REFERENCE_STACK_LIMITS, config=config)
    return tc.stack_tables(features, topology, stacking["groups"],
                           stack_limits=REFERENCE_STACK_LIMITS, config=config)


def inputs_of(spec: dict, arrays: dict[str, np.ndarray]) -> dict[str, tc.Ragged]:
    return {
        f["name"]: tc.Ragged(arrays[f"in/{f['name']}/values"], arrays[f"in/{f['name']}/row_splits"],
                             arrays.get(f"in/{f['name']}/weights"))
        for f in spec["features"]
    }


@pytest.mark.parametrize("case", CASES)
def test_stacking_matches_reference(case: str) -> None:
    spec, _ = load(case)
    plan = build_plan(spec)
    expected = spec["result_stacking"]
    for name, setting in expected["tables"].items():
        assert dataclasses.asdict(plan.table_settings[name]) == setting, name
    for name, transform in expected["features"].items():
        ours = plan.feature_settings[name]
        assert (ours.row_offset, ours.col_offset, ours.col_shift) == (
            transform["row_offset"], transform["col_offset"], transform["col_shift"]), name
    assert sorted(plan.stacks) == sorted(expected["stacks"])
    for name, stacked in expected["stacks"].items():
        ours = plan.stacks[name]
        assert (ours.vocab_size, ours.embedding_dim, ours.total_sample_count,
                ours.max_ids_per_partition, ours.max_unique_ids_per_partition) == (
            stacked["stack_vocab_size"], stacked["stack_embedding_dim"],
            stacked["total_sample_count"], stacked["max_ids_per_partition"],
            stacked["max_unique_ids_per_partition"]), name


def _with_reference_buffer_sizes(plan: tc.StackingPlan, spec: dict) -> tc.StackingPlan:
    # The reference forgets a table's suggested buffer size once it is stacked;
    # tilecore keeps it. Use the reference's value so the buffers line up.
    stacks = {
        name: dataclasses.replace(stack, suggested_coo_buffer_size_per_device=spec[
            "result_stacking"]["stacks"][name]["suggested_coo_buffer_size_per_device"])
        for name, stack in plan.stacks.items()
    }
    return dataclasses.replace(plan, stacks=stacks)


@pytest.mark.parametrize("case", [c for c in CASES if c not in {"mean_zero_weight_sum",
                                                                 "suggested_coo_overflow"}])
def test_buffers_and_stats_match_reference(case: str, recwarn: pytest.WarningsRecorder) -> None:
    spec, arrays = load(case)
    plan = _with_reference_buffer_sizes(build_plan(spec), spec)
    batch, stats = tc.preprocess(plan, inputs_of(spec, arrays), has_leading_dimension=False)
    for name in spec["stack_order"]:
        ours = batch.stacks[name]
        covered = arrays[f"out/{name}/covered"]
        filler = arrays[f"out/{name}/filler"]
        np.testing.assert_array_equal(ours.row_pointers, arrays[f"out/{name}/row_pointers"])
        for field in ("embedding_ids", "sample_ids", "gains"):
            got, want = getattr(ours, field), arrays[f"out/{name}/{field}"]
            assert got.shape == want.shape and got.dtype == want.dtype, field
            np.testing.assert_array_equal(got[covered], want[covered], err_msg=f"{name}.{field}")
        assert np.all(ours.embedding_ids[filler] == 2**31 - 1)
        assert np.all(np.isnan(ours.gains[filler]))
        assert_stats_equal(stats, spec["stats"][name], name)
    assert bool(recwarn.list) == any(stats.id_drop_counters.values())


def test_zero_weight_sum_raises_instead_of_inf() -> None:
    spec, arrays = load("mean_zero_weight_sum")
    with pytest.raises(ValueError, match="sum to zero"):
        tc.preprocess(build_plan(spec), inputs_of(spec, arrays))


def test_buffer_overflow_raises_unless_dropping_allowed() -> None:
    spec, arrays = load("suggested_coo_overflow")
    plan = _with_reference_buffer_sizes(build_plan(spec), spec)
    with pytest.raises(ValueError, match="COO entries"):
        tc.preprocess(plan, inputs_of(spec, arrays))
    with pytest.warns(UserWarning, match="Dropped"):
        batch, stats = tc.preprocess(plan.with_config(allow_id_dropping=True),
                                     inputs_of(spec, arrays), has_leading_dimension=False)
    name = spec["stack_order"][0]
    assert stats.id_drop_counters[name] == spec["stats"][name]["id_drop_counters"]
    covered = arrays[f"out/{name}/covered"]
    np.testing.assert_array_equal(batch.stacks[name].row_pointers,
                                  arrays[f"out/{name}/row_pointers"])
    np.testing.assert_array_equal(batch.stacks[name].embedding_ids[covered],
                                  arrays[f"out/{name}/embedding_ids"][covered])
