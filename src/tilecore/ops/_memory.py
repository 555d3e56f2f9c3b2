"""Whether a plan's variables can fit at all, asked before they are allocated.

A table too large for the machine otherwise ends badly: numpy raises a bare
`MemoryError`, XLA a `RESOURCE_EXHAUSTED` naming no table, and on Linux a lazily
committed allocation is filled until the kernel's OOM killer ends the process
without a word.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from .._host import host_memory_bytes
from ..stacking import StackingPlan

_GIB = 2**30


def variables_bytes(plan: StackingPlan) -> dict[str, int]:
    """Bytes of every stack's table (in its `weights_dtype`) and float32 optimizer slots,
    over all devices."""
    out = {}
    for name, spec in plan.stacks.items():
        table = np.dtype(spec.weights_dtype).itemsize
        slots = 4 * len(spec.optimizer.slot_names)
        out[name] = spec.vocab_size * spec.embedding_dim * (table + slots)
    return out


def check_memory(plan: StackingPlan, *, mesh: Mesh | None = None) -> None:
    """Raise `MemoryError` when `plan`'s tables and slots cannot fit where they would go.

    On CPU devices the limit is the host's memory and swap, shared by this process's
    devices (their share of the rows); on an accelerator each device's own memory
    (`bytes_limit`), where the backend reports it. Only what can never fit is refused:
    the check knows nothing of the memory other programs use. `init_tables` calls it.
    """
    sizes = variables_bytes(plan)
    total = sum(sizes.values())
    devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    local = [d for d in devices if d.process_index == jax.process_index()] or devices[:1]
    share = total // plan.topology.global_devices  # each device holds 1/G of every stack's rows
    if local[0].platform == "cpu":
        need, limit, where = share * len(local), host_memory_bytes(), "this host's memory and swap"
    else:
        stats = local[0].memory_stats() or {}
        need, limit, where = share, stats.get("bytes_limit"), f"the memory of {local[0]}"
    if limit is None or need <= limit:
        return
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    shown = ", ".join(f"{name!r} {size / _GIB:,.1f} GiB" for name, size in largest)
    raise MemoryError(
        f"The plan's tables and optimizer slots need {need / _GIB:,.1f} GiB here, more than "
        f"{where} ({limit / _GIB:,.1f} GiB); the largest stacks: {shown}. Use smaller "
        "vocabularies or embedding dims, 16-bit tables (weights_dtype), or more devices.")
