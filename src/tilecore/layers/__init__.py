"""Flax layers over `tilecore.ops`: linen (`LinenEmbed`) and nnx (`NnxEmbed`).

Both keep the stacked tables and optimizer slots apart from the dense
parameters and train them with the fused sparse update, never with a dense
gradient: the activation gradients come through a zero probe
(`tilecore.ops.embed`). One train step updates the dense parameters with optax
and the tables with their own optimizers; see `tilecore.layers._linen` and
`tilecore.layers._nnx` for the step, written out.
"""

from ._access import embedding_variables as embedding_variables
from ._linen import ACTIVATION_GRADS as ACTIVATION_GRADS
from ._linen import EMBEDDINGS as EMBEDDINGS
from ._linen import PROBES as PROBES
from ._linen import LinenEmbed as LinenEmbed
from ._linen import update_embeddings as update_embeddings
from ._nnx import PARAMS_AND_PROBES as PARAMS_AND_PROBES
from ._nnx import EmbedOptimizer as EmbedOptimizer
from ._nnx import NnxEmbed as NnxEmbed
from ._nnx import Probe as Probe
from ._nnx import Tables as Tables

__all__ = [
    "ACTIVATION_GRADS",
    "EMBEDDINGS",
    "PARAMS_AND_PROBES",
    "PROBES",
    "EmbedOptimizer",
    "LinenEmbed",
    "NnxEmbed",
    "Probe",
    "Tables",
    "embedding_variables",
    "update_embeddings",
]
