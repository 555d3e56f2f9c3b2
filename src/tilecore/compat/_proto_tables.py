"""Per-table arrays ⇄ stacked arrays laid out as an `EmbeddingSpecProto` says.

The reference's proto-driven `table_stacking` functions. Each stack of the proto
becomes compat `TableSpec`s carrying just its layout (checked for consistency),
and `_arrays` moves the rows — the same math as
`table_stacking.stack_and_shard_tables`. Values pass through the host (the
arrays must be addressable by this process); results take the input's sharding.
JAX is imported only when arrays are placed, so `import tilecore.compat` stays
free of it.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..stacking import round_up
from ..stacking._build import place_tables
from ._arrays import stack_and_shard_tables, unshard_and_unstack_tables
from ._optimizers import SGDOptimizerSpec
from ._protos import as_message
from ._specs import StackedTableSpec, TableSettingInStack, TableSpec
from .lib.proto import embedding_spec_pb2 as pb

if TYPE_CHECKING:
    import jax

_LAYOUT_ONLY = SGDOptimizerSpec(learning_rate=0.0)
"""Optimizer of the layout specs: moving rows never reads it."""


def _inconsistent(stack: str, what: str) -> ValueError:
    return ValueError(
        f"StackedTableSpecProto {stack!r}: {what}. The EmbeddingSpecProto is inconsistent; "
        "create it with embedding_proto_utils.create_proto_from_feature_specs(feature_specs, "
        "global_device_count, num_sparsecore_per_device)."
    )


def _check_table(stack: pb.StackedTableSpecProto, table: pb.TableSpecProto, offset: int) -> None:
    n, name, where = stack.num_sparsecores, stack.stack_name, f"table {table.table_name!r}"
    if table.vocab_size < 1 or table.embedding_dim < 1:
        raise _inconsistent(name, f"{where} has vocab_size={table.vocab_size}, "
                                  f"embedding_dim={table.embedding_dim} (both must be >= 1)")
    if table.padded_vocab_size != round_up(table.vocab_size, 8 * n):
        raise _inconsistent(name, f"{where} has padded_vocab_size={table.padded_vocab_size}, but "
                                  f"vocab_size={table.vocab_size} pads to "
                                  f"{round_up(table.vocab_size, 8 * n)} over {n} SparseCores")
    if not table.embedding_dim <= table.padded_embedding_dim == stack.stack_embedding_dim:
        raise _inconsistent(name, f"{where} has embedding_dim={table.embedding_dim} and "
                                  f"padded_embedding_dim={table.padded_embedding_dim}; the stack's "
                                  f"stack_embedding_dim is {stack.stack_embedding_dim}")
    if table.row_offset_in_shard != offset:
        raise _inconsistent(name, f"{where} has row_offset_in_shard={table.row_offset_in_shard}; "
                                  f"after the tables before it, it starts at row {offset}")
    if not 0 <= table.shard_rotation < n:
        raise _inconsistent(name, f"{where} has shard_rotation={table.shard_rotation}, outside "
                                  f"[0, {n})")


def layout_specs(stack: pb.StackedTableSpecProto) -> list[TableSpec]:
    """Compat specs with the stack's layout (name, sizes, place in stack), in proto order."""
    n, name = stack.num_sparsecores, stack.stack_name
    if n < 1 or stack.stack_embedding_dim < 1 or not stack.table_specs:
        raise _inconsistent(name, f"num_sparsecores={n}, stack_embedding_dim="
                                  f"{stack.stack_embedding_dim} and {len(stack.table_specs)} tables "
                                  "(each must be >= 1)")
    stacked = StackedTableSpec(
        stack_name=name, stack_vocab_size=stack.stack_vocab_size,
        stack_embedding_dim=stack.stack_embedding_dim, optimizer=_LAYOUT_ONLY, combiner="sum",
        total_sample_count=stack.total_sample_count,
    )
    specs, offset = [], 0
    for table in stack.table_specs:
        _check_table(stack, table, offset)
        spec = TableSpec(name=table.table_name, vocabulary_size=table.vocab_size,
                         embedding_dim=table.embedding_dim, initializer=None,
                         optimizer=_LAYOUT_ONLY, combiner=table.combiner or "sum")
        spec.setting_in_stack = TableSettingInStack(
            stack_name=name, padded_vocab_size=table.padded_vocab_size,
            padded_embedding_dim=table.padded_embedding_dim,
            row_offset_in_shard=table.row_offset_in_shard, shard_rotation=table.shard_rotation)
        spec.stacked_table_spec = stacked
        specs.append(spec)
        offset += table.padded_vocab_size // n
    if offset * n != stack.stack_vocab_size:
        raise _inconsistent(name, f"stack_vocab_size={stack.stack_vocab_size}, but its tables' "
                                  f"padded_vocab_size add up to {offset * n}")
    return specs


def stacks_of(embedding_specs: object, argument: str) -> list[pb.StackedTableSpecProto]:
    """The stacks of an `EmbeddingSpecProto`, checked: at least one, unique stack and table
    names.

    A proto with no stacks (default-constructed, or parsed from empty bytes) would
    stack, unstack or map nothing and return `{}`, hiding the mistake; it is refused.
    """
    proto = as_message(embedding_specs, pb.EmbeddingSpecProto, argument)
    stacks = list(proto.stacked_table_specs)
    if not stacks:
        raise ValueError(
            f"{argument} is an EmbeddingSpecProto with no stacked_table_specs, so there is "
            "nothing to stack, unstack or map (was it default-constructed, or parsed from empty "
            "bytes?). Create it with embedding_proto_utils.create_proto_from_feature_specs("
            "feature_specs, global_device_count, num_sparsecore_per_device)."
        )
    for kind, names in (("stack", [s.stack_name for s in stacks]),
                        ("table", [t.table_name for s in stacks for t in s.table_specs])):
        repeated = sorted(n for n, c in collections.Counter(names).items() if c > 1)
        if repeated:
            raise ValueError(f"{argument} names the {kind}(s) {repeated} more than once; each "
                             f"{kind} must appear once.")
    return stacks


def _is_jax_array(array: Any) -> bool:
    """Whether `array` is a `jax.Array` (never, while JAX is not imported)."""
    jax_module = sys.modules.get("jax")
    return jax_module is not None and isinstance(array, jax_module.Array)


def _sharding(array: Any) -> Any:
    return array.sharding if _is_jax_array(array) else None


def _host(array: Any, what: str) -> np.ndarray:
    if _is_jax_array(array) and not array.is_fully_addressable:
        raise ValueError(f"{what} spans devices of other processes; gather it to this process "
                         "(e.g. jax.experimental.multihost_utils.process_allgather) first.")
    return np.asarray(array)


def _place(values: np.ndarray, sharding: Any, what: str) -> jax.Array:
    """`values` on the devices of `sharding` (None: the default device)."""
    import jax  # deferred: see the module docstring
    import jax.numpy as jnp

    if sharding is None:
        return jnp.asarray(values)
    try:
        sharding.shard_shape(values.shape)
    except ValueError as err:
        raise ValueError(
            f"{what} has shape {values.shape}, which the input's sharding {sharding} cannot "
            f"split ({err}). Pass the input replicated (NamedSharding(mesh, PartitionSpec())) "
            "or on one device."
        ) from None
    return jax.device_put(values, sharding)


def _delete(arrays: Sequence[Any]) -> None:
    for array in arrays:
        if _is_jax_array(array) and not array.is_deleted():
            array.delete()


def stack_and_shard_feature_tables(
    feature_tables: Mapping[str, jax.Array | np.ndarray],
    embedding_specs: pb.EmbeddingSpecProto,
    delete_input: bool = False,
) -> dict[str, jax.Array]:
    """Stack name → `(stack_vocab_size, stack_embedding_dim)` mod-sharded stacked table.

    Every table of the proto must be in `feature_tables` as a
    `(vocab_size, embedding_dim)` array (extra entries are ignored); all share one
    sharding, which the stacked tables take. Padding is 0. With `delete_input`,
    the input jax arrays are deleted once stacked, to lower peak memory.
    """
    if not isinstance(feature_tables, Mapping):
        raise TypeError(f"feature_tables must map table names to arrays, got "
                        f"{type(feature_tables).__name__}.")
    shardings = [(name, _sharding(a)) for name, a in feature_tables.items()]
    for name, sharding in shardings[1:]:
        if sharding != shardings[0][1]:
            raise ValueError(
                f"All feature tables must have the same sharding. Found {sharding} (table "
                f"{name!r}) and {shardings[0][1]} (table {shardings[0][0]!r}); device_put them "
                "with one sharding."
            )
    out = {}
    for stack in stacks_of(embedding_specs, "embedding_specs"):
        specs = layout_specs(stack)
        missing = [s.name for s in specs if s.name not in feature_tables]
        if missing:
            raise ValueError(f"Tables {missing} of stack {stack.stack_name!r} not found in "
                             f"`feature_tables` (it has {sorted(feature_tables)}).")
        arrays = [feature_tables[s.name] for s in specs]
        host = [_host(a, f"Table {s.name!r}") for s, a in zip(specs, arrays, strict=True)]
        stacked = stack_and_shard_tables(specs, host, stack.num_sparsecores, pad_value=0.0)
        values = stacked[stack.stack_name].reshape(-1, stack.stack_embedding_dim)
        dtype = np.result_type(*(h.dtype for h in host))
        out[stack.stack_name] = _place(values.astype(dtype, copy=False), shardings[0][1],
                                       f"Stacked table {stack.stack_name!r}")
        if delete_input:
            _delete(arrays)
    return out


def _check_stacked_shape(stack: pb.StackedTableSpecProto, array: Any) -> None:
    n, vocab, dim = stack.num_sparsecores, stack.stack_vocab_size, stack.stack_embedding_dim
    shape = tuple(np.shape(array))
    if shape not in ((vocab, dim), (n, vocab // n, dim)):
        raise ValueError(
            f"Stacked table {stack.stack_name!r} has shape {shape}; its StackedTableSpecProto "
            f"describes ({vocab}, {dim}) (or ({n}, {vocab // n}, {dim}) per SparseCore). Pass "
            "the stacked table this proto was created for."
        )


def unstack_and_unshard_stacked_tables(
    stacked_tables: Mapping[str, jax.Array | np.ndarray],
    embedding_specs: pb.EmbeddingSpecProto,
    donate: bool = False,
) -> dict[str, jax.Array]:
    """Table name → `(vocab_size, embedding_dim)` array, from the stacks the proto describes.

    Every stack of the proto must be in `stacked_tables` (extra entries are
    ignored); each table takes its stack's sharding. With `donate`, the stacked
    jax arrays are deleted once unstacked, to lower peak memory.
    """
    if not isinstance(stacked_tables, Mapping):
        raise TypeError(f"stacked_tables must map stack names to arrays, got "
                        f"{type(stacked_tables).__name__}.")
    out = {}
    for stack in stacks_of(embedding_specs, "embedding_specs"):
        array = stacked_tables.get(stack.stack_name)
        if array is None:
            raise ValueError(f"Stacked table '{stack.stack_name}' not found in `stacked_tables` "
                             f"(it has {sorted(stacked_tables)}).")
        specs = layout_specs(stack)
        _check_stacked_shape(stack, array)
        host = _host(array, f"Stacked table {stack.stack_name!r}")
        tables = unshard_and_unstack_tables(specs, {stack.stack_name: host},
                                            stack.num_sparsecores)
        for spec, table in zip(specs, tables, strict=True):
            out[spec.name] = _place(table, _sharding(array), f"Table {spec.name!r}")
        if donate:
            _delete([array])
    return out


def compute_table_to_setting_in_stack(
    stack_name: str,
    table_names: Sequence[str],
    padded_embedding_dim: int,
    table_to_padded_vocab_size: Mapping[str, int],
    num_shards: int,
    rotation: int,
) -> dict[str, TableSettingInStack]:
    """Each table's place in stack `stack_name` when stacked in `table_names` order.

    Table k starts, in every shard, after the `padded_vocab / num_shards` rows of
    tables 0..k−1, and gets shard rotation `k·rotation mod num_shards`.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}.")
    repeated = sorted(t for t, c in collections.Counter(table_names).items() if c > 1)
    if repeated:
        raise ValueError(f"Tables {repeated} are repeated in stack {stack_name!r}.")
    for name in table_names:
        if name not in table_to_padded_vocab_size:
            raise ValueError(f"Padded vocab size for Table {name} is missing; "
                             f"table_to_padded_vocab_size has {sorted(table_to_padded_vocab_size)}.")
        vocab = table_to_padded_vocab_size[name]
        if vocab < 1 or vocab % num_shards:
            raise ValueError(f"Table {name!r}: padded vocab size {vocab} must be a positive "
                             f"multiple of num_shards={num_shards}.")
    settings = place_tables(
        stack_name, {t: int(table_to_padded_vocab_size[t]) for t in table_names},
        int(padded_embedding_dim), num_shards, int(rotation),
    )
    return {t: TableSettingInStack(**dataclasses.asdict(s)) for t, s in settings.items()}
