"""`jax_tpu_embedding.sparsecore.lib.fdo.fdo_client`: the abstract FDO client.

An FDO (feedback-directed optimisation) client collects the preprocessing
statistics of this process, publishes them to storage shared by all processes,
and loads the aggregate of every process's, for
`embedding.update_preprocessing_parameters` to raise the limits.
"""

from __future__ import annotations

import abc

from ..._results import SparseDenseMatmulInputStats

__all__ = ["FDOClient"]


class FDOClient(abc.ABC):
    """Abstract interface of a per-process FDO client.

    Typical use: create an implementation (`file_fdo_client.NPZFileFDOClient`,
    `csv_file_fdo_client.CSVFileFDOClient`); `record` the statistics of each
    preprocessed batch; after some steps `publish` them; then `load` the
    statistics aggregated over all processes.
    """

    @abc.abstractmethod
    def record(self, data: SparseDenseMatmulInputStats) -> None:
        """Add one batch's statistics to this process's local history."""
        raise NotImplementedError

    @abc.abstractmethod
    def publish(self) -> None:
        """Write the local history to the storage that every process reads."""
        raise NotImplementedError

    @abc.abstractmethod
    def load(self) -> SparseDenseMatmulInputStats:
        """The statistics aggregated over every process's published history."""
        raise NotImplementedError
