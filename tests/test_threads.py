"""How many preprocessing threads: explicit, from the environment, or sized to the batch."""

from __future__ import annotations

import os

import pytest

from tilecore.preprocessing import NUM_THREADS_ENV, resolve_num_threads
from tilecore.preprocessing._threads import MIN_IDS_PER_THREAD


def test_default_is_capped_by_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NUM_THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert resolve_num_threads(None) == 16
    assert resolve_num_threads(None, max_ids=10) == 1
    assert resolve_num_threads(None, max_ids=3 * MIN_IDS_PER_THREAD + 5) == 3
    assert resolve_num_threads(None, max_ids=100 * MIN_IDS_PER_THREAD) == 16


def test_explicit_and_environment_settings_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NUM_THREADS_ENV, "5")
    assert resolve_num_threads(None, max_ids=10) == 5
    assert resolve_num_threads(7, max_ids=10) == 7
    monkeypatch.setenv(NUM_THREADS_ENV, "many")
    with pytest.raises(ValueError, match=r"\$TILECORE_NUM_THREADS must be an integer >= 1"):
        resolve_num_threads(None)
    with pytest.raises(ValueError, match="num_threads must be an integer >= 1, got 0"):
        resolve_num_threads(0)


def test_pools_of_sizes_no_longer_asked_for_end_their_threads() -> None:
    """A pool per thread count was kept for ever: a program that asked for 2..399 threads
    kept 982 idle threads. The most recent few sizes are kept; the others' threads end."""
    import gc
    import threading
    import time

    from tilecore.preprocessing import _threads

    def alive() -> int:
        return sum(t.name.startswith("tilecore") for t in threading.enumerate())

    for n in range(2, 40):
        assert list(_threads.pool(n).map(abs, range(-n, 0))) == list(range(n, 0, -1))
    gc.collect()
    deadline = time.monotonic() + 10
    while alive() > sum(_threads._pools) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_threads._pools) == _threads.KEPT_POOLS
    assert alive() <= sum(_threads._pools)  # 36..39 at most, not the 740 started
    assert _threads.pool(39) is _threads.pool(39)
