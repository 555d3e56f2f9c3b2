"""Statistics of one batch over every process: what FDO records in a multi-process run."""

from __future__ import annotations

import numpy as np

from ..preprocessing import PreprocessStats
from ._agreement import DistributedAgreement

_ARRAYS = ("max_ids_per_partition", "max_unique_ids_per_partition", "required_buffer_size_per_sc")


def _payload(stats: PreprocessStats) -> dict:
    out: dict = {field: {name: np.asarray(a).tolist() for name, a in getattr(stats, field).items()}
                 for field in _ARRAYS}
    out["id_drop_counters"] = {name: int(c) for name, c in stats.id_drop_counters.items()}
    return out


def max_over_processes(stats: PreprocessStats, agreement: DistributedAgreement, *,
                       batch_number: int) -> PreprocessStats:
    """The element-wise maximum of every process's statistics (drop counters summed).

    Each process holds `[local_devices, …]` arrays for its own devices; the result
    has the same shapes and is the same on every process, so limits tuned from it
    (`update_preprocessing_parameters`) agree everywhere. Every process must call
    it for the same `batch_number`, in the same order as its other agreement calls.
    """
    merged = stats
    gathered = agreement.all_gather(batch_number, "stats", _payload(stats))
    for p, theirs in enumerate(gathered):
        if p == agreement.process_id:
            continue
        other = PreprocessStats(
            **{field: {name: np.asarray(v, np.asarray(getattr(stats, field)[name]).dtype)
                       for name, v in theirs[field].items()} for field in _ARRAYS},
            id_drop_counters=theirs["id_drop_counters"],
        )
        for field in _ARRAYS:
            for name, array in getattr(stats, field).items():
                if name in getattr(other, field) and (
                        np.shape(getattr(other, field)[name]) != np.shape(array)):
                    raise ValueError(
                        f"max_over_processes: stack {name!r} {field} has shape "
                        f"{np.shape(array)} on process {agreement.process_id} but "
                        f"{np.shape(getattr(other, field)[name])} on process {p}; every "
                        "process must use the same number of local devices.")
        try:
            merged = merged.merge(other)
        except ValueError as error:
            raise ValueError(f"max_over_processes: process {p}: {error}") from None
    return merged
