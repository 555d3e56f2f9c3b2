"""Signal handlers set for the length of a block, then put back."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any


@contextlib.contextmanager
def handling_signals(signums: Iterable[int],
                     handler: Callable[[int, FrameType | None], Any]) -> Iterator[None]:
    """While the block runs, `handler` takes `signums`; the previous handlers afterwards.
    Only the main thread may set handlers: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
