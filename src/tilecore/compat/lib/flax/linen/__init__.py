"""`jax_tpu_embedding.sparsecore.lib.flax.linen` on tilecore: `embed`, `embed_optimizer`."""

from . import embed as embed
from . import embed_optimizer as embed_optimizer

__all__ = ["embed", "embed_optimizer"]
