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
