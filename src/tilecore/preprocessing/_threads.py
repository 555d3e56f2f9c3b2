"""Worker threads for preprocessing: how many, and a reusable pool."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

NUM_THREADS_ENV = "TILECORE_NUM_THREADS"

_pools: dict[int, ThreadPoolExecutor] = {}


MIN_IDS_PER_THREAD = 1 << 16
"""The default uses one thread per this many IDs: below it, handing tasks to threads
costs more than it saves (a 1024-sample click batch ran 1.7x slower on 16 threads
than on 2 on a 16-core host)."""


def resolve_num_threads(num_threads: int | None, *, max_ids: int | None = None) -> int:
    """`num_threads`, else $TILECORE_NUM_THREADS, else the CPU count.

    With `max_ids` (an upper bound on the batch's IDs), the CPU-count default is
    capped at one thread per `MIN_IDS_PER_THREAD` IDs; explicit settings are kept.
    """
    source = "num_threads"
    if num_threads is None:
        env = os.environ.get(NUM_THREADS_ENV)
        if env is None:
            useful = None if max_ids is None else max_ids // MIN_IDS_PER_THREAD
            if useful is not None and useful <= 1:
                return 1  # without reading the CPU count (tens of µs per call on some hosts)
            cpus = max(1, os.cpu_count() or 1)
            return cpus if useful is None else min(cpus, useful)
        source = f"${NUM_THREADS_ENV}"
        try:
            num_threads = int(env)
        except ValueError:
            raise ValueError(f"{source} must be an integer >= 1, got {env!r}.") from None
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"{source} must be an integer >= 1, got {num_threads!r}.")
    return num_threads


def pool(num_threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of `num_threads` workers (created once per size)."""
    if num_threads not in _pools:
        _pools[num_threads] = ThreadPoolExecutor(num_threads, thread_name_prefix="tilecore")
    return _pools[num_threads]
