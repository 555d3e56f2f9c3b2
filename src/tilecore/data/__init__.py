"""Deterministic synthetic workloads for demos, benchmarks and tests (numpy only).

A `Workload` holds feature specs (with their tables) and regenerates any batch
from `(seed, step)`. Built-ins: `criteo`, `multihot`, `stacked`, `criteo26`.
`clicks` is labelled click data with a hidden ground truth (for `tilecore train`).
"""

from ._click_files import ClickFiles as ClickFiles
from ._click_files import ClickSource as ClickSource
from ._click_files import load_click_files as load_click_files
from ._click_files import write_click_files as write_click_files
from ._clicks import ClickBatch as ClickBatch
from ._clicks import ClickDataset as ClickDataset
from ._clicks import ClickFeature as ClickFeature
from ._clicks import clicks as clicks
from ._files import load_batch as load_batch
from ._files import save_batch as save_batch
from ._workload import IdDistribution as IdDistribution
from ._workload import Workload as Workload
from ._workload import num_ids as num_ids
from ._workloads import WORKLOADS as WORKLOADS
from ._workloads import criteo as criteo
from ._workloads import criteo26 as criteo26
from ._workloads import get_workload as get_workload
from ._workloads import multihot as multihot
from ._workloads import stacked as stacked

__all__ = [
    "WORKLOADS",
    "ClickBatch",
    "ClickDataset",
    "ClickFeature",
    "ClickFiles",
    "ClickSource",
    "IdDistribution",
    "Workload",
    "clicks",
    "criteo",
    "criteo26",
    "get_workload",
    "load_batch",
    "load_click_files",
    "multihot",
    "num_ids",
    "save_batch",
    "stacked",
    "write_click_files",
]
