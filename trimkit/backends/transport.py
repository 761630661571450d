"""The HTTP wire of the HTTP backend (docs/servers.md §6): wire failures as trimkit errors; server-sent
events (:class:`EventReader` decides, :func:`iter_events` moves bytes); opening a request over ``httpx``
or the user's ``openai`` client (:class:`HTTPTransport`, bodies capped); reading an open stream
(:class:`StreamState`, :func:`read_chunks`); deadlines and retries (:class:`RequestLimits`, :meth:`HTTPTransport.retried`).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import json
import logging
import operator
import re
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

import attrs
import httpx
import tenacity

from trimkit.backends.base import Clock, Io, Measurement, Steps, TimedStream, run_async, run_sync
from trimkit.backends.replies import (
    MAX_EVENT_BYTES,
    MAX_REPLY_BYTES,
    Reply,
    body_kind,
    error_message,
    excerpt,
    load_json,
    parse_chunk,
    parse_completion,
    retry_after_s,
)
from trimkit.errors import (
    InvalidInputError,
    MalformedReplyError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    StreamInterruptedError,
    TransientServerError,
    TrimkitError,
    count,
)

log = logging.getLogger("trimkit")

# == errors: what goes wrong on the wire =====================================================================

#: HTTP statuses worth retrying (before the first chunk only).
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})

#: what the ``openai`` client raises while decoding a reply it cannot make sense of
_CLIENT_DECODE_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError)


def _openai() -> ModuleType | None:
    try:
        import openai
    except ImportError:  # pragma: no cover - a client without openai installed
        return None
    return openai


def status_error(status: int, body: Any, headers: Any = None) -> ServerError:
    """An error status as ServerError (TransientServerError when retried), ``Retry-After`` as ``retry_after_s``."""
    message = error_message(body)
    cls = TransientServerError if status in TRANSIENT_STATUSES else ServerError
    err = cls(f"the server answered HTTP {status}: {message}", status=status, server_message=message)
    err.retry_after_s = retry_after_s(headers.get("retry-after") if headers is not None else None)  # type: ignore[attr-defined]
    return err


def undecodable(exc: BaseException, what: str) -> MalformedReplyError:
    text = f"{type(exc).__name__}: {exc}"
    return MalformedReplyError(f"{what} could not be decoded: {text[:300]}", server_message=text[:500])


def transport_error(exc: BaseException | None, url: str, what: str = "the stream") -> TrimkitError | None:
    """An ``httpx`` exception: unreachable (timed out), or a body its ``Content-Encoding`` does not decode (None: neither)."""
    if isinstance(exc, httpx.TransportError):
        cls = ServerTimeoutError if isinstance(exc, httpx.TimeoutException) else ServerUnreachableError
        return cls(f"{url} {'timed out' if cls is ServerTimeoutError else 'could not be reached'}: {type(exc).__name__}: {exc}")
    if isinstance(exc, httpx.DecodingError):
        return undecodable(exc, f"{what} from {url}")
    return None


def client_error(exc: BaseException, url: str, *, streaming: bool = False) -> TrimkitError | None:
    """An ``openai`` client's exception (``streaming``: also one from reading its stream, which may be
    undecodable) as a trimkit error; None: the caller's own, e.g. a bad argument."""
    if isinstance(exc, TrimkitError):
        return None
    if streaming and isinstance(exc, _CLIENT_DECODE_ERRORS) or isinstance(exc, (json.JSONDecodeError, RecursionError)):
        return undecodable(exc, f"the {'stream' if streaming else 'reply'} from {url}")
    openai = _openai()
    if openai is None or not isinstance(exc, openai.APIError):
        return transport_error(exc, url, "the reply")
    if isinstance(exc, openai.APIStatusError):
        body = exc.body if exc.body is not None else exc.message
        return status_error(exc.status_code, body, getattr(getattr(exc, "response", None), "headers", None))
    if isinstance(exc, openai.APIConnectionError):  # its cause: a timeout, a connection refused, a body that does not decode
        cls = ServerTimeoutError if isinstance(exc, openai.APITimeoutError) else ServerUnreachableError
        return transport_error(exc.__cause__, url, "the reply") or cls(f"{url} failed: {type(exc).__name__}: {exc}")
    if isinstance(exc, openai.APIResponseValidationError):
        return undecodable(exc, f"the reply from {url}")
    message = error_message(exc.body) if exc.body is not None else str(exc.message)  # an error event inside the stream
    return ServerError(f"the server reported an error mid-stream: {message}", status=200, server_message=message)


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


# == server-sent events ======================================================================================

#: what a stream or body that ended gives as its next event or piece
END = object()
_LINE = re.compile(rb"([^\r\n]*)(\r\n|\r|\n)")  # a line and its end (a \r last in the bytes may be half a \r\n)


class EventReader:
    """One event stream, parsed without I/O (SSE: ``data:`` lines joined, ``event:``, comments):
    :meth:`feed` the bytes, :meth:`end` at the end; each gives the JSON values of the events it completed.
    ``[DONE]`` ends the stream; an ``error`` event raises ServerError; an event over ``max_event_bytes``
    raises MalformedReplyError (nothing past the cap buffered); a stream cut inside an event raises StreamInterruptedError."""

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self.max_event_bytes = MAX_EVENT_BYTES if max_event_bytes is None else max_event_bytes
        self.done = False  #: the server sent ``data: [DONE]``
        self._buf = bytearray()  # a line not ended yet
        self._size = 0  # bytes of the event being read, in the lines ended so far
        self._name = ""
        self._data: list[str] = []
        self.ended = False  #: the bytes ended (:meth:`end`)

    def feed(self, data: bytes) -> Iterator[Any]:
        """The values of the events ``data`` completes."""
        self._buf += data
        if b"\r" in data or b"\n" in data:
            used = 0
            for line in _LINE.finditer(self._buf):
                if line.end() == len(self._buf) and line[2] == b"\r":  # the first half of a \r\n, maybe
                    break
                used, self._size = line.end(), self._size + len(line[0])
                self._check(line[1], 0)
                yield from self._line(line[1])
            del self._buf[:used]
        self._check(self._buf, len(self._buf))

    def end(self) -> Iterator[Any]:
        """The value of a last event sent without its blank line."""
        self.ended = True
        return self.feed(b"\n\n")

    def _check(self, sample: bytes | bytearray, pending: int) -> None:
        if self._size + pending > self.max_event_bytes and not self.ended and not self.done:
            raise MalformedReplyError(f"the server sent a stream event longer than {self.max_event_bytes} bytes",
                                      server_message=excerpt(bytes(sample[:500])))

    def _line(self, line: bytes | bytearray) -> Iterator[Any]:
        if line:
            field, _, value = line.decode("utf-8", "replace").partition(":")
            if field == "data":
                self._data.append(value.removeprefix(" "))
            elif field == "event":
                self._name = value.removeprefix(" ")
            return
        name, data, self._size = self._name, "\n".join(self._data), 0
        self._name, self._data = "", []
        if not data or self.done:
            return
        if data.strip() == "[DONE]":
            self.done = True
            return
        if self.ended:  # the stream closed in the middle of this event: cut short, not garbled
            try:
                json.loads(data)
            except json.JSONDecodeError:
                raise StreamInterruptedError(f"the stream ended in the middle of an event: {data[:200]!r}") from None
            except (ValueError, RecursionError):
                pass  # load_json says what is wrong with it
        value = load_json(data, what="stream event")
        if name == "error" or (isinstance(value, Mapping) and value.get("error") is not None and value.get("choices") is None):
            message = error_message(value)
            raise ServerError(f"the server reported an error mid-stream: {message}", status=200, server_message=message)
        yield value


def event_steps(data: Any, reader: EventReader) -> Callable[[], Steps]:
    """The next event of a stream's bytes ``data`` (an iterator, or an async one), as I/O steps: its JSON value, or END
    after ``[DONE]`` or the end. One reader for sync and async streams."""
    pending: Iterator[Any] = iter(())

    def next_event() -> Steps:
        nonlocal pending
        while True:
            for value in pending:  # (the events one read completed: the rest are taken on the next call)
                return value
            if reader.done or reader.ended:
                return END
            got = yield Io(next, anext, data, END)
            pending = reader.end() if got is END else reader.feed(got)

    return next_event


def iter_events(byte_chunks: Iterable[bytes], reader: EventReader | None = None) -> Iterator[Any]:
    """The JSON events of an event stream's bytes, in order, until ``[DONE]`` or the end."""
    next_event = event_steps(iter(byte_chunks), reader or EventReader())
    while (value := run_sync(next_event())) is not END:
        yield value


# == sending a request and opening its answer ================================================================

#: what is read of an error status's body (for its message)
ERROR_BODY_BYTES = 64 * 1024
MISSING_STATUSES = (404, 405, 501)


@attrs.define
class Opened:
    """A stream opened up to its first event."""

    first: Any  # the first event, or END
    next_event: Callable[[], Steps]  # the next event after it, as I/O steps (END: no more)
    close: Callable[[], Any]  # (a coroutine function for an async stream)
    done: Callable[[], bool]  # did the server end the stream properly ([DONE])?
    whole: bool = False  # the server ignored stream=true: ``first`` is a whole completion
    client: bool = False  # read through the ``openai`` client: its errors are translated (client_error)


def _discard(future: concurrent.futures.Future[Any]) -> None:
    """Close what an abandoned attempt opened (a stream); other results need nothing."""
    if future.exception() is None and isinstance(future.result(), Opened):
        with contextlib.suppress(Exception):
            future.result().close()


def body_cap(status: int, kind: str | None, url: str) -> tuple[int, str, bool]:
    """How a response that is no event stream is read, ``(cap, what, truncate)``: a whole JSON answer
    (more than the cap: MalformedReplyError), else the start of what the server sent."""
    if status < 300 and kind is not None:
        return MAX_REPLY_BYTES, f"reply from {url}", False
    return ERROR_BODY_BYTES if status >= 300 else 2048, "error body", True


def answer(status: int, headers: Any, body: bytes, url: str, kind: str | None = "json") -> Any:
    """A response that is no event stream: its JSON; an error status, a redirect, or a body of no known type (``kind`` None) raise."""
    if status >= 400:
        raise status_error(status, body, headers)
    if status >= 300:  # followed only by an ``http_client`` that does
        location = headers.get("location") if headers is not None else None
        where = f" to {redact_url(location)}" if location else ""
        raise ServerError(f"{url} redirected the request (HTTP {status}){where}: trimkit does not follow redirects; use that URL, or pass "
                          "http_client=httpx.Client(follow_redirects=True)", status=status, server_message=f"redirect{where}")
    if kind is None:
        raise MalformedReplyError(f"{url} answered a stream request with content type {headers.get('content-type') or 'none'!r}, "
                                  f"not text/event-stream: {excerpt(body, 200)!r}", field="content-type", server_message=excerpt(body))
    return load_json(body, what=f"reply from {url}", status=status)


def capped(chunks: Any, cap: int, what: str, truncate: bool = False) -> Steps:
    """A body read, as I/O steps, until ``cap`` bytes: past it MalformedReplyError (``truncate``: its
    first ``cap`` bytes). Nothing beyond the cap is read."""
    out = bytearray()
    while (data := (yield Io(next, anext, chunks, END))) is not END:
        out += data
        if len(out) > cap and not truncate:
            raise MalformedReplyError(f"the server sent a {what} over the {cap}-byte cap", server_message=excerpt(bytes(out[:500])))
        if len(out) > cap:
            break
    return bytes(out[:cap])


def read_capped(byte_chunks: Iterable[bytes], cap: int, what: str, truncate: bool = False) -> bytes:
    return run_sync(capped(iter(byte_chunks), cap, what, truncate))


_USERINFO = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://)[^/?#@\s]*@")


def redact_url(text: Any) -> str:
    """``text`` with the userinfo of every URL in it replaced by ``***@``: how trimkit names an endpoint anywhere."""
    return _USERINFO.sub(r"\1***@", str(text))


def normalize_base_url(base_url: Any) -> tuple[str, str]:
    """``(base_url, root)``: the OpenAI base (``.../v1``, no trailing slash) and the server root, both
    without userinfo (credentials go in a header: :func:`url_credentials`). InvalidInputError for a bad URL."""
    if not isinstance(base_url, (str, httpx.URL)):
        raise InvalidInputError(f"base_url must be a str, got {type(base_url).__name__}")
    try:
        url = httpx.URL(str(base_url).strip())
    except Exception as exc:
        raise InvalidInputError(f"invalid base_url {redact_url(base_url)!r}: {redact_url(exc)}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InvalidInputError(f"base_url must be an http(s) URL with a host, e.g. http://127.0.0.1:8080/v1; got {redact_url(base_url)!r}")
    base = str(url.copy_with(query=None, fragment=None, username=None, password=None)).rstrip("/")
    return base, base.removesuffix("/v1")


def url_credentials(base_url: Any) -> str | None:
    """The HTTP Basic ``Authorization`` value for the userinfo of ``base_url`` (None without one)."""
    try:
        url = httpx.URL(str(base_url).strip())
    except Exception:
        return None
    if not url.username and not url.password:
        return None
    return "Basic " + base64.b64encode(f"{url.username}:{url.password}".encode()).decode("ascii")


def without_retries(client: Any) -> Any:
    """The caller's ``openai`` client with ``max_retries=0`` (connections shared), so its retries do not
    nest inside trimkit's and run past the deadline; a client without ``with_options`` as it is."""
    with_options = getattr(client, "with_options", None)
    if not getattr(client, "max_retries", 0) or not callable(with_options):
        return client
    try:
        return with_options(max_retries=0)
    except Exception:  # a client-like object with its own idea of with_options
        return client


class HTTPTransport:
    """The requests of one backend: its URLs, headers, pooled ``httpx`` client and limits."""

    def __init__(self, base_url: str, root_url: str, headers: Mapping[str, str], limits: RequestLimits,
                 http: httpx.Client | None = None, async_http: httpx.AsyncClient | None = None) -> None:
        self.base_url, self.root_url = base_url, root_url
        self.headers = dict(headers)
        self.limits = limits
        self.own_http = http is None
        self.http = http or httpx.Client(headers=self.headers, timeout=limits.httpx_timeout())
        self.async_http = async_http
        # one pooled AsyncClient per event loop (an AsyncClient is bound to its loop): a stream
        # neither builds a client (an SSL context, ~10 ms on the loop) nor a connection of its own
        self._loop_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()
        self._loop_lock = threading.Lock()

    def close(self) -> None:
        """Close the sync client trimkit made (async ones: :meth:`aclose` on their loop)."""
        if self.own_http:
            self.http.close()

    async def aclose(self) -> None:
        self.close()
        with self._loop_lock:
            client = self._loop_clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def request_json(self, method: str, url: str, body: Any = None, *, missing_ok: bool = False, deadline: Deadline | None = None) -> Any:
        """A side request, retried like a chat request (a pooled connection the server dropped fails once)."""
        def attempt(wait: Wait) -> Steps:
            return (yield Io(self.request_json_once, self.request_json_once, method, url, body, wait=wait, missing_ok=missing_ok))

        return run_sync(self.retried(attempt, deadline or self.limits.deadline(), url))

    def request_json_once(self, method: str, url: str, body: Any = None, *, wait: Wait | None = None, missing_ok: bool = False,
                          headers: Mapping[str, str] | None = None) -> Any:
        """One request: its JSON body (capped); with ``missing_ok`` None for 404/405/501 or a body that is not JSON."""
        with translated(lambda exc: transport_error(exc, url, "the reply")):
            with self.http.stream(method, url, json=body, headers={**self.headers, **(headers or {})},
                                  timeout=self.limits.httpx_timeout(wait)) as resp:
                status, got = resp.status_code, resp.headers
                if missing_ok and status in MISSING_STATUSES:
                    return None
                content = read_capped(resp.iter_bytes(), *body_cap(status, "json", url))
        try:
            return answer(status, got, content, url)
        except ServerError as exc:  # missing_ok: a body that is not JSON, or 400/422 from an endpoint of the server root (another engine's)
            root_only = url.startswith(self.root_url) and not url.startswith(self.base_url)
            if missing_ok and (status < 300 or exc.status in (400, 422) and root_only):
                return None
            raise

    def retried(self, attempt: Callable[[Wait], Steps], deadline: Deadline, url: str) -> Steps:
        """The I/O steps ``attempt(wait)``, retried (at least the server's ``Retry-After`` apart, exponential backoff) until it
        succeeds, a non-transient error, ``max_attempts`` or the deadline (the backoff is a step too: one loop for sync and async
        callers). A bounded deadline waits for no attempt past it (ServerTimeoutError)."""
        start, naps, limits = time.monotonic(), list[float](), self.limits
        previous: BaseException | None = None  # the last attempt's error
        expo = tenacity.wait_exponential(multiplier=limits.retry_backoff_s, min=limits.retry_backoff_s, max=limits.retry_backoff_max_s)

        def backoff(state: tenacity.RetryCallState) -> float:
            retry_after = getattr(previous, "retry_after_s", None)
            return max(expo(state), retry_after) if retry_after else expo(state)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            log.info("trimkit: attempt %d failed (%s); retrying in %.2f s", state.attempt_number, previous, state.upcoming_sleep)

        def timed_out() -> BaseException:
            """The previous attempt's error status if there was one (the server was answering, with 503s), else ServerTimeoutError."""
            if isinstance(previous, TransientServerError):
                return previous
            return ServerTimeoutError(f"{url} did not answer within the request's deadline of {deadline.seconds:.2f} s "
                                      "(no first chunk, or no reply to a side request)")

        stop = tenacity.stop_after_attempt(limits.max_attempts) | tenacity.stop_before_delay(deadline.seconds)
        retrying = tenacity.Retrying(sleep=naps.append, stop=stop, wait=backoff, retry=tenacity.retry_if_exception_type(RETRIED), before_sleep=before_sleep, reraise=True)
        try:
            for try_ in retrying:
                with try_:
                    if naps:
                        yield Io(time.sleep, asyncio.sleep, naps.pop())
                    wait = Wait(deadline.seconds - (time.monotonic() - start), deadline.seconds if deadline.bounded else None)
                    try:
                        if not deadline.bounded:
                            return (yield from attempt(wait))
                        return (yield Io(run_within, arun_within, attempt(wait), wait.remaining_s, timed_out))
                    except BaseException as exc:
                        previous = exc
                        raise
        except ServerUnreachableError as exc:
            elapsed = time.monotonic() - start
            # a bounded deadline is also each read's timeout: whichever fired first, it is the deadline that passed
            if isinstance(exc, ServerTimeoutError) and deadline.bounded and elapsed >= deadline.seconds and isinstance(timed_out(), ServerUnreachableError):
                raise timed_out() from exc
            raise type(exc)(f"{exc} (gave up after {retrying.statistics.get('attempt_number', 1)} attempts in {elapsed:.1f} s)") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _open_url(self, client: httpx.Client | httpx.AsyncClient, path: str, body: Mapping[str, Any], wait: Wait,
                  headers: Mapping[str, str] | None) -> Steps:
        url, is_async = self.base_url + path, isinstance(client, httpx.AsyncClient)
        sent_headers = {**self.headers, **(headers or {}), "Accept": "text/event-stream"}
        request = client.build_request("POST", url, json=body, headers=sent_headers, timeout=self.limits.httpx_timeout(wait))
        with translated(lambda exc: transport_error(exc, url)):
            resp = yield Io(client.send, client.send, request, stream=True)
            close, data = (resp.aclose, resp.aiter_bytes()) if is_async else (resp.close, resp.iter_bytes())
            try:
                kind = body_kind(resp.headers.get("content-type"))
                if resp.status_code >= 300 or kind != "sse":  # an error, or the server ignored stream=true: one whole response
                    content = yield from capped(data, *body_cap(resp.status_code, kind, url))
                    return Opened(answer(resp.status_code, resp.headers, content, url, kind), _no_more, close, lambda: True, whole=True)
                reader = EventReader()
                next_event = event_steps(data, reader)
                return Opened((yield from next_event()), next_event, close, lambda: reader.done)
            except BaseException:
                yield Io(close, close)
                raise

    def open_stream(self, path: str, body: Mapping[str, Any], wait: Wait, client: Any = None, headers: Mapping[str, str] | None = None, *,
                    is_async: bool = False) -> Steps:
        """A stream opened up to its first event, as I/O steps: through the ``openai`` ``client`` when
        given, else ``POST base_url + path`` over httpx (async: :meth:`stream_client`); ``headers`` this request's own."""
        if client is not None:
            return self._open_client(client, body, wait, headers, is_async=is_async)
        return self._open_url(self.stream_client() if is_async else self.http, path, body, wait, headers)

    def stream_client(self) -> httpx.AsyncClient:
        """The ``async_http_client`` given, else the running loop's pooled one, made on first use."""
        if self.async_http is not None:
            return self.async_http
        loop = asyncio.get_running_loop()
        with self._loop_lock:
            client = self._loop_clients.get(loop)
            if client is None or client.is_closed:
                client = self._loop_clients[loop] = httpx.AsyncClient(headers=self.headers, timeout=self.limits.httpx_timeout())
        return client

    def create(self, client: Any, body: Mapping[str, Any], wait: Wait, url: str, headers: Mapping[str, str] | None = None) -> Any:
        """``client.chat.completions.create(**body)`` (an async client's: its coroutine), its exceptions as trimkit errors; a bounded
        deadline's read timeout unless the caller gave ``timeout``; ``headers`` joined to a copy of the caller's ``extra_headers``."""
        kwargs = dict(body)
        if wait.bound_s is not None and "timeout" not in kwargs:
            kwargs["timeout"] = self.limits.read_timeout_s(wait)
        if headers:
            kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), **headers}
        with translated(lambda exc: client_error(exc, url)):
            return client.chat.completions.create(**kwargs)

    async def acreate(self, client: Any, body: Mapping[str, Any], wait: Wait, url: str, headers: Mapping[str, str] | None = None) -> Any:
        with translated(lambda exc: client_error(exc, url)):
            return await self.create(client, body, wait, url, headers)

    def _open_client(self, client: Any, body: Mapping[str, Any], wait: Wait, headers: Mapping[str, str] | None, *, is_async: bool) -> Steps:
        url = self.base_url
        stream = yield Io(self.create, self.acreate, client, body, wait, url, headers)
        close = stream.close if is_async else getattr(stream, "close", lambda: None)
        with translated(lambda exc: client_error(exc, url, streaming=True)):
            try:
                response: Any = getattr(stream, "response", None)  # the HTTP response under the client's stream
                got: Any = getattr(response, "headers", None)
                if callable(getattr(got, "get", None)) and (kind := body_kind(got.get("content-type"))) != "sse":
                    data = response.aiter_bytes() if is_async else response.iter_bytes()
                    head = yield from capped(data, ERROR_BODY_BYTES, "body", truncate=True)
                    # the server's error if the body is one (ServerError), else what it is not
                    parse_completion(answer(200, got, head, url, kind))
                    raise MalformedReplyError(f"{url} answered a stream request with one JSON body, which this client cannot stream",
                                              field="content-type", server_message=excerpt(head))
                it = stream.__aiter__() if is_async else iter(stream)

                def next_event() -> Steps:
                    return (yield Io(next, anext, it, END))

                return Opened((yield from next_event()), next_event, close, lambda: False, client=True)
            except BaseException:
                with contextlib.suppress(Exception):
                    yield Io(close, close)
                raise


# == reading an open stream ==================================================================================

_SKIP = object()  # an event not handed to the caller


@attrs.define
class StreamState:
    """What one stream has said so far."""

    url: str
    hide_usage_chunk: bool = False  # trimkit added stream_options: the usage-only chunk is its own
    stats_reply: Reply | None = None  # the last reply that carried usage / timings
    finish_reason: str | None = None
    chunks: list[Reply] | None = None  # filled when the response is to be assembled
    last: Reply | None = None  # the reply of the chunk just yielded (read by the TimedStream)
    n_seen: int = 0
    #: a bounded deadline holds until the first output (content, a tool call, a finish), whatever
    #: arrives before it: role deltas, ``content: null`` chunks, keep-alives
    deadline: Deadline | None = None
    started: float | None = None  # time.monotonic() when the request went out
    has_output: bool = False
    served_model: str | None = None  # the model the server says answered (its chunks' ``model``)
    #: the open response (what :meth:`AsyncTimedStream.aclose` closes under another task's step; is it the openai client's?)
    opened: Opened | None = attrs.field(default=None, repr=False)

    def take(self, item: Any, opened: Opened) -> Any:
        """Parse an event (a chunk, or a whole completion) and record what it says; the chunk to hand on, or ``_SKIP``."""
        self.n_seen += 1
        reply = parse_completion(item) if opened.whole else parse_chunk(item)
        self.served_model = self.served_model or reply.model
        if not self.has_output:
            if reply.output is not None:
                self.has_output = True
            elif not reply.usage_only and (d := self.deadline) is not None and d.bounded and time.monotonic() - (self.started or 0.0) > d.seconds:
                raise ServerTimeoutError(f"{self.url} sent {self.n_seen} chunks but no content within the request's deadline of {d.seconds:.2f} s")
        self.last = reply
        if self.chunks is not None:
            self.chunks.append(reply)
        if reply.has_stats:
            self.stats_reply = reply
        self.finish_reason = reply.finish_reason or self.finish_reason
        return _SKIP if self.hide_usage_chunk and reply.usage_only else reply.raw

    def end(self, opened: Opened) -> None:
        if self.finish_reason is not None:
            return
        if not opened.done():
            raise StreamInterruptedError(f"the stream from {self.url} ended after {self.n_seen} chunks without a finish reason or [DONE]")
        if not self.has_output:  # [DONE] before anything was generated: the same outcome as through an openai client
            raise StreamInterruptedError(f"the stream from {self.url} ended ([DONE]) after {self.n_seen} chunks without content "
                                         "or a finish reason")


def _next_chunk(state: StreamState, open_: Callable[[], Steps]) -> Steps:
    """The next chunk of a stream to hand on (END: its end), as I/O steps; the first opens it (``open_()``)."""
    if state.opened is None:
        state.started = time.monotonic()
        state.opened = yield from open_()
        if (item := state.opened.first) is END:
            message = "the server closed the stream without sending a chunk (llama-cpp-python does this when the prompt exceeds its context window)"
            raise ServerError(message, status=200, server_message="empty stream")
    else:
        item = yield from state.opened.next_event()
    while item is not END:
        if (chunk := state.take(item, state.opened)) is not _SKIP:
            return chunk
        item = yield from state.opened.next_event()
    state.end(state.opened)
    return END


def read_chunks(open_: Callable[[], Steps], state: StreamState) -> Iterator[Any]:
    """The chunks of a stream, opened on the first ``next()`` (when the TTFT clock starts)."""
    try:
        while (chunk := run_sync(_next_chunk(state, open_))) is not END:
            yield chunk
    finally:
        if state.opened is not None:
            state.opened.close()


async def aread_chunks(open_: Callable[[], Steps], state: StreamState) -> AsyncIterator[Any]:
    """:func:`read_chunks` for asyncio: ONE async generator, which closes its response itself (``finally``), never through
    another async generator (asyncio would close that on its own, in any order)."""
    try:
        while (chunk := await run_async(_next_chunk(state, open_))) is not END:
            yield chunk
    finally:
        if state.opened is not None:
            await state.opened.close()


def _stream_error(state: StreamState, stream_of: Callable[[], TimedStream | None]) -> Callable[[BaseException], BaseException | None]:
    """A stream's failure after it was opened as a trimkit error (None: as it is); ``stream_of()`` holds it weakly."""
    url = state.url

    def on_error(exc: BaseException) -> BaseException | None:
        if isinstance(exc, TrimkitError):
            return None
        openai = _openai()
        broken = (httpx.TransportError, OSError, *((openai.APIConnectionError, openai.APIStatusError) if openai is not None else ()))
        if not isinstance(exc, broken):  # an error event, a body that does not decode, or as it is
            return client_error(exc, url, streaming=True) if state.opened is not None and state.opened.client else transport_error(exc, url)
        ts = stream_of()
        n = ts.n_chunks if ts is not None else 0
        return StreamInterruptedError(f"the stream from {url} broke after {n} chunks: {type(exc).__name__}: {exc}")

    return on_error


def timed_stream(chunks: Any, state: StreamState, clock: Clock, measure: Callable[[StreamState, TimedStream], Measurement], *,
                 output_of: Callable[[Reply], str | None] = operator.attrgetter("output"), cls: type[TimedStream] = TimedStream) -> Any:
    """The :class:`TimedStream` (``cls``) over ``chunks``, each chunk's output read from the reply
    ``state`` parsed; ``measure(state, stream)`` at the end. Its error handler holds the stream weakly:
    a stream dropped unfinished is freed at once, not later by the cyclic collector on whatever thread
    it runs, which inside httpcore's pool (holding its lock) deadlocked every later request."""
    ref: weakref.ref[TimedStream] | None = None

    def content_of(chunk: Any) -> str | None:  # each chunk is yielded right after it is parsed
        return output_of(state.last) if state.last is not None else None

    extra: dict[str, Any] = {"abort": functools.partial(_close_opened, state)} if issubclass(cls, AsyncTimedStream) else {}
    ts = cls(chunks, started=None, clock=clock, content_of=content_of, finish=lambda ts: measure(state, ts),
             on_error=_stream_error(state, lambda: ref() if ref is not None else None), **extra)
    ref = weakref.ref(ts)
    return ts


async def _close_opened(state: StreamState) -> None:
    if state.opened is not None:  # closing it twice is harmless
        await state.opened.close()


def _no_more() -> Steps:
    return END
    yield  # pragma: no cover


def _raising(exc: BaseException) -> Iterator[Any]:
    raise exc
    yield  # pragma: no cover


class AsyncTimedStream(TimedStream):
    """:class:`TimedStream` over an async iterator (``async for`` it). :meth:`aclose` works from any
    task, also while another is inside ``__anext__``: ``abort()`` then closes the response under that
    step (closing the generator itself would raise "asynchronous generator is already running")."""

    def __init__(self, chunks: AsyncIterator[Any], *, abort: Callable[[], Awaitable[None]] | None = None, **kwargs: Any) -> None:
        super().__init__(iter(()), **kwargs)
        self._achunks = chunks
        self._abort = abort
        self._closed = False

    def __aiter__(self) -> AsyncTimedStream:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        if self.started is None:
            self.started = self.clock()  # the request goes out on the first step
        try:
            self._chunks = iter((await self._achunks.__anext__(),))
        except StopAsyncIteration:
            self._chunks = iter(())
        except BaseException as exc:
            if self._closed:  # aclose() ended the request under this step (a cancelled reader keeps its CancelledError)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise StopAsyncIteration from None
            self._chunks = _raising(exc)
        if self._closed:  # aclose() came from another task during this step: the stream ends here
            await self._close_chunks()
            raise StopAsyncIteration
        try:  # the sync step records, completes or translates exactly as for a sync stream
            return TimedStream.__next__(self)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Stop the stream; its response is closed before this returns (unless not open yet: a step
        another task is inside then ends the stream when its wait ends)."""
        self._closed = True
        if getattr(self._achunks, "ag_running", False):  # another task is inside __anext__
            if self._abort is not None:
                await self._abort()
            return
        await self._close_chunks()

    async def _close_chunks(self) -> None:
        aclose = getattr(self._achunks, "aclose", None)
        if aclose is not None:
            await aclose()

    async def adrain(self) -> Measurement:
        async for _ in self:
            pass
        assert self.measurement is not None
        return self.measurement


# == how long a request may wait, and how it is retried ======================================================

MIN_WAIT_S = 0.05
#: the errors a request is retried on, inside its deadline
RETRIED = (TransientServerError, ServerUnreachableError)


@attrs.frozen
class Deadline:
    """How long a request may take to its first chunk (a side request: its answer). ``seconds`` bounds
    the retries; ``bounded``: also every wait (ServerTimeoutError), each read at most ``seconds``."""

    seconds: float
    bounded: bool = False


@attrs.frozen
class Wait:
    """What one attempt may wait: ``remaining_s`` of its deadline; ``bound_s`` (bounded deadlines) the longest read."""

    remaining_s: float
    bound_s: float | None = None


def _positive(value: Any, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidInputError(f"{label} must be a number > 0, got {value!r}")
    return float(value)


@attrs.define
class RequestLimits:
    """A backend's timeouts and retry settings; they may be changed on the instance."""

    timeout_s: float = attrs.field(default=300.0, converter=lambda v: _positive(v, "timeout_s"))
    connect_timeout_s: float = attrs.field(default=5.0, converter=lambda v: _positive(v, "connect_timeout_s"))
    retry_deadline_s: float = attrs.field(default=30.0, converter=lambda v: _positive(v, "retry_deadline_s"))
    max_attempts: int = attrs.field(default=10, converter=lambda v: count(v, "max_attempts", minimum=1))
    retry_backoff_s: float = attrs.field(default=0.1, converter=float)
    retry_backoff_max_s: float = attrs.field(default=2.0, converter=float)
    #: the deadline of calls and side requests that give none (None: waits bounded by timeout_s only)
    deadline_s: float | None = None

    def deadline(self, retry_deadline_s: float | None = None, deadline_s: float | None = None, *, unbounded: bool = False) -> Deadline:
        """``deadline_s`` (else the instance's), bounding every wait; without one (or ``unbounded``:
        calibration probes, non-streamed answers) the retry window only."""
        bound = deadline_s if deadline_s is not None else self.deadline_s
        if not unbounded and bound is not None:
            return Deadline(float(bound), bounded=True)
        return Deadline(float(self.retry_deadline_s if retry_deadline_s is None else retry_deadline_s))

    def read_timeout_s(self, wait: Wait | None) -> float:
        if wait is None or wait.bound_s is None:
            return self.timeout_s
        return max(min(self.timeout_s, wait.bound_s), MIN_WAIT_S)

    def httpx_timeout(self, wait: Wait | None = None) -> httpx.Timeout:
        """Connect within what is left of the deadline; each other wait :meth:`read_timeout_s`."""
        if wait is None:
            return httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
        return httpx.Timeout(self.read_timeout_s(wait), connect=max(min(self.connect_timeout_s, wait.remaining_s), MIN_WAIT_S))



def run_within(steps: Steps, seconds: float, timed_out: Callable[[], BaseException]) -> Any:
    """``steps`` run in a worker thread, waited for at most ``seconds`` (then ``timed_out()`` is raised):
    a blocking read cannot be given an overall deadline (a server may trickle bytes forever), nor can
    the ``openai`` client's stream be interrupted. The worker ends on its own (each wait is bounded);
    a stream it opens after the caller gave up is closed."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(run_sync(steps))
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, name="trimkit-request", daemon=True).start()
    done, _ = concurrent.futures.wait([future], timeout=max(seconds, 0.0))
    if not done:
        future.add_done_callback(_discard)
        raise timed_out()
    return future.result()


async def arun_within(steps: Steps, seconds: float, timed_out: Callable[[], BaseException]) -> Any:
    """:func:`run_within` for asyncio: the attempt is cancelled at the deadline."""
    try:
        async with asyncio.timeout(max(seconds, 0.0)):
            return await run_async(steps)
    except TimeoutError as exc:
        if isinstance(exc, TrimkitError):
            raise
        raise timed_out() from None
