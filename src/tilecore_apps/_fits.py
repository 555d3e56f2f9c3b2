"""Whether what a size option asks for can fit at all, asked before any of it is made.

A size far beyond the machine (`data --rows 99999999999999`, `limits --batch-size
1000000000`) otherwise runs for seconds or minutes and then ends with numpy's bare
"Unable to allocate ... GiB", a full disk, or the kernel's OOM killer, naming no option.
As `tilecore.ops.check_memory` does for a plan's tables, only what can never fit is
refused: the bound is this host's memory plus swap (it knows nothing of the memory other
programs use) or the free space of the file system written to, and every estimate is a
lower bound, so a refused run could not have finished.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tilecore import data, host_memory_bytes

_GIB = 2**30


def check_memory(need: int, what: str, fix: str) -> None:
    """Raise ValueError when `need` bytes exceed this host's memory and swap. `what` names
    the option, its value and what it makes; `fix` says what to pass instead."""
    limit = host_memory_bytes()
    if limit is not None and need > limit:
        raise ValueError(f"{what} would take about {need / _GIB:,.1f} GiB of memory, more than this "
                         f"host's memory and swap ({limit / _GIB:,.1f} GiB); {fix}.")


def check_disk(need: int, directory: Path, what: str, fix: str) -> None:
    """Raise ValueError when `need` bytes exceed the free space of the file system that
    holds `directory` (or, before it is made, its nearest existing ancestor)."""
    place = directory.absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        free = shutil.disk_usage(place).free
    except OSError:  # unknown: the write itself will say
        return
    if need > free:
        raise ValueError(f"{what} would take at least {need / _GIB:,.1f} GiB on disk, more than the "
                         f"{free / _GIB:,.1f} GiB free where {str(directory)!r} is; {fix}.")


def batch_bytes(workload: data.Workload) -> int:
    """Bytes of one of `workload`'s batches as `Workload.batch` makes it: per feature, the
    int32 IDs (as many per sample as its distribution's mean) and the int64 row splits.
    Preprocessing them takes more still."""
    return sum(workload.batch_size * (2 * (d.min_ids + d.max_ids) + 8)
               for d in workload.distributions)


def check_batches(workload: data.Workload, count: int = 1, count_flag: str | None = None
                  ) -> None:
    """Raise ValueError when `count` of `workload`'s batches, held at once, cannot fit in this
    host's memory, naming --batch-size and its value (and `count_flag`, the option that sets
    `count`)."""
    held = "a batch" if count == 1 else f"{count} batches"
    fewer = f" or fewer {count_flag}" if count_flag else ""
    check_memory(count * batch_bytes(workload),
                 f"--batch-size {workload.batch_size}: {held} of workload {workload.name!r}",
                 f"use a smaller --batch-size{fewer}")
