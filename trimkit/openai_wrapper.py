"""The OpenAI-client front-end: a TTFT budget on a model behind an OpenAI-compatible server.

:class:`TrimmedOpenAI` and :class:`AsyncTrimmedOpenAI` are drop-ins for ``openai.OpenAI`` and ``openai.AsyncOpenAI`` (``create`` also takes ``rag_chunks=``,
``ttft_budget_s=``, ``on_busy=``, ``routing_key=``); :func:`wrap_one_url` gives the same API over plain ``httpx``. Usage: docs/servers.md.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trimkit.backends.base import Io, Measurement, Steps, client_is_async, is_openai_client, run_async, run_sync
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.replies import SOURCE_CLIENT, assemble_chat_completion
from trimkit.backends.server import NOT_GIVEN, RoutingOptions, check_routing_key, planning_for, routing_headers
from trimkit.errors import InvalidInputError, InvalidMessageError, positive_finite
from trimkit.frontend import AsyncClosing, AsyncReportingStream, Closing, FrontEnd, ReportingStream, StreamReporter, adrain, drain, send_params, usage_counts
from trimkit.messages import validate_messages
from trimkit.pipeline import Pipeline, Prepared

__all__ = ["TrimmedOpenAI", "AsyncTrimmedOpenAI", "OpenAIFrontEnd", "Send", "ClientChat", "ReportingOpenAIStream", "AsyncReportingStream",
           "wrap_openai", "retry_deadline_for", "BACKEND_KWARGS", "MIN_RETRY_DEADLINE_S", "call_arguments", "max_tokens_note", "router_note",
           "split_backend_kwargs"]

#: what ``create(stream=True)`` returns on an OpenAI-style wrapper
ReportingOpenAIStream = ReportingStream
#: the retry deadline never drops below this, however tight the budget
MIN_RETRY_DEADLINE_S = 5.0


def retry_deadline_for(ttft_budget_s: float | None, default_s: float) -> float:
    """How long a request without its first chunk is retried, and with a budget the call's deadline for every wait before it: ``max(2 × budget, 5 s)``, else
    ``default_s``. Once the first token is later than twice the budget the answer has failed its purpose, but a tight budget must not turn a dropped
    keep-alive connection or a brief 503 into an error."""
    if ttft_budget_s is None:
        return default_s
    return max(2.0 * ttft_budget_s, MIN_RETRY_DEADLINE_S)


@attrs.frozen
class CallDeadlines:
    """A wrapper's deadlines: ``unbudgeted_s`` retries a call without a budget; ``fixed_s``, if set, every call."""

    unbudgeted_s: float
    fixed_s: float | None = None

    def retry_s(self, ttft_budget_s: float | None) -> float:
        return self.fixed_s if self.fixed_s is not None else retry_deadline_for(ttft_budget_s, self.unbudgeted_s)

    def first_chunk_s(self, ttft_budget_s: float | None) -> float | None:
        """The deadline of every wait before the first chunk (None without a budget: the backend's ``timeout_s``)."""
        return self.retry_s(ttft_budget_s) if ttft_budget_s is not None else None

    def whole_answer_s(self, ttft_budget_s: float | None, params: Mapping[str, Any], decode_tokens_per_s: Any) -> float | None:
        """The deadline of a request sent whole (``n > 1``): the first chunk's plus twice the
        decode of ``n × max_tokens``; None without a budget, ``max_tokens`` or a decode speed."""
        base = self.first_chunk_s(ttft_budget_s)
        max_tokens = params.get("max_completion_tokens") or params.get("max_tokens")
        n, speed = params.get("n") or 1, decode_tokens_per_s
        if base is None or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (max_tokens, n)):
            return None
        if not isinstance(speed, (int, float)) or not math.isfinite(speed) or speed <= 0:
            return None
        return base + 2.0 * n * max_tokens / speed  # type: ignore[operator]


#: keyword arguments of the wrappers that configure the HTTP backend, not the pipeline
BACKEND_KWARGS = ("model", "n_ctx", "n_batch", "cache_block_tokens", "chat_format", "timeout_s", "connect_timeout_s", "max_attempts",
                  "retry_backoff_s", "retry_backoff_max_s", "headers", "http_client", "async_http_client", "tokenizer")


def split_backend_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the backend's keyword arguments (:data:`BACKEND_KWARGS`) out of ``kwargs``."""
    return {k: kwargs.pop(k) for k in BACKEND_KWARGS if k in kwargs}


def call_arguments(kwargs: Mapping[str, Any]) -> tuple[Any, Any, float | None, dict[str, Any], bool, dict[str, Any], Any]:
    """A ``create()`` call's arguments: (messages, rag_chunks, budget, the parameters passed through, stream, trimkit's options (``on_busy``), the routing
    key validated: a key, None or :data:`~trimkit.backends.server.NOT_GIVEN`). ``openai.NOT_GIVEN`` values are left out."""
    params = {k: v for k, v in kwargs.items() if type(v).__name__ not in ("NotGiven", "Omit")}  # openai.NOT_GIVEN, openai.Omit
    if "messages" not in params:
        raise InvalidMessageError("create() needs messages=[...]")
    messages = params.pop("messages")
    rag_chunks = params.pop("rag_chunks", None)
    budget = params.pop("ttft_budget_s", None)
    options = {"on_busy": params.pop("on_busy")} if "on_busy" in params else {}
    key = params.pop("routing_key", NOT_GIVEN)
    key = key if key is None or key is NOT_GIVEN else check_routing_key(key)
    stream = params.get("stream", False)
    if stream not in (True, False, None):
        raise InvalidInputError(f"stream must be True or False, got {stream!r}")
    return messages, rag_chunks, budget, params, bool(stream), options, key


def _not_a_list(target: Any, what: str) -> None:
    if isinstance(target, (list, tuple)):
        raise InvalidInputError(f"several {what}: use trimkit.wrap_url([...]) or trimkit.wrap([...]) (trimkit.fleet), which route between them")


# -- the report's notes ------------------------------------------------------------------------------
def _usage_note(m: Measurement, params: Mapping[str, Any]) -> tuple[str, ...]:
    if not params.get("stream") and m.ttft_s is not None and m.finish_reason is not None and m.timing_source == SOURCE_CLIENT:
        return ("the server reported no usage while streaming: the response's usage holds trimkit's counts "
                "(prompt tokens as trimkit counted them, completion tokens = content chunks)",)
    return ()


def max_tokens_note(m: Measurement, params: Mapping[str, Any]) -> tuple[str, ...]:
    """The warning when an answer ran past the ``max_tokens`` asked for: something on the way
    dropped the limit (sglang-router sends ``max_completion_tokens``, which llama-cpp-python ignores)."""
    asked = [v for v in (params.get("max_tokens"), params.get("max_completion_tokens")) if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    n = m.completion_tokens
    if not asked or n is None:
        return ()
    limit = min(asked)
    choices = params.get("n")
    if not isinstance(choices, int) or isinstance(choices, bool) or choices < 1:
        choices = 1
    limit_all = limit * choices  # the server counts the tokens of every choice
    if n <= limit_all:
        return ()
    name = "max_tokens" if params.get("max_tokens") == limit else "max_completion_tokens"
    per = f" per choice, {limit_all} for n={choices}" if limit_all != limit else ""
    return (f"the answer ran past {name}={limit}{per}: {n} completion tokens. Something between trimkit and the engine dropped the limit "
            "(sglang-router forwards max_tokens as max_completion_tokens, which llama-cpp-python's server ignores); "
            "the decode ran on and its time is not the one asked for",)


def router_note(backend: OpenAIHTTPBackend, m: Measurement) -> tuple[str, ...]:
    """The warning when the request went through a router: what trimkit could see through it, and its routing key."""
    if not isinstance(m.server, Mapping) or "router" not in m.server:
        return ()
    info = backend.server_info()  # probed already (the request was sent)
    if info.router is None:
        return ()
    sent = m.server.get("routing_headers")
    key = (f"sent with a routing key ({', '.join(sent)})" if sent else
           "sent without a routing key: the router chose the worker by its policy, and the cache predicted is the last request's worker's")
    return (f"{info.router.describe()}; {key}",)


def _model_note(asked: str | None, m: Measurement) -> tuple[str, ...]:
    served = m.server.get("model") if isinstance(m.server, Mapping) else None
    if not asked or not isinstance(served, str) or not served or served == asked:
        return ()
    return (f"the server answered with model {served[:120]!r}, not {asked[:120]!r} as asked (the profile and this report are "
            "for the model asked for)",)


# -- the drop-in client ------------------------------------------------------------------------------
class _ClientPart:
    """``.chat`` or ``.chat.completions`` of a wrapper or a fleet (``owner``, whose ``call_steps``
    a call runs); what trimkit does not define is the wrapped client's own."""

    _path: tuple[str, ...] = ()

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        if name == "_owner":  # not set yet (copy, pickle): not the client's either
            raise AttributeError(name)
        return getattr(self._owner._client_part(*self._path), name)


class _Completions(_ClientPart):
    _path = ("chat", "completions")

    def create(self, **kwargs: Any) -> Any:
        return run_sync(self._owner.call_steps(kwargs))


class _AsyncCompletions(_ClientPart):
    _path = ("chat", "completions")

    async def create(self, **kwargs: Any) -> Any:
        return await run_async(self._owner.call_steps(kwargs))


class ClientChat(_ClientPart):
    _path = ("chat",)

    def __init__(self, owner: Any) -> None:
        super().__init__(owner)
        self.completions = _AsyncCompletions(owner) if owner.is_async else _Completions(owner)


class OpenAIFrontEnd(FrontEnd):
    """What :class:`TrimmedOpenAI` and :class:`AsyncTrimmedOpenAI` share. ``retry_deadline_s`` fixes how long a request is retried before its first chunk
    (default: :func:`retry_deadline_for` of its budget); backend settings (:data:`BACKEND_KWARGS`) go to the
    :class:`~trimkit.backends.http.OpenAIHTTPBackend`, the rest to the :class:`~trimkit.pipeline.Pipeline`."""

    is_async = False
    backend: OpenAIHTTPBackend

    def __init__(self, client: Any, ttft_budget_s: float | None = None, *, retry_deadline_s: float | None = None,
                 backend: OpenAIHTTPBackend | None = None, **kwargs: Any) -> None:
        fixed_s = None if retry_deadline_s is None else positive_finite(retry_deadline_s, "retry_deadline_s")
        #: the routing key of a call that gives none, and the headers a key goes in
        self.routing = RoutingOptions.of(kwargs.pop("auto_routing_key", False), kwargs.pop("routing_headers", None))
        backend_kwargs = split_backend_kwargs(kwargs)
        if backend is None:
            if not is_openai_client(client):
                raise InvalidInputError(f"cannot wrap {type(client).__name__}: it needs .chat.completions.create (an openai.OpenAI-style client)")
            if client_is_async(client) != self.is_async:
                raise InvalidInputError(f"{type(client).__name__} is {'an async' if client_is_async(client) else 'a sync'} client: "
                                        f"use {'AsyncTrimmedOpenAI' if client_is_async(client) else 'TrimmedOpenAI'} (or trimkit.wrap)")
            backend = OpenAIHTTPBackend.from_openai_client(client, **backend_kwargs)
        elif backend_kwargs:
            raise InvalidInputError(f"{sorted(backend_kwargs)} configure the backend: pass them to OpenAIHTTPBackend, not with backend=")
        self.client = client
        self.deadlines = CallDeadlines(backend.retry_deadline_s, fixed_s)
        configured = backend.model

        def notes(m: Measurement, params: Mapping[str, Any]) -> tuple[str, ...]:
            asked = params.get("model") if isinstance(params.get("model"), str) else configured
            return (*_usage_note(m, params), *_model_note(asked, m), *max_tokens_note(m, params), *router_note(backend, m))

        try:
            self.pipeline = Pipeline(backend, ttft_budget_s=ttft_budget_s, model_label=self._model_label, report_notes=notes, **kwargs)
        except BaseException:
            backend.close()
            raise
        if self.is_async:  # async requests go in one piece (the watched prefill's steps are sync requests)
            self.pipeline.watch_prefill = False
        self.bound_side_requests()
        self.chat = ClientChat(self)

    def _client_part(self, *path: str) -> Any:
        obj = self.client
        if obj is None:
            raise AttributeError(f"{'.'.join(path)}: this wrapper talks to {self.backend.base_url} without a client")
        for name in path:
            obj = getattr(obj, name)
        return obj

    def _model_label(self, params: Mapping[str, Any]) -> str:
        """``model @ url`` (a fleet's reports name the server as their ``endpoint`` instead)."""
        model = params.get("model") or self.backend.model_name or ""
        return model if self.pipeline.endpoint_label else f"{model} @ {self.backend.base_url}"

    def bound_side_requests(self) -> None:
        """Bound the side requests made while a call is planned (tokenize, server facts) by the
        default budget's deadlines; construction (its calibration) had the backend's own."""
        self.backend.retry_deadline_s = self.deadlines.retry_s(self.ttft_budget_s)
        self.backend.deadline_s = self.deadlines.first_chunk_s(self.ttft_budget_s)

    def call_steps(self, kwargs: dict[str, Any]) -> Steps:
        """A ``create()`` call, sync or async: planned (async: in a worker thread), then sent (:class:`Send`)."""
        messages, rag_chunks, budget, params, stream, options, key = call_arguments(kwargs)
        if key is NOT_GIVEN and self.routing.auto:
            validate_messages(messages)  # before the key is made of them
        key = self.routing.key(key, messages)
        # behind a router the cache is predicted on the worker this key stays on (an async call's worker thread runs in a copy of this context)
        with planning_for(key):
            prepared = yield Io(self.prepare, in_thread(self.prepare), messages, rag_chunks, params, ttft_budget_s=budget, **options)
        return (yield from Send(self, params, stream, routing_headers(key, self.routing.headers)).steps(prepared))

    def assemble(self, rs: StreamReporter) -> Any:
        """The client's ``ChatCompletion`` (a dict without a client) rebuilt from a drained stream; its ``usage`` the server's, else trimkit's counts."""
        response = assemble_chat_completion(rs.chunks)
        if response["usage"] is None and rs.report is not None:
            m = rs.report.measurement
            usage = usage_counts(m.prompt_tokens or 0, m.completion_tokens or 0)
            if m.cached_tokens is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": m.cached_tokens}
            response["usage"] = usage
        return self.backend.as_client_response(response)


def in_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, awaited in a worker thread (an async call plans off the event loop)."""
    return functools.partial(asyncio.to_thread, fn)


class Send:
    """One request's way out through an OpenAI-style front-end, sync or async (its steps yield :class:`~trimkit.backends.base.Io`): sent whole if streaming
    cannot measure it (``n > 1``), else streamed, and drained and assembled unless a stream was asked for. ``attempt``: a fleet's
    (:class:`trimkit.fleet.Route`): its deadline, its place in the endpoint's queue, its stream read up to the first token."""

    def __init__(self, front: OpenAIFrontEnd, params: Mapping[str, Any], stream: bool, headers: Mapping[str, str] | None = None,
                 attempt: Any = None) -> None:
        self.front, self.params, self.stream, self.headers, self.attempt = front, params, stream, headers, attempt
        #: the stream's reporter (None until streamed; stays None for an answer sent whole)
        self.reporter: StreamReporter | None = None

    def steps(self, prepared: Prepared) -> Steps:
        out = yield from self.reply(prepared)
        return (yield from self.completion(out))

    def reply(self, prepared: Prepared) -> Steps:
        """The answer sent whole, or the stream the caller reads (a fleet fails over on an error here)."""
        front, params, attempt = self.front, self.params, self.attempt
        backend, pipeline = front.backend, front.pipeline
        extra: dict[str, Any] = {"headers": self.headers} if self.headers else {}
        n = params.get("n")
        try:
            if not self.stream and isinstance(n, int) and not isinstance(n, bool) and n > 1:  # its first byte after the whole answer
                blocker = f"n={n} asks for several choices: sent as a real non-streaming request, so TTFT was not measured (server numbers only)"
                prepared = pipeline.sent(prepared.with_warning(blocker))
                deadline = front.deadlines.whole_answer_s(prepared.budget_s, params, front.profile.decode_tokens_per_s)
                response, m = yield Io(backend.complete, backend.acomplete, prepared.messages, send_params(params), **extra, measure_ttft=False,
                                       prompt_tokens=prepared.prompt_tokens, retry_deadline_s=front.deadlines.retry_s(prepared.budget_s),
                                       deadline_s=deadline)
                if attempt is not None:  # out of the endpoint's queue before its report
                    attempt.went_out(prepared)
                    attempt.release()
                    attempt.endpoint.queue.observe(params, m)
                pipeline.finish(prepared, m, params)
                return response
            # a budgeted sync request to a llama-server is watched while it prefills (OpenAIHTTPBackend.evaluate_to)
            watch = pipeline.watched(prepared)
            if watch is not None:
                extra["watch"] = watch
            budget = prepared.budget_s
            retry_s, deadline_s = (front.deadlines.retry_s(budget), front.deadlines.first_chunk_s(budget)) if attempt is None else (attempt.deadline_s,) * 2
            ts = yield Io(backend.send, backend.asend, prepared.messages, send_params(params), prompt_tokens=prepared.prompt_tokens,
                          retry_deadline_s=retry_s, deadline_s=deadline_s, **extra)
            prepared = pipeline.sent(prepared, watch=watch)
            if attempt is not None:
                attempt.went_out(prepared)
        except BaseException:
            if attempt is not None:
                attempt.release(failed=True)
            raise
        self.reporter = (AsyncReportingStream if front.is_async else ReportingStream)(ts, pipeline, prepared, params, watch=watch)
        return self.reporter if attempt is None else (yield from attempt.read(self.reporter))

    def completion(self, out: Any) -> Steps:
        """What the call returns: the reply as it is, or the stream drained and assembled."""
        if self.reporter is None or self.stream:
            return out
        yield Io(drain, adrain, out)
        return self.front.assemble(self.reporter)


class TrimmedOpenAI(Closing, OpenAIFrontEnd):
    """An ``openai.OpenAI``-style client whose chat calls keep TTFT inside a budget: ``create`` returns the client's ``ChatCompletion``, rebuilt from a
    stream so that TTFT is measured, or with ``stream=True`` its chunks (with ``.report``). ``close()`` / ``with`` close the client too."""

    def execute(self, prepared: Prepared, params: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> ReportingOpenAIStream:
        """Send a prepared request; a stream of the client's chunks that reports when done."""
        return run_sync(Send(self, params, True, headers).steps(prepared))

    def close(self) -> None:
        self.backend.close()
        if self.client is not None and callable(getattr(self.client, "close", None)):
            self.client.close()


class AsyncTrimmedOpenAI(AsyncClosing, OpenAIFrontEnd):
    """:class:`TrimmedOpenAI` for ``openai.AsyncOpenAI``. Planning runs in a worker thread;
    construction is synchronous (it may calibrate: build it before the loop starts)."""

    is_async = True

    async def close(self) -> None:
        aclose = getattr(self.backend, "aclose", None)
        if aclose is not None:
            await aclose()
        else:
            self.backend.close()
        if self.client is not None and callable(getattr(self.client, "close", None)):
            await self.client.close()


def wrap_openai(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> OpenAIFrontEnd:
    """Wrap an ``openai.OpenAI`` (→ :class:`TrimmedOpenAI`) or ``openai.AsyncOpenAI`` (→ :class:`AsyncTrimmedOpenAI`)-style client."""
    _not_a_list(client, "clients")
    cls = AsyncTrimmedOpenAI if is_openai_client(client) and client_is_async(client) else TrimmedOpenAI  # not a client: refused there
    return cls(client, ttft_budget_s=ttft_budget_s, **kwargs)


def wrap_one_url(base_url: str, *, model: str | None = None, ttft_budget_s: float | None = None, api_key: str | None = None,
                 asynchronous: bool = False, **kwargs: Any) -> OpenAIFrontEnd:
    """The same API for a server URL over plain ``httpx`` (answers are dicts in OpenAI's JSON shape)."""
    _not_a_list(base_url, "URLs")
    backend_kwargs = split_backend_kwargs(kwargs)
    backend = OpenAIHTTPBackend(base_url, model=model, api_key=api_key, **backend_kwargs)
    cls = AsyncTrimmedOpenAI if asynchronous else TrimmedOpenAI
    return cls(None, ttft_budget_s=ttft_budget_s, backend=backend, **kwargs)
