"""The FDO client interface: record statistics, publish them, load everyone's maxima."""

from __future__ import annotations

import abc
from pathlib import Path

from ..preprocessing import PreprocessStats
from ..preprocessing._observed import check_stats
from ..stacking import StackingPlan


class FdoClient(abc.ABC):
    """Feedback-directed optimisation of limits: a store of observed statistics.

    Each process `record`s the statistics of the batches it preprocesses,
    `publish`es them, waits for every process (a barrier), and `load`s the
    element-wise maximum over all processes, which it passes to
    `tilecore.update_preprocessing_parameters` so every process agrees on limits.
    `load_for(plan)` is `load` checked against the plan first.
    """

    @abc.abstractmethod
    def record(self, stats: PreprocessStats) -> None:
        """Add one step's statistics to this process's history."""

    @abc.abstractmethod
    def publish(self) -> Path | None:
        """Make this process's history visible to every process's `load`."""

    @abc.abstractmethod
    def load(self) -> PreprocessStats:
        """The element-wise maximum of the published statistics of all processes."""

    def load_for(self, plan: StackingPlan) -> PreprocessStats:
        """`load`, checked against `plan` before the statistics can change its limits.

        Loaded statistics may be corrupt or of another plan: an `FdoStatsError`
        (a ValueError) names the stack, field and value; a stack of the plan they
        lack keeps its limits, with an `FdoStatsWarning`. File clients override
        this to name the file.
        """
        return check_stats(plan, self.load(), f"The statistics {type(self).__name__}.load() "
                                              "returned")
