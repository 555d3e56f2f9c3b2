"""Facts about the host that size checks need, without importing JAX."""

from __future__ import annotations

import os


def host_memory_bytes() -> int | None:
    """Physical memory plus swap of this host (Linux `/proc/meminfo`, else `sysconf`),
    or None when unknown: the bound `ops.check_memory` and the commands' size checks
    hold what can never fit to (they know nothing of the memory other programs use)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
    except (OSError, KeyError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None
