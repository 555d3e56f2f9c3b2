"""Feature and table stacking: plans that place tables and features in stacks."""

from ._build import LimitsForStack as LimitsForStack
from ._build import padded_dim as padded_dim
from ._build import padded_vocab as padded_vocab
from ._build import stack_name_for as stack_name_for
from ._memory import StackMemory as StackMemory
from ._memory import memory_estimates as memory_estimates
from ._plan import FeatureSetting as FeatureSetting
from ._plan import StackingPlan as StackingPlan
from ._plan import StackSpec as StackSpec
from ._plan import TableSetting as TableSetting
from ._plan import round_up as round_up
from ._strategies import auto_groups as auto_groups
from ._strategies import auto_stack_tables as auto_stack_tables
from ._strategies import ordered_features as ordered_features
from ._strategies import plan_stacking as plan_stacking
from ._strategies import stack_tables as stack_tables
from ._transform import physical_rows as physical_rows
from ._transform import transform_ids as transform_ids

__all__ = [
    "FeatureSetting",
    "LimitsForStack",
    "StackMemory",
    "StackSpec",
    "StackingPlan",
    "TableSetting",
    "auto_groups",
    "auto_stack_tables",
    "memory_estimates",
    "ordered_features",
    "padded_dim",
    "padded_vocab",
    "physical_rows",
    "plan_stacking",
    "round_up",
    "stack_name_for",
    "stack_tables",
    "transform_ids",
]
