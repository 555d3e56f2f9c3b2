"""Stacking strategies: automatic grouping, explicit groups, or none."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ..specs import (
    DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
    FeatureSpec,
    SparseCoreConfig,
    TableSpec,
    Topology,
)
from ._build import LimitsForStack, build_stack, padded_dim, stack_name_for
from ._plan import FeatureSetting, StackingPlan, StackSpec, TableSetting

Features = Sequence[FeatureSpec] | Mapping[str, FeatureSpec]


def ordered_features(features: Features) -> list[FeatureSpec]:
    """Features in pytree-leaf order (a mapping's keys sorted), validated unique."""
    if isinstance(features, FeatureSpec):
        features = [features]
    if isinstance(features, Mapping):
        items = [features[k] for k in sorted(features)]
    else:
        items = list(features)
    if not items:
        raise ValueError("No features given: pass at least one FeatureSpec.")
    seen_features: set[str] = set()
    seen_tables: dict[str, FeatureSpec] = {}
    for feature in items:
        if not isinstance(feature, FeatureSpec):
            raise TypeError(f"Expected FeatureSpec values, got {type(feature).__name__}.")
        if feature.name in seen_features:
            raise ValueError(f"Feature name {feature.name!r} appears twice; names must be unique.")
        seen_features.add(feature.name)
        first = seen_tables.setdefault(feature.table.name, feature)
        if first.table != feature.table:
            raise ValueError(
                f"Two different tables are named {feature.table.name!r}: feature "
                f"{first.name!r} uses one, feature {feature.name!r} another "
                f"({_table_differences(first.table, feature.table)}). A table name picks one "
                "table everywhere (its rows, its ID range, its checkpoint entry); give each "
                "TableSpec a unique name, or let the features share one TableSpec."
            )
    return items


def _table_differences(a: TableSpec, b: TableSpec) -> str:
    """`field a vs b` for each field in which two same-named tables differ."""
    return ", ".join(
        f"{field.name} {getattr(a, field.name)!r} vs {getattr(b, field.name)!r}"
        for field in dataclasses.fields(a) if getattr(a, field.name) != getattr(b, field.name)
    )


def _tables_in_order(features: Sequence[FeatureSpec]) -> dict[str, TableSpec]:
    tables: dict[str, TableSpec] = {}
    for feature in features:
        tables.setdefault(feature.table.name, feature.table)
    return tables


def _features_by_table(features: Sequence[FeatureSpec]) -> dict[str, list[FeatureSpec]]:
    grouped: dict[str, list[FeatureSpec]] = {}
    for feature in features:
        grouped.setdefault(feature.table.name, []).append(feature)
    return grouped


def _assemble(
    features: Sequence[FeatureSpec],
    topology: Topology,
    config: SparseCoreConfig,
    groups: Sequence[Sequence[str]],
    names: Sequence[str],
    **stack_options: object,
) -> StackingPlan:
    """A plan with one stack per group; every other table stacks only its features."""
    tables = _tables_in_order(features)
    by_table = _features_by_table(features)
    leaf_order = [f.name for f in features]
    stacks: dict[str, StackSpec] = {}
    table_settings: dict[str, TableSetting] = {}
    feature_settings: dict[str, FeatureSetting] = {}

    def add(name: str, members: list[TableSpec], order: Sequence[str], **options: object) -> None:
        if name in stacks:
            raise ValueError(f"Stack name {name!r} is used twice; choose distinct stack names.")
        stack, t_settings, f_settings = build_stack(
            name, members, by_table, order, topology, **options  # type: ignore[arg-type]
        )
        stacks[name] = stack
        table_settings.update(t_settings)
        feature_settings.update(f_settings)

    grouped: set[str] = set()
    for name, group in zip(names, groups, strict=True):
        add(name, [tables[t] for t in group], leaf_order, **stack_options)
        grouped.update(group)
    for table_name, table in tables.items():
        if table_name not in grouped:
            # Features sharing a table alone are placed in name order (as the reference does).
            add(table_name, [table], sorted(f.name for f in by_table[table_name]))
    return StackingPlan(
        topology=topology, config=config, features={f.name: f for f in features},
        tables=tables, stacks=stacks, table_settings=table_settings,
        feature_settings=feature_settings,
    )


def _check_groups(groups: Sequence[Sequence[str]], tables: Mapping[str, TableSpec]) -> None:
    seen: set[str] = set()
    for group in groups:
        if not group:
            raise ValueError("A stacking group is empty; list at least one table per group.")
        for name in group:
            if name not in tables:
                raise ValueError(
                    f"Stacking group names table {name!r}, which no feature uses; "
                    f"known tables: {sorted(tables)}."
                )
            if name in seen:
                raise ValueError(f"Table {name!r} is in two stacking groups.")
            seen.add(name)


def stack_tables(
    features: Features,
    topology: Topology,
    groups: Sequence[Sequence[str]] = (),
    *,
    stack_names: Sequence[str] | None = None,
    rotation: int | None = None,
    stack_limits: LimitsForStack | None = None,
    fail_on_excess_padding: bool = False,
    use_short_stack_names: bool = True,
    config: SparseCoreConfig | None = None,
) -> StackingPlan:
    """Stack each group of tables (in the given order); other tables stay alone.

    With no groups this is feature stacking only: features sharing a table are
    stacked, every table is its own stack.
    """
    ordered = ordered_features(features)
    tables = _tables_in_order(ordered)
    groups = [list(g) for g in groups]
    _check_groups(groups, tables)
    if stack_names is None:
        names = [stack_name_for(g, short=use_short_stack_names) for g in groups]
    elif len(stack_names) != len(groups):
        raise ValueError(f"Got {len(stack_names)} stack_names for {len(groups)} groups.")
    else:
        names = list(stack_names)
    return _assemble(
        ordered, topology, config or SparseCoreConfig(), groups, names, rotation=rotation,
        stack_limits=stack_limits, fail_on_excess_padding=fail_on_excess_padding,
    )


def auto_groups(
    features: Sequence[FeatureSpec], topology: Topology, activation_mem_bytes_limit: int
) -> list[list[str]]:
    """Tables grouped by (padded dim, optimizer, combiner, quantization, weights dtype),
    split first-fit.

    A table joins the first group of its kind whose stacked activations per
    SparseCore stay within `activation_mem_bytes_limit`.
    """
    tables = _tables_in_order(features)
    by_table = _features_by_table(features)
    n = topology.num_partitions
    kinds: dict[tuple[object, ...], list[tuple[list[str], int]]] = {}
    for name, table in tables.items():
        key = (padded_dim(table), table.optimizer, table.combiner, table.quantization,
               table.weights_dtype)
        mem = padded_dim(table) * sum(f.batch_size // n for f in by_table[name]) * 4
        bins = kinds.setdefault(key, [])
        for members_and_mem in bins:
            members, used = members_and_mem
            if used + mem <= activation_mem_bytes_limit:
                members.append(name)
                bins[bins.index(members_and_mem)] = (members, used + mem)
                break
        else:
            bins.append(([name], mem))
    return [members for bins in kinds.values() for members, _ in bins]


def auto_stack_tables(
    features: Features,
    topology: Topology,
    *,
    rotation: int | None = None,
    activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
    stack_limits: LimitsForStack | None = None,
    use_short_stack_names: bool = True,
    config: SparseCoreConfig | None = None,
) -> StackingPlan:
    """Stack every group of compatible tables (see `auto_groups`)."""
    ordered = ordered_features(features)
    groups = auto_groups(ordered, topology, activation_mem_bytes_limit)
    return stack_tables(
        ordered, topology, groups, rotation=rotation, stack_limits=stack_limits,
        use_short_stack_names=use_short_stack_names, config=config,
    )


def _apply_table_budgets(
    features: list[FeatureSpec], topology: Topology, config: SparseCoreConfig
) -> list[FeatureSpec]:
    """Features re-pointed at tables whose limits come from per-table budgets."""
    budgets_ids = dict(config.max_ids_per_table or {})
    budgets_unique = dict(config.max_unique_ids_per_table or {})
    known = _tables_in_order(features)
    for name in {*budgets_ids, *budgets_unique} - known.keys():
        raise ValueError(f"SparseCoreConfig names table {name!r}, which no feature uses.")
    n = topology.num_partitions
    new_tables = {
        name: table.with_limits(
            max_ids_per_partition=math.ceil(budgets_ids[name] / n) if name in budgets_ids else None,
            max_unique_ids_per_partition=(
                math.ceil(budgets_unique[name] / n) if name in budgets_unique else None
            ),
        )
        for name, table in known.items()
    }
    return [dataclasses.replace(f, table=new_tables[f.table.name]) for f in features]


def plan_stacking(
    features: Features, topology: Topology, config: SparseCoreConfig | None = None
) -> StackingPlan:
    """The stacking plan that `config` asks for: automatic unless stacking is disabled."""
    if not isinstance(topology, Topology):
        raise TypeError(f"plan_stacking: topology must be a tilecore.Topology, got {topology!r}.")
    if config is not None and not isinstance(config, SparseCoreConfig):
        raise TypeError("plan_stacking: config must be a tilecore.SparseCoreConfig or None, got "
                        f"{config!r}.")
    config = config or SparseCoreConfig()
    ordered = _apply_table_budgets(ordered_features(features), topology, config)
    if config.disable_table_stacking:
        return stack_tables(ordered, topology, config=config)
    return auto_stack_tables(
        ordered, topology, activation_mem_bytes_limit=config.activation_mem_bytes_limit,
        config=config,
    )
