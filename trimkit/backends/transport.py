"""Sending a request and opening its answer, over ``httpx`` or through the user's ``openai`` client.

:class:`HTTPTransport` is all the I/O of the HTTP backend: a side request answered with JSON
(:meth:`~HTTPTransport.request_json`, retried), and a stream opened up to its first event —
sync and async, over httpx (:meth:`~HTTPTransport.open_url`) or the ``openai`` client
(:meth:`~HTTPTransport.open_client`). What an answer means is decided without I/O
(:func:`stream_body_plan`, :func:`json_answer`, :mod:`trimkit.backends.faults`); the sync and
async openers differ only in the lines that read. Every body read is capped
(:data:`~trimkit.backends.fields.MAX_REPLY_BYTES`; an error status's body at 64 KiB).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import threading
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import httpx

from trimkit.backends.faults import (
    client_error,
    client_open_error,
    client_read_error,
    redirect_error,
    status_error,
    stream_reply_error,
    translated,
    transport_error,
    wrong_content_type,
)
from trimkit.backends.fields import MAX_REPLY_BYTES, excerpt, load_json
from trimkit.backends.limits import Deadline, RequestLimits, Wait, with_retries
from trimkit.backends.replies import body_kind
from trimkit.backends.sse import EventReader, aiter_events, iter_events
from trimkit.errors import InvalidInputError, MalformedReplyError

__all__ = ["END", "ERROR_BODY_BYTES", "Opened", "BodyPlan", "HTTPTransport", "normalize_base_url", "url_credentials",
           "redact_url", "stream_body_plan", "json_answer",
           "read_capped", "aread_capped", "without_retries"]

#: what a stream that ended before its first event gives as its first event
END = object()
#: what is read of an error status's body (for its message)
ERROR_BODY_BYTES = 64 * 1024
_MISSING_STATUSES = (404, 405, 501)  # an endpoint this server does not have


@attrs.define
class Opened:
    """A stream opened up to its first event."""

    first: Any  # the first event, or END
    rest: Any  # iterator or async iterator of the events after it (None: ``whole``)
    close: Callable[[], Any]  # (a coroutine function for an async stream)
    done: Callable[[], bool]  # did the server end the stream properly ([DONE])?
    whole: bool = False  # the server ignored stream=true: ``first`` is a whole completion


def _never() -> bool:
    return False


def _discard(value: Any) -> None:
    """Close what an abandoned attempt opened (a stream); other results need nothing."""
    if isinstance(value, Opened):
        value.close()


# -- decisions ------------------------------------------------------------------------------------
@attrs.frozen
class BodyPlan:
    """A stream request answered with something other than events: read at most ``cap`` bytes
    of the body (``truncate``: cut there, else refuse more), then ``outcome(body)`` is the whole
    answer or raises."""

    cap: int
    what: str
    truncate: bool
    outcome: Callable[[bytes], Any]


def _raise(error: BaseException) -> Any:
    raise error


def stream_body_plan(status: int, headers: Any, url: str) -> BodyPlan | None:
    """What a stream request's response is, from its status and headers: None for an event
    stream, else how to read the body and what it means."""
    if status >= 400:
        return BodyPlan(ERROR_BODY_BYTES, "error body", True, lambda body: _raise(status_error(status, body, headers)))
    if 300 <= status < 400:
        return BodyPlan(ERROR_BODY_BYTES, "redirect body", True, lambda body: _raise(redirect_error(status, headers, url)))
    content_type = headers.get("content-type")
    kind = body_kind(content_type)
    if kind == "json":  # the server ignored stream=true: one whole response
        return BodyPlan(MAX_REPLY_BYTES, f"reply from {url}", False, lambda body: load_json(body, what=f"reply from {url}"))
    if kind is None:
        return BodyPlan(2048, "body", True, lambda body: _raise(wrong_content_type(content_type, body, url)))
    return None


def json_answer(status: int, headers: Any, content: bytes, url: str, *, missing_ok: bool, root_only: bool) -> Any:
    """A side request's JSON answer. ``missing_ok``: None for a body that is not JSON, or for
    400/422 from an endpoint of the server root (``root_only``: another engine's, refused)."""
    if status >= 400:
        if missing_ok and status in (400, 422) and root_only:
            return None
        raise status_error(status, content, headers)
    if 300 <= status < 400:
        raise redirect_error(status, headers, url)
    try:
        return load_json(content, what=f"reply from {url}", status=status)
    except MalformedReplyError:
        if missing_ok:
            return None
        raise


class _Capped:
    """A body read until ``cap`` bytes: past it MalformedReplyError (or, ``truncate``, the first
    ``cap`` bytes). Nothing beyond the cap is read."""

    def __init__(self, cap: int, what: str, truncate: bool) -> None:
        self.cap, self.what, self.truncate = cap, what, truncate
        self.out = bytearray()

    def full(self, data: bytes) -> bool:
        self.out += data
        if len(self.out) <= self.cap:
            return False
        if not self.truncate:
            raise MalformedReplyError(f"the server sent a {self.what} over the {self.cap}-byte cap", server_message=excerpt(bytes(self.out[:500])))
        return True

    def value(self) -> bytes:
        return bytes(self.out[: self.cap])


def read_capped(byte_chunks: Iterable[bytes], cap: int, what: str, *, truncate: bool = False) -> bytes:
    body = _Capped(cap, what, truncate)
    for data in byte_chunks:
        if body.full(data):
            break
    return body.value()


async def aread_capped(byte_chunks: AsyncIterable[bytes], cap: int, what: str, *, truncate: bool = False) -> bytes:
    body = _Capped(cap, what, truncate)
    async for data in byte_chunks:
        if body.full(data):
            break
    return body.value()


_USERINFO = re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://)[^/?#@\s]*@")


def redact_url(text: Any) -> str:
    """``text`` with the userinfo of every URL in it (``http://user:secret@host``) replaced by
    ``***@``: what trimkit writes wherever it names an endpoint (reports, logs, errors, profile keys)."""
    return _USERINFO.sub(r"\1***@", str(text))


def normalize_base_url(base_url: Any) -> tuple[str, str]:
    """``(base_url, root)``: the OpenAI base (``.../v1``) without a trailing slash, and the
    server root where llama.cpp's own endpoints live — both without the URL's userinfo
    (credentials go in a header: :func:`url_credentials`), so no name trimkit gives the endpoint
    carries a password. Raises InvalidInputError for a bad URL (its text redacted)."""
    if not isinstance(base_url, (str, httpx.URL)):
        raise InvalidInputError(f"base_url must be a str, got {type(base_url).__name__}")
    try:
        url = httpx.URL(str(base_url).strip())
    except Exception as exc:
        raise InvalidInputError(f"invalid base_url {redact_url(base_url)!r}: {redact_url(exc)}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InvalidInputError(f"base_url must be an http(s) URL with a host, e.g. http://127.0.0.1:8080/v1; got {redact_url(base_url)!r}")
    base = str(url.copy_with(query=None, fragment=None, username=None, password=None)).rstrip("/")
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    return base, root


def url_credentials(base_url: Any) -> str | None:
    """The ``Authorization`` header value (HTTP Basic) for the userinfo of ``base_url``
    (``http://user:secret@host/v1``), or None when it has none."""
    try:
        url = httpx.URL(str(base_url).strip())
    except Exception:
        return None
    if not url.username and not url.password:
        return None
    token = base64.b64encode(f"{url.username}:{url.password}".encode()).decode("ascii")
    return f"Basic {token}"


def without_retries(client: Any) -> Any:
    """The client trimkit sends its own requests through: the caller's ``openai`` client with
    ``max_retries=0`` (its configuration otherwise the same, its connections shared), so that its
    retries do not nest inside trimkit's and run past the request's deadline. A client without
    ``with_options`` is used as it is."""
    with_options = getattr(client, "with_options", None)
    if not getattr(client, "max_retries", 0) or not callable(with_options):
        return client
    try:
        return with_options(max_retries=0)
    except Exception:  # a client-like object with its own idea of with_options
        return client


def _client_response(stream: Any) -> Any:
    """The HTTP response under an ``openai`` client's stream (an httpx-style response; the
    client may be built on another httpx than trimkit's), or None."""
    response = getattr(stream, "response", None)
    headers = getattr(response, "headers", None)
    return response if headers is not None and callable(getattr(headers, "get", None)) else None


def _not_events(response: Any) -> bool:
    return response is not None and body_kind(response.headers.get("content-type")) != "sse"


def _client_items(it: Iterator[Any], url: str) -> Iterator[Any]:
    """The rest of an ``openai`` client's stream, its decoding errors translated."""
    while True:
        with translated(lambda exc: client_read_error(exc, url)):
            item = next(it, END)
        if item is END:
            return
        yield item


async def _aclient_items(it: AsyncIterator[Any], url: str) -> AsyncIterator[Any]:
    while True:
        with translated(lambda exc: client_read_error(exc, url)):
            item = await anext(it, END)
        if item is END:
            return
        yield item


# -- I/O ------------------------------------------------------------------------------------------
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
        """Close the pooled sync client (if trimkit made it). The async clients trimkit made are
        closed by :meth:`aclose` on their loop; one whose loop is gone is dropped with it."""
        if self.own_http:
            self.http.close()

    async def aclose(self) -> None:
        """:meth:`close`, and the AsyncClient trimkit made for the running loop."""
        self.close()
        with self._loop_lock:
            client = self._loop_clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def loop_client(self) -> httpx.AsyncClient:
        """The AsyncClient trimkit keeps for the running event loop, made on first use."""
        loop = asyncio.get_running_loop()
        with self._loop_lock:
            client = self._loop_clients.get(loop)
            if client is None or client.is_closed:
                client = httpx.AsyncClient(headers=self.headers, timeout=self.limits.httpx_timeout())
                self._loop_clients[loop] = client
        return client

    # side requests -------------------------------------------------------------------------------
    def request_json(self, method: str, url: str, body: Any = None, *, missing_ok: bool = False, deadline: Deadline | None = None) -> Any:
        """A side request (server facts, tokenize), retried like a chat request: a pooled
        keep-alive connection the server dropped fails once and must not fail the call."""
        deadline = deadline or self.limits.deadline()
        return with_retries(lambda wait: self.request_json_once(method, url, body, wait=wait, missing_ok=missing_ok), deadline, url, self.limits)

    def request_json_once(self, method: str, url: str, body: Any = None, *, wait: Wait | None = None, missing_ok: bool = False,
                          headers: Mapping[str, str] | None = None) -> Any:
        """One request. Returns the JSON body (at most MAX_REPLY_BYTES, nested at most
        MAX_JSON_DEPTH deep); ``None`` for 404/405/501, or a body that is not JSON, when
        ``missing_ok`` (an endpoint this server does not have). ``headers``: this request's own, added."""
        sent_headers = {**self.headers, **(headers or {})}
        with translated(lambda exc: transport_error(exc, url, "the reply")):
            with self.http.stream(method, url, json=body, headers=sent_headers, timeout=self.limits.httpx_timeout(wait)) as resp:
                status, headers = resp.status_code, resp.headers
                if missing_ok and status in _MISSING_STATUSES:
                    return None
                if status >= 400:
                    content = read_capped(resp.iter_bytes(), ERROR_BODY_BYTES, "error body", truncate=True)
                else:
                    content = read_capped(resp.iter_bytes(), MAX_REPLY_BYTES, f"reply from {url}")
        root_only = url.startswith(self.root_url) and not url.startswith(self.base_url)
        return json_answer(status, headers, content, url, missing_ok=missing_ok, root_only=root_only)

    def retried(self, attempt: Callable[[Wait], Any], deadline: Deadline, url: str) -> Any:
        """:func:`~trimkit.backends.limits.with_retries` with this transport's limits; a
        stream an abandoned attempt opens is closed."""
        return with_retries(attempt, deadline, url, self.limits, _discard)

    # streams over httpx --------------------------------------------------------------------------
    def _stream_request(self, client: httpx.Client | httpx.AsyncClient, url: str, body: Mapping[str, Any], wait: Wait,
                        headers: Mapping[str, str] | None = None) -> httpx.Request:
        sent_headers = {**self.headers, **(headers or {}), "Accept": "text/event-stream"}
        return client.build_request("POST", url, json=body, headers=sent_headers, timeout=self.limits.httpx_timeout(wait))

    def open_url(self, path: str, body: Mapping[str, Any], wait: Wait, headers: Mapping[str, str] | None = None) -> Opened:
        """POST ``body`` to ``base_url + path`` (with this request's own ``headers`` added) and read up to the first event."""
        url = self.base_url + path
        with translated(lambda exc: transport_error(exc, url)):
            resp = self.http.send(self._stream_request(self.http, url, body, wait, headers), stream=True)
            try:
                plan = stream_body_plan(resp.status_code, resp.headers, url)
                if plan is not None:
                    answer = plan.outcome(read_capped(resp.iter_bytes(), plan.cap, plan.what, truncate=plan.truncate))
                    return Opened(answer, None, resp.close, lambda: True, whole=True)
                reader = EventReader()
                events = iter_events(resp.iter_bytes(), reader)
                return Opened(next(events, END), events, resp.close, lambda: reader.done)
            except BaseException:
                resp.close()
                raise

    async def aopen_url(self, client: httpx.AsyncClient, path: str, body: Mapping[str, Any], wait: Wait,
                        headers: Mapping[str, str] | None = None) -> Opened:
        url = self.base_url + path
        with translated(lambda exc: transport_error(exc, url)):
            resp = await client.send(self._stream_request(client, url, body, wait, headers), stream=True)
            try:
                plan = stream_body_plan(resp.status_code, resp.headers, url)
                if plan is not None:
                    answer = plan.outcome(await aread_capped(resp.aiter_bytes(), plan.cap, plan.what, truncate=plan.truncate))
                    return Opened(answer, None, resp.aclose, lambda: True, whole=True)
                reader = EventReader()
                events = aiter_events(resp.aiter_bytes(), reader)
                return Opened(await anext(events, END), events, resp.aclose, lambda: reader.done)
            except BaseException:
                await resp.aclose()
                raise

    def open_stream(self, path: str, body: Mapping[str, Any], wait: Wait, client: Any = None, headers: Mapping[str, str] | None = None) -> Opened:
        """A stream through the ``openai`` ``client`` when one is given, else over httpx;
        ``headers`` are this request's own (a routing key), added to the backend's."""
        return self.open_client(client, body, wait, headers) if client is not None else self.open_url(path, body, wait, headers)

    async def aopen_stream(self, http: httpx.AsyncClient | None, path: str, body: Mapping[str, Any], wait: Wait, client: Any = None,
                           headers: Mapping[str, str] | None = None) -> Opened:
        if client is not None:
            return await self.aopen_client(client, body, wait, headers)
        assert http is not None, "an async stream over httpx needs an AsyncClient"
        return await self.aopen_url(http, path, body, wait, headers)

    def stream_client(self, *, needed: bool = True) -> httpx.AsyncClient | None:
        """The ``async_http_client`` given, else the pooled one of the running event loop
        (:meth:`loop_client`); None if not ``needed`` (the client form). A plain call, not an
        async context manager: a stream's chunks are one async generator (issue 34, item 9)."""
        return self.async_http if self.async_http is not None or not needed else self.loop_client()

    # through the openai client -------------------------------------------------------------------
    def client_kwargs(self, body: Mapping[str, Any], wait: Wait, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``create()``'s arguments: the body, and with a bounded deadline the request's own
        timeout in seconds (unless the caller gave ``timeout``): whichever httpx the client is built on.
        ``headers`` (a routing key) join the caller's ``extra_headers`` (a copy: the caller's stays as it was)."""
        kwargs = dict(body)
        if wait.bound_s is not None and "timeout" not in kwargs:
            kwargs["timeout"] = self.limits.read_timeout_s(wait)
        if headers:
            kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), **headers}
        return kwargs

    def create(self, client: Any, body: Mapping[str, Any], wait: Wait, url: str, headers: Mapping[str, str] | None = None) -> Any:
        """``client.chat.completions.create(**body)``, its exceptions as trimkit errors."""
        with translated(lambda exc: client_error(exc, url)):
            return client.chat.completions.create(**self.client_kwargs(body, wait, headers))

    async def acreate(self, client: Any, body: Mapping[str, Any], wait: Wait, url: str, headers: Mapping[str, str] | None = None) -> Any:
        with translated(lambda exc: client_error(exc, url)):
            return await client.chat.completions.create(**self.client_kwargs(body, wait, headers))

    def open_client(self, client: Any, body: Mapping[str, Any], wait: Wait, headers: Mapping[str, str] | None = None) -> Opened:
        """A stream through the ``openai`` client, read up to its first chunk."""
        url = self.base_url
        stream = self.create(client, body, wait, url, headers)
        close = getattr(stream, "close", lambda: None)
        with translated(lambda exc: client_open_error(exc, url)):
            try:
                response = _client_response(stream)
                if _not_events(response):
                    head = read_capped(response.iter_bytes(), ERROR_BODY_BYTES, "body", truncate=True)
                    raise stream_reply_error(response.headers.get("content-type"), head, url)
                it = iter(stream)
                return Opened(next(it, END), _client_items(it, url), close, _never)
            except BaseException:
                with contextlib.suppress(Exception):
                    close()
                raise

    async def aopen_client(self, client: Any, body: Mapping[str, Any], wait: Wait, headers: Mapping[str, str] | None = None) -> Opened:
        url = self.base_url
        stream = await self.acreate(client, body, wait, url, headers)
        with translated(lambda exc: client_open_error(exc, url)):
            try:
                response = _client_response(stream)
                if _not_events(response):
                    head = await aread_capped(response.aiter_bytes(), ERROR_BODY_BYTES, "body", truncate=True)
                    raise stream_reply_error(response.headers.get("content-type"), head, url)
                it = stream.__aiter__()
                return Opened(await anext(it, END), _aclient_items(it, url), stream.close, _never)
            except BaseException:
                with contextlib.suppress(Exception):
                    await stream.close()
                raise
