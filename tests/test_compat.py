"""tilecore.compat: reference scripts port by changing the import line."""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import tilecore as tc
from tilecore.compat import embedding, embedding_spec, table_stacking

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "reference"
FIXTURE_CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))


def worked_example_specs() -> dict[str, embedding_spec.FeatureSpec]:
    """REFERENCE.md §5, written exactly as a reference user would."""
    table_a = embedding_spec.TableSpec(
        name="table_a", vocabulary_size=64, embedding_dim=12, initializer=None,
        optimizer=embedding_spec.SGDOptimizerSpec(learning_rate=0.1), combiner="sum",
    )
    table_b = embedding_spec.TableSpec(
        name="table_b", vocabulary_size=120, embedding_dim=10, initializer=None,
        optimizer=embedding_spec.SGDOptimizerSpec(learning_rate=0.1), combiner="sum",
    )
    return {
        "f_a": embedding_spec.FeatureSpec(name="f_a", table_spec=table_a, input_shape=[16, 1],
                                          output_shape=[16, 12]),
        "f_b": embedding_spec.FeatureSpec(name="f_b", table_spec=table_b, input_shape=[16, 1],
                                          output_shape=[16, 10]),
        "f_c": embedding_spec.FeatureSpec(name="f_c", table_spec=table_b, input_shape=[16, 1],
                                          output_shape=[16, 10]),
    }


def test_worked_example_stacking_in_place() -> None:
    features = worked_example_specs()
    embedding.auto_stack_tables(features, global_device_count=2, num_sc_per_device=4)
    embedding.prepare_feature_specs_for_training(features, global_device_count=2,
                                                 num_sc_per_device=4)
    stacked = features["f_a"].table_spec.stacked_table_spec
    assert (stacked.stack_name, stacked.stack_vocab_size, stacked.stack_embedding_dim,
            stacked.total_sample_count) == ("table_a_table_b", 192, 16, 48)
    assert (stacked.max_ids_per_partition, stacked.max_unique_ids_per_partition) == (256, 256)
    assert stacked.optimizer == embedding_spec.SGDOptimizerSpec(learning_rate=0.1)
    b = features["f_b"].table_spec.setting_in_stack
    assert (b.padded_vocab_size, b.padded_embedding_dim, b.row_offset_in_shard,
            b.shard_rotation) == (128, 16, 8, 4)
    transforms = {name: f.id_transformation for name, f in features.items()}
    assert transforms == {
        "f_a": embedding_spec.FeatureIdTransformation(0, 0, 0),
        "f_b": embedding_spec.FeatureIdTransformation(16, 64, 4),
        "f_c": embedding_spec.FeatureIdTransformation(32, 64, 4),
    }
    assert embedding.get_stacked_table_specs(features) == {"table_a_table_b": stacked}
    assert set(embedding.get_table_specs(features)) == {"table_a", "table_b"}
    # b-id 0 lives at physical row 104 of the stacked table; c-id 100 in partition 0, row 20.
    tables = {"table_a": np.zeros((64, 12), np.float32),
              "table_b": np.arange(1200, dtype=np.float32).reshape(120, 10)}
    specs = embedding.get_table_specs(features)
    stacked_arrays = table_stacking.stack_and_shard_tables(specs, tables, num_shards=8)
    flat = stacked_arrays["table_a_table_b"].reshape(192, 16)
    np.testing.assert_array_equal(flat[104, :10], tables["table_b"][0])
    np.testing.assert_array_equal(flat[0 * 24 + 20, :10], tables["table_b"][100])
    assert np.isnan(flat[104, 10:]).all()


def test_stacked_table_rejects_limit_changes() -> None:
    features = worked_example_specs()
    embedding.auto_stack_tables(features, 2, 4)
    with pytest.raises(AttributeError, match="update_preprocessing_parameters"):
        features["f_a"].table_spec.max_ids_per_partition = 10
    with pytest.raises(ValueError, match="already stacked"):
        table_stacking.stack_tables(features, ["table_a"], 2, 4, stack_name="again")


def test_stack_tables_explicit_group_and_names() -> None:
    features = worked_example_specs()
    table_stacking.stack_tables(features, ["table_b", "table_a"], 2, 4,
                                stack_to_max_ids_per_partition=lambda name, n: n,
                                stack_to_max_unique_ids_per_partition=lambda name, n: 7)
    stacked = features["f_a"].table_spec.stacked_table_spec
    assert stacked.stack_name == "table_b_table_a"
    assert (stacked.max_ids_per_partition, stacked.max_unique_ids_per_partition) == (48, 7)
    # Row offsets follow pytree-leaf order (sorted dict keys); table_b comes first in the stack.
    assert features["f_b"].id_transformation == embedding_spec.FeatureIdTransformation(16, 0, 0)
    assert features["f_a"].id_transformation == embedding_spec.FeatureIdTransformation(0, 128, 4)
    with pytest.raises(ValueError, match="different widths"):
        fresh = worked_example_specs()
        fresh["f_a"].table_spec.embedding_dim = 24
        table_stacking.stack_tables(fresh, ["table_a", "table_b"], 2, 4,
                                    fail_on_excess_padding=True)


def test_long_stack_names_are_shortened() -> None:
    names = ["a_really_long_embedding_table_name_number_one",
             "another_really_long_embedding_table_name_number_two"]
    tables = [embedding_spec.TableSpec(name=n, vocabulary_size=40, embedding_dim=8,
                                       initializer=None,
                                       optimizer=embedding_spec.SGDOptimizerSpec(),
                                       combiner="sum") for n in names]
    features = [embedding_spec.FeatureSpec(name=f"f{i}", table_spec=t, input_shape=[8, 3],
                                           output_shape=[8, 8]) for i, t in enumerate(tables)]
    embedding.auto_stack_tables(features, 1, 2)
    short = features[0].table_spec.stacked_table_spec.stack_name
    assert short.startswith("_".join(names)[:50] + "...") and len(short) == 65
    long_features = [dataclasses.replace(f, table_spec=dataclasses.replace(
        f.table_spec, _stacked_table_spec=None, _setting_in_stack=None)) for f in features]
    embedding.auto_stack_tables(long_features, 1, 2, use_short_stack_names=False)
    assert long_features[0].table_spec.stacked_table_spec.stack_name == "_".join(names)


def random_inputs(rng: np.random.Generator, specs: dict, local_rows: dict[str, int],
                  ragged: bool) -> tuple[dict, dict]:
    ids, weights = {}, {}
    for name, spec in specs.items():
        rows, vocab = local_rows[name], spec.table_spec.vocabulary_size
        if ragged:
            ids[name] = np.empty(rows, dtype=object)
            weights[name] = np.empty(rows, dtype=object)
            for r in range(rows):
                n = int(rng.integers(0, 6))
                ids[name][r] = rng.integers(0, vocab, n).astype(np.int32)
                weights[name][r] = rng.uniform(0.5, 2.0, n).astype(np.float32)
        else:
            ids[name] = rng.integers(0, vocab, (rows, 3)).astype(np.int32)
            weights[name] = rng.uniform(0.5, 2.0, (rows, 3)).astype(np.float32)
    return ids, weights


def native_plan_like_reference(topology: tc.Topology) -> tc.StackingPlan:
    sgd = tc.SGD(learning_rate=0.1)
    table_a = tc.TableSpec(name="table_a", vocab_size=64, embedding_dim=12, optimizer=sgd)
    table_b = tc.TableSpec(name="table_b", vocab_size=120, embedding_dim=10, optimizer=sgd)
    features = [tc.FeatureSpec(name="f_a", table=table_a, input_shape=(16, 1)),
                tc.FeatureSpec(name="f_b", table=table_b, input_shape=(16, 1)),
                tc.FeatureSpec(name="f_c", table=table_b, input_shape=(16, 1))]
    return tc.auto_stack_tables(features, topology, stack_limits=lambda name, n: (256, 256))


@pytest.mark.parametrize(("seed", "ragged", "weighted", "local"), [
    (0, False, False, 2), (1, True, True, 2), (2, True, False, 1), (3, False, True, 1),
])
def test_compat_and_native_agree(seed: int, ragged: bool, weighted: bool, local: int) -> None:
    features = worked_example_specs()
    embedding.auto_stack_tables(features, 2, 4)
    embedding.prepare_feature_specs_for_training(features, 2, 4)
    rng = np.random.default_rng(seed)
    ids, weights = random_inputs(rng, features, {n: 16 * local // 2 for n in features}, ragged)
    got, got_stats = embedding.preprocess_sparse_dense_matmul_input(
        ids, weights if weighted else None, features, local_device_count=local,
        global_device_count=2, num_sc_per_device=4, has_leading_dimension=True,
    )
    plan = native_plan_like_reference(tc.Topology(global_devices=2, sc_per_device=4,
                                                  local_devices=local))
    batch, stats = tc.preprocess(plan, ids, weights if weighted else None)
    for name, buffers in batch.stacks.items():
        np.testing.assert_array_equal(got.lhs_row_pointers[name], buffers.row_pointers)
        np.testing.assert_array_equal(got.lhs_embedding_ids[name], buffers.embedding_ids)
        np.testing.assert_array_equal(got.lhs_sample_ids[name], buffers.sample_ids)
        np.testing.assert_array_equal(got.lhs_gains[name], buffers.gains)
        np.testing.assert_array_equal(got_stats.max_ids_per_partition[name],
                                      stats.max_ids_per_partition[name].reshape(-1))
        np.testing.assert_array_equal(got_stats.max_unique_ids_per_partition[name],
                                      stats.max_unique_ids_per_partition[name].reshape(-1))
        np.testing.assert_array_equal(got_stats.required_buffer_size_per_sc[name],
                                      stats.required_buffer_size_per_sc[name].reshape(-1))
        assert got_stats.id_drop_counters[name] == stats.id_drop_counters[name]
    assert got.num_minibatches.shape == (local, 1)
    flat, _ = embedding.preprocess_sparse_dense_matmul_input(
        list(ids.values()), None, list(features.values()), local, 2, num_sc_per_device=4)
    name = "table_a_table_b"
    assert flat.lhs_embedding_ids[name].shape == (local * batch.stacks[name].embedding_ids.shape[1],)
    assert flat.num_minibatches.shape == (local,)


def test_sparse_tensor_input_matches_ragged() -> None:
    features = worked_example_specs()
    embedding.prepare_feature_specs_for_training(features, 2, 4)
    rng = np.random.default_rng(7)
    ids, _ = random_inputs(rng, features, dict.fromkeys(features, 16), ragged=True)
    indices, values, shapes = {}, {}, {}
    for name, rows in ids.items():
        lengths = [len(r) for r in rows]
        indices[name] = np.array([(i, j) for i, n in enumerate(lengths) for j in range(n)],
                                 np.int64).reshape(-1, 2)
        values[name] = np.concatenate(list(rows)).astype(np.int32)
        shapes[name] = np.array([16, 5], np.int64)
    coo, coo_stats = embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
        indices, values, shapes, features, 2, 2, num_sc_per_device=4)
    ragged, ragged_stats = embedding.preprocess_sparse_dense_matmul_input(
        ids, None, features, 2, 2, num_sc_per_device=4)
    for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"):
        for name, array in getattr(ragged, field).items():
            np.testing.assert_array_equal(getattr(coo, field)[name], array)
    assert coo.num_minibatches.dtype == np.int32
    assert coo_stats.max_ids_per_partition.keys() == ragged_stats.max_ids_per_partition.keys()


def test_sparse_tensor_input_takes_big_endian_indices() -> None:
    """'>i8' indices failed in numba (TypingError): `np.dtype('>i8').type is np.int64`,
    so they were handed to the kernel unconverted."""
    features = worked_example_specs()
    embedding.prepare_feature_specs_for_training(features, 2, 4)
    indices, values, shapes = {}, {}, {}
    for i, name in enumerate(features):
        indices[name] = np.stack([np.arange(16), np.zeros(16, np.int64)], 1)
        values[name] = (np.arange(16) * (i + 1)) % 60
        shapes[name] = np.array([16, 1])

    def call(dtype: str) -> tuple[Any, Any]:
        swapped = {k: v.astype(dtype) for k, v in indices.items()}
        return embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
            swapped, values, shapes, features, 2, 2, num_sc_per_device=4)

    (want, _), (got, _) = call("=i8"), call(">i8")
    for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"):
        for name, array in getattr(want, field).items():
            np.testing.assert_array_equal(getattr(got, field)[name], array)


def test_batch_by_one_object_arrays_squeeze() -> None:
    features = worked_example_specs()
    embedding.prepare_feature_specs_for_training(features, 2, 4)
    rng = np.random.default_rng(11)
    ids, weights = random_inputs(rng, features, dict.fromkeys(features, 16), ragged=True)
    column = {name: rows.reshape(-1, 1) for name, rows in ids.items()}
    column_weights = {name: rows.reshape(-1, 1) for name, rows in weights.items()}
    want, want_stats = embedding.preprocess_sparse_dense_matmul_input(
        ids, weights, features, 2, 2, num_sc_per_device=4)
    got, got_stats = embedding.preprocess_sparse_dense_matmul_input(
        column, column_weights, features, 2, 2, num_sc_per_device=4)
    for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"):
        for name, array in getattr(want, field).items():
            np.testing.assert_array_equal(getattr(got, field)[name], array)
    assert got_stats.id_drop_counters == want_stats.id_drop_counters
    wide = {name: np.stack([rows, rows], axis=1) for name, rows in ids.items()}
    with pytest.raises(ValueError, match="1-D"):
        embedding.preprocess_sparse_dense_matmul_input(wide, None, features, 2, 2,
                                                       num_sc_per_device=4)


def test_update_preprocessing_parameters_in_place() -> None:
    features = worked_example_specs()
    embedding.auto_stack_tables(features, 2, 4)
    embedding.prepare_feature_specs_for_training(features, 2, 4)
    ids, _ = random_inputs(np.random.default_rng(3), features, dict.fromkeys(features, 16),
                           ragged=False)
    _, stats = embedding.preprocess_sparse_dense_matmul_input(ids, None, features, 2, 2,
                                                              num_sc_per_device=4)
    name = "table_a_table_b"
    embedding.update_preprocessing_parameters(features, stats, num_sc_per_device=4)
    for feature in features.values():
        stacked = feature.table_spec.stacked_table_spec
        assert stacked.max_ids_per_partition == stats.max_ids_per_partition[name].max()
        assert stacked.max_unique_ids_per_partition == stats.max_unique_ids_per_partition[
            name].max()
        assert stacked.suggested_coo_buffer_size_per_device == (
            stats.get_required_buffer_size_per_device(name, 4))
    sizes = embedding.compute_coo_buffer_size_per_device(features, 2, 4)
    again, again_stats = embedding.preprocess_sparse_dense_matmul_input(
        ids, None, features, 2, 2, num_sc_per_device=4)
    assert again.lhs_embedding_ids[name].shape == (2 * sizes[name],)
    np.testing.assert_array_equal(again_stats.max_ids_per_partition[name],
                                  stats.max_ids_per_partition[name])


def test_unsupported_options_raise() -> None:
    features = worked_example_specs()
    embedding.prepare_feature_specs_for_training(features, 2, 4)
    ids = {name: np.zeros((16, 1), np.int32) for name in features}
    with pytest.raises(ValueError, match="MOD"):
        embedding.preprocess_sparse_dense_matmul_input(ids, None, features, 2, 2,
                                                       num_sc_per_device=4,
                                                       sharding_strategy="DIV")
    with pytest.raises(ValueError, match="do not match"):
        embedding.preprocess_sparse_dense_matmul_input(list(ids.values()), None, features, 2, 2)


def test_preprocess_requires_prepared_specs() -> None:
    features = worked_example_specs()
    ids = {name: np.zeros((16, 1), np.int32) for name in features}
    with pytest.raises(ValueError, match="prepare_feature_specs_for_training"):
        embedding.preprocess_sparse_dense_matmul_input(ids, None, features, 2, 2)
    with pytest.raises(ValueError, match="prepare_feature_specs_for_training"):
        embedding.get_stacked_table_specs(features)


def test_buffer_size_helpers() -> None:
    assert embedding.compute_row_pointers_size_per_device(global_device_count=2,
                                                          num_sc_per_device=4) == 32
    assert embedding.compute_row_pointers_size_per_device(global_device_count=1) == 32
    assert embedding.compute_theoretical_max_coo_buffer_size(100, 1, 2) == 416
    # With minibatching, room for 64 minibatches (the reference's sizes).
    assert embedding.compute_theoretical_max_coo_buffer_size(
        100, 1, 2, enable_minibatching=True) == 416 * 64
    assert embedding.compute_row_pointers_size_per_device(
        global_device_count=2, num_sc_per_device=4, enable_minibatching=True) == 32 * 64


@pytest.mark.parametrize(("compat", "native"), [
    (embedding_spec.SGDOptimizerSpec(0.5), tc.SGD(learning_rate=0.5)),
    (embedding_spec.AdagradOptimizerSpec(), tc.Adagrad(learning_rate=1e-3)),
    (embedding_spec.AdamOptimizerSpec(beta_2=0.99), tc.Adam(beta_2=0.99)),
    (embedding_spec.AdagradMomentumOptimizerSpec(use_nesterov=True),
     tc.AdagradMomentum(use_nesterov=True)),
    (embedding_spec.FTRLOptimizerSpec(l1_regularization_strength=0.1),
     tc.FTRL(l1_regularization_strength=0.1)),
    (embedding_spec.LaPropOptimizerSpec(b2=0.9), tc.LaProp(b2=0.9)),
])
def test_optimizers_map_to_native(compat: embedding_spec.OptimizerSpec,
                                  native: tc.OptimizerSpec) -> None:
    assert compat.to_native() == native
    assert compat.short_name() == native.short_name
    twin = copy.deepcopy(compat)
    assert twin == compat and hash(twin) == hash(compat)
    assert compat != embedding_spec.SGDOptimizerSpec(learning_rate=123.0)


def test_learning_rate_callables_and_custom_optimizer() -> None:
    spec = embedding_spec.SGDOptimizerSpec(learning_rate=lambda: 0.25)
    assert spec.to_native().learning_rate_at(7) == 0.25
    assert spec.get_learning_rate() == np.float32(0.25)
    schedule = embedding_spec.AdagradOptimizerSpec(learning_rate=lambda step: 0.1 / (1 + step))
    assert schedule.to_native().learning_rate_at(1) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="step"):
        schedule.get_learning_rate()

    def rule(grad, row, slot, lr):
        return row - lr * grad, slot

    custom = embedding_spec.CustomOptimizerSpec(
        learning_rate=0.1, custom_computation_fn=rule, slot_variable_initializers_tuple=(0.5,),
        short_name_str="mine",
    )
    native = custom.to_native()
    assert (native.update_fn, native.slot_initial_values(), native.name) == (rule, (0.5,), "mine")
    with pytest.raises(ValueError, match="rms_clip_threshold"):
        embedding_spec.LaPropOptimizerSpec(rms_clip_threshold=1.0)


def test_stack_and_unshard_round_trip() -> None:
    features = worked_example_specs()
    embedding.auto_stack_tables(features, 2, 4)
    specs = embedding.get_table_specs(features)
    rng = np.random.default_rng(0)
    tables = {name: rng.normal(size=(t.vocabulary_size, t.embedding_dim)).astype(np.float32)
              for name, t in specs.items()}
    stacked = table_stacking.stack_and_shard_tables(specs, tables, num_shards=8)
    assert stacked["table_a_table_b"].shape == (8, 24, 16)
    back = table_stacking.unshard_and_unstack_tables(specs, stacked, num_shards=8)
    for name, table in tables.items():
        np.testing.assert_array_equal(back[name], table)
    # Physical row of logical id i: ((i mod N + rotation) mod N)·R + i div N + row_offset_in_shard.
    flat = stacked["table_a_table_b"].reshape(-1, 16)
    for i in range(120):
        row = ((i % 8 + 4) % 8) * 24 + i // 8 + 8
        np.testing.assert_array_equal(flat[row, :10], tables["table_b"][i])
    rows = table_stacking.compute_physical_row_ids(8, 192, 4, 8, np.arange(120))
    np.testing.assert_array_equal(flat[rows, :10], tables["table_b"])
    assert table_stacking.compute_physical_row_ids(8, 192, 4, 8, 0) == 104


def test_compat_does_not_import_jax() -> None:
    code = "import sys, tilecore.compat; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_results_are_jax_pytrees() -> None:
    jax = pytest.importorskip("jax")
    features = worked_example_specs()
    embedding.prepare_feature_specs_for_training(features, 1, 2)
    ids = {name: jax.numpy.zeros((16, 1), np.int32) for name in features}
    preprocessed, stats = embedding.preprocess_sparse_dense_matmul_input(
        ids, None, features, 1, 1, num_sc_per_device=2)
    assert len(jax.tree.leaves(preprocessed)) == 4 * 2 + 1
    assert len(jax.tree.leaves(stats)) == 4 * 2
    rebuilt = jax.tree.map(lambda x: x, preprocessed)
    assert isinstance(rebuilt, embedding.PreprocessedInput)


# ---------------------------------------------------------------------------
# Golden fixtures from the reference (tools/make_reference_fixtures.py).


def fixture_specs(meta: dict) -> list[embedding_spec.FeatureSpec]:
    """The case's specs built and stacked with compat, as the generator did with the reference."""
    topo = meta["topology"]
    g, s = topo["global_devices"], topo["sc_per_device"]
    optimizers = {"sgd": embedding_spec.SGDOptimizerSpec,
                  "adagrad": embedding_spec.AdagradOptimizerSpec}
    tables = {
        t["name"]: embedding_spec.TableSpec(
            name=t["name"], vocabulary_size=t["vocab_size"], embedding_dim=t["embedding_dim"],
            initializer=None, optimizer=optimizers[t["optimizer"]](), combiner=t["combiner"],
            max_ids_per_partition=t["max_ids_per_partition"],
            max_unique_ids_per_partition=t["max_unique_ids_per_partition"],
            suggested_coo_buffer_size_per_device=t["suggested_coo_buffer_size_per_device"],
        )
        for t in meta["tables"]
    }
    features = [
        embedding_spec.FeatureSpec(name=f["name"], table_spec=tables[f["table"]],
                                   input_shape=f["input_shape"], output_shape=f["output_shape"])
        for f in meta["features"]
    ]
    stacking = meta["stacking"]
    if stacking == "auto":
        limit = meta["activation_mem_bytes_limit"]
        extra = {} if limit is None else {"activation_mem_bytes_limit": limit}
        table_stacking.auto_stack_tables(features, global_device_count=g, num_sc_per_device=s,
                                         **extra)
    elif isinstance(stacking, dict):
        for group in stacking["groups"]:
            table_stacking.stack_tables(features, group, global_device_count=g,
                                        num_sc_per_device=s)
    embedding.prepare_feature_specs_for_training(features, global_device_count=g,
                                                 num_sc_per_device=s)
    return features


def fixture_call(meta: dict, arrays: dict, features: list) -> tuple:
    topo = meta["topology"]
    kwargs = {"local_device_count": topo["local_devices"],
              "global_device_count": topo["global_devices"],
              "num_sc_per_device": topo["sc_per_device"],
              "allow_id_dropping": meta["allow_id_dropping"]}
    values, splits = [], []
    for f in meta["features"]:
        values.append(arrays[f"in/{f['name']}/values"])
        splits.append(arrays[f"in/{f['name']}/row_splits"])
    fmt = meta["input_format"]
    if fmt == "sparse_coo":
        indices, shapes = [], []
        for f, v, rs in zip(meta["features"], values, splits, strict=True):
            lengths = np.diff(rs)
            rows = np.repeat(np.arange(len(lengths)), lengths)
            cols = np.arange(len(v)) - np.repeat(rs[:-1], lengths)
            indices.append(np.stack([rows, cols], axis=1).astype(np.int64))
            shapes.append(np.array([len(lengths), f["input_shape"][1]], np.int64))
        return embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
            indices, values, shapes, features, **kwargs)
    weights = [arrays.get(f"in/{f['name']}/weights") for f in meta["features"]]
    if fmt == "dense":
        ids = [v.reshape(len(rs) - 1, -1) for v, rs in zip(values, splits, strict=True)]
        w = None
        if meta["weighted"]:
            w = [arrays[f"in/{f['name']}/weights"].reshape(len(rs) - 1, -1)
                 for f, rs in zip(meta["features"], splits, strict=True)]
    else:
        ids, w = [], []
        for v, rs, x in zip(values, splits, weights, strict=True):
            ragged = tc.Ragged(v, rs, x).to_object_array()
            ids.append(ragged[0])
            w.append(ragged[1])
        w = w if meta["weighted"] else None
    return embedding.preprocess_sparse_dense_matmul_input(ids, w, features, **kwargs)


def load_fixture(case: str) -> tuple[dict, dict[str, np.ndarray]]:
    meta = json.loads((FIXTURES / f"{case}.json").read_text())
    with np.load(FIXTURES / f"{case}.npz") as z:
        return meta, dict(z)


@pytest.mark.parametrize("case", FIXTURE_CASES)
def test_fixture_stacking(case: str) -> None:
    meta, _ = load_fixture(case)
    features = fixture_specs(meta)
    expected = meta["result_stacking"]
    for f in features:
        assert dataclasses.asdict(f.table_spec.setting_in_stack) == expected["tables"][
            f.table_spec.name], f.table_spec.name
        assert dataclasses.asdict(f.id_transformation) == expected["features"][f.name], f.name
    stacks = {}
    for name, s in embedding.get_stacked_table_specs(features).items():
        fields = dataclasses.asdict(s)
        fields["optimizer"] = type(s.optimizer).__name__
        stacks[name] = {k: fields[k] for k in expected["stacks"][name]}
    assert stacks == expected["stacks"]


def assert_equals_fixture(meta: dict, arrays: dict[str, np.ndarray], preprocessed: embedding.PreprocessedInput,
                          stats: embedding.SparseDenseMatmulInputStats, case: str) -> None:
    """compat's buffers and statistics equal a fixture's (the reference's output): every
    covered buffer entry, each buffer's shape and dtype, the statistics, the minibatch count."""
    local = meta["topology"]["local_devices"]
    for name in meta["stack_order"]:
        covered = arrays[f"out/{name}/covered"]
        np.testing.assert_array_equal(preprocessed.lhs_row_pointers[name],
                                      arrays[f"out/{name}/row_pointers"])
        for field in ("embedding_ids", "sample_ids", "gains"):
            got = getattr(preprocessed, f"lhs_{field}")[name]
            want = arrays[f"out/{name}/{field}"]
            assert got.shape == want.shape and got.dtype == want.dtype, (case, field)
            np.testing.assert_array_equal(got[covered], want[covered],
                                          err_msg=f"{case}: {name}.{field}")
            assert got.shape == (local * meta["buffer_sizes"][name]["coo_size_per_device"],)
        expected = meta["stats"][name]
        for field in ("max_ids_per_partition", "max_unique_ids_per_partition",
                      "required_buffer_size_per_sc"):
            np.testing.assert_array_equal(getattr(stats, field)[name], expected[field],
                                          err_msg=f"{case}: {name}.{field}")
            assert getattr(stats, field)[name].dtype == np.int32
        assert stats.id_drop_counters[name] == expected["id_drop_counters"]
    np.testing.assert_array_equal(preprocessed.num_minibatches, arrays["num_minibatches"])
    assert preprocessed.num_minibatches.dtype == arrays["num_minibatches"].dtype


@pytest.mark.parametrize("case", [c for c in FIXTURE_CASES if c != "mean_zero_weight_sum"])
def test_fixture_buffers_and_stats(case: str, recwarn: pytest.WarningsRecorder) -> None:
    meta, arrays = load_fixture(case)
    preprocessed, stats = fixture_call(meta, arrays, fixture_specs(meta))
    assert_equals_fixture(meta, arrays, preprocessed, stats, case)
    assert bool(recwarn.list) == any(stats.id_drop_counters.values())


def test_fixture_zero_weight_sum_raises() -> None:
    # The reference emits inf/NaN gains for mean rows whose weights sum to zero;
    # tilecore refuses the input instead.
    meta, arrays = load_fixture("mean_zero_weight_sum")
    with pytest.raises(ValueError, match="sum to zero"):
        fixture_call(meta, arrays, fixture_specs(meta))
