"""`jax_tpu_embedding.sparsecore.lib.fdo.file_fdo_client`: FDO statistics in `.npz` files.

Files written here load in the reference's `NPZFileFDOClient` and the other way
round: `fdo_stats_<process_index>_<time_ns>.npz`, one int64 array per key
`<table>_max_ids`, `<table>_max_unique_ids`, `<table>_required_buffer_size`,
`<table>_id_drop_counters` (see `tilecore.compat._fdo` for the merge rules).
"""

from __future__ import annotations

import os

from ....fdo._formats import read_npz, write_npz
from ..._fdo import FileFDOClient

__all__ = ["NPZFileFDOClient"]


class NPZFileFDOClient(FileFDOClient):
    """FDO client that writes stats to a file in .npz format.

    Usage::

        client = NPZFileFDOClient(base_dir="/path/to/base/dir")
        _, stats = embedding.preprocess_sparse_dense_matmul_input(...)
        client.record(stats)     # every step: one more row per table
        client.publish()         # this process's history to a new file
        stats = client.load()    # the element-wise max over every process's newest file

    `load` returns a key as stored when only one process published (a history of
    several steps stays `[steps, width]`), and the max over all rows otherwise.
    """

    _extension = "npz"
    _write = staticmethod(write_npz)
    _read = staticmethod(read_npz)

    def __init__(self, base_dir: str | os.PathLike[str]) -> None:
        super().__init__(base_dir)
