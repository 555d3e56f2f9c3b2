"""The JSON record of a checkpoint: specs, stacking plan and array layout.

Written next to the arrays so a checkpoint says what it holds without the code
that wrote it: every table (sizes, combiner, limits, optimizer with its
hyperparameters, storage dtype), every feature, the topology and the full stacking plan, and
the checksum of every saved array (`_checksums`), compared when it is read.

Callables cannot be stored: a learning-rate schedule, a `CustomOptimizer`'s
`update_fn` and table initializers are recorded by qualified name only (and
listed under `"not_serialized"`); on restore the model's specs supply them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..specs import OptimizerSpec, SparseCoreConfig, TableSpec, Topology
from ..stacking import StackingPlan, StackSpec, TableSetting
from ._checksums import Expected, expectations

FORMAT = "tilecore-checkpoint"
VERSION = 1


def _callable_name(fn: object) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _jsonable(value: object) -> object:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(value):
        return _callable_name(value)
    return repr(value)


def optimizer_json(spec: OptimizerSpec) -> dict[str, Any]:
    """Type, slots and hyperparameters of an optimizer; callables by name only."""
    lr = spec.learning_rate
    hyper = {f.name: _jsonable(getattr(spec, f.name)) for f in dataclasses.fields(spec)
             if f.name != "learning_rate"}
    return {
        "type": type(spec).__name__,
        "slot_names": list(spec.slot_names),
        "slot_initial_values": list(spec.slot_initial_values()),
        "learning_rate": None if callable(lr) else float(lr),
        "learning_rate_schedule": _callable_name(lr) if callable(lr) else None,
        "hyperparameters": hyper,
    }


def _table_json(table: TableSpec) -> dict[str, Any]:
    return {
        "vocab_size": table.vocab_size,
        "embedding_dim": table.embedding_dim,
        "combiner": table.combiner,
        "optimizer": optimizer_json(table.optimizer),
        "initializer": None if table.initializer is None else _callable_name(table.initializer),
        "max_ids_per_partition": table.max_ids_per_partition,
        "max_unique_ids_per_partition": table.max_unique_ids_per_partition,
        "suggested_coo_buffer_size_per_device": table.suggested_coo_buffer_size_per_device,
        "quantization": None if table.quantization is None
        else dataclasses.asdict(table.quantization),
        "weights_dtype": table.weights_dtype.name,
    }


def _not_serialized(plan: StackingPlan) -> list[str]:
    notes = []
    for name, table in plan.tables.items():
        if callable(table.optimizer.learning_rate):
            notes.append(f"table {name!r}: learning-rate schedule (stored by name)")
        if hasattr(table.optimizer, "update_fn"):
            notes.append(f"table {name!r}: custom optimizer update_fn (stored by name)")
        if table.initializer is not None:
            notes.append(f"table {name!r}: initializer (stored by name)")
    return notes


def _stack_json(stack: StackSpec) -> dict[str, Any]:
    fields = ("name", "vocab_size", "embedding_dim", "combiner", "total_sample_count",
              "max_ids_per_partition", "max_unique_ids_per_partition",
              "suggested_coo_buffer_size_per_device", "table_names", "feature_names")
    return {**{f: _jsonable(getattr(stack, f)) for f in fields},
            "slot_names": list(stack.optimizer.slot_names),
            "weights_dtype": stack.weights_dtype.name}


def plan_json(plan: StackingPlan, step: int, version: str) -> dict[str, Any]:
    """Everything about `plan` that JSON can hold; `stacks` is in array order."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "tilecore_version": version,
        "step": step,
        "topology": dataclasses.asdict(plan.topology),
        "config": _jsonable(dataclasses.asdict(plan.config)),
        "tables": {name: _table_json(t) for name, t in plan.tables.items()},
        "features": {
            name: {"table": f.table.name, "input_shape": list(f.input_shape),
                   "output_shape": list(f.output_shape)}
            for name, f in plan.features.items()
        },
        "stacks": [_stack_json(s) for s in plan.stacks.values()],
        "table_settings": {k: dataclasses.asdict(v) for k, v in plan.table_settings.items()},
        "feature_settings": {k: dataclasses.asdict(v) for k, v in plan.feature_settings.items()},
        "not_serialized": _not_serialized(plan),
    }


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """What restore needs from the metadata.

    Attributes:
      plan: a layout-only plan (tables' sizes, stacks and settings; placeholder
        SGD optimizers, no features) for `tilecore.ops.unshard`.
      stack_order: stack names in the order of the saved arrays.
      slot_names: stack → its slot names, in the saved order.
      optimizers: table → (optimizer type, slot names) as saved.
      embeddings: leaf key (`0/table`, `0/slots/1`) → what that saved array must be
        (its name for messages, shape and, if recorded, checksum).
      extra: leaf key → the recorded checksum of each `extra` leaf.
      checksummed: whether the checkpoint records checksums (False: written before
        they existed; its arrays are checked for shape only).
    """

    plan: StackingPlan
    stack_order: tuple[str, ...]
    slot_names: Mapping[str, tuple[str, ...]]
    optimizers: Mapping[str, tuple[str, tuple[str, ...]]]
    embeddings: Mapping[str, Expected] = dataclasses.field(default_factory=dict)
    extra: Mapping[str, Expected] = dataclasses.field(default_factory=dict)
    checksummed: bool = False


def parse(raw: object) -> SavedLayout:
    """The layout recorded in `raw`; raises KeyError/TypeError/ValueError if malformed."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
    if raw["version"] != VERSION:
        raise ValueError(f"version {raw['version']!r} is not supported (this reader: {VERSION})")
    topo = raw["topology"]
    topology = Topology(global_devices=topo["global_devices"], sc_per_device=topo["sc_per_device"],
                        local_devices=topo["local_devices"])
    tables = {name: TableSpec(name=name, vocab_size=t["vocab_size"],
                              embedding_dim=t["embedding_dim"], combiner=t["combiner"],
                              weights_dtype=t.get("weights_dtype", "float32"))
              for name, t in raw["tables"].items()}
    optimizers = {name: (str(t["optimizer"]["type"]), tuple(t["optimizer"]["slot_names"]))
                  for name, t in raw["tables"].items()}
    settings = {name: TableSetting(**s) for name, s in raw["table_settings"].items()}
    stacks: dict[str, StackSpec] = {}
    slot_names: dict[str, tuple[str, ...]] = {}
    for s in raw["stacks"]:
        members = tuple(s["table_names"])
        for member in members:
            if member not in tables or member not in settings:
                raise ValueError(f"stack {s['name']!r} names unknown table {member!r}")
        first = tables[members[0]]
        stacks[s["name"]] = StackSpec(
            name=s["name"], vocab_size=s["vocab_size"], embedding_dim=s["embedding_dim"],
            optimizer=first.optimizer, combiner=first.combiner, quantization=None,
            total_sample_count=s["total_sample_count"],
            max_ids_per_partition=s["max_ids_per_partition"],
            max_unique_ids_per_partition=s["max_unique_ids_per_partition"],
            suggested_coo_buffer_size_per_device=s["suggested_coo_buffer_size_per_device"],
            table_names=members, feature_names=tuple(s["feature_names"]),
            weights_dtype=first.weights_dtype,
        )
        slot_names[s["name"]] = tuple(s["slot_names"])
    for name, setting in settings.items():
        if name not in tables or setting.stack_name not in stacks:
            raise ValueError(f"table setting {name!r} points at unknown stack "
                             f"{setting.stack_name!r}")
    plan = StackingPlan(topology=topology, config=SparseCoreConfig(), features={}, tables=tables,
                        stacks=stacks, table_settings=settings, feature_settings={})
    embeddings, extra = expectations(
        raw.get("checksums"),
        {n: (s.vocab_size, s.embedding_dim, s.table_names) for n, s in stacks.items()},
        slot_names)
    return SavedLayout(plan=plan, stack_order=tuple(stacks), slot_names=slot_names,
                       optimizers=optimizers, embeddings=embeddings, extra=extra,
                       checksummed=raw.get("checksums") is not None)
