"""trimkit's exceptions: one tree, rooted at :class:`TrimkitError` (the tree, and which failure
raises what: docs/reference.md "Errors", docs/servers.md §6).

Catch ``TrimkitError`` to handle anything trimkit raises on purpose. Each error also subclasses
the builtin it naturally is (``ValueError``, ``FileNotFoundError``, ``TimeoutError``, ...), so code
that already catches those keeps working. Dependency errors (httpx, llama_cpp, openai) are
translated into these at the boundary. A :class:`BackendError` raised while a wrapped call's stream
is read carries ``.report`` (what was sent, with the TTFT if it was measured); elsewhere None.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = [
    "FleetUnavailableError",
    "FleetOverloadedError",
    "TrimkitError",
    "InvalidInputError",
    "InvalidMessageError",
    "InvalidChunkError",
    "InvalidBudgetError",
    "InvalidNumberError",
    "MissingExtraError",
    "require_extra",
    "ModelError",
    "ModelNotFoundError",
    "NotGGUFError",
    "ContextTooSmallError",
    "ProfileError",
    "CalibrationError",
    "InfeasibleBudgetError",
    "QueueBudgetError",
    "BackendError",
    "ServerError",
    "TransientServerError",
    "PromptTruncatedError",
    "ServerUnreachableError",
    "StreamInterruptedError",
    "EngineBusyError",
    "OverloadedError",
    "MalformedReplyError",
    "ServerTimeoutError",
]


class TrimkitError(Exception):
    """Base of every error trimkit raises on purpose."""


class InvalidInputError(TrimkitError, ValueError):
    """An argument is invalid. Raised before any request is sent; nothing was changed."""


class InvalidMessageError(InvalidInputError):
    """A chat message list is malformed (not a list, a message without role or content, ...)."""


class InvalidChunkError(InvalidInputError):
    """A RAG chunk is malformed (no text, wrong type, bad score)."""


class InvalidBudgetError(InvalidInputError):
    """A TTFT budget is zero, negative, NaN or infinite."""


class InvalidNumberError(InvalidInputError):
    """A time or count is non-positive, non-finite or of the wrong type."""


class MissingExtraError(TrimkitError, ImportError):
    """A feature needs an optional part of trimkit that is not installed; the message names the
    extra (``pip install 'trimkit[llama]'`` for in-process engines and the embedded model)."""


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
    """The file exists but is not a GGUF model (wrong magic bytes)."""


class ContextTooSmallError(TrimkitError, ValueError):
    """The context window (n_ctx) is too small for what was asked."""


class ProfileError(TrimkitError):
    """A stored calibration profile is unreadable or invalid."""


class CalibrationError(TrimkitError, RuntimeError):
    """Calibration could not produce a usable profile."""


class InfeasibleBudgetError(TrimkitError):
    """Even the minimal prompt (system + last user message) cannot meet the TTFT budget.

    Raised only with ``on_infeasible="raise"``. ``.plan`` holds the plan (with the best
    achievable TTFT); ``.report`` the report of what would have been sent.
    """

    def __init__(self, message: str, *, plan: Any = None, report: Any = None) -> None:
        super().__init__(message)
        self.plan = plan
        self.report = report


class QueueBudgetError(InfeasibleBudgetError):
    """The requests ahead of this one on the engine are predicted to take its whole budget: the
    predicted wait alone reaches the budget less the safety margin, so no prompt can meet it.

    Raised only with ``on_infeasible="raise"`` (and ``on_busy="trim"``), before anything is
    planned or sent (the request leaves the engine's queue). ``.wait_s`` is the predicted wait, ``.ahead`` how many requests are ahead,
    ``.report`` the report of the request as it would have been sent (``queue_wait_predicted_s``
    says the wait); ``.plan`` is None (nothing was planned). An :class:`InfeasibleBudgetError`:
    code that handles an unmeetable budget handles this one too."""

    def __init__(self, message: str, *, wait_s: float, ahead: int = 0, report: Any = None) -> None:
        super().__init__(message, plan=None, report=report)
        self.wait_s = wait_s
        self.ahead = ahead


class BackendError(TrimkitError, RuntimeError):
    """The model engine or server failed. ``.report`` is set (to the report of what was sent)
    when it was raised while a wrapped call's stream was being read; else None."""

    report: Any = None


class ServerError(BackendError):
    """The server answered with an error status. ``.status`` and ``.server_message`` say what."""

    def __init__(self, message: str, *, status: int | None = None, server_message: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.server_message = server_message


class TransientServerError(ServerError):
    """A server error worth retrying (429, 502, 503, 504). Raised once retries are exhausted."""


class PromptTruncatedError(ServerError):
    """The server answered (HTTP 200) but evaluated fewer prompt tokens than trimkit sent: it
    cut the prompt to fit its context window (Ollama drops the front of an over-long prompt).
    Raised once the answer is complete, when the wrapper was built with
    ``on_truncation="raise"``; ``.truncated_tokens`` says how many were missing and
    ``.report`` is the request's report (the answer is in it only as the stream read it)."""

    def __init__(self, message: str, *, truncated_tokens: int, report: Any = None) -> None:
        super().__init__(message, status=200)
        self.truncated_tokens = truncated_tokens
        self.report = report


class ServerUnreachableError(BackendError, ConnectionError):
    """The server could not be reached (refused, unresolvable, timed out) after retries."""


class StreamInterruptedError(BackendError):
    """The response stream broke before it finished. ``.report`` keeps what was sent."""

    def __init__(self, message: str, *, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class EngineBusyError(BackendError, TimeoutError):
    """The in-process engine (one ``Llama``) stayed busy — another request, or a stream nobody
    has finished or closed — for longer than this request may wait: its TTFT budget, else
    ``LlamaBackend.engine_wait_s``. Nothing was sent. ``.waited_s`` says how long it waited."""

    def __init__(self, message: str, *, waited_s: float = 0.0) -> None:
        super().__init__(message)
        self.waited_s = waited_s


class OverloadedError(BackendError, TimeoutError):
    """Where the request could go is alive but too busy to start it within its deadline (a
    fleet whose replicas are all working through their queues). Not a failure of any server:
    nothing was taken out of rotation and nothing was answered. Retry after
    ``.retry_after_s`` seconds, or shed the load."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MalformedReplyError(ServerError):
    """The server's reply is not what the protocol allows, so trimkit cannot use it: a body that
    is not JSON (or not the JSON it should be), a field of the wrong type (``choices: 5``), a
    number out of range (a 400-digit token count, a NaN time), JSON nested deeper than
    :data:`trimkit.backends.replies.MAX_JSON_DEPTH`, a reply over the size cap, or the wrong
    content type. ``.field`` names where (``choices[0].delta``, ``usage.prompt_tokens``; ``""``
    for the body as a whole); ``.server_message`` holds the start of what was received.
    Never retried: the same server gives the same reply."""

    def __init__(self, message: str, *, field: str = "", status: int | None = 200, server_message: str = "") -> None:
        super().__init__(message, status=status, server_message=server_message)
        self.field = field


class ServerTimeoutError(ServerUnreachableError, TimeoutError):
    """The server did not produce the first chunk (a side request: its answer) within the
    request's deadline: a server that accepts and never answers, answers too slowly, or
    trickles bytes that never make an event. Raised within about the deadline, whatever the
    server does; also a builtin ``TimeoutError``."""


class FleetUnavailableError(ServerUnreachableError):
    """No endpoint of the fleet could take the request: all are out of rotation, or each one
    tried failed before the first token. ``.attempts`` lists ``(endpoint, what went wrong)``
    for every endpoint tried or found down. Nothing was answered."""

    def __init__(self, message: str, *, attempts: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.attempts = tuple(attempts)


class FleetOverloadedError(OverloadedError):
    """Every endpoint of the fleet that could take the request is alive but too busy to start it
    within the call's deadline (each timed out with this client's own requests ahead of it, or
    while it was answering others, or said 429). No endpoint was taken out of rotation. Nothing
    was answered: retry after ``.retry_after_s`` (the predicted wait for the least busy
    endpoint), or shed the load. ``.attempts`` lists ``(endpoint, what went wrong)``."""

    def __init__(self, message: str, *, retry_after_s: float, attempts: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.attempts = tuple(attempts)


# -- Small validators shared by the value classes (attrs ``validator=`` hooks and plain calls). ----------

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
