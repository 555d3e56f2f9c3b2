"""`jax_tpu_embedding.sparsecore.lib.flax.nnx` on tilecore: `embed`, `checkpoint_utils`,
`offline_converter` (imported on first use)."""

from typing import TYPE_CHECKING

from ...._aliases import submodule_getattr

__all__ = ["checkpoint_utils", "embed", "offline_converter"]
if TYPE_CHECKING:  # the submodules load lazily; type checkers see them here
    from . import checkpoint_utils, embed, offline_converter

__getattr__ = submodule_getattr(__name__, __all__)
