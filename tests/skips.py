"""The skipped tests, summarised as one line per reason with a count (see conftest.py's
``pytest_terminal_summary``): ``-ra`` printed one line per skipped test, about a hundred
identical "no usable CUDA device" lines on a machine without a GPU."""

from __future__ import annotations

from collections import Counter

import pytest

__all__ = ["skip_reason", "summarise_skips"]


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a test was skipped, as ``pytest.skip`` or a skip marker gave it."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def summarise_skips(reporter: pytest.TerminalReporter) -> None:
    """Write one line per reason, most frequent first: ``N skipped: REASON``.

    A skipped test never counts as passed: the line says how many were skipped, and why.
    """
    reasons = Counter(skip_reason(report) for report in reporter.stats.get("skipped", []))
    if not reasons:
        return
    reporter.write_sep("=", f"{sum(reasons.values())} skipped, by reason")
    for reason, count in reasons.most_common():
        reporter.write_line(f"{count} skipped: {reason}")
