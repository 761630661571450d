"""Backend for an OpenAI-compatible HTTP endpoint (llama.cpp server, llama-cpp-python's server,
vLLM, SGLang, Ollama's ``/v1``, LM Studio): :class:`OpenAIHTTPBackend`, over ``httpx`` (chunks
are plain dicts shaped like OpenAI's) or through the user's ``openai`` client (its own chunks).

The class is thin: the server's facts, probes and evidence are :mod:`~trimkit.backends.server`;
the I/O, retries and deadlines :mod:`~trimkit.backends.transport`; the parsers
:mod:`~trimkit.backends.replies`. What it sends is decided here, without I/O (:class:`ChatCall`,
:func:`chat_body`, :func:`probe_body`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import httpx

from trimkit.backends.base import Backend, Clock, Measurement, Steps, TimedStream, client_is_async, is_openai_client, run_async, run_sync
from trimkit.backends.llama_format import chat_format_renderer
from trimkit.backends.replies import as_chat_completion, assemble_chat_completion, parse_completion, parse_server_stats, probe_output
from trimkit.backends.server import (
    DelegatedProbes,
    ServerEvidence,
    ServerInfo,
    ServerProbes,
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
    Opened,
    RequestLimits,
    StreamState,
    Wait,
    aread_chunks,
    awith_retries,
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


# == what is sent, decided without I/O =======================================================================

_USAGE = {"include_usage": True}


@attrs.frozen
class ChatCall:
    """A chat request decided: the prompt as counted (``sent``), its predicted cached prefix,
    the body, whether the usage-only chunk is trimkit's own (``hide_usage``), and how long its
    first chunk may take."""

    sent: list[int]
    predicted: int
    body: dict[str, Any]
    hide_usage: bool
    deadline: Deadline
    #: headers of this request only (a routing key: :mod:`trimkit.backends.server`)
    headers: Mapping[str, str] = attrs.field(factory=dict)


def chat_body(messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], model: str | None, *, stream: bool,
              include_usage: bool) -> tuple[dict[str, Any], bool]:
    """``(body, hide_usage)``: the caller's parameters as given, the model if known, and for a
    stream ``stream_options`` asking for usage (unless the caller set it or the server refuses
    it): then the usage-only chunk is trimkit's, not to be handed on."""
    body: dict[str, Any] = {"messages": list(messages), **params, "stream": stream}
    if model:
        body["model"] = model
    hide = stream and "stream_options" not in params and include_usage
    if hide:
        body["stream_options"] = dict(_USAGE)
    elif not stream:
        body.pop("stream_options", None)
    return body, hide


def probe_body(text: str, model: str | None, *, max_tokens: int, include_usage: bool, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A streamed ``/v1/completions`` calibration probe: raw prompt text, greedy."""
    body: dict[str, Any] = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, **(extra or {})}
    if model:
        body["model"] = model
    if include_usage:
        body["stream_options"] = dict(_USAGE)
    return body


# == the backend =============================================================================================

def _limit(name: str, doc: str) -> property:
    """A setting of the backend's :class:`~trimkit.backends.transport.RequestLimits`, readable
    and settable on the backend."""
    return property(lambda self: getattr(self.limits, name), lambda self, value: setattr(self.limits, name, value), doc=doc)


class OpenAIHTTPBackend(DelegatedProbes, Backend):
    """An OpenAI-compatible endpoint. Use when the model is served by llama.cpp server, vLLM,
    SGLang, Ollama or llama-cpp-python's server rather than loaded in-process.

    ``retry_deadline_s`` bounds the total time spent retrying a request that has not yet
    produced a chunk (set it from the TTFT budget); it can be changed on the instance or per
    call. ``deadline_s`` (per call, or on the instance for calls and side requests that give
    none) bounds every wait before the first chunk as well (:mod:`trimkit.backends.transport`).
    ``chat_format`` names the server's chat template (a llama-cpp-python format name such as
    ``"gemma"``, or a Jinja template) when the server has no ``/apply-template`` endpoint, so
    prompt counts are exact instead of a ChatML estimate. ``cache_block_tokens`` is the engine's
    prefix-cache granularity: ``None`` picks 16 for vLLM (its KV block size) and 1 elsewhere.
    ``tokenizer`` (a :class:`~trimkit.planning.tokens.PromptTokenizer`) counts locally, never asking the
    server (``llama_prompt_tokenizer(Llama(path, vocab_only=True))``: exact, and llama-cpp-python's
    server takes its model lock for a tokenize). ``cache_view`` (settable, see :meth:`predict_cached_tokens`).
    """

    name = "openai_http"
    #: a depth probe sends its prefix first, then prefix + new tokens (ServerProbes.measure_prefill)
    depth_probe_keeps_prefix = False
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
        self.model = model
        self.clock = clock
        self._n_ctx_arg, self._n_batch_arg, self._block_arg = n_ctx, n_batch, cache_block_tokens
        self.chat_format = chat_format
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
        if tokenizer is not None and not isinstance(tokenizer, PromptTokenizer):
            raise InvalidInputError(f"tokenizer must be a trimkit.planning.tokens.PromptTokenizer, got {type(tokenizer).__name__}")
        self._tokenizer: PromptTokenizer | None = tokenizer
        self._local_tokenizer = tokenizer
        #: replaces :meth:`predict_cached_tokens`' evidence when set (``cache_view(prompt_tokens) -> int``)
        self.cache_view: Callable[[Sequence[int]], int] | None = None
        #: :meth:`cache_state` when ``cache_view`` is set (``cache_state_view() -> CacheState``)
        self.cache_state_view: Callable[[], CacheState] | None = None
        self._include_usage = True  # cleared if the server refuses stream_options
        self.evidence = ServerEvidence(self.base_url, lambda: self.cache_block_tokens, self._counts_exact,
                                       engine=lambda: self._info.engine if self._info is not None else None)
        self.probes = ServerProbes(self)

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
        """Probe the server once (``/v1/models``, ``/props``, ``/version``, tokenizer endpoints);
        cached. The first request is retried like a chat request (a server still starting),
        for ``deadline_s`` (default ``retry_deadline_s``). A reply of the wrong shape raises
        :class:`~trimkit.errors.MalformedReplyError`."""
        return self._server_info(self.limits.deadline(deadline_s))

    def _server_info(self, deadline: Deadline) -> ServerInfo:
        with self._lock:
            if self._info is None:
                self._info = probe_server(self.transport.request_json, self.base_url, self.root_url, self.model, deadline)
            return self._info

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
        return ProfileKey(backend=self.name, model=f"{self.base_url}|{self.model_name}", n_ctx=self.n_ctx,
                          n_batch=self._n_batch_arg or 512,  # servers do not report it
                          engine_version=info.engine_version or info.engine, cpu="remote", extra=f"engine={info.engine}")

    # -- tokens and cache -----------------------------------------------------------------------
    @property
    def tokenizer(self) -> PromptTokenizer:  # type: ignore[override]
        """The server's tokenizer where it has an endpoint for it (``exact``), else tiktoken.
        The chat template is the server's (``/apply-template``) or a ChatML estimate; the name says which."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = server_prompt_tokenizer(self.transport.request_json, self.root_url, self.server_info(), self.model,
                                                          render_local=self._render_local, chat_format=self.chat_format)
            return self._tokenizer

    @functools.cached_property
    def background_tokenizer(self) -> PromptTokenizer:
        """A local count for background work (tiktoken with the named chat template, else a
        ChatML estimate): it never sends a request, so it cannot cut a stream short on a server
        that interrupts the request in flight when another arrives (``llama_cpp.server``).
        Made once, so its count cache serves every background job. A ``tokenizer`` given is local: it is used."""
        if self._local_tokenizer is not None:
            return self._local_tokenizer
        return local_prompt_tokenizer(self._render_local, self.chat_format)

    @property
    def prompt_count_exact(self) -> bool:
        """True when prompt token counts are the server's own (tokenizer and chat template), or
        an exact ``tokenizer`` was given."""
        if self._local_tokenizer is not None:
            return self._local_tokenizer.exact
        info = self.server_info()
        return info.tokenize_endpoint is not None and (info.apply_template or self._render_local is not None)

    @property
    def token_count_correction(self) -> float:
        """Running ratio of the server's ``usage.prompt_tokens`` to trimkit's count (1.0 until
        the server reports one). Multiply an estimated count by it."""
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
        """The longest common prefix with the last prompt sent, rounded down to the engine's
        cache block, leaving at least one token to evaluate; 0 once the server has shown it does
        not reuse prefixes (:class:`~trimkit.backends.server.ServerEvidence`); ``cache_view``'s
        prediction when one is set."""
        if self.cache_view is not None:
            return self.cache_view(prompt_tokens)
        return self.evidence.predict_cached_tokens(prompt_tokens, key=self._router_key(current_key.get()))

    def cache_state(self) -> CacheState | None:
        """:meth:`predict_cached_tokens` as data: ``cache_state_view``'s when set (with a
        ``cache_view``; None: not told), else the evidence's."""
        if self.cache_view is not None:
            return self.cache_state_view() if self.cache_state_view is not None else None
        return self.evidence.cache_state(key=self._router_key(current_key.get()))

    def _router_key(self, key: str | None) -> str | None:
        """``key`` where it decides the worker: behind a recognised router (a server alone keeps
        its cache whatever key a request carries)."""
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
        """Count the prompt, predict its cached prefix and build the body. Probing the server,
        when needed (tokenizer, cache block), waits for a server still starting, within ``deadline``.
        ``headers``: the request's own (a routing key, :mod:`trimkit.backends.server`)."""
        if not isinstance(params, Mapping):
            raise InvalidInputError(f"params must be a mapping, got {type(params).__name__}")
        if prompt_tokens is None or self._block_arg is None:
            self._server_info(deadline)
        sent = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        body, hide = chat_body(messages, params, self._known_model(params), stream=stream, include_usage=self._include_usage)
        key = self._router_key(key_of(headers))
        if self.cache_view is not None or key is None:
            predicted = self.predict_cached_tokens(sent)
        else:  # behind a router: the worker this key stays on holds the last prompt sent with it, and will hold this one
            predicted = self.evidence.predict_cached_tokens(sent, key=key)
            self.evidence.remember(key, sent)
        return ChatCall(sent, predicted, body, hide, deadline, dict(headers or {}))

    def _request_facts(self, call: ChatCall) -> dict[str, Any]:
        """What the report's ``measurement.server`` says of how a request went: the headers its
        routing key went in (never the key), and the router it went through (``router``, ``router_workers``)."""
        facts: dict[str, Any] = {}
        if call.headers:
            facts["routing_headers"] = sorted(call.headers)
        router = self._info.router if self._info is not None else None
        if router is not None:
            facts |= {"router": router.kind, "router_workers": router.workers}
        return facts

    def _opening(self, path: str, body: dict[str, Any], state: StreamState, wait: Wait, client: Any = None,
                 headers: Mapping[str, str] | None = None, **how: Any) -> Steps:
        """The stream opened (:meth:`~trimkit.backends.transport.HTTPTransport.open_stream`, ``how``
        async or not); a server that refuses ``stream_options`` is asked again without (and from now on)."""
        try:
            return (yield from self.transport.open_stream(path, body, wait, client, headers, **how))
        except ServerError as exc:
            if "stream_options" not in body or exc.status not in (400, 422) or "stream_options" not in exc.server_message:
                raise
            log.info("trimkit: %s refuses stream_options; streaming without usage", self.base_url)
            self._include_usage = False
            state.hide_usage_chunk = False
            del body["stream_options"]
            return (yield from self.transport.open_stream(path, body, wait, client, headers, **how))

    def _check_form(self, is_async: bool) -> None:
        if self.client is not None and self.client_is_async != is_async:
            raise InvalidInputError(f"this backend wraps a{'n async' if self.client_is_async else ' sync'} client: "
                                    f"use {'asend()/acomplete()' if self.client_is_async else 'send()/complete()'}")

    def as_client_response(self, response: dict[str, Any]) -> Any:
        """An assembled ``chat.completion`` dict as the wrapped client's own ``ChatCompletion``
        type (the dict itself for the URL form)."""
        return response if self.client is None else as_chat_completion(response)

    # -- requests: sync -------------------------------------------------------------------------------
    def _stream(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], prompt_tokens: Sequence[int] | None,
                retry_deadline_s: float | None, *, deadline_s: float | None = None, collect: bool = False, is_async: bool = False,
                via_url: bool = False, probe: bool = False, headers: Mapping[str, str] | None = None) -> tuple[Any, StreamState]:
        """``via_url``: a sync request over ``httpx`` even when an (async) client is wrapped —
        for calibration probes, which run synchronously whatever the client. ``probe``: a
        calibration probe, never bounded by a deadline (a long probe is meant to take long)."""
        if not via_url:
            self._check_form(is_async)
        call = self._call(messages, params, prompt_tokens, self.limits.deadline(retry_deadline_s, deadline_s, unbounded=probe), stream=True,
                          headers=headers)
        state = StreamState(self.base_url, hide_usage_chunk=call.hide_usage, chunks=[] if collect else None, deadline=call.deadline)
        measure = _with_facts(self.evidence.stream_measure(call.sent, call.predicted), self._request_facts(call))
        if is_async:
            return timed_stream(self._achunks(call, state), state, self.clock, measure, cls=AsyncTimedStream), state
        client = self.send_client if not via_url else None
        chunks = read_chunks(lambda: self._open("/chat/completions", call.body, state, call.deadline, client, call.headers), state)
        return timed_stream(chunks, state, self.clock, measure), state

    def _open(self, path: str, body: dict[str, Any], state: StreamState, deadline: Deadline, client: Any = None,
              headers: Mapping[str, str] | None = None) -> Opened:
        def attempt(wait: Wait) -> Opened:
            return run_sync(self._opening(path, body, state, wait, client, headers))

        return self.transport.retried(attempt, deadline, self.base_url)

    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
             retry_deadline_s: float | None = None, deadline_s: float | None = None, watch: Any = None,
             headers: Mapping[str, str] | None = None) -> TimedStream:
        """Stream a chat request. It goes out on the first ``next()`` (when the TTFT clock starts) and
        is retried on transient failures until ``retry_deadline_s``, never after the first chunk;
        ``deadline_s`` (else the instance's) bounds every wait before the first chunk
        (ServerTimeoutError). Yields plain dicts (URL form) or the client's own chunks, never the
        usage-only chunk trimkit asked for. ``watch``: the driver of a watched prefill
        (:attr:`evaluate_to`); ``headers``: this request's own (a routing key)."""
        if watch is not None:
            return self._watched_stream(messages, params, prompt_tokens, retry_deadline_s, deadline_s, watch, headers)
        return self._stream(messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s, headers=headers)[0]

    # -- the watched prefill over llama-server (trimkit.pipeline.WatchedPrefill) ----------------------
    @property
    def evaluate_to(self) -> Callable[[Sequence[int], int], tuple[float, int]] | None:
        """One step of a watched prefill: a ``/completion`` of ``tokens[:end]`` with ``n_predict: 0``
        makes the slot hold them; it returns (seconds, where evaluation started: ``timings.cache_n``).
        Only for llama.cpp's own ``llama-server`` (``/props`` names its build) with exact counts, so
        the steps are the prompt the chat request renders, and a sync client; None elsewhere — and
        behind a router, whose workers the steps and the chat request could reach apart."""
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
        """:meth:`send` with the prompt prefilled in steps first (the TTFT clock runs from the
        first step): the chat request that follows names what the watch returned."""
        deadline = self.limits.deadline(retry_deadline_s, deadline_s)
        state = StreamState(self.base_url, deadline=deadline)
        decided: dict[str, ChatCall] = {}

        def step(tokens: Sequence[int], end: int) -> tuple[float, int]:
            return self._evaluate_step(tokens, end, deadline)

        def chunks() -> Iterator[Any]:
            planned = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
            to_send, tokens = watch(step, self.clock, self.predict_cached_tokens(planned))
            call = self._call(to_send, params, tokens, deadline, stream=True, headers=headers)
            # the steps left the whole prompt in the slot: all of it but the token llama.cpp re-evaluates
            call = attrs.evolve(call, predicted=max(len(call.sent) - 1, 0))
            decided["call"] = call
            state.hide_usage_chunk = call.hide_usage
            yield from read_chunks(lambda: self._open("/chat/completions", call.body, state, call.deadline, self.send_client, call.headers), state)

        def measure(state: StreamState, ts: TimedStream) -> Measurement:
            call = decided["call"]
            return _with_facts(self.evidence.stream_measure(call.sent, call.predicted), self._request_facts(call))(state, ts)

        return timed_stream(chunks(), state, self.clock, measure)

    def complete(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                 measure_ttft: bool = True, retry_deadline_s: float | None = None, deadline_s: float | None = None,
                 headers: Mapping[str, str] | None = None) -> tuple[Any, Measurement]:
        """A non-streaming chat request: ``(response, measurement)``, the response a ``chat.completion``
        dict (URL form) or the client's own ``ChatCompletion``. With ``measure_ttft`` (default) it is
        streamed and assembled, so TTFT is measured (``usage`` is what the stream reported). With
        ``measure_ttft=False`` it is sent with ``stream=False``: only the server's numbers, and
        ``deadline_s`` (only if given) bounds the whole answer, decode included."""
        if measure_ttft:
            ts, state = self._stream(messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s, collect=True, headers=headers)
            m = ts.drain()
            return self._assembled(state), m
        if self.client_is_async:
            raise InvalidInputError("this backend wraps an async client: use acomplete()")
        call = self._call(messages, params, prompt_tokens, self.limits.deadline(retry_deadline_s, deadline_s), stream=False, headers=headers)
        url = self.base_url + "/chat/completions"

        def attempt(wait: Wait) -> Any:
            if self.client is None:
                return self.transport.request_json_once("POST", url, call.body, wait=wait, headers=call.headers)
            return self.transport.create(self.send_client, call.body, wait, url, call.headers)

        start = self.clock()
        response = self.transport.retried(attempt, self.limits.whole_answer_deadline(retry_deadline_s, deadline_s), url)
        m = self.evidence.whole_measure(parse_completion(response), self.clock() - start, call.sent, call.predicted)
        return response, _facts_added(m, self._request_facts(call))

    def _assembled(self, state: StreamState) -> Any:
        return self.as_client_response(assemble_chat_completion(state.chunks or [], state.stats_reply))

    # -- requests: async --------------------------------------------------------------------------------
    def _achunks(self, call: ChatCall, state: StreamState) -> AsyncIterator[Any]:
        """The chunks of an async stream: ONE async generator, which closes its response itself
        (:func:`~trimkit.backends.transport.aread_chunks` says why)."""

        async def open_() -> Opened:
            http = self.transport.stream_client(needed=self.send_client is None)  # on the loop: its pooled client

            async def attempt(wait: Wait) -> Opened:
                return await run_async(self._opening("/chat/completions", call.body, state, wait, self.send_client, call.headers, http=http,
                                                     is_async=True))

            return await awith_retries(attempt, call.deadline, self.base_url, self.limits)

        return aread_chunks(open_, state)

    async def asend(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                    retry_deadline_s: float | None = None, deadline_s: float | None = None, headers: Mapping[str, str] | None = None) -> AsyncTimedStream:
        """:meth:`send` for asyncio, through the wrapped ``openai.AsyncOpenAI`` client, the
        ``async_http_client`` given, or one pooled ``httpx.AsyncClient`` per event loop (an
        AsyncClient is bound to its loop; ``aclose`` closes it). Side requests (tokenize, server facts) run in a worker thread."""
        return (await asyncio.to_thread(self._stream, messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s, is_async=True,
                                        headers=headers))[0]

    async def acomplete(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
                        measure_ttft: bool = True, retry_deadline_s: float | None = None, deadline_s: float | None = None,
                        headers: Mapping[str, str] | None = None) -> tuple[Any, Measurement]:
        """Async :meth:`complete`: streamed and assembled so TTFT is measured, or with
        ``measure_ttft=False`` one ``stream=False`` request (server numbers only)."""
        if measure_ttft:
            ts, state = await asyncio.to_thread(self._stream, messages, params, prompt_tokens, retry_deadline_s, deadline_s=deadline_s,
                                                collect=True, is_async=True, headers=headers)
            m = await ts.adrain()
            return self._assembled(state), m
        if self.client is not None and not self.client_is_async:
            raise InvalidInputError("this backend wraps a sync client: use complete()")
        call = await asyncio.to_thread(self._call, messages, params, prompt_tokens, self.limits.deadline(retry_deadline_s, deadline_s), stream=False,
                                       headers=headers)
        url = self.base_url + "/chat/completions"

        async def attempt(wait: Wait) -> Any:
            if self.client is None:  # the URL form: the pooled sync client, off the event loop
                return await asyncio.to_thread(self.transport.request_json_once, "POST", url, call.body, wait=wait, headers=call.headers)
            return await self.transport.acreate(self.send_client, call.body, wait, url, call.headers)

        start = self.clock()
        response = await awith_retries(attempt, self.limits.whole_answer_deadline(retry_deadline_s, deadline_s), url, self.limits)
        m = self.evidence.whole_measure(parse_completion(response), self.clock() - start, call.sent, call.predicted)
        return response, _facts_added(m, self._request_facts(call))

    # -- calibration probes (trimkit.backends.server) ----------------------------------------------------
    def probe_completion(self, text: str, tokens: list[int], *, max_tokens: int = 1, extra: Mapping[str, Any] | None = None) -> Measurement:
        """One streamed ``/v1/completions`` request with raw prompt text, never bounded by a
        deadline (a long probe is meant to take long); TTFT at the first chunk."""
        body = probe_body(text, self._known_model({}), max_tokens=max_tokens, include_usage=self._include_usage, extra=extra)
        state = StreamState(self.base_url, hide_usage_chunk=self._include_usage)
        predicted = self.predict_cached_tokens(tokens)
        chunks = read_chunks(lambda: self._open("/completions", body, state, self.limits.deadline(unbounded=True)), state)
        measure = self.evidence.stream_measure(tokens, predicted)
        return timed_stream(chunks, state, self.clock, measure, output_of=probe_output).drain()

    def probe_chat(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Measurement:
        """A short chat request as a calibration probe: over httpx when the client is async
        (a probe runs synchronously), never bounded by a deadline."""
        return self._stream(messages, params, None, None, via_url=self.client_is_async, probe=True)[0].drain()


def _facts_added(m: Measurement, facts: Mapping[str, Any]) -> Measurement:
    return attrs.evolve(m, server={**m.server, **facts}) if facts else m


def _with_facts(measure: Callable[[StreamState, TimedStream], Measurement], facts: Mapping[str, Any]) -> Callable[[StreamState, TimedStream], Measurement]:
    """``measure`` whose measurement's ``server`` also holds ``facts``."""
    if not facts:
        return measure
    return lambda state, ts: _facts_added(measure(state, ts), facts)
