"""Wall-clock timing of jitted calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(call: Callable[[int], Any], *, warmup: int, repeats: int) -> float:
    """Median wall time of `call(i)`, blocked until its result is ready, over `repeats`
    calls after `warmup` untimed ones (the first compiles). `i` counts every call."""
    import jax

    for i in range(warmup):
        jax.block_until_ready(call(i))
    seconds = []
    for i in range(warmup, warmup + repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call(i))
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)
