"""Small validators shared by the value classes (attrs ``validator=`` hooks and plain calls)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from trimkit.errors import InvalidBudgetError, InvalidNumberError


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_finite(value: Any, name: str, *, error: type[Exception] = InvalidNumberError) -> float:
    """Return ``value`` as a float if it is a finite number > 0, else raise ``error``."""
    if not _is_real(value):
        raise error(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise error(f"{name} must be finite, got {value!r}")
    if value <= 0:
        raise error(f"{name} must be > 0, got {value!r}")
    return float(value)


def real_float(value: Any) -> float:
    """attrs converter: a real number (int, float, numpy scalar) as a float; bools, strings and
    None are refused with :class:`InvalidNumberError` instead of being coerced (``float(True)``
    is 1.0, ``float("x")`` a bare ValueError). Range checks are left to the validator."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidNumberError(f"expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def non_negative_finite(value: Any, name: str) -> float:
    if not _is_real(value):
        raise InvalidNumberError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise InvalidNumberError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def count(value: Any, name: str, *, minimum: int = 0) -> int:
    """Return ``value`` if it is an int >= ``minimum`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNumberError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidNumberError(f"{name} must be >= {minimum}, got {value!r}")
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
        raise InvalidNumberError(f"{name} must be below 1, got {value!r}")
    return v
