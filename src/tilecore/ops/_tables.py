"""Tables in the stacked, sharded layout: creation and conversion to per-table arrays.

Logical ID i of a table sits at physical row
`((i mod N + rotation) mod N)·R + i div N + row_offset_in_shard` of its stack's
`[N·R, padded_dim]` array, R being the stack's rows per partition shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..optimizers import init_slots
from ..specs import Initializer
from ..stacking import StackingPlan
from ._contract import check_mesh
from ._lookup import DEFAULT_AXIS
from ._memory import check_memory
from ._placement import place_rows
from ._variables import EmbeddingVariables


def _physical_rows(plan: StackingPlan, table: str, count: int) -> np.ndarray:
    setting = plan.table_settings[table]
    n = plan.num_partitions
    rows_per_shard = plan.stacks[setting.stack_name].vocab_size // n
    ids = np.arange(count, dtype=np.int64)
    return ((ids % n + setting.shard_rotation) % n) * rows_per_shard + ids // n + (
        setting.row_offset_in_shard
    )


def shard(plan: StackingPlan, tables: Mapping[str, np.ndarray], *, fill: float = 0.0
          ) -> dict[str, np.ndarray]:
    """Per-table `[vocab, dim]` arrays → per-stack `[N·R, padded_dim]` arrays (numpy).

    Padding rows and columns hold `fill`. Works for tables and for slot variables.
    The result is float32 (exact for half-precision inputs); cast a table to its
    stack's `weights_dtype` before passing it to the ops.
    """
    missing = sorted(set(plan.tables) - set(tables))
    if missing:
        raise ValueError(f"shard: no array for tables {missing}.")
    out = {name: np.full((s.vocab_size, s.embedding_dim), fill, np.float32)
           for name, s in plan.stacks.items()}
    for name, spec in plan.tables.items():
        array = np.asarray(tables[name], np.float32)
        if array.shape != (spec.vocab_size, spec.embedding_dim):
            raise ValueError(
                f"shard: table {name!r} has shape {array.shape}; expected "
                f"{(spec.vocab_size, spec.embedding_dim)}."
            )
        stack = plan.table_settings[name].stack_name
        out[stack][_physical_rows(plan, name, spec.vocab_size), : spec.embedding_dim] = array
    return out


def unshard(plan: StackingPlan, stacked: Mapping[str, np.ndarray | jax.Array]
            ) -> dict[str, np.ndarray]:
    """Per-stack arrays → per-table `[vocab, dim]` numpy arrays (the inverse of `shard`)."""
    out = {}
    for name, spec in plan.tables.items():
        stack = plan.table_settings[name].stack_name
        array = np.asarray(stacked[stack])
        out[name] = array[_physical_rows(plan, name, spec.vocab_size), : spec.embedding_dim]
    return out


@functools.cache
def _default_initializer(dim: int):
    return jax.nn.initializers.truncated_normal(stddev=1.0 / np.sqrt(dim))


StackSignature = tuple[int, tuple[tuple[Initializer, int], ...], np.dtype]


def _stack_signature(plan: StackingPlan, stack: str) -> StackSignature:
    """What the stack's initial values depend on besides the key: its padded dim,
    per table in stack order the initializer and the rows per partition shard, and
    the storage dtype."""
    spec = plan.stacks[stack]
    n = plan.num_partitions
    parts = []
    for table_name in spec.table_names:
        table = plan.tables[table_name]
        init = table.initializer or _default_initializer(table.embedding_dim)
        parts.append((init, plan.table_settings[table_name].padded_vocab_size // n))
    return spec.embedding_dim, tuple(parts), spec.weights_dtype


@functools.cache
def _plan_initializer(num_partitions: int, stacks: tuple[StackSignature, ...]
                      ) -> Callable[[jax.Array], tuple[jax.Array, ...]]:
    """`key -> (table per stack)`, every stack in one compiled program (cached per layout).

    The key is split once per stack and each stack's key once per partition shard;
    every table's initializer runs per shard key with shape `(rows, dim)`, and the
    shards' rows (tables side by side) are laid out as `[N·R, dim]`. Initializers
    draw float32 values; a half-precision stack rounds them to nearest once.

    Each `(table, shard)` block is written in place into the stack's buffer by a loop
    over the shards, so the program holds the stacks plus one block's temporaries at a
    time. Building each table whole and concatenating held a second copy of the table
    on top of the initializer's own temporaries (measured on the `criteo26` tables with
    a constant initializer: a peak of 1.85 times the tables' size, now 1.09). A loop
    rather than a vmap: vmapping threefry compiles several times slower on CPU.
    """

    def init_stack(key: jax.Array, signature: StackSignature) -> jax.Array:
        dim, parts, dtype = signature
        shard_keys = jax.random.split(key, num_partitions)
        rows_per_shard = sum(rows for _, rows in parts)
        table = jnp.zeros((num_partitions, rows_per_shard, dim), dtype)
        offset = 0
        for init, rows in parts:
            table = jax.lax.fori_loop(
                0, num_partitions,
                functools.partial(_write_block, init, (rows, dim), offset, shard_keys), table)
            offset += rows
        return table.reshape(-1, dim)

    def init_all(key: jax.Array) -> tuple[jax.Array, ...]:
        keys = jax.random.split(key, len(stacks))
        return tuple(init_stack(k, sig) for k, sig in zip(keys, stacks, strict=True))

    return jax.jit(init_all)


def _write_block(init: Initializer, shape: tuple[int, int], offset: int,
                 shard_keys: jax.Array, shard: jax.Array, table: jax.Array) -> jax.Array:
    """`table[shard, offset:offset + rows]` ← `init(shard_keys[shard], shape)`, rounded to
    the table's dtype."""
    block = jnp.asarray(init(shard_keys[shard], shape, jnp.float32), jnp.float32)
    return jax.lax.dynamic_update_slice(table, block.astype(table.dtype)[None],
                                        (shard, offset, 0))


def init_tables(
    plan: StackingPlan,
    key: jax.Array,
    *,
    mesh: Mesh | None = None,
    axis: str = DEFAULT_AXIS,
    on_host: bool = False,
) -> dict[str, EmbeddingVariables]:
    """Fresh variables for every stack: tables from their initializers, constant slots.

    A table is stored in its stack's `weights_dtype` (float32, bfloat16 or float16);
    optimizer slots are float32 whatever the table's dtype, as FBGEMM keeps its
    momentum in float32: a slot such as Adagrad's accumulator only grows, and in 8
    mantissa bits its increments would soon fall below half a unit in the last place,
    while the slots are read and written only for touched rows (no lookup traffic).

    Each table's initializer is called per partition shard with shape
    `(padded_vocab/N, padded_dim)` (padding rows included), one key per shard
    shared by the stack's tables, as the reference does. All stacks are computed by
    one jitted program, compiled once per layout (stacks, tables, shard shapes and
    initializers) and cached: a second call with the same layout does not compile.
    With `on_host` the values are computed on the CPU and then transferred;
    otherwise on the default device. Raises `MemoryError` first when the variables
    cannot fit at all (`check_memory`).
    """
    if mesh is not None:
        check_mesh(plan, mesh, axis, "init_tables")
    check_memory(plan, mesh=mesh)
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(axis, None))
    initialize = _plan_initializer(
        plan.num_partitions, tuple(_stack_signature(plan, name) for name in plan.stacks))
    with jax.default_device(jax.local_devices(backend="cpu")[0] if on_host else None):
        tables = initialize(key)
    out = {}
    for (name, spec), table in zip(plan.stacks.items(), tables, strict=True):
        table = jax.device_put(table, sharding) if sharding is not None else table
        slots = init_slots(spec.optimizer, (spec.vocab_size, spec.embedding_dim),
                           sharding=sharding)
        out[name] = EmbeddingVariables(table, slots)
    # device_put does not constrain a traced result (init under jit): pin the rows too.
    return place_rows(out, mesh, axis)


def use_huge_pages(*trees: object) -> int:
    """Move the tables (any arrays) in `trees` onto transparent huge pages where they sit in
    CPU memory; the bytes moved.

    Lookups and updates read rows at random; a table on 4 KiB pages misses the TLB on
    almost every row, on 2 MiB pages it rarely does (criteo26 on 2 AMD EPYC vCPUs, the
    same tables either way in one process: the forward 4.00 → 3.46 ms, an SGD step
    17.2 → 16.2 ms). Call it once the tables exist: the pages
    are moved now, at about 2.5 s per GB, and stay huge while the buffers live (the
    training step donates the tables and the CPU kernels update them in place). Does
    nothing (returns 0) for arrays on other devices, off Linux, or where the kernel's
    transparent huge pages are off or older than Linux 6.1.
    """
    from .cpu._huge_pages import collapse_to_huge_pages

    return collapse_to_huge_pages(*trees)
