"""Backend for Ollama's native API (``/api/chat``, ``/api/generate``) through the user's own
``ollama.Client`` / ``AsyncClient`` (docs/servers.md §2.3): unlike ``/v1`` it honours
``options.num_ctx`` and reports cached tokens and prefill time. An over-long prompt is cut from
the front and still answered 200 (ollama#3839), so trimkit sets ``num_ctx`` and compares what was
sent with what was taken in.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import httpx

from trimkit.backends.base import Clock, Measurement, TimedStream, is_ollama_client
from trimkit.backends.llama_format import chat_format_renderer
from trimkit.backends.replies import MAX_EVENT_BYTES, ServerStats, as_mapping, error_message, load_json, parse_server_stats
from trimkit.backends.server import ServerBackend, ServerEvidence, local_prompt_tokenizer
from trimkit.backends.transport import AsyncTimedStream, redact_url, status_error, translated, transport_error
from trimkit.errors import InvalidInputError, MalformedReplyError, ServerError, StreamInterruptedError, count
from trimkit.planning.costs import CacheState
from trimkit.planning.profile import ProfileKey

#: ``num_ctx`` when ``n_ctx`` is not given: Ollama's own default under 24 GiB of memory (stated, not guessed)
DEFAULT_OLLAMA_CTX = 4096
#: the keyword arguments of ``ollama.Client.chat`` that go into the request body as they are
OLLAMA_SEND_KEYS = ("model", "tools", "think", "logprobs", "top_logprobs", "format", "options", "keep_alive")


def _plain(value: Any) -> Any:
    """A message, tool or options object as JSON-ready data (pydantic models without unset fields), as a copy."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    mapping = as_mapping(value)
    if mapping is not None:
        return {k: _plain(v) for k, v in mapping.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def client_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages as the ``ollama`` client sends them (its ``_copy_messages``: images as base64)."""
    from ollama._client import _copy_messages

    return [m.model_dump(exclude_none=True) for m in _copy_messages(messages)]


def client_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """The tools as the ``ollama`` client sends them (a Python function becomes its JSON schema), so they are counted as sent."""
    from ollama._client import _copy_tools

    try:
        return [t.model_dump(exclude_none=True) for t in _copy_tools(tools)]
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"tools: the ollama client cannot read them: {exc}"[:500]) from None


def plain_messages(messages: Any) -> list[dict[str, Any]]:
    """``ollama.Message`` objects (or dicts) as plain dicts, for validation and planning."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidInputError(f"messages must be a list, got {type(messages).__name__}")
    return [_plain(m) for m in messages]


class _Lines:
    """The NDJSON lines of one answer as the client's ``ChatResponse`` (``GenerateResponse``) objects, no I/O: an ``error``
    line raises ServerError; the ``done`` line ends it."""

    def __init__(self, url: str, generate: bool) -> None:
        self.url = url
        self.generate = generate
        self.final: Mapping[str, Any] | None = None
        self.n_lines = 0

    def take(self, line: str) -> Any:
        """The object for ``line``; None for a blank line."""
        import ollama

        if not line.strip():
            return None
        if len(line) > MAX_EVENT_BYTES:
            raise MalformedReplyError(f"{self.url} sent an answer line over the {MAX_EVENT_BYTES}-byte cap", server_message=line[:200])
        data = load_json(line, what="answer line")
        if not isinstance(data, Mapping):
            raise MalformedReplyError(f"{self.url} sent an answer line that is not an object", server_message=line[:200])
        if data.get("error") is not None:
            raise ServerError(f"{self.url} answered with an error: {error_message(data)}", status=200, server_message=error_message(data))
        self.n_lines += 1
        if data.get("done") is True:
            self.final = data
            if not self.generate and "message" not in data:  # the final line as Ollama's docs print it (the server sends an empty one)
                data = {**data, "message": {"role": "assistant", "content": ""}}
        try:
            return ollama.GenerateResponse(**data) if self.generate else ollama.ChatResponse(**data)
        except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise MalformedReplyError(f"{self.url} sent an answer line the ollama client cannot read: {exc}"[:500],
                                      server_message=str(data)[:200]) from None

    def end(self) -> None:
        if self.final is None:
            raise StreamInterruptedError(f"the answer from {self.url} ended after {self.n_lines} lines without its final (done) line")


def content_of(chunk: Any) -> str | None:
    """The text of one answer line; ``""`` for output without text (a tool call, the final line); None before the answer."""
    message = getattr(chunk, "message", None)
    if message is not None:
        text = (getattr(message, "content", None) or "") + (getattr(message, "thinking", None) or "")
        if text:
            return text
        if getattr(message, "tool_calls", None):
            return ""
    elif getattr(chunk, "response", None):
        return chunk.response
    return "" if getattr(chunk, "done", False) else None


class OllamaBackend(ServerBackend):
    """Ollama's native API through an ``ollama.Client`` / ``AsyncClient``: ``n_ctx`` is every request's
    ``options.num_ctx``; ``chat_format`` the model's template (else ChatML is assumed); not retried."""

    name = "ollama"
    depth_probe_keeps_prefix = False
    cache_block_tokens = 1
    prompt_count_exact = False

    def __init__(self, client: Any, *, model: str | None = None, n_ctx: int | None = None, n_batch: int | None = None,
                 chat_format: str | None = None, clock: Clock = time.perf_counter) -> None:
        if not is_ollama_client(client):
            raise InvalidInputError(f"client must be an ollama.Client or ollama.AsyncClient, got {type(client).__name__}")
        if model is not None and (not isinstance(model, str) or not model):
            raise InvalidInputError(f"model must be a non-empty str, got {model!r}")
        self.client = client
        self.http = client._client
        self.client_is_async = isinstance(self.http, httpx.AsyncClient)
        self.model = model
        self._n_ctx = count(n_ctx, "n_ctx", minimum=1) if n_ctx is not None else DEFAULT_OLLAMA_CTX
        self._n_batch = count(n_batch, "n_batch", minimum=1) if n_batch is not None else None
        self.chat_format = chat_format
        self.tokenizer = local_prompt_tokenizer(chat_format_renderer(chat_format) if chat_format is not None else None, chat_format)
        self.clock = clock
        self.base_url = redact_url(str(self.http.base_url).rstrip("/"))
        self._lock = threading.Lock()
        self._version: str | None = None
        self._side: httpx.Client | None = None  # sync requests beside an async client: probes, /api/version
        self.evidence = ServerEvidence(self.base_url, lambda: 1, lambda: False)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def token_count_correction(self) -> float:
        return self.evidence.correction

    def corrected_count(self, counted_tokens: int) -> int:
        return self.evidence.corrected_count(counted_tokens)

    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        return self.evidence.predict_cached_tokens(prompt_tokens)

    def cache_state(self) -> CacheState:
        return self.evidence.cache_state()

    def _sync_http(self) -> httpx.Client:
        if not self.client_is_async:
            return self.http
        with self._lock:
            if self._side is None:
                self._side = httpx.Client(base_url=self.http.base_url, headers=self.http.headers, timeout=self.http.timeout)
            return self._side

    @property
    def engine_version(self) -> str:
        """Ollama's version (``GET /api/version``), asked once; ``""`` when not told."""
        if self._version is None:
            with translated(lambda exc: transport_error(exc, self.base_url, "/api/version")):
                response = self._sync_http().get("/api/version")
            data = load_json(response.content, what="/api/version reply") if response.status_code == 200 else {}
            version = data.get("version") if isinstance(data, Mapping) else None
            self._version = version if isinstance(version, str) else ""
        return self._version

    def engine_identity(self) -> Any:
        return (self.name, self.base_url, self.model or "")

    def profile_key(self) -> ProfileKey:
        return ProfileKey(backend=self.name, model=f"{self.base_url}|{self.model or ''}", n_ctx=self.n_ctx, n_batch=self._n_batch or 512,
                          engine_version=self.engine_version or "ollama", cpu="remote", extra="engine=ollama")

    def close(self) -> None:
        if self._side is not None:
            self._side.close()

    def chat_body(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
        """The ``/api/chat`` body: the call's own arguments, streamed, ``options.num_ctx`` the planned window."""
        body: dict[str, Any] = {key: _plain(params[key]) for key in OLLAMA_SEND_KEYS if params.get(key) is not None}
        model = body.get("model") or self.model
        if not model:
            raise InvalidInputError("name the model: chat(model=...) or wrap(client, model=...)")
        options = dict(body.get("options") or {})
        asked = options.get("num_ctx")
        if asked is not None and asked != self.n_ctx:
            raise InvalidInputError(f"options.num_ctx={asked!r} differs from the wrapper's n_ctx={self.n_ctx}: trimkit plans the prompt "
                                    "inside n_ctx and sends it as num_ctx; set n_ctx= on the wrapper instead")
        options["num_ctx"] = self.n_ctx
        if params.get("max_tokens") is not None and "num_predict" not in options:  # calibration's probes name it so
            options["num_predict"] = params["max_tokens"]
        return {**body, "model": model, "options": options, "messages": client_messages(messages), "stream": True}

    def _measure(self, lines: _Lines, sent: list[int], predicted: int, ts: TimedStream) -> Measurement:
        final = lines.final or {}
        stats = parse_server_stats(final, strict=True) if final else ServerStats()
        reason = final.get("done_reason") if isinstance(final.get("done_reason"), str) else None
        load = stats.raw.get("load_duration")
        loaded = {"load_s": load / 1e9} if isinstance(load, (int, float)) and not isinstance(load, bool) and load >= 0 else {}
        return self.evidence.timed_measure(stats, ts, sent, predicted, reason, context_tokens=self.n_ctx, server={"num_ctx": self.n_ctx, **loaded})

    def _chunks(self, path: str, body: dict[str, Any], lines: _Lines) -> Iterator[Any]:
        with translated(lambda exc: transport_error(exc, self.base_url)), self._sync_http().stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                raise status_error(response.status_code, response.text, response.headers)
            for line in response.iter_lines():
                if (chunk := lines.take(line)) is not None:
                    yield chunk
        lines.end()

    async def _achunks(self, path: str, body: dict[str, Any], lines: _Lines, held: list[httpx.Response]) -> AsyncIterator[Any]:
        """The async stream's chunks: one async generator opens and closes the answer
        (:func:`~trimkit.backends.transport.aread_chunks` says why); ``held`` gets the response to abort."""
        response: httpx.Response | None = None
        try:
            with translated(lambda exc: transport_error(exc, self.base_url)):
                response = await self.http.send(self.http.build_request("POST", path, json=body), stream=True)
                held.append(response)
                if response.status_code != 200:
                    await response.aread()
                    raise status_error(response.status_code, response.text, response.headers)
                async for line in response.aiter_lines():
                    if (chunk := lines.take(line)) is not None:
                        yield chunk
            lines.end()
        finally:
            if response is not None:
                await response.aclose()

    def _stream(self, path: str, body: dict[str, Any], sent: list[int], *, is_async: bool, generate: bool = False) -> TimedStream:
        lines = _Lines(self.base_url + path, generate)
        finish = functools.partial(self._measure, lines, sent, self.predict_cached_tokens(sent))
        if is_async:
            held: list[httpx.Response] = []

            async def abort() -> None:  # close() from another task while one reads
                for response in held:
                    await response.aclose()

            return AsyncTimedStream(self._achunks(path, body, lines, held), started=None, clock=self.clock, content_of=content_of,
                                    finish=finish, abort=abort)
        return TimedStream(self._chunks(path, body, lines), started=None, clock=self.clock, content_of=content_of, finish=finish)

    def _chat(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None, *,
              is_async: bool) -> TimedStream:
        if is_async != self.client_is_async:
            which = "an ollama.AsyncClient: use asend()" if self.client_is_async else "a sync ollama.Client: use send()"
            raise InvalidInputError(f"this backend wraps {which}")
        body = self.chat_body(messages, params)
        sent = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        return self._stream("/api/chat", body, sent, is_async=is_async)

    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
             **_: Any) -> TimedStream:
        """Stream a chat request (sync client) of the client's ``ChatResponse`` lines."""
        return self._chat(messages, params, prompt_tokens, is_async=False)

    async def asend(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                    **_: Any) -> AsyncTimedStream:
        """:meth:`send` for an ``ollama.AsyncClient``."""
        return self._chat(messages, params, prompt_tokens, is_async=True)  # type: ignore[return-value]

    # -- calibration probes (trimkit.backends.server) --------------------------------------------------
    def probe_completion(self, text: str, tokens: list[int], *, max_tokens: int = 1, extra: Mapping[str, Any] | None = None) -> Measurement:
        """One raw ``/api/generate`` request, sync whatever the client; ``extra`` (``ignore_eos``) has no Ollama equivalent."""
        model = self.model
        if not model:
            raise InvalidInputError("calibrating through Ollama needs the model: wrap(client, model=...)")
        body = {"model": model, "prompt": text, "raw": True, "stream": True, "options": {"num_ctx": self.n_ctx, "num_predict": max_tokens}}
        return self._stream("/api/generate", body, tokens, is_async=False, generate=True).drain()

    def probe_chat(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Measurement:
        options = {"num_predict": params.get("max_tokens", 2), "temperature": params.get("temperature", 0.0)}
        body = self.chat_body(messages, {"options": options})
        return self._stream("/api/chat", body, self.tokenizer.prompt_tokens(messages, None), is_async=False).drain()

