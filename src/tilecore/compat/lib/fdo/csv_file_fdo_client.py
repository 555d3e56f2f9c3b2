"""`jax_tpu_embedding.sparsecore.lib.fdo.csv_file_fdo_client`: FDO statistics in `.csv` files.

Files written here load in the reference's `CSVFileFDOClient` and the other way
round: `fdo_stats_<process_index>_<time_ns>.csv`, the header `key,values`, then
one row `<table><suffix>,<space-separated counts>` per key and recorded step
(excel dialect, `\\r\\n` line ends; see `tilecore.compat._fdo` for the merge rules).
"""

from __future__ import annotations

import os

from ....fdo._formats import read_csv, write_csv
from ..._fdo import FileFDOClient

__all__ = ["CSVFileFDOClient"]


class CSVFileFDOClient(FileFDOClient):
    """FDO client that writes stats to a file in .csv format.

    Usage::

        client = CSVFileFDOClient(base_dir="/path/to/base/dir", retain_history=True)
        _, stats = embedding.preprocess_sparse_dense_matmul_input(...)
        client.record(stats)
        client.publish()
        stats = client.load()

    With `retain_history=False` each `record` collapses the history to its
    element-wise max, so a file holds one row per key. Unlike the reference, a
    table's drop counter recorded once is written as a one-value row instead of
    failing; the reference reads it back as a 1-element array.
    """

    _extension = "csv"
    _write = staticmethod(write_csv)
    _read = staticmethod(read_csv)

    def __init__(self, base_dir: str | os.PathLike[str], retain_history: bool = True) -> None:
        super().__init__(base_dir, retain_history)
