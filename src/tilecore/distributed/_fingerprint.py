"""A comparable description of a stacking plan, item by item, for cross-process checks.

Processes that preprocess one global batch must hold the same plan: the same
tables, features, stacks, limits, topology and config. Comparing `repr`s would not
do (callables print their memory address), so every value is reduced to plain
JSON-able data first: dataclasses field by field, callables by qualified name
(learning-rate schedules also by their rates at a few steps), floats by `repr` (NaN
and infinities included).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from ..specs import OptimizerSpec, TableSpec
from ..stacking import StackingPlan

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


SCHEDULE_STEPS = (0, 1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
"""Where learning-rate schedules are compared: two schedules of one name (a factory's
closures over other rates, say) differ at one of these steps in every practical case."""


def canonical(value: Any) -> Any:
    """`value` as JSON-able data that is equal across processes when the values are."""
    if isinstance(value, OptimizerSpec) and callable(value.learning_rate):
        return {**canonical(dataclasses.replace(value, learning_rate=1.0)),
                "learning_rate": _schedule(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": type(value).__qualname__, **{
            f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return repr(value)
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return _ADDRESS.sub("", repr(value))


def _schedule(spec: OptimizerSpec) -> Any:
    """A learning-rate schedule by its name and its rates at `SCHEDULE_STEPS`."""
    try:
        rates = [repr(float(spec.learning_rate_at(step))) for step in SCHEDULE_STEPS]
    except Exception as error:  # a schedule that needs a traced step: by name only
        rates = [f"not evaluated: {type(error).__name__}"]
    return {"schedule": canonical(spec.learning_rate), "rates at steps": rates}


def _feature(plan: StackingPlan, name: str) -> Any:
    feature = plan.features[name]
    spec = canonical(feature)
    spec["table"] = feature.table.name  # the table itself is an item of its own
    return {"spec": spec, "setting": canonical(plan.feature_settings[name])}


def _table(plan: StackingPlan, name: str) -> Any:
    table: TableSpec = plan.tables[name]
    return {"spec": canonical(table), "setting": canonical(plan.table_settings[name])}


def plan_items(plan: StackingPlan) -> dict[str, Any]:
    """Item label → canonical value: topology, config, every table, feature and stack."""
    items: dict[str, Any] = {
        "topology": canonical(plan.topology),
        "config": canonical(plan.config),
        "table names": sorted(plan.tables),
        "feature names": sorted(plan.features),
        "stack names": sorted(plan.stacks),
    }
    items.update({f"table {name!r}": _table(plan, name) for name in plan.tables})
    items.update({f"feature {name!r}": _feature(plan, name) for name in plan.features})
    items.update({f"stack {name!r}": canonical(spec) for name, spec in plan.stacks.items()})
    return items


def digest(value: Any) -> str:
    """A short, stable hash of canonical data."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def leaf_differences(a: Any, b: Any, path: str = "") -> list[str]:
    """`path: a vs b` for every leaf where two canonical values differ (a few at most)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(a.keys() | b.keys()):
            out += leaf_differences(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in leaf_differences(x, y, f"{path}[{i}]")]
    if a == b:
        return []
    return [f"{path or 'value'}: {_short(a)} vs {_short(b)}"]


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."
