"""`jax_tpu_embedding.sparsecore.lib.flax.nnx` on tilecore: `embed`."""

from . import embed as embed

__all__ = ["embed"]
