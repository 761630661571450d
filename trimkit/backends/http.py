"""Backend for an OpenAI-compatible HTTP endpoint (llama.cpp server, llama-cpp-python's server, vLLM,
SGLang, Ollama's ``/v1``, LM Studio): :class:`OpenAIHTTPBackend`, over ``httpx`` (chunks are plain dicts)
or through the user's ``openai`` client (its own chunks). What it sends is decided here; the server's
facts, probes and evidence are :mod:`~trimkit.backends.server`, the I/O :mod:`~trimkit.backends.transport`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import httpx

from trimkit.backends.base import Clock, Io, Measurement, Steps, TimedStream, client_is_async, is_openai_client, run_async, run_sync
from trimkit.backends.llama_format import chat_format_renderer
from trimkit.backends.replies import as_chat_completion, assemble_chat_completion, parse_completion, parse_server_stats, probe_output
from trimkit.backends.server import (
    ServerBackend,
    ServerEvidence,
    ServerInfo,
    current_key,
    key_of,
    local_prompt_tokenizer,
    probe_server,
    server_prompt_tokenizer,
)
from trimkit.backends.transport import (
    AsyncTimedStream,
    Deadline,
    HTTPTransport,
    RequestLimits,
    StreamState,
    Wait,
    aread_chunks,
    normalize_base_url,
    read_chunks,
    timed_stream,
    url_credentials,
    without_retries,
)
from trimkit.errors import InvalidInputError, ServerError, count
from trimkit.planning.costs import CacheState
from trimkit.planning.profile import ProfileKey
from trimkit.planning.tokens import PromptTokenizer

log = logging.getLogger("trimkit")


@attrs.frozen
class ChatCall:
    """A chat request decided: the prompt as counted (``sent``), its predicted cached prefix, the body,
    whether the usage-only chunk is trimkit's own (``hide_usage``), its deadline and its own headers."""

    sent: list[int]
    predicted: int
    body: dict[str, Any]
    hide_usage: bool
    deadline: Deadline
    headers: Mapping[str, str] = attrs.field(factory=dict)


def _limit(name: str, doc: str) -> property:
    """A setting of the backend's :class:`~trimkit.backends.transport.RequestLimits`, readable and settable on it."""
    return property(lambda self: getattr(self.limits, name), lambda self, value: setattr(self.limits, name, value), doc=doc)


def _off_loop(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a coroutine function that runs it in a worker thread (an I/O step's async side)."""
    return functools.partial(asyncio.to_thread, fn)


class OpenAIHTTPBackend(ServerBackend):
    """An OpenAI-compatible endpoint, for a model served rather than loaded in-process (docs/servers.md).

    ``retry_deadline_s`` bounds the retries of a request before its first chunk; ``deadline_s`` (per call
    or on the instance) bounds every wait before it. ``chat_format`` names the server's chat template
    where it has no ``/apply-template`` (exact counts instead of a ChatML estimate); ``cache_block_tokens``
    the prefix-cache granularity (None: 16 for vLLM, else 1); ``tokenizer`` counts locally, never asking
    the server. ``cache_view`` (settable) replaces :meth:`predict_cached_tokens`' evidence.
    """

    name = "openai_http"
    timeout_s = _limit("timeout_s", "Seconds any one network wait may take.")
    connect_timeout_s = _limit("connect_timeout_s", "Seconds to connect.")
    retry_deadline_s = _limit("retry_deadline_s", "Seconds a request is retried before its first chunk.")
    deadline_s = _limit("deadline_s", "The deadline of calls and side requests that give none (None: waits bounded by timeout_s only).")
    max_attempts = _limit("max_attempts", "Attempts at most per request.")

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None, timeout_s: float = 300.0,
                 connect_timeout_s: float = 5.0, retry_deadline_s: float = 30.0, max_attempts: int = 10, retry_backoff_s: float = 0.1,
                 retry_backoff_max_s: float = 2.0, n_ctx: int | None = None, n_batch: int | None = None, cache_block_tokens: int | None = None,
                 chat_format: str | None = None, headers: Mapping[str, str] | None = None, http_client: httpx.Client | None = None,
                 async_http_client: httpx.AsyncClient | None = None, client: Any = None, clock: Clock = time.perf_counter,
                 tokenizer: PromptTokenizer | None = None) -> None:
        self.base_url, self.root_url = normalize_base_url(base_url)  # without userinfo: it goes in the header below
        self.limits = RequestLimits(timeout_s, connect_timeout_s, retry_deadline_s, max_attempts, retry_backoff_s, retry_backoff_max_s)
        if cache_block_tokens is not None:
            count(cache_block_tokens, "cache_block_tokens", minimum=1)
        if client is not None and not is_openai_client(client):
            raise InvalidInputError("client must look like openai.OpenAI: it needs .chat.completions.create")
        if tokenizer is not None and not isinstance(tokenizer, PromptTokenizer):
            raise InvalidInputError(f"tokenizer must be a trimkit.planning.tokens.PromptTokenizer, got {type(tokenizer).__name__}")
        self.model, self.clock, self.chat_format = model, clock, chat_format
        self._n_ctx_arg, self._n_batch_arg, self._block_arg = n_ctx, n_batch, cache_block_tokens
        self._render_local = chat_format_renderer(chat_format) if chat_format is not None else None
        request_headers = {"Accept": "application/json", **(headers or {})}
        basic = url_credentials(base_url)
        if basic and not any(k.lower() == "authorization" for k in request_headers):
            request_headers["Authorization"] = basic
        if api_key:
            request_headers["Authorization"] = f"Bearer {api_key}"
        self.transport = HTTPTransport(self.base_url, self.root_url, request_headers, self.limits, http_client, async_http_client)
        self.client = client
        self.client_is_async = client is not None and client_is_async(client)
        self.send_client = without_retries(client) if client is not None else None  # trimkit's requests: no nested retries
        self._lock = threading.RLock()
        self._info: ServerInfo | None = None
        self._tokenizer: PromptTokenizer | None = tokenizer
        self._local_tokenizer = tokenizer
        #: replaces :meth:`predict_cached_tokens`' evidence when set (``cache_view(prompt_tokens) -> int``)
        self.cache_view: Callable[[Sequence[int]], int] | None = None
        #: :meth:`cache_state` when ``cache_view`` is set (``cache_state_view() -> CacheState``)
        self.cache_state_view: Callable[[], CacheState] | None = None
        self._include_usage = True  # cleared if the server refuses stream_options
        self.evidence = ServerEvidence(self.base_url, lambda: self.cache_block_tokens, self._counts_exact,
                                       engine=lambda: self._info.engine if self._info is not None else None)

    @classmethod
    def from_openai_client(cls, client: Any, *, model: str | None = None, **kwargs: Any) -> OpenAIHTTPBackend:
        """Wrap an ``openai.OpenAI`` or ``openai.AsyncOpenAI`` client: chat requests go through it; side
        requests (tokenize, server facts, probes) use its ``base_url`` and ``api_key``."""
        base_url = getattr(client, "base_url", None)
        if base_url is None:
            raise InvalidInputError("the client has no base_url; pass OpenAIHTTPBackend(base_url, client=client)")
        kwargs.setdefault("api_key", getattr(client, "api_key", None))
        return cls(str(base_url), model=model, client=client, **kwargs)

    def close(self) -> None:
        self.transport.close()

    async def aclose(self) -> None:
        """:meth:`close`, and the pooled AsyncClient of the running event loop."""
        await self.transport.aclose()

    def __enter__(self) -> OpenAIHTTPBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- server facts ---------------------------------------------------------------------------
    def server_info(self, *, deadline_s: float | None = None) -> ServerInfo:
        """Probe the server once (cached); the first request is retried like a chat request (a server
        still starting) for ``deadline_s`` (default ``retry_deadline_s``)."""
        return self._server_info(self.limits.deadline(deadline_s))

    def _server_info(self, deadline: Deadline) -> ServerInfo:
        with self._lock:
            if self._info is None:
                self._info = probe_server(self.transport.request_json, self.base_url, self.root_url, self.model, deadline)
            return self._info

    @property
    def model_name(self) -> str | None:
        """The model to ask for: the constructor's, else the server's first listed model."""
        ids = () if self.model else self.server_info().model_ids
        return self.model or (ids[0] if ids else None)

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
        return ProfileKey(backend=self.name, model=f"{self.base_url}|{self.model_name}", n_ctx=self.n_ctx,
                          n_batch=self._n_batch_arg or 512,  # servers do not report it
                          engine_version=info.engine_version or info.engine, cpu="remote", extra=f"engine={info.engine}")

    # -- tokens and cache -----------------------------------------------------------------------
    @property
    def tokenizer(self) -> PromptTokenizer:  # type: ignore[override]
        """The server's tokenizer where it has an endpoint for it, else tiktoken; under the server's chat
        template (``/apply-template``) or a ChatML estimate. The name says which."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = server_prompt_tokenizer(self.transport.request_json, self.root_url, self.server_info(), self.model,
                                                          render_local=self._render_local, chat_format=self.chat_format)
            return self._tokenizer

    @functools.cached_property
    def background_tokenizer(self) -> PromptTokenizer:
        """A local count for background work (the ``tokenizer`` given, else tiktoken under the named
        template, else ChatML): it never sends a request, which would cut short a stream on a server
        that interrupts the request in flight when another arrives (``llama_cpp.server``)."""
        if self._local_tokenizer is not None:
            return self._local_tokenizer
        return local_prompt_tokenizer(self._render_local, self.chat_format)

    @property
    def prompt_count_exact(self) -> bool:
        """True when prompt counts are the server's own (tokenizer and template), or an exact ``tokenizer`` was given."""
        if self._local_tokenizer is not None:
            return self._local_tokenizer.exact
        info = self.server_info()
        return info.tokenize_endpoint is not None and (info.apply_template or self._render_local is not None)

    @property
    def token_count_correction(self) -> float:
        """Running ratio of the server's ``usage.prompt_tokens`` to trimkit's count (1.0 until reported)."""
        return self.evidence.correction

    @property
    def prefix_reuse(self) -> bool | None:
        """Whether the server reuses cached prefixes: None while it never reported a cached count."""
        return self.evidence.prefix_reuse

    def _counts_exact(self) -> bool:
        return self._tokenizer is not None and self.prompt_count_exact

    def corrected_count(self, counted_tokens: int) -> int:
        return self.evidence.corrected_count(counted_tokens)

    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """The longest common prefix with the last prompt sent, rounded down to the cache block (0 once the
        server has shown it does not reuse prefixes); ``cache_view``'s prediction when one is set."""
        if self.cache_view is not None:
            return self.cache_view(prompt_tokens)
        return self.evidence.predict_cached_tokens(prompt_tokens, key=self._router_key(current_key.get()))

    def cache_state(self) -> CacheState | None:
        """:meth:`predict_cached_tokens` as data (``cache_state_view``'s with a ``cache_view``; None: not told)."""
        if self.cache_view is not None:
            return self.cache_state_view() if self.cache_state_view is not None else None
        return self.evidence.cache_state(key=self._router_key(current_key.get()))

    def _router_key(self, key: str | None) -> str | None:
        """``key`` where it decides the worker: behind a router (a server alone keeps its cache whatever the key)."""
        return key if key is not None and self._info is not None and self._info.router is not None else None

    # -- requests: the decisions ---------------------------------------------------------------------
    def _known_model(self, params: Mapping[str, Any]) -> str | None:
        """The model to name in a request, without probing (the client form needs one: probe)."""
        if params.get("model") or self.model:
            return params.get("model") or self.model
        if self.client is not None or self._info is not None:
            return self.model_name
        return None  # the URL form may leave it out: single-model servers serve their model

    def _call(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None,
              deadline: Deadline, *, stream: bool, headers: Mapping[str, str] | None = None) -> ChatCall:
        """Count the prompt, predict its cached prefix, build the body (the caller's parameters, the model if
        known, for a stream ``stream_options`` asking for usage unless the caller set it). Probing the
        server, when needed, waits for one still starting within ``deadline``."""
        if not isinstance(params, Mapping):
            raise InvalidInputError(f"params must be a mapping, got {type(params).__name__}")
        if prompt_tokens is None or self._block_arg is None:
            self._server_info(deadline)
        sent = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        body: dict[str, Any] = {"messages": list(messages), **params, "stream": stream}
        if model := self._known_model(params):
            body["model"] = model
        hide = stream and "stream_options" not in params and self._include_usage
        if hide:
            body["stream_options"] = {"include_usage": True}
        elif not stream:
            body.pop("stream_options", None)
        key = self._router_key(key_of(headers))
        if self.cache_view is not None or key is None:
            predicted = self.predict_cached_tokens(sent)
        else:  # behind a router: the worker this key stays on holds the last prompt sent with it, and will hold this one
            predicted = self.evidence.predict_cached_tokens(sent, key=key)
            self.evidence.remember(key, sent)
        return ChatCall(sent, predicted, body, hide, deadline, dict(headers or {}))

    def _request_facts(self, call: ChatCall) -> dict[str, Any]:
        """What ``measurement.server`` says of how a request went: the headers its routing key went in
        (never the key), and the router it went through."""
        facts: dict[str, Any] = {"routing_headers": sorted(call.headers)} if call.headers else {}
        router = self._info.router if self._info is not None else None
        if router is not None:
            facts |= {"router": router.kind, "router_workers": router.workers}
        return facts

    def _opening(self, path: str, body: dict[str, Any], state: StreamState, wait: Wait, client: Any = None,
                 headers: Mapping[str, str] | None = None, *, is_async: bool) -> Steps:
        """The stream opened; a server that refuses ``stream_options`` is asked
        again without (and from now on)."""
        try:
            return (yield from self.transport.open_stream(path, body, wait, client, headers, is_async=is_async))
        except ServerError as exc:
            if "stream_options" not in body or exc.status not in (400, 422) or "stream_options" not in exc.server_message:
                raise
            log.info("trimkit: %s refuses stream_options; streaming without usage", self.base_url)
            self._include_usage = False
            state.hide_usage_chunk = False
            del body["stream_options"]
            return (yield from self.transport.open_stream(path, body, wait, client, headers, is_async=is_async))

    def _check_form(self, is_async: bool) -> None:
        if self.client is not None and self.client_is_async != is_async:
            raise InvalidInputError(f"this backend wraps a{'n async' if self.client_is_async else ' sync'} client: "
                                    f"use {'asend()/acomplete()' if self.client_is_async else 'send()/complete()'}")

    def as_client_response(self, response: dict[str, Any]) -> Any:
        """An assembled ``chat.completion`` dict as the wrapped client's ``ChatCompletion`` (the dict for the URL form)."""
        return response if self.client is None else as_chat_completion(response)

    # -- requests ---------------------------------------------------------------------------------------
    def _stream(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None,
                retry_deadline_s: float | None, *, deadline_s: float | None = None, collect: bool = False, is_async: bool = False,
                via_url: bool = False, probe: bool = False, headers: Mapping[str, str] | None = None) -> tuple[Any, StreamState]:
        """``via_url``: a sync request over ``httpx`` whatever client is wrapped (calibration probes run
        synchronously); ``probe``: never bounded by a deadline (a long probe is meant to take long)."""
        if not via_url:
            self._check_form(is_async)
        call = self._call(messages, params, prompt_tokens, self.limits.deadline(retry_deadline_s, deadline_s, unbounded=probe), stream=True,
                          headers=headers)
        state = StreamState(self.base_url, hide_usage_chunk=call.hide_usage, chunks=[] if collect else None, deadline=call.deadline)
        measure = self.evidence.stream_measure(call.sent, call.predicted, self._request_facts(call))
        chunks = self._chunks("/chat/completions", call.body, state, call.deadline, self.send_client if not via_url else None, call.headers,
                              is_async=is_async)
        return timed_stream(chunks, state, self.clock, measure, cls=AsyncTimedStream if is_async else TimedStream), state

    def _chunks(self, path: str, body: dict[str, Any], state: StreamState, deadline: Deadline, client: Any = None,
                headers: Mapping[str, str] | None = None, *, is_async: bool = False) -> Any:
        """The chunks of a stream, opened (retried) on the first step; async: ONE async generator, which closes its response itself
        (:func:`aread_chunks`), over the loop's pooled client."""

        def opening() -> Steps:
            return self.transport.retried(lambda wait: self._opening(path, body, state, wait, client, headers, is_async=is_async), deadline, self.base_url)

        return (aread_chunks if is_async else read_chunks)(opening, state)

    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
             retry_deadline_s: float | None = None, deadline_s: float | None = None, watch: Any = None,
             headers: Mapping[str, str] | None = None) -> TimedStream:
        """Stream a chat request: it goes out on the first ``next()`` and is retried on transient failures
        until ``retry_deadline_s``, never after the first chunk; ``deadline_s`` bounds every wait before
        it. Yields dicts (URL form) or the client's chunks, never the usage-only chunk trimkit asked for.
        ``watch``: the driver of a watched prefill (:attr:`evaluate_to`); ``headers``: this request's own."""
        if watch is not None:
            return self._watched_stream(messages, params, prompt_tokens, retry_deadline_s, deadline_s, watch, headers)
        return self._stream(messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s, headers=headers)[0]

    async def asend(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                    retry_deadline_s: float | None = None, deadline_s: float | None = None, headers: Mapping[str, str] | None = None) -> AsyncTimedStream:
        """:meth:`send` for asyncio, through the wrapped async client, the ``async_http_client`` given, or
        one pooled ``httpx.AsyncClient`` per event loop; side requests run in a worker thread."""
        return (await asyncio.to_thread(self._stream, messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s, is_async=True,
                                        headers=headers))[0]

    # -- the watched prefill over llama-server (trimkit.pipeline.WatchedPrefill) ----------------------
    @property
    def evaluate_to(self) -> Callable[[Sequence[int], int], tuple[float, int]] | None:
        """One step of a watched prefill: a ``/completion`` of ``tokens[:end]`` with ``n_predict: 0``, which
        the slot then holds; (seconds, ``timings.cache_n``). Only for llama.cpp's ``llama-server`` with exact
        counts and a sync client, not behind a router (the steps and the chat request could reach two workers)."""
        info = self.server_info()
        if info.router is not None or info.engine != "llama.cpp" or not info.engine_version.startswith("llama.cpp ") or self.client_is_async or not self.prompt_count_exact:
            return None
        return self._evaluate_step

    def _evaluate_step(self, tokens: Sequence[int], end: int, deadline: Deadline | None = None) -> tuple[float, int]:
        body = {"prompt": [int(t) for t in tokens[:end]], "n_predict": 0, "cache_prompt": True}
        started = self.clock()
        reply = self.transport.request_json("POST", self.root_url + "/completion", body, deadline=deadline or self.limits.deadline())
        seconds = self.clock() - started
        stats = parse_server_stats(reply, strict=True)
        with self.evidence.lock:  # what the slot holds now: the cache predictions of a re-plan start from it
            self.evidence.last_prompt = [int(t) for t in tokens[:end]]
        return seconds, min(stats.cached_tokens or 0, end)

    def _watched_stream(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None,
                        retry_deadline_s: float | None, deadline_s: float | None, watch: Any, headers: Mapping[str, str] | None = None) -> TimedStream:
        """:meth:`send` with the prompt prefilled in steps first (the TTFT clock runs from the first step);
        the chat request that follows names what the watch returned."""
        deadline = self.limits.deadline(retry_deadline_s, deadline_s)
        state = StreamState(self.base_url, deadline=deadline)
        decided: dict[str, ChatCall] = {}

        def chunks() -> Iterator[Any]:
            planned = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
            to_send, tokens = watch(functools.partial(self._evaluate_step, deadline=deadline), self.clock, self.predict_cached_tokens(planned))
            call = self._call(to_send, params, tokens, deadline, stream=True, headers=headers)
            # the steps left the whole prompt in the slot: all of it but the token llama.cpp re-evaluates
            call = decided["call"] = attrs.evolve(call, predicted=max(len(call.sent) - 1, 0))
            state.hide_usage_chunk = call.hide_usage
            yield from self._chunks("/chat/completions", call.body, state, call.deadline, self.send_client, call.headers)

        def measure(state: StreamState, ts: TimedStream) -> Measurement:
            call = decided["call"]
            return self.evidence.stream_measure(call.sent, call.predicted, self._request_facts(call))(state, ts)

        return timed_stream(chunks(), state, self.clock, measure)

    # -- non-streamed answers ---------------------------------------------------------------------------
    def complete(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                 measure_ttft: bool = True, retry_deadline_s: float | None = None, deadline_s: float | None = None,
                 headers: Mapping[str, str] | None = None) -> tuple[Any, Measurement]:
        """A non-streaming chat request: ``(response, measurement)``, a ``chat.completion`` dict (URL form)
        or the client's ``ChatCompletion``. With ``measure_ttft`` it is streamed and assembled (TTFT
        measured); else sent with ``stream=False``: the server's numbers only, ``deadline_s`` (if given)
        bounding the whole answer."""
        return run_sync(self._complete(messages, params, prompt_tokens, measure_ttft, retry_deadline_s, deadline_s, headers, is_async=False))

    async def acomplete(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                        measure_ttft: bool = True, retry_deadline_s: float | None = None, deadline_s: float | None = None,
                        headers: Mapping[str, str] | None = None) -> tuple[Any, Measurement]:
        """Async :meth:`complete`."""
        return await run_async(self._complete(messages, params, prompt_tokens, measure_ttft, retry_deadline_s, deadline_s, headers, is_async=True))

    def _complete(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None, measure_ttft: bool,
                  retry_deadline_s: float | None, deadline_s: float | None, headers: Mapping[str, str] | None, *, is_async: bool) -> Steps:
        """:meth:`complete` as I/O steps: a stream assembled, or one ``stream=False`` request, retried (the URL form's I/O off the event loop)."""
        if measure_ttft:
            ts, state = yield Io(self._stream, _off_loop(self._stream), messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s,
                                 collect=True, is_async=is_async, headers=headers)
            m = yield Io(TimedStream.drain, AsyncTimedStream.adrain, ts)
            return self.as_client_response(assemble_chat_completion(state.chunks or [], state.stats_reply)), m
        self._check_form(is_async)
        call = yield Io(self._call, _off_loop(self._call), messages, params, prompt_tokens, self.limits.deadline(retry_deadline_s, deadline_s),
                        stream=False, headers=headers)
        url = self.base_url + "/chat/completions"

        def attempt(wait: Wait) -> Steps:
            if self.client is None:
                once = self.transport.request_json_once
                return (yield Io(once, _off_loop(once), "POST", url, call.body, wait=wait, headers=call.headers))
            return (yield Io(self.transport.create, self.transport.acreate, self.send_client, call.body, wait, url, call.headers))

        # bounded only by a deadline_s given for this call: the first byte of a whole answer comes after all of it
        deadline = self.limits.deadline(retry_deadline_s, deadline_s, unbounded=deadline_s is None)
        start = self.clock()
        response = yield from self.transport.retried(attempt, deadline, url)
        reply = parse_completion(response)  # the server's numbers only, no TTFT
        facts = {"model": reply.model} if reply.model else {}
        return response, self.evidence.timed_measure(reply.stats, None, call.sent, call.predicted, reply.finish_reason, total_s=self.clock() - start,
                                                     server=facts | self._request_facts(call))

    # -- calibration probes (trimkit.backends.server) ----------------------------------------------------
    def probe_completion(self, text: str, tokens: list[int], *, max_tokens: int = 1, extra: Mapping[str, Any] | None = None) -> Measurement:
        body: dict[str, Any] = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, **(extra or {})}
        if model := self._known_model({}):
            body["model"] = model
        if self._include_usage:
            body["stream_options"] = {"include_usage": True}
        state = StreamState(self.base_url, hide_usage_chunk=self._include_usage)
        predicted = self.predict_cached_tokens(tokens)
        chunks = self._chunks("/completions", body, state, self.limits.deadline(unbounded=True))
        return timed_stream(chunks, state, self.clock, self.evidence.stream_measure(tokens, predicted), output_of=probe_output).drain()

    def probe_chat(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Measurement:
        """Over httpx when the client is async (a probe runs synchronously)."""
        return self._stream(messages, params, None, None, via_url=self.client_is_async, probe=True)[0].drain()
