"""Types of the runtime-built messages in `embedding_spec_pb2.py` (as protoc's `.pyi` would give)."""

from collections.abc import Iterable, Mapping
from typing import ClassVar

from google.protobuf.descriptor import FileDescriptor
from google.protobuf.internal.containers import (
    RepeatedCompositeFieldContainer,
    RepeatedScalarFieldContainer,
    ScalarMap,
)
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from google.protobuf.message import Message

DESCRIPTOR: FileDescriptor

class FeatureSpecProto(Message):
    feature_name: str
    input_shape: RepeatedScalarFieldContainer[int]
    output_shape: RepeatedScalarFieldContainer[int]
    row_offset: int
    col_offset: int
    col_shift: int
    def __init__(
        self,
        *,
        feature_name: str | None = ...,
        input_shape: Iterable[int] | None = ...,
        output_shape: Iterable[int] | None = ...,
        row_offset: int | None = ...,
        col_offset: int | None = ...,
        col_shift: int | None = ...,
    ) -> None: ...

class OptimizerSpecProto(Message):
    OptimizerType: ClassVar[EnumTypeWrapper]
    OPTIMIZER_TYPE_UNSPECIFIED: ClassVar[int]
    SGD: ClassVar[int]
    ADAGRAD: ClassVar[int]
    ADAM: ClassVar[int]
    FTRL: ClassVar[int]
    F2A: ClassVar[int]
    ADAGRAD_MOMENTUM: ClassVar[int]
    CUSTOM: ClassVar[int]
    type: int
    learning_rate: float
    learning_rate_tag: str
    float_params: ScalarMap[str, float]
    bool_params: ScalarMap[str, bool]
    def __init__(
        self,
        *,
        type: int | None = ...,
        learning_rate: float | None = ...,
        learning_rate_tag: str | None = ...,
        float_params: Mapping[str, float] | None = ...,
        bool_params: Mapping[str, bool] | None = ...,
    ) -> None: ...

class TableSpecProto(Message):
    table_name: str
    vocab_size: int
    embedding_dim: int
    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    padded_vocab_size: int
    padded_embedding_dim: int
    row_offset_in_shard: int
    shard_rotation: int
    feature_specs: RepeatedCompositeFieldContainer[FeatureSpecProto]
    combiner: str
    @property
    def optimizer(self) -> OptimizerSpecProto: ...
    def __init__(
        self,
        *,
        table_name: str | None = ...,
        vocab_size: int | None = ...,
        embedding_dim: int | None = ...,
        max_ids_per_partition: int | None = ...,
        max_unique_ids_per_partition: int | None = ...,
        padded_vocab_size: int | None = ...,
        padded_embedding_dim: int | None = ...,
        row_offset_in_shard: int | None = ...,
        shard_rotation: int | None = ...,
        feature_specs: Iterable[FeatureSpecProto] | None = ...,
        combiner: str | None = ...,
        optimizer: OptimizerSpecProto | None = ...,
    ) -> None: ...

class StackedTableSpecProto(Message):
    stack_name: str
    stack_vocab_size: int
    stack_embedding_dim: int
    total_sample_count: int
    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    num_sparsecores: int
    table_specs: RepeatedCompositeFieldContainer[TableSpecProto]
    activation_mem_bytes_limit: int
    def __init__(
        self,
        *,
        stack_name: str | None = ...,
        stack_vocab_size: int | None = ...,
        stack_embedding_dim: int | None = ...,
        total_sample_count: int | None = ...,
        max_ids_per_partition: int | None = ...,
        max_unique_ids_per_partition: int | None = ...,
        num_sparsecores: int | None = ...,
        table_specs: Iterable[TableSpecProto] | None = ...,
        activation_mem_bytes_limit: int | None = ...,
    ) -> None: ...

class EmbeddingSpecProto(Message):
    stacked_table_specs: RepeatedCompositeFieldContainer[StackedTableSpecProto]
    def __init__(
        self, *, stacked_table_specs: Iterable[StackedTableSpecProto] | None = ...
    ) -> None: ...

__all__ = [
    "DESCRIPTOR",
    "EmbeddingSpecProto",
    "FeatureSpecProto",
    "OptimizerSpecProto",
    "StackedTableSpecProto",
    "TableSpecProto",
]
