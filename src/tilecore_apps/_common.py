"""Pieces shared by the subcommands: topology parsing, thread counts, limit calibration."""

from __future__ import annotations

import argparse
import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from functools import reduce
from pathlib import Path
from typing import Any

import tilecore as tc
from tilecore import data
from tilecore.preprocessing import resolve_num_threads

from ._options import positive_int

_TOPOLOGY = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_topology(text: str) -> tc.Topology:
    """`"LxS"`: L devices (all local) × S SparseCores per device, e.g. `1x4`."""
    match = _TOPOLOGY.match(text)
    if not match:
        raise ValueError(
            f"topology must look like LxS (devices x SparseCores per device), e.g. 1x4; "
            f"got {text!r}."
        )
    devices, sc = int(match[1]), int(match[2])
    return tc.Topology(global_devices=devices, sc_per_device=sc)


def flags_topology(devices: int, sc_per_device: int) -> tc.Topology:
    """The topology of `--devices` and `--sc-per-device`; one that is none (the partitions,
    devices × SparseCores, not a power of two, say) is named by those flags, not by the
    library's field names."""
    try:
        return tc.Topology(global_devices=devices, sc_per_device=sc_per_device)
    except ValueError as error:
        raise ValueError(f"--devices {devices} --sc-per-device {sc_per_device}: {error}"
                         ) from None


def topology_arg(text: str) -> tc.Topology:
    """argparse type of a `--topology LxS` option: a bad value is a usage error naming it."""
    try:
        return parse_topology(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def effective_threads(threads: int | None) -> int:
    """The worker threads `tc.preprocess(num_threads=threads)` will use (for reports)."""
    return resolve_num_threads(threads)


def preprocess_dropping(
    plan: tc.StackingPlan, batch: Mapping[str, tc.Ragged], *, num_threads: int | None
) -> tuple[tc.PreprocessedBatch, tc.PreprocessStats]:
    """`tc.preprocess` with dropping allowed and its warning silenced (the stats count drops)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tc.IdDroppingWarning)
        return tc.preprocess(
            plan.with_config(allow_id_dropping=True), batch, num_threads=num_threads
        )


def calibrate(
    plan: tc.StackingPlan,
    batches: Iterable[Mapping[str, tc.Ragged]],
    *,
    num_threads: int | None = None,
    headroom: float = 0.0,
) -> tuple[tc.StackingPlan, tc.PreprocessStats]:
    """Limits set to the maxima observed over `batches`, plus `headroom` (a fraction).

    Each batch is preprocessed once with dropping allowed (statistics are counted
    before dropping, so they are exact whatever the old limits); the merged
    statistics then set every stack's limits and COO buffer, so none of these
    batches drops an ID under the returned plan. Headroom (e.g. 0.1 for 10 %)
    lets later batches of the same distribution fit too. The config is `plan`'s.
    """
    stats = [preprocess_dropping(plan, batch, num_threads=num_threads)[1] for batch in batches]
    if not stats:
        raise ValueError("calibrate needs at least one batch.")
    merged = reduce(tc.PreprocessStats.merge, stats)
    plan = tc.update_preprocessing_parameters(plan, merged)
    return tc.fdo.with_headroom(plan, headroom), merged


def write_file(path: Path, content: bytes) -> None:
    """Write `content` to `path` atomically (a temporary file, then a rename). A symbolic
    link is written through (its target replaced atomically); a FIFO, a device or
    another file that is not a regular one (/dev/stdout, say) is written in place. A write
    or rename that fails removes the temporary file: nothing is left beside `path`."""
    path = Path(os.path.realpath(path)) if path.is_symlink() else path
    if path.exists() and not path.is_file() and not path.is_dir():
        with open(path, "wb") as stream:
            stream.write(content)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(content)
        os.replace(tmp, path)
    except BaseException:  # a full disk, a directory where the file goes, Ctrl-C
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Write `value` as indented JSON to `path` and say so."""
    write_file(path, (json.dumps(value, indent=2) + "\n").encode())
    print(f"wrote {path}")


def add_workload_option(parser: Any, default: str = "criteo") -> None:
    """`--workload`: one of tilecore.data's built-in workloads."""
    parser.add_argument("--workload", default=default, choices=sorted(data.WORKLOADS),
                        help=f"built-in workload from tilecore.data (default {default})")


def add_threads_option(parser: Any) -> None:
    """`--threads`: preprocessing worker threads."""
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="preprocessing threads (default $TILECORE_NUM_THREADS, else the "
                             "CPU count)")
