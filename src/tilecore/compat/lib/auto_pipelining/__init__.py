"""`jax_tpu_embedding.sparsecore.lib.auto_pipelining` on tilecore: pipelining a plain training step."""

from typing import TYPE_CHECKING

from ..._aliases import submodule_getattr

__all__ = ["auto_pipelining", "decompose", "preprocess", "utils"]
if TYPE_CHECKING:  # the submodules load lazily; type checkers see them here
    from . import auto_pipelining, decompose, preprocess, utils

__getattr__ = submodule_getattr(__name__, __all__)
