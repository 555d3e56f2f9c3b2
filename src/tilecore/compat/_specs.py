"""The reference's table and feature specs: mutable shells that stacking fills in place.

Field names, defaults and the in-place habits follow `jax_tpu_embedding`'s
`embedding_spec` (`TableSpec.stacked_table_spec`, `TableSpec.setting_in_stack`,
`FeatureSpec.id_transformation`). The values are converted to tilecore's frozen
specs and stacking plan (`tilecore.compat._native`) whenever work is done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..specs import DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
from ._optimizers import CallableTableInitializer, OptimizerSpec

_STACKING_ATTRIBUTES = frozenset(
    {"_stacked_table_spec", "_setting_in_stack", "stacked_table_spec", "setting_in_stack"}
)
_FDO_PARAMETERS = frozenset(
    {"max_ids_per_partition", "max_unique_ids_per_partition",
     "suggested_coo_buffer_size_per_device"}
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class QuantizationConfig:
    """Simulated quantization of looked-up rows: `num_buckets` levels in `[min_value, max_value]`."""

    min_value: float
    max_value: float
    num_buckets: int

    def __post_init__(self) -> None:
        if self.num_buckets < 2:
            raise ValueError(f"num_buckets must be ≥ 2, got num_buckets={self.num_buckets}.")
        if self.min_value >= self.max_value:
            raise ValueError(
                f"min_value must be < max_value, got min_value={self.min_value}, "
                f"max_value={self.max_value}."
            )

    def as_tuple(self) -> tuple[float, float, int]:
        return (self.min_value, self.max_value, self.num_buckets)


@dataclasses.dataclass(eq=True, frozen=True)
class FeatureIdTransformation:
    """How a feature's IDs and samples move into its stack.

    Attributes:
      row_offset: samples of the stack's earlier features (feature stacking).
      col_offset: `row_offset_in_shard · N` of the feature's table (table stacking).
      col_shift: the table's shard rotation.
    """

    row_offset: int = 0
    col_offset: int = 0
    col_shift: int = 0


@dataclasses.dataclass(eq=True, frozen=True, kw_only=True)
class TableSettingInStack:
    """A table's place in its stack: padded sizes, first row in each shard, shard rotation."""

    stack_name: str
    padded_vocab_size: int
    padded_embedding_dim: int
    row_offset_in_shard: int = 0
    shard_rotation: int = 0


@dataclasses.dataclass(eq=True, frozen=True, kw_only=True)
class StackedTableSpec:
    """One stack of tables: the unit that is preprocessed, looked up and updated.

    Attributes:
      stack_name: name of the stack (the table's name for a table alone).
      stack_vocab_size: Σ padded vocabularies (each a multiple of `8·N`).
      stack_embedding_dim: padded row width (a multiple of 8).
      optimizer / combiner: shared by every table of the stack.
      total_sample_count: Σ global batch sizes of the stack's features.
      max_ids_per_partition / max_unique_ids_per_partition: limits checked per
        (SparseCore, partition); update them with
        `embedding.update_preprocessing_parameters`.
      activation_mem_bytes_limit: the activation memory per SparseCore that
        `auto_stack_tables` kept the stack under (recorded; tilecore sizes nothing
        from it after stacking).
      suggested_coo_buffer_size_per_device: COO buffer size per device, or None
        for the theoretical maximum.
      quantization_config: optional simulated quantization.
    """

    stack_name: str
    stack_vocab_size: int
    stack_embedding_dim: int
    optimizer: OptimizerSpec
    combiner: str
    total_sample_count: int
    max_ids_per_partition: int = 256
    max_unique_ids_per_partition: int = 256
    activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
    suggested_coo_buffer_size_per_device: int | None = None
    quantization_config: QuantizationConfig | None = None

    def replace(self, **changes: Any) -> StackedTableSpec:
        """A copy with `changes` applied (as `flax.struct` dataclasses offer)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(eq=True, unsafe_hash=True, kw_only=True)
class TableSpec:
    """One embedding table (mutable until stacked, as in the reference).

    Attributes:
      name: unique table name.
      vocabulary_size: rows; valid IDs are `[0, vocabulary_size)`.
      embedding_dim: row width.
      initializer: `init(key, shape, dtype)` (e.g. from `jax.nn.initializers`).
      optimizer: an optimizer spec such as `SGDOptimizerSpec()`.
      combiner: `"sum"`, `"mean"` or `"sqrtn"`.
      max_ids_per_partition / max_unique_ids_per_partition: per-partition limits
        used when the table is stacked alone.
      suggested_coo_buffer_size_per_device: COO buffer size per device (None: the
        theoretical maximum).
      quantization_config: optional simulated quantization.

    Once stacked, only `stacked_table_spec` and `setting_in_stack` may change; use
    `embedding.update_preprocessing_parameters` to change limits.
    """

    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: CallableTableInitializer | None
    optimizer: OptimizerSpec
    combiner: str
    max_ids_per_partition: int = 256
    max_unique_ids_per_partition: int = 256
    suggested_coo_buffer_size_per_device: int | None = None
    quantization_config: QuantizationConfig | None = None

    _initialized: bool = dataclasses.field(init=False, default=False, compare=False)
    _stacked_table_spec: StackedTableSpec | None = dataclasses.field(default=None, compare=False)
    _setting_in_stack: TableSettingInStack | None = dataclasses.field(default=None, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if (name not in _STACKING_ATTRIBUTES and getattr(self, "_initialized", False)
                and self.is_stacked()):
            if name in _FDO_PARAMETERS:
                fix = ("use embedding.update_preprocessing_parameters() to update the "
                       "StackedTableSpec instead.")
            else:
                fix = ("create a new spec with dataclasses.replace(table_spec, ...) and "
                       "dataclasses.replace(feature_spec, table_spec=new_table_spec), then "
                       "prepare the feature specs for training again.")
            raise AttributeError(
                f"Cannot update parameter {name!r} on TableSpec {self.name!r} after it has "
                f"been stacked; {fix}"
            )
        super().__setattr__(name, value)

    def __post_init__(self) -> None:
        if self._setting_in_stack is None:
            self._setting_in_stack = TableSettingInStack(
                stack_name=self.name, padded_vocab_size=self.vocabulary_size,
                padded_embedding_dim=self.embedding_dim,
            )
        object.__setattr__(self, "_initialized", True)

    @property
    def setting_in_stack(self) -> TableSettingInStack:
        """This table's place in its stack."""
        assert self._setting_in_stack is not None
        return self._setting_in_stack

    @setting_in_stack.setter
    def setting_in_stack(self, setting_in_stack: TableSettingInStack) -> None:
        self._setting_in_stack = setting_in_stack

    @property
    def stacked_table_spec(self) -> StackedTableSpec:
        """The stack this table belongs to (set by stacking or preparation for training)."""
        assert self._stacked_table_spec is not None, f"Table {self.name} is not stacked."
        return self._stacked_table_spec

    @stacked_table_spec.setter
    def stacked_table_spec(self, stacked_table_spec: StackedTableSpec) -> None:
        self._stacked_table_spec = stacked_table_spec

    def is_stacked(self) -> bool:
        return self._stacked_table_spec is not None


@dataclasses.dataclass(eq=True, unsafe_hash=True, kw_only=True)
class FeatureSpec:
    """One input feature looked up in `table_spec`.

    Attributes:
      name: unique feature name.
      table_spec: the table its IDs index.
      input_shape: `[global_batch, valency]` (the valency may be left out for ragged input).
      output_shape: `[global_batch, embedding_dim]`.
    """

    name: str
    table_spec: TableSpec
    input_shape: Sequence[int]
    output_shape: Sequence[int]
    _id_transformation: FeatureIdTransformation | None = dataclasses.field(
        default=None, compare=False
    )

    @property
    def id_transformation(self) -> FeatureIdTransformation:
        """How this feature's IDs move into its stack (set by stacking; until then the
        identity: a feature alone in its table's own stack)."""
        if self._id_transformation is None:
            return FeatureIdTransformation()
        return self._id_transformation

    @id_transformation.setter
    def id_transformation(self, id_transformation: FeatureIdTransformation) -> None:
        self._id_transformation = id_transformation
