"""Settings from the environment (``SHAREDARRAYS_*``): unset or empty means the default,
anything else must be valid or a :class:`~sharedarrays.errors.SettingError` says why."""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
import warnings
from types import MappingProxyType
from typing import TypeVar

from sharedarrays.errors import SettingError

__all__ = ["NUMBERS", "WORDS", "TOOLS", "check_environment", "env_number", "env_word", "seconds"]

N = TypeVar("N", int, float)


def env_number(name: str, default: N, minimum: N) -> N:
    """The number (of ``default``'s type, at least ``minimum``) in ``$name``, or ``default``."""
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
    """The word in the environment variable ``name`` matching ``pattern`` (``what``), or None."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not pattern.fullmatch(text):
        raise SettingError(f"{name}={text!r} is not {what}; unset it for the default")
    return text


NUMBERS: MappingProxyType[str, int | float] = MappingProxyType(
    {
        "SHAREDARRAYS_CHUNK_BYTES": 1,
        "SHAREDARRAYS_KEEP_IMPORTS": 0,
        "SHAREDARRAYS_KEEPER_IDLE": 0.0,
        "SHAREDARRAYS_KEEPER_CONNECTIONS": 1,
        "SHAREDARRAYS_POOL_MAX_BYTES": 1,
        "SHAREDARRAYS_IN_FLIGHT": 0.0,
        "SHAREDARRAYS_EXIT_WAIT": 0.0,
        "SHAREDARRAYS_CACHE_BYTES": 0,
        "SHAREDARRAYS_TAKE_FDS": 0,
    }
)
"""Every number setting's minimum, of its kind (read where it is used, by :func:`env_number`)."""


WORDS = (
    "SHAREDARRAYS_NODE",
    "SHAREDARRAYS_NAMESPACE",
    "SHAREDARRAYS_HIP_MODULE",
    "SHAREDARRAYS_ASCEND_MODULE",
)
"""Every word setting (read by :func:`env_word` or as a module name)."""
TOOLS = ("SHAREDARRAYS_BENCH_TIMEOUT", "SHAREDARRAYS_BENCH_DEBUG", "SHAREDARRAYS_CHROMIUM")
"""Settings of the benchmark (``python benchmarks/bench.py``) and of the test suite."""
PREFIX = "SHAREDARRAYS_"


def check_environment() -> None:
    """Refuse a bad number setting at ``import sharedarrays`` (not at exit), and warn of each
    ``SHAREDARRAYS_*`` variable that is no setting, naming the closest one."""
    for name, minimum in NUMBERS.items():
        env_number(name, minimum, minimum)
    settings = (*NUMBERS, *WORDS)
    known = (*settings, *TOOLS)
    for name in sorted(os.environ):
        if name.startswith(PREFIX) and name not in known:
            rest = [k[len(PREFIX) :] for k in known]  # (every name shares the prefix)
            close = difflib.get_close_matches(name[len(PREFIX) :], rest, n=1)
            hint = f" (did you mean {PREFIX}{close[0]}?)" if close else ""
            warnings.warn(
                f"{name} is not a sharedarrays setting{hint}: it is ignored. The settings "
                f"are {', '.join(settings)}",
                RuntimeWarning,
                stacklevel=2,
            )


def seconds(value: object, what: str, low: float, high: float, *, above: bool = False) -> float:
    """An argument of seconds as a float from ``low`` (``above``: more than ``low``) to
    ``high``: TypeError for no real number, SettingError out of range or ``nan``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    number = float(value)
    if not (low < number if above else low <= number) or not number <= high:  # (nan: refused)
        bounds = f"above {low:g} and at most" if above else f"from {low:g} to"
        raise SettingError(f"{what} must be {bounds} {high:g} seconds, not {number:g}")
    return number
