"""Hostile cases for `tilecore.compat`: a ported program's mistakes, refused clearly.

Each mistake must raise an error that names the table, feature or argument and the
value, never pass silently or fail deep inside with a raw AttributeError. Where the
reference itself raises a specific type for the mistake (checked in its venv when
it is built), compat raises that type, with a clear message.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np
import pytest

from _reference_peer import requires_reference, run_reference
from tilecore.compat.lib.nn import (
    embedding,
    embedding_proto_utils,
    embedding_spec,
    table_stacking,
)
from tilecore.compat.lib.proto import embedding_spec_pb2 as pb

PROTO_HELPERS = ("create_proto_from_feature_specs", "get_optimizer_class", "get_optimizer_type",
                 "optimizer_spec_to_proto", "proto_to_optimizer_spec")
INIT = jax.nn.initializers.constant(0.5)


def table(name: str = "t", vocab: int = 64, dim: int = 8, optimizer: Any = None
          ) -> embedding_spec.TableSpec:
    return embedding_spec.TableSpec(
        name=name, vocabulary_size=vocab, embedding_dim=dim, initializer=INIT,
        optimizer=optimizer or embedding_spec.SGDOptimizerSpec(learning_rate=0.1),
        combiner="sum")


def feature(name: str, table_spec: Any, width: int | None = None) -> embedding_spec.FeatureSpec:
    return embedding_spec.FeatureSpec(
        name=name, table_spec=table_spec, input_shape=[16, 1],
        output_shape=[16, width or getattr(table_spec, "embedding_dim", 8)])


def prepare(specs: Any) -> Any:
    embedding.prepare_feature_specs_for_training(specs, global_device_count=1,
                                                 num_sc_per_device=4)
    return specs


# --- two different tables under one name ---------------------------------------------------

def test_two_different_tables_named_alike_are_refused_when_prepared() -> None:
    """They used to be merged silently: the first table's vocabulary checked both features."""
    specs = {"a": feature("a", table(vocab=64, dim=8)), "b": feature("b", table(vocab=128, dim=16))}
    with pytest.raises(ValueError, match=r"Two different tables are named 't': feature 'a' uses "
                                         r"one, feature 'b' another \(vocab_size 64 vs 128, "
                                         r"embedding_dim 8 vs 16\)"):
        prepare(specs)


def test_two_different_tables_named_alike_are_refused_when_auto_stacked() -> None:
    specs = {"a": feature("a", table(vocab=64)), "b": feature("b", table(vocab=128))}
    with pytest.raises(ValueError, match="Two different tables are named 't'"):
        embedding.auto_stack_tables(specs, global_device_count=1, num_sc_per_device=4)


def test_equal_tables_named_alike_are_one_table() -> None:
    """Two equal TableSpec objects under one name are one table, as in the reference."""
    specs = prepare({"a": feature("a", table()), "b": feature("b", table())})
    assert list(embedding.get_stacked_table_specs(specs)) == ["t"]


# --- proto helpers re-exported by embedding ------------------------------------------------

def test_embedding_re_exports_the_proto_helpers() -> None:
    for name in PROTO_HELPERS:
        assert getattr(embedding, name) is getattr(embedding_proto_utils, name), name
        assert name in embedding.__all__


# --- specs of the wrong kind ---------------------------------------------------------------

def test_a_table_name_for_table_spec_is_refused_naming_the_feature() -> None:
    with pytest.raises(AttributeError, match=r"FeatureSpec 'f': table_spec must be an "
                                             r"embedding_spec.TableSpec, got str 't'"):
        prepare({"f": feature("f", "t", width=8)})


def test_stacked_specs_for_init_embedding_variables_are_refused() -> None:
    specs = prepare({"f": feature("f", table())})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    with pytest.raises(AttributeError, match=r"table_specs must hold embedding_spec.TableSpec "
                                             r"values.*got StackedTableSpec 't'"):
        embedding.init_embedding_variables(jax.random.key(0),
                                           embedding.get_stacked_table_specs(specs), sharding, 4)


# --- custom optimizer slot initializers ----------------------------------------------------

def custom(slot_init: Any) -> embedding_spec.CustomOptimizerSpec:
    return embedding_spec.CustomOptimizerSpec(
        learning_rate=0.1, custom_computation_fn=lambda g, w, s, lr: (w - lr * g, s),
        slot_variable_initializers_tuple=(slot_init,), short_name_str="mine")


@pytest.mark.parametrize(("slot_init", "match"), [
    (jax.nn.initializers.constant(float("nan")),
     r"TableSpec 't'.*slot_initial_value_tuple must be a finite number, got .*nan"),
    (jax.nn.initializers.normal(), r"TableSpec 't': CustomOptimizerSpec 'mine': tilecore slot "
                                   r"variables start from a constant, but the slot initializer "
                                   r".* fills different values"),
    ("x", r"TableSpec 't'.*must be a finite number, got .*'x'"),
])
def test_bad_slot_initializers_are_named(slot_init: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prepare({"f": feature("f", table(optimizer=custom(slot_init)))})


def test_a_constant_slot_initializer_gives_its_value() -> None:
    assert custom(jax.nn.initializers.constant(0.25)).to_native().slot_initial_values() == (0.25,)


# --- activation widths ---------------------------------------------------------------------

def test_activation_width_narrower_is_sliced_wider_is_refused() -> None:
    """As in the reference: a narrower output_shape takes the first columns; a wider one
    is refused, naming the feature, when the activations are unstacked."""
    narrow = prepare({"f": feature("f", table(), width=3)})
    activations = {"t": np.arange(16 * 8, dtype=np.float32).reshape(16, 8)}
    out = embedding.unstack_embedding_activations(activations, narrow, 1, 4)
    np.testing.assert_array_equal(np.asarray(out["f"]), activations["t"][:, :3])
    wide = prepare({"f": feature("f", table(), width=16)})
    with pytest.raises(ValueError, match=r"Feature 'f' has output shape \(16, 16\) wider than "
                                         r"its table's embedding_dim=8"):
        embedding.unstack_embedding_activations(activations, wide, 1, 4)


# --- empty spec protos ---------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda proto: table_stacking.stack_and_shard_feature_tables(
        {"t": np.ones((64, 8), np.float32)}, proto),
    lambda proto: table_stacking.unstack_and_unshard_stacked_tables(
        {"t": np.ones((64, 8), np.float32)}, proto),
    lambda proto: table_stacking.get_row_ids_in_stacked_tables(proto, {}),
])
def test_a_proto_without_stacks_is_refused(call: Any) -> None:
    with pytest.raises(ValueError, match="EmbeddingSpecProto with no stacked_table_specs"):
        call(pb.EmbeddingSpecProto())


# --- against the reference -----------------------------------------------------------------

REFERENCE_CODE = '''
import json
import jax
import numpy as np
from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_proto_utils as epu
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es

out = {"re_exported": [getattr(embedding, n, None) is getattr(epu, n)
                       for n in json.loads((WORKDIR / "names.json").read_text())]}

def error(fn):
    try:
        fn()
    except Exception as err:
        return type(err).__name__
    return None

table = es.TableSpec(name="t", vocabulary_size=64, embedding_dim=8,
                     initializer=jax.nn.initializers.constant(0.5),
                     optimizer=es.SGDOptimizerSpec(learning_rate=0.1), combiner="sum")
bad = {"f": es.FeatureSpec(name="f", table_spec="t", input_shape=[16, 1], output_shape=[16, 8])}
out["table_spec_str"] = error(lambda: embedding.prepare_feature_specs_for_training(bad, 1, 4))
specs = {"f": es.FeatureSpec(name="f", table_spec=table, input_shape=[16, 1],
                             output_shape=[16, 8])}
embedding.prepare_feature_specs_for_training(specs, 1, 4)
mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
out["init_stacked"] = error(lambda: embedding.init_embedding_variables(
    jax.random.key(0), embedding.get_stacked_table_specs(specs), sharding, 4,
    bypass_mesh_check=True))
(WORKDIR / "out.json").write_text(json.dumps(out))
'''


@requires_reference
def test_reference_re_exports_and_error_types(tmp_path: pathlib.Path) -> None:
    """The reference's embedding re-exports the same five helpers, and raises
    AttributeError for the two wrong-kind specs above (so compat keeps that type)."""
    (tmp_path / "names.json").write_text(json.dumps(PROTO_HELPERS))
    run_reference(REFERENCE_CODE, tmp_path)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out == {"re_exported": [True] * len(PROTO_HELPERS),
                   "table_spec_str": "AttributeError", "init_stacked": "AttributeError"}
