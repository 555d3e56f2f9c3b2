"""`jax_tpu_embedding.sparsecore.lib` on tilecore: its subpackages, imported on first use."""

from .._aliases import submodule_getattr

__all__ = ["auto_pipelining", "core", "fdo", "flax", "nn", "proto"]
__getattr__ = submodule_getattr(__name__, __all__)
