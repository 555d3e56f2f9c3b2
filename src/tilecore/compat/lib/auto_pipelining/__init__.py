"""`jax_tpu_embedding.sparsecore.lib.auto_pipelining` on tilecore: pipelining a plain training step."""

from ..._aliases import submodule_getattr

__all__ = ["auto_pipelining"]
__getattr__ = submodule_getattr(__name__, __all__)
