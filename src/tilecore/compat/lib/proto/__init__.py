"""`jax_tpu_embedding.sparsecore.lib.proto` on tilecore: the wire-compatible `EmbeddingSpecProto`."""

from typing import TYPE_CHECKING

from ..._aliases import submodule_getattr

__all__ = ["embedding_spec_pb2"]
if TYPE_CHECKING:  # the submodules load lazily; type checkers see them here
    from . import embedding_spec_pb2

__getattr__ = submodule_getattr(__name__, __all__)
