"""Reference-compatible specs (`jax_tpu_embedding.sparsecore.lib.nn.embedding_spec`).

Mutable shells with the reference's field names and defaults; stacking fills
`TableSpec.stacked_table_spec`, `TableSpec.setting_in_stack` and
`FeatureSpec.id_transformation` in place. Each converts to tilecore's frozen specs
(`OptimizerSpec.to_native()`, and a `tilecore.StackingPlan` for the stacks) when
work is done.
"""

from ....specs import DEFAULT_ACTIVATION_MEM_BYTES_LIMIT as DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
from ..._optimizers import AdagradMomentumOptimizerSpec as AdagradMomentumOptimizerSpec
from ..._optimizers import AdagradMomentumSlotVariables as AdagradMomentumSlotVariables
from ..._optimizers import AdagradOptimizerSpec as AdagradOptimizerSpec
from ..._optimizers import AdagradSlotVariables as AdagradSlotVariables
from ..._optimizers import AdamOptimizerSpec as AdamOptimizerSpec
from ..._optimizers import AdamSlotVariables as AdamSlotVariables
from ..._optimizers import CallablePlaceholder as CallablePlaceholder
from ..._optimizers import CallableTableInitializer as CallableTableInitializer
from ..._optimizers import CustomOptimizerSpec as CustomOptimizerSpec
from ..._optimizers import F2AOptimizerSpec as F2AOptimizerSpec
from ..._optimizers import F2ASlotVariables as F2ASlotVariables
from ..._optimizers import FTRLOptimizerSpec as FTRLOptimizerSpec
from ..._optimizers import FTRLSlotVariables as FTRLSlotVariables
from ..._optimizers import HyperParameterType as HyperParameterType
from ..._optimizers import LaPropOptimizerSpec as LaPropOptimizerSpec
from ..._optimizers import LaPropSlotVariables as LaPropSlotVariables
from ..._optimizers import OptimizerSpec as OptimizerSpec
from ..._optimizers import SGDOptimizerSpec as SGDOptimizerSpec
from ..._optimizers import SGDSlotVariables as SGDSlotVariables
from ..._specs import FeatureIdTransformation as FeatureIdTransformation
from ..._specs import FeatureSpec as FeatureSpec
from ..._specs import QuantizationConfig as QuantizationConfig
from ..._specs import StackedTableSpec as StackedTableSpec
from ..._specs import TableSettingInStack as TableSettingInStack
from ..._specs import TableSpec as TableSpec

__all__ = [
    "DEFAULT_ACTIVATION_MEM_BYTES_LIMIT",
    "AdagradMomentumOptimizerSpec",
    "AdagradMomentumSlotVariables",
    "AdagradOptimizerSpec",
    "AdagradSlotVariables",
    "AdamOptimizerSpec",
    "AdamSlotVariables",
    "CallablePlaceholder",
    "CallableTableInitializer",
    "CustomOptimizerSpec",
    "F2AOptimizerSpec",
    "F2ASlotVariables",
    "FTRLOptimizerSpec",
    "FTRLSlotVariables",
    "FeatureIdTransformation",
    "FeatureSpec",
    "HyperParameterType",
    "LaPropOptimizerSpec",
    "LaPropSlotVariables",
    "OptimizerSpec",
    "QuantizationConfig",
    "SGDOptimizerSpec",
    "SGDSlotVariables",
    "StackedTableSpec",
    "TableSettingInStack",
    "TableSpec",
]
