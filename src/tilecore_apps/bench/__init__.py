"""`tilecore bench`: every benchmark implementation, each a subcommand.

- `preprocess`: host preprocessing throughput on a built-in workload.
- `step`: the device ops' forward and training step against a naive JAX step (and,
  with `--peer-python`, FBGEMM's table-batched embeddings run by another Python:
  `peers/fbgemm_tbe.py`).
- `scale`: the training step's time against vocabulary size (up to a memory budget) and
  against IDs per batch, as JSON and a PNG.
- `train`: whether the host or the device limits the DLRM trainer.

Like the rest of `tilecore_apps`, these use only tilecore's public API.
"""

from __future__ import annotations

from typing import Any

from . import _preprocess, _scale, _step, _train
from ._machine import machine_facts as machine_facts


def add_parser(subparsers: Any) -> None:
    """Add `bench` and its subcommands (preprocess, step, scale, train) to `subparsers`."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="{preprocess,step,scale,train}")
    _preprocess.add_parser(kinds)
    _step.add_parser(kinds)
    _scale.add_parser(kinds)
    _train.add_parser(kinds)


__all__ = ["add_parser", "machine_facts"]
