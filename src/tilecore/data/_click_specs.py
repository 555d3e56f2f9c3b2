"""Click features → feature specs on their tables (one table per feature, or shared)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..specs import FeatureSpec, Initializer, OptimizerSpec, TableSpec
from ._clicks import ClickFeature


def features_by_table(features: Sequence[ClickFeature], where: str = "click data"
                      ) -> dict[str, tuple[ClickFeature, ...]]:
    """The features of each table (`ClickFeature.table_name`), in the order they come.

    Raises:
      ValueError: features of one table with different `vocab_size`s (a table has
        one size), or two features of one name.
    """
    names = [f.name for f in features]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{where}: features {twice} come more than once; name each once.")
    tables: dict[str, list[ClickFeature]] = {}
    for f in features:
        tables.setdefault(f.table_name, []).append(f)
    for table, members in tables.items():
        sizes = sorted({f.vocab_size for f in members})
        if len(sizes) > 1:
            got = {f.name: f.vocab_size for f in members}
            raise ValueError(f"{where}: features {[f.name for f in members]} share table "
                             f"{table!r} but have vocabulary sizes {got}; a table has one size: "
                             "give its features the same (--vocab-sizes, "
                             "ReadOptions.vocab_sizes).")
    return {table: tuple(members) for table, members in tables.items()}


def shared_table_of(sparse: Sequence[str], shared: Mapping[str, tuple[str, ...]], where: str,
                    hint: str = "--sparse-columns names them") -> tuple[str | None, ...]:
    """The table of each sparse column by `shared` (table → its columns; None: a table of
    its own, named as the column): the one rule for every kind of click data.

    Raises:
      ValueError: `shared` names a column that is not one of `sparse` (`hint` says where
        the sparse columns come from), or a table that has the name of a sparse column
        with a table of its own.
    """
    table_of = {column: table for table, columns in shared.items() for column in columns}
    unknown = sorted(set(table_of) - set(sparse))
    if unknown:
        raise ValueError(f"{where}: shared tables name columns {unknown}, which are not sparse "
                         f"columns; the sparse columns are {list(sparse)} ({hint}).")
    clash = sorted(t for t in shared if t in sparse and t not in table_of)
    if clash:
        raise ValueError(f"{where}: shared tables {clash} have the names of sparse columns "
                         "that have tables of their own; name the shared tables otherwise, or "
                         "add those columns to them.")
    return tuple(table_of.get(name) for name in sparse)


def click_feature_specs(features: Sequence[ClickFeature], batch_size: int, *,
                        embedding_dim: int, optimizer: OptimizerSpec | None = None,
                        initializer: Initializer | None = None) -> tuple[FeatureSpec, ...]:
    """A `FeatureSpec` per click feature (input `[batch_size, max_ids]`), on one
    `TableSpec` per table name: features naming one table share it.

    A table's combiner is `sum` when all its features are one-hot, else `mean`
    (a multi-hot feature is pooled by its mean; for a one-hot one the two agree).
    `optimizer` and `initializer`: of every table (None: `TableSpec`'s defaults).

    Raises:
      ValueError: features of one table disagree on `vocab_size` (see
        `features_by_table`).
    """
    extra: dict[str, Any] = {} if optimizer is None else {"optimizer": optimizer}
    tables = {
        table: TableSpec(name=table, vocab_size=members[0].vocab_size,
                         embedding_dim=embedding_dim, initializer=initializer,
                         combiner="sum" if all(f.max_ids == 1 for f in members) else "mean",
                         **extra)
        for table, members in features_by_table(features).items()
    }
    return tuple(FeatureSpec(name=f.name, table=tables[f.table_name],
                             input_shape=(batch_size, f.max_ids)) for f in features)
