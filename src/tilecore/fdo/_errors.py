"""The FDO error and warning: statistics that must not (or only partly) set a plan's limits."""

from __future__ import annotations


class FdoStatsError(ValueError):
    """Invalid FDO statistics: a corrupt file, or counts that do not fit the plan.

    The message names the file (or where the statistics came from), the stack,
    the field and the value, and says how to fix it. A `ValueError`, so callers
    catching that keep working.
    """


class FdoStatsWarning(UserWarning):
    """FDO statistics that leave some of a plan's limits as they are (a stack missing)."""
