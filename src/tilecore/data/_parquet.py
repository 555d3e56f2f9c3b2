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
(`pyarrow.parquet.ParquetFile.iter_batches`), never whole; a file that pyarrow
cannot open, or whose pages it cannot read, is an error naming it (`DamagedFileError`
past the rows it could read).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..preprocessing import Ragged
from ._checks import DENSE_RULE, LABEL_RULE, bad_dense, bad_labels
from ._clicks import ClickBatch
from ._criteo import BadRowError, DamagedFileError
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


def open_parquet(path: Path) -> Any:
    """The `pyarrow.parquet.ParquetFile` at `path`; a file pyarrow cannot open (empty, cut,
    not Parquet) is a ValueError naming it."""
    pa, pq = _pyarrow(path)
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        raise ValueError(f"{path}: cannot read it as a Parquet file ({type(error).__name__}: "
                         f"{error}).") from error


def read_batches(path: Path, batches: Callable[[], Iterable[Any]]) -> Generator[Any, None, None]:
    """The record batches `batches()` reads from the file `path`; pyarrow's error on a
    damaged page is a `DamagedFileError` naming the file and the rows read before it."""
    pa, _ = _pyarrow(path)
    done = 0
    try:
        iterator = iter(batches())
        while (batch := next(iterator, None)) is not None:
            yield batch
            done += batch.num_rows
    except (OSError, pa.ArrowException) as error:
        raise DamagedFileError(path, done, f"{type(error).__name__}: {error}",
                               unit="row") from error


def column_types(schema: Any, where: str) -> dict[str, Any]:
    """Column name → Arrow type of a file's `schema`; two columns of one name (which
    pyarrow cannot tell apart) are a ValueError naming them."""
    names = list(schema.names)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{where}: columns {twice} come more than once; give each column of "
                         "the file its own name.")
    return {name: schema.field(name).type for name in names}


def _floats(column: Any) -> np.ndarray:
    """A numeric or boolean Arrow column as float64, null → 0."""
    import pyarrow as pa

    cast = compute().cast(column, pa.float64()).fill_null(0.0)
    return np.asarray(cast.to_numpy(zero_copy_only=False), np.float64)


def _row_problems(batch: Any, layout: ParquetLayout) -> list[tuple[np.ndarray, str, str]]:
    """(bad-row mask, column, reason) for each check that some row of `batch` fails."""
    pc = compute()
    n, out = batch.num_rows, []
    label = batch.column(layout.label)
    bad = np.asarray(label.is_null().to_numpy(zero_copy_only=False)) | bad_labels(_floats(label))
    out.append((bad, layout.label, LABEL_RULE))
    for name in layout.dense:
        out.append((bad_dense(_floats(batch.column(name))), name, DENSE_RULE))
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
        self._total = sum(open_parquet(f).metadata.num_rows for f in layout.files)
        schema = open_parquet(layout.files[0]).schema_arrow
        column_types(schema, str(layout.files[0]))
        self._schema = self._pa.schema([schema.field(name) for name in layout.columns])
        self._plain = self._pa.schema([f.with_type(_plain_lists(self._pa, f.type))
                                       for f in self._schema])
        """The schema of the batches read (`_file_batches`)."""

    def _record_batches(self, rows: int) -> Generator[Any, None, None]:
        for path in self.layout.files:
            file = open_parquet(path)
            types = column_types(file.schema_arrow, str(path))
            for field in self._schema:
                have = types.get(field.name, "no such column")
                if have != field.type:
                    raise ValueError(f"{path}: column {field.name!r} is {have}, but "
                                     f"{self.layout.files[0]} has {field.type}; the files of "
                                     "one data set need the same columns and types.")
            first = 0
            for batch in read_batches(path, functools.partial(self._file_batches, path, file,
                                                              rows)):
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
    labels = _floats(table.column(layout.label)).astype(np.float32)
    dense = np.zeros((n, len(layout.dense)), np.float32)
    for j, name in enumerate(layout.dense):
        dense[:, j] = _floats(table.column(name))
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
