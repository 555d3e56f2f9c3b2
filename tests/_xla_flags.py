"""XLA_FLAGS for the tests' child processes: this session's own flags (conftest's quick-compile
switches, which a child inherits) with the host platform's device count set, or removed."""

from __future__ import annotations

import os
import re

from tilecore_apps._devices import with_device_count

_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


def xla_flags(devices: int | None = None) -> str:
    """This process's XLA_FLAGS with `devices` CPU devices (None: XLA's default, one)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return with_device_count(flags, devices) if devices else " ".join(_COUNT.sub("", flags).split())
