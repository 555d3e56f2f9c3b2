"""The NPZ FDO client: each publish is one `.npz` of `[steps, width]` int64 arrays."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from ._files import Arrays, FileFdoClient, check_table
from ._formats import read_npz, write_npz


class NpzFdoClient(FileFdoClient):
    """FDO statistics in `<base_dir>/fdo_stats_<process_index>_<time_ns>.npz`.

    Usage (every process)::

        client = NpzFdoClient(base_dir, process_index=jax.process_index(), plan=plan)
        _, stats = tilecore.preprocess(plan, inputs)
        client.record(stats)            # every step
        client.publish()                # every few hundred steps
        sync_global_devices("fdo")      # a barrier
        plan = tilecore.update_preprocessing_parameters(plan, client.load())

    With `plan`, `load` checks every file against it (`load_for`) before its
    counts can become limits.
    """

    extension = "npz"

    def _write(self, file: IO[bytes], arrays: Arrays) -> None:
        write_npz(file, arrays)

    def _read(self, path: Path) -> Arrays:
        return check_table(read_npz(path), path)
