"""Errors and warnings of host preprocessing."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._types import PreprocessStats


class IdDroppingWarning(UserWarning):
    """IDs were dropped because a stack's limits or buffer were exceeded (dropping allowed)."""


class LimitExceededError(ValueError):
    """A partition received more IDs than its stack's limits allow, and dropping is off.

    Attributes name the first offending stack, device and partition (and, when
    minibatching could not split it further, the hash bucket), the limit, and the
    observed and allowed values; `stats` holds the whole batch's statistics
    so callers (e.g. limit auto-tuning) can raise the limits and retry.
    """

    def __init__(
        self,
        *,
        stack: str,
        tables: tuple[str, ...],
        limit: str,
        device: int,
        partition: int,
        observed: int,
        allowed: int,
        num_exceeding: int,
        worst: int,
        stats: PreprocessStats,
        bucket: int | None = None,
    ) -> None:
        self.stack, self.tables, self.limit = stack, tables, limit
        self.device, self.partition, self.bucket = device, partition, bucket
        self.observed, self.allowed = observed, allowed
        self.stats = stats
        where = f"partition {partition}"
        pairs = "(device, partition) pairs"
        if bucket is not None:
            where = f"partition {partition} from minibatching bucket {bucket} alone"
            pairs = "(device, partition, minibatch) segments"
        super().__init__(
            f"Stack {stack!r} (tables {', '.join(tables)}): a SparseCore of local device "
            f"{device} sends {observed} IDs to {where}, above "
            f"{limit}={allowed} ({num_exceeding} {pairs} exceed it; the "
            f"largest is {worst}). Fix: raise the limit, e.g. "
            f"plan = tilecore.update_preprocessing_parameters(plan, error.stats) or "
            f"TableSpec({limit}={worst}), or allow dropping with "
            f"SparseCoreConfig(allow_id_dropping=True)."
        )


class PeerPreprocessingError(RuntimeError):
    """Another process could not preprocess this batch, so this one stops too.

    Raised on every process but the failing one (which raises its own error), so
    no process is left waiting in the device collectives of a step that another
    will never run.
    """

    def __init__(self, batch_number: int) -> None:
        self.batch_number = batch_number
        super().__init__(
            f"Batch {batch_number}: another process could not preprocess it (one minibatching "
            "bucket exceeded a limit there; its own error says which stack and partition). "
            "This process stops too rather than wait for it in the device ops.")


class FdoStatsError(ValueError):
    """Invalid FDO statistics: a corrupt file, or counts that do not fit the plan.

    The message names the file (or where the statistics came from), the stack,
    the field and the value, and says how to fix it. A `ValueError`, so callers
    catching that keep working. (Defined with the statistics it judges;
    `tilecore.fdo` exports it.)
    """


class FdoStatsWarning(UserWarning):
    """FDO statistics that leave some of a plan's limits as they are (a stack missing)."""
