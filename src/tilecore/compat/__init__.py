"""Drop-in replacements for `jax_tpu_embedding.sparsecore.lib.nn`.

A reference script ports by changing one import line::

    # from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec, table_stacking
    from tilecore.compat import embedding, embedding_spec, table_stacking

The modules mirror the reference's names, arguments, defaults and in-place
updates of the specs they are given; the work is done by tilecore's native API
(`tilecore.stacking`, `tilecore.preprocess`, `tilecore.ops`). Nothing here
imports JAX at import time; the device functions import it on first call. See
`tilecore.compat.embedding` for the differences from the reference.

Two more ports import JAX and Flax, so they are imported explicitly:
`tilecore.compat.embedding_pipelining_utils` (the reference's
`lib/nn/embedding_pipelining_utils`) and `tilecore.compat.flax.linen` /
`tilecore.compat.flax.nnx` (its `lib/flax` layers).
"""

from . import embedding as embedding
from . import embedding_spec as embedding_spec
from . import table_stacking as table_stacking

__all__ = ["embedding", "embedding_spec", "table_stacking"]
