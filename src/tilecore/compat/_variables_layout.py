"""Whether `init_embedding_variables` can lay a stack out over the partitions it is given.

The variables are built per partition (SparseCore): partition p's rows are each
table's `padded_vocab_size / N` rows, in `row_offset_in_shard` order, with
`N = mesh devices × num_sparsecore_per_device`. That is the layout the specs
recorded only when they were stacked for the same N. The reference does not
check it: a stack of two tables prepared for 4 SparseCores and initialised with
2 puts rows of one table where lookups read the other (verified: each table
then holds both initializers' values). A stack of one table has no such
conflict (any N that splits its rows is a valid layout), so it is accepted as
the reference accepts it.

Specs never prepared (no `prepare_feature_specs_for_training`) keep their raw
sizes; the reference initialises them as they are. That equals the prepared
variables when the sizes are already padded for N (a multiple of `8·N` rows, of
8 columns), and gives a table no lookup can use otherwise: refused, naming the
table and the padded sizes preparation gives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..stacking import round_up
from ._integers import whole
from ._specs import TableSpec


def _topology(devices: int, sc_per_device: int) -> str:
    return (f"{devices} device(s) x num_sparsecore_per_device={sc_per_device} "
            f"({devices * sc_per_device} partitions)")


def _check_unprepared(table: TableSpec, devices: int, sc_per_device: int) -> None:
    owner = f"TableSpec {table.name!r}"
    vocab = whole(owner, "vocabulary_size", table.vocabulary_size)
    dim = whole(owner, "embedding_dim", table.embedding_dim)
    padded = (round_up(vocab, 8 * devices * sc_per_device), round_up(dim, 8))
    if (vocab, dim) != padded:
        raise ValueError(
            f"init_embedding_variables: table {table.name!r} was never prepared (it holds no "
            f"stacking information), and its vocabulary_size={vocab}, embedding_dim={dim} are "
            f"not padded for {_topology(devices, sc_per_device)}: preparation makes it "
            f"{padded[0]} x {padded[1]}, so these variables would not fit the stack that "
            "preprocessing and the lookups use. Call embedding.prepare_feature_specs_for_"
            "training(feature_specs, global_device_count, num_sc_per_device) first, then pass "
            "embedding.get_table_specs(feature_specs)."
        )


def check_layout(stacks: Mapping[str, Sequence[TableSpec]], devices: int,
                 sc_per_device: int) -> None:
    """Every stack (its tables in `row_offset_in_shard` order) fits `devices × sc_per_device`
    partitions as its specs record it; see the module docstring.

    Raises:
      ValueError: naming the stack, the table, and the rows it starts at against the
        rows the tables before it take over these partitions.
    """
    partitions = devices * sc_per_device
    for name, tables in stacks.items():
        rows = 0
        for table in tables:
            if not table.is_stacked():
                _check_unprepared(table, devices, sc_per_device)
            setting = table.setting_in_stack
            if setting.padded_vocab_size % partitions:
                raise ValueError(
                    f"init_embedding_variables: stack {name!r}: table {table.name!r} has "
                    f"padded_vocab_size={setting.padded_vocab_size}, which does not split over "
                    f"{_topology(devices, sc_per_device)}; the specs were prepared for another "
                    "topology. Pass the mesh and num_sparsecore_per_device they were prepared "
                    "for, or prepare them again for this one."
                )
            if setting.row_offset_in_shard != rows:
                raise ValueError(
                    f"init_embedding_variables: stack {name!r} was prepared for another number "
                    f"of SparseCores: table {table.name!r} starts at row "
                    f"{setting.row_offset_in_shard} of each partition's shard, but over "
                    f"{_topology(devices, sc_per_device)} the tables before it take {rows} rows, "
                    "so its rows would be initialised with another table's initializer. Pass "
                    "the mesh and num_sparsecore_per_device the specs were prepared for, or "
                    "prepare them again for this topology."
                )
            rows += setting.padded_vocab_size // partitions
