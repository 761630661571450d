"""The OpenAI-client front-end: keep TTFT inside a budget on a model behind an OpenAI-compatible
server (llama.cpp, vLLM, SGLang, Ollama's ``/v1``, LM Studio).

:class:`TrimmedOpenAI` (``openai.OpenAI``) and :class:`AsyncTrimmedOpenAI` (``openai.AsyncOpenAI``)
are drop-ins: ``.chat.completions.create`` takes the client's arguments plus ``rag_chunks=``,
``ttft_budget_s=``, ``on_busy=`` and ``routing_key=``, and returns what the client returns; any
other attribute is the client's. They send through
:class:`~trimkit.backends.http.OpenAIHTTPBackend`; :func:`trimkit.wrap_url` gives the same API
over plain ``httpx``. Usage: ``docs/servers.md``.

**Deadlines** (:func:`retry_deadline_for`). Once the first token is later than twice the budget
the answer has failed its purpose, and retrying longer only hides an outage; but a tight budget
must not turn a dropped keep-alive connection or a brief 503 into an error, so a few seconds of
retries are always allowed. Retries never happen after the first chunk.
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
from trimkit.frontend import (
    AsyncReportingStream,
    FrontEnd,
    ReportingOpenAIStream,
    StreamReporter,
    adrain,
    drain,
    send_params,
    usage_counts,
)
from trimkit.messages import validate_messages
from trimkit.pipeline import Pipeline, Prepared

__all__ = ["TrimmedOpenAI", "AsyncTrimmedOpenAI", "OpenAIFrontEnd", "Send", "ClientChat", "ReportingOpenAIStream", "AsyncReportingStream",
           "wrap_openai", "retry_deadline_for", "BACKEND_KWARGS", "MIN_RETRY_DEADLINE_S", "call_arguments", "call_options", "call_routing_key",
           "max_tokens_note", "router_note", "split_backend_kwargs"]


# -- deadlines: how long a wrapped call may wait, from its TTFT budget -----------------------------------

#: the retry deadline never drops below this, however tight the budget (see :func:`retry_deadline_for`)
MIN_RETRY_DEADLINE_S = 5.0
#: with a budget, a request is retried for at most this many budgets
RETRY_DEADLINE_BUDGETS = 2.0


def retry_deadline_for(ttft_budget_s: float | None, default_s: float) -> float:
    """How long a request that has not produced its first chunk is retried (connection refused,
    timeouts, 429/502/503/504): ``max(2 × budget, 5 s)`` with a budget, else ``default_s``.

    With a budget this is also the call's *deadline*: every wait before the first chunk ends by
    then (a server that accepts and never answers gives ``ServerTimeoutError`` after it, not
    after the backend's ``timeout_s``).
    """
    if ttft_budget_s is None:
        return default_s
    return max(RETRY_DEADLINE_BUDGETS * ttft_budget_s, MIN_RETRY_DEADLINE_S)


@attrs.frozen
class CallDeadlines:
    """The deadlines of one wrapper's calls. ``unbudgeted_s``: the retry deadline of a call
    without a budget (the backend's own); ``fixed_s``: a retry deadline the user fixed for every
    call (None: derived from each call's budget)."""

    unbudgeted_s: float
    fixed_s: float | None = None

    def retry_s(self, ttft_budget_s: float | None) -> float:
        """The retry deadline of a request with this budget (see :func:`retry_deadline_for`)."""
        return self.fixed_s if self.fixed_s is not None else retry_deadline_for(ttft_budget_s, self.unbudgeted_s)

    def first_chunk_s(self, ttft_budget_s: float | None) -> float | None:
        """The deadline bounding every wait before a request's first chunk: the retry deadline
        when the request has a budget; None without one (each wait then has the backend's
        ``timeout_s``)."""
        return self.retry_s(ttft_budget_s) if ttft_budget_s is not None else None

    def whole_answer_s(self, ttft_budget_s: float | None, params: Mapping[str, Any], decode_tokens_per_s: Any) -> float | None:
        """The deadline of a request that cannot be streamed (``n > 1``), whose first byte comes
        after the whole answer: the first-chunk deadline plus twice the time its
        ``n × max_tokens`` take to decode at ``decode_tokens_per_s``. None (each wait bounded by
        ``timeout_s`` only) without a budget, without ``max_tokens`` or without a decode speed."""
        base = self.first_chunk_s(ttft_budget_s)
        max_tokens = params.get("max_completion_tokens") or params.get("max_tokens")
        n = params.get("n") or 1
        speed = decode_tokens_per_s
        if base is None or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (max_tokens, n)):
            return None
        assert isinstance(max_tokens, int)  # checked above; for the type checker
        if not isinstance(speed, (int, float)) or not math.isfinite(speed) or speed <= 0:
            return None
        return base + 2.0 * n * max_tokens / speed


# -- the OpenAI-client front-end -------------------------------------------------------------------------

#: keyword arguments of the wrappers that configure the HTTP backend, not the pipeline
BACKEND_KWARGS = ("model", "n_ctx", "n_batch", "cache_block_tokens", "chat_format", "timeout_s", "connect_timeout_s", "max_attempts",
                  "retry_backoff_s", "retry_backoff_max_s", "headers", "http_client", "async_http_client", "tokenizer")


def _is_not_given(value: Any) -> bool:
    """``openai.NOT_GIVEN`` (and ``openai.Omit``): an argument the caller did not give."""
    return type(value).__name__ in ("NotGiven", "Omit")


def split_backend_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the backend's keyword arguments (:data:`BACKEND_KWARGS`) out of ``kwargs``."""
    return {k: kwargs.pop(k) for k in BACKEND_KWARGS if k in kwargs}


def call_arguments(kwargs: Mapping[str, Any]) -> tuple[Any, Any, float | None, dict[str, Any], bool]:
    """Split a ``create()`` call's arguments: (messages, rag_chunks, budget, pass-through params,
    stream). Arguments the caller did not give (``openai.NOT_GIVEN``) are left out; trimkit's own
    per-call options (``on_busy``) are not pass-through: read them with :func:`call_options`."""
    params = {k: v for k, v in kwargs.items() if not _is_not_given(v)}
    if "messages" not in params:
        raise InvalidMessageError("create() needs messages=[...]")
    messages = params.pop("messages")
    rag_chunks = params.pop("rag_chunks", None)
    budget = params.pop("ttft_budget_s", None)
    for name in (*TRIMKIT_CALL_OPTIONS, ROUTING_KEY_OPTION):
        params.pop(name, None)
    stream = params.get("stream", False)
    if stream not in (True, False, None):
        raise InvalidInputError(f"stream must be True or False, got {stream!r}")
    return messages, rag_chunks, budget, params, bool(stream)


#: a call's options that are trimkit's, never sent to the server
TRIMKIT_CALL_OPTIONS = ("on_busy",)
#: a call's routing key: trimkit's option, sent as headers, never in the body (:mod:`trimkit.backends.server`)
ROUTING_KEY_OPTION = "routing_key"


def call_options(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """trimkit's own planning options of a ``create()`` call (``on_busy``), as given (None: not given)."""
    return {name: kwargs.get(name) for name in TRIMKIT_CALL_OPTIONS if not _is_not_given(kwargs.get(name))}


def call_routing_key(kwargs: Mapping[str, Any]) -> Any:
    """A call's ``routing_key=``, validated (:class:`~trimkit.errors.InvalidInputError` before
    anything is sent): the key, ``None`` (given as None: no key for this call) or
    :data:`~trimkit.backends.server.NOT_GIVEN`."""
    if ROUTING_KEY_OPTION not in kwargs or _is_not_given(kwargs[ROUTING_KEY_OPTION]):
        return NOT_GIVEN
    key = kwargs[ROUTING_KEY_OPTION]
    return None if key is None else check_routing_key(key)


def _not_a_list(target: Any, what: str) -> None:
    if isinstance(target, (list, tuple)):
        raise InvalidInputError(f"several {what}: use trimkit.wrap_url([...]) or trimkit.wrap([...]) (trimkit.fleet), which route between them")


def _streaming_blocker(params: Mapping[str, Any]) -> str | None:
    """Why this request cannot be measured by streaming it (None: it can)."""
    n = params.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return f"n={n} asks for several choices: sent as a real non-streaming request, so TTFT was not measured (server numbers only)"
    return None


def _usage_of(m: Measurement) -> dict[str, Any]:
    """``usage`` for a response rebuilt from a stream: the server's counts when it reported
    them, else trimkit's (prompt tokens as sent, completion tokens = content chunks)."""
    usage = usage_counts(m.prompt_tokens or 0, m.completion_tokens or 0)
    if m.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": m.cached_tokens}
    return usage


def _usage_note(m: Measurement, params: Mapping[str, Any]) -> tuple[str, ...]:
    """The report's warning when a non-streamed call's ``usage`` holds trimkit's counts."""
    if not params.get("stream") and m.ttft_s is not None and m.finish_reason is not None and m.timing_source == SOURCE_CLIENT:
        return ("the server reported no usage while streaming: the response's usage holds trimkit's counts "
                "(prompt tokens as trimkit counted them, completion tokens = content chunks)",)
    return ()


def _limit(params: Mapping[str, Any]) -> int | None:
    """The answer's length the caller asked for: the smaller of ``max_tokens`` and
    ``max_completion_tokens`` given as positive ints (None: neither)."""
    asked = [v for v in (params.get("max_tokens"), params.get("max_completion_tokens"))
             if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(asked) if asked else None


def max_tokens_note(m: Measurement, params: Mapping[str, Any]) -> tuple[str, ...]:
    """The report's warning when an answer ran past the ``max_tokens`` asked for: something on
    the way dropped the limit (sglang-router forwards ``max_tokens`` as ``max_completion_tokens``,
    which llama-cpp-python's server ignores), and the decode ran on."""
    limit = _limit(params)
    n = m.completion_tokens
    if limit is None or n is None:
        return ()
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
    """The report's warning when the request went through a router (vllm-router,
    sglang-router): what trimkit's probes could and could not see through it, and whether the
    request carried a routing key."""
    if not isinstance(m.server, Mapping) or "router" not in m.server:  # the request's facts: the backend saw a router
        return ()
    info = backend.server_info()  # probed already (the request was sent)
    if info.router is None:
        return ()
    sent = m.server.get("routing_headers")
    key = (f"sent with a routing key ({', '.join(sent)})" if sent else
           "sent without a routing key: the router chose the worker by its policy, and the cache predicted is the last request's worker's")
    return (f"{info.router.describe()}; {key}",)


def _model_note(asked: str | None, m: Measurement) -> tuple[str, ...]:
    """The report's warning when the server answered with another model than the one asked for."""
    served = m.server.get("model") if isinstance(m.server, Mapping) else None
    if not asked or not isinstance(served, str) or not served or served == asked:
        return ()
    return (f"the server answered with model {served[:120]!r}, not {asked[:120]!r} as asked (the profile and this report are "
            "for the model asked for)",)


class _ClientPart:
    """A part of the wrapper's drop-in client (``.chat``, ``.chat.completions``): what trimkit
    does not define is the wrapped client's own. ``owner``: an :class:`OpenAIFrontEnd` or a fleet
    (:mod:`trimkit.fleet`), whose ``call_steps`` a call runs."""

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
        """Like ``client.chat.completions.create``, inside the TTFT budget (see :class:`TrimmedOpenAI`)."""
        return run_sync(self._owner.call_steps(kwargs))


class _AsyncCompletions(_ClientPart):
    _path = ("chat", "completions")

    async def create(self, **kwargs: Any) -> Any:
        """Like ``await client.chat.completions.create``, inside the TTFT budget (see :class:`AsyncTrimmedOpenAI`)."""
        return await run_async(self._owner.call_steps(kwargs))


class ClientChat(_ClientPart):
    """``.chat`` of a wrapper or a fleet: ``.completions.create`` runs the owner's calls."""

    _path = ("chat",)

    def __init__(self, owner: Any) -> None:
        super().__init__(owner)
        self.completions = _AsyncCompletions(owner) if owner.is_async else _Completions(owner)


class OpenAIFrontEnd(FrontEnd):
    """What :class:`TrimmedOpenAI` and :class:`AsyncTrimmedOpenAI` share: the backend and the
    pipeline they hold, the drop-in attributes, the deadlines of a call, the splitting of a
    call's arguments and the response rebuilt from a stream.

    ``ttft_budget_s``: the default budget. ``retry_deadline_s``: fixes how long a request is
    retried before its first chunk (default: :func:`retry_deadline_for` of the call's budget,
    and of the default budget for the side requests made while planning). Backend settings
    (:data:`BACKEND_KWARGS`) go to :class:`~trimkit.backends.http.OpenAIHTTPBackend`; the rest
    to the :class:`~trimkit.pipeline.Pipeline` (without a ``profile``, the stored one or a
    micro-calibration against the server now). ``auto_routing_key`` and ``routing_headers``: the
    routing key of a call behind a router (``docs/scaling.md`` §4).
    """

    #: whether the wrapped client's calls are awaited
    is_async = False
    backend: OpenAIHTTPBackend

    def __init__(self, client: Any, ttft_budget_s: float | None = None, *, retry_deadline_s: float | None = None,
                 backend: OpenAIHTTPBackend | None = None, **kwargs: Any) -> None:
        if retry_deadline_s is not None:
            positive_finite(retry_deadline_s, "retry_deadline_s")
        #: the routing key of a call that gives none, and the headers a key goes in
        self.routing = RoutingOptions.of(kwargs.pop("auto_routing_key", False), kwargs.pop("routing_headers", None))
        backend_kwargs = split_backend_kwargs(kwargs)
        own_backend = backend is None
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
        #: how long this wrapper's calls may wait
        self.deadlines = CallDeadlines(backend.retry_deadline_s, float(retry_deadline_s) if retry_deadline_s is not None else None)
        try:
            #: validate → plan → measure → report; this front-end only sends
            configured = backend.model

            def notes(m: Measurement, params: Mapping[str, Any]) -> tuple[str, ...]:
                asked = params.get("model") if isinstance(params.get("model"), str) else configured
                return (*_usage_note(m, params), *_model_note(asked, m), *max_tokens_note(m, params), *router_note(backend, m))

            self.pipeline = Pipeline(backend, ttft_budget_s=ttft_budget_s, model_label=self._model_label, report_notes=notes, **kwargs)
        except BaseException:
            backend.close()
            raise
        if own_backend:
            self.bound_side_requests()
        self.chat = ClientChat(self)

    # -- drop-in ------------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:  # everything else is the client's
        client = self.__dict__.get("client")
        if client is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(client, name)

    def _client_part(self, *path: str) -> Any:
        obj = self.client
        if obj is None:
            raise AttributeError(f"{'.'.join(path)}: this wrapper talks to {self.backend.base_url} without a client")
        for name in path:
            obj = getattr(obj, name)
        return obj

    def _model_label(self, params: Mapping[str, Any]) -> str:
        """``model @ url``: the model this call named (or the backend's), and the server (which
        a fleet's reports name as their ``endpoint`` instead)."""
        model = params.get("model") or self.backend.model_name or ""
        return model if self.pipeline.endpoint_label else f"{model} @ {self.backend.base_url}"

    # -- deadlines (:class:`CallDeadlines`) --------------------------------------------
    @property
    def retry_deadline_s(self) -> float | None:
        """The retry deadline fixed for every call (None: derived from each call's budget)."""
        return self.deadlines.fixed_s

    def retry_deadline_for_call(self, ttft_budget_s: float | None) -> float:
        """The retry deadline of a request with this budget (see :func:`retry_deadline_for`)."""
        return self.deadlines.retry_s(ttft_budget_s)

    def deadline_for_call(self, ttft_budget_s: float | None) -> float | None:
        """The deadline bounding every wait before a request's first chunk (None without a budget)."""
        return self.deadlines.first_chunk_s(ttft_budget_s)

    def bound_side_requests(self) -> None:
        """Retry (and, with a default budget, bound) the side requests made while a call is planned
        (tokenize, server facts) within the default budget's deadline too; construction (a server
        still loading, a calibration) had the backend's own."""
        self.backend.retry_deadline_s = self.retry_deadline_for_call(self.ttft_budget_s)
        self.backend.deadline_s = self.deadline_for_call(self.ttft_budget_s)

    # -- one call, apart from its I/O -----------------------------------------------------------------
    def call_key(self, given: Any, messages: Any) -> str | None:
        """A call's routing key: the one it gave (:func:`call_routing_key`), else with
        ``auto_routing_key`` its conversation's (the messages validated first: bad ones raise
        :class:`~trimkit.errors.InvalidMessageError` before anything is sent)."""
        if given is NOT_GIVEN and self.routing.auto:
            validate_messages(messages)
        return self.routing.key(given, messages)

    def call_steps(self, kwargs: dict[str, Any]) -> Steps:
        """A ``create()`` call, sync or async (:func:`~trimkit.backends.base.run_sync`,
        :func:`~trimkit.backends.base.run_async`): planned (an async call's in a worker thread, off
        the event loop), then sent (:class:`Send`)."""
        messages, rag_chunks, budget, params, stream = call_arguments(kwargs)
        key = self.call_key(call_routing_key(kwargs), messages)
        # behind a router the cache is predicted on the worker this key stays on (an async call's
        # worker thread runs in a copy of this context)
        with planning_for(key):
            prepared = yield Io(self.prepare, _in_thread(self.prepare), messages, rag_chunks, params, ttft_budget_s=budget, **call_options(kwargs))
        return (yield from Send(self, params, stream, routing_headers(key, self.routing.headers)).steps(prepared))

    def assemble(self, rs: StreamReporter) -> Any:
        """The client's ``ChatCompletion`` (a dict for :func:`trimkit.wrap_url`) rebuilt from a drained stream."""
        response = assemble_chat_completion(rs.chunks)
        if response["usage"] is None and rs.report is not None:
            response["usage"] = _usage_of(rs.report.measurement)
        return self.backend.as_client_response(response)


def _in_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, awaited in a worker thread (an async call plans off the event loop)."""
    return functools.partial(asyncio.to_thread, fn)


class Send:
    """One request's way out through an OpenAI-style front-end — the one send path of every
    call, one endpoint's or a fleet's attempt (:mod:`trimkit.fleet`), sync or async: its steps
    yield the I/O (:class:`~trimkit.backends.base.Io`).

    A non-streamed request that streaming cannot measure (``n > 1``) is sent whole; every other
    is streamed, and a non-streamed one drained and its completion assembled from the stream.
    :meth:`reply` is everything up to the answer or the stream the caller reads (a fleet fails
    over on an error there); the hooks (:meth:`stream_args`, :meth:`answered`,
    :meth:`went_out`, :meth:`failed`, :meth:`reading`) are where a fleet's attempt differs."""

    def __init__(self, front: OpenAIFrontEnd, params: Mapping[str, Any], stream: bool, headers: Mapping[str, str] | None = None) -> None:
        self.front, self.params, self.stream, self.headers = front, params, stream, headers
        #: the stream's reporter (None until streamed; stays None for an answer sent whole)
        self.reporter: StreamReporter | None = None

    def steps(self, prepared: Prepared) -> Steps:
        """Send ``prepared``: what the call returns."""
        out = yield from self.reply(prepared)
        return (yield from self.completion(out))

    def reply(self, prepared: Prepared) -> Steps:
        """The answer sent whole, or the stream the caller reads."""
        front, params = self.front, self.params
        backend, pipeline = front.backend, front.pipeline
        extra: dict[str, Any] = {"headers": self.headers} if self.headers else {}
        blocker = None if self.stream else _streaming_blocker(params)
        try:
            if blocker is not None:  # a real non-streaming request, its first byte after the whole answer
                prepared = pipeline.sent(prepared.with_warning(blocker))
                deadline = front.deadlines.whole_answer_s(prepared.budget_s, params, front.profile.decode_tokens_per_s)
                response, m = yield Io(backend.complete, backend.acomplete, prepared.messages, send_params(params), **extra, measure_ttft=False,
                                       prompt_tokens=prepared.prompt_tokens, retry_deadline_s=front.retry_deadline_for_call(prepared.budget_s),
                                       deadline_s=deadline)
                self.answered(prepared, m)
                return response
            # a budgeted sync request to a llama-server is watched while it prefills (OpenAIHTTPBackend.evaluate_to)
            watch = pipeline.watched(prepared)
            if watch is not None:
                extra["watch"] = watch
            ts = yield Io(backend.send, backend.asend, prepared.messages, send_params(params), **self.stream_args(prepared), **extra)
            prepared = pipeline.sent(prepared)
            if watch is not None:
                watch.prepared = prepared
            self.went_out(prepared)
        except BaseException:
            self.failed()
            raise
        self.reporter = (AsyncReportingStream if front.is_async else ReportingOpenAIStream)(ts, pipeline, prepared, params, watch=watch)
        return (yield from self.reading(self.reporter))

    def completion(self, out: Any) -> Steps:
        """What the call returns: the reply as it is (an answer sent whole, a stream asked
        for), or the stream drained and its completion assembled."""
        if self.reporter is None or self.stream:
            return out
        yield Io(drain, adrain, out)
        return self.front.assemble(self.reporter)

    # -- hooks (a fleet's attempt: trimkit.fleet.FleetSend) ------------------------------
    def stream_args(self, prepared: Prepared) -> dict[str, Any]:
        """The backend's keyword arguments to stream ``prepared``."""
        budget = prepared.budget_s
        return {"prompt_tokens": prepared.prompt_tokens, "retry_deadline_s": self.front.retry_deadline_for_call(budget),
                "deadline_s": self.front.deadline_for_call(budget)}

    def answered(self, prepared: Prepared, m: Measurement) -> None:
        """The request sent whole was answered."""
        self.front.pipeline.finish(prepared, m, self.params)

    def went_out(self, prepared: Prepared) -> None:
        """The request was sent to be streamed."""

    def failed(self) -> None:
        """Sending failed."""

    def reading(self, rs: StreamReporter) -> Steps:
        """The stream the caller reads."""
        yield from ()
        return rs


class TrimmedOpenAI(OpenAIFrontEnd):
    """An ``openai.OpenAI``-style client whose chat calls keep TTFT inside a budget.

    ``chat.completions.create(...)`` with ``stream=True`` returns an iterator of the client's own
    chunk objects (with ``.report``, ``with`` and ``close()``); otherwise the client's
    ``ChatCompletion``, rebuilt from a stream so that TTFT is measured (``usage`` the server's
    when it reports usage while streaming, else trimkit's counts). Only a request that cannot be
    streamed faithfully (``n > 1``) is sent as a real non-streaming request, and its report says
    so. ``close()`` / ``with`` close the wrapped client too. Construction: :class:`OpenAIFrontEnd`.
    """

    def execute(self, prepared: Prepared, params: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> ReportingOpenAIStream:
        """Send a prepared request (``headers``: its routing key's); a stream of the client's chunks that reports when done."""
        return run_sync(Send(self, params, True, headers).steps(prepared))

    def close(self) -> None:
        """Close the backend's connections and the wrapped client."""
        self.backend.close()
        if self.client is not None and callable(getattr(self.client, "close", None)):
            self.client.close()

    def __enter__(self) -> TrimmedOpenAI:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncTrimmedOpenAI(OpenAIFrontEnd):
    """:class:`TrimmedOpenAI` for ``openai.AsyncOpenAI``: ``await chat.completions.create(...)``
    returns the client's ``ChatCompletion``, or with ``stream=True`` an async iterator of its
    chunks with ``.report`` (``async with`` and ``await close()`` work).

    Planning and the server's side requests (tokenize) run in a worker thread, off the event
    loop. Constructing it is synchronous: without a stored profile it calibrates against the
    server there and then (a micro-calibration, about 3 s), so build it before the loop starts or
    through ``asyncio.to_thread``.
    """

    is_async = True

    def __init__(self, client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(client, ttft_budget_s, **kwargs)
        # async requests go in one piece (the watched prefill's steps are sync requests): they are
        # planned with the whole prediction's margin, as an unwatched request
        self.pipeline.watch_prefill = False

    async def close(self) -> None:
        """Close the backend's connections and the wrapped client (``await``, as on ``AsyncOpenAI``)."""
        aclose = getattr(self.backend, "aclose", None)
        if aclose is not None:
            await aclose()
        else:
            self.backend.close()
        if self.client is not None and callable(getattr(self.client, "close", None)):
            await self.client.close()

    async def __aenter__(self) -> AsyncTrimmedOpenAI:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def wrap_openai(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> OpenAIFrontEnd:
    """Wrap an ``openai.OpenAI`` (→ :class:`TrimmedOpenAI`) or ``openai.AsyncOpenAI``
    (→ :class:`AsyncTrimmedOpenAI`) client, or any client shaped like them."""
    _not_a_list(client, "clients")
    if not is_openai_client(client):
        raise InvalidInputError(f"cannot wrap {type(client).__name__}: it needs .chat.completions.create (an openai.OpenAI-style client)")
    cls = AsyncTrimmedOpenAI if client_is_async(client) else TrimmedOpenAI
    return cls(client, ttft_budget_s=ttft_budget_s, **kwargs)


def wrap_one_url(base_url: str, *, model: str | None = None, ttft_budget_s: float | None = None, api_key: str | None = None,
             asynchronous: bool = False, **kwargs: Any) -> OpenAIFrontEnd:
    """The same ``.chat.completions.create(...)`` API for an OpenAI-compatible server, without
    the ``openai`` package: requests go out through ``httpx`` and responses are plain dicts in
    OpenAI's JSON shape (chunk dicts when streaming). ``asynchronous=True`` gives the async
    wrapper. ``model`` names the model when a call does not (default: the server's first);
    other keyword arguments as for :class:`TrimmedOpenAI`. A malformed URL raises
    :class:`~trimkit.errors.InvalidInputError` before anything is sent."""
    _not_a_list(base_url, "URLs")
    backend_kwargs = split_backend_kwargs(kwargs)
    backend = OpenAIHTTPBackend(base_url, model=model, api_key=api_key, **backend_kwargs)
    cls = AsyncTrimmedOpenAI if asynchronous else TrimmedOpenAI
    chat = cls(None, ttft_budget_s=ttft_budget_s, backend=backend, **kwargs)
    chat.bound_side_requests()
    return chat
