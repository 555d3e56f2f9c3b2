"""Building one stack from an ordered group of tables and their features."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..specs import FeatureSpec, TableSpec, Topology
from ._checks import check_stack_limits
from ._plan import FeatureSetting, StackSpec, TableSetting, round_up

LimitsForStack = Callable[[str, int], tuple[int, int]]
"""The limits a stack gets when it is built: `(stack_name, total_sample_count) ->
(max_ids_per_partition, max_unique_ids_per_partition)` (the tuned limits of a built
stack are `tilecore.fdo.StackLimits`)."""

MAX_STACK_NAME_LENGTH = 50


def padded_dim(table: TableSpec) -> int:
    """Row width on the device: a multiple of 8 floats (32 bytes)."""
    return round_up(table.embedding_dim, 8)


def padded_vocab(table: TableSpec, topology: Topology) -> int:
    """Rows on the device: a multiple of 8 per partition."""
    return round_up(table.vocab_size, 8 * topology.num_partitions)


def stack_name_for(table_names: Sequence[str], *, short: bool = True) -> str:
    """`a_b_c`; with `short`, names over 50 characters become `prefix...hash`."""
    name = "_".join(table_names)
    if short and len(name) > MAX_STACK_NAME_LENGTH:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = f"{name[:MAX_STACK_NAME_LENGTH]}...{digest}"
    return name


def summed_table_limits(tables: Sequence[TableSpec]) -> tuple[int, int, int | None]:
    """Limits of a multi-table stack: each partition may receive every member's share."""
    suggested = [t.suggested_coo_buffer_size_per_device for t in tables]
    return (
        sum(t.max_ids_per_partition for t in tables),
        sum(t.max_unique_ids_per_partition for t in tables),
        None if None in suggested else sum(s for s in suggested if s is not None),
    )


def place_tables(
    name: str, padded_vocabs: Mapping[str, int], stack_dim: int, num_partitions: int,
    rotation: int,
) -> dict[str, TableSetting]:
    """Settings of the tables of stack `name`, stacked in `padded_vocabs` order.

    Table k gets rotation `k·rotation mod N` and starts, in every shard, after the
    `padded_vocab / N` rows of each of tables 0..k−1.
    """
    settings: dict[str, TableSetting] = {}
    offset = 0
    for k, (table, vocab) in enumerate(padded_vocabs.items()):
        settings[table] = TableSetting(
            stack_name=name, padded_vocab_size=vocab, padded_embedding_dim=stack_dim,
            row_offset_in_shard=offset, shard_rotation=(k * rotation) % num_partitions,
        )
        offset += vocab // num_partitions
    return settings


def check_stackable(name: str, tables: Sequence[TableSpec], fail_on_excess_padding: bool
                     ) -> None:
    """Raise unless `tables` can share one stack: one optimizer, combiner, quantization and
    storage format (and, with `fail_on_excess_padding`, one padded width)."""
    first = tables[0]
    for table in tables[1:]:
        if table.optimizer != first.optimizer or table.combiner != first.combiner:
            raise ValueError(
                f"Cannot stack table {table.name!r} with {first.name!r}: optimizer and combiner "
                f"must match, got ({table.optimizer}, {table.combiner!r}) vs "
                f"({first.optimizer}, {first.combiner!r})."
            )
        if table.quantization != first.quantization:
            raise ValueError(
                f"Cannot stack table {table.name!r} with {first.name!r}: quantization differs."
            )
        if table.weights_dtype != first.weights_dtype:
            raise ValueError(
                f"Cannot stack table {table.name!r} with {first.name!r}: weights_dtype differs "
                f"({table.weights_dtype.name} vs {first.weights_dtype.name}); a stacked table has "
                "one storage format. Stack them separately, or give them the same weights_dtype."
            )
    dims = {padded_dim(t) for t in tables}
    if len(dims) > 1 and fail_on_excess_padding:
        raise ValueError(
            f"Stack {name!r}: tables pad to different widths "
            f"{ {t.name: padded_dim(t) for t in tables} }; stacking them pads every row to "
            f"{max(dims)}. Group tables of equal padded width, or pass fail_on_excess_padding=False."
        )


def derived_fields(tables: Sequence[TableSpec], features: Sequence[FeatureSpec] | None,
                   topology: Topology) -> dict[str, Any]:
    """The `StackSpec` fields a stack of `tables` (stackable, in this order) with
    `features` derives from them: everything but its name, members and limits
    (`total_sample_count` left out when `features` is None)."""
    first = tables[0]
    fields: dict[str, Any] = {
        "vocab_size": sum(padded_vocab(t, topology) for t in tables),
        "embedding_dim": max(padded_dim(t) for t in tables),
        "optimizer": first.optimizer, "combiner": first.combiner,
        "quantization": first.quantization, "weights_dtype": first.weights_dtype,
    }
    if features is not None:
        fields["total_sample_count"] = sum(f.batch_size for f in features)
    return fields


def _stack_limits(name: str, tables: Sequence[TableSpec], topology: Topology, samples: int,
                  stack_limits: LimitsForStack | None) -> tuple[int, int, int | None]:
    """(max IDs, max unique IDs, suggested buffer size) of a stack of `tables` with `samples`
    samples: a single table's own, else `stack_limits(name, samples)`, else the sums of
    the tables' limits (the buffer size never past what those limits can fill)."""
    first = tables[0]
    if len(tables) == 1:
        return (first.max_ids_per_partition, first.max_unique_ids_per_partition,
                first.suggested_coo_buffer_size_per_device)
    if stack_limits is not None:
        max_ids, max_unique = check_stack_limits(name, samples, stack_limits(name, samples))
        return max_ids, max_unique, None
    max_ids, max_unique, suggested = summed_table_limits(tables)
    if suggested is not None:
        theoretical = round_up(max_ids, 8) * topology.sc_per_device * topology.num_partitions
        suggested = min(suggested, theoretical)
    return max_ids, max_unique, suggested


def build_stack(
    name: str,
    tables: Sequence[TableSpec],
    features_by_table: Mapping[str, Sequence[FeatureSpec]],
    feature_order: Sequence[str],
    topology: Topology,
    *,
    rotation: int | None = None,
    stack_limits: LimitsForStack | None = None,
    fail_on_excess_padding: bool = False,
) -> tuple[StackSpec, dict[str, TableSetting], dict[str, FeatureSetting]]:
    """Stack `tables` (in this order) with their features placed in `feature_order`.

    Table k gets rotation `k·rotation mod N` and starts, in every shard, after the
    padded rows of tables 0..k−1. Features get consecutive row offsets in
    `feature_order`. A single table keeps its own limits; several tables take
    `stack_limits(name, samples)` or, by default, the sums of their limits.
    """
    check_stackable(name, tables, fail_on_excess_padding)
    n = topology.num_partitions
    rotation = topology.sc_per_device if rotation is None else rotation
    stack_dim = max(padded_dim(t) for t in tables)

    table_settings = place_tables(
        name, {t.name: padded_vocab(t, topology) for t in tables}, stack_dim, n, rotation
    )

    by_name = {f.name: (table.name, f) for table in tables for f in features_by_table[table.name]}
    feature_settings: dict[str, FeatureSetting] = {}
    row_offset = 0
    ordered = [f for f in feature_order if f in by_name]
    for feature_name in ordered:
        table_name, feature = by_name[feature_name]
        setting = table_settings[table_name]
        feature_settings[feature_name] = FeatureSetting(
            stack_name=name, row_offset=row_offset,
            col_offset=setting.row_offset_in_shard * n, col_shift=setting.shard_rotation,
        )
        row_offset += feature.batch_size

    max_ids, max_unique, suggested = _stack_limits(name, tables, topology, row_offset,
                                                   stack_limits)
    stack = StackSpec(
        name=name, **derived_fields(tables, [by_name[f][1] for f in ordered], topology),
        max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique,
        suggested_coo_buffer_size_per_device=suggested,
        table_names=tuple(t.name for t in tables), feature_names=tuple(ordered),
    )
    return stack, table_settings, feature_settings
