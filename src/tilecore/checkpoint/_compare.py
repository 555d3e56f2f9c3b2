"""Does a checkpoint fit a model? Every table difference, and whether layouts agree."""

from __future__ import annotations

from ..specs import TableSpec
from ..stacking import StackingPlan
from ._errors import Mismatch
from ._metadata import SavedLayout


def _optimizer(kind: str, slots: tuple[str, ...]) -> str:
    return f"{kind} (slots {list(slots)})"


def _sizes(table: TableSpec | None) -> str | None:
    if table is None:
        return None
    return f"vocab_size={table.vocab_size}, embedding_dim={table.embedding_dim}"


def table_mismatches(saved: SavedLayout, plan: StackingPlan, *, optimizers: bool = True
                     ) -> list[Mismatch]:
    """Every table present on one side only, or with other sizes or slots.

    Hyperparameters (learning rate, betas, …) may differ: a resumed job may change
    them. Optimizers must agree in type and slots, since slots are restored.
    """
    old, new = saved.plan.tables, plan.tables
    out = []
    for name in sorted(old.keys() | new.keys()):
        if name not in old or name not in new:
            out.append(Mismatch(name, "table", _sizes(old.get(name)), _sizes(new.get(name))))
            continue
        for field in ("vocab_size", "embedding_dim"):
            if getattr(old[name], field) != getattr(new[name], field):
                out.append(Mismatch(name, field, getattr(old[name], field),
                                    getattr(new[name], field)))
        spec = new[name].optimizer
        expected = (type(spec).__name__, tuple(spec.slot_names))
        if optimizers and saved.optimizers[name] != expected:
            out.append(Mismatch(name, "optimizer", _optimizer(*saved.optimizers[name]),
                                _optimizer(*expected)))
    return out


def same_layout(saved: SavedLayout, plan: StackingPlan) -> bool:
    """True when every stacked array of `plan` is, row for row, the saved one.

    Then the arrays are read straight onto the new devices (even another device
    count); otherwise they are converted through per-table arrays. A stack stored
    in another dtype (`weights_dtype`) is converted too: its table is cast on the
    way (exact from a half format to float32, rounded to nearest the other way).
    """
    old = saved.plan
    if old.num_partitions != plan.num_partitions or old.stacks.keys() != plan.stacks.keys():
        return False
    for name, stack in plan.stacks.items():
        was = old.stacks[name]
        if (was.vocab_size, was.embedding_dim, was.table_names, was.weights_dtype) != (
                stack.vocab_size, stack.embedding_dim, stack.table_names, stack.weights_dtype):
            return False
    return all(old.table_settings[t] == plan.table_settings[t] for t in plan.tables)
