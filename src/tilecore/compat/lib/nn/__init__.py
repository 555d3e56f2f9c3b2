"""`jax_tpu_embedding.sparsecore.lib.nn` on tilecore: specs, stacking, preprocessing, lookups."""

from typing import TYPE_CHECKING

from ..._aliases import submodule_getattr

__all__ = [
    "custom_optimizer_lowering",
    "embedding",
    "embedding_pipelining_utils",
    "embedding_proto_utils",
    "embedding_spec",
    "table_stacking",
]
if TYPE_CHECKING:  # the submodules load lazily; type checkers see them here
    from . import (
        custom_optimizer_lowering,
        embedding,
        embedding_pipelining_utils,
        embedding_proto_utils,
        embedding_spec,
        table_stacking,
    )

__getattr__ = submodule_getattr(__name__, __all__)
