"""`jax_tpu_embedding.sparsecore.lib` on tilecore: its subpackages, imported on first use."""

from typing import TYPE_CHECKING

from .._aliases import submodule_getattr

__all__ = ["auto_pipelining", "core", "fdo", "flax", "nn", "proto"]
if TYPE_CHECKING:  # the submodules load lazily; type checkers see them here
    from . import auto_pipelining, core, fdo, flax, nn, proto

__getattr__ = submodule_getattr(__name__, __all__)
