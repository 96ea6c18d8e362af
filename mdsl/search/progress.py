"""The default progress display of a search: one short status line on stderr.

On a terminal the line is rewritten in place (at most ten times a second) and cut to the terminal's
width; otherwise (a log file, CI) a line of about `LIMIT` characters is printed every few seconds.
The final state is always printed, on a line of its own. The line says what a person watching needs:
time against the budget, candidates generated and verified, and the best estimate with its speed-up
over the original program's. `verbose` prints the search's full statistics instead (every prune
reason), a line every few seconds; `--log`'s JSON lines hold them too.
"""
from __future__ import annotations

import shutil
import sys
import time
from typing import Optional, TextIO

from mdsl.search.stats import GENERATED, VERIFIED, SearchStats

#: the longest status line: a longer kernel name is shortened to keep within it, down to _SHORTEST_NAME
LIMIT = 100
_SHORTEST_NAME = 16


def status(stats: SearchStats, limit: int = LIMIT) -> str:
    """One line, e.g. `mdsl search rms_norm_linear: 12/60 s, 48 candidates, 2 verified, best 13.9 us
    (1.14x)`: the best verified candidate's estimate, and how many times faster than the original's it is."""
    budget = stats.budget_s
    if not stats.done:
        when = f"{stats.elapsed_s:.0f}/{budget:g} s" if budget is not None else f"{stats.elapsed_s:.0f} s"
    elif stats.timed_out:
        when = f"stopped at {budget if budget is not None else stats.elapsed_s:.3g} s"
    else:
        when = f"done in {stats.elapsed_s:.1f} s"
    generated = stats.total(GENERATED)
    parts = [when, f"{generated} candidate{'' if generated == 1 else 's'}", f"{stats.total(VERIFIED)} verified"]
    if stats.best_seconds is not None:
        best = f"best {_us(stats.best_seconds)}"
        if stats.original_seconds and stats.best_seconds:   # a plan that launches nothing has no ratio
            best += f" ({stats.original_seconds / stats.best_seconds:.3g}x)"
        parts.append(best)
    return _line(stats.kernel, ", ".join(parts), limit)


def _line(kernel: str, text: str, limit: Optional[int] = None) -> str:
    """`text` after the search's name, the kernel's shortened to keep the line within `limit`."""
    if not kernel:
        return f"mdsl search: {text}"
    room = max(limit - len(f"mdsl search : {text}"), _SHORTEST_NAME) if limit is not None else len(kernel)
    name = kernel if len(kernel) <= room else kernel[:room - 3] + "..."
    return f"mdsl search {name}: {text}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"


class StatusLine:
    """A progress display: call it with the search's SearchStats (the engine does, on every count)."""

    def __init__(self, stream: Optional[TextIO] = None, *, interval_s: Optional[float] = None,
                 verbose: bool = False):
        self.stream = stream if stream is not None else sys.stderr
        self.verbose = verbose
        # a verbose line is too long to rewrite in place: it is printed as a line of its own
        self.tty = self.stream.isatty() and not verbose
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.tty else 5.0)
        self._last = time.monotonic()
        self._shown = ""   # the line on screen: not written again, and blanked by a shorter one

    def __call__(self, stats: SearchStats) -> None:
        now = time.monotonic()
        if not stats.done and now - self._last < self.interval_s:
            return
        self._last = now
        if self.verbose:
            line = _line(stats.kernel, stats.summary())
        elif self.tty:   # a rewritten line must fit the terminal: one that wraps cannot be rewritten
            columns = shutil.get_terminal_size().columns - 1
            line = status(stats, min(LIMIT, columns))[:columns]
        else:
            line = status(stats)
        if self.tty:
            if line == self._shown and not stats.done:
                return
            self.stream.write("\r" + line.ljust(len(self._shown)) + ("\n" if stats.done else ""))
            self._shown = "" if stats.done else line
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
