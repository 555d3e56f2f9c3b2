"""`jax_tpu_embedding.sparsecore.utils` on tilecore: device and table-layout helpers."""

from .._aliases import submodule_getattr

__all__ = ["utils"]
__getattr__ = submodule_getattr(__name__, __all__)
