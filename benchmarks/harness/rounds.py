"""Interleaved rounds: every method once per round, in a balanced order, and each method's
overhead over the floor as the median of its per-round differences.

The Pool's own round trip drifts within one run by more than the differences the bench
resolves (docs/performance.md: the floor alone ranged 0.31-0.80 ms in one H200 run),
so a method is never compared with a floor timed minutes apart: each round times the floor
and every method once, back to back, and the method's figure is the median over rounds of
(method - floor of the same round). A round's order is a row of a Williams design
(:func:`round_order`): every method stands in every place, and follows every other method,
equally often, so that no method always follows the same neighbour (a handoff pays for what
the one before it left behind: the first task after a big message, a large free), and an
untimed lead-in before each round (:func:`run_rounds`' ``lead_in``) gives every round's
first entry the same neighbour before it, which the design leaves out. (The bench's timed
calls, :meth:`harness.measure.Run._rounds`, each end with a settling floor task,
so that work a task leaves behind in the worker is charged to that task's entry.) Nothing
here touches a Pool: :func:`run_rounds` calls the function it is given, which the tests
replace with a clock of their own.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FLOOR", "round_order", "run_rounds", "over_floor", "percentile", "median_interval"]

FLOOR = "floor"
"""The name of the floor among the entries of a round."""


def round_order(names: Sequence[str], index: int) -> list[str]:
    """The order of round ``index``: row ``index`` of a Williams design over ``names``.

    A Latin square balanced for the neighbour before: its first row is places ``0, 1, n-1,
    2, n-2, ...``, row ``k`` adds ``k`` to each place (mod ``n``), and for an odd ``n`` rows
    ``n`` to ``2n-1`` are the first ``n`` reversed. Over one period (``n`` rounds for an even
    number of names, ``2n`` for an odd one) every name stands in every place equally often and
    follows every other name within a round equally often.
    """
    n = len(names)
    if not n:
        return []
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    k = index % (n if n % 2 == 0 else 2 * n)
    row = [names[(place + k) % n] for place in first]
    return row[::-1] if k >= n else row


def run_rounds(
    names: Sequence[str],
    rounds: int,
    time_one: Callable[[str], float],
    *,
    warmup: int = 0,
    before_round: Callable[[int], None] | None = None,
    after_round: Callable[[int], None] | None = None,
    lead_in: Callable[[], None] | None = None,
    max_seconds: float | None = None,
    min_rounds: int = 3,
) -> dict[str, list[float]]:
    """Time every name once per round, in :func:`round_order`, ``warmup + rounds`` rounds.

    Parameters
    ----------
    names : sequence of str
        The entries of a round (usually the floor first, then the methods).
    rounds : int
        Timed rounds.
    time_one : callable
        ``time_one(name)`` -> seconds of one timed call of that entry.
    warmup : int
        Untimed rounds first (their samples are dropped).
    before_round, after_round : callable, optional
        Called with the round's index (warm-up rounds included) around each round, outside
        every timed call: a cold method makes its new objects before and frees them after.
        ``after_round`` runs also when the round failed (then the error propagates).
    lead_in : callable, optional
        Called untimed right before each round's first timed call (after
        ``before_round``), so that every round's first entry follows it, the same thing
        every time. Without it, the first entry of a round follows the last entry of the
        round before, and the Williams design leaves that neighbour unbalanced: with an
        even number of entries each one is first after the same one entry every time
        (after one of two with an odd number), and so pays what that entry leaves behind
        in one round of ``n`` more than the others do.
    max_seconds : float, optional
        Stop after the round during which this much wall time has passed since the first
        timed round, once ``min_rounds`` timed rounds are done.

    Returns
    -------
    dict
        name -> one sample (seconds) per timed round, in round order (every list has the
        same length, so index ``i`` of each is round ``i``).
    """
    samples: dict[str, list[float]] = {name: [] for name in names}
    started: float | None = None
    for index in range(warmup + rounds):
        if index == warmup:
            started = time.perf_counter()
        try:
            if before_round is not None:
                before_round(index)
            if lead_in is not None:
                lead_in()
            got = {name: time_one(name) for name in round_order(names, index)}
        finally:
            if after_round is not None:
                after_round(index)
        if index < warmup:
            continue
        for name in names:
            samples[name].append(got[name])
        done = index - warmup + 1
        if (
            max_seconds is not None
            and started is not None
            and done >= min_rounds
            and time.perf_counter() - started > max_seconds
        ):
            break
    return samples


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values`` (95% for the
    default ``z``): the order statistics of ranks ``n/2 - z*sqrt(n)/2`` and ``1 + n/2 +
    z*sqrt(n)/2`` (rounded outwards, 1-based), from the binomial count of values below the
    true median (Conover, *Practical Nonparametric Statistics*). No resampling: the same
    values give the same interval. With fewer than 3 values, their range."""
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        raise ValueError("no values")
    if n < 3:
        return ordered[0], ordered[-1]
    half = z * math.sqrt(n) / 2
    low = max(1, math.floor(n / 2 - half))
    high = min(n, math.ceil(1 + n / 2 + half))
    return ordered[low - 1], ordered[high - 1]


def over_floor(samples: dict[str, list[float]], floor: str = FLOOR) -> dict[str, dict[str, Any]]:
    """Each method's overhead over the floor, from :func:`run_rounds`' samples.

    Returns
    -------
    dict
        method name -> ``median_us``, ``p10_us``, ``p90_us`` of the per-round differences
        (method - floor of the same round, microseconds), ``ci95_us`` (the median's 95%
        interval, :func:`median_interval`), ``method_median_ms`` (the method's own median),
        ``rounds`` and ``diffs_us`` (every per-round difference).
    """
    base = samples[floor]
    out: dict[str, dict[str, Any]] = {}
    for name, values in samples.items():
        if name == floor:
            continue
        if len(values) != len(base) or not values:
            raise ValueError(f"{name} has {len(values)} rounds, the floor {len(base)}")
        diffs = [(v - f) * 1e6 for v, f in zip(values, base)]
        out[name] = {
            "median_us": statistics.median(diffs),
            "p10_us": percentile(diffs, 0.10),
            "p90_us": percentile(diffs, 0.90),
            "ci95_us": list(median_interval(diffs)),
            "method_median_ms": statistics.median(values) * 1e3,
            "rounds": len(diffs),
            "diffs_us": diffs,
        }
    return out
