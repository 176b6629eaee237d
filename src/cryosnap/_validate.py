"""Argument validators: one rule and one message shape for every public argument check.

A wrong type is a ``TypeError``, a bad value of the right type a ``ValueError``; a ``bool`` is
never an int. Pure functions, no state: any thread may call them; the library calls them
eagerly, on the caller's thread, before any work starts. Imports nothing from cryosnap at
import time. docs/design/api.md has the rule and the messages.
"""

from __future__ import annotations

import math
from typing import Literal, NoReturn, overload

# The largest step a version may have: the format's limit (cryosnap._format.limits re-exports
# it), defined here at the bottom so that validation imports nothing of the package.
MAX_STEP = 10**12 - 1

__all__ = [
    "bad_value",
    "boolean",
    "fraction",
    "integer",
    "non_negative_int",
    "number",
    "positive_int",
    "positive_int_or_none",
    "seconds",
    "step",
    "wrong_type",
]


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def wrong_type(value: object, name: str, allowed: str) -> NoReturn:
    """Raise the ``TypeError`` of the rule (for checks that are not one of the validators)."""
    raise TypeError(f"{name} must be {allowed}, got {_show(value)} ({type(value).__name__})")


def bad_value(value: object, name: str, allowed: str) -> NoReturn:
    """Raise the ``ValueError`` of the rule (for checks that are not one of the validators)."""
    raise ValueError(f"{name}={_show(value)} is invalid: allowed is {allowed}")


def integer(
    value: object,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allowed: str | None = None,
) -> int:
    """``value`` if it is an int (not a bool) within ``[minimum, maximum]`` (None: no bound)."""
    if allowed is None:
        allowed = _int_range(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, int):
        wrong_type(value, name, allowed)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bad_value(value, name, allowed)
    return value


def _int_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int from {minimum} to {maximum}"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def positive_int(value: object, name: str, *, allowed: str = "a positive int") -> int:
    """``value`` if it is an int >= 1."""
    return integer(value, name, minimum=1, allowed=allowed)


def non_negative_int(value: object, name: str, *, allowed: str = "an int >= 0") -> int:
    """``value`` if it is an int >= 0."""
    return integer(value, name, minimum=0, allowed=allowed)


def positive_int_or_none(
    value: object, name: str, *, allowed: str = "a positive int or None"
) -> int | None:
    """``value`` if it is None or an int >= 1."""
    return None if value is None else integer(value, name, minimum=1, allowed=allowed)


def step(value: object, name: str = "step") -> int:
    """``value`` if it is a step a version can have: an int from 0 to ``MAX_STEP``."""
    return integer(value, name, minimum=0, maximum=MAX_STEP)


def number(value: object, name: str, *, allowed: str = "a finite number") -> float:
    """``value`` as a float if it is a finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        wrong_type(value, name, allowed)
    if not math.isfinite(value):
        bad_value(value, name, allowed)
    return float(value)


@overload
def seconds(
    value: object,
    name: str,
    *,
    allow_none: Literal[False] = False,
    allow_zero: bool = False,
    allowed: str | None = None,
) -> float: ...


@overload
def seconds(
    value: object,
    name: str,
    *,
    allow_none: bool,
    allow_zero: bool = False,
    allowed: str | None = None,
) -> float | None: ...


def seconds(
    value: object,
    name: str,
    *,
    allow_none: bool = False,
    allow_zero: bool = False,
    allowed: str | None = None,
) -> float | None:
    """``value`` as a float if it is a finite number of seconds, > 0 (>= 0 with
    ``allow_zero``); None passes with ``allow_none``."""
    if allowed is None:
        allowed = (
            "a finite number of seconds >= 0"
            if allow_zero
            else "a positive, finite number of seconds"
        )
        if allow_none:
            allowed += " or None"
    if value is None and allow_none:
        return None
    out = number(value, name, allowed=allowed)
    if out < 0 or (out == 0 and not allow_zero):
        bad_value(value, name, allowed)
    return out


def fraction(value: object, name: str, *, allowed: str = "a fraction in (0, 1)") -> float:
    """``value`` as a float if it is a number strictly between 0 and 1."""
    out = number(value, name, allowed=allowed)
    if not 0 < out < 1:
        bad_value(value, name, allowed)
    return out


def boolean(value: object, name: str) -> bool:
    """``value`` if it is a bool (an int or a truthy object is not: say True or False)."""
    if not isinstance(value, bool):
        wrong_type(value, name, "a bool")
    return value
