"""The roles of a Parquet click file's columns: from options, the file's schema or the types.

The file metadata key `tilecore.clicks` (written by `write_sample`) holds JSON
`{"label": …, "dense": [...], "sparse": [{"name", "vocab_size", "max_ids"}, …]}`
(a sparse entry may add `"table"`: the table it shares), checked key by key
(`_schema_json`: an error names the file and the key); `ReadOptions` override
it. A list column without `max_ids` there gets the longest list in the first
batch of the file (at least 2: a list column is a multi-hot feature, pooled by
its mean). ID columns hold integers or strings (`string`, `large_string`,
dictionary-encoded), or lists of them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._click_specs import features_by_table, shared_table_of
from ._clicks import ClickFeature
from ._files import _pyarrow  # pyright: ignore[reportPrivateUsage]
from ._parquet import SCHEMA_KEY, ParquetLayout, column_types, compute, open_parquet, read_batches
from ._read_options import ClickColumns, ReadOptions
from ._schema_json import check_name, check_names, feature_entries, parse_json, read_object


def parquet_files(path: Path) -> tuple[Path, ...]:
    """`path` itself, or the `*.parquet` files of the directory `path` in name order."""
    if path.is_dir():
        files = tuple(sorted(path.glob("*.parquet")))
        if not files:
            raise ValueError(f"{path}: a directory without *.parquet files.")
        return files
    return (path,)


def _is_id(pa: Any, kind: Any) -> bool:
    """IDs: integers or strings, dictionary-encoded or not."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_id_list(pa: Any, kind: Any) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and _is_id(
        pa, kind.value_type)


def _roles(pa: Any, types: Mapping[str, Any], columns: ClickColumns, saved: dict[str, Any],
           where: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    given = (columns.label, columns.dense, columns.sparse) != ("label", None, None)
    label = columns.label if given or not saved else saved["label"]
    dense, sparse = columns.dense, columns.sparse
    if dense is None and sparse is None and saved:
        dense, sparse = tuple(saved["dense"]), tuple(s["name"] for s in saved["sparse"])
    if sparse is None:
        sparse = tuple(n for n, t in types.items() if n != label and n not in (dense or ())
                       and (_is_id(pa, t) or _is_id_list(pa, t)))
    if dense is None:
        dense = tuple(n for n, t in types.items() if n != label and n not in sparse
                      and pa.types.is_floating(t))
    unknown = sorted({label, *dense, *sparse} - types.keys())
    if unknown:
        raise ValueError(f"{where}: no columns {unknown}; it has {list(types)} (--label-column, "
                         "--dense-columns and --sparse-columns name them).")
    numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)
    for name, role in ((label, "the label"), *((d, "a dense column") for d in dense)):
        if not any(check(types[name]) for check in numeric):
            raise ValueError(f"{where}: column {name!r} is {role} but holds {types[name]}; "
                             "it needs numbers.")
    for name in sparse:
        if not (_is_id(pa, types[name]) or _is_id_list(pa, types[name])):
            raise ValueError(f"{where}: sparse column {name!r} holds {types[name]}; it needs "
                             "IDs, integers or strings (hashed into the table), or lists of "
                             "them. Convert the column, or leave it out (--sparse-columns).")
    if not sparse or not dense:
        raise ValueError(f"{where}: found {len(dense)} dense and {len(sparse)} sparse columns "
                         f"among {list(types)}; the click model needs at least one of each (name "
                         "them with --dense-columns and --sparse-columns).")
    return label, dense, sparse


def parquet_layout(path: Path, options: ReadOptions
                   ) -> tuple[ParquetLayout, tuple[ClickFeature, ...]]:
    """The layout of the Parquet click data at `path` and its features, in column order."""
    pa, _ = _pyarrow(path)
    files = parquet_files(path)
    file = open_parquet(files[0])
    saved = _saved_schema(file.schema_arrow.metadata or {}, files[0])
    types = column_types(file.schema_arrow, str(files[0]))
    label, dense, sparse = _roles(pa, types, options.columns, saved, str(path))
    is_list = tuple(_is_id_list(pa, types[n]) for n in sparse)
    by_name = {s["name"]: s for s in saved.get("sparse", ())}
    schema_vocab = (tuple(by_name[n]["vocab_size"] for n in sparse)
                    if all(n in by_name for n in sparse) else None)
    vocab = options.vocab_for(sparse, schema_vocab, str(path))
    tables = _tables(sparse, options.columns.shared_tables, by_name, str(path))
    layout = ParquetLayout(files=files, label=label, dense=dense, sparse=sparse,
                           is_list=is_list, vocab_sizes=vocab)
    first = next(read_batches(files[0], functools.partial(
        file.iter_batches, batch_size=options.batch_size, columns=list(sparse))), None)
    features = []
    for name, listed, size, table in zip(sparse, is_list, vocab, tables, strict=True):
        max_ids = 1
        if listed:
            longest = 0 if first is None else _longest(first.column(name))
            max_ids = max(2, int(by_name.get(name, {}).get("max_ids", longest)))
        features.append(ClickFeature(name=name, vocab_size=size, max_ids=max_ids, table=table))
    features_by_table(features, str(path))  # a shared table's columns agree on its size
    return layout, tuple(features)


def _saved_schema(metadata: Mapping[bytes, bytes], path: Path) -> dict[str, Any]:
    """The `tilecore.clicks` metadata of the file `path`, checked ({} if it has none)."""
    if SCHEMA_KEY not in metadata:
        return {}
    where = f"{path}: metadata {SCHEMA_KEY.decode()!r}"
    saved = read_object(parse_json(metadata[SCHEMA_KEY], where), where,
                        ("label", "dense", "sparse"))
    check_name(f"{where}: label", saved["label"])
    check_names(f"{where}: dense", saved["dense"])
    feature_entries(saved["sparse"], f"{where}: sparse", optional=("max_ids", "table"))
    return saved


def _tables(sparse: tuple[str, ...], shared: Mapping[str, tuple[str, ...]],
            saved: Mapping[str, Any], where: str) -> tuple[str | None, ...]:
    """The table of each sparse column (None: its own): from `shared`, else the schema."""
    if not shared:
        return tuple(saved.get(name, {}).get("table") for name in sparse)
    return shared_table_of(sparse, shared, where)


def _longest(column: Any) -> int:
    pc = compute()
    lengths = pc.list_value_length(column).fill_null(0)
    return int(pc.max(lengths).as_py() or 0)
