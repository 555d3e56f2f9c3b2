"""The reference's Flax layers (`jax_tpu_embedding.sparsecore.lib.flax`) on tilecore.

Port by changing the import::

    # from jax_tpu_embedding.sparsecore.lib.flax.linen import embed, embed_optimizer
    from tilecore.compat.flax.linen import embed, embed_optimizer
    # from jax_tpu_embedding.sparsecore.lib.flax.nnx import embed
    from tilecore.compat.flax.nnx import embed

These import JAX and Flax (unlike the rest of `tilecore.compat`). tilecore's own
layers, which never pass updated tables off as gradients, are `tilecore.layers`.
"""

from . import linen as linen
from . import nnx as nnx

__all__ = ["linen", "nnx"]
