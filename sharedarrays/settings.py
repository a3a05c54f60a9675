"""Settings from the environment, read one way.

Every ``SHAREDARRAYS_*`` number is read by :func:`env_number`: unset or empty means the
default; anything else must be a number of the setting's kind, at least its minimum, or a
:class:`ValueError` names the variable and what it takes. A word (a name, an id) is read by
:func:`env_word` the same way: unset or empty means ``None``, anything else must match the
setting's pattern. A number of seconds given as an argument (an interval, a timeout) is
checked by :func:`seconds`.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
import warnings
from typing import TypeVar

from sharedarrays.errors import SettingError

__all__ = ["NUMBERS", "WORDS", "TOOLS", "check_environment", "env_number", "env_word", "seconds"]

N = TypeVar("N", int, float)


def env_number(name: str, default: N, minimum: N) -> N:
    """The number in the environment variable ``name`` (an int or a float like ``default``).

    Parameters
    ----------
    name : str
        The variable, e.g. ``"SHAREDARRAYS_KEEP_IMPORTS"``.
    default : int or float
        The value when the variable is unset or empty; its type is the setting's kind.
    minimum : int or float
        The smallest value accepted.

    Raises
    ------
    ValueError
        The value is not a number of that kind (or not finite), or is below ``minimum``.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    kind = type(default)
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise SettingError(f"{name}={text!r} is not {what}; unset it for the default") from None
    if kind is float and not math.isfinite(value):  # (nan passes every comparison)
        raise SettingError(f"{name}={text!r} is not a finite number; unset it for the default")
    if value < minimum:
        raise SettingError(f"{name} must be at least {minimum}, got {value}")
    return value


def env_word(name: str, pattern: re.Pattern[str], what: str) -> str | None:
    """The word in the environment variable ``name``, or ``None`` when it is unset or empty.

    Parameters
    ----------
    name : str
        The variable, e.g. ``"SHAREDARRAYS_NODE"``.
    pattern : re.Pattern
        What a value must match in full (surrounding blanks are dropped first).
    what : str
        What the pattern takes, in words, for the error message.

    Raises
    ------
    ValueError
        The value does not match ``pattern``.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not pattern.fullmatch(text):
        raise SettingError(f"{name}={text!r} is not {what}; unset it for the default")
    return text


NUMBERS: dict[str, tuple[type, int | float]] = {
    "SHAREDARRAYS_CHUNK_BYTES": (int, 1),
    "SHAREDARRAYS_KEEP_IMPORTS": (int, 0),
    "SHAREDARRAYS_KEEPER_IDLE": (float, 0.0),
    "SHAREDARRAYS_KEEPER_CONNECTIONS": (int, 1),
    "SHAREDARRAYS_POOL_MAX_BYTES": (int, 1),
    "SHAREDARRAYS_IN_FLIGHT": (float, 0.0),
    "SHAREDARRAYS_EXIT_WAIT": (float, 0.0),
    "SHAREDARRAYS_CACHE_BYTES": (int, 0),
}
"""Every number setting: its kind and minimum (each is read where it is used, with its
default, by :func:`env_number`; this table lets :func:`check_environment` read them all at
once)."""


WORDS = (
    "SHAREDARRAYS_NODE",
    "SHAREDARRAYS_NAMESPACE",
    "SHAREDARRAYS_HIP_MODULE",
    "SHAREDARRAYS_ASCEND_MODULE",
)
"""Every word setting (read where it is used, by :func:`env_word` or as a module name)."""
TOOLS = ("SHAREDARRAYS_BENCH_TIMEOUT", "SHAREDARRAYS_BENCH_DEBUG", "SHAREDARRAYS_CHROMIUM")
"""Settings of the benchmark (``python benchmarks/bench.py``) and of the test suite."""
PREFIX = "SHAREDARRAYS_"


def check_environment() -> None:
    """Read every number setting of :data:`NUMBERS` now (``import sharedarrays`` does), so
    that a bad one is refused where the process starts, not where it is first read (at exit
    a payload in flight was lost, a release failed with a warning, a keeper did not start);
    and warn of each ``SHAREDARRAYS_*`` variable that is no setting (a misspelt one is
    otherwise ignored without a word), naming the setting it is closest to.

    Raises
    ------
    ValueError
        One of them is bad (the message names it).
    """
    for name, (kind, minimum) in NUMBERS.items():
        env_number(name, kind(minimum), minimum)
    settings = (*NUMBERS, *WORDS)
    known = (*settings, *TOOLS)
    for name in sorted(os.environ):
        if name.startswith(PREFIX) and name not in known:
            # (the rest of the name against the settings' rest: every name shares the prefix)
            close = difflib.get_close_matches(
                name[len(PREFIX) :], [k[len(PREFIX) :] for k in known], n=1
            )
            hint = f" (did you mean {PREFIX}{close[0]}?)" if close else ""
            warnings.warn(
                f"{name} is not a sharedarrays setting{hint}: it is ignored. The settings "
                f"are {', '.join(settings)}",
                RuntimeWarning,
                stacklevel=2,
            )


def seconds(value: object, what: str, low: float, high: float, *, above: bool = False) -> float:
    """``value`` as a float number of seconds from ``low`` (``above``: more than ``low``) to
    ``high``: an argument such as an interval or a timeout, checked before anything runs.

    Raises
    ------
    TypeError
        ``value`` is not a real number (a string, ``None``, a bool).
    ValueError
        It is out of range, ``nan`` or infinite (``interval=0`` would refresh without pause).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    number = float(value)
    if above:
        if not low < number <= high:  # (False for nan)
            raise SettingError(
                f"{what} must be above {low:g} and at most {high:g} seconds, not {number:g}"
            )
    elif not low <= number <= high:
        raise SettingError(f"{what} must be from {low:g} to {high:g} seconds, not {number:g}")
    return number
