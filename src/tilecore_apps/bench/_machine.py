"""What a benchmark ran on, recorded in every JSON it writes (CPUs differ: name them)."""

from __future__ import annotations

import os
import platform
import time
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


def _busy_seconds() -> float | None:
    """CPU-seconds this machine has spent busy since boot, every CPU (Linux /proc/stat:
    user, nice, system, irq, softirq and steal), or None where unknown."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8))
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _own_seconds() -> float:
    """CPU-seconds of this process and of its children that have ended."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """How many CPUs other processes kept busy while some code ran: the machine's busy
    time less this process's (and its finished children's), per second of wall time.

    On a shared machine this decides the timings: on a 2-vCPU VM one busy neighbour
    doubled the forward's and the step's times (2.4 -> 4.9 ms), of tilecore and of
    FBGEMM alike, while the work per call stayed the same; so each benchmark records it.
    `OtherLoad.start()`, run the code, `.cpus()` (None where /proc/stat is missing).
    """

    def __init__(self) -> None:
        self._busy, self._own, self._wall = _busy_seconds(), _own_seconds(), time.monotonic()

    @classmethod
    def start(cls) -> OtherLoad:
        return cls()

    def cpus(self) -> float | None:
        busy, wall = _busy_seconds(), time.monotonic() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return None
        return max(0.0, (busy - self._busy) - (_own_seconds() - self._own)) / wall
