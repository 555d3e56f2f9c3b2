"""How to read click data from files: batch size, vocabularies, held-out data, columns."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from ..specs._numbers import is_integer
from ._checks import MAX_VOCAB_SIZE, check_vocab_size

DEFAULT_VOCAB_SIZE = 100_000
"""Rows of each table when neither `vocab_sizes` nor the file's schema gives them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClickColumns:
    """Which Parquet columns hold what.

    Attributes:
      label: the label column (0 or 1; integer, boolean or float).
      dense: the dense feature columns, in order (None: every floating-point
        column but the label).
      sparse: the ID columns, one feature each: integer or string IDs, or lists
        of them (None: every such column that is not the label or a dense column).
      shared_tables: tables that several sparse columns look up together: table
        name → its columns, e.g. `{"item": ("item", "last_items")}` (each column
        stays a feature of its own; the columns of a table need one vocabulary
        size). A column named nowhere here has a table of its own, named as the
        column. Empty: the file's schema, else a table per column.
    """

    label: str = "label"
    dense: tuple[str, ...] | None = None
    sparse: tuple[str, ...] | None = None
    shared_tables: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in (("dense", self.dense), ("sparse", self.sparse),
                            *((f"shared_tables[{t!r}]", c) for t, c in self.shared_tables.items())):
            if isinstance(value, str):  # it would be read as its characters
                raise ValueError(f"ClickColumns: {name} must be a tuple of column names, got the "
                                 f"string {value!r} (write ({value!r},)).")
        named = [self.label, *(self.dense or ()), *(self.sparse or ())]
        twice = sorted({n for n in named if named.count(n) > 1})
        if twice:
            raise ValueError(f"ClickColumns: columns {twice} have more than one role (label, "
                             "dense, sparse); name each column once.")
        tables = {table: tuple(columns) for table, columns in self.shared_tables.items()}
        object.__setattr__(self, "shared_tables", tables)
        if any(not table or not columns for table, columns in tables.items()):
            raise ValueError(f"ClickColumns: shared_tables must map table names to their "
                             f"columns (at least one), got {tables}.")
        listed = [c for columns in tables.values() for c in columns]
        twice = sorted({c for c in listed if listed.count(c) > 1})
        if twice:
            raise ValueError(f"ClickColumns: columns {twice} are in more than one shared table "
                             f"({tables}); a column looks up one table.")
        roles = {self.label, *(self.dense or ())}
        other = sorted(c for c in listed if c in roles or (
            self.sparse is not None and c not in self.sparse))
        if other:
            raise ValueError(f"ClickColumns: shared tables name columns {other}, which are not "
                             f"sparse columns (sparse={self.sparse}); a table holds sparse "
                             "columns only.")

    def __hash__(self) -> int:  # a value, hashable like the options that hold it
        return hash((self.label, self.dense, self.sparse, tuple(self.shared_tables.items())))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How `open_click_data` reads a Criteo TSV or Parquet file (a click-file directory
    fixes its own batch size and vocabularies).

    Attributes:
      batch_size: samples per batch. The rows after the last full batch of the
        file are not used.
      vocab_sizes: rows of each feature's table (IDs are hashed into them), each in
        [1, `MAX_VOCAB_SIZE`]: one size for every table, or one per sparse feature in order (`C1` … `C26`
        for TSV; features of one shared table need the same size). None: the
        Parquet file's schema, else `DEFAULT_VOCAB_SIZE`.
      held_out_batches: held-out (evaluation) batches. Without `eval_path` they
        are the first batches of the data, and training reads the batches after
        them; with it, the first batches of `eval_path` (cycled if it has fewer).
        0: none (training reads from the first batch; `eval_batch` raises).
      eval_path: a separate held-out file (same format), e.g. a later day of logs.
      skip_bad_rows: count and skip rows that cannot be read (a `BadRowsWarning`
        says how many) instead of raising `BadRowError`.
      columns: the roles of Parquet columns; for TSV (fixed columns) only its
        `shared_tables`, of `C1` … `C26` (other roles raise).
      progress: report long reads (seconds spent skipping to a batch) on stderr.
    """

    batch_size: int = 1024
    vocab_sizes: tuple[int, ...] | None = None
    held_out_batches: int = 4
    eval_path: Path | None = None
    skip_bad_rows: bool = False
    columns: ClickColumns = dataclasses.field(default_factory=ClickColumns)
    progress: bool = True

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("held_out_batches", 0)):
            value = getattr(self, name)
            if not is_integer(value):
                raise ValueError(f"ReadOptions: {name} must be an integer >= {low}, got "
                                 f"{name}={value!r}.")
        if self.vocab_sizes is not None:
            if not isinstance(self.vocab_sizes, tuple | list) or not self.vocab_sizes:
                raise ValueError(f"ReadOptions: vocab_sizes must be a tuple of sizes in [1, "
                                 f"{MAX_VOCAB_SIZE}], got {self.vocab_sizes!r}.")
            object.__setattr__(self, "vocab_sizes", tuple(
                check_vocab_size(f"ReadOptions: vocab_sizes[{k}]", size)
                for k, size in enumerate(self.vocab_sizes)))
        if self.batch_size < 1 or self.held_out_batches < 0:
            raise ValueError(f"ReadOptions: need batch_size >= 1 and held_out_batches >= 0, got "
                             f"batch_size={self.batch_size}, "
                             f"held_out_batches={self.held_out_batches}.")

    def vocab_for(self, names: tuple[str, ...], schema: tuple[int, ...] | None,
                  where: str) -> tuple[int, ...]:
        """The vocabulary of each of the features `names` (of the data at `where`)."""
        sizes = self.vocab_sizes
        if sizes is None:
            return schema if schema is not None else (DEFAULT_VOCAB_SIZE,) * len(names)
        if len(sizes) == 1:
            return sizes * len(names)
        if len(sizes) != len(names):
            raise ValueError(f"{where}: {len(sizes)} vocabulary sizes for {len(names)} sparse "
                             f"features {list(names)}; give one size for all, or one each "
                             "(--vocab-sizes).")
        return sizes
