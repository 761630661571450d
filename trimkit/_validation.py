"""Small validators shared by the value classes (attrs ``validator=`` hooks and plain calls)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from trimkit.errors import InvalidBudgetError, InvalidInputError, InvalidNumberError


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """``repr(value)`` for an error message, cut short (an int of 400 digits is not a message)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str limit
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


def _as_float(value: Any, name: str, error: type[Exception]) -> float:
    """``float(value)`` for a real number, ``error`` instead of OverflowError for an int too
    large for a float (``10**400``: ``math.isnan`` and ``float`` both overflow on it)."""
    try:
        return float(value)
    except OverflowError:
        raise error(f"{name} must be finite, got an int too large for a float ({_short(value)})") from None


def positive_finite(value: Any, name: str, *, error: type[Exception] = InvalidNumberError) -> float:
    """Return ``value`` as a float if it is a finite number > 0, else raise ``error``."""
    if not _is_real(value):
        raise error(f"{name} must be a number, got {type(value).__name__} {_short(value)}")
    v = _as_float(value, name, error)
    if math.isnan(v) or math.isinf(v):
        raise error(f"{name} must be finite, got {_short(value)}")
    if v <= 0:
        raise error(f"{name} must be > 0, got {_short(value)}")
    return v


def real_float(value: Any) -> float:
    """attrs converter: a real number (int, float, numpy scalar) as a float; bools, strings and
    None are refused with :class:`InvalidNumberError` instead of being coerced (``float(True)``
    is 1.0, ``float("x")`` a bare ValueError). Range checks are left to the validator."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidNumberError(f"expected a number, got {type(value).__name__} {_short(value)}")
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):  # 10**400; a Real whose __float__ fails
        raise InvalidNumberError(f"expected a number a float can hold, got {_short(value)}") from None


def non_negative_finite(value: Any, name: str) -> float:
    if not _is_real(value):
        raise InvalidNumberError(f"{name} must be a number, got {type(value).__name__} {_short(value)}")
    v = _as_float(value, name, InvalidNumberError)
    if math.isnan(v) or math.isinf(v) or v < 0:
        raise InvalidNumberError(f"{name} must be a finite number >= 0, got {_short(value)}")
    return v


def count(value: Any, name: str, *, minimum: int = 0) -> int:
    """Return ``value`` if it is an int >= ``minimum`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNumberError(f"{name} must be an integer, got {type(value).__name__} {_short(value)}")
    if value < minimum:
        raise InvalidNumberError(f"{name} must be >= {minimum}, got {_short(value)}")
    return value


def budget(value: Any, name: str = "ttft_budget_s") -> float:
    """Validate a TTFT budget in seconds: a finite number > 0."""
    return positive_finite(value, name, error=InvalidBudgetError)


def attrs_non_negative(instance: Any, attribute: Any, value: Any) -> None:
    non_negative_finite(value, attribute.name)


def fraction(value: Any, name: str) -> float:
    """Validate a share in ``[0, 1)`` (a safety margin: the part of a budget held back)."""
    v = non_negative_finite(value, name)
    if v >= 1.0:
        raise InvalidNumberError(f"{name} must be below 1, got {_short(value)}")
    return v


def open_share(value: Any, name: str) -> float:
    """Validate a share strictly between 0 and 1 (an attainment target); a typed
    :class:`~trimkit.errors.InvalidInputError` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise InvalidInputError(f"{name} must be a number strictly between 0 and 1, got {_short(value)}")
    return float(value)
