"""Click data in Parquet: a label column, dense number columns, sparse ID columns.

A sparse column holds one ID per sample (a one-hot feature) or a list of them
(`list<…>`: any number per sample, a multi-hot feature); each is a feature with
its own table of the same name, unless `ClickColumns.shared_tables` puts several
on one table. IDs are integers, taken modulo the table's vocabulary (IDs in
range are unchanged), or strings (`string`, `large_string`, dictionary-encoded),
hashed into it as the Criteo reader hashes its hexadecimal values (`_hashing`:
stable across runs and processes). A null ID or null list is a sample without
IDs (an empty string is a value like any other). Dense values are used as they
are (float32), null → 0. Bad rows (a null label or one other than 0/1, a dense
value that is not finite, a null inside a list) raise `BadRowError` naming file,
row and column, or are counted and skipped. The files are read by record batches
(`pyarrow.parquet.ParquetFile.iter_batches`), never whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import numpy as np

from ..preprocessing import Ragged
from ._clicks import ClickBatch
from ._criteo import BadRowError
from ._files import _pyarrow  # pyright: ignore[reportPrivateUsage]
from ._hashing import integer_ids, string_ids

SCHEMA_KEY = b"tilecore.clicks"
"""Key of the file metadata (JSON: label, dense, sparse with vocab_size and max_ids)
that `write_sample` stores and the reader uses when no option says otherwise."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParquetLayout:
    """Where the parts of a sample are: the files and the columns with their roles."""

    files: tuple[Path, ...]
    label: str
    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    is_list: tuple[bool, ...]
    vocab_sizes: tuple[int, ...]

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.sparse]


def compute() -> Any:
    """`pyarrow.compute` (untyped: its functions are generated at import)."""
    import pyarrow.compute as pc

    return pc


def _row_problems(batch: Any, layout: ParquetLayout) -> list[tuple[np.ndarray, str, str]]:
    """(bad-row mask, column, reason) for each check that some row of `batch` fails."""
    pc = compute()
    n, out = batch.num_rows, []
    label = batch.column(layout.label)
    values = np.asarray(label.fill_null(0).to_numpy(zero_copy_only=False), np.float64)
    bad = np.asarray(label.is_null().to_numpy(zero_copy_only=False)) | ~np.isin(values, (0, 1))
    out.append((bad, layout.label, "the label must be 0 or 1"))
    for name in layout.dense:
        column = batch.column(name).fill_null(0)
        dense = np.asarray(column.to_numpy(zero_copy_only=False), np.float64)
        out.append((~np.isfinite(dense), name, "dense values must be finite numbers"))
    for name, is_list in zip(layout.sparse, layout.is_list, strict=True):
        column = batch.column(name)
        if is_list and column.flatten().null_count:
            bad = np.zeros(n, bool)
            parents = pc.list_parent_indices(column).to_numpy()
            bad[parents[np.asarray(column.flatten().is_null().to_numpy(zero_copy_only=False))]] = True
            out.append((bad, name, "a list of IDs may not hold nulls (a null list is no IDs)"))
    return [(mask, name, reason) for mask, name, reason in out if mask.any()]


def _plain_lists(pa: Any, kind: Any) -> Any:
    """`kind` with every list's dictionary-encoded values replaced by their value type
    (`kind` itself where it has none)."""
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return kind
    value = kind.value_type
    plain = value.value_type if pa.types.is_dictionary(value) else _plain_lists(pa, value)
    if plain == value:
        return kind
    return (pa.large_list if pa.types.is_large_list(kind) else pa.list_)(
        kind.value_field.with_type(plain))


class ParquetReader:
    """One pass over the files of `layout`: `take` valid rows, `parse` them into a batch.

    `on_bad`: called with the `BadRowError` of each bad row, which is then
    skipped; None raises it.
    """

    def __init__(self, layout: ParquetLayout, rows: int,
                 on_bad: Callable[[BadRowError], None] | None) -> None:
        self.layout, self.on_bad = layout, on_bad
        self._pa, self._pq = _pyarrow(layout.files[0])
        self._batches = self._record_batches(rows)
        self._pending: list[Any] = []
        self._pending_rows = 0
        self._done = 0
        self._total = sum(self._pq.ParquetFile(f).metadata.num_rows for f in layout.files)
        schema = self._pq.ParquetFile(layout.files[0]).schema_arrow
        self._schema = self._pa.schema([schema.field(name) for name in layout.columns])
        self._plain = self._pa.schema([f.with_type(_plain_lists(self._pa, f.type))
                                       for f in self._schema])
        """The schema of the batches read (`_file_batches`)."""

    def _record_batches(self, rows: int) -> Generator[Any, None, None]:
        for path in self.layout.files:
            file = self._pq.ParquetFile(path)
            for field in self._schema:
                have = file.schema_arrow.field(field.name).type if (
                    field.name in file.schema_arrow.names) else "no such column"
                if have != field.type:
                    raise ValueError(f"{path}: column {field.name!r} is {have}, but "
                                     f"{self.layout.files[0]} has {field.type}; the files of "
                                     "one data set need the same columns and types.")
            first = 0
            for batch in self._file_batches(path, file, rows):
                yield self._check(path, first, batch)
                first += batch.num_rows
                self._done += batch.num_rows

    def _file_batches(self, path: Path, file: Any, rows: int) -> Any:
        """The file's record batches of the layout's columns, at most `rows` each.

        pyarrow's Parquet reader cannot stream a list of dictionary-encoded values
        (`list<dictionary<string>>`: "Nested data conversions not implemented for chunked
        array outputs"), so a file with such a column is scanned as a dataset whose
        schema reads those lists' values plainly (the same strings, so the same IDs).
        """
        columns = self.layout.columns
        if self._plain == self._schema:
            return file.iter_batches(batch_size=rows, columns=columns)
        import pyarrow.dataset as ds
        scan = ds.dataset(path, format="parquet", schema=self._plain)
        return scan.to_batches(batch_size=rows, columns=columns)

    def _check(self, path: Path, first: int, batch: Any) -> Any:
        problems = _row_problems(batch, self.layout)
        if not problems:
            return batch
        bad = np.zeros(batch.num_rows, bool)
        for row in sorted({int(i) for mask, _, _ in problems for i in np.flatnonzero(mask)}):
            column, reason = next((c, r) for m, c, r in problems if m[row])
            value = batch.column(column)[row].as_py()
            error = BadRowError(path, first + row + 1, column, f"{reason}, got {value!r}",
                                unit="row")
            if self.on_bad is None:
                raise error
            self.on_bad(error)
            bad[row] = True
        return batch.filter(self._pa.array(~bad))

    def take(self, rows: int) -> tuple[Any, int]:
        """A table of up to `rows` valid rows (fewer only at the end) and its row count."""
        while self._pending_rows < rows:
            batch = next(self._batches, None)
            if batch is None:
                break
            self._pending.append(batch)
            self._pending_rows += batch.num_rows
        table = self._pa.Table.from_batches(self._pending, schema=self._plain)
        head, tail = table.slice(0, rows), table.slice(rows)
        self._pending, self._pending_rows = tail.to_batches(), tail.num_rows
        return head, head.num_rows

    def parse(self, table: Any) -> ClickBatch:
        return parse_table(table, self.layout)

    @property
    def progress(self) -> tuple[int, int]:
        """Rows of the files read so far, and their number."""
        return self._done, self._total

    def close(self) -> None:
        self._batches.close()


def parse_table(table: Any, layout: ParquetLayout) -> ClickBatch:
    """Rows checked by `ParquetReader.take` → a batch (features named as the columns)."""
    pc = compute()
    n = table.num_rows
    labels = np.asarray(table.column(layout.label).combine_chunks().to_numpy(
        zero_copy_only=False), np.float32)
    dense = np.zeros((n, len(layout.dense)), np.float32)
    for j, name in enumerate(layout.dense):
        column = table.column(name).combine_chunks().fill_null(0)
        dense[:, j] = column.to_numpy(zero_copy_only=False)
    sparse = {}
    for name, is_list, vocab in zip(layout.sparse, layout.is_list, layout.vocab_sizes,
                                    strict=True):
        column = table.column(name).combine_chunks()
        if is_list:
            counts = pc.list_value_length(column).fill_null(0).to_numpy()
            ids = column.flatten()
        else:
            counts = ~np.asarray(column.is_null().to_numpy(zero_copy_only=False))
            ids = column.drop_null()
        splits = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=splits[1:])
        sparse[name] = Ragged(table_rows(ids, vocab), splits)
    return ClickBatch(sparse=sparse, dense=dense, labels=labels)


def table_rows(ids: Any, vocab_size: int) -> np.ndarray:
    """The rows of an Arrow array of IDs without nulls: integers, or strings hashed (each
    distinct string once) by the one hash of `_hashing`."""
    import pyarrow as pa

    if pa.types.is_dictionary(ids.type):
        ids = ids.dictionary_decode()
    if pa.types.is_integer(ids.type):
        return integer_ids(np.asarray(ids.to_numpy(zero_copy_only=False)), vocab_size)
    encoded = compute().dictionary_encode(ids)
    strings = encoded.dictionary.to_pylist()
    rows = string_ids(strings, len(strings), vocab_size)
    return rows[np.asarray(encoded.indices.to_numpy(zero_copy_only=False), np.int64)]
