"""A search's progress display: a short status line, the full statistics when asked, and on by default
only where stderr is a terminal."""
from __future__ import annotations

import io

import pytest

import mdsl
from mdsl import Tensor, f32
from mdsl.search.config import SearchConfig
from mdsl.search.engine import optimize
from mdsl.search.progress import LIMIT, StatusLine, status
from mdsl.search.stats import SearchStats
from tests.search import fakes

QUICK = SearchConfig(budget_s=30, workers=1)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def busy_stats(kernel: str = "rms_norm_linear_bs1", **fields) -> SearchStats:
    """The statistics of a search well under way, with every kind of count a real one has."""
    stats = SearchStats(kernel=kernel, budget_s=120.0, original_seconds=15.9e-6, elapsed_s=61.25, **fields)
    for reason, n in (("phase", 1177077), ("dead-end", 936529), ("abstract-expression", 262002),
                      ("guided: does not lift", 658), ("shared-memory", 362)):
        stats.count("pruned", reason, n)
    stats.count("generated", "enumerate", 526)
    stats.count("generated", "guided", 48)
    stats.count("verified", n=14)
    stats.count("skipped", "no faster than the original (estimate)", 544)
    stats.count("work", "verify", 1800)
    stats.best_seconds = 13.9e-6
    return stats


def test_the_status_line_is_short_and_says_time_counts_and_the_best_with_its_speedup():
    line = status(busy_stats())
    assert line == "mdsl search rms_norm_linear_bs1: 61/120 s, 574 candidates, 14 verified, best 13.9 us (1.14x)"
    assert len(line) <= LIMIT
    assert "phase" not in line and "dead-end" not in line   # no prune reasons


@pytest.mark.parametrize("done, timed_out, when", [(True, False, "done in 61.2 s"), (True, True, "stopped at 120 s")])
def test_the_final_status_says_how_the_search_ended(done, timed_out, when):
    assert f": {when}, 574 candidates" in status(busy_stats(done=done, timed_out=timed_out))


def test_a_long_kernel_name_is_shortened_to_keep_the_line_short():
    name = "a_kernel_with_a_very_long_name_indeed_" * 3
    line = status(busy_stats(name))
    assert len(line) <= LIMIT and line.startswith("mdsl search a_kernel_with_a_") and "...: 61/120 s" in line


def test_elsewhere_a_line_is_printed_now_and_then_and_the_final_state_always():
    stream = io.StringIO()
    line = StatusLine(stream)
    stats = SearchStats()
    stats.count("generated", "guided", 3)
    line(stats)               # within the interval: nothing
    stats.done = True
    line(stats)
    assert stream.getvalue() == "mdsl search: done in 0.0 s, 3 candidates, 0 verified\n"


def test_on_a_terminal_the_line_is_rewritten_in_place_within_its_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    stream = Terminal()
    line = StatusLine(stream, interval_s=0.0)
    line(busy_stats())
    line(busy_stats())        # the same line: not written again
    line(busy_stats(done=True))
    first, final = stream.getvalue().split("\r")[1:]
    assert len(first) == 59 and "\n" not in first   # cut to the terminal: a wrapped line cannot be rewritten
    assert final.startswith("mdsl search ") and final.endswith("\n") and len(final.rstrip()) <= 59


def test_verbose_prints_the_full_statistics_line_by_line_even_on_a_terminal():
    stream = Terminal()
    line = StatusLine(stream, interval_s=0.0, verbose=True)
    line(busy_stats())
    text = stream.getvalue()
    assert "\r" not in text and text.endswith("\n")
    assert text.startswith("mdsl search rms_norm_linear_bs1: 61.2s, 574 candidates (enumerate 526, guided 48)")
    assert "pruned 2376628 (phase 1177077, dead-end 936529," in text


def run_quietly(monkeypatch, stderr: io.StringIO, progress=None):
    monkeypatch.setattr("sys.stderr", stderr)
    return optimize(fakes.ORIGINAL, QUICK, cache=False, generators=[fakes.mixed], verifier=fakes.verify,
                    progress=progress)


@pytest.mark.timeout(30)
def test_by_default_a_search_shows_its_status_line_on_a_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    stderr = Terminal()
    run_quietly(monkeypatch, stderr)
    text = stderr.getvalue()
    assert text.startswith("\rmdsl search double: ") and text.endswith("\n")
    assert "done in " in text and "8 candidates, 2 verified, best 2 us (3x)" in text


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stderr, progress", [(io.StringIO(), None), (Terminal(), False)])
def test_elsewhere_or_when_told_not_to_it_is_silent(monkeypatch, stderr, progress):
    run_quietly(monkeypatch, stderr, progress)
    assert stderr.getvalue() == ""


@pytest.mark.timeout(30)
def test_asked_for_it_shows_progress_when_stderr_is_not_a_terminal(monkeypatch):
    stderr = io.StringIO()
    run_quietly(monkeypatch, stderr, True)
    (line,) = stderr.getvalue().splitlines()   # a short search: only its final state
    assert line.startswith("mdsl search double: done in ") and len(line) <= LIMIT


@pytest.mark.timeout(60)
def test_kernel_optimize_shows_progress_on_a_terminal_and_not_elsewhere(monkeypatch):
    @mdsl.kernel
    def scaled(x: Tensor[8, 16, f32]):
        return x * 2.0

    config = SearchConfig(budget_s=20, workers=1)
    for stderr, shown in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr("sys.stderr", stderr)
        scaled.optimize(config=config, cache=False)
        assert stderr.getvalue().startswith("\rmdsl search scaled: ") is shown
