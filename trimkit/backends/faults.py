"""What goes wrong on the wire, as trimkit errors: error statuses, unreachable or silent servers,
bodies that do not decode, the ``openai`` client's own exceptions. Pure functions, no I/O: the
transport raises what they return.

Which errors are retried is decided here too (:data:`RETRIED`): transient statuses
(:data:`TRANSIENT_STATUSES`) and unreachable servers, before the first chunk only.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import httpx

from trimkit.backends.fields import excerpt, load_json
from trimkit.backends.replies import body_kind, error_message, parse_completion, retry_after_s
from trimkit.errors import (
    MalformedReplyError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    TransientServerError,
    TrimkitError,
)

__all__ = [
    "TRANSIENT_STATUSES",
    "RETRIED",
    "status_error",
    "unreachable",
    "undecodable",
    "transport_error",
    "client_error",
    "client_read_error",
    "client_open_error",
    "is_transport_failure",
    "translated",
    "wrong_content_type",
    "redirect_error",
    "stream_reply_error",
    "empty_stream_error",
]

#: HTTP statuses worth retrying (before the first chunk only).
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
#: the errors a request is retried on, inside its deadline
RETRIED = (TransientServerError, ServerUnreachableError)

#: what the ``openai`` client raises while decoding a reply it cannot make sense of (JSON errors,
#: and its model constructors meeting the wrong types)
_CLIENT_DECODE_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError)


def _openai() -> ModuleType | None:
    """The ``openai`` package (an optional dependency), or None when it is not installed."""
    try:
        import openai
    except ImportError:  # pragma: no cover - a client without openai installed
        return None
    return openai


def status_error(status: int, body: Any, headers: Any = None) -> ServerError:
    """An error status as ServerError (TransientServerError for a retried status), with the
    server's message and its ``Retry-After`` as ``retry_after_s``."""
    message = error_message(body)
    cls = TransientServerError if status in TRANSIENT_STATUSES else ServerError
    err = cls(f"the server answered HTTP {status}: {message}", status=status, server_message=message)
    err.retry_after_s = retry_after_s(headers.get("retry-after") if headers is not None else None)  # type: ignore[attr-defined]
    return err


def unreachable(exc: BaseException, url: str) -> ServerUnreachableError:
    if isinstance(exc, httpx.TimeoutException):
        return ServerTimeoutError(f"{url} timed out: {type(exc).__name__}: {exc}")
    return ServerUnreachableError(f"{url} could not be reached: {type(exc).__name__}: {exc}")


def undecodable(exc: BaseException, what: str) -> MalformedReplyError:
    text = f"{type(exc).__name__}: {exc}"
    return MalformedReplyError(f"{what} could not be decoded: {text[:300]}", server_message=text[:500])


def transport_error(exc: BaseException, url: str, what: str = "the stream") -> TrimkitError | None:
    """An ``httpx`` exception of a request trimkit sent itself: unreachable, or a body its
    ``Content-Encoding`` does not decode (None: not one of those)."""
    if isinstance(exc, httpx.TransportError):
        return unreachable(exc, url)
    if isinstance(exc, httpx.DecodingError):
        return undecodable(exc, f"{what} from {url}")
    return None


def client_error(exc: BaseException, url: str) -> TrimkitError | None:
    """An ``openai`` client exception raised by ``create()`` as a trimkit error (``None`` if it
    is not one: a TypeError for an argument the client does not take is the caller's)."""
    if isinstance(exc, TrimkitError):
        return None
    if isinstance(exc, httpx.TransportError):
        return unreachable(exc, url)
    if isinstance(exc, (json.JSONDecodeError, RecursionError)):
        return undecodable(exc, f"the reply from {url}")
    openai = _openai()
    if openai is None:
        return None
    if isinstance(exc, openai.APIStatusError):
        response = getattr(exc, "response", None)
        body = exc.body if exc.body is not None else exc.message
        return status_error(exc.status_code, body, getattr(response, "headers", None))
    if isinstance(exc, openai.APITimeoutError):
        return ServerTimeoutError(f"{url} timed out: {exc}")
    if isinstance(exc, openai.APIConnectionError):
        if type(exc.__cause__).__name__ == "DecodingError":  # a body its Content-Encoding does not decode
            return undecodable(exc.__cause__, f"the reply from {url}")
        return unreachable(exc, url)
    if isinstance(exc, openai.APIResponseValidationError):
        return undecodable(exc, f"the reply from {url}")
    if isinstance(exc, openai.APIError):  # an error event inside the stream
        message = error_message(exc.body) if exc.body is not None else str(exc.message)
        return ServerError(f"the server reported an error mid-stream: {message}", status=200, server_message=message)
    return None


def client_read_error(exc: BaseException, url: str) -> TrimkitError | None:
    """An exception from iterating the ``openai`` client's stream as a trimkit error: an error
    event, or a reply it could not decode. Transport failures are left to the stream's error
    handler (StreamInterruptedError after the first chunk)."""
    if isinstance(exc, (TrimkitError, httpx.TransportError)):
        return None
    openai = _openai()
    if openai is not None and isinstance(exc, openai.APIError):
        if isinstance(exc, (openai.APIConnectionError, openai.APIStatusError)):
            return None
        return client_error(exc, url)
    if isinstance(exc, _CLIENT_DECODE_ERRORS):
        return undecodable(exc, f"the stream from {url}")
    return None


def client_open_error(exc: BaseException, url: str) -> TrimkitError | None:
    """An exception while the ``openai`` client's stream is opened (up to its first chunk)."""
    return client_read_error(exc, url) or client_error(exc, url)


def is_transport_failure(exc: BaseException) -> bool:
    """A broken connection (httpx's, the OS's or the ``openai`` client's)."""
    if isinstance(exc, (httpx.TransportError, OSError)):
        return True
    openai = _openai()
    return openai is not None and isinstance(exc, openai.APIError)


@contextlib.contextmanager
def translated(translate: Callable[[BaseException], TrimkitError | None]) -> Iterator[None]:
    """Raise an exception of the block as the trimkit error ``translate`` gives (as it is: None)."""
    try:
        yield
    except Exception as exc:
        error = translate(exc)
        if error is None:
            raise
        raise error from exc


def redirect_error(status: int, headers: Any, url: str) -> ServerError:
    """A 3xx answer (trimkit does not follow redirects unless the ``http_client`` given does):
    where the server sends the request, so the caller can point trimkit there."""
    from trimkit.backends.transport import redact_url  # (transport imports this module)

    location = headers.get("location") if headers is not None else None
    where = f" to {redact_url(location)}" if location else ""
    message = (f"{url} redirected the request (HTTP {status}){where}: trimkit does not follow redirects; use that URL, or pass "
               "http_client=httpx.Client(follow_redirects=True)")
    return ServerError(message, status=status, server_message=f"redirect{where}")


def wrong_content_type(content_type: str | None, head: bytes, url: str) -> MalformedReplyError:
    return MalformedReplyError(f"{url} answered a stream request with content type {content_type or 'none'!r}, "
                               f"not text/event-stream: {excerpt(head, 200)!r}", field="content-type", server_message=excerpt(head))


def stream_reply_error(content_type: str | None, head: bytes, url: str) -> ServerError:
    """The error for a stream request the ``openai`` client got something other than an event
    stream for: the server's error if the body is one, else MalformedReplyError."""
    if body_kind(content_type) == "json":
        parse_completion(load_json(head, what=f"reply from {url}"))  # raises ServerError for {"error": ...}
        return MalformedReplyError(f"{url} answered a stream request with one JSON body, which this client cannot stream",
                                   field="content-type", server_message=excerpt(head))
    return wrong_content_type(content_type, head, url)


def empty_stream_error() -> ServerError:
    message = "the server closed the stream without sending a chunk (llama-cpp-python does this when the prompt exceeds its context window)"
    return ServerError(message, status=200, server_message="empty stream")
