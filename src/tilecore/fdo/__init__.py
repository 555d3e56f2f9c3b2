"""Feedback-directed optimisation (FDO) of limits: observed statistics → limits.

File clients (`NpzFdoClient`, `CsvFdoClient`) share statistics between processes
(element-wise max); `tune_limits` settles a plan's limits on sample batches.
Loaded statistics are checked against the plan before they change its limits
(`FdoClient.load_for`, `check_stats`): a corrupt file or one of another plan is an
`FdoStatsError` (a ValueError) naming the file, stack, field and value; a stack
the statistics lack keeps its limits, with an `FdoStatsWarning`.
Imports numpy only (never JAX).
"""

from ..preprocessing._errors import FdoStatsError as FdoStatsError
from ..preprocessing._errors import FdoStatsWarning as FdoStatsWarning
from ..preprocessing._observed import check_stats as check_stats
from ._client import FdoClient as FdoClient
from ._csv import CsvFdoClient as CsvFdoClient
from ._files import FileFdoClient as FileFdoClient
from ._npz import NpzFdoClient as NpzFdoClient
from ._tune import StackLimits as StackLimits
from ._tune import TuneReport as TuneReport
from ._tune import heuristic_limits as heuristic_limits
from ._tune import limits_of as limits_of
from ._tune import tune_limits as tune_limits
from ._tune import with_headroom as with_headroom

__all__ = [
    "CsvFdoClient",
    "FdoClient",
    "FdoStatsError",
    "FdoStatsWarning",
    "FileFdoClient",
    "NpzFdoClient",
    "StackLimits",
    "TuneReport",
    "check_stats",
    "heuristic_limits",
    "limits_of",
    "tune_limits",
    "with_headroom",
]
