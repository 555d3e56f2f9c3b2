"""`tilecore data`: write synthetic click data in every format `--data` reads; and the
options that say how `train --data` and `limits --data` read a file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

from tilecore import data

from .._fits import check_disk
from .._options import output_dir, positive_int, seed_int

FORMATS = get_args(data.SampleFormat)
DISK_BYTES_PER_ROW = {"criteo-tsv": 224, "criteo-tsv-gz": 64, "parquet": 32, "npz": 128}
"""Least bytes a row of each format takes on disk (261, 98, 57 and 148 measured over
20,480 rows: compression varies a little with the IDs drawn)."""


def _names(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated column names."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"must be column names separated by commas, got {text!r}")
    return names


def _shared_table(text: str) -> tuple[str, tuple[str, ...]]:
    """argparse type: `TABLE=A,B,...`, a table and the sparse columns that look it up."""
    table, equals, columns = text.partition("=")
    if not equals or not table.strip():
        raise argparse.ArgumentTypeError(f"must be TABLE=COLUMN,COLUMN,..., got {text!r}")
    return table.strip(), _names(columns)


def add_read_options(p: argparse.ArgumentParser, *, eval_data: bool) -> None:
    """The flags of `--data` files other than the data path and batch size (`--eval-data`
    only for a command that evaluates)."""
    if eval_data:
        p.add_argument("--eval-data", type=Path, default=None, metavar="PATH",
                       help="held-out data in the format of --data (e.g. a later day of logs; "
                            "default: the first --eval-batches batches of --data are held out "
                            "and never trained on)")
    p.add_argument("--skip-bad-rows", action="store_true",
                   help="count and skip rows of --data that cannot be read (a warning gives "
                        "the count) instead of stopping at the first, naming file, line and "
                        "column")
    p.add_argument("--label-column", default=None, metavar="NAME",
                   help="Parquet: the label column (default: the file's schema, else label)")
    p.add_argument("--dense-columns", type=_names, default=None, metavar="A,B,...",
                   help="Parquet: the dense columns (default: every float column)")
    p.add_argument("--sparse-columns", type=_names, default=None, metavar="A,B,...",
                   help="Parquet: the ID columns, a feature each: integer or string IDs (strings "
                        "are hashed into the table as TSV hexadecimal values are), or lists of "
                        "them (default: every such column)")
    p.add_argument("--shared-table", dest="shared_tables", type=_shared_table,
                   action="append", default=None, metavar="TABLE=A,B,...",
                   help="sparse columns A, B, ... (Parquet columns, or C1 ... C26 of a TSV) "
                        "look up one table, TABLE (each stays a feature; they need one "
                        "vocabulary size); repeat for more tables (default: a table per column, "
                        "named as it)")


def read_options(args: argparse.Namespace, *, held_out: int) -> data.ReadOptions:
    """`ReadOptions` from the flags of `add_read_options` plus --batch-size, --vocab-sizes."""
    tables = [table for table, _ in args.shared_tables or ()]
    twice = sorted({t for t in tables if tables.count(t) > 1})
    if twice:
        raise ValueError(f"--shared-table names tables {twice} more than once; list all of a "
                         "table's columns in one --shared-table.")
    shared = dict(args.shared_tables or ())
    try:
        columns = data.ClickColumns(**({} if args.label_column is None
                                       else {"label": args.label_column}),
                                    dense=args.dense_columns, sparse=args.sparse_columns,
                                    shared_tables=shared)
    except ValueError as error:  # name the flags, not the class they fill
        message = str(error).removeprefix("ClickColumns: ")
        raise ValueError(f"{message} (--label-column, default 'label', --dense-columns, "
                         "--sparse-columns and --shared-table give the roles)") from None
    return data.ReadOptions(batch_size=args.batch_size or 1024, vocab_sizes=args.vocab_sizes,
                            held_out_batches=held_out, eval_path=getattr(args, "eval_data", None),
                            skip_bad_rows=args.skip_bad_rows, columns=columns)


def _given(args: argparse.Namespace) -> list[str]:
    return [flag for flag, value in (("--eval-data", getattr(args, "eval_data", None)),
                                     ("--skip-bad-rows", args.skip_bad_rows),
                                     ("--label-column", args.label_column),
                                     ("--dense-columns", args.dense_columns),
                                     ("--sparse-columns", args.sparse_columns),
                                     ("--shared-table", args.shared_tables)) if value]


def check_read_options(args: argparse.Namespace) -> None:
    """Refuse reading flags without `--data` (they would be ignored)."""
    given = _given(args)
    if given and args.data is None:
        raise ValueError(f"{', '.join(given)} read --data files; pass --data PATH too.")


def open_data(args: argparse.Namespace, *, held_out: int) -> data.ClickSource:
    """The click data of `--data` read as the flags say."""
    source = data.open_click_data(args.data, read_options(args, held_out=held_out))
    fixed = [*_given(args), *(["--batch-size"] if args.batch_size else []),
             *(["--vocab-sizes"] if args.vocab_sizes else [])]
    if isinstance(source, data.ClickFiles) and fixed:
        raise ValueError(f"--data {args.data} holds .npz click files, which fix the batch "
                         f"size, vocabularies and held-out batches; drop {', '.join(fixed)}.")
    return source


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "data", help="write synthetic click data in every format --data reads",
        description=(
            "Write a small synthetic click data set (labels from a hidden model, so a model "
            "can learn them) in each --format into --out, to inspect or to train on: "
            "criteo-tsv (clicks.tsv: label, 13 integer and 26 hexadecimal features, "
            "tab-separated, some fields empty), criteo-tsv-gz (clicks.tsv.gz), parquet "
            "(clicks.parquet: label, dense float columns, integer, string and list<integer> "
            "ID columns) and npz (clicks-npz/: .npz click files). Earlier samples there are "
            "replaced."),
    )
    p.add_argument("--out", type=output_dir, required=True, metavar="DIR", help="directory to write")
    p.add_argument("--format", dest="formats", nargs="+", choices=FORMATS, default=None,
                   metavar="FORMAT", help=f"one or more of {', '.join(FORMATS)} (default all)")
    p.add_argument("--rows", type=positive_int, default=10_000,
                   help="rows to write (default 10000)")
    p.add_argument("--batch-size", type=positive_int, default=1024,
                   help="rows per .npz file (npz only; default 1024)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="seed of the data and of the hidden model of its labels (default 0)")
    p.add_argument("--held-out", action="store_true",
                   help="write other rows of the same hidden model, for train --eval-data "
                        "(TSV and Parquet)")
    p.set_defaults(run=run)


def _check_fits(rows: int, kinds: list[str], out: Path) -> None:
    """Refuse `rows` that cannot fit on disk once all `kinds` are written in `out`, before
    any of it is made (every format is written batch by batch: memory is not the bound)."""
    check_disk(rows * sum(DISK_BYTES_PER_ROW[k] for k in kinds), out,
               f"--rows {rows}: the {', '.join(kinds)} files", "use fewer --rows or another --out")


def run(args: argparse.Namespace) -> int:
    kinds = args.formats or [k for k in FORMATS if not (args.held_out and k == "npz")]
    if "npz" in kinds and args.rows < 2 * args.batch_size:  # checked before any file is written
        raise ValueError(
            f"the npz format writes batches of --batch-size {args.batch_size} rows, one to "
            f"train on and at least one held out: it needs --rows >= {2 * args.batch_size}, got "
            f"{args.rows}. Raise --rows, lower --batch-size, or pick other --format values.")
    _check_fits(args.rows, kinds, args.out)
    written = [(kind, data.write_sample(args.out, kind, rows=args.rows, seed=args.seed,
                                        batch_size=args.batch_size, held_out=args.held_out))
               for kind in kinds]
    for kind, path in written:
        print(f"wrote {path} ({kind})")
    kind, path = written[0]
    vocab = " --vocab-sizes 10000" if kind.startswith("criteo") else ""
    if args.held_out:
        print(f"evaluate on it: tilecore train --data TRAINING-DATA --eval-data {path}{vocab}")
    else:
        print(f"train on it: tilecore train --data {path}{vocab} --steps 100")
    return 0
