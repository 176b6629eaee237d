"""The argument validators: a wrong type is a TypeError, a bad value of the right type a
ValueError, and both messages name the argument, the value and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest

from cryosnap import _validate as v
from cryosnap._format.limits import MAX_STEP

Validator = Callable[[object, str], object]

NUMERIC: list[Validator] = [
    v.integer,
    v.positive_int,
    v.non_negative_int,
    v.positive_int_or_none,
    v.step,
    v.number,
    v.seconds,
    v.fraction,
]


@pytest.mark.parametrize("check", NUMERIC)
@pytest.mark.parametrize("value", [True, False, "1", b"1", [1], Fraction(1, 2)])
def test_a_wrong_type_is_a_type_error(check: Validator, value: object) -> None:
    with pytest.raises(TypeError, match=rf"^arg must be .*, got .* \({type(value).__name__}\)$"):
        check(value, "arg")


def test_ints() -> None:
    assert v.integer(-5, "x") == -5
    assert v.positive_int(1, "x") == 1
    assert v.non_negative_int(0, "x") == 0
    assert v.positive_int_or_none(None, "x") is None
    assert v.positive_int_or_none(7, "x") == 7
    assert v.integer(3, "x", minimum=3, maximum=3) == 3
    with pytest.raises(ValueError, match=r"^full_every=0 is invalid: allowed is a positive int$"):
        v.positive_int(0, "full_every")
    with pytest.raises(ValueError, match=r"^x=-1 is invalid: allowed is an int >= 0$"):
        v.non_negative_int(-1, "x")
    with pytest.raises(ValueError, match=r"^x=4 is invalid: allowed is an int from 1 to 3$"):
        v.integer(4, "x", minimum=1, maximum=3)
    with pytest.raises(ValueError, match=r"^x=4 is invalid: allowed is an int <= 3$"):
        v.integer(4, "x", maximum=3)
    with pytest.raises(TypeError, match=r"^x must be a positive int or None, got 1\.0 \(float\)$"):
        v.positive_int_or_none(1.0, "x")
    with pytest.raises(TypeError, match=r"^x must be an int, got None \(NoneType\)$"):
        v.integer(None, "x")


def test_numpy_ints_are_not_ints() -> None:
    # np.int64 is not an int subclass: the caller converts (int(x)), as for any other type.
    with pytest.raises(TypeError, match=r"\(int64\)"):
        v.positive_int(np.int64(3), "x")


def test_step() -> None:
    assert v.step(0) == 0
    assert v.step(MAX_STEP) == MAX_STEP
    for bad in (-1, MAX_STEP + 1):
        with pytest.raises(ValueError, match=rf"^step={bad} is invalid: .* 0 to {MAX_STEP}$"):
            v.step(bad)
    with pytest.raises(TypeError, match=r"^rank must be an int from 0 to"):
        v.step(1.0, "rank")


def test_numbers_and_seconds() -> None:
    assert v.number(-2, "x") == -2.0 and isinstance(v.number(-2, "x"), float)
    assert v.number(np.float64(0.5), "x") == 0.5  # a float subclass; np.float32 is not
    with pytest.raises(TypeError, match=r"\(float32\)"):
        v.number(np.float32(0.5), "x")
    assert v.seconds(2, "t") == 2.0
    assert v.seconds(0, "t", allow_zero=True) == 0.0
    assert v.seconds(None, "t", allow_none=True) is None
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"^t=.* is invalid: allowed is a positive, finite"):
            v.seconds(bad, "t")
    with pytest.raises(ValueError, match=r"^t=-0\.5 .* seconds >= 0 or None$"):
        v.seconds(-0.5, "t", allow_zero=True, allow_none=True)
    with pytest.raises(TypeError, match=r"^t must be a positive, finite number of seconds, got"):
        v.seconds(None, "t")
    with pytest.raises(ValueError, match=r"^x=nan is invalid: allowed is a finite number$"):
        v.number(math.nan, "x")


def test_fraction() -> None:
    assert v.fraction(0.05, "f") == 0.05
    for bad in (0, 1, 1.5, -0.1, math.nan):
        with pytest.raises(
            ValueError, match=r"^f=.* is invalid: allowed is a fraction in \(0, 1\)"
        ):
            v.fraction(bad, "f")


def test_boolean() -> None:
    assert v.boolean(True, "b") is True
    assert v.boolean(False, "b") is False
    for bad in (1, 0, None, "yes", np.bool_(True)):
        with pytest.raises(TypeError, match=r"^b must be a bool, got "):
            v.boolean(bad, "b")


def test_allowed_overrides_the_description() -> None:
    allowed = "None, a positive int or a retention policy"
    with pytest.raises(ValueError, match=rf"^keep=0 is invalid: allowed is {allowed}$"):
        v.positive_int(0, "keep", allowed=allowed)
    with pytest.raises(TypeError, match=rf"^keep must be {allowed}, got 'x' \(str\)$"):
        v.positive_int("x", "keep", allowed=allowed)


def test_long_values_are_shortened() -> None:
    with pytest.raises(TypeError) as exc:
        v.positive_int("x" * 500, "n")
    assert len(str(exc.value)) < 120 and "..." in str(exc.value)
