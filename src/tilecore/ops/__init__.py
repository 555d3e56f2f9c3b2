"""Device ops in JAX: sharded lookup, fused gradient + optimizer update, table layout, and
preprocessing on the device (bit-identical to the host's)."""

from . import _pytrees  # noqa: F401  (registers the preprocessing outputs as pytrees)
from ._activations import stack_gradients as stack_gradients
from ._activations import unstack_activations as unstack_activations
from ._autodiff import activation_probe as activation_probe
from ._autodiff import embed as embed
from ._autodiff import training_update as training_update
from ._device_preprocessing import PreprocessOn as PreprocessOn
from ._device_preprocessing import preprocess_batch as preprocess_batch
from ._device_preprocessing import preprocess_on_device as preprocess_on_device
from ._device_preprocessing import resolve_preprocess_on as resolve_preprocess_on
from ._layout import StackLayout as StackLayout
from ._layout import stack_layouts as stack_layouts
from ._lookup import DEFAULT_AXIS as DEFAULT_AXIS
from ._lookup import lookup as lookup
from ._lookup_grad import UpdateOptions as UpdateOptions
from ._lookup_grad import lookup_grad as lookup_grad
from ._memory import check_memory as check_memory
from ._tables import init_tables as init_tables
from ._tables import shard as shard
from ._tables import unshard as unshard
from ._tables import use_huge_pages as use_huge_pages
from ._variables import EmbeddingVariables as EmbeddingVariables

__all__ = [
    "DEFAULT_AXIS",
    "EmbeddingVariables",
    "PreprocessOn",
    "StackLayout",
    "UpdateOptions",
    "activation_probe",
    "check_memory",
    "embed",
    "init_tables",
    "lookup",
    "lookup_grad",
    "preprocess_batch",
    "preprocess_on_device",
    "resolve_preprocess_on",
    "shard",
    "stack_gradients",
    "stack_layouts",
    "training_update",
    "unshard",
    "unstack_activations",
    "use_huge_pages",
]
