"""Optimizer update rules: one small pure-`jnp` rule per optimizer spec.

`update_rule(spec)` returns `rule(grad, row, *slots, *spec.hyperparameters(step))
-> (new_row, *new_slots)` on gathered `[rows, dim]` arrays; `init_slots(spec, shape)`
builds the slot variables. `tilecore.ops` applies any rule in one fused sparse
update, so adding an optimizer means adding a rule, never a kernel.

A rule may also come as a StableHLO module (the reference system's custom-optimizer
form): `lower_rule(fn, dim=...)` writes one, `StableHLORule(text, ...)` runs one as a
`tilecore.CustomOptimizer(update_fn=...)`, and `clip_module` adds value limits.
"""

from ._registry import UpdateRule as UpdateRule
from ._registry import init_slots as init_slots
from ._registry import update_rule as update_rule
from ._stablehlo_rule import StableHLORule as StableHLORule
from ._stablehlo_rule import clip_module as clip_module
from ._stablehlo_rule import clip_values as clip_values
from ._stablehlo_rule import lower_rule as lower_rule

__all__ = [
    "StableHLORule",
    "UpdateRule",
    "clip_module",
    "clip_values",
    "init_slots",
    "lower_rule",
    "update_rule",
]
