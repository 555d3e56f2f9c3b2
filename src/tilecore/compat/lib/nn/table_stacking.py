"""Reference-compatible table stacking (`jax_tpu_embedding.sparsecore.lib.nn.table_stacking`).

Like the reference, these functions fill the stacking information of the
FeatureSpecs they are given **in place** (`table_spec.stacked_table_spec`,
`table_spec.setting_in_stack`, `feature.id_transformation`). The stacking itself
is tilecore's (`tilecore.stacking`); only the bookkeeping lives here.

Results equal the reference's (v0.1.0) except that (as the reference's later
versions do) automatic grouping also separates tables with different
`quantization_config`, and a stack keeps its first table's `quantization_config`
instead of dropping it. Like the reference, `stack_tables` does not carry a
table's `suggested_coo_buffer_size_per_device` into its stack.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .... import stacking as native_stacking
from ....specs import DEFAULT_ACTIVATION_MEM_BYTES_LIMIT as DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
from ..._arrays import stack_and_shard_tables as stack_and_shard_tables
from ..._arrays import unshard_and_unstack_tables as unshard_and_unstack_tables
from ..._native import feature_leaves, native_features, record_stack, topology
from ..._proto_rows import get_row_ids_in_stacked_table as get_row_ids_in_stacked_table
from ..._proto_rows import get_row_ids_in_stacked_tables as get_row_ids_in_stacked_tables
from ..._proto_tables import compute_table_to_setting_in_stack as compute_table_to_setting_in_stack
from ..._proto_tables import stack_and_shard_feature_tables as stack_and_shard_feature_tables
from ..._proto_tables import (
    unstack_and_unshard_stacked_tables as unstack_and_unshard_stacked_tables,
)
from ..._pytree import leaves
from ..._specs import FeatureSpec
from ..._specs import StackedTableSpec as StackedTableSpec
from ..._specs import TableSpec as TableSpec

LimitsCallable = Callable[[str, int], int]
"""`(stack_name, total_sample_count) -> limit` for a multi-table stack."""

_log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ACTIVATION_MEM_BYTES_LIMIT",
    "LimitsCallable",
    "StackedTableSpec",
    "TableSpec",
    "auto_stack_tables",
    "compute_physical_row_ids",
    "compute_table_to_setting_in_stack",
    "get_default_limits",
    "get_row_ids_in_stacked_table",
    "get_row_ids_in_stacked_tables",
    "get_table_stacks",
    "round_up_dim_and_vocab_size",
    "stack_and_shard_feature_tables",
    "stack_and_shard_tables",
    "stack_tables",
    "unshard_and_unstack_tables",
    "unstack_and_unshard_stacked_tables",
]


def get_default_limits(name: str, batch_size: int) -> int:
    """The limit a multi-table stack gets unless told otherwise: always 256."""
    del name, batch_size
    return 256


def round_up_dim_and_vocab_size(
    tables: Mapping[str, TableSpec], num_sc: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Padded widths (multiples of 8) and vocabularies (multiples of `8·num_sc`) by table name."""
    dims = {name: native_stacking.round_up(int(t.embedding_dim), 8) for name, t in tables.items()}
    vocabs = {
        name: native_stacking.round_up(int(t.vocabulary_size), 8 * num_sc)
        for name, t in tables.items()
    }
    return dims, vocabs


def compute_physical_row_ids(
    num_sparse_cores: int,
    stack_vocab_size: int,
    shard_rotation: int,
    row_offset_in_shard: int,
    row_ids: Any,
) -> Any:
    """Rows in the stacked `[stack_vocab_size, dim]` array of a table's logical `row_ids`.

    ID `i` lives in shard `(i mod N + shard_rotation) mod N`, at row
    `row_offset_in_shard + i div N` of that shard's `stack_vocab_size / N` rows.
    Works on ints and numpy arrays alike.
    """
    n = num_sparse_cores
    shard = (row_ids % n + shard_rotation) % n
    return shard * (stack_vocab_size // n) + row_ids // n + row_offset_in_shard


def get_table_stacks(table_specs: Any) -> dict[str, list[TableSpec]]:
    """Stack name → the tables stacked in it (a table not yet stacked is its own stack)."""
    stacks: dict[str, list[TableSpec]] = collections.defaultdict(list)
    for table in leaves(table_specs):
        name = table.stacked_table_spec.stack_name if table.is_stacked() else table.name
        stacks[name].append(table)
    return stacks


def _check_group(
    stack_name: str, table_names: Sequence[str], features: Sequence[FeatureSpec]
) -> dict[str, TableSpec]:
    tables = {f.table_spec.name: f.table_spec for f in features}
    unknown = [t for t in table_names if t not in tables]
    if unknown:
        raise ValueError(
            f"Cannot stack {list(table_names)} as {stack_name!r}: no feature uses table(s) "
            f"{unknown}; known tables: {sorted(tables)}."
        )
    for name, count in collections.Counter(table_names).items():
        if count > 1:
            raise ValueError(f"Table {name} is repeated in group {stack_name}.")
    for name in table_names:
        setting = tables[name].setting_in_stack
        if setting.stack_name != name:
            raise ValueError(f"Table {name} is already stacked in group {setting.stack_name}.")
    for feature in features:
        setting = feature.table_spec.setting_in_stack
        if setting.stack_name != feature.table_spec.name and setting.stack_name == stack_name:
            raise ValueError(f"Cannot use stack name {stack_name} since it's already used.")
    return tables


def stack_tables(
    features: Any,
    table_names: Sequence[str],
    global_device_count: int,
    num_sc_per_device: int,
    rotation: int | None = None,
    stack_to_max_ids_per_partition: LimitsCallable = get_default_limits,
    stack_to_max_unique_ids_per_partition: LimitsCallable = get_default_limits,
    stack_name: str | None = None,
    fail_on_excess_padding: bool = False,
    *,
    activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
) -> None:
    """Stack the tables `table_names` (in this order) into one stack, updating `features` in place.

    Features of these tables get consecutive row offsets in pytree-leaf order;
    table k gets shard rotation `k·rotation mod N` (`rotation` defaults to
    `num_sc_per_device`). A multi-table stack takes its limits from
    `stack_to_max_ids_per_partition(stack_name, total_sample_count)` (and the
    unique variant); a single table keeps its own limits. `activation_mem_bytes_limit`
    is recorded on the `StackedTableSpec`.
    """
    table_names = list(table_names)
    if not stack_name:
        stack_name = native_stacking.stack_name_for(table_names, short=True)
    specs = feature_leaves(features)
    tables = _check_group(stack_name, table_names, specs)
    topo = topology(global_device_count, num_sc_per_device)
    dims, _ = round_up_dim_and_vocab_size({t: tables[t] for t in table_names}, 1)
    if len(set(dims.values())) > 1 and not fail_on_excess_padding:
        _log.warning(
            "Excess padding in stack %s: tables %s pad to widths %s; every row is padded to %d. "
            "Stack tables of equal padded width to save memory.",
            stack_name, table_names, dims, max(dims.values()),
        )
    members = [f for f in specs if f.table_spec.name in table_names]

    def limits(name: str, samples: int) -> tuple[int, int]:
        return (stack_to_max_ids_per_partition(name, samples),
                stack_to_max_unique_ids_per_partition(name, samples))

    plan = native_stacking.stack_tables(
        native_features(members), topo, [table_names], stack_names=[stack_name],
        rotation=rotation, stack_limits=limits, fail_on_excess_padding=fail_on_excess_padding,
    )
    # As in the reference, stack_tables does not carry a table's suggested COO size.
    record_stack(specs, plan, stack_name, keep_suggested_coo_buffer_size=False,
                 activation_mem_bytes_limit=activation_mem_bytes_limit)


def auto_stack_tables(
    features: Any,
    global_device_count: int,
    num_sc_per_device: int,
    rotation: int | None = None,
    stack_to_max_ids_per_partition: LimitsCallable = get_default_limits,
    stack_to_max_unique_ids_per_partition: LimitsCallable = get_default_limits,
    *,
    use_short_stack_names: bool = True,
    activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
) -> None:
    """Stack every group of compatible tables, updating `features` in place.

    Tables are grouped by (padded width, optimizer, combiner, quantization) in
    order of first appearance among the pytree leaves, and each group is split
    first-fit so its activations per SparseCore stay within
    `activation_mem_bytes_limit` (tilecore's `auto_groups`). Each group is then
    stacked with `stack_tables`.
    """
    specs = feature_leaves(features)
    groups = native_stacking.auto_groups(
        native_features(specs), topology(global_device_count, num_sc_per_device),
        activation_mem_bytes_limit,
    )
    for group in groups:
        stack_tables(
            features, group, global_device_count, num_sc_per_device, rotation=rotation,
            stack_to_max_ids_per_partition=stack_to_max_ids_per_partition,
            stack_to_max_unique_ids_per_partition=stack_to_max_unique_ids_per_partition,
            stack_name=native_stacking.stack_name_for(group, short=use_short_stack_names),
            fail_on_excess_padding=False, activation_mem_bytes_limit=activation_mem_bytes_limit,
        )
