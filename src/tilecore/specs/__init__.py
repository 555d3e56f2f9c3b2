"""Specifications: tables, features, optimizers, topology and host configuration."""

from ._config import DEFAULT_ACTIVATION_MEM_BYTES_LIMIT as DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
from ._config import SparseCoreConfig as SparseCoreConfig
from ._optimizers import F2A as F2A
from ._optimizers import FTRL as FTRL
from ._optimizers import SGD as SGD
from ._optimizers import Adagrad as Adagrad
from ._optimizers import AdagradMomentum as AdagradMomentum
from ._optimizers import Adam as Adam
from ._optimizers import CustomOptimizer as CustomOptimizer
from ._optimizers import LaProp as LaProp
from ._optimizers import LearningRate as LearningRate
from ._optimizers import OptimizerSpec as OptimizerSpec
from ._tables import COMBINERS as COMBINERS
from ._tables import Combiner as Combiner
from ._tables import FeatureSpec as FeatureSpec
from ._tables import Initializer as Initializer
from ._tables import QuantizationConfig as QuantizationConfig
from ._tables import TableSpec as TableSpec
from ._topology import DEFAULT_AXIS as DEFAULT_AXIS
from ._topology import Topology as Topology
from ._weights_dtype import WEIGHTS_DTYPES as WEIGHTS_DTYPES

__all__ = [
    "COMBINERS",
    "DEFAULT_ACTIVATION_MEM_BYTES_LIMIT",
    "DEFAULT_AXIS",
    "F2A",
    "FTRL",
    "SGD",
    "WEIGHTS_DTYPES",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "Combiner",
    "CustomOptimizer",
    "FeatureSpec",
    "Initializer",
    "LaProp",
    "LearningRate",
    "OptimizerSpec",
    "QuantizationConfig",
    "SparseCoreConfig",
    "TableSpec",
    "Topology",
]
