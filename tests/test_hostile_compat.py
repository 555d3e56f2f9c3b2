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
PADDING_ID = 2**31 - 1
"""compat's embedding ID in COO entries no row pointer covers (the reference writes 0)."""


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


# --- integer fields given as floats --------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "match"), [
    ("vocabulary_size", 64.0, r"vocabulary_size must be an integer, got 64.0 \(float\). "
                              r"Write vocabulary_size=64"),
    ("vocabulary_size", 63.5, r"vocabulary_size must be an integer, got 63.5 \(float\)"),
    ("embedding_dim", 8.0, r"embedding_dim must be an integer, got 8.0"),
    ("max_ids_per_partition", 8.0, r"max_ids_per_partition must be an integer, got 8.0"),
    ("suggested_coo_buffer_size_per_device", 1024.0,
     r"suggested_coo_buffer_size_per_device must be an integer, got 1024.0"),
])
def test_a_float_size_or_limit_is_refused_naming_the_table(field: str, value: float,
                                                           match: str) -> None:
    """63.5 became a 63-row table (int() truncated it). The reference raises RuntimeError
    (its binding, at preprocessing) or, for the width, JAX's TypeError (at init): compat
    refuses it when the specs are prepared, with NotAnIntegerError, which is both."""
    spec = table()
    setattr(spec, field, value)  # not stacked yet: the shell is mutable, as in the reference
    for kind in (RuntimeError, TypeError):
        with pytest.raises(kind, match=rf"TableSpec 't': {match}"):
            prepare({"f": feature("f", spec, width=8)})


def test_numpy_and_python_integers_are_accepted() -> None:
    specs = prepare({"f": feature("f", table(vocab=np.int64(64)))})  # type: ignore[arg-type]
    assert embedding.get_stacked_table_specs(specs)["t"].stack_vocab_size == 64


# --- init_embedding_variables over another number of SparseCores ----------------------------

def sharding(devices: int = 1) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))


def init(tables: Any, sc: int) -> Any:
    return embedding.init_embedding_variables(jax.random.key(0), tables, sharding(), sc)


def test_a_stack_of_tables_prepared_for_other_sparsecores_is_refused() -> None:
    """Prepared for 4 and initialised over 2, table 't2's rows took 't1's initializer (and
    the reverse) in silence, as in the reference."""
    specs = {"a": feature("a", table("t1")), "b": feature("b", table("t2"))}
    embedding.auto_stack_tables(specs, global_device_count=1, num_sc_per_device=4)
    prepare(specs)
    with pytest.raises(ValueError, match=r"stack 't1_t2' was prepared for another number of "
                                         r"SparseCores: table 't2' starts at row 16 .* over 1 "
                                         r"device\(s\) x num_sparsecore_per_device=2 \(2 "
                                         r"partitions\) the tables before it take 32 rows"):
        init(embedding.get_table_specs(specs), 2)
    assert set(init(embedding.get_table_specs(specs), 4)) == {"t1_t2"}


def test_one_table_prepared_for_other_sparsecores_is_accepted() -> None:
    """Its rows split over 2 partitions as well as 4: a valid layout, as the reference has it."""
    specs = prepare({"f": feature("f", table())})
    assert init(embedding.get_table_specs(specs), 2)["t"].table.shape == (64, 8)


def test_rows_that_do_not_split_over_the_partitions_are_refused() -> None:
    """24 rows over 16 partitions floor-divided to a 16-row table."""
    specs = {"f": feature("f", table(vocab=24))}
    embedding.prepare_feature_specs_for_training(specs, global_device_count=1, num_sc_per_device=1)
    with pytest.raises(ValueError, match=r"table 't' has padded_vocab_size=24, which does not "
                                         r"split over 1 device\(s\) x num_sparsecore_per_"
                                         r"device=16"):
        init(embedding.get_table_specs(specs), 16)


def test_unprepared_tables_need_padded_sizes() -> None:
    """Never prepared, a 60-row table made 60 rows no lookup can use (preparation pads to
    64); a table already padded gives exactly the prepared variables, as in the reference."""
    with pytest.raises(ValueError, match=r"table 't' was never prepared .* vocabulary_size=60, "
                                         r"embedding_dim=8 are not padded for 1 device\(s\) x "
                                         r"num_sparsecore_per_device=4 .* preparation makes it "
                                         r"64 x 8"):
        init({"t": table(vocab=60)}, 4)
    raw, prepared = table(), table()
    raw.initializer = prepared.initializer = jax.nn.initializers.normal()
    prepare({"f": feature("f", prepared)})
    np.testing.assert_array_equal(np.asarray(init({"t": raw}, 4)["t"].table),
                                  np.asarray(init({"t": prepared}, 4)["t"].table))


# --- against the reference -----------------------------------------------------------------

ERROR_OF = '''
def error(fn):
    """The name of the exception `fn()` raises, or None."""
    try:
        fn()
    except Exception as err:
        return type(err).__name__
    return None
'''

REFERENCE_CODE = ERROR_OF + '''
import json
import jax
import numpy as np
from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_proto_utils as epu
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es

out = {"re_exported": [getattr(embedding, n, None) is getattr(epu, n)
                       for n in json.loads((WORKDIR / "names.json").read_text())]}

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


# --- what the reference does with the cases left as they are, and the ones refused ---------

DECISIONS_CODE = ERROR_OF + '''
import json
import jax
import numpy as np
from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec as es
from jax_tpu_embedding.sparsecore.lib.nn import table_stacking

exec((WORKDIR / "cases.py").read_text())
out, arrays = {}, {}

IDS = {"f": np.zeros((16, 1), np.int32)}
out["float_vocab"] = error(lambda: embedding.preprocess_sparse_dense_matmul_input(
    IDS, None, prepare({"f": feature("f", table(vocab=64.0))}), 1, 1, num_sc_per_device=4))
out["float_dim"] = error(lambda: init(embedding.get_table_specs(
    prepare({"f": feature("f", table(dim=8.0))})), 4))
mixed = mixed_stack()
stacked = init(embedding.get_table_specs(mixed), 2)["t1_t2"].table
out["mixed"] = {name: sorted(set(np.asarray(t).ravel().tolist())) for name, t in
                table_stacking.unshard_and_unstack_tables(
                    embedding.get_table_specs(mixed), {"t1_t2": np.asarray(stacked)}, 4).items()}
arrays["unprepared"] = np.asarray(init({"t": table(initializer=NORMAL)}, 4)["t"].table)
arrays["one_table_over_2"] = np.asarray(
    init(embedding.get_table_specs(prepare({"f": feature("f", table(initializer=NORMAL))})),
         2)["t"].table)
for name, (specs, ids) in accepted_cases().items():
    prepare(specs)
    processed, _ = embedding.preprocess_sparse_dense_matmul_input(
        ids, None, specs, 1, 1, num_sc_per_device=4)
    for field, stacks in processed.sparse_dense_matmul_input._asdict().items():
        for stack, value in stacks.items():
            arrays[f"{name}/{field}/{stack}"] = np.asarray(value)
(WORKDIR / "out.json").write_text(json.dumps(out))
np.savez(WORKDIR / "arrays.npz", **arrays)
'''

CASES = '''
INIT = jax.nn.initializers.constant(0.5)
NORMAL = jax.nn.initializers.normal()

def table(name="t", vocab=64, dim=8, initializer=INIT, **limits):
    return es.TableSpec(name=name, vocabulary_size=vocab, embedding_dim=dim,
                        initializer=initializer, optimizer=es.SGDOptimizerSpec(learning_rate=0.1),
                        combiner="sum", **limits)

def feature(name, table_spec, input_shape=(16, 1)):
    return es.FeatureSpec(name=name, table_spec=table_spec, input_shape=list(input_shape),
                          output_shape=[16, table_spec.embedding_dim])

def prepare(specs):
    embedding.prepare_feature_specs_for_training(specs, 1, 4)
    return specs

def init(tables, sc):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    return embedding.init_embedding_variables(jax.random.key(0), tables, sharding, sc,
                                              bypass_mesh_check=True)

def mixed_stack():
    specs = {"a": feature("a", table("t1", initializer=jax.nn.initializers.constant(1.0))),
             "b": feature("b", table("t2", initializer=jax.nn.initializers.constant(2.0)))}
    embedding.auto_stack_tables(specs, global_device_count=1, num_sc_per_device=4)
    return prepare(specs)

def accepted_cases():
    ids = (np.arange(16, dtype=np.int32) * 3 % 64).reshape(16, 1)
    return {
        "input_shape_3d": ({"f": feature("f", table(), (16, 2, 1))}, {"f": ids}),
        "keys_swapped": ({"a": feature("b", table("tb")), "b": feature("a", table("ta"))},
                         {"a": ids, "b": ids + 1}),
        "unique_over_ids": ({"f": feature("f", table(max_ids_per_partition=8,
                                                     max_unique_ids_per_partition=64))},
                            {"f": ids}),
    }
'''


@requires_reference
def test_reference_decides_the_sixth_hunt_cases(tmp_path: pathlib.Path) -> None:
    """The reference refuses float sizes (RuntimeError when it preprocesses, TypeError for
    a float width at init) and mixes two tables' rows when a stack prepared for 4 SparseCores
    is initialised over 2: compat refuses those. It accepts, and handles as compat does
    (equal arrays), a 3-D input_shape, pytree keys that are not the feature names (inputs
    follow the pytree structure), max_unique_ids_per_partition above max_ids_per_partition,
    a never-prepared table already padded, and one table initialised over 2 SparseCores
    after preparation for 4: compat accepts those."""
    (tmp_path / "cases.py").write_text(CASES)
    run_reference(DECISIONS_CODE, tmp_path)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out == {"float_vocab": "RuntimeError", "float_dim": "TypeError",
                   "mixed": {"t1": [1.0, 2.0], "t2": [1.0, 2.0]}}
    want = dict(np.load(tmp_path / "arrays.npz"))
    namespace: dict[str, Any] = {"jax": jax, "np": np, "es": embedding_spec,
                                 "embedding": embedding}
    exec(CASES, namespace)  # the same cases, built with tilecore.compat
    assert_equal(want.pop("unprepared"),
                 namespace["init"]({"t": namespace["table"](initializer=namespace["NORMAL"])}, 4))
    one = namespace["prepare"]({"f": namespace["feature"]("f", namespace["table"](
        initializer=namespace["NORMAL"]))})
    assert_equal(want.pop("one_table_over_2"),
                 namespace["init"](embedding.get_table_specs(one), 2))
    got = {}
    for name, (specs, ids) in namespace["accepted_cases"]().items():
        namespace["prepare"](specs)
        processed, _ = embedding.preprocess_sparse_dense_matmul_input(
            ids, None, specs, 1, 1, num_sc_per_device=4)
        for field, stacks in processed.sparse_dense_matmul_input._asdict().items():
            got.update({f"{name}/{field}/{stack}": np.asarray(v) for stack, v in stacks.items()})
    assert sorted(got) == sorted(want)
    for key, value in want.items():  # the entries the row pointers cover (padding differs)
        case, field, stack = key.split("/")
        covered = got[f"{case}/lhs_embedding_ids/{stack}"] != PADDING_ID
        mask = ... if field == "lhs_row_pointers" else covered
        np.testing.assert_array_equal(got[key][mask], value[mask], err_msg=key)


def assert_equal(want: np.ndarray, variables: Any) -> None:
    (stack,) = variables.values()
    np.testing.assert_array_equal(np.asarray(stack.table), want)


@pytest.fixture(scope="module")
def pipelining_case() -> Any:
    import test_compat_auto_pipelining as ap_tests

    return ap_tests.make_case("sgd", steps=1)


@pytest.mark.parametrize(("change", "named"), [
    (lambda c: c._replace(steps=c.steps.astype(jax.numpy.float32)), r"carry\.steps: int32\[\] in, "
                                                             r"float32\[\] out"),
    (lambda c: c._replace(w=jax.numpy.concatenate([c.w, c.w])), r"carry\.w: float32\[12\] in, "
                                                         r"float32\[24\] out")])
def test_auto_pipelining_names_a_carry_whose_shape_or_dtype_changes(
        pipelining_case: Any, change: Any, named: str) -> None:
    """A dtype change was blamed on "the embedding updates handed on from the previous
    step"; a shape change failed a step later in the dense part (dot_general)."""
    import test_compat_auto_pipelining as ap_tests

    step = ap_tests.make_step(pipelining_case)

    def train_step(carry: Any, sparse: Any, labels: Any) -> Any:
        new, loss = step(carry, sparse, labels)
        return change(new), loss

    with pytest.raises(ValueError, match=r"must keep the carry's shapes and dtypes .* changed: "
                                         + named):
        ap_tests.first_call(pipelining_case, train_step)


def test_auto_pipelining_static_argnums_as_jax_reads_them(pipelining_case: Any) -> None:
    """None and a NumPy integer (accepted by the reference's jax.make_jaxpr) raised
    "'NoneType' object is not iterable"; a float the same raw TypeError."""
    import test_compat_auto_pipelining as ap_tests
    from tilecore.compat.lib.auto_pipelining import auto_pipelining as ap

    step = ap_tests.make_step(pipelining_case)

    def flagged(carry: Any, sparse: Any, labels: Any, double: bool) -> Any:
        carry, loss = step(carry, sparse, labels)
        return carry, loss * 2 if double else loss

    state, _ = ap_tests.first_call(pipelining_case, step, static_argnums=None)
    assert state.args_1 is not None
    state, _ = ap_tests.first_call(pipelining_case, flagged, True, static_argnums=np.int64(3))
    assert state.args_1[-1] == ap._ap.Static(True)
    with pytest.raises(TypeError, match=r"static_argnums must be an integer or a sequence of "
                                        r"integers .* got float 2\.0"):
        ap.auto_pipelining(step, out_shardings=None, static_argnums=2.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"fn must be the train step \(a callable\), got int"):
        ap.auto_pipelining(3, out_shardings=None)  # pyright: ignore[reportArgumentType]


def test_partitioned_optimizer_refuses_embedding_variables_of_another_model() -> None:
    """The "gradients" (updated tables) of another model, or with a stack missing, were
    copied into the model by nnx.update without a word: its tables took their shapes."""
    import flax.nnx as nnx
    import optax

    import test_compat_flax as flax_tests
    from tilecore.compat.lib.flax.nnx import embed as nnx_embed

    model = flax_tests.NnxModel(flax_tests.feature_specs(), nnx.Rngs(0))
    optimizer = nnx_embed.PartitionedOptimizer(model, optax.sgd(0.1))
    ids, labels = flax_tests.examples(1)[0]
    inputs = model.embed.preprocess_inputs(0, ids, None)
    grads = nnx.grad(lambda m: flax_tests.bce(m(inputs), labels))(model)
    variable = grads["embed"]["embedding_table"]
    updated = variable.get_value()
    variable.set_value({k: type(v)(table=v.table[:8], slot=v.slot) for k, v in updated.items()})
    with pytest.raises(ValueError, match=r"variables at 'embed/embedding_table' do not fit the "
                                         r"model's \(\['item'\]\.table: given \(8, 8\), model "
                                         r"\(96, 8\)"):
        optimizer.update(model, grads)
    variable.set_value({"item": updated["item"]})
    with pytest.raises(ValueError, match=r"\['user'\]\.slot\.accumulator: given none, model "
                                         r"\(64, 8\)"):
        optimizer.update(model, grads)
    assert {k: v.table.shape for k, v in model.embed.embedding_table.get_value().items()} == {
        "item": (96, 8), "user": (64, 8)}
    variable.set_value(updated)
    optimizer.update(model, grads)  # this model's own update
