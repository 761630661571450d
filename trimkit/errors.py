"""trimkit's exceptions, rooted at :class:`TrimkitError` (docs/reference.md "Errors").

Each error also subclasses the builtin it naturally is (``ValueError``, ``TimeoutError``, ...);
dependency errors (httpx, llama_cpp, openai) are translated into these at the boundary.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = [
    "FleetUnavailableError", "FleetOverloadedError", "TrimkitError", "InvalidInputError", "InvalidMessageError", "InvalidChunkError",
    "InvalidBudgetError", "InvalidNumberError", "MissingExtraError", "require_extra", "ModelError", "ModelNotFoundError", "NotGGUFError",
    "ContextTooSmallError", "ProfileError", "CalibrationError", "InfeasibleBudgetError", "QueueBudgetError", "BackendError", "ServerError",
    "TransientServerError", "PromptTruncatedError", "ServerUnreachableError", "StreamInterruptedError", "EngineBusyError",
    "OverloadedError", "MalformedReplyError", "ServerTimeoutError",
]


class TrimkitError(Exception):
    """Base of every error trimkit raises on purpose; keyword arguments set the fields a class declares."""

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message)
        for name, value in fields.items():
            if not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            setattr(self, name, value)


class InvalidInputError(TrimkitError, ValueError):
    """An argument is invalid; raised before any request is sent."""


class InvalidMessageError(InvalidInputError):
    """A chat message list is malformed."""


class InvalidChunkError(InvalidInputError):
    """A RAG chunk is malformed (no text, wrong type, bad score)."""


class InvalidBudgetError(InvalidInputError):
    """A TTFT budget is zero, negative, NaN or infinite."""


class InvalidNumberError(InvalidInputError):
    """A time or count is non-positive, non-finite or of the wrong type."""


class MissingExtraError(TrimkitError, ImportError):
    """A feature needs an optional part of trimkit that is not installed; the message names the extra."""


#: what each extra brings, for the message of a missing one
EXTRA_PACKAGES = {"llama": "llama-cpp-python", "plot": "matplotlib", "otel": "opentelemetry-api", "prometheus": "prometheus-client"}


def require_extra(module: str, extra: str, needed_by: str) -> Any:
    """Import ``module`` for ``needed_by``, or raise :class:`MissingExtraError` naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        what = EXTRA_PACKAGES.get(extra, extra)
        raise MissingExtraError(f"{needed_by} needs {what}, which is not installed ({exc}): pip install 'trimkit[{extra}]'") from exc


class ModelError(TrimkitError, ValueError):
    """The model file cannot be used."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The model path does not exist."""


class NotGGUFError(ModelError):
    """The file exists but is not a GGUF model."""


class ContextTooSmallError(TrimkitError, ValueError):
    """The context window (n_ctx) is too small for what was asked."""


class ProfileError(TrimkitError):
    """A stored calibration profile is unreadable or invalid."""


class CalibrationError(TrimkitError, RuntimeError):
    """Calibration could not produce a usable profile."""


class InfeasibleBudgetError(TrimkitError):
    """Even the minimal prompt cannot meet the TTFT budget (``on_infeasible="raise"``)."""

    plan: Any = None
    report: Any = None


class QueueBudgetError(InfeasibleBudgetError):
    """The predicted wait for the ``ahead`` requests before this one takes the whole budget; nothing was planned."""

    wait_s: float = 0.0
    ahead: int = 0


class BackendError(TrimkitError, RuntimeError):
    """The engine or server failed; ``.report`` is set when raised while a wrapped stream was read."""

    report: Any = None


class ServerError(BackendError):
    """The server answered with an error."""

    status: int | None = None
    server_message: str = ""


class TransientServerError(ServerError):
    """A server error worth retrying (429, 502, 503, 504), raised once retries are exhausted."""


class PromptTruncatedError(ServerError):
    """The server evaluated fewer prompt tokens than sent (``on_truncation="raise"``)."""

    status: int | None = 200
    truncated_tokens: int = 0


class ServerUnreachableError(BackendError, ConnectionError):
    """The server could not be reached after retries."""


class StreamInterruptedError(BackendError):
    """The response stream broke before it finished; ``.report`` keeps what was sent."""


class EngineBusyError(BackendError, TimeoutError):
    """The in-process engine stayed busy longer than this request may wait; nothing was sent."""

    waited_s: float = 0.0


class OverloadedError(BackendError, TimeoutError):
    """Alive but too busy to start the request within its deadline; retry after ``.retry_after_s``."""

    retry_after_s: float = 0.0


class MalformedReplyError(ServerError):
    """The server's reply breaks the protocol (``.field`` says where); never retried."""

    status: int | None = 200
    field: str = ""


class ServerTimeoutError(ServerUnreachableError, TimeoutError):
    """The server did not produce the first chunk within the request's deadline."""


class FleetUnavailableError(ServerUnreachableError):
    """No endpoint of the fleet could take the request; ``.attempts`` lists ``(endpoint, what went wrong)``."""

    attempts: Sequence[tuple[str, str]] = ()


class FleetOverloadedError(OverloadedError):
    """Every endpoint that could take the request is too busy; ``.attempts`` as for :class:`FleetUnavailableError`."""

    attempts: Sequence[tuple[str, str]] = ()


# -- validators shared by the value classes ---------------------------------------------------------------

def _short(value: Any) -> str:
    """``repr(value)`` for an error message, cut short."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str limit
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


def finite(value: Any, name: str, *, above: float | None = None, at_least: float | None = None, below: float | None = None,
           error: type[Exception] = InvalidNumberError) -> float:
    """``value`` as a finite float within the bounds given, else ``error`` (bools refused; ``10**400`` is not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} must be a number, got {type(value).__name__} {_short(value)}")
    try:
        v = float(value)
    except OverflowError:
        raise error(f"{name} must be finite, got an int too large for a float ({_short(value)})") from None
    if not math.isfinite(v):
        raise error(f"{name} must be finite, got {_short(value)}")
    for out, bound in ((above is not None and v <= above, f"> {above}"), (at_least is not None and v < at_least, f">= {at_least}"),
                       (below is not None and v >= below, f"below {below}")):
        if out:
            raise error(f"{name} must be {bound}, got {_short(value)}")
    return v


#: the bounds trimkit's numbers keep: ``name(value, label)`` as a float, else InvalidNumberError (``budget``: InvalidBudgetError)
positive_finite = functools.partial(finite, above=0)
non_negative_finite = functools.partial(finite, at_least=0)
fraction = functools.partial(finite, at_least=0, below=1)  # a safety margin
open_share = functools.partial(finite, above=0, below=1)  # an attainment target


def real_float(value: Any) -> float:
    """attrs converter: a real number as a float; bools, strings and None raise :class:`InvalidNumberError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidNumberError(f"expected a number, got {type(value).__name__} {_short(value)}")
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):  # 10**400; a Real whose __float__ fails
        raise InvalidNumberError(f"expected a number a float can hold, got {_short(value)}") from None


def count(value: Any, name: str, *, minimum: int = 0) -> int:
    """``value`` if it is an int >= ``minimum`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNumberError(f"{name} must be an integer, got {type(value).__name__} {_short(value)}")
    if value < minimum:
        raise InvalidNumberError(f"{name} must be >= {minimum}, got {_short(value)}")
    return value


def budget(value: Any, name: str = "ttft_budget_s") -> float:
    """A TTFT budget: finite and > 0, else :class:`InvalidBudgetError`."""
    return finite(value, name, above=0, error=InvalidBudgetError)


def attrs_non_negative(instance: Any, attribute: Any, value: Any) -> None:
    non_negative_finite(value, attribute.name)
