"""The default progress display of a search: one status line on stderr.

On a terminal the line is rewritten in place (at most ten times a second); otherwise (a log file, CI)
a line is printed every few seconds. The final state is always printed, on a line of its own.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from mdsl.search.stats import SearchStats


class StatusLine:
    def __init__(self, stream: Optional[TextIO] = None, *, interval_s: Optional[float] = None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.tty else 5.0)
        self._last = time.monotonic()
        self._width = 0  # of the line on screen, so that a shorter one can blank its tail

    def __call__(self, stats: SearchStats) -> None:
        now = time.monotonic()
        if not stats.done and now - self._last < self.interval_s:
            return
        self._last = now
        line = f"mdsl search: {stats.summary()}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width) + ("\n" if stats.done else ""))
            self._width = 0 if stats.done else len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
