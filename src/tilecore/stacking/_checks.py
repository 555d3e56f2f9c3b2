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


def check_plan(plan: StackingPlan) -> None:
    """Refuse a plan that contradicts itself or needs integers past int32."""
    _check_membership(plan)
    for stack in plan.stacks.values():
        _check_stack(stack, plan.num_partitions)


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
