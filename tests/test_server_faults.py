"""A hostile server: every way an OpenAI-compatible endpoint can answer badly, on loopback, driven
through the three front-ends users have — ``wrap_url`` (sync and async), ``trimkit.wrap`` of an
``openai.OpenAI`` and of an ``openai.AsyncOpenAI`` — streamed and not.

:class:`FaultServer` is a stdlib ``http.server`` in a thread whose reply to each path a test sets
(raw bytes, so it can send anything: garbage JSON, HTML, a reset, nothing at all). What each
fault must give: a typed trimkit error (``MalformedReplyError`` naming the field, ``ServerError``
with the server's message, ``ServerTimeoutError`` within about the deadline,
``StreamInterruptedError``) — never a ``TypeError`` or ``JSONDecodeError``, never a hang — and
an error raised mid-stream carries the report of what was sent.

Every test is bounded (``pytest.mark.timeout``: a hang fails it); none asserts how long a call
took — that depends on the machine's load (docs: "within about the deadline" is the design,
``benchmarks`` measure it).
"""

from __future__ import annotations

import asyncio
import copy
import http.server
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import pytest

import trimkit
from tests._core_helpers import make_profile
from trimkit import wrap_url
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.replies import chunk_content
from trimkit.errors import (
    CalibrationError,
    MalformedReplyError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    StreamInterruptedError,
    TransientServerError,
    TrimkitError,
)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(60)

ASK = [{"role": "user", "content": "Say hello."}]
PROFILE = make_profile()
#: the deadline the fault tests run under (a budget of 0.5 s; the deadline fixed at 1 s to keep them short)
DEADLINE_S = 1.0
#: how far past its deadline a call may return on a shared, loaded machine (a bound against hangs, not a speed claim)
SLACK_S = 3.0


# -- the server ---------------------------------------------------------------------------------------
Reply = Callable[["_Handler", dict[str, Any]], None]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _dispatch(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        path = self.path.split("?", 1)[0]
        owner = self.server.owner
        with owner.lock:
            owner.hits.append(path)
            owner.largest_body = max(owner.largest_body, length)
        reply = owner.routes.get(path) or status_reply(404, {"error": {"message": f"no {path}"}})
        try:
            reply(self, body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_POST = _dispatch

    def head(self, status: int = 200, content_type: str | None = "application/json", headers: dict[str, str] | None = None,
             length: int | None = None) -> None:
        self.send_response_only(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()

    def wait_released(self, seconds: float = 30.0) -> None:
        self.server.owner.released.wait(seconds)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultServer

    def handle_error(self, request: Any, client_address: Any) -> None:  # a client that went away: expected here
        pass


class FaultServer:
    """An OpenAI-compatible server on 127.0.0.1 whose replies a test chooses: ``routes[path]`` is
    a function writing the raw response. By default it lists one model (``m``), has no tokenize
    endpoint (trimkit counts with tiktoken) and streams a short good answer."""

    def __init__(self) -> None:
        self.routes: dict[str, Reply] = {
            "/v1/models": json_reply({"object": "list", "data": [{"id": "m", "owned_by": "fault"}]}),
            "/v1/chat/completions": sse_reply(*GOOD_STREAM),
        }
        self.hits: list[str] = []
        self.largest_body = 0  # bytes: the largest request body received
        self.lock = threading.Lock()
        self.released = threading.Event()  # set on close: handlers that hang return
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def chat(self, reply: Reply) -> FaultServer:
        self.routes["/v1/chat/completions"] = reply
        return self

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for p in self.hits if p == path)

    def close(self) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()


# the ``server`` fixture (a FaultServer) is in tests/conftest.py, shared with the other fault tests


# -- replies -----------------------------------------------------------------------------------------------
def chunk(content: Any = None, *, role: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


GOOD_STREAM = (chunk(role="assistant"), chunk("Hello"), chunk(" there"), chunk(finish="stop"))
COMPLETION = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there"}, "finish_reason": "stop"},
                          {"index": 1, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}


def _event_bytes(event: Any) -> bytes:
    if isinstance(event, bytes):
        return event
    if isinstance(event, str):
        return event.encode()
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def sse_reply(*events: Any, done: bool = True, content_type: str | None = "text/event-stream", then: Reply | None = None) -> Reply:
    """An event stream: dicts as ``data:`` events, bytes/str written as they are; ``then`` runs
    after the events (to hang or reset instead of ending)."""

    def reply(h: _Handler, body: dict[str, Any]) -> None:
        h.head(200, content_type)
        h.wfile.write(b"".join(_event_bytes(e) for e in events) + (b"data: [DONE]\n\n" if done else b""))
        h.wfile.flush()
        if then is not None:
            then(h, body)

    return reply


def raw_reply(data: bytes, *, status: int = 200, content_type: str | None = "application/json", headers: dict[str, str] | None = None) -> Reply:
    def reply(h: _Handler, body: dict[str, Any]) -> None:
        h.head(status, content_type, headers, length=len(data))
        h.wfile.write(data)

    return reply


def json_reply(obj: Any, *, status: int = 200, content_type: str = "application/json", headers: dict[str, str] | None = None) -> Reply:
    return raw_reply(json.dumps(obj).encode(), status=status, content_type=content_type, headers=headers)


def status_reply(status: int, obj: Any, headers: dict[str, str] | None = None) -> Reply:
    return json_reply(obj, status=status, headers=headers)


def hang(h: _Handler, body: dict[str, Any]) -> None:
    """Accept the request and never answer (until the server closes)."""
    h.wait_released()


def hang_after_headers(h: _Handler, body: dict[str, Any]) -> None:
    h.head(200, "text/event-stream")
    h.wait_released()


def ping_forever(h: _Handler, body: dict[str, Any]) -> None:
    """Headers, then an SSE comment every 0.1 s: bytes keep coming, no event ever does."""
    h.head(200, "text/event-stream")
    while not h.server.owner.released.wait(0.1):
        h.wfile.write(b": ping\n\n")
        h.wfile.flush()


def dribble_headers(h: _Handler, body: dict[str, Any]) -> None:
    """Slowloris: the status line and headers one byte every 0.1 s, each read well inside any timeout."""
    for byte in b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nX-Filler: " + b"x" * 400:
        if h.server.owner.released.wait(0.1):
            return
        h.wfile.write(bytes([byte]))
        h.wfile.flush()


def slow_first_byte(seconds: float) -> Reply:
    def reply(h: _Handler, body: dict[str, Any]) -> None:
        if h.server.owner.released.wait(seconds):
            return
        sse_reply(*GOOD_STREAM)(h, body)

    return reply


def reset(h: _Handler, body: dict[str, Any]) -> None:
    """Close the connection with a TCP reset, before any response."""
    h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    h.connection.close()


def huge_line(n_bytes: int) -> Reply:
    """An event stream whose first line never ends: ``n_bytes`` of data without a newline."""

    def reply(h: _Handler, body: dict[str, Any]) -> None:
        h.head(200, "text/event-stream")
        h.wfile.write(b"data: ")
        piece = b"x" * (1 << 20)
        for _ in range(n_bytes // len(piece)):
            h.wfile.write(piece)

    return reply


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- driving the three front-ends ---------------------------------------------------------------------
FORMS = ("url", "url_async", "openai", "openai_async")


@attrs.define
class Outcome:
    value: Any = None
    error: BaseException | None = None
    chunks: list[Any] = attrs.Factory(list)
    elapsed_s: float = 0.0


def make_chat(form: str, server: FaultServer, **kwargs: Any) -> Any:
    """A wrapper of the given form on the fault server. The ``openai`` clients keep their default
    ``max_retries`` (2): trimkit must not let them retry inside its own retries."""
    options: dict[str, Any] = dict(profile=PROFILE, ttft_budget_s=0.5, retry_deadline_s=DEADLINE_S, retry_backoff_s=0.01,
                                   retry_backoff_max_s=0.05, summarizer=None)
    options.update(kwargs)
    if form == "url":
        return wrap_url(server.base_url, model="m", **options)
    if form == "url_async":
        return wrap_url(server.base_url, model="m", asynchronous=True, **options)
    if form == "openai":
        return trimkit.wrap(openai.OpenAI(base_url=server.base_url, api_key="x"), model="m", **options)
    return trimkit.wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="x"), model="m", **options)


def call(form: str, server: FaultServer, *, stream: bool, messages: Any = None, chat_kwargs: dict[str, Any] | None = None,
         **params: Any) -> Outcome:
    """One ``create`` through ``form``; the outcome (value or error, streamed chunks, time taken)."""
    messages = copy.deepcopy(ASK) if messages is None else messages
    out = Outcome()
    t0 = time.monotonic()
    if form in ("url", "openai"):
        chat = make_chat(form, server, **(chat_kwargs or {}))
        try:
            if stream:
                for c in chat.chat.completions.create(messages=messages, stream=True, **params):
                    out.chunks.append(c)
            else:
                out.value = chat.chat.completions.create(messages=messages, **params)
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            out.error = exc
        finally:
            chat.close()
    else:
        async def run() -> None:
            chat = make_chat(form, server, **(chat_kwargs or {}))
            try:
                if stream:
                    s = await chat.chat.completions.create(messages=messages, stream=True, **params)
                    async for c in s:
                        out.chunks.append(c)
                else:
                    out.value = await chat.chat.completions.create(messages=messages, **params)
            except BaseException as exc:  # noqa: BLE001
                out.error = exc
            finally:
                await chat.close()

        asyncio.run(run())
    out.elapsed_s = time.monotonic() - t0
    return out


def expect(out: Outcome, cls: type[BaseException], match: str | None = None) -> BaseException:
    """The outcome is an error of ``cls`` (a trimkit error, never another exception)."""
    assert out.error is not None, f"expected {cls.__name__}, got a result: {out.value!r} / {out.chunks!r}"
    assert isinstance(out.error, TrimkitError), f"a raw {type(out.error).__name__} leaked: {out.error!r}"
    assert isinstance(out.error, cls), f"expected {cls.__name__}, got {type(out.error).__name__}: {out.error}"
    if match is not None:
        assert match in str(out.error), f"{match!r} not in {str(out.error)!r}"
    return out.error


def _text(chunks: list[Any]) -> str:
    return "".join(chunk_content(c) or "" for c in chunks)


# -- the fault server itself works ------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stream", [True, False])
def test_a_good_server_answers_through_every_front_end(server, form, stream):
    out = call(form, server, stream=stream, max_tokens=4)
    assert out.error is None, out.error
    if stream:
        assert _text(out.chunks) == "Hello there"
    else:
        content = out.value["choices"][0]["message"]["content"] if isinstance(out.value, dict) else out.value.choices[0].message.content
        assert content == "Hello there"


# -- garbage: a typed error naming what was wrong, with the report, the caller's data untouched ------------------
USAGE_400_DIGITS = {"choices": [], "usage": {"prompt_tokens": int("9" * 400), "completion_tokens": 2}}
NESTED = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}], "x": %s}\n\n'

#: (id, reply, error, the field it must name (None: not checked), raised after content was streamed)
STREAM_FAULTS = [
    ("choices_is_a_number", sse_reply({"id": "c", "choices": 5}), MalformedReplyError, "choices", False),
    ("delta_is_a_string", sse_reply({"choices": [{"index": 0, "delta": "x"}]}), MalformedReplyError, "choices[0].delta", False),
    ("content_is_a_number", sse_reply(chunk(role="assistant"), chunk(5)), MalformedReplyError, "choices[0].delta.content", False),
    ("finish_reason_is_a_number", sse_reply(chunk("Hi", role="assistant"), {"choices": [{"index": 0, "delta": {}, "finish_reason": 5}]}),
     MalformedReplyError, "choices[0].finish_reason", True),
    ("tool_calls_is_a_string", sse_reply({"choices": [{"index": 0, "delta": {"tool_calls": "x"}}]}), MalformedReplyError,
     "choices[0].delta.tool_calls", False),
    ("event_is_a_number", sse_reply(b"data: 5\n\n"), MalformedReplyError, "", False),
    ("event_is_null", sse_reply(b"data: null\n\n"), MalformedReplyError, "", False),
    ("nested_100_deep", sse_reply(NESTED % deep(100).encode()), MalformedReplyError, None, False),
    ("nested_100000_deep", sse_reply(NESTED % deep(100_000).encode()), MalformedReplyError, None, False),
    ("usage_with_400_digits", sse_reply(*GOOD_STREAM, USAGE_400_DIGITS), MalformedReplyError, "usage.prompt_tokens", True),
    ("usage_negative", sse_reply(*GOOD_STREAM, {"choices": [], "usage": {"prompt_tokens": -3}}), MalformedReplyError,
     "usage.prompt_tokens", True),
    ("timings_nan", sse_reply(*GOOD_STREAM[:-1], chunk(finish="stop", timings={"prompt_n": 3, "prompt_ms": float("nan")})),
     MalformedReplyError, "timings.prompt_ms", True),
    ("not_json_mid_stream", sse_reply(chunk(role="assistant"), chunk("Hel"), b"data: {not json\n\n"), MalformedReplyError, None, True),
    ("error_event_mid_stream", sse_reply(chunk(role="assistant"), chunk("Hel"), b'data: {"error": {"message": "slot crashed"}}\n\n'),
     ServerError, None, True),
    ("json_that_is_not_json", raw_reply(b"this is not json {"), MalformedReplyError, None, False),
    ("json_that_is_empty", raw_reply(b""), MalformedReplyError, None, False),
    ("html_with_200", raw_reply(b"<html><body>Bad gateway</body></html>", content_type="text/html"), MalformedReplyError, "content-type", False),
    ("html_labelled_json", raw_reply(b"<html><body>Bad gateway</body></html>"), MalformedReplyError, None, False),
    ("gzip_that_is_not_gzip", raw_reply(b"not gzip at all", content_type="text/event-stream", headers={"Content-Encoding": "gzip"}),
     MalformedReplyError, None, False),
    ("cut_in_the_middle_of_an_event", sse_reply(chunk(role="assistant"), chunk("Hel"), b'data: {"id": "c1", "choi', done=False),
     StreamInterruptedError, None, True),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(("reply", "error", "field", "mid_stream"), [f[1:] for f in STREAM_FAULTS], ids=[f[0] for f in STREAM_FAULTS])
def test_garbage_from_the_server_is_a_typed_error_naming_the_field(server, form, stream, reply, error, field, mid_stream):
    server.chat(reply)
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    before = copy.deepcopy(messages)
    err = expect(call(form, server, stream=stream, messages=messages, max_tokens=4), error)
    if field is not None:
        assert err.field == field, (err.field, str(err))
    assert err.report is not None, "an error raised while the stream was read carries the report of what was sent"
    assert err.report.decode_params["max_tokens"] == 4
    if mid_stream:
        assert err.report.measured_ttft_s is not None and err.report.measured_ttft_s > 0
    assert messages == before


def test_an_error_object_with_status_200_is_the_servers_error_not_an_empty_answer(server):
    server.chat(json_reply({"error": {"message": "model is loading", "code": 500}}))
    for form in FORMS:
        for stream in (True, False):
            err = expect(call(form, server, stream=stream, max_tokens=4), ServerError, "model is loading")
            assert not isinstance(err, MalformedReplyError) and err.status == 200 and err.server_message == "model is loading"


@pytest.mark.parametrize("form", FORMS)
def test_a_stream_line_that_never_ends_is_refused_at_the_cap_not_read_to_the_end(server, form):
    server.chat(huge_line(9 << 20))  # over the 8 MiB event cap
    # a deadline no loaded host reaches: the openai client buffers all 9 MiB, and this is about the cap
    out = call(form, server, stream=True, max_tokens=4, chat_kwargs={"retry_deadline_s": 30.0})
    if form.startswith("url"):  # read by trimkit: refused at the cap
        expect(out, MalformedReplyError, "longer than")
    else:  # read by the openai client, which buffers it and drops it at the end: a typed error all the same
        expect(out, ServerError)


def test_a_body_over_the_cap_is_refused(server, monkeypatch):
    import trimkit.backends.replies as replies
    import trimkit.backends.transport as transport

    monkeypatch.setattr(transport, "MAX_REPLY_BYTES", 1 << 20)
    monkeypatch.setattr(replies, "MAX_REPLY_BYTES", 1 << 20)
    server.chat(raw_reply(json.dumps({**COMPLETION, "pad": "x" * (2 << 20)}).encode()))
    for form in ("url", "url_async"):
        expect(call(form, server, stream=True, max_tokens=4), MalformedReplyError, "cap")
        expect(call(form, server, stream=False, max_tokens=4, n=2), MalformedReplyError, "cap")


#: faults of a non-streamed answer (``n > 1``, sent with stream=False): the body is one JSON document
WHOLE_FAULTS = [
    ("not_json", raw_reply(b"this is not json {"), MalformedReplyError, None),
    ("html", raw_reply(b"<html><body>Bad gateway</body></html>", content_type="text/html"), MalformedReplyError, None),
    ("no_choices", json_reply({"id": "x", "object": "chat.completion"}), MalformedReplyError, "choices"),
    ("choices_is_a_number", json_reply({**COMPLETION, "choices": 5}), MalformedReplyError, "choices"),
    ("message_is_a_string", json_reply({**COMPLETION, "choices": [{"index": 0, "message": "x"}]}), MalformedReplyError, "choices[0].message"),
    ("nested_100_deep", raw_reply(b'{"choices": [], "x": ' + deep(100).encode() + b"}"), MalformedReplyError, None),
    ("nested_100000_deep", raw_reply(b'{"choices": [], "x": ' + deep(100_000).encode() + b"}"), MalformedReplyError, None),
    ("usage_with_400_digits", raw_reply(json.dumps({**COMPLETION, "usage": {"prompt_tokens": int("9" * 400)}}).encode()),
     MalformedReplyError, "usage.prompt_tokens"),
    ("error_object", json_reply({"error": {"message": "model is loading"}}), ServerError, None),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("reply", "error", "field"), [f[1:] for f in WHOLE_FAULTS], ids=[f[0] for f in WHOLE_FAULTS])
def test_garbage_as_a_non_streamed_answer_is_a_typed_error(server, form, reply, error, field):
    server.chat(reply)
    err = expect(call(form, server, stream=False, max_tokens=4, n=2), error)
    if field is not None:
        assert err.field == field, (err.field, str(err))


@pytest.mark.parametrize("form", FORMS)
def test_what_servers_really_send_still_works(server, form):
    """Not faults: variations real servers produce, which the parsing must keep accepting."""
    variants = [
        sse_reply(*GOOD_STREAM, done=False),  # a finish reason and no [DONE]
        sse_reply(*GOOD_STREAM, content_type=None),  # no content type
        sse_reply(*GOOD_STREAM, content_type="text/plain; charset=utf-8"),
        sse_reply(b": ping\n\n", *[_event_bytes(e).replace(b"\n", b"\r\n") for e in GOOD_STREAM]),  # CRLF, a comment
        sse_reply(b'data:{"choices":[{"index":0,"delta":{"content":"Hello there"},"finish_reason":null}]}\n\n',
                  b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": null, "timings": null}\n\n'),
        sse_reply(*GOOD_STREAM, {"choices": None, "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}}),
    ]
    for reply in variants:
        server.chat(reply)
        out = call(form, server, stream=True, max_tokens=4)
        assert out.error is None, out.error
        assert _text(out.chunks) == "Hello there"


# -- hung servers: a typed timeout within about the deadline ----------------------------------------------
HANGS = [
    ("accepts_and_never_answers", hang),
    ("headers_then_nothing", hang_after_headers),
    ("pings_forever", ping_forever),
    ("slowloris_headers", dribble_headers),
    ("first_byte_after_5s", slow_first_byte(5.0)),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reply", [h[1] for h in HANGS], ids=[h[0] for h in HANGS])
def test_a_hung_server_gives_a_timeout_within_about_the_deadline(server, form, reply):
    server.chat(reply)
    out = call(form, server, stream=True, max_tokens=4)
    err = expect(out, ServerTimeoutError)
    assert isinstance(err, TimeoutError) and isinstance(err, ServerUnreachableError)
    assert err.report is not None and err.report.measured_ttft_s is None
    assert server.count("/v1/chat/completions") == 1  # no nested retries inside the deadline


@pytest.mark.parametrize("form", ["url", "openai"])
def test_a_half_second_budget_is_not_held_for_minutes_by_a_hung_server(server, form):
    """The issue's case: budget 0.5 s, the default deadline (max(2 × budget, 5 s))."""
    from trimkit.openai_wrapper import MIN_RETRY_DEADLINE_S

    server.chat(hang)
    out = call(form, server, stream=False, max_tokens=4, chat_kwargs={"retry_deadline_s": None})
    expect(out, ServerTimeoutError, f"deadline of {MIN_RETRY_DEADLINE_S:.2f} s")  # the budget's, not the backend's 30 s


@pytest.mark.parametrize("form", FORMS)
def test_a_hung_server_with_a_non_streamed_answer_times_out_after_deadline_plus_decode(server, form):
    server.chat(hang)
    out = call(form, server, stream=False, max_tokens=4, n=2)
    expect(out, ServerTimeoutError)
    # the deadline plus twice what the profile says 2 × 4 tokens take to decode (50 tokens/s)


def test_a_hung_side_request_is_bounded_too(server):
    server.routes["/v1/models"] = hang
    out = call("url", server, stream=True, max_tokens=4)
    expect(out, ServerTimeoutError, "/v1/models")


@pytest.mark.parametrize("form", ["openai", "openai_async"])
def test_the_openai_clients_own_retries_do_not_nest_inside_trimkits(server, form):
    server.chat(status_reply(503, {"error": {"message": "loading"}}))
    err = expect(call(form, server, stream=True, max_tokens=4, chat_kwargs={"max_attempts": 2}), TransientServerError)
    assert err.status == 503 and server.count("/v1/chat/completions") == 2  # trimkit's two attempts, not 2 × 3


@pytest.mark.parametrize("form", FORMS)
def test_a_server_always_503_gives_up_at_the_deadline(server, form):
    server.chat(status_reply(503, {"error": {"message": "loading"}}))
    out = call(form, server, stream=True, max_tokens=4, chat_kwargs={"max_attempts": 10_000})
    expect(out, TransientServerError)


@pytest.mark.parametrize("retry_after", ["nan", "1e400", "-5", "inf", "soon"])
def test_a_retry_after_that_is_not_a_number_of_seconds_does_not_stop_the_retries(server, retry_after):
    server.chat(status_reply(429, {"error": {"message": "busy"}}, headers={"Retry-After": retry_after}))
    out = call("url", server, stream=True, max_tokens=4)
    expect(out, TransientServerError, "busy")
    assert server.count("/v1/chat/completions") >= 2  # the backoff applied, within the deadline


# -- resets --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
def test_a_connection_reset_before_the_answer_is_retried_then_unreachable(server, form):
    server.chat(reset)
    out = call(form, server, stream=True, max_tokens=4, chat_kwargs={"max_attempts": 3})
    expect(out, ServerUnreachableError)
    assert server.count("/v1/chat/completions") == 3  # trimkit's attempts only


@pytest.mark.parametrize("form", FORMS)
def test_a_connection_reset_mid_stream_is_an_interruption_with_the_report(server, form):
    server.chat(sse_reply(chunk(role="assistant"), chunk("Hel"), done=False, then=reset))
    err = expect(call(form, server, stream=True, max_tokens=4), StreamInterruptedError)
    assert err.report is not None and err.report.measured_ttft_s > 0
    assert server.count("/v1/chat/completions") == 1


# -- side requests: server facts and tokenize replies -------------------------------------------------------
SIDE_FAULTS = [
    ("models_data_is_a_number", "/v1/models", json_reply({"data": 5}), "data"),
    ("models_entry_is_a_number", "/v1/models", json_reply({"data": [5]}), "data[0]"),
    ("models_context_with_400_digits", "/v1/models", json_reply({"data": [{"id": "m", "max_model_len": int("9" * 400)}]}),
     "data[0].max_model_len"),
    ("models_id_is_an_object", "/v1/models", json_reply({"data": [{"id": {"x": 1}}]}), "data[0].id"),
    ("props_context_with_400_digits", "/props", json_reply({"default_generation_settings": {"n_ctx": int("9" * 400)}}),
     "default_generation_settings.n_ctx"),
    ("tokenize_gives_strings", "/tokenize", json_reply({"tokens": ["a", "b"]}), "tokens[0]"),
    ("extras_tokenize_gives_strings", "/extras/tokenize", json_reply({"tokens": ["a", "b"]}), "tokens[0]"),
    ("extras_tokenize_gives_too_many", "/extras/tokenize", json_reply({"tokens": list(range(10_000))}), "tokens"),
    ("tokenize_gives_negative_ids", "/tokenize", json_reply({"tokens": [-1]}), "tokens[0]"),
]


@pytest.mark.parametrize(("path", "reply", "field"), [f[1:] for f in SIDE_FAULTS], ids=[f[0] for f in SIDE_FAULTS])
def test_garbage_from_the_servers_side_endpoints_is_a_typed_error(server, path, reply, field):
    server.routes[path] = reply
    for form in ("url", "openai"):
        err = expect(call(form, server, stream=True, max_tokens=4), MalformedReplyError)
        assert err.field == field, (err.field, str(err))


def test_a_models_list_of_null_means_no_models(server):
    server.routes["/v1/models"] = json_reply({"object": "list", "data": None})
    out = call("url", server, stream=True, max_tokens=4)
    assert out.error is None and _text(out.chunks) == "Hello there"


def test_a_tokenize_endpoint_that_answers_later_calls_with_garbage(server):
    """The probe at the start is fine; a later tokenize reply is not."""
    answers = iter([{"tokens": [2]}])

    def tokenize(h: _Handler, body: dict[str, Any]) -> None:
        json_reply(next(answers, {"tokens": "not a list"}))(h, body)

    server.routes["/extras/tokenize"] = tokenize
    err = expect(call("url", server, stream=True, max_tokens=4), MalformedReplyError)
    assert err.field == "tokens"


# -- calibration probes are bounded ----------------------------------------------------------------------
def _tokenize_route(count_of: Callable[[str], int], limit_bytes: int = 8 << 20) -> Reply:
    """An ``/extras/tokenize`` whose count a test chooses; like a real server it refuses a body
    over ``limit_bytes`` (413), so a probe growing without end shows as that, quickly."""

    def reply(h: _Handler, body: dict[str, Any]) -> None:
        text = body.get("input", "")
        if len(text) > limit_bytes:
            status_reply(413, {"error": {"message": "request body too large"}})(h, body)
            return
        json_reply({"tokens": [1] * count_of(text)})(h, body)

    return reply


@pytest.mark.parametrize(("count_of", "error", "match"), [
    (lambda text: 7, CalibrationError, "do not grow"),  # the same count whatever the text
    (lambda text: len(text.split()) // 50 + 1, CalibrationError, "probe cap"),  # far too few tokens for the words
    (lambda text: 5000 if text else 1, MalformedReplyError, "tokens for a text"),  # more tokens than the text has bytes
], ids=["constant", "too_few", "too_many"])
def test_a_tokenizer_that_does_not_count_the_text_stops_calibration(server, count_of, error, match):
    from trimkit.backends.server import MAX_PROBE_TEXT_BYTES

    server.routes["/extras/tokenize"] = _tokenize_route(count_of)
    backend = OpenAIHTTPBackend(server.base_url, model="m", retry_backoff_s=0.01)
    try:
        with pytest.raises(error, match=match):
            backend.measure_prefill(512)
        with pytest.raises(error):
            trimkit.calibrate(backend, mode="quick", store=False)
    finally:
        backend.close()
    assert server.largest_body < MAX_PROBE_TEXT_BYTES + 4096
    assert server.count("/v1/completions") == 0  # nothing was sent to be measured


def test_calibration_probes_against_a_fair_tokenizer_stay_within_the_cap(server):
    from trimkit.backends.server import MAX_PROBE_TEXT_BYTES

    server.routes["/extras/tokenize"] = _tokenize_route(lambda text: 1 + len(text.split()))
    backend = OpenAIHTTPBackend(server.base_url, model="m")
    try:
        text, tokens = backend.probe_prompt(2048, 0)
        assert 2040 <= len(tokens) <= 2048 and len(text.encode()) < MAX_PROBE_TEXT_BYTES
        with pytest.raises(CalibrationError, match="cap"):  # a probe no text under the cap can make
            backend.probe_prompt(10_000_000, 0)
    finally:
        backend.close()
