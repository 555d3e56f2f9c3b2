"""The FDO file formats of jax-tpu-embedding 0.2.0, read defensively.

Both formats map keys `<stack><suffix>` (suffixes in `SUFFIXES`) to integer
arrays: 0-d (one step's drop count), 1-d (one step) or 2-d (one row per step).

- `.npz`: `numpy.savez` of int64 arrays, one member `<key>.npy` per key.
- `.csv`: the header `key,values`, then one row `<key>,<space-separated ints>` per
  1-d array, per row of a 2-d array, or per 0-d array (one value), with the
  `csv` module's excel dialect (`\\r\\n` line ends). Reading gives a key with one
  row a 1-d array, a key with several rows a 2-d array.

Readers check every header before allocating and every value, so a hostile file
(truncated, non-integer, negative or absurd counts, ragged rows) is an
`FdoStatsError` (a ValueError) naming the file, the stack and the value, never a
crash or a huge allocation. Whether the counts fit a plan is checked later
(`preprocessing._observed`), when the plan is known.
"""

from __future__ import annotations

import csv
import io
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import numpy as np

from ..preprocessing._errors import FdoStatsError
from ..preprocessing._observed import FIELDS, check_counts

SUFFIXES = tuple(f"_{field}" for field in FIELDS)
"""Key suffixes: `_max_ids`, `_max_unique_ids`, `_required_buffer_size`, `_id_drop_counters`."""

MAX_ELEMENTS = 1 << 26
"""Most values one key may hold (512 MiB of int64): a larger array is refused unread."""

_HEADER = ["key", "values"]
_CORRUPT = "The file is corrupt (or not FDO statistics): delete it and publish again."
_MAX_CSV_BYTES = 4 * MAX_ELEMENTS
_VALUES = re.compile(r"[ \t]*-?[0-9]+(?:[ \t]+-?[0-9]+)*[ \t]*")


def split_key(key: str) -> tuple[str, str] | None:
    """`(stack, suffix)` of a key `<stack><suffix>`, or None when no suffix fits."""
    for suffix in SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], suffix
    return None


def describe(key: str) -> str:
    """`stack 's' (max_ids)` for a key with a known suffix, else the quoted key."""
    parts = split_key(key)
    return f"key {key!r}" if parts is None else f"stack {parts[0]!r} ({parts[1][1:]})"


def write_npz(file: IO[bytes], arrays: Mapping[str, np.ndarray]) -> None:
    """`numpy.savez` of `arrays` as int64 (keys end with a suffix, never `file`)."""
    np.savez(file, **{k: np.asarray(v, np.int64) for k, v in arrays.items()})  # pyright: ignore[reportArgumentType]


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an `.npz` FDO file, each header checked before its data is read."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        raise FdoStatsError(f"FDO file {path} is not an .npz archive (truncated or corrupt): {e}. "
                            "Delete it and publish again.") from None
    out: dict[str, np.ndarray] = {}
    with archive:
        for info in archive.infolist():
            key = info.filename.removesuffix(".npy")
            if key == info.filename or key in out:
                raise FdoStatsError(f"FDO file {path}: unexpected member {info.filename!r} (not a "
                                    "unique <key>.npy). The file is corrupt.")
            try:
                with archive.open(info) as member:
                    array = _read_npy(member, key, path)
            except (zipfile.BadZipFile, EOFError, OSError) as e:
                raise FdoStatsError(f"FDO file {path}: {describe(key)} cannot be read "
                                    f"(truncated or corrupt): {e}. Delete it and publish "
                                    "again.") from None
            out[key] = check_counts(array, f"FDO file {path}: {describe(key)}", _CORRUPT)
    return out


def _read_npy(member: IO[bytes], key: str, path: Path) -> np.ndarray:
    where = f"FDO file {path}: {describe(key)}"
    try:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except ValueError as e:
        raise FdoStatsError(f"{where} has a bad .npy header ({e}). The file is corrupt.") from None
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if dtype.kind not in "iu" or len(shape) > 2 or count > MAX_ELEMENTS:
        raise FdoStatsError(f"{where} declares dtype {dtype} and shape {shape}; expected at most "
                            f"{MAX_ELEMENTS} integers in 0-2 dimensions. The file is corrupt.")
    data = member.read(count * dtype.itemsize + 1)  # one byte more reveals trailing junk
    if len(data) != count * dtype.itemsize:
        raise FdoStatsError(f"{where} holds {len(data)} bytes of data, its header declares shape "
                            f"{shape} of {dtype} ({count * dtype.itemsize} bytes). The file is "
                            "truncated or corrupt: delete it and publish again.")
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")


def write_csv(file: IO[bytes], arrays: Mapping[str, np.ndarray]) -> None:
    """The header, then one row per 1-d array, per row of a 2-d array, per 0-d array."""
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(_HEADER)
    for key, value in arrays.items():
        array = np.asarray(value, np.int64)
        for row in array.reshape(1, -1) if array.ndim < 2 else array:
            writer.writerow([key, " ".join(map(str, row.tolist()))])
    file.write(text.getvalue().encode())


def read_csv(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a `.csv` FDO file: a key's single row 1-d, several rows 2-d."""
    if (size := path.stat().st_size) > _MAX_CSV_BYTES:
        raise FdoStatsError(f"FDO file {path} has {size} bytes, more than the {_MAX_CSV_BYTES} "
                            f"that {MAX_ELEMENTS} counts per key can take: it is not FDO "
                            "statistics.")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise FdoStatsError(f"FDO file {path} is not UTF-8 text ({e}): it is corrupt.") from None
    if not text.endswith("\n"):
        raise FdoStatsError(f"FDO file {path} does not end with a line end: it is truncated. "
                            "Delete it and publish again.")
    lines = [line.removesuffix("\r") for line in text[:-1].split("\n")]
    if lines[0] != ",".join(_HEADER):
        raise FdoStatsError(f"FDO file {path}: header {lines[0][:80]!r}, expected 'key,values'.")
    rows: dict[str, list[np.ndarray]] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line:
            continue  # the reference skips blank rows
        key, values = _split_row(line, number, path)
        where = f"FDO file {path}, line {number}: {describe(key)}"
        if not _VALUES.fullmatch(values):
            raise FdoStatsError(f"{where} has values {values[:80]!r}; expected integers "
                                "separated by spaces. The file is corrupt.")
        tokens = values.split()
        previous = rows.setdefault(key, [])
        width = len(tokens)
        if previous and width != previous[0].size:
            raise FdoStatsError(f"{where} has {width} values, its earlier rows "
                                f"{previous[0].size}. The file is truncated or corrupt.")
        if width * (len(previous) + 1) > MAX_ELEMENTS:
            raise FdoStatsError(f"{where}: more than {MAX_ELEMENTS} values. The file is corrupt.")
        try:
            previous.append(np.array(tokens, dtype=np.int64))
        except (OverflowError, ValueError):
            raise FdoStatsError(
                f"{where} holds a count beyond int64. The file is corrupt.") from None
    return {key: check_counts(r[0] if len(r) == 1 else np.vstack(r),
                              f"FDO file {path}: {describe(key)}", _CORRUPT)
            for key, r in rows.items()}


def _split_row(line: str, number: int, path: Path) -> tuple[str, str]:
    """`<key>,<values>` (the key csv-quoted when it needs to be) → (key, values)."""
    head, comma, values = line.rpartition(",")
    fields = next(csv.reader([head]), []) if comma else []
    if len(fields) != 1 or not fields[0]:
        raise FdoStatsError(f"FDO file {path}, line {number}: expected '<key>,<values>', "
                            f"got {line[:80]!r}. The file is corrupt.")
    return fields[0], values
