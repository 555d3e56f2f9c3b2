"""Cheap peak-memory probes: how far the resident set rises while some code runs.

tracemalloc does not see memory that numba kernels allocate, so the probe reads
the process's resident set instead. On Linux with glibc, `malloc_trim(0)` first
hands memory freed earlier back to the OS, and writing 5 to /proc/self/clear_refs
resets the high-water mark (VmHWM) to the current RSS, so the peak between
`start` and `stop` is measured exactly ("vmhwm"). Elsewhere the lifetime peak of
`resource.getrusage` is all there is ("maxrss"): a lower bound, short by however
far an earlier phase went higher.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import resource
import sys


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def mapped_file_mb() -> float:
    """Resident MB of this process's file mappings (`RssFile`: its libraries' code and
    data, which the kernel can drop and read again), 0 where /proc does not say."""
    return (_status_kib("RssFile") or 0) / 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _release_freed_memory() -> None:
    """Return freed heap memory to the OS (glibc only; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    if sys.platform != "linux" or name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


@dataclasses.dataclass(kw_only=True)
class PeakProbe:
    """`probe = PeakProbe.start()`; run the code; `probe.extra_bytes()`."""

    before: int
    method: str  # "vmhwm" (exact peak) or "maxrss" (lower bound)

    @classmethod
    def start(cls) -> PeakProbe:
        _release_freed_memory()
        rss = _status_kib("VmRSS")
        if rss is not None and _reset_peak():
            return cls(before=rss * 1024, method="vmhwm")
        return cls(before=_maxrss_bytes(), method="maxrss")

    def peak_bytes(self) -> int:
        """Resident bytes at the peak since `start` (exact with "vmhwm"; with "maxrss" the
        process's lifetime peak, which may predate `start`)."""
        if self.method == "vmhwm":
            return (_status_kib("VmHWM") or 0) * 1024
        return _maxrss_bytes()

    def extra_bytes(self) -> int:
        """Peak resident bytes since `start`, above the resident bytes at `start`."""
        if self.method == "vmhwm":
            peak = _status_kib("VmHWM")
            return max(0, (peak or 0) * 1024 - self.before)
        return max(0, _maxrss_bytes() - self.before)
