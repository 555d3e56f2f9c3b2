"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) without losing it.

While `StopSignals` is active, the first SIGINT or SIGTERM only records the request:
the step loop stops taking batches, lets the steps in flight finish (a pipelined loop
drains), evaluates and saves a checkpoint at the step it reached, and returns. A
second SIGINT interrupts at once (KeyboardInterrupt), as Ctrl-C did before. Signal
handlers can only be set from the main thread; elsewhere nothing is installed and
the signals keep their usual effect.
"""

from __future__ import annotations

import contextlib
import signal
from types import FrameType, TracebackType

from .._signals import handling_signals

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """`with StopSignals() as stop:` … `stop.requested()` after each step."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._handlers = contextlib.ExitStack()

    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.signal is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.signal = signal.Signals(signum)

    def __enter__(self) -> StopSignals:
        self._handlers.enter_context(handling_signals(STOP_SIGNALS, self._handle))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._handlers.close()
