"""Rows of stacked tables for rows of their tables, as an `EmbeddingSpecProto` lays them out.

The reference's `get_row_ids_in_stacked_table(s)`: serving and debugging tools
use them to read a table's rows straight out of a stacked checkpoint.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np

from ._proto_tables import layout_specs, stacks_of
from ._protos import as_message
from .lib.proto import embedding_spec_pb2 as pb


def _row_ids(table: pb.TableSpecProto, row_ids: Sequence[int]) -> np.ndarray:
    """`row_ids` as int64, checked to be a flat sequence of integers in `[0, vocab_size)`."""
    ids = np.asarray(row_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise TypeError(
            f"Table {table.table_name!r}: row_ids must be a flat sequence of integers, got "
            f"{type(row_ids).__name__} with shape {ids.shape} and dtype {ids.dtype}."
        )
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= table.vocab_size)]
    if bad.size:
        raise ValueError(
            f"Table {table.table_name!r}: row ids {bad[:8].tolist()} are outside the "
            f"vocabulary [0, {table.vocab_size}) (available vocabulary size "
            f"[{table.vocab_size}])."
        )
    return ids


def get_row_ids_in_stacked_table(
    stack_table_spec: pb.StackedTableSpecProto,
    table_spec: pb.TableSpecProto,
    row_ids: Sequence[int],
) -> list[int]:
    """The rows of `stack_table_spec`'s stacked table that hold rows `row_ids` of `table_spec`.

    `table_spec` must be one of the stack's tables. Row `i` lives in shard
    `(i mod N + shard_rotation) mod N`, at row `row_offset_in_shard + i div N` of
    that shard's `stack_vocab_size / N` rows.
    """
    from .lib.nn.table_stacking import compute_physical_row_ids  # deferred: it imports us

    stack = as_message(stack_table_spec, pb.StackedTableSpecProto, "stack_table_spec")
    table = as_message(table_spec, pb.TableSpecProto, "table_spec")
    layout_specs(stack)  # the stack's layout is consistent
    own = {t.table_name: t for t in stack.table_specs}
    if own.get(table.table_name) != table:
        raise ValueError(
            f"table_spec {table.table_name!r} is not one of the tables of stack "
            f"{stack.stack_name!r} ({sorted(own)}) as the stack describes it; pass the "
            "TableSpecProto from stack_table_spec.table_specs."
        )
    rows = compute_physical_row_ids(
        stack.num_sparsecores, stack.stack_vocab_size, table.shard_rotation,
        table.row_offset_in_shard, _row_ids(table, row_ids),
    )
    return [int(r) for r in rows]


def get_row_ids_in_stacked_tables(
    embedding_spec_proto: pb.EmbeddingSpecProto,
    row_ids: Mapping[str, Sequence[int]],
) -> Mapping[str, Sequence[int]]:
    """Stack name → stacked-table rows of the given rows of its tables (in proto table order).

    `row_ids` maps table names to their row ids; every name must be a table of
    the proto. Stacks none of whose tables are asked for are absent.
    """
    stacks = stacks_of(embedding_spec_proto, "embedding_spec_proto")
    known = {t.table_name for s in stacks for t in s.table_specs}
    unknown = sorted(set(row_ids) - known)
    if unknown:
        raise ValueError(f"row_ids names tables {unknown} that the EmbeddingSpecProto does not "
                         f"have (it has {sorted(known)}).")
    out: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
    for stack in stacks:
        for table in stack.table_specs:
            if table.table_name in row_ids:
                out[stack.stack_name].extend(
                    get_row_ids_in_stacked_table(stack, table, row_ids[table.table_name]))
    return out
