"""Spec protos and proto-driven table stacking: tilecore.compat against the reference 0.2.0.

Both sides build the same feature specs (one code text, run with each side's
`embedding`/`embedding_spec`), stack them and write their `EmbeddingSpecProto`;
each side parses the other's bytes. The reference stacks, unstacks and maps row
ids of the same random tables, and tilecore must give identical arrays.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from _reference_peer import ROOT, requires_reference, run_reference
from tilecore.compat.lib.nn import (
    embedding,
    embedding_proto_utils,
    embedding_spec,
    table_stacking,
)
from tilecore.compat.lib.proto import embedding_spec_pb2 as pb

pytestmark = requires_reference

SPECS_CODE = '''
class Schedule:
    tag = "warmup_cosine"

    def __call__(self, step):
        return 0.1 / (1 + step)


def optimizers(es):
    return [
        es.SGDOptimizerSpec(learning_rate=0.3),
        es.AdagradOptimizerSpec(learning_rate=0.25, initial_accumulator_value=0.1),
        es.AdamOptimizerSpec(learning_rate=Schedule(), beta_1=0.8),
        es.FTRLOptimizerSpec(learning_rate=0.5, l1_regularization_strength=0.01,
                             multiply_linear_by_learning_rate=True),
        es.F2AOptimizerSpec(learning_rate=0.5, rho=0.25),
        es.AdagradMomentumOptimizerSpec(learning_rate=0.125, use_nesterov=True, beta2=0.9),
        es.LaPropOptimizerSpec(learning_rate=0.5),
    ]


def build(embedding, es):
    adagrad = es.AdagradOptimizerSpec(learning_rate=0.25, initial_accumulator_value=0.5)
    ftrl = es.FTRLOptimizerSpec(learning_rate=Schedule(), l1_regularization_strength=0.5,
                                multiply_linear_by_learning_rate=True)
    momentum = es.AdagradMomentumOptimizerSpec(learning_rate=0.125, use_nesterov=True)

    def table(name, vocab, dim, opt, combiner="sum"):
        return es.TableSpec(name=name, vocabulary_size=vocab, embedding_dim=dim,
                            initializer=None, optimizer=opt, combiner=combiner)

    tables = [table("user", 50, 6, adagrad), table("item", 70, 8, adagrad),
              table("tag", 300, 5, adagrad), table("query", 40, 16, ftrl, "mean"),
              table("ad", 33, 4, momentum, "sqrtn")]
    by_name = {t.name: t for t in tables}
    uses = [("f_user", "user", 16, 1), ("f_item", "item", 16, 2), ("f_item2", "item", 16, 1),
            ("f_tag", "tag", 8, 3), ("f_query", "query", 8, 1), ("f_ad", "ad", 16, 1)]
    specs = {
        name: es.FeatureSpec(name=name, table_spec=by_name[t], input_shape=[batch, valency],
                             output_shape=[batch, by_name[t].embedding_dim])
        for name, t, batch, valency in uses
    }
    embedding.auto_stack_tables(specs, global_device_count=2, num_sc_per_device=4)
    embedding.prepare_feature_specs_for_training(specs, global_device_count=2,
                                                 num_sc_per_device=4)
    return specs
'''

ROW_IDS = {"user": [0, 7, 49], "item": [69, 1, 8], "tag": [299, 0], "ad": [32, 5]}

SETTINGS_ARGS = ("s", ["a", "b", "c"], 16, {"a": 64, "b": 128, "c": 192}, 8, 3)

REFERENCE_CODE = f"SETTINGS_ARGS = {SETTINGS_ARGS!r}\n" + '''
import dataclasses
import json
import numpy as np
import jax.numpy as jnp
from google.protobuf import descriptor_pb2
from jax_tpu_embedding.sparsecore.lib.nn import (
    embedding, embedding_proto_utils as epu, embedding_spec as es, table_stacking)
from jax_tpu_embedding.sparsecore.lib.proto import embedding_spec_pb2 as pb

namespace = {}
exec((WORKDIR / "specs.py").read_text(), namespace)
specs = namespace["build"](embedding, es)
proto = epu.create_proto_from_feature_specs(specs, 2, 4)
(WORKDIR / "ref_proto.bin").write_bytes(proto.SerializeToString())
ours = pb.EmbeddingSpecProto.FromString((WORKDIR / "our_proto.bin").read_bytes())
descriptor = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
our_descriptor = descriptor_pb2.FileDescriptorProto.FromString(
    (WORKDIR / "our_descriptor.bin").read_bytes())
our_descriptor.name = descriptor.name

opts = namespace["optimizers"](es)
our_opts = [pb.OptimizerSpecProto.FromString(bytes.fromhex(h))
            for h in json.loads((WORKDIR / "our_optimizers.json").read_text())]
(WORKDIR / "ref_optimizers.json").write_text(json.dumps(
    [epu.optimizer_spec_to_proto(o).SerializeToString().hex() for o in opts]))
read_back = [epu.proto_to_optimizer_spec(p) for p in our_opts]
checks = {
    "our_proto_equal": ours == proto,
    "descriptor_equal": our_descriptor == descriptor,
    "our_optimizer_protos_equal": [epu.optimizer_spec_to_proto(o) == p
                                   for o, p in zip(opts, our_opts)],
    "read_back": [f"{type(o).__name__}({o.learning_rate!r}, {o.get_float_params()!r}, "
                  f"{o.get_bool_params()!r})" for o in read_back],
}
(WORKDIR / "checks.json").write_text(json.dumps(checks))

with np.load(WORKDIR / "tables.npz") as z:
    tables = {k: jnp.asarray(v) for k, v in z.items()}
stacked = table_stacking.stack_and_shard_feature_tables(tables, proto)
np.savez(WORKDIR / "ref_stacked.npz", **{k: np.asarray(v) for k, v in stacked.items()})
unstacked = table_stacking.unstack_and_unshard_stacked_tables(stacked, proto)
np.savez(WORKDIR / "ref_unstacked.npz", **{k: np.asarray(v) for k, v in unstacked.items()})
row_ids = json.loads((WORKDIR / "row_ids.json").read_text())
rows = table_stacking.get_row_ids_in_stacked_tables(proto, row_ids)
(WORKDIR / "ref_rows.json").write_text(json.dumps({k: [int(r) for r in v]
                                                    for k, v in rows.items()}))
settings = table_stacking.compute_table_to_setting_in_stack(*SETTINGS_ARGS)
(WORKDIR / "ref_settings.json").write_text(json.dumps(
    {k: dataclasses.asdict(v) for k, v in settings.items()}))
'''


def _our_specs() -> dict[str, embedding_spec.FeatureSpec]:
    namespace: dict[str, object] = {}
    exec(SPECS_CODE, namespace)
    return namespace["build"](embedding, embedding_spec)  # type: ignore[operator]


def _our_optimizers() -> list[embedding_spec.OptimizerSpec]:
    namespace: dict[str, object] = {}
    exec(SPECS_CODE, namespace)
    return namespace["optimizers"](embedding_spec)  # type: ignore[operator]


@pytest.fixture(scope="module")
def exchange(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Write our side's files, run the reference once, and return the folder."""
    work = tmp_path_factory.mktemp("proto")
    (work / "specs.py").write_text(SPECS_CODE)
    proto = embedding_proto_utils.create_proto_from_feature_specs(_our_specs(), 2, 4)
    (work / "our_proto.bin").write_bytes(proto.SerializeToString())
    descriptor = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(descriptor)
    (work / "our_descriptor.bin").write_bytes(descriptor.SerializeToString())
    opts = [embedding_proto_utils.optimizer_spec_to_proto(o) for o in _our_optimizers()]
    (work / "our_optimizers.json").write_text(
        json.dumps([o.SerializeToString().hex() for o in opts if o is not None]))
    rng = np.random.default_rng(3)
    tables = {t.table_spec.name: t.table_spec for t in _our_specs().values()}
    arrays: dict[str, Any] = {
        name: rng.normal(size=(t.vocabulary_size, t.embedding_dim)).astype(np.float32)
        for name, t in tables.items()}
    np.savez(work / "tables.npz", **arrays)
    (work / "row_ids.json").write_text(json.dumps(ROW_IDS))
    run_reference(REFERENCE_CODE, work)
    return work


def test_protos_parse_on_both_sides_and_are_equal(exchange: pathlib.Path) -> None:
    ours = embedding_proto_utils.create_proto_from_feature_specs(_our_specs(), 2, 4)
    theirs = pb.EmbeddingSpecProto.FromString((exchange / "ref_proto.bin").read_bytes())
    assert theirs == ours
    assert max(len(s.table_specs) for s in ours.stacked_table_specs) == 3  # a real stack
    checks = json.loads((exchange / "checks.json").read_text())
    assert checks["our_proto_equal"] and checks["descriptor_equal"]


def test_optimizer_protos_agree(exchange: pathlib.Path) -> None:
    checks = json.loads((exchange / "checks.json").read_text())
    assert all(checks["our_optimizer_protos_equal"]), checks["our_optimizer_protos_equal"]
    theirs = [pb.OptimizerSpecProto.FromString(bytes.fromhex(h))
              for h in json.loads((exchange / "ref_optimizers.json").read_text())]
    ours = [embedding_proto_utils.optimizer_spec_to_proto(o) for o in _our_optimizers()]
    assert theirs == ours
    read_back = [embedding_proto_utils.proto_to_optimizer_spec(p) for p in theirs]
    assert checks["read_back"] == [
        f"{type(o).__name__}({o.learning_rate!r}, {o.get_float_params()!r}, "
        f"{o.get_bool_params()!r})" for o in read_back]


def test_tables_stack_unstack_and_map_rows_identically(exchange: pathlib.Path) -> None:
    proto = pb.EmbeddingSpecProto.FromString((exchange / "ref_proto.bin").read_bytes())
    with np.load(exchange / "tables.npz") as z:
        tables = dict(z)
    with np.load(exchange / "ref_stacked.npz") as z:
        ref_stacked = dict(z)
    with np.load(exchange / "ref_unstacked.npz") as z:
        ref_unstacked = dict(z)
    stacked = table_stacking.stack_and_shard_feature_tables(tables, proto)
    assert stacked.keys() == ref_stacked.keys()
    for name, array in stacked.items():
        np.testing.assert_array_equal(np.asarray(array), ref_stacked[name], err_msg=name)
    unstacked = table_stacking.unstack_and_unshard_stacked_tables(ref_stacked, proto)
    assert unstacked.keys() == ref_unstacked.keys()
    for name, array in unstacked.items():
        np.testing.assert_array_equal(np.asarray(array), ref_unstacked[name], err_msg=name)
    rows = table_stacking.get_row_ids_in_stacked_tables(proto, ROW_IDS)
    assert dict(rows) == json.loads((exchange / "ref_rows.json").read_text())


def test_table_settings_in_stack_agree(exchange: pathlib.Path) -> None:
    settings = table_stacking.compute_table_to_setting_in_stack(*SETTINGS_ARGS)
    assert {k: dataclasses.asdict(v) for k, v in settings.items()} == json.loads(
        (exchange / "ref_settings.json").read_text())


def test_both_message_sets_live_in_one_process(tmp_path: pathlib.Path) -> None:
    """Our pb2 (a private pool) imports beside the reference's (the default pool)."""
    ours = ROOT / "src" / "tilecore" / "compat" / "lib" / "proto" / "embedding_spec_pb2.py"
    out = run_reference(f"""
import importlib.util
from jax_tpu_embedding.sparsecore.lib.proto import embedding_spec_pb2 as ref
spec = importlib.util.spec_from_file_location("ours_pb2", {str(ours)!r})
ours = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ours)
m = ours.OptimizerSpecProto(type=ours.OptimizerSpecProto.FTRL, learning_rate_tag="t",
                            bool_params={{"multiply_linear_by_learning_rate": True}})
r = ref.OptimizerSpecProto.FromString(m.SerializeToString())
print(ref.OptimizerSpecProto.OptimizerType.Name(r.type), r.learning_rate_tag,
      dict(r.bool_params), ours.OptimizerSpecProto.FromString(r.SerializeToString()) == m)
""", tmp_path)
    assert out.split() == ["FTRL", "t", "{'multiply_linear_by_learning_rate':", "True}", "True"]
