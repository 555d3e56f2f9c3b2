"""tilecore.compat's spec protos, embedding_proto_utils and the proto-driven table_stacking."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from google.protobuf import descriptor_pool

from _xla_flags import xla_flags
from tilecore.compat import embedding, embedding_spec, table_stacking
from tilecore.compat._native import build_plan
from tilecore.compat.lib.nn import embedding_proto_utils as epu
from tilecore.compat.lib.proto import embedding_spec_pb2 as pb
from tilecore.stacking import physical_rows

DEVICES, SC = 2, 4  # N = 8 SparseCores


class Schedule:
    """A learning-rate schedule with a tag, as a reference user would write one."""

    tag = "warmup_cosine"

    def __call__(self, step: int) -> float:
        return 0.1 / (1 + step)


def named_schedule(step: int) -> float:
    return 0.5 / (1 + step)


module_lambda = lambda step: 0.1  # noqa: E731 (a lambda's tag is made of its id)


def stack_named(proto: pb.EmbeddingSpecProto, name: str) -> pb.StackedTableSpecProto:
    return next(s for s in proto.stacked_table_specs if s.stack_name == name)


def feature_specs() -> dict[str, embedding_spec.FeatureSpec]:
    """Four tables in three stacks prepared for 2 devices × 4 SCs.

    Stacks in order of first feature (keys sorted): ad; item_user (item rows first,
    then user's, rotated by 4); query.
    """
    adagrad = embedding_spec.AdagradOptimizerSpec(learning_rate=0.25, initial_accumulator_value=0.5)

    def table(name: str, vocab: int, dim: int, opt: embedding_spec.OptimizerSpec,
              combiner: str = "sum") -> embedding_spec.TableSpec:
        return embedding_spec.TableSpec(name=name, vocabulary_size=vocab, embedding_dim=dim,
                                        initializer=None, optimizer=opt, combiner=combiner)

    user, item = table("user", 50, 6, adagrad), table("item", 70, 8, adagrad)
    query = table("query", 40, 16, embedding_spec.FTRLOptimizerSpec(
        learning_rate=Schedule(), l1_regularization_strength=0.5,
        multiply_linear_by_learning_rate=True), "mean")
    ad = table("ad", 33, 4, embedding_spec.AdagradMomentumOptimizerSpec(
        learning_rate=0.125, use_nesterov=True), "sqrtn")

    def feature(name: str, t: embedding_spec.TableSpec, batch: int, valency: int
                ) -> embedding_spec.FeatureSpec:
        return embedding_spec.FeatureSpec(name=name, table_spec=t, input_shape=[batch, valency],
                                          output_shape=[batch, t.embedding_dim])

    specs = {
        "f_user": feature("f_user", user, 16, 1), "f_item": feature("f_item", item, 16, 2),
        "f_item2": feature("f_item2", item, 16, 1), "f_query": feature("f_query", query, 8, 1),
        "f_ad": feature("f_ad", ad, 16, 1),
    }
    embedding.auto_stack_tables(specs, global_device_count=DEVICES, num_sc_per_device=SC)
    embedding.prepare_feature_specs_for_training(specs, global_device_count=DEVICES,
                                                 num_sc_per_device=SC)
    return specs


def random_tables(specs: dict[str, embedding_spec.FeatureSpec]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    tables = {f.table_spec.name: f.table_spec for f in specs.values()}
    return {name: rng.normal(size=(t.vocabulary_size, t.embedding_dim)).astype(np.float32)
            for name, t in tables.items()}


@pytest.fixture
def specs() -> dict[str, embedding_spec.FeatureSpec]:
    return feature_specs()


@pytest.fixture
def proto(specs: dict[str, embedding_spec.FeatureSpec]) -> pb.EmbeddingSpecProto:
    return epu.create_proto_from_feature_specs(specs, DEVICES, SC)


# --- messages -----------------------------------------------------------------------------


def test_messages_round_trip_through_bytes(proto: pb.EmbeddingSpecProto) -> None:
    data = proto.SerializeToString()
    assert pb.EmbeddingSpecProto.FromString(data) == proto
    assert pb.OptimizerSpecProto.OptimizerType.Name(pb.OptimizerSpecProto.ADAGRAD_MOMENTUM) == (
        "ADAGRAD_MOMENTUM")
    assert [pb.OptimizerSpecProto.OptimizerType.Value(n) for n in ("SGD", "CUSTOM")] == [1, 7]
    empty = pb.StackedTableSpecProto()
    assert not empty.HasField("activation_mem_bytes_limit")  # proto3 `optional`
    empty.activation_mem_bytes_limit = 0
    assert empty.HasField("activation_mem_bytes_limit")
    with pytest.raises(Exception, match=r"(?i)parse|decode|truncat"):
        pb.EmbeddingSpecProto.FromString(data[: len(data) // 2])


def test_messages_live_in_a_private_pool() -> None:
    name = "third_party.py.jax_tpu_embedding.sparsecore_lib_proto.EmbeddingSpecProto"
    assert pb.EmbeddingSpecProto.DESCRIPTOR.full_name == name
    with pytest.raises(KeyError):
        descriptor_pool.Default().FindMessageTypeByName(name)


# --- optimizers ---------------------------------------------------------------------------

OPTIMIZERS = [
    (embedding_spec.SGDOptimizerSpec(learning_rate=0.5), "SGD"),
    (embedding_spec.AdagradOptimizerSpec(learning_rate=0.25, initial_accumulator_value=0.5),
     "ADAGRAD"),
    (embedding_spec.AdamOptimizerSpec(learning_rate=0.125, beta_1=0.5, beta_2=0.75,
                                      epsilon=0.25), "ADAM"),
    (embedding_spec.FTRLOptimizerSpec(learning_rate=0.5, learning_rate_power=-0.25, beta=2.0,
                                      multiply_linear_by_learning_rate=True), "FTRL"),
    (embedding_spec.F2AOptimizerSpec(learning_rate=0.5, rho=0.25, max_lr_multiplier=8.0), "F2A"),
    (embedding_spec.AdagradMomentumOptimizerSpec(learning_rate=0.5, momentum=0.5,
                                                 use_nesterov=True, exponent=4.0),
     "ADAGRAD_MOMENTUM"),
]


@pytest.mark.parametrize(("opt", "type_name"), OPTIMIZERS, ids=[t for _, t in OPTIMIZERS])
def test_optimizer_round_trip(opt: embedding_spec.OptimizerSpec, type_name: str) -> None:
    proto = epu.optimizer_spec_to_proto(opt)
    assert proto is not None
    assert pb.OptimizerSpecProto.OptimizerType.Name(proto.type) == type_name
    assert proto.WhichOneof("learning_rate_spec") == "learning_rate"
    as_float32 = {k: float(np.float32(v)) for k, v in opt.get_float_params().items()}
    assert dict(proto.float_params) == as_float32  # a proto float is 32-bit
    assert dict(proto.bool_params) == opt.get_bool_params()
    parsed = pb.OptimizerSpecProto.FromString(proto.SerializeToString())
    back = epu.proto_to_optimizer_spec(parsed)
    assert type(back) is type(opt) and back.learning_rate == opt.learning_rate
    assert back.get_float_params() == as_float32
    assert back.get_bool_params() == opt.get_bool_params()
    assert epu.get_optimizer_class(proto.type) is type(opt)
    assert epu.get_optimizer_type(type(opt)) == proto.type


def test_callable_learning_rates_become_placeholders() -> None:
    cases = [(Schedule(), "warmup_cosine"),
             (named_schedule, f"{__name__}.named_schedule")]
    for schedule, tag in cases:
        proto = epu.optimizer_spec_to_proto(embedding_spec.SGDOptimizerSpec(learning_rate=schedule))
        assert proto is not None and proto.learning_rate_tag == tag
        back = epu.proto_to_optimizer_spec(proto)
        assert back.learning_rate == embedding_spec.CallablePlaceholder(tag)
        with pytest.raises(RuntimeError, match=f"{tag}.*cannot be evaluated"):
            back.learning_rate(3)
    proto = epu.optimizer_spec_to_proto(embedding_spec.AdamOptimizerSpec(learning_rate=module_lambda))
    assert proto is not None and proto.learning_rate_tag == f"function_{id(module_lambda)}"


def test_optimizers_without_a_type_are_custom_and_read_back_as_sgd(
    caplog: pytest.LogCaptureFixture,
) -> None:
    laprop = embedding_spec.LaPropOptimizerSpec(learning_rate=0.5, b1=0.5)
    assert epu.get_optimizer_type(embedding_spec.LaPropOptimizerSpec) == pb.OptimizerSpecProto.CUSTOM

    class MySGD(embedding_spec.SGDOptimizerSpec):
        pass

    assert epu.get_optimizer_type(MySGD) == pb.OptimizerSpecProto.CUSTOM
    proto = epu.optimizer_spec_to_proto(laprop)
    assert proto is not None and proto.type == pb.OptimizerSpecProto.CUSTOM
    assert not proto.float_params and not proto.bool_params
    with caplog.at_level(logging.WARNING):
        assert epu.proto_to_optimizer_spec(proto) == embedding_spec.SGDOptimizerSpec(0.5)
    assert "CUSTOM" in caplog.text
    assert epu.get_optimizer_class(pb.OptimizerSpecProto.CUSTOM) is None
    assert epu.proto_to_optimizer_spec(None) == embedding_spec.SGDOptimizerSpec(0.0)
    assert epu.optimizer_spec_to_proto(None) is None


def test_bad_optimizer_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="type=42, which is no OptimizerType"):
        epu.proto_to_optimizer_spec(pb.OptimizerSpecProto(type=42))
    extra = pb.OptimizerSpecProto(type=pb.OptimizerSpecProto.ADAM, float_params={"rho": 0.5})
    with pytest.raises(ValueError, match=r"\['rho'\] that AdamOptimizerSpec does not take"):
        epu.proto_to_optimizer_spec(extra)
    with pytest.raises(ValueError, match="learning_rate='fast'"):
        epu.optimizer_spec_to_proto(embedding_spec.SGDOptimizerSpec(learning_rate="fast"))
    with pytest.raises(ValueError, match="AdamOptimizerSpec: its hyperparameters"):
        epu.optimizer_spec_to_proto(embedding_spec.AdamOptimizerSpec(beta_1=lambda: 0.9))
    with pytest.raises(TypeError, match="got dict"):
        epu.optimizer_spec_to_proto({"learning_rate": 0.1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="proto must be a OptimizerSpecProto"):
        epu.proto_to_optimizer_spec(pb.TableSpecProto())  # type: ignore[arg-type]
    np_lr = epu.optimizer_spec_to_proto(embedding_spec.SGDOptimizerSpec(np.float32(0.25)))
    assert np_lr is not None and np_lr.learning_rate == 0.25


# --- create_proto_from_feature_specs ------------------------------------------------------


def test_proto_records_the_stacking(specs: dict[str, embedding_spec.FeatureSpec],
                                    proto: pb.EmbeddingSpecProto) -> None:
    plan = build_plan(specs, global_devices=DEVICES, sc_per_device=SC)
    assert [s.stack_name for s in proto.stacked_table_specs] == list(plan.stacks)
    for stack in proto.stacked_table_specs:
        native = plan.stacks[stack.stack_name]
        assert (stack.stack_vocab_size, stack.stack_embedding_dim, stack.total_sample_count,
                stack.num_sparsecores) == (native.vocab_size, native.embedding_dim,
                                           native.total_sample_count, DEVICES * SC)
        assert [t.table_name for t in stack.table_specs] == list(native.table_names)
        for table in stack.table_specs:
            setting = plan.table_settings[table.table_name]
            assert (table.padded_vocab_size, table.padded_embedding_dim,
                    table.row_offset_in_shard, table.shard_rotation) == (
                setting.padded_vocab_size, setting.padded_embedding_dim,
                setting.row_offset_in_shard, setting.shard_rotation)
            for feature in table.feature_specs:
                fs = plan.feature_settings[feature.feature_name]
                assert (feature.row_offset, feature.col_offset, feature.col_shift) == (
                    fs.row_offset, fs.col_offset, fs.col_shift)
                assert list(feature.input_shape) == list(specs[feature.feature_name].input_shape)
    names = {t.table_name: [f.feature_name for f in t.feature_specs]
             for s in proto.stacked_table_specs for t in s.table_specs}
    assert names["item"] == ["f_item", "f_item2"]
    query = next(t for s in proto.stacked_table_specs for t in s.table_specs
                 if t.table_name == "query")
    assert query.combiner == "mean" and query.optimizer.learning_rate_tag == "warmup_cosine"
    assert query.optimizer.bool_params["multiply_linear_by_learning_rate"]


def test_create_proto_rejects_unprepared_or_mismatched_specs(
    specs: dict[str, embedding_spec.FeatureSpec],
) -> None:
    table = embedding_spec.TableSpec(name="t", vocabulary_size=8, embedding_dim=8,
                                     initializer=None,
                                     optimizer=embedding_spec.SGDOptimizerSpec(), combiner="sum")
    raw = embedding_spec.FeatureSpec(name="f", table_spec=table, input_shape=[4, 1],
                                     output_shape=[4, 8])
    with pytest.raises(ValueError, match=r"'f' .*no stacking information"):
        epu.create_proto_from_feature_specs([raw], 1, 4)
    with pytest.raises(ValueError, match="does not split over 128 SparseCores"):
        epu.create_proto_from_feature_specs(specs, 32, SC)
    with pytest.raises(ValueError, match="power of two"):
        epu.create_proto_from_feature_specs(specs, DEVICES, 3)


# --- stacking and unstacking through the proto -------------------------------------------


def test_stack_via_proto_equals_stack_and_shard_tables(
    specs: dict[str, embedding_spec.FeatureSpec], proto: pb.EmbeddingSpecProto,
) -> None:
    tables = random_tables(specs)
    table_specs = {f.table_spec.name: f.table_spec for f in specs.values()}
    expected = table_stacking.stack_and_shard_tables(table_specs, tables, DEVICES * SC,
                                                     pad_value=0.0)
    stacked = table_stacking.stack_and_shard_feature_tables(
        {k: jnp.asarray(v) for k, v in tables.items()}, proto)
    assert stacked.keys() == expected.keys() and len(stacked) == 3
    for name, array in stacked.items():
        assert isinstance(array, jax.Array)
        want = np.asarray(expected[name])
        np.testing.assert_array_equal(np.asarray(array), want.reshape(-1, want.shape[-1]))
    back = table_stacking.unstack_and_unshard_stacked_tables(stacked, proto)
    assert back.keys() == tables.keys()
    for name, table in tables.items():
        np.testing.assert_array_equal(np.asarray(back[name]), table)


def test_dtype_is_kept_and_inputs_can_be_deleted(proto: pb.EmbeddingSpecProto,
                                                 specs: dict[str, embedding_spec.FeatureSpec]
                                                 ) -> None:
    tables = {k: jnp.asarray(v, jnp.bfloat16) for k, v in random_tables(specs).items()}
    kept = {k: np.asarray(v) for k, v in tables.items()}
    stacked = table_stacking.stack_and_shard_feature_tables(tables, proto, delete_input=True)
    assert all(t.is_deleted() for t in tables.values())
    assert {a.dtype for a in stacked.values()} == {jnp.dtype(jnp.bfloat16)}
    three_d = {k: v.reshape(DEVICES * SC, -1, v.shape[-1]) for k, v in stacked.items()}
    back = table_stacking.unstack_and_unshard_stacked_tables(three_d, proto, donate=True)
    assert all(t.is_deleted() for t in three_d.values())
    for name, table in kept.items():
        assert back[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(np.asarray(back[name]), table)


def test_row_ids_match_the_native_plan(specs: dict[str, embedding_spec.FeatureSpec],
                                       proto: pb.EmbeddingSpecProto) -> None:
    plan = build_plan(specs, global_devices=DEVICES, sc_per_device=SC)
    tables = random_tables(specs)
    stacked = table_stacking.stack_and_shard_feature_tables(tables, proto)
    asked = {"user": [0, 7, 49], "item": [1, 69, 8], "ad": [32, 0]}
    rows = table_stacking.get_row_ids_in_stacked_tables(proto, asked)
    assert set(rows) == {"item_user", "ad"}
    assert rows["item_user"] == [*physical_rows(plan, "f_item", np.array(asked["item"])),
                                 *physical_rows(plan, "f_user", np.array(asked["user"]))]
    assert rows["ad"] == list(physical_rows(plan, "f_ad", np.array(asked["ad"])))
    item_user = np.asarray(stacked["item_user"])
    np.testing.assert_array_equal(item_user[rows["item_user"][3:], :6], tables["user"][[0, 7, 49]])
    stack = stack_named(proto, "item_user")
    assert table_stacking.get_row_ids_in_stacked_table(stack, stack.table_specs[1], []) == []


def test_table_settings_equal_the_native_stacking(
    specs: dict[str, embedding_spec.FeatureSpec],
) -> None:
    tables = {f.table_spec.name: f.table_spec for f in specs.values()}
    got = table_stacking.compute_table_to_setting_in_stack(
        "item_user", ["item", "user"], 8,
        {n: tables[n].setting_in_stack.padded_vocab_size for n in ("user", "item")},
        DEVICES * SC, SC)
    assert got == {n: tables[n].setting_in_stack for n in ("item", "user")}
    assert got["user"].shard_rotation == SC
    with pytest.raises(ValueError, match="Padded vocab size for Table b is missing"):
        table_stacking.compute_table_to_setting_in_stack("s", ["a", "b"], 8, {"a": 64}, 8, 4)
    with pytest.raises(ValueError, match="'a': padded vocab size 60 must be a positive multiple"):
        table_stacking.compute_table_to_setting_in_stack("s", ["a"], 8, {"a": 60}, 8, 4)
    with pytest.raises(ValueError, match=r"Tables \['a'\] are repeated"):
        table_stacking.compute_table_to_setting_in_stack("s", ["a", "a"], 8, {"a": 64}, 8, 4)


# --- bad input ----------------------------------------------------------------------------


def test_bad_arrays_are_errors(specs: dict[str, embedding_spec.FeatureSpec],
                               proto: pb.EmbeddingSpecProto) -> None:
    tables = random_tables(specs)
    with pytest.raises(ValueError, match=r"Tables \['ad'\] of stack 'ad' not found"):
        table_stacking.stack_and_shard_feature_tables(
            {k: v for k, v in tables.items() if k != "ad"}, proto)
    with pytest.raises(ValueError, match="'user': expected an array of shape \\(50, 6\\)"):
        table_stacking.stack_and_shard_feature_tables({**tables, "user": tables["user"][:, :5]},
                                                      proto)
    with pytest.raises(ValueError, match="same sharding"):
        table_stacking.stack_and_shard_feature_tables(
            {**tables, "user": jnp.asarray(tables["user"])}, proto)
    stacked = table_stacking.stack_and_shard_feature_tables(tables, proto)
    with pytest.raises(ValueError, match="Stacked table 'query' not found"):
        table_stacking.unstack_and_unshard_stacked_tables(
            {k: v for k, v in stacked.items() if k != "query"}, proto)
    with pytest.raises(ValueError, match=r"'ad' has shape \(32, 8\); .* describes \(64, 8\)"):
        table_stacking.unstack_and_unshard_stacked_tables(
            {**stacked, "ad": stacked["ad"][:32]}, proto)
    with pytest.raises(TypeError, match="embedding_specs must be a EmbeddingSpecProto"):
        table_stacking.unstack_and_unshard_stacked_tables(stacked, {"stacks": []})  # type: ignore[arg-type]


def test_inconsistent_protos_are_errors(proto: pb.EmbeddingSpecProto) -> None:
    tables = {t.table_name: np.zeros((t.vocab_size, t.embedding_dim), np.float32)
              for s in proto.stacked_table_specs for t in s.table_specs}
    cases = [
        (lambda p: setattr(stack_named(p, "item_user").table_specs[1], "row_offset_in_shard", 3),
         "'user' has row_offset_in_shard=3; .* starts at row 16"),
        (lambda p: setattr(stack_named(p, "item_user").table_specs[1], "padded_vocab_size", 56),
         "'user' has padded_vocab_size=56, but vocab_size=50 pads to 64"),
        (lambda p: setattr(stack_named(p, "item_user"), "stack_vocab_size", 200),
         "stack_vocab_size=200, but .* add up to 192"),
        (lambda p: setattr(stack_named(p, "query").table_specs[0], "shard_rotation", 8),
         "shard_rotation=8, outside \\[0, 8\\)"),
        (lambda p: setattr(stack_named(p, "query").table_specs[0], "padded_embedding_dim", 8),
         "'query' has embedding_dim=16 and padded_embedding_dim=8"),
        (lambda p: stack_named(p, "query").table_specs.append(stack_named(p, "ad").table_specs[0]),
         "names the table\\(s\\) \\['ad'\\] more than once"),
    ]
    for corrupt, message in cases:
        bad = pb.EmbeddingSpecProto.FromString(proto.SerializeToString())
        corrupt(bad)
        with pytest.raises(ValueError, match=message):
            table_stacking.stack_and_shard_feature_tables(tables, bad)


def test_bad_row_ids_are_errors(proto: pb.EmbeddingSpecProto) -> None:
    stack = stack_named(proto, "item_user")
    with pytest.raises(ValueError, match=r"'user': row ids \[50, -1\] are outside .*\[0, 50\)"):
        table_stacking.get_row_ids_in_stacked_table(stack, stack.table_specs[1], [3, 50, -1])
    with pytest.raises(TypeError, match="flat sequence of integers"):
        table_stacking.get_row_ids_in_stacked_table(stack, stack.table_specs[1], [1.5])  # type: ignore[list-item]
    other = stack_named(proto, "query").table_specs[0]
    with pytest.raises(ValueError, match="'query' is not one of the tables of stack 'item_user'"):
        table_stacking.get_row_ids_in_stacked_table(stack, other, [0])
    with pytest.raises(ValueError, match=r"names tables \['usr'\]"):
        table_stacking.get_row_ids_in_stacked_tables(proto, {"usr": [0]})


def test_stacked_tables_keep_a_two_device_sharding(tmp_path) -> None:
    code = textwrap.dedent(f"""
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from tilecore.compat.lib.nn import table_stacking
        from tilecore.compat.lib.proto import embedding_spec_pb2 as pb
        data = open({str(tmp_path / "proto.bin")!r}, "rb").read()
        proto = pb.EmbeddingSpecProto.FromString(data)
        sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x", None))
        tables = {{t.table_name: jax.device_put(np.ones((t.vocab_size, t.embedding_dim),
                                                        np.float32), sharding)
                  for s in proto.stacked_table_specs for t in s.table_specs
                  if t.vocab_size % 2 == 0}}
        proto = pb.EmbeddingSpecProto(stacked_table_specs=[
            s for s in proto.stacked_table_specs if s.stack_name == "item_user"])
        stacked = table_stacking.stack_and_shard_feature_tables(tables, proto)
        assert stacked["item_user"].sharding == sharding, stacked["item_user"].sharding
        back = table_stacking.unstack_and_unshard_stacked_tables(stacked, proto)
        assert back["user"].sharding == sharding
        odd = pb.EmbeddingSpecProto.FromString(data)
        odd = pb.EmbeddingSpecProto(stacked_table_specs=[odd.stacked_table_specs[0]])
        ad = jax.device_put(np.zeros((64, 8), np.float32), sharding)
        try:
            table_stacking.unstack_and_unshard_stacked_tables({{"ad": ad}}, odd)
        except ValueError as err:
            assert "Table 'ad' has shape (33, 4)" in str(err) and "replicated" in str(err)
        else:
            raise AssertionError("an uneven split was accepted")
        print("ok")
    """)
    proto = epu.create_proto_from_feature_specs(feature_specs(), DEVICES, SC)
    (tmp_path / "proto.bin").write_bytes(proto.SerializeToString())
    env = {"XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=240, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
