"""A plain-text progress bar with examples/s (no dependency): `\\r` on a terminal, lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 24


class Progress:
    """Reports `done/total` steps, the examples/s since `start`, and the latest loss.

    On a terminal the bar redraws in place; otherwise (a log file, a pipe) it
    prints a line every tenth of the run, so logs stay short.
    """

    def __init__(self, total: int, batch_size: int, *, stream: TextIO | None = None) -> None:
        self.total, self.batch_size = total, batch_size
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._every = max(1, total // 10)
        self._start: float | None = None
        self._start_step = 0
        self._excluded = 0.0

    def start(self, step: int) -> None:
        """Start the examples/s clock after `step` steps (e.g. once compilation is done)."""
        self._start, self._start_step = time.perf_counter(), step

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (e.g. an evaluation) out of the examples/s clock."""
        self._excluded += seconds

    def examples_per_s(self, done: int) -> float:
        if self._start is None or done <= self._start_step:
            return 0.0
        elapsed = time.perf_counter() - self._start - self._excluded
        return (done - self._start_step) * self.batch_size / max(elapsed, 1e-9)

    def update(self, done: int, loss: float | None, note: str = "") -> None:
        """`done` steps are finished; `loss` is the latest known training loss."""
        if not self.tty and done % self._every and done != self.total:
            return
        filled = _WIDTH * done // self.total
        bar = "=" * filled + (">" if filled < _WIDTH else "") + " " * (_WIDTH - filled - 1)
        rate = self.examples_per_s(done)
        text = (f"step {done:>{len(str(self.total))}}/{self.total} [{bar}] "
                f"{rate:>9,.0f} examples/s" + ("" if loss is None else f"  loss {loss:.4f}")
                + (f"  {note}" if note else ""))
        self.stream.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (e.g. an evaluation result) without breaking the bar."""
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
