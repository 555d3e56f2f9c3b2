"""What every `StackingPlan` must satisfy, checked when the plan is built.

A plan is the contract the host preprocessing, the device ops and the checkpoints
share. A plan that contradicts itself (a feature in no stack, a table the stack
does not place) or that needs integers past int32 (the width of every ID, row
pointer and sample index on the device) would fail later, far from its cause, or
silently: embedding IDs that wrap to negative values. So it is refused here, with
the fix in the message.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..specs import OptimizerSpec, QuantizationConfig
from ..specs._weights_dtype import WEIGHTS_DTYPES

if TYPE_CHECKING:
    from ._plan import StackingPlan, StackSpec

INT32_LIMIT = 2**31
"""Device IDs, row pointers and sample indices are int32: every count stays below this."""


def check_limit(stack: str, field: str, value: object, *, source: str = "") -> None:
    """A stack limit is an integer >= 1 (below 2**31)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or not 1 <= int(value) < INT32_LIMIT):
        raise ValueError(f"Stack {stack!r}: {field} must be an integer in [1, 2**31), got "
                         f"{value!r}{source}.")


def _check_stack(stack: StackSpec, num_partitions: int) -> None:
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition"):
        check_limit(stack.name, field, getattr(stack, field))
    if stack.suggested_coo_buffer_size_per_device is not None:
        check_limit(stack.name, "suggested_coo_buffer_size_per_device",
                    stack.suggested_coo_buffer_size_per_device)
    if stack.vocab_size >= INT32_LIMIT:
        raise ValueError(
            f"Stack {stack.name!r}: its tables {list(stack.table_names)} stack to "
            f"{stack.vocab_size} rows ({stack.vocab_size // num_partitions} per shard), past "
            f"the int32 row index (2**31 - 1) the device ops address rows with. Put these "
            "tables in separate stacks (fewer tables per stacking group, or "
            "SparseCoreConfig(disable_table_stacking=True)).")
    if stack.total_sample_count >= INT32_LIMIT:
        raise ValueError(
            f"Stack {stack.name!r}: its features {list(stack.feature_names)} hold "
            f"{stack.total_sample_count} samples per global batch, past the int32 sample index "
            "(2**31 - 1). Use a smaller global batch, or split the features over stacks.")


def _check_membership(plan: StackingPlan) -> None:
    """Every feature sits in a stack that lists it, with its table placed in that stack."""
    for name, stack in plan.stacks.items():
        for table in stack.table_names:
            setting = plan.table_settings.get(table)
            if setting is None or setting.stack_name != name:
                raise ValueError(
                    f"Stack {name!r} lists table {table!r}, but the plan places that table "
                    f"{'nowhere' if setting is None else f'in stack {setting.stack_name!r}'}. "
                    "Build plans with tilecore.plan_stacking / stack_tables.")
    for name, feature in plan.features.items():
        setting = plan.feature_settings.get(name)
        stack = None if setting is None else plan.stacks.get(setting.stack_name)
        if setting is None or stack is None or name not in stack.feature_names:
            raise ValueError(
                f"Feature {name!r} (table {feature.table.name!r}) is in no stack of the plan "
                f"(stacks: {sorted(plan.stacks)}): its IDs would get no buffers and never be "
                "checked. Stack every feature's table (tilecore.plan_stacking / stack_tables "
                "with all features).")
        table = plan.table_settings.get(feature.table.name)
        if table is None or table.stack_name != setting.stack_name:
            raise ValueError(
                f"Feature {name!r} is in stack {setting.stack_name!r} but its table "
                f"{feature.table.name!r} is "
                f"{'in no stack' if table is None else f'in stack {table.stack_name!r}'}.")


_REBUILD = ("A stack's fields are derived from its tables and features: build plans with "
            "tilecore.plan_stacking / stack_tables, and change a stack's limits with "
            "plan.with_stack_limits.")


_FIELD_TYPES: dict[str, tuple[type | tuple[type, ...], str]] = {
    "optimizer": (OptimizerSpec, "an OptimizerSpec (e.g. tilecore.SGD(...))"),
    "combiner": (str, "a str"),
    "quantization": ((QuantizationConfig, type(None)), "a QuantizationConfig or None"),
    "weights_dtype": (np.dtype, "a numpy dtype (one of "
                                f"{', '.join(d.name for d in WEIGHTS_DTYPES)})"),
}


def _check_field_types(stack: Any) -> None:
    """A `StackSpec` (built by hand or by `dataclasses.replace`) holds fields of its types."""
    from ._plan import StackSpec  # which imports this module

    if not isinstance(stack, StackSpec):
        raise TypeError(f"A plan's stacks must be StackSpecs, got {type(stack).__name__}.")
    name = stack.name
    if not isinstance(name, str):
        raise TypeError(f"StackSpec name must be a str, got {name!r}.")
    for field in ("vocab_size", "embedding_dim", "total_sample_count"):
        value = getattr(stack, field)
        if type(value) is not int and (isinstance(value, bool)
                                       or not isinstance(value, numbers.Integral)):
            raise TypeError(f"Stack {name!r}: {field} must be an integer, got "
                            f"{type(value).__name__} {value!r}. {_REBUILD}")
    for field in ("table_names", "feature_names"):
        value = getattr(stack, field)
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"Stack {name!r}: {field} must be a tuple of names, got {value!r}.")
        if len(set(value)) != len(value):
            raise ValueError(f"Stack {name!r}: {field} lists a name twice: {value!r}.")
    if not stack.table_names:
        raise ValueError(f"Stack {name!r} has no tables (table_names=()). {_REBUILD}")
    for field, (kind, what) in _FIELD_TYPES.items():
        value = getattr(stack, field)
        if not isinstance(value, kind):
            raise TypeError(f"Stack {name!r}: {field} must be {what}, got "
                            f"{type(value).__name__} {value!r}. {_REBUILD}")


def _check_derived(plan: StackingPlan, stack: StackSpec) -> None:
    """Every field of `stack` is what `plan_stacking` derives from its tables and features
    (`_build.derived_fields`, the derivation `build_stack` uses)."""
    from ._build import check_stackable, derived_fields  # which imports this module

    name = stack.name
    missing = [t for t in stack.table_names if t not in plan.tables]
    if missing:
        raise ValueError(f"Stack {name!r} lists tables {missing} that are not in the plan's "
                         f"tables {sorted(plan.tables)}. {_REBUILD}")
    tables = [plan.tables[t] for t in stack.table_names]
    check_stackable(name, tables, False)
    order = sorted(stack.table_names, key=lambda t: plan.table_settings[t].row_offset_in_shard)
    if tuple(order) != stack.table_names:
        raise ValueError(f"Stack {name!r}: table_names is {stack.table_names} but its tables' "
                         f"settings place them in the order {tuple(order)}. {_REBUILD}")
    features = None
    if plan.features:  # a checkpoint's layout plan has tables and stacks, no features
        for feature in stack.feature_names:
            spec = plan.features.get(feature)
            if spec is None or spec.table.name not in stack.table_names:
                which = ("the plan does not have" if spec is None
                         else f"looks up table {spec.table.name!r}")
                raise ValueError(f"Stack {name!r} lists feature {feature!r}, which {which}; its "
                                 f"tables are {list(stack.table_names)}. {_REBUILD}")
        order = sorted(stack.feature_names, key=lambda f: plan.feature_settings[f].row_offset)
        if tuple(order) != stack.feature_names:
            raise ValueError(
                f"Stack {name!r}: feature_names is {stack.feature_names} but its features' "
                f"row offsets put them in the order {tuple(order)}. {_REBUILD}")
        features = [plan.features[f] for f in stack.feature_names]
    implied = derived_fields(tables, features, plan.topology)
    for field, want in implied.items():
        found = getattr(stack, field)
        if found != want:
            source = ("its features' batches" if field == "total_sample_count"
                      else f"its tables {list(stack.table_names)}")
            raise ValueError(f"Stack {name!r}: {field} is {found!r} but {source} make it "
                             f"{want!r}. {_REBUILD}")


def _check_tables_of_features(plan: StackingPlan) -> None:
    """`plan.tables` holds the very tables its features look up."""
    for name, feature in plan.features.items():
        table = plan.tables.get(feature.table.name)
        if table is not feature.table and table != feature.table:
            raise ValueError(
                f"Feature {name!r} looks up table {feature.table.name!r}, but the plan's tables "
                f"hold {'no such table' if table is None else 'another table of that name'}. "
                f"{_REBUILD}")


def check_plan(plan: StackingPlan) -> None:
    """Refuse a plan that contradicts itself or needs integers past int32."""
    for key, stack in plan.stacks.items():
        _check_field_types(stack)
        if stack.name != key:
            raise ValueError(f"The plan holds stack {stack.name!r} under the name {key!r}. "
                             f"{_REBUILD}")
    _check_membership(plan)
    _check_tables_of_features(plan)
    for stack in plan.stacks.values():
        _check_stack(stack, plan.num_partitions)
        _check_derived(plan, stack)


def check_stack_limits(name: str, samples: int, limits: Any) -> tuple[int, int]:
    """The `(max_ids, max_unique_ids)` a `stack_limits(name, samples)` callback returned."""
    source = f" (returned by stack_limits({name!r}, {samples}))"
    if not isinstance(limits, tuple | list) or len(limits) != 2:
        raise ValueError(f"Stack {name!r}: stack_limits must return (max_ids_per_partition, "
                         f"max_unique_ids_per_partition), got {limits!r}{source}.")
    values: Mapping[str, Any] = dict(zip(("max_ids_per_partition",
                                           "max_unique_ids_per_partition"), limits, strict=True))
    for field, value in values.items():
        check_limit(name, field, value, source=source)
    return int(limits[0]), int(limits[1])
