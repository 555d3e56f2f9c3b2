"""Consistency checks of FDO statistics files, for the reference's clients (`_fdo`).

The reference merges whatever its files hold; these checks turn the files that
would make it crash or merge nonsense (unknown keys, a table without its
counts, widths that no topology gives, files of different stacking plans) into
`FdoStatsError`s (ValueErrors) naming the file, the table and the values. The
reference's clients do not know the plan, so nothing here checks against one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..fdo._formats import SUFFIXES, split_key
from ..preprocessing._errors import FdoStatsError

_IDS, _UNIQUE, _BUFFER, _DROPS = SUFFIXES
_FIX = "Delete the file and publish again (one base_dir per stacking plan)."


def _width(array: np.ndarray) -> int:
    return int(array.shape[-1]) if array.ndim else 1


def join_rows(old: np.ndarray, new: np.ndarray, where: str,
              combine: Callable[[tuple[np.ndarray, np.ndarray]], np.ndarray]) -> np.ndarray:
    """`combine((old, new))` (a vstack, or its max) once both have the same width."""
    if _width(old) != _width(new):
        raise FdoStatsError(
            f"{where} has {_width(new)} values per step, earlier {_width(old)} (shapes "
            f"{new.shape} and {old.shape}): statistics of different topologies do not mix.")
    return combine((old, new))


def check_file(arrays: Mapping[str, np.ndarray], path: Path) -> None:
    """Every key is `<table><suffix>`; every table has both ID counts, with widths that fit.

    Per table, `max_ids` and `max_unique_ids` (one value per partition) have equal
    shapes, `required_buffer_size` (one per SparseCore) a width dividing theirs,
    and `id_drop_counters` one value per step.
    """
    tables: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        parts = split_key(key)
        if parts is None:
            raise FdoStatsError(f"FDO file {path}: unexpected key {key!r}; every key must be "
                                f"<table> followed by one of {list(SUFFIXES)}. {_FIX}")
        tables.setdefault(parts[0], {})[parts[1]] = value
    for table, fields in tables.items():
        where = f"FDO file {path}: stack {table!r}"
        missing = [s[1:] for s in (_IDS, _UNIQUE) if s not in fields]
        if missing:
            raise FdoStatsError(f"{where} lacks {missing} (has {sorted(s[1:] for s in fields)}): "
                                f"the file is truncated or corrupt. {_FIX}")
        ids, unique = fields[_IDS], fields[_UNIQUE]
        if ids.shape != unique.shape:
            raise FdoStatsError(f"{where}: max_ids has shape {ids.shape} but max_unique_ids "
                                f"{unique.shape}; both hold one count per partition. {_FIX}")
        buffer = fields.get(_BUFFER)
        if buffer is not None and _width(ids) % _width(buffer):
            raise FdoStatsError(
                f"{where}: required_buffer_size has {_width(buffer)} values per step, which "
                f"does not divide the {_width(ids)} partitions of max_ids; no topology gives "
                f"these widths. {_FIX}")
        drops = fields.get(_DROPS)
        if drops is not None and _width(drops) != 1:
            raise FdoStatsError(f"{where}: id_drop_counters has shape {drops.shape}; expected one "
                                f"count per step. {_FIX}")


def check_same_keys(keys: set[str], path: Path, first_keys: set[str], first: Path) -> None:
    """Files of one job hold the same keys (else a stack is missing or plans differ)."""
    if keys == first_keys:
        return
    raise FdoStatsError(
        f"FDO file {path} and {first} hold different statistics: only in {path.name}: "
        f"{sorted(keys - first_keys)}, only in {first.name}: {sorted(first_keys - keys)}. "
        f"A stack is missing from one of them, or they come from different stacking plans. "
        f"{_FIX}")
