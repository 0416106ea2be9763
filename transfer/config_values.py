"""Checks for configuration values, shared by explicit options and environment variables.

Each check returns the value unchanged or raises ValueError naming the option (or variable):
a bad value must never be replaced by a default or truncated into a different one.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TRUE_WORDS = ("1", "true", "on", "yes")
FALSE_WORDS = ("0", "false", "off", "no")
FLAG_HELP = "use 1/true/on/yes or 0/false/off/no"


def flag(name: str, value: object) -> bool:
    """A bool, 0/1, or one of the flag words (case-insensitive)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(f"{name}={value!r}: {FLAG_HELP}")


def count(name: str, value: object, lo: int = 1, hi: int | None = None) -> int:
    """An int (not a bool, not a float) in lo..hi."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    number = int(value)
    if number < lo or (hi is not None and number > hi):
        raise ValueError(f"{name}={value!r} is outside {lo}..{hi if hi is not None else 'inf'}")
    return number


def positive(name: str, value: object, hi: float = math.inf) -> float:
    """A finite real number in (0, hi]."""
    number = real(name, value)
    if not (math.isfinite(number) and 0 < number <= hi):
        bound = f"at most {hi:g}" if math.isfinite(hi) else "finite"
        raise ValueError(f"{name}={value!r} must be > 0 and {bound}")
    return value  # type: ignore[return-value]  # the caller's number as given (an int stays an int)


def real(name: str, value: object) -> float:
    """A real number (not a bool), as given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return value  # type: ignore[return-value]  # a numbers.Real: int, float, numpy scalars


def port(name: str, value: object) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    return count(name, value, 0, 65535)


def from_env(var: str, default: T, parse: Callable[[str], object], check: Callable[[str, object], T]) -> T:
    """The variable parsed and checked under its own name; unset or empty: the default."""
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return default
    try:
        val = parse(raw.strip())
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not a valid value") from None
    return check(var, val)
