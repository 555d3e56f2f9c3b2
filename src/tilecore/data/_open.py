"""Open click data of any supported kind as a `ClickSource`, picked by what the path is.

- `*.tsv`, `*.txt` (optionally `.gz`; gzip is also recognised by its content):
  Criteo-format logs (`_criteo`), 26 features `C1` … `C26` (a table each, or shared
  as `ClickColumns.shared_tables` says), 13 dense.
- `*.parquet`, or a directory of them: Parquet click data (`_parquet`): integer or
  string IDs, a table per column or shared as `ClickColumns.shared_tables` says.
- a directory with `clicks.json`: `.npz` click files (`write_click_files`), which
  fix their own batch size and vocabularies.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ._click_files import SCHEMA_FILE, ClickSource, load_click_files
from ._click_specs import features_by_table, shared_table_of
from ._clicks import ClickFeature
from ._criteo import COLUMNS, NUM_CATEGORICAL, NUM_INTEGER, CriteoReader, parse_lines
from ._parquet import ParquetReader, parse_table
from ._parquet_layout import parquet_layout
from ._read_options import ClickColumns, ReadOptions
from ._stream import OpenReader, Parse, StreamedClicks

TSV_SUFFIXES = (".tsv", ".txt", ".tsv.gz", ".txt.gz")


def data_kind(path: Path) -> str:
    """`"criteo-tsv"`, `"parquet"` or `"npz"`: how `open_click_data` reads `path`."""
    name = path.name.lower()
    if path.is_dir():
        if (path / SCHEMA_FILE).is_file():
            return "npz"
        if any(path.glob("*.parquet")):
            return "parquet"
        raise ValueError(f"{path}: a directory without {SCHEMA_FILE} (click files) or *.parquet "
                         "files; write a sample with `tilecore data --out DIR` to compare.")
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory.")
    if name.endswith(TSV_SUFFIXES):
        return "criteo-tsv"
    if name.endswith(".parquet"):
        return "parquet"
    raise ValueError(f"{path}: unknown kind of data {path.suffix!r}; use Criteo TSV "
                     f"({', '.join(TSV_SUFFIXES)}), .parquet (a file or a directory of them), or "
                     f"a directory of .npz click files (with {SCHEMA_FILE}).")


def _tsv(path: Path, options: ReadOptions
         ) -> tuple[tuple[ClickFeature, ...], int, OpenReader, Parse]:
    names = COLUMNS[1 + NUM_INTEGER:]
    columns = options.columns
    fixed = [f"{role}={value!r}" for role, value, default in (
        ("label", columns.label, ClickColumns().label), ("dense", columns.dense, None),
        ("sparse", columns.sparse, None)) if value != default]
    if fixed:
        raise ValueError(f"{path}: Criteo TSV has fixed columns (label, I1 … I13, C1 … C26), "
                         f"so column roles cannot be chosen ({', '.join(fixed)}); only shared "
                         "tables of C1 … C26 can.")
    vocab = options.vocab_for(names, None, str(path))
    tables = shared_table_of(names, columns.shared_tables, str(path),
                             hint="a Criteo TSV file's are C1 … C26")
    features = tuple(ClickFeature(name=n, vocab_size=v, table=t)
                     for n, v, t in zip(names, vocab, tables, strict=True))
    features_by_table(features, str(path))  # a shared table's columns agree on its size
    assert len(features) == NUM_CATEGORICAL
    return (features, NUM_INTEGER, functools.partial(CriteoReader, path, vocab),
            functools.partial(parse_lines, vocab_sizes=vocab))


def _parquet(path: Path, options: ReadOptions
             ) -> tuple[tuple[ClickFeature, ...], int, OpenReader, Parse]:
    layout, features = parquet_layout(path, options)
    return (features, len(layout.dense),
            functools.partial(ParquetReader, layout, options.batch_size),
            functools.partial(parse_table, layout=layout))


def open_click_data(path: str | os.PathLike[str], options: ReadOptions | None = None
                    ) -> ClickSource:
    """Click data at `path` (Criteo TSV, Parquet or `.npz` click files) as a `ClickSource`.

    TSV and Parquet are streamed (see `ReadOptions` for batches, vocabularies and
    held-out data); `.npz` click files are read one file per batch.

    Raises:
      ValueError: `path` is none of these, or a file does not match its kind;
        `BadRowError` (a ValueError) names the file, line or row and column of a
        row that cannot be read (unless `options.skip_bad_rows`).
    """
    path, options = Path(path), options or ReadOptions()
    kind = data_kind(path)
    if kind == "npz":
        return load_click_files(path)
    read = _tsv if kind == "criteo-tsv" else _parquet
    features, num_dense, train, parse = read(path, options)
    eval_reader = None
    if options.eval_path is not None:
        eval_path = Path(options.eval_path)
        if data_kind(eval_path) != kind:
            raise ValueError(f"{eval_path}: held-out data must be of the kind of {path} ({kind}).")
        eval_features, eval_dense, eval_reader, _ = read(eval_path, options)
        def names(fs: tuple[ClickFeature, ...]) -> list[tuple[str, int, str]]:
            return [(f.name, f.vocab_size, f.table_name) for f in fs]

        if names(eval_features) != names(features) or eval_dense != num_dense:
            raise ValueError(f"{eval_path}: its features {[f.name for f in eval_features]} and "
                             f"{eval_dense} dense differ from {path}'s "
                             f"{[f.name for f in features]} and {num_dense}.")
    return StreamedClicks(name=str(path), features=features, num_dense=num_dense,
                          batch_size=options.batch_size, train=train, parse=parse,
                          held_out=options.held_out_batches, eval_reader=eval_reader,
                          skip_bad_rows=options.skip_bad_rows, progress=options.progress,
                          eval_name=None if options.eval_path is None else str(options.eval_path))
