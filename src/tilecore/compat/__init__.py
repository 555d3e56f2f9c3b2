"""jax-tpu-embedding 0.2.0's public API (`jax_tpu_embedding.sparsecore`) on tilecore.

A program written for the reference ports by one textual substitution::

    # from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec
    from tilecore.compat.lib.nn import embedding, embedding_spec

Every module a reference user imports exists at the same path below
`tilecore.compat`: `lib.nn.{embedding, embedding_spec, table_stacking,
embedding_pipelining_utils, embedding_proto_utils, custom_optimizer_lowering}`,
`lib.flax.linen.{embed, embed_optimizer}`, `lib.flax.nnx.{embed,
checkpoint_utils, offline_converter}`, `lib.fdo.{fdo_client, file_fdo_client,
csv_file_fdo_client}`, `lib.proto.embedding_spec_pb2`, `lib.auto_pipelining`,
`lib.core` and `utils.utils`. Names, arguments, defaults, return types and the
in-place updates of the specs they are given follow the reference; the work is
done by tilecore's native API. Where the reference aborts the process or accepts
bad input silently, compat raises the native API's errors.

The short paths of earlier releases (`tilecore.compat.embedding`,
`tilecore.compat.embedding_spec`, `tilecore.compat.table_stacking`,
`tilecore.compat.embedding_pipelining_utils`, `tilecore.compat.flax…`) are the
same module objects as their places in the tree. `import tilecore.compat`
imports neither JAX nor Flax; the modules that need them import them.
"""

from . import _aliases
from .lib.nn import embedding as embedding
from .lib.nn import embedding_spec as embedding_spec
from .lib.nn import table_stacking as table_stacking

_aliases.install({
    f"{__name__}.embedding": f"{__name__}.lib.nn.embedding",
    f"{__name__}.embedding_spec": f"{__name__}.lib.nn.embedding_spec",
    f"{__name__}.table_stacking": f"{__name__}.lib.nn.table_stacking",
    f"{__name__}.embedding_pipelining_utils": f"{__name__}.lib.nn.embedding_pipelining_utils",
    f"{__name__}.flax": f"{__name__}.lib.flax",
})

__all__ = ["embedding", "embedding_spec", "table_stacking"]
