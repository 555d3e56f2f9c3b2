"""The stacking plan: where every table and feature sits in which stack.

A plan is a value computed from the user's specs; it never changes them. Host
preprocessing, device ops and checkpoints all read their layout from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from ..specs import FeatureSpec, OptimizerSpec, QuantizationConfig, SparseCoreConfig, TableSpec
from ..specs import Topology as Topology
from ..specs._weights_dtype import FLOAT32
from ._checks import check_limit, check_plan


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= `value`."""
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSetting:
    """A table's place in its stack (the reference's `TableSettingInStack`)."""

    stack_name: str
    padded_vocab_size: int
    padded_embedding_dim: int
    row_offset_in_shard: int
    shard_rotation: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSetting:
    """A feature's place in its stack and its ID transform.

    `col = ((id + col_shift) mod N) + (id − id mod N) + col_offset`; the partition
    is `col mod N` and the row inside that partition's shard is `col div N`.
    """

    stack_name: str
    row_offset: int
    col_offset: int
    col_shift: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackSpec:
    """One stacked table: the unit that is preprocessed, looked up and updated.

    `vocab_size` and `embedding_dim` are the stacked (padded) sizes; the limits are
    the ones checked against every (SparseCore, partition) pair of this stack.
    `weights_dtype` is the storage format of the stacked table (its tables' own:
    tables of different formats are never stacked together).
    """

    name: str
    vocab_size: int
    embedding_dim: int
    optimizer: OptimizerSpec
    combiner: str
    quantization: QuantizationConfig | None
    total_sample_count: int
    max_ids_per_partition: int
    max_unique_ids_per_partition: int
    suggested_coo_buffer_size_per_device: int | None
    table_names: tuple[str, ...]
    feature_names: tuple[str, ...]
    """Features in row-offset order: the order their samples follow on each SparseCore."""
    weights_dtype: np.dtype = FLOAT32


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackingPlan:
    """Stacks, table settings and feature settings for one topology."""

    topology: Topology
    config: SparseCoreConfig
    features: Mapping[str, FeatureSpec]
    tables: Mapping[str, TableSpec]
    stacks: Mapping[str, StackSpec]
    table_settings: Mapping[str, TableSetting]
    feature_settings: Mapping[str, FeatureSetting]

    def __post_init__(self) -> None:
        check_plan(self)

    @property
    def num_partitions(self) -> int:
        return self.topology.num_partitions

    def stack_features(self, stack: str) -> tuple[FeatureSpec, ...]:
        """The stack's features in row-offset order."""
        return tuple(self.features[name] for name in self.stacks[stack].feature_names)

    def with_config(self, **changes: object) -> StackingPlan:
        """A copy whose `SparseCoreConfig` has `changes` applied (e.g. allow_id_dropping)."""
        stacking_fields = {"disable_table_stacking", "max_ids_per_table",
                           "max_unique_ids_per_table", "activation_mem_bytes_limit"}
        if stacking_fields & changes.keys():
            raise ValueError(
                f"with_config cannot change {sorted(stacking_fields & changes.keys())}: they "
                "shape the stacks. Build a new plan with plan_stacking(features, topology, config)."
            )
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))  # type: ignore[arg-type]

    def with_stack_limits(
        self,
        stack: str,
        *,
        max_ids_per_partition: int | None = None,
        max_unique_ids_per_partition: int | None = None,
        suggested_coo_buffer_size_per_device: int | None = None,
    ) -> StackingPlan:
        """A copy with one stack's limits replaced (None keeps the current value)."""
        if stack not in self.stacks:
            raise KeyError(f"Unknown stack {stack!r}; the plan has {sorted(self.stacks)}.")
        changes = {
            "max_ids_per_partition": max_ids_per_partition,
            "max_unique_ids_per_partition": max_unique_ids_per_partition,
            "suggested_coo_buffer_size_per_device": suggested_coo_buffer_size_per_device,
        }
        for field, value in changes.items():
            if value is not None:
                check_limit(stack, field, value)
        new = dataclasses.replace(
            self.stacks[stack], **{k: int(v) for k, v in changes.items() if v is not None})
        return dataclasses.replace(self, stacks={**self.stacks, stack: new})
