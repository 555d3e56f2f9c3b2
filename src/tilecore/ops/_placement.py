"""Row-sharded placement that holds both eagerly and under `jit`.

`jax.device_put` / `device=` inside a traced function (`jax.jit(model.init)`, an
`nnx.jit`-ed constructor) does not constrain the output: tables would come back
replicated, and the first train step, whose outputs are row-sharded, would hand
the second step differently placed inputs and compile it again. A sharding
constraint (a reshard on explicitly sharded axes) holds in both cases; eagerly
it moves the data.
"""

from __future__ import annotations

from typing import TypeVar

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_Tree = TypeVar("_Tree")
"""A pytree of arrays: `{stack: EmbeddingVariables}` or `{feature: probe}`."""


def explicit_axis(mesh: Mesh, axis: str) -> bool:
    """Whether `axis` of `mesh` is explicitly sharded (arrays then move by `jax.reshard`,
    and a cotangent must carry its input's sharding), not by sharding constraints."""
    return mesh.axis_types[mesh.axis_names.index(axis)] == jax.sharding.AxisType.Explicit


def place_rows(tree: _Tree, mesh: Mesh | None, axis: str) -> _Tree:
    """`tree`'s arrays split by rows over `axis` of `mesh` (unchanged without a mesh).

    Tables and slots (`[N·R, dim]`) and probes (`[batch, dim]`) are all split
    along their first dimension, with the partition specs `tilecore.ops` gives them
    (`P(axis, None)` for 2-D arrays), so eager and jitted creation agree.
    """
    if mesh is None:
        return tree
    explicit = explicit_axis(mesh, axis)

    def place(x: jax.Array) -> jax.Array:
        sharding = NamedSharding(mesh, PartitionSpec(axis, *([None] * (x.ndim - 1))))
        return jax.reshard(x, sharding) if explicit else jax.lax.with_sharding_constraint(
            x, sharding)

    return jax.tree.map(place, tree)
