"""The CSV FDO client: header `key,values`, one row per key and recorded step."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from ._files import Arrays, FileFdoClient, check_table
from ._formats import read_csv, write_csv


class CsvFdoClient(FileFdoClient):
    """FDO statistics in `<base_dir>/fdo_stats_<process_index>_<time_ns>.csv`.

    Each row is `<stack>_<field>,<space-separated integers>`: one row per recorded
    step (or a single row holding the running maximum when `retain_history=False`).
    Use it like `NpzFdoClient`; the files are human-readable.
    """

    extension = "csv"

    def _write(self, file: IO[bytes], arrays: Arrays) -> None:
        write_csv(file, arrays)

    def _read(self, path: Path) -> Arrays:
        return check_table(read_csv(path), path)
