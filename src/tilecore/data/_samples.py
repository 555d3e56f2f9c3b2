"""Synthetic samples of every click-data format, drawn from `clicks` (learnable labels).

- `criteo-tsv` / `criteo-tsv-gz` → `clicks.tsv` / `clicks.tsv.gz`: 26 one-hot features
  and 13 dense ones (`clicks` with those sizes). Dense value d is written as the
  integer `floor(exp(d + 1.5) − 1)` (−1 when below 0, as in the real logs), so the
  reader's `log(1 + max(x, 0))` gives back about `d + 1.5`; ID i of feature j as the
  8 hexadecimal digits of a fixed 32-bit mix of (i, j), which the reader hashes
  into its vocabulary. About 2% of the fields are left empty.
- `parquet` → `clicks.parquet`: the default `clicks` features (8; two multi-hot as
  `list<int64>` columns, and one, `STRING_FEATURE`, as strings `"ad-<id>"`, which
  the reader hashes into its table as it does any string), dense columns `d0` …, a
  `label` column, one row group per 1024 rows, and the schema (roles,
  vocabularies) in the file metadata.
- `npz` → `clicks-npz/`: `.npz` click files (`write_click_files`), a fifth of the
  batches held out.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from ..specs._numbers import is_integer
from ._click_files import write_click_files
from ._clicks import ClickBatch, ClickDataset, clicks
from ._parquet import SCHEMA_KEY

SampleFormat = Literal["criteo-tsv", "criteo-tsv-gz", "parquet", "npz"]
SAMPLE_FILES: dict[str, str] = {"criteo-tsv": "clicks.tsv", "criteo-tsv-gz": "clicks.tsv.gz",
                                "parquet": "clicks.parquet", "npz": "clicks-npz"}
_CRITEO_VOCAB = (1000, 5000, 20_000, 50_000, 100_000, 2000, 10_000, 500) * 3 + (300, 3000)
_CHUNK = 1024
STRING_FEATURE = "c01"
"""The Parquet sample's feature written as string IDs (`"ad-<id>"`), the way logs often
hold them."""


def _batches(dataset: ClickDataset, rows: int, held_out: bool
             ) -> Iterator[tuple[ClickBatch, int]]:
    """The first `rows` rows of `dataset`'s training (or held-out) batches: (batch, rows to
    use), made one at a time as the writer takes them (a list of them all held every row
    in memory before the first was written)."""
    get = dataset.eval_batch if held_out else dataset.train_batch
    for i in range(-(-rows // dataset.batch_size)):
        yield get(i), min(dataset.batch_size, rows - i * dataset.batch_size)


def _criteo_lines(batch: ClickBatch, rows: int, seed: int, step: int) -> list[str]:
    rng = np.random.default_rng((seed, step, 7))
    ints = np.floor(np.expm1(batch.dense[:rows].astype(np.float64) + 1.5)).astype(np.int64)
    fields = [[str(int(v)) for v in batch.labels[:rows]]]
    fields += [[str(v) for v in column] for column in ints.T]
    for j, ragged in enumerate(batch.sparse.values()):
        ids = ragged.values[ragged.row_splits[:rows]].astype(np.uint64)
        mixed = (ids * np.uint64(0x9E3779B1) ^ np.uint64(0x85EBCA6B * (j + 1))) & np.uint64(
            0xFFFFFFFF)
        fields.append([f"{v:08x}" for v in mixed.tolist()])
    blank = rng.random((len(fields), rows)) < 0.02
    blank[0] = False  # the label is never empty
    return ["\t".join("" if blank[k, i] else fields[k][i] for k in range(len(fields)))
            for i in range(rows)]


def _write_tsv(path: Path, rows: int, seed: int, held_out: bool, *, gz: bool) -> None:
    dataset = clicks(seed, _CHUNK, vocab_sizes=_CRITEO_VOCAB, multi_hot={}, num_dense=13)
    with (gzip.open(path, "wt", encoding="ascii") if gz
          else open(path, "w", encoding="ascii")) as out:
        for step, (batch, count) in enumerate(_batches(dataset, rows, held_out)):
            out.writelines(line + "\n" for line in _criteo_lines(batch, count, seed, step))


def _write_parquet(path: Path, rows: int, seed: int, held_out: bool) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    dataset = clicks(seed, _CHUNK)
    schema = {"label": "label", "dense": [f"d{j}" for j in range(dataset.num_dense)],
              "sparse": [{"name": f.name, "vocab_size": f.vocab_size, "max_ids": f.max_ids}
                         for f in dataset.features]}
    writer = None
    try:
        for batch, count in _batches(dataset, rows, held_out):
            columns = {"label": pa.array(batch.labels[:count].astype(np.int8))}
            for j, name in enumerate(schema["dense"]):
                columns[name] = pa.array(batch.dense[:count, j])
            for f in dataset.features:
                ragged = batch.sparse[f.name]
                splits = ragged.row_splits[:count + 1]
                values = pa.array(ragged.values[:splits[-1]].astype(np.int64))
                if f.name == STRING_FEATURE:
                    values = pa.array([f"ad-{v}" for v in values.to_pylist()], pa.string())
                columns[f.name] = (values if f.max_ids == 1 else
                                   pa.ListArray.from_arrays(pa.array(splits.astype(np.int32)),
                                                            values))
            table = pa.table(columns)
            if writer is None:
                metadata = {SCHEMA_KEY: json.dumps(schema).encode()}
                writer = pq.ParquetWriter(path, table.schema.with_metadata(metadata))
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()


def write_sample(directory: str | os.PathLike[str], kind: SampleFormat, *, rows: int = 10_000,
                 seed: int = 0, batch_size: int = 1024, held_out: bool = False) -> Path:
    """Write `rows` synthetic click rows as `kind` into `directory`; returns the path.

    The file names are `SAMPLE_FILES[kind]`; an earlier sample there is replaced.
    `batch_size` is the batch of `npz` click files (which need >= 2 batches; they
    hold their own held-out batches). `held_out`: rows of the same hidden model
    that the sample without it never holds (for `--eval-data`; TSV and Parquet).
    The same `seed` gives the same hidden model: another seed, another one.
    """
    if kind not in get_args(SampleFormat):
        raise ValueError(f"write_sample: unknown format {kind!r}; use one of "
                         f"{list(get_args(SampleFormat))}.")
    if not is_integer(seed) or seed < 0:
        raise ValueError(f"write_sample: seed must be an integer >= 0, got {seed!r}.")
    if rows < 1 or batch_size < 1:
        raise ValueError(f"write_sample: rows and batch_size must be >= 1, got {rows=}, "
                         f"{batch_size=}.")
    if held_out and kind == "npz":
        raise ValueError("write_sample: npz click files hold their own held-out batches; "
                         "held_out is for TSV and Parquet.")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    target = root / SAMPLE_FILES[kind]
    if kind == "npz":
        batches = rows // batch_size
        if batches < 2:
            raise ValueError(f"write_sample: npz needs rows >= 2 x batch_size (one training "
                             f"and one held-out batch), got {rows=}, {batch_size=}.")
        evals = max(1, batches // 5)
        for old in [*target.glob("train/*.npz"), *target.glob("eval/*.npz")]:
            old.unlink()  # an earlier, larger sample's batches must not stay in the cycle
        return write_click_files(target, clicks(seed, batch_size), train_batches=batches - evals,
                                 eval_batches=evals)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        if kind == "parquet":
            _write_parquet(tmp, rows, seed, held_out)
        else:
            _write_tsv(tmp, rows, seed, held_out, gz=kind == "criteo-tsv-gz")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
