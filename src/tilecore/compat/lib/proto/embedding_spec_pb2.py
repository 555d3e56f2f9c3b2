"""The reference's `embedding_spec.proto` messages, wire-compatible (`lib/proto/embedding_spec_pb2`).

`EmbeddingSpecProto` → `StackedTableSpecProto` → `TableSpecProto` →
`FeatureSpecProto`, plus `OptimizerSpecProto` (with its `OptimizerType` enum),
describe how trained tables were stacked and sharded, so a checkpoint can be
unstacked for serving or restacked for another topology. The proto package,
message and field names, numbers and types are the reference's, so bytes written
by either side parse on the other (and text/JSON formats and `Any` type URLs
agree).

protoc is not needed: the file descriptor is built here as a
`FileDescriptorProto` and the message classes come from the protobuf runtime. They
live in a private descriptor pool, so importing the reference's own
`embedding_spec_pb2` in the same process (it registers the same full names in the
default pool) does not clash.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_FIELD = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "third_party.py.jax_tpu_embedding.sparsecore_lib_proto"
_FILE_NAME = "tilecore/compat/lib/proto/embedding_spec.proto"

_SCALARS = {
    "string": _FIELD.TYPE_STRING,
    "int64": _FIELD.TYPE_INT64,
    "float": _FIELD.TYPE_FLOAT,
    "bool": _FIELD.TYPE_BOOL,
}

_ENUMS = frozenset({"OptimizerSpecProto.OptimizerType"})

_OPTIMIZER_TYPES = (
    "OPTIMIZER_TYPE_UNSPECIFIED", "SGD", "ADAGRAD", "ADAM", "FTRL", "F2A", "ADAGRAD_MOMENTUM",
    "CUSTOM",
)
"""`OptimizerSpecProto.OptimizerType` values, numbered 0, 1, … in this order."""


def _add_field(
    message: descriptor_pb2.DescriptorProto,
    name: str,
    number: int,
    kind: str,
    *,
    repeated: bool = False,
    oneof_index: int | None = None,
    proto3_optional: bool = False,
) -> None:
    """Add field `name = number`; `kind` is a scalar name, or an enum (`_ENUMS`) or message
    path in the package."""
    field = message.field.add(name=name, number=number)
    field.label = _FIELD.LABEL_REPEATED if repeated else _FIELD.LABEL_OPTIONAL
    if kind in _SCALARS:
        field.type = _SCALARS[kind]
    else:
        field.type = _FIELD.TYPE_ENUM if kind in _ENUMS else _FIELD.TYPE_MESSAGE
        field.type_name = f".{_PACKAGE}.{kind}"
    if oneof_index is not None:
        field.oneof_index = oneof_index
    if proto3_optional:
        field.proto3_optional = True


def _add_map_entry(message: descriptor_pb2.DescriptorProto, entry: str, value: str) -> None:
    """A `map<string, value>` field's synthetic entry message `entry`."""
    nested = message.nested_type.add(name=entry)
    _add_field(nested, "key", 1, "string")
    _add_field(nested, "value", 2, value)
    nested.options.map_entry = True


def _feature_spec(file: descriptor_pb2.FileDescriptorProto) -> None:
    message = file.message_type.add(name="FeatureSpecProto")
    _add_field(message, "feature_name", 1, "string")
    _add_field(message, "input_shape", 2, "int64", repeated=True)
    _add_field(message, "output_shape", 3, "int64", repeated=True)
    _add_field(message, "row_offset", 4, "int64")
    _add_field(message, "col_offset", 5, "int64")
    _add_field(message, "col_shift", 6, "int64")


def _optimizer_spec(file: descriptor_pb2.FileDescriptorProto) -> None:
    message = file.message_type.add(name="OptimizerSpecProto")
    _add_field(message, "type", 1, "OptimizerSpecProto.OptimizerType")
    message.oneof_decl.add(name="learning_rate_spec")
    _add_field(message, "learning_rate", 2, "float", oneof_index=0)
    _add_field(message, "learning_rate_tag", 3, "string", oneof_index=0)
    _add_field(message, "float_params", 4, "OptimizerSpecProto.FloatParamsEntry", repeated=True)
    _add_field(message, "bool_params", 5, "OptimizerSpecProto.BoolParamsEntry", repeated=True)
    _add_map_entry(message, "FloatParamsEntry", "float")
    _add_map_entry(message, "BoolParamsEntry", "bool")
    enum = message.enum_type.add(name="OptimizerType")
    for number, name in enumerate(_OPTIMIZER_TYPES):
        enum.value.add(name=name, number=number)


def _table_spec(file: descriptor_pb2.FileDescriptorProto) -> None:
    message = file.message_type.add(name="TableSpecProto")
    _add_field(message, "table_name", 1, "string")
    for name, number in (("vocab_size", 2), ("embedding_dim", 3), ("max_ids_per_partition", 5),
                         ("max_unique_ids_per_partition", 6), ("padded_vocab_size", 7),
                         ("padded_embedding_dim", 8), ("row_offset_in_shard", 9),
                         ("shard_rotation", 10)):
        _add_field(message, name, number, "int64")
    _add_field(message, "feature_specs", 11, "FeatureSpecProto", repeated=True)
    _add_field(message, "combiner", 12, "string")
    _add_field(message, "optimizer", 13, "OptimizerSpecProto")


def _stacked_table_spec(file: descriptor_pb2.FileDescriptorProto) -> None:
    message = file.message_type.add(name="StackedTableSpecProto")
    _add_field(message, "stack_name", 1, "string")
    for name, number in (("stack_vocab_size", 2), ("stack_embedding_dim", 3),
                         ("total_sample_count", 6), ("max_ids_per_partition", 7),
                         ("max_unique_ids_per_partition", 8), ("num_sparsecores", 9)):
        _add_field(message, name, number, "int64")
    _add_field(message, "table_specs", 10, "TableSpecProto", repeated=True)
    # `optional int64 activation_mem_bytes_limit = 11;` (proto3 presence: a synthetic oneof).
    message.oneof_decl.add(name="_activation_mem_bytes_limit")
    _add_field(message, "activation_mem_bytes_limit", 11, "int64", oneof_index=0,
               proto3_optional=True)


def _file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """`embedding_spec.proto` as a descriptor: the reference's messages, names and numbers."""
    file = descriptor_pb2.FileDescriptorProto(name=_FILE_NAME, package=_PACKAGE, syntax="proto3")
    _feature_spec(file)
    _optimizer_spec(file)
    _table_spec(file)
    _stacked_table_spec(file)
    embedding = file.message_type.add(name="EmbeddingSpecProto")
    _add_field(embedding, "stacked_table_specs", 1, "StackedTableSpecProto", repeated=True)
    file.options.java_multiple_files = True
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file_descriptor_proto())
DESCRIPTOR = _POOL.FindFileByName(_FILE_NAME)
"""The `FileDescriptor` of these messages (in tilecore's private pool)."""


def _message_class(name: str) -> type:
    return message_factory.GetMessageClass(DESCRIPTOR.message_types_by_name[name])


FeatureSpecProto = _message_class("FeatureSpecProto")
OptimizerSpecProto = _message_class("OptimizerSpecProto")
TableSpecProto = _message_class("TableSpecProto")
StackedTableSpecProto = _message_class("StackedTableSpecProto")
EmbeddingSpecProto = _message_class("EmbeddingSpecProto")

__all__ = [
    "DESCRIPTOR",
    "EmbeddingSpecProto",
    "FeatureSpecProto",
    "OptimizerSpecProto",
    "StackedTableSpecProto",
    "TableSpecProto",
]
