"""Between the reference-style shells and tilecore's frozen specs and stacking plan.

`native_features` turns compat specs into native ones; `record_stack` writes a
native stack back into the compat specs (the reference's in-place habit); and
`build_plan` rebuilds a native `StackingPlan` from what the compat specs record,
so preprocessing follows whatever stacking the user's in-place calls did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from .. import specs as native
from ..stacking import FeatureSetting, StackingPlan, StackSpec, TableSetting, ordered_features
from ._fields import compat_kwargs, native_kwargs
from ._integers import whole
from ._optimizers import native_optimizer
from ._pytree import leaves
from ._specs import (
    FeatureIdTransformation,
    FeatureSpec,
    QuantizationConfig,
    StackedTableSpec,
    TableSettingInStack,
    TableSpec,
)

DEFAULT_NUM_SC_PER_DEVICE = 4
"""tilecore's default logical SparseCores per device (the TPU v5p figure)."""


def resolve_num_sc_per_device(num_sc_per_device: int | None) -> int:
    """`num_sc_per_device`, or tilecore's default of 4 when None.

    The reference asks the TPU runtime when None; tilecore's SparseCores are
    logical shards, so the default is fixed (any power of two ≥ 1 is accepted).
    """
    return DEFAULT_NUM_SC_PER_DEVICE if num_sc_per_device is None else num_sc_per_device


def topology(
    global_devices: int, sc_per_device: int | None, local_devices: int | None = None
) -> native.Topology:
    return native.Topology(
        global_devices=global_devices, sc_per_device=resolve_num_sc_per_device(sc_per_device),
        local_devices=local_devices,
    )


def feature_leaves(feature_specs: Any) -> list[FeatureSpec]:
    """The distinct FeatureSpecs of a pytree, in leaf order, checked for type and names.

    As in the reference, a collection may hold the same feature twice (e.g. one spec
    under two keys): equal specs are one feature. Two *different* specs with one
    name are an error. A `table_spec` that is no TableSpec (e.g. the table's name)
    raises AttributeError, the type the reference raises for it, with a clear message.
    """
    specs: list[FeatureSpec] = []
    seen: dict[str, FeatureSpec] = {}
    for spec in leaves(feature_specs):
        if not isinstance(spec, FeatureSpec):
            raise TypeError(
                "feature_specs must hold tilecore.compat.embedding_spec.FeatureSpec values, got "
                f"{type(spec).__name__}. Build the specs with tilecore.compat.embedding_spec."
            )
        if not isinstance(spec.table_spec, TableSpec):
            raise AttributeError(  # the reference's type for this mistake; a clear message
                f"FeatureSpec {spec.name!r}: table_spec must be an embedding_spec.TableSpec, "
                f"got {type(spec.table_spec).__name__} {spec.table_spec!r}. Pass the TableSpec "
                "object itself, not its name."
            )
        known = seen.get(spec.name)
        if known is None:
            seen[spec.name] = spec
            specs.append(spec)
        elif known is not spec and known != spec:
            raise ValueError(
                f"Two different feature specs are named {spec.name!r}: {known} and {spec}. "
                "Feature names must be unique; rename one."
            )
    return specs




def _native_quantization(config: Any) -> native.QuantizationConfig | None:
    if config is None:
        return None
    return native.QuantizationConfig(**native_kwargs(native.QuantizationConfig, config, {
        "min_value": float, "max_value": float, "num_buckets": int}))


def _compat_quantization(config: native.QuantizationConfig | None) -> QuantizationConfig | None:
    if config is None:
        return None
    return QuantizationConfig(**compat_kwargs(native.QuantizationConfig, config))


def native_table(table: TableSpec) -> native.TableSpec:
    """The frozen native spec of a compat table (its fields named by `_fields.RENAMED`).

    Sizes and limits must be integers (`_integers.whole`): a float is refused, as
    the reference refuses it, rather than truncated.
    """
    owner = f"TableSpec {table.name!r}"

    def integer(field: str) -> Any:
        return lambda value: whole(owner, field, value)

    def optional(field: str) -> Any:
        return lambda value: None if value is None else whole(owner, field, value)

    return native.TableSpec(**native_kwargs(native.TableSpec, table, {
        "vocab_size": integer("vocabulary_size"), "embedding_dim": integer("embedding_dim"),
        "optimizer": lambda opt: native_optimizer(table.name, opt),
        "max_ids_per_partition": integer("max_ids_per_partition"),
        "max_unique_ids_per_partition": integer("max_unique_ids_per_partition"),
        "suggested_coo_buffer_size_per_device": optional("suggested_coo_buffer_size_per_device"),
        "quantization": _native_quantization,
    }))


def native_features(features: Iterable[FeatureSpec]) -> list[native.FeatureSpec]:
    """Native features (and tables) for compat features, in the same order.

    The native output shape always ends in the table's width: host-side work only
    reads the batch dimensions, and the reference allows a narrower activation.
    Equal tables (one spec, or equal specs under one name) share one native
    table; a *different* table under a known name is converted on its own, so
    that stacking (`tilecore.stacking.ordered_features`) refuses the clash rather
    than every feature silently taking the first table's sizes.
    """
    tables: dict[str, tuple[TableSpec, native.TableSpec]] = {}
    out = []
    for feature in features:
        table = feature.table_spec
        known = tables.get(table.name)
        if known is None:
            known = tables[table.name] = (table, native_table(table))
        nt = known[1] if known[0] is table or known[0] == table else native_table(table)

        def output_shape(shape: Any, width: int = nt.embedding_dim) -> tuple[int, ...]:
            return (*(int(d) for d in list(shape)[:-1]), width)

        out.append(native.FeatureSpec(**native_kwargs(native.FeatureSpec, feature, {
            "table": lambda _, nt=nt: nt,
            "input_shape": lambda shape: tuple(int(d) for d in shape),
            "output_shape": output_shape,
        })))
    return out


def record_stack(
    features: Sequence[FeatureSpec],
    plan: StackingPlan,
    stack_name: str,
    *,
    keep_suggested_coo_buffer_size: bool,
    activation_mem_bytes_limit: int = native.DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
) -> None:
    """Write stack `stack_name` of a native plan into the compat specs of its features."""
    stack = plan.stacks[stack_name]
    first = next(f.table_spec for f in features if f.table_spec.name in stack.table_names)
    fields = compat_kwargs(StackSpec, stack, {"quantization": _compat_quantization})
    # The optimizer shell is the user's own (native specs hold the frozen conversion).
    fields["optimizer"] = first.optimizer
    if not keep_suggested_coo_buffer_size:
        fields["suggested_coo_buffer_size_per_device"] = None
    stacked = StackedTableSpec(**fields, activation_mem_bytes_limit=activation_mem_bytes_limit)
    for feature in features:
        if feature.name not in stack.feature_names:
            continue
        table = feature.table_spec
        table.setting_in_stack = TableSettingInStack(
            **dataclasses.asdict(plan.table_settings[table.name])
        )
        table.stacked_table_spec = stacked
        setting = plan.feature_settings[feature.name]
        feature.id_transformation = FeatureIdTransformation(
            row_offset=setting.row_offset, col_offset=setting.col_offset,
            col_shift=setting.col_shift,
        )


def stack_of(feature: FeatureSpec) -> StackedTableSpec:
    """The stacked spec a prepared feature's table belongs to (a clear error if unprepared)."""
    table = feature.table_spec
    if not table.is_stacked():
        raise ValueError(
            f"Feature {feature.name!r} (table {table.name!r}) has no stacking information. "
            "Call embedding.prepare_feature_specs_for_training(feature_specs, "
            "global_device_count, num_sc_per_device) first (after any auto_stack_tables)."
        )
    return table.stacked_table_spec


def _native_stack(
    stacked: StackedTableSpec, members: list[FeatureSpec], n: int
) -> StackSpec:
    tables = {f.table_spec.name: f.table_spec for f in members}
    for feature in members:
        setting = feature.table_spec.setting_in_stack
        if setting.stack_name != stacked.stack_name:
            raise ValueError(
                f"Table {feature.table_spec.name!r}: setting_in_stack names stack "
                f"{setting.stack_name!r} but its stacked_table_spec is {stacked.stack_name!r}."
            )
        if feature.id_transformation.col_offset != setting.row_offset_in_shard * n:
            raise ValueError(
                f"Feature {feature.name!r} was stacked for another number of SparseCores: its "
                f"col_offset={feature.id_transformation.col_offset} is not row_offset_in_shard="
                f"{setting.row_offset_in_shard} × N={n}. Stack the specs again for this topology."
            )
    if stacked.stack_vocab_size % n:
        raise ValueError(
            f"Stack {stacked.stack_name!r}: stack_vocab_size={stacked.stack_vocab_size} does not "
            f"split over N={n} SparseCores; it was stacked for another topology. Stack again."
        )
    return StackSpec(
        **native_kwargs(StackSpec, stacked, {
            "optimizer": lambda opt: native_optimizer(stacked.stack_name, opt),
            "quantization": _native_quantization,
        }),
        table_names=tuple(sorted(tables, key=lambda t: tables[t].setting_in_stack.row_offset_in_shard)),
        feature_names=tuple(
            f.name for f in sorted(members, key=lambda f: f.id_transformation.row_offset)
        ),
    )


def build_plan(
    feature_specs: Any,
    *,
    global_devices: int,
    sc_per_device: int | None,
    local_devices: int | None = None,
    allow_id_dropping: bool = False,
    enable_minibatching: bool = False,
) -> StackingPlan:
    """The native plan that the stacking recorded on the compat specs describes."""
    specs = feature_leaves(feature_specs)
    topo = topology(global_devices, sc_per_device, local_devices)
    members: dict[str, tuple[StackedTableSpec, list[FeatureSpec]]] = {}
    for feature in specs:
        stacked = stack_of(feature)
        known = members.setdefault(stacked.stack_name, (stacked, []))
        if known[0] != stacked:
            raise ValueError(
                f"Stack {stacked.stack_name!r} has two different StackedTableSpecs (features "
                f"{known[1][0].name!r} and {feature.name!r}); update stacks only through "
                "embedding.update_preprocessing_parameters with all feature specs."
            )
        known[1].append(feature)
    # ordered_features refuses two different tables under one name (specs prepared apart).
    natives = ordered_features(native_features(specs)) if specs else []
    table_settings = {
        f.table_spec.name: TableSetting(**dataclasses.asdict(f.table_spec.setting_in_stack))
        for f in specs
    }
    feature_settings = {
        f.name: FeatureSetting(
            stack_name=f.table_spec.setting_in_stack.stack_name,
            row_offset=f.id_transformation.row_offset, col_offset=f.id_transformation.col_offset,
            col_shift=f.id_transformation.col_shift,
        )
        for f in specs
    }
    n = topo.num_partitions
    return StackingPlan(
        topology=topo,
        config=native.SparseCoreConfig(allow_id_dropping=allow_id_dropping,
                                       enable_minibatching=enable_minibatching),
        features={f.name: f for f in natives},
        tables={f.table.name: f.table for f in natives},
        stacks={name: _native_stack(st, fs, n) for name, (st, fs) in members.items()},
        table_settings=table_settings, feature_settings=feature_settings,
    )
