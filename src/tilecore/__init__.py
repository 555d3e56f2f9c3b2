"""tilecore: SparseCore-style sharded embeddings for JAX on any backend.

The public surface: specs (tables, features, optimizers, topology), stacking
plans, and host preprocessing into packed per-partition buffers.
"""

from ._host import host_memory_bytes as host_memory_bytes
from .fdo import CsvFdoClient as CsvFdoClient
from .fdo import FdoClient as FdoClient
from .fdo import NpzFdoClient as NpzFdoClient
from .fdo import TuneReport as TuneReport
from .fdo import tune_limits as tune_limits
from .preprocessing import IdDroppingWarning as IdDroppingWarning
from .preprocessing import LimitExceededError as LimitExceededError
from .preprocessing import PreprocessedBatch as PreprocessedBatch
from .preprocessing import PreprocessStats as PreprocessStats
from .preprocessing import Ragged as Ragged
from .preprocessing import StackBuffers as StackBuffers
from .preprocessing import coo_buffer_size_per_device as coo_buffer_size_per_device
from .preprocessing import preprocess as preprocess
from .preprocessing import row_pointers_size_per_device as row_pointers_size_per_device
from .preprocessing import update_preprocessing_parameters as update_preprocessing_parameters
from .specs import F2A as F2A
from .specs import FTRL as FTRL
from .specs import SGD as SGD
from .specs import Adagrad as Adagrad
from .specs import AdagradMomentum as AdagradMomentum
from .specs import Adam as Adam
from .specs import CustomOptimizer as CustomOptimizer
from .specs import FeatureSpec as FeatureSpec
from .specs import LaProp as LaProp
from .specs import OptimizerSpec as OptimizerSpec
from .specs import QuantizationConfig as QuantizationConfig
from .specs import SparseCoreConfig as SparseCoreConfig
from .specs import TableSpec as TableSpec
from .specs import Topology as Topology
from .stacking import FeatureSetting as FeatureSetting
from .stacking import StackingPlan as StackingPlan
from .stacking import StackSpec as StackSpec
from .stacking import TableSetting as TableSetting
from .stacking import auto_stack_tables as auto_stack_tables
from .stacking import plan_stacking as plan_stacking
from .stacking import stack_tables as stack_tables

__version__ = "0.1.0"

__all__ = [
    "F2A",
    "FTRL",
    "SGD",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "CsvFdoClient",
    "CustomOptimizer",
    "FdoClient",
    "FeatureSetting",
    "FeatureSpec",
    "IdDroppingWarning",
    "LaProp",
    "LimitExceededError",
    "NpzFdoClient",
    "OptimizerSpec",
    "PreprocessStats",
    "PreprocessedBatch",
    "QuantizationConfig",
    "Ragged",
    "SparseCoreConfig",
    "StackBuffers",
    "StackSpec",
    "StackingPlan",
    "TableSetting",
    "TableSpec",
    "Topology",
    "TuneReport",
    "auto_stack_tables",
    "coo_buffer_size_per_device",
    "host_memory_bytes",
    "plan_stacking",
    "preprocess",
    "row_pointers_size_per_device",
    "stack_tables",
    "tune_limits",
    "update_preprocessing_parameters",
]
