"""`jax_tpu_embedding.sparsecore.lib.core` on tilecore: the Python functions user code calls."""

from typing import TYPE_CHECKING

from ..._aliases import submodule_getattr

__all__ = ["constants", "input_preprocessing"]
if TYPE_CHECKING:  # the submodules load lazily; type checkers see them here
    from . import constants, input_preprocessing

__getattr__ = submodule_getattr(__name__, __all__)
