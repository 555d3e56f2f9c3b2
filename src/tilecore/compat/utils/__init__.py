"""`jax_tpu_embedding.sparsecore.utils` on tilecore: device and table-layout helpers."""

from typing import TYPE_CHECKING

from .._aliases import submodule_getattr

__all__ = ["utils"]
if TYPE_CHECKING:  # the submodules load lazily; type checkers see them here
    from . import utils

__getattr__ = submodule_getattr(__name__, __all__)
