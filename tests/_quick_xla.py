"""The suite's quick-compile XLA:CPU switches, where this jaxlib's XLA knows them.

XLA aborts the process on a flag it does not know (jax 0.11.2 no longer knows
`--xla_cpu_use_fusion_emitters`: on a GPU machine with it every test worker died at
start-up), so the switches are first tried in a child process, once per jaxlib version and
set of flags (the answer kept in a file of the compilation cache's folder).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import sys
import zlib

QUICK_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",
                   "--xla_cpu_parallel_codegen_split_count=1")


def with_quick_flags(flags: str, cache: str) -> str:
    """`flags` (an XLA_FLAGS value) with every switch of `QUICK_XLA_FLAGS` that it lacks
    and this XLA starts with; `cache`: a folder for the answer."""
    missing = [f for f in QUICK_XLA_FLAGS if f.split("=")[0] not in flags]
    if missing and not _xla_knows(" ".join(missing), cache):  # one child where all are known
        missing = [f for f in missing if _xla_knows(f, cache)]
    return " ".join([flags, *missing]).strip()


def _xla_knows(flags: str, cache: str) -> bool:
    """Whether a process whose XLA_FLAGS is `flags` starts JAX's CPU backend."""
    answer = os.path.join(cache, "xla-flags-{}-{:08x}".format(
        importlib.metadata.version("jaxlib"), zlib.crc32(flags.encode())))
    with contextlib.suppress(OSError), open(answer) as kept:
        return kept.read() == "yes"
    child = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"],
                           capture_output=True, check=False,
                           env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"))
    with contextlib.suppress(OSError), open(answer, "w") as kept:
        kept.write("yes" if child.returncode == 0 else "no")
    return child.returncode == 0
