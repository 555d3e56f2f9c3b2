"""What a benchmark ran on, recorded in every JSON it writes (CPUs differ: name them)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (e.g. 'AMD EPYC 9B14'), or the architecture if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available_memory_bytes() -> int | None:
    """Bytes this machine could still give a process without swapping: MemAvailable from
    /proc/meminfo (Linux), else the free physical pages of `os.sysconf`; None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def machine_facts() -> dict[str, object]:
    """Python, architecture, CPU model and CPU count of this machine."""
    return {"python": platform.python_version(), "machine": platform.machine(),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count()}
