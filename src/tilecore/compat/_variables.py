"""`init_embedding_variables` with the reference's layout, keys and initializer calls.

Per stack, `split(rng, mesh.size·S·num_stacks)` gives each stack `mesh.size·S`
keys, one per partition (SparseCore) p = d·S + s. Partition p's rows of the stack
are its tables' shards, in `row_offset_in_shard` order, each from
`initializer(key_p, (padded_vocab/N, padded_dim))`: one key per partition shared
by the stack's tables, padding rows included. The slots come from the optimizer's
slot initializers the same way. The row layout is `tilecore.ops`' (partition p
holds rows `[p·R, (p+1)·R)`), so the variables feed the native ops unchanged.
Imports JAX: load it lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._native import resolve_num_sc_per_device
from ._pytree import leaves
from ._specs import StackedTableSpec, TableSpec
from ._variables_layout import check_layout


def _initializer(table: TableSpec) -> Callable[..., Any]:
    if table.initializer is not None:
        return table.initializer
    return jax.nn.initializers.truncated_normal(stddev=1.0 / np.sqrt(table.embedding_dim))


def _slot_initializers(table: TableSpec) -> tuple[Any, Callable[[list[Any]], Any]]:
    """The slot initializers and a rebuild of their container (a named tuple or a tuple)."""
    inits: Any = table.optimizer.slot_variables_initializers()
    container = type(inits)
    if hasattr(inits, "_fields"):
        return inits, lambda values: container(*values)
    return tuple(inits), lambda values: tuple(values)


def _call(init: Any, key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    if not callable(init):  # a plain float slot value
        return jnp.full(shape, float(init), jnp.float32)
    return jnp.asarray(init(key, shape), jnp.float32)


def _stack_rows(tables: list[TableSpec], keys: jax.Array, partitions: int) -> tuple:
    """This device's `[S·R, dim]` table and slots, from its S partition keys."""
    parts: list[list[jax.Array]] = []
    for key in keys:
        for table in tables:
            setting = table.setting_in_stack
            shape = (setting.padded_vocab_size // partitions, setting.padded_embedding_dim)
            slots, _ = _slot_initializers(table)
            parts.append([_call(_initializer(table), key, shape),
                          *(_call(init, key, shape) for init in slots)])
    return tuple(jnp.concatenate(column) for column in zip(*parts, strict=True))


def _check_table(table: object) -> None:
    """Refuse a leaf that is no TableSpec: AttributeError, the reference's type for it."""
    if isinstance(table, TableSpec):
        return
    hint = (" A StackedTableSpec (from get_stacked_table_specs) describes a stack, not its "
            "tables." if isinstance(table, StackedTableSpec) else "")
    raise AttributeError(
        "init_embedding_variables: table_specs must hold embedding_spec.TableSpec values, "
        f"e.g. embedding.get_table_specs(feature_specs); got {type(table).__name__} "
        f"{getattr(table, 'stack_name', table)!r}.{hint}"
    )


def init_variables(
    rng: jax.Array,
    table_specs: Any,
    global_sharding: NamedSharding,
    num_sparsecore_per_device: int | None,
    bypass_mesh_check: bool,
    make_variables: Callable[[jax.Array, Any], Any],
) -> dict[str, Any]:
    """Stack name → `make_variables(table, slots)`; see the module docstring."""
    num_sc = resolve_num_sc_per_device(num_sparsecore_per_device)
    spec = tuple(global_sharding.spec)
    axis = next((s for s in spec if s is not None), None)
    if axis is None or spec not in ((axis, None), (axis, None, None)):
        raise ValueError(
            "PartitionSpec of the global sharding either needs to be in the format "
            f"PartitionSpec('x', None, None) or PartitionSpec('x', None). Got {global_sharding.spec}"
        )
    mesh = global_sharding.mesh
    if not bypass_mesh_check and list(np.ravel(np.asarray(mesh.devices))) != list(jax.devices()):
        raise ValueError(
            "global_sharding needs to be created with default device order from jax.devices(), "
            f"but global_sharding.mesh.devices={mesh.devices!r} and "
            f"jax.devices()={jax.devices()!r}; build the mesh from jax.devices() or pass "
            "bypass_mesh_check=True."
        )
    stacks: dict[str, list[TableSpec]] = {}
    for table in leaves(table_specs):
        _check_table(table)
        stacks.setdefault(table.setting_in_stack.stack_name, []).append(table)
    for tables in stacks.values():
        tables.sort(key=lambda t: t.setting_in_stack.row_offset_in_shard)
    check_layout(stacks, mesh.size, num_sc)
    width = mesh.size * num_sc
    keys = jax.random.split(rng, width * len(stacks))
    flat = NamedSharding(mesh, PartitionSpec(axis))
    out = {}
    for i, (name, tables) in enumerate(stacks.items()):
        _, rebuild = _slot_initializers(tables[0])

        def per_device(k: jax.Array, tables: list[TableSpec] = tables) -> tuple:
            return _stack_rows(tables, k, width)

        init = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=PartitionSpec(axis),
                                     out_specs=PartitionSpec(axis), check_vma=False),
                       out_shardings=flat)
        table, *slots = init(jax.device_put(keys[i * width:(i + 1) * width], flat))
        if len(spec) == 3:  # pmap layout: [devices, rows per device, dim]
            table, *slots = (jax.device_put(x.reshape(mesh.size, -1, x.shape[-1]),
                                            global_sharding) for x in (table, *slots))
        out[name] = make_variables(table, rebuild(slots))
    return out
