"""Criteo-format click logs: tab-separated text, plain or gzip, read line by line.

Each line is `label`, 13 integer features `I1 … I13` and 26 categorical features
`C1 … C26` written in hexadecimal, separated by tabs (the layout of the Criteo
display-advertising and terabyte click logs). As in those logs, any field but
the label may be empty and the integers may be negative. A line becomes a sample:

- label: `0` or `1`.
- dense feature j: `log(1 + max(I_j, 0))` (float32); empty → 0.
- categorical feature `C_j` (table `C_j`): the ID `int(C_j, 16) mod vocab_size_j`
  (`_hashing`, the hash the Parquet reader applies to strings too) — stable, the
  same in every run and process; empty → no ID for that sample (its embedding is
  the empty sum, zeros).

A bad line (not 40 fields, a label other than 0/1, an integer that is not a
decimal of at most 18 digits, a categorical value that is not at most 16
hexadecimal digits) raises `BadRowError` naming the file, line and column, or is
counted and skipped. Reading takes `rows` valid lines at a time (`take`) and
converts them later (`parse`), so skipping batches costs only the line check.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from ..preprocessing import Ragged
from ._clicks import ClickBatch
from ._hashing import hex_ids

NUM_INTEGER, NUM_CATEGORICAL = 13, 26
COLUMNS = ("label", *(f"I{j}" for j in range(1, 14)), *(f"C{j}" for j in range(1, 27)))
"""The 40 columns of a line, in order (also the feature names: `C1` … `C26`)."""
_INT, _HEX = r"(?:-?[0-9]{1,18})?", r"[0-9a-fA-F]{0,16}"
_LINE = re.compile(rf"[01](?:\t{_INT}){{13}}(?:\t{_HEX}){{26}}", re.ASCII)
_FIELD = {"label": re.compile("[01]"), "I": re.compile(_INT, re.ASCII),
          "C": re.compile(_HEX, re.ASCII)}
_EXPECTED = {"label": "0 or 1", "I": "an integer of at most 18 digits, or empty",
             "C": "a hexadecimal value of at most 16 digits, or empty"}


class BadRowError(ValueError):
    """A row of a data file that cannot be read: names the file, line (or row) and column.

    Attributes: `path`, `line` (1-based line or row), `column` (1-based for TSV, a
    name for Parquet, None: the row's shape), `reason`, `where` (file, line, column).
    """

    def __init__(self, path: Path, line: int, column: int | str | None, reason: str,
                 *, unit: str = "line") -> None:
        shown = "" if column is None else f", column {column!r}"
        self.where = f"{path}, {unit} {line}{shown}"
        super().__init__(f"{self.where}: {reason}. Fix or remove the {unit}, or skip bad rows "
                         "(counted): `--skip-bad-rows` / ReadOptions(skip_bad_rows=True).")
        self.path, self.line, self.column, self.reason = path, line, column, reason
        self._unit = unit

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by input worker processes
        return (_bad_row, (self.path, self.line, self.column, self.reason, self._unit))


class DamagedFileError(ValueError):
    """A data file whose bytes cannot be decoded past some point (a truncated or corrupt
    gzip stream, a Parquet page that cannot be read): names the file and the last line
    (or row) read. Skipping bad rows cannot pass it: nothing after the damage can be
    read."""

    def __init__(self, path: Path, line: int, reason: str, *, unit: str = "line") -> None:
        super().__init__(f"{path}: damaged after {unit} {line} ({reason}); nothing past it "
                         f"can be read. Use an intact copy, or cut the file at that {unit}.")
        self.path, self.line, self.reason, self._unit = path, line, reason, unit

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by input worker processes
        return (_damaged, (self.path, self.line, self.reason, self._unit))


def _bad_row(path: Path, line: int, column: int | str | None, reason: str,
             unit: str) -> BadRowError:
    return BadRowError(path, line, column, reason, unit=unit)


def _damaged(path: Path, line: int, reason: str, unit: str) -> DamagedFileError:
    return DamagedFileError(path, line, reason, unit=unit)


def diagnose(path: Path, line_number: int, line: str) -> BadRowError:
    """Why `line` (a line that failed the check) is not a Criteo row."""
    fields = line.split("\t")
    if len(fields) != len(COLUMNS):
        return BadRowError(path, line_number, None,
                           f"{len(fields)} tab-separated fields, expected {len(COLUMNS)} (label, "
                           f"{NUM_INTEGER} integer and {NUM_CATEGORICAL} hexadecimal features)")
    for k, (name, value) in enumerate(zip(COLUMNS, fields, strict=True)):
        kind = "label" if name == "label" else name[0]
        if not _FIELD[kind].fullmatch(value):
            shown = value if len(value) <= 40 else value[:37] + "..."
            return BadRowError(path, line_number, k + 1,
                               f"{name} must be {_EXPECTED[kind]}, got {shown!r}")
    return BadRowError(path, line_number, None, "not a Criteo row")  # unreachable in practice


def parse_lines(lines: list[str], vocab_sizes: tuple[int, ...]) -> ClickBatch:
    """Checked lines (see `CriteoReader.take`) → a batch with features `C1` … `C26`."""
    n = len(lines)
    columns = list(zip(*(line.split("\t") for line in lines), strict=True)) if n else [()] * 40
    labels = np.fromiter((v == "1" for v in columns[0]), np.float32, n)
    ints = np.array(columns[1:14], dtype=str).reshape(NUM_INTEGER, n)
    ints = np.where(ints == "", "0", ints).astype(np.int64)
    dense = np.log1p(np.maximum(ints, 0)).T.astype(np.float32)
    sparse = {}
    for j, vocab in enumerate(vocab_sizes):
        column = columns[1 + NUM_INTEGER + j]
        splits = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter((v != "" for v in column), bool, n), out=splits[1:])
        ids = hex_ids((v for v in column if v), int(splits[-1]), vocab)
        sparse[COLUMNS[1 + NUM_INTEGER + j]] = Ragged(ids, splits)
    return ClickBatch(sparse=sparse, dense=np.ascontiguousarray(dense), labels=labels)


def open_text(path: Path) -> tuple[IO[str], IO[bytes]]:
    """`path` as text lines (gunzipped if it starts with gzip's magic bytes) and the raw
    binary file under it (whose position tells how far the reading got)."""
    raw = open(path, "rb")  # noqa: SIM115 (closed by CriteoReader.close)
    gz = raw.peek(2)[:2] == b"\x1f\x8b"
    binary = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw)
    return io.TextIOWrapper(binary, encoding="utf-8", errors="replace"), raw


class CriteoReader:
    """One pass over a Criteo TSV file: `take` valid lines, `parse` them into a batch.

    `on_bad`: called with the `BadRowError` of each bad line, which is then
    skipped; None raises it.
    """

    def __init__(self, path: Path, vocab_sizes: tuple[int, ...],
                 on_bad: Callable[[BadRowError], None] | None) -> None:
        self.path, self.vocab_sizes, self.on_bad = path, vocab_sizes, on_bad
        self._text, self._raw = open_text(path)
        self._size = os.path.getsize(path)
        self.line = 0  # lines read so far

    def take(self, rows: int) -> tuple[list[str], int]:
        """Up to `rows` valid lines (fewer only at the end of the file) and their count."""
        out: list[str] = []
        match, text = _LINE.fullmatch, self._text
        while len(out) < rows:
            try:
                line = text.readline()
            except (EOFError, OSError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
                kind = ("zlib." if isinstance(error, zlib.error) else "") + type(error).__name__
                raise DamagedFileError(self.path, self.line, f"{kind}: {error}") from error
            if not line:
                break
            self.line += 1
            line = line.rstrip("\r\n")
            if match(line):
                out.append(line)
                continue
            error = diagnose(self.path, self.line, line)
            if self.on_bad is None:
                raise error
            self.on_bad(error)
        return out, len(out)

    def parse(self, lines: list[str]) -> ClickBatch:
        return parse_lines(lines, self.vocab_sizes)

    @property
    def progress(self) -> tuple[int, int]:
        """Bytes of the file read so far, and its size."""
        return self._raw.tell(), self._size

    def close(self) -> None:
        self._text.close()
        self._raw.close()
