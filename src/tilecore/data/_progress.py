"""Progress of long reads on stderr: quiet unless a read takes seconds.

A read (skipping to a training batch far into a file, when resuming) reports
only after `after_s` seconds: on a terminal a line redrawn in place, otherwise
one line every `every_s` seconds, so logs and tests stay quiet.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ReadProgress:
    """Reports how far through `label` a long read has got (see the module docstring)."""

    def __init__(self, label: str, *, enabled: bool = True, stream: TextIO | None = None,
                 after_s: float = 2.0, every_s: float = 30.0) -> None:
        self.label, self.enabled = label, enabled
        self.stream = stream
        self.after_s, self.every_s = after_s, every_s
        self._start = self._last = 0.0
        self._shown = False

    def start(self) -> None:
        """A read begins (reports nothing yet)."""
        self._start = self._last = time.perf_counter()
        self._shown = False

    def update(self, done: int, total: int, what: str) -> None:
        """`done` of `total` (bytes or rows) read, on the way to `what`."""
        now = time.perf_counter()
        if not self.enabled or now - self._start < self.after_s:
            return
        stream = self.stream or sys.stderr
        tty = bool(getattr(stream, "isatty", lambda: False)())
        if not tty and self._shown and now - self._last < self.every_s:
            return
        if tty and now - self._last < 0.2 and self._shown:
            return
        percent = 100.0 * done / total if total else 100.0
        text = f"reading {self.label}: {percent:5.1f}% of the file, to {what}"
        stream.write(f"\r{text}" if tty else f"{text}\n")
        stream.flush()
        self._shown, self._last = True, now

    def finish(self) -> None:
        """The read is done: end the redrawn line, if one was shown."""
        stream = self.stream or sys.stderr
        if self._shown and bool(getattr(stream, "isatty", lambda: False)()):
            stream.write("\n")
            stream.flush()
        self._shown = False
