"""Data in and out: synthetic workloads, click data from files, batch files (numpy only).

A `Workload` holds feature specs (with their tables) and regenerates any batch
from `(seed, step)`. Built-ins: `criteo`, `multihot`, `stacked`, `criteo26`.
`clicks` is labelled click data with a hidden ground truth (for `tilecore train`).
`open_click_data` reads your own click data — Criteo-format TSV (plain or gzip),
Parquet, or `.npz` click files — streamed, as a `ClickSource`; `write_sample`
writes a synthetic sample of each format. `click_feature_specs` turns click
features into feature specs on their tables (shared where the features say so).
`save_batch` / `load_batch` hold one batch of IDs in the `.npz` layout every
command reads.
"""

from ._click_files import ClickFiles as ClickFiles
from ._click_files import ClickSource as ClickSource
from ._click_files import load_click_files as load_click_files
from ._click_files import write_click_files as write_click_files
from ._click_specs import click_feature_specs as click_feature_specs
from ._clicks import ClickBatch as ClickBatch
from ._clicks import ClickDataset as ClickDataset
from ._clicks import ClickFeature as ClickFeature
from ._clicks import clicks as clicks
from ._criteo import BadRowError as BadRowError
from ._criteo import DamagedFileError as DamagedFileError
from ._files import load_batch as load_batch
from ._files import save_batch as save_batch
from ._open import open_click_data as open_click_data
from ._read_options import DEFAULT_VOCAB_SIZE as DEFAULT_VOCAB_SIZE
from ._read_options import ClickColumns as ClickColumns
from ._read_options import ReadOptions as ReadOptions
from ._samples import SampleFormat as SampleFormat
from ._samples import write_sample as write_sample
from ._stream import BadRows as BadRows
from ._stream import BadRowsWarning as BadRowsWarning
from ._stream import StreamedClicks as StreamedClicks
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
    "DEFAULT_VOCAB_SIZE",
    "WORKLOADS",
    "BadRowError",
    "BadRows",
    "BadRowsWarning",
    "ClickBatch",
    "ClickColumns",
    "ClickDataset",
    "ClickFeature",
    "ClickFiles",
    "ClickSource",
    "DamagedFileError",
    "IdDistribution",
    "ReadOptions",
    "SampleFormat",
    "StreamedClicks",
    "Workload",
    "click_feature_specs",
    "clicks",
    "criteo",
    "criteo26",
    "get_workload",
    "load_batch",
    "load_click_files",
    "multihot",
    "num_ids",
    "open_click_data",
    "save_batch",
    "stacked",
    "write_click_files",
    "write_sample",
]
