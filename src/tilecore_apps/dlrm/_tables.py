"""Initial table values drawn on the host with numpy, then placed on the devices.

`ops.init_tables` runs the tables' JAX initializers in one compiled program, but
compiling threefry on CPU still takes seconds (about 5 s for the default click
model on a loaded 2-core machine). Drawing U(−0.05, 0.05) with numpy and
converting to the stacked layout with `ops.shard` costs milliseconds, so a short
run is not dominated by start-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tilecore import ops
from tilecore.optimizers import init_slots
from tilecore.stacking import StackingPlan

INIT_SCALE = 0.05


def uniform_init(key: jax.Array, shape: tuple[int, ...], dtype: object = jnp.float32
                 ) -> jax.Array:
    """U(−0.05, 0.05) in JAX: the tables' declared initializer (non-zero, as pipelining needs)."""
    return jax.random.uniform(key, shape, dtype, -INIT_SCALE, INIT_SCALE)  # pyright: ignore[reportArgumentType]


def init_variables(plan: StackingPlan, seed: int, *, mesh: Mesh | None = None
                   ) -> dict[str, ops.EmbeddingVariables]:
    """Every stack's variables: tables U(−0.05, 0.05) from numpy (seeded by `seed` and the
    table's index), padding rows zero, slots at their optimizer's initial values. Raises
    `MemoryError` before drawing anything when they cannot fit (`ops.check_memory`)."""
    ops.check_memory(plan, mesh=mesh)
    tables = {
        name: np.random.default_rng((seed, k)).uniform(
            -INIT_SCALE, INIT_SCALE, (spec.vocab_size, spec.embedding_dim)).astype(np.float32)
        for k, (name, spec) in enumerate(sorted(plan.tables.items()))
    }
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(ops.DEFAULT_AXIS, None))
    out = {}
    for name, table in ops.shard(plan, tables).items():
        spec = plan.stacks[name]
        slots = init_slots(spec.optimizer, table.shape, sharding=sharding)
        out[name] = ops.EmbeddingVariables(jax.device_put(table, sharding), slots)
    return out
