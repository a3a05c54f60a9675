"""Numeric settings from the environment, read one way.

Every ``SHAREDARRAYS_*`` number is read by :func:`env_number`: unset or empty means the
default; anything else must be a number of the setting's kind, at least its minimum, or a
:class:`ValueError` names the variable and what it takes.
"""

from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["env_number"]

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
        The value is not a number of that kind, or is below ``minimum``.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    kind = type(default)
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name}={text!r} is not {what}; unset it for the default") from None
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value
