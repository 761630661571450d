"""Backend for Ollama's native API (``/api/chat``, ``/api/generate``), through the user's own
``ollama.Client`` or ``ollama.AsyncClient`` (docs/servers.md §2.3).

Why the native API: Ollama's ``/v1`` carries usage counts only and ignores ``options.num_ctx``;
the final line of a native answer says what the wait was made of (evaluated and cached tokens,
prefill time, ``load_duration``: a cold load, reported and kept out of what is learned). An
over-long prompt is cut from the front and still answered 200 (ollama#3839), so trimkit sets
``options.num_ctx`` to the window it plans within and compares what was sent with what was taken
in. Requests go out through the client's own ``httpx`` client; each NDJSON line is parsed at the
boundary and handed on as the client's own ``ChatResponse``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import attrs
import httpx

from trimkit.backends.base import Clock, Measurement, TimedStream, is_ollama_client
from trimkit.backends.llama_format import chat_format_renderer
from trimkit.backends.replies import MAX_EVENT_BYTES, ServerStats, as_mapping, error_message, load_json, parse_server_stats
from trimkit.backends.server import ServerBackend, ServerEvidence, local_prompt_tokenizer
from trimkit.backends.transport import AsyncTimedStream, redact_url, status_error, transport_error
from trimkit.errors import InvalidInputError, MalformedReplyError, ServerError, StreamInterruptedError, count
from trimkit.planning.costs import CacheState
from trimkit.planning.profile import ProfileKey
from trimkit.planning.tokens import PromptTokenizer

log = logging.getLogger("trimkit")

#: the context trimkit asks for when ``n_ctx`` is not given: Ollama's own default on machines
#: under 24 GiB of memory (larger machines default larger; the wrapper's window is stated, not guessed)
DEFAULT_OLLAMA_CTX = 4096
#: the keyword arguments of ``ollama.Client.chat`` that go into the request body as they are
OLLAMA_SEND_KEYS = ("model", "tools", "think", "logprobs", "top_logprobs", "format", "options", "keep_alive")


def _plain(value: Any) -> Any:
    """A message, tool or options object as JSON-ready data (the client's pydantic models dumped
    without their unset fields), leaving the caller's object untouched."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    mapping = as_mapping(value)
    if mapping is not None:
        return {k: _plain(v) for k, v in mapping.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def client_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages as the ``ollama`` client itself sends them (its ``_copy_messages``: images
    as base64, empty fields left out); plain copies where the client lacks that helper."""
    try:
        from ollama._client import _copy_messages
    except ImportError:  # pragma: no cover - another client version
        return [_plain(m) for m in messages]
    return [m.model_dump(exclude_none=True) for m in _copy_messages(messages)]


def client_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """The tools as the ``ollama`` client sends them (its ``_copy_tools``: a Python function
    becomes its JSON schema, from the docstring), so that they are counted as they are sent."""
    try:
        from ollama._client import _copy_tools
    except ImportError:  # pragma: no cover - another client version
        return [_plain(t) for t in tools]
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
    """The NDJSON lines of one answer, parsed at the boundary (no I/O): each line a JSON object
    of at most ``MAX_EVENT_BYTES``; an ``{"error": ...}`` line raises ServerError; the line
    with ``done: true`` ends the answer and carries the server's numbers."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.final: Mapping[str, Any] | None = None
        self.n_lines = 0

    def take(self, line: str) -> Mapping[str, Any] | None:
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
        return data

    def end(self) -> None:
        if self.final is None:
            raise StreamInterruptedError(f"the answer from {self.url} ended after {self.n_lines} lines without its final (done) line")


def content_of(chunk: Any) -> str | None:
    """The text of one answer line (a ``ChatResponse`` or a generate reply): its content (or
    thinking, or generated text); ``""`` for a line that is output without text (a tool call,
    the final line); None for an empty line before the answer."""
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
    """Ollama's native API through an ``ollama.Client`` / ``ollama.AsyncClient``.

    ``n_ctx`` is the context window every request asks for (``options.num_ctx``) and the plan
    keeps the prompt inside; ``chat_format`` names the model's chat template (a llama-cpp-python
    format name or Jinja) so counts follow it, else ChatML is assumed; ``model`` is the model to
    name when a call does not. Requests are not retried (the client's own transport settings
    apply)."""

    name = "ollama"
    depth_probe_keeps_prefix = False

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
        self._tokenizer = local_prompt_tokenizer(chat_format_renderer(chat_format) if chat_format is not None else None, chat_format)
        self.clock = clock
        self.base_url = redact_url(str(self.http.base_url).rstrip("/"))
        self._lock = threading.Lock()
        self._version: str | None = None
        self._side: httpx.Client | None = None  # sync requests beside an async client: probes, /api/version
        self.evidence = ServerEvidence(self.base_url, lambda: 1, lambda: False)

    # -- facts ----------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def cache_block_tokens(self) -> int:
        return 1

    @property
    def tokenizer(self) -> PromptTokenizer:  # type: ignore[override]
        return self._tokenizer

    background_tokenizer = tokenizer

    @property
    def prompt_count_exact(self) -> bool:
        return False

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
        """Ollama's version (``GET /api/version``), asked once; ``""`` when it does not say."""
        if self._version is None:
            try:
                response = self._sync_http().get("/api/version")
                data = load_json(response.content, what="/api/version reply") if response.status_code == 200 else {}
                version = data.get("version") if isinstance(data, Mapping) else None
                self._version = version if isinstance(version, str) else ""
            except httpx.HTTPError as exc:
                raise transport_error(exc, self.base_url, "/api/version") or exc from None
        return self._version

    def engine_identity(self) -> Any:
        return (self.name, self.base_url, self.model or "")

    def profile_key(self) -> ProfileKey:
        return ProfileKey(backend=self.name, model=f"{self.base_url}|{self.model or ''}", n_ctx=self.n_ctx, n_batch=self._n_batch or 512,
                          engine_version=self.engine_version or "ollama", cpu="remote", extra="engine=ollama")

    def close(self) -> None:
        if self._side is not None:
            self._side.close()

    # -- requests -------------------------------------------------------------------------------
    def chat_body(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
        """The ``/api/chat`` body: the call's own arguments, streamed, with ``options.num_ctx``
        set to the window the plan kept the prompt inside (a call's own ``num_ctx`` must be that
        window: a different one would be planned for the wrong context and reload the model)."""
        body: dict[str, Any] = {key: _plain(params[key]) for key in OLLAMA_SEND_KEYS if params.get(key) is not None}
        model = body.get("model") or self.model
        if not model:
            raise InvalidInputError("name the model: chat(model=...) or wrap(client, model=...)")
        body["model"] = model
        options = dict(body.get("options") or {})
        asked = options.get("num_ctx")
        if asked is not None and asked != self.n_ctx:
            raise InvalidInputError(f"options.num_ctx={asked!r} differs from the wrapper's n_ctx={self.n_ctx}: trimkit plans the prompt "
                                    "inside n_ctx and sends it as num_ctx; set n_ctx= on the wrapper instead")
        options["num_ctx"] = self.n_ctx
        if params.get("max_tokens") is not None and "num_predict" not in options:  # calibration's probes name it so
            options["num_predict"] = params["max_tokens"]
        body["options"] = options
        body["messages"] = client_messages(messages)
        body["stream"] = True
        return body

    def _chunk(self, data: Mapping[str, Any], generate: bool) -> Any:
        """One answer line as the client's own type (``ChatResponse``, ``GenerateResponse``)."""
        import ollama

        if not generate and "message" not in data and data.get("done") is True:
            # the final line as Ollama's docs print it has no message (the server sends an empty one)
            data = {**data, "message": {"role": "assistant", "content": ""}}
        try:
            return ollama.GenerateResponse(**data) if generate else ollama.ChatResponse(**data)
        except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise MalformedReplyError(f"{self.base_url} sent an answer line the ollama client cannot read: {exc}"[:500],
                                      server_message=str(data)[:200]) from None

    def _measure(self, lines: _Lines, ts: TimedStream, sent: list[int], predicted: int) -> Measurement:
        final = lines.final or {}
        stats = parse_server_stats(final, strict=True) if final else ServerStats()
        reason = final.get("done_reason") if isinstance(final.get("done_reason"), str) else None
        m = self.evidence.timed_measure(stats, ts, sent, predicted, reason, context_tokens=self.n_ctx)
        load = stats.raw.get("load_duration")
        server = dict(m.server)
        server["num_ctx"] = self.n_ctx
        if isinstance(load, (int, float)) and not isinstance(load, bool) and load >= 0:
            server["load_s"] = load / 1e9
        return attrs.evolve(m, server=server)

    def _lines(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        try:
            with self._sync_http().stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise status_error(response.status_code, response.text, response.headers)
                yield from response.iter_lines()
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.base_url) or exc from None

    async def _achunks(self, path: str, body: dict[str, Any], lines: _Lines, generate: bool, held: list[httpx.Response]) -> AsyncIterator[Any]:
        """The async stream's chunks: ONE async generator, which opens the answer and closes it
        itself (:func:`~trimkit.backends.transport.aread_chunks` says why). ``held`` gets the open
        response (what ``abort`` closes)."""
        response: httpx.Response | None = None
        try:
            try:
                response = await self.http.send(self.http.build_request("POST", path, json=body), stream=True)
                held.append(response)
                if response.status_code != 200:
                    await response.aread()
                    raise status_error(response.status_code, response.text, response.headers)
                async for line in response.aiter_lines():
                    if (data := lines.take(line)) is not None:
                        yield self._chunk(data, generate)
            except httpx.HTTPError as exc:
                raise transport_error(exc, self.base_url) or exc from None
            lines.end()
        finally:
            if response is not None:
                await response.aclose()

    def _stream(self, path: str, body: dict[str, Any], sent: list[int], *, is_async: bool, generate: bool = False) -> TimedStream:
        lines = _Lines(self.base_url + path)
        predicted = self.predict_cached_tokens(sent)

        def chunks() -> Iterator[Any]:
            for line in self._lines(path, body):
                if (data := lines.take(line)) is not None:
                    yield self._chunk(data, generate)
            lines.end()

        def finish(ts: TimedStream) -> Measurement:
            return self._measure(lines, ts, sent, predicted)

        if is_async:
            held: list[httpx.Response] = []

            async def abort() -> None:  # close() from another task while one reads
                for response in held:
                    await response.aclose()

            return AsyncTimedStream(self._achunks(path, body, lines, generate, held), started=None, clock=self.clock, content_of=content_of,
                                    finish=finish, abort=abort)
        return TimedStream(chunks(), started=None, clock=self.clock, content_of=content_of, finish=finish)

    def _prompt(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None) -> list[int]:
        return list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))

    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
             **_: Any) -> TimedStream:
        """Stream a chat request (sync client); yields the client's ``ChatResponse`` lines."""
        if self.client_is_async:
            raise InvalidInputError("this backend wraps an ollama.AsyncClient: use asend()")
        body = self.chat_body(messages, params)
        return self._stream("/api/chat", body, self._prompt(messages, params, prompt_tokens), is_async=False)

    async def asend(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                    **_: Any) -> AsyncTimedStream:
        """:meth:`send` for an ``ollama.AsyncClient``: an async stream of ``ChatResponse`` lines."""
        if not self.client_is_async:
            raise InvalidInputError("this backend wraps a sync ollama.Client: use send()")
        body = self.chat_body(messages, params)
        return self._stream("/api/chat", body, self._prompt(messages, params, prompt_tokens), is_async=True)  # type: ignore[return-value]

    # -- calibration probes (trimkit.backends.server) --------------------------------------------------
    def probe_completion(self, text: str, tokens: list[int], *, max_tokens: int = 1, extra: Mapping[str, Any] | None = None) -> Measurement:
        """One raw ``/api/generate`` request (no template), ``num_predict=max_tokens``; sync
        whatever the client. ``extra`` (``ignore_eos``) has no Ollama equivalent and is left out."""
        model = self.model
        if not model:
            raise InvalidInputError("calibrating through Ollama needs the model: wrap(client, model=...)")
        body = {"model": model, "prompt": text, "raw": True, "stream": True, "options": {"num_ctx": self.n_ctx, "num_predict": max_tokens}}
        return self._stream("/api/generate", body, tokens, is_async=False, generate=True).drain()

    def probe_chat(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Measurement:
        options = {"num_predict": params.get("max_tokens", 2), "temperature": params.get("temperature", 0.0)}
        body = self.chat_body(messages, {"options": options})
        return self._stream("/api/chat", body, self._prompt(messages, {}, None), is_async=False).drain()

