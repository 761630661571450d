"""The OpenAI-client front-end: keep TTFT inside a budget on a served model.

Use it when the model runs behind an OpenAI-compatible server (llama.cpp server,
llama-cpp-python's server, vLLM, SGLang, Ollama's ``/v1``, LM Studio) rather than in-process::

    client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none")
    chat = trimkit.wrap(client, ttft_budget_s=1.0)           # or wrap_openai(client, ...)
    out = chat.chat.completions.create(model="m", messages=[...], rag_chunks=[...], max_tokens=64)
    print(chat.last_report)

:class:`TrimmedOpenAI` (``openai.OpenAI``) and :class:`AsyncTrimmedOpenAI` (``openai.AsyncOpenAI``)
are drop-ins: ``.chat.completions.create`` takes the client's arguments plus ``rag_chunks=`` and
a per-call ``ttft_budget_s=``, passes every other argument through unchanged, and returns what
the client returns. Any other attribute is the client's own. :func:`wrap_url` gives the same API
over plain ``httpx`` for users without the ``openai`` package (responses are plain dicts).

All planning, measuring and reporting is the :class:`~trimkit.wrapper.Trimmer`'s; the requests go
through :class:`~trimkit.backends.http.OpenAIHTTPBackend`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import attrs

from trimkit import _validate
from trimkit.backends.base import Measurement
from trimkit.backends.server_timings import SOURCE_CLIENT
from trimkit.backends.http import OpenAIHTTPBackend, _client_is_async, assemble_chat_completion
from trimkit.errors import InvalidInputError, InvalidMessageError, TrimkitError
from trimkit.report import Report
from trimkit.wrapper import Prepared, ReportingStream, Trimmer, _Reporting

__all__ = [
    "TrimmedOpenAI",
    "AsyncTrimmedOpenAI",
    "ReportingOpenAIStream",
    "AsyncReportingStream",
    "wrap_openai",
    "wrap_url",
    "retry_deadline_for",
    "BACKEND_KWARGS",
    "MIN_RETRY_DEADLINE_S",
]

#: keyword arguments of the wrappers that configure the HTTP backend, not the Trimmer
BACKEND_KWARGS = (
    "model",
    "n_ctx",
    "n_batch",
    "cache_block_tokens",
    "chat_format",
    "timeout_s",
    "connect_timeout_s",
    "max_attempts",
    "retry_backoff_s",
    "retry_backoff_max_s",
    "headers",
    "http_client",
    "async_http_client",
)

#: the retry deadline never drops below this, however tight the budget (see :func:`retry_deadline_for`)
MIN_RETRY_DEADLINE_S = 5.0
#: with a budget, a request is retried for at most this many budgets
RETRY_DEADLINE_BUDGETS = 2.0


def retry_deadline_for(ttft_budget_s: float | None, default_s: float) -> float:
    """How long a request that has not produced its first chunk is retried (connection refused,
    timeouts, 429/502/503/504): ``max(2 × budget, 5 s)`` with a budget, else ``default_s``.

    Why: once the first token is later than twice the budget the answer has failed its purpose,
    and retrying longer only hides an outage from the caller; but a tight budget (0.3 s) must not
    turn a dropped keep-alive connection or a server's brief 503 into an error, so a few seconds
    of retries are always allowed. Retries never happen after the first chunk.

    With a budget this is also the call's *deadline*: every wait before the first chunk ends by
    then (a server that accepts and never answers gives ``ServerTimeoutError`` after it, not
    after the backend's ``timeout_s``).
    """
    if ttft_budget_s is None:
        return default_s
    return max(RETRY_DEADLINE_BUDGETS * ttft_budget_s, MIN_RETRY_DEADLINE_S)


def _is_not_given(value: Any) -> bool:
    """``openai.NOT_GIVEN`` (and ``openai.Omit``): an argument the caller did not give."""
    return type(value).__name__ in ("NotGiven", "Omit")


def _split_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the backend's keyword arguments out of ``kwargs``."""
    return {k: kwargs.pop(k) for k in BACKEND_KWARGS if k in kwargs}


def _streaming_blocker(params: Mapping[str, Any]) -> str | None:
    """Why this request cannot be measured by streaming it (None: it can)."""
    n = params.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return f"n={n} asks for several choices: sent as a real non-streaming request, so TTFT was not measured (server numbers only)"
    return None


def _usage_of(m: Measurement) -> dict[str, Any]:
    """``usage`` for a response rebuilt from a stream: the server's counts when it reported
    them, else trimkit's (prompt tokens as sent, completion tokens = content chunks)."""
    prompt = m.prompt_tokens or 0
    completion = m.completion_tokens or 0
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if m.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": m.cached_tokens}
    return usage


class ReportingOpenAIStream(ReportingStream):
    """What ``create(stream=True)`` returns: iterate it like the client's own stream (it yields
    the client's chunk objects, or dicts for :func:`wrap_url`); ``.report`` is set once it is
    exhausted; ``with`` and :meth:`close` work as on ``openai.Stream``."""

    def __enter__(self) -> ReportingOpenAIStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncReportingStream(_Reporting):
    """What the async ``create(stream=True)`` returns: ``async for`` it like ``openai.AsyncStream``;
    ``.report`` is set once it is exhausted; ``async with`` and ``await close()`` work."""

    def __aiter__(self) -> AsyncReportingStream:
        return self

    async def __anext__(self) -> Any:
        try:
            chunk = await self._ts.__anext__()
        except StopAsyncIteration:
            raise
        except TrimkitError as exc:
            _attach_report(exc, self._ts, self._trimmer, self.prepared, self._params)
            raise
        self.chunks.append(chunk)
        return chunk

    async def close(self) -> None:
        await self._ts.aclose()

    async def __aenter__(self) -> AsyncReportingStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _attach_report(exc: TrimkitError, ts: Any, trimmer: Trimmer, prepared: Prepared, params: Mapping[str, Any]) -> None:
    """Give an error that carries a report (any BackendError: StreamInterruptedError, a
    ServerError or MalformedReplyError mid-stream, a ServerTimeoutError) the report of what was sent."""
    if getattr(exc, "report", "absent") is not None:
        return
    total = (ts.ended_at - ts.started) if ts.ended_at is not None and ts.started is not None else 0.0
    m = Measurement(ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=total)
    exc.report = trimmer._report(prepared, m, params)  # type: ignore[attr-defined]


class _Completions:
    """``wrapper.chat.completions``: ``create`` is trimkit's, everything else the client's."""

    def __init__(self, owner: TrimmedOpenAI) -> None:
        self._owner = owner

    def create(self, **kwargs: Any) -> Any:
        """Like ``client.chat.completions.create``, inside the TTFT budget (see :class:`TrimmedOpenAI`)."""
        return self._owner._create(kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner._client_part("chat", "completions"), name)


class _AsyncCompletions(_Completions):
    async def create(self, **kwargs: Any) -> Any:  # type: ignore[override]
        """Like ``await client.chat.completions.create``, inside the TTFT budget (see :class:`AsyncTrimmedOpenAI`)."""
        return await self._owner._acreate(kwargs)  # type: ignore[attr-defined]


class _Chat:
    def __init__(self, owner: TrimmedOpenAI, completions: _Completions) -> None:
        self._owner = owner
        self.completions = completions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner._client_part("chat"), name)


class TrimmedOpenAI(Trimmer):
    """An ``openai.OpenAI``-style client whose chat calls keep TTFT inside a budget.

    ``chat.completions.create(messages=..., model=..., rag_chunks=None, ttft_budget_s=None,
    stream=False, **kwargs)`` behaves as the client's: with ``stream=True`` it returns an
    iterator of the client's own chunk objects (with ``.report``, ``with`` and ``close()``);
    otherwise it returns the client's ``ChatCompletion``, rebuilt from a stream so that TTFT is
    measured (``usage`` is the server's when it reports usage while streaming, else trimkit's
    counts). Only a request that cannot be streamed faithfully (``n > 1``) is sent as a real
    non-streaming request, and its report says so. Every other argument passes through
    unchanged and is listed in the report's ``decode_params``.

    ``ttft_budget_s``: the default budget (a per-call ``ttft_budget_s=`` overrides it).
    ``retry_deadline_s``: fixes how long a request is retried before its first chunk; by default
    :func:`retry_deadline_for` derives it from the call's budget (and the planning-time side
    requests — tokenize, server facts — from the default budget). Backend settings
    (:data:`BACKEND_KWARGS`: ``n_ctx`` for servers that do not report it, ``cache_block_tokens``,
    timeouts, ...) go to :class:`~trimkit.backends.http.OpenAIHTTPBackend`; the rest
    (``profile``, ``strategies``, ``on_infeasible``, ...) to :class:`~trimkit.wrapper.Trimmer`.
    Without a ``profile`` the stored one for this endpoint is used, else a quick calibration runs
    against the server now.

    ``close()`` / ``with`` close the wrapped client too, as the client's own would.
    """

    _async = False

    def __init__(self, client: Any, ttft_budget_s: float | None = None, *, retry_deadline_s: float | None = None,
                 backend: OpenAIHTTPBackend | None = None, **kwargs: Any) -> None:
        if ttft_budget_s is not None:
            _validate.budget(ttft_budget_s)
        if retry_deadline_s is not None:
            _validate.positive_finite(retry_deadline_s, "retry_deadline_s")
        backend_kwargs = _split_kwargs(kwargs)
        own_backend = backend is None
        if backend is None:
            if client is None or not callable(getattr(getattr(getattr(client, "chat", None), "completions", None), "create", None)):
                raise InvalidInputError(f"cannot wrap {type(client).__name__}: it needs .chat.completions.create (an openai.OpenAI-style client)")
            if _client_is_async(client) != self._async:
                raise InvalidInputError(f"{type(client).__name__} is {'an async' if _client_is_async(client) else 'a sync'} client: "
                                        f"use {'AsyncTrimmedOpenAI' if _client_is_async(client) else 'TrimmedOpenAI'} (or trimkit.wrap)")
            backend = OpenAIHTTPBackend.from_openai_client(client, **backend_kwargs)
        elif backend_kwargs:
            raise InvalidInputError(f"{sorted(backend_kwargs)} configure the backend: pass them to OpenAIHTTPBackend, not with backend=")
        self.client = client
        self.retry_deadline_s = float(retry_deadline_s) if retry_deadline_s is not None else None
        self._unbudgeted_deadline_s = backend.retry_deadline_s
        try:
            super().__init__(backend, ttft_budget_s=ttft_budget_s, **kwargs)
        except BaseException:
            backend.close()
            raise
        self.backend: OpenAIHTTPBackend = backend
        if own_backend:
            self._bound_side_requests()
        self.chat = _Chat(self, _AsyncCompletions(self) if self._async else _Completions(self))

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

    def close(self) -> None:
        """Close the backend's connections and the wrapped client."""
        self.backend.close()
        if self.client is not None and callable(getattr(self.client, "close", None)):
            self.client.close()

    def __enter__(self) -> TrimmedOpenAI:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the engine's hooks ---------------------------------------------------------------------------
    def retry_deadline_for_call(self, ttft_budget_s: float | None) -> float:
        """The retry deadline of a request with this budget (see :func:`retry_deadline_for`)."""
        if self.retry_deadline_s is not None:
            return self.retry_deadline_s
        return retry_deadline_for(ttft_budget_s, self._unbudgeted_deadline_s)

    def deadline_for_call(self, ttft_budget_s: float | None) -> float | None:
        """The deadline bounding every wait before a request's first chunk: the retry deadline
        when the request has a budget; None without one (each wait then has the backend's
        ``timeout_s``, as before)."""
        return self.retry_deadline_for_call(ttft_budget_s) if ttft_budget_s is not None else None

    def whole_answer_deadline(self, ttft_budget_s: float | None, params: Mapping[str, Any]) -> float | None:
        """The deadline of a request that cannot be streamed (``n > 1``), whose first byte comes
        after the whole answer: the call's deadline plus twice the time the profile says its
        ``n × max_tokens`` take to decode. None (each wait bounded by ``timeout_s`` only) without
        a budget or without ``max_tokens``."""
        base = self.deadline_for_call(ttft_budget_s)
        max_tokens = params.get("max_completion_tokens") or params.get("max_tokens")
        n = params.get("n") or 1
        speed = self.profile.decode_tokens_per_s
        if base is None or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (max_tokens, n)):
            return None
        if not isinstance(speed, (int, float)) or not math.isfinite(speed) or speed <= 0:
            return None
        return base + 2.0 * n * max_tokens / speed

    def _bound_side_requests(self) -> None:
        """Retry (and, with a default budget, bound) the side requests made while a call is planned
        (tokenize, server facts) within the default budget's deadline too; construction (a server
        still loading, a calibration) had the backend's own."""
        self.backend.retry_deadline_s = self.retry_deadline_for_call(self.ttft_budget_s)
        self.backend.deadline_s = self.deadline_for_call(self.ttft_budget_s)

    def execute(self, prepared: Prepared, params: Mapping[str, Any]) -> ReportingOpenAIStream:
        """Send a prepared request; a stream of the client's chunks that reports when done."""
        self._last_prepared = prepared
        ts = self.backend.send(prepared.messages, _send_params(params), prompt_tokens=prepared.prompt_tokens,
                               retry_deadline_s=self.retry_deadline_for_call(prepared.budget_s),
                               deadline_s=self.deadline_for_call(prepared.budget_s))
        return ReportingOpenAIStream(ts, self, prepared, params)

    def _report(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any], *, sent: bool = True) -> Report:
        report = super()._report(prepared, m, params, sent=sent)
        warnings = report.warnings
        if not params.get("stream") and m.ttft_s is not None and m.finish_reason is not None and m.timing_source == SOURCE_CLIENT:
            warnings = (*warnings, "the server reported no usage while streaming: the response's usage holds trimkit's counts "
                        "(prompt tokens as trimkit counted them, completion tokens = content chunks)")
        return attrs.evolve(report, warnings=warnings)

    def _model_label(self, params: Mapping[str, Any]) -> str:
        """``model @ url``: the model this call named (or the backend's), and the server."""
        return f"{params.get('model') or self.backend.model_name or ''} @ {self.backend.base_url}"

    # -- create ---------------------------------------------------------------------------------------
    def _begin(self, kwargs: dict[str, Any]) -> tuple[Any, Any, float | None, dict[str, Any], bool]:
        """Split a call's arguments: (messages, rag_chunks, budget, pass-through params, stream)."""
        params = {k: v for k, v in kwargs.items() if not _is_not_given(v)}
        if "messages" not in params:
            raise InvalidMessageError("create() needs messages=[...]")
        messages = params.pop("messages")
        rag_chunks = params.pop("rag_chunks", None)
        budget = params.pop("ttft_budget_s", None)
        stream = params.get("stream", False)
        if stream not in (True, False, None):
            raise InvalidInputError(f"stream must be True or False, got {stream!r}")
        return messages, rag_chunks, budget, params, bool(stream)

    def _with_warning(self, prepared: Prepared, warning: str) -> Prepared:
        return attrs.evolve(prepared, warnings=(*prepared.warnings, warning))

    def _assemble(self, rs: ReportingStream | AsyncReportingStream) -> Any:
        response = assemble_chat_completion(rs.chunks)
        if response["usage"] is None and rs.report is not None:
            response["usage"] = _usage_of(rs.report.measurement)
        return self.backend._as_client_response(response)

    def _create(self, kwargs: dict[str, Any]) -> Any:
        messages, rag_chunks, budget, params, stream = self._begin(kwargs)
        prepared = self.prepare(messages, rag_chunks, params, ttft_budget_s=budget)
        blocker = None if stream else _streaming_blocker(params)
        if blocker is not None:
            prepared = self._with_warning(prepared, blocker)
            self._last_prepared = prepared
            response, m = self.backend.complete(prepared.messages, _send_params(params), prompt_tokens=prepared.prompt_tokens,
                                                measure_ttft=False, retry_deadline_s=self.retry_deadline_for_call(prepared.budget_s),
                                                deadline_s=self.whole_answer_deadline(prepared.budget_s, params))
            self._finished(prepared, m, params)
            return response
        rs = self.execute(prepared, params)
        if stream:
            return rs
        for _ in rs:
            pass
        return self._assemble(rs)


class AsyncTrimmedOpenAI(TrimmedOpenAI):
    """:class:`TrimmedOpenAI` for ``openai.AsyncOpenAI``: ``await chat.completions.create(...)``
    returns the client's ``ChatCompletion``, or with ``stream=True`` an async iterator of its
    chunks with ``.report`` (``async with`` and ``await close()`` work).

    Planning and the server's side requests (tokenize) run in a worker thread, off the event
    loop. Constructing it is synchronous: without a stored profile it calibrates against the
    server there and then, so build it before the loop starts or through ``asyncio.to_thread``.
    """

    _async = True

    async def _acreate(self, kwargs: dict[str, Any]) -> Any:
        messages, rag_chunks, budget, params, stream = self._begin(kwargs)
        prepared = await asyncio.to_thread(self.prepare, messages, rag_chunks, params, ttft_budget_s=budget)
        deadline = self.retry_deadline_for_call(prepared.budget_s)
        blocker = None if stream else _streaming_blocker(params)
        if blocker is not None:
            prepared = self._with_warning(prepared, blocker)
            self._last_prepared = prepared
            response, m = await self.backend.acomplete(prepared.messages, _send_params(params), prompt_tokens=prepared.prompt_tokens,
                                                       measure_ttft=False, retry_deadline_s=deadline,
                                                       deadline_s=self.whole_answer_deadline(prepared.budget_s, params))
            self._finished(prepared, m, params)
            return response
        self._last_prepared = prepared
        ts = await self.backend.asend(prepared.messages, _send_params(params), prompt_tokens=prepared.prompt_tokens, retry_deadline_s=deadline,
                                      deadline_s=self.deadline_for_call(prepared.budget_s))
        ars = AsyncReportingStream(ts, self, prepared, params)
        if stream:
            return ars
        async for _ in ars:
            pass
        return self._assemble(ars)

    def _create(self, kwargs: dict[str, Any]) -> Any:
        raise InvalidInputError("this wrapper wraps an async client: await chat.completions.create(...)")

    def execute(self, prepared: Prepared, params: Mapping[str, Any]) -> ReportingOpenAIStream:
        raise InvalidInputError("this wrapper wraps an async client: await chat.completions.create(...)")

    async def close(self) -> None:  # type: ignore[override]
        """Close the backend's connections and the wrapped client (``await``, as on ``AsyncOpenAI``)."""
        self.backend.close()
        if self.client is not None and callable(getattr(self.client, "close", None)):
            await self.client.close()

    def __enter__(self) -> AsyncTrimmedOpenAI:
        raise InvalidInputError("an async wrapper: use 'async with'")

    async def __aenter__(self) -> AsyncTrimmedOpenAI:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _send_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """What goes to the backend: everything the caller gave but ``stream`` (the backend streams)."""
    return {k: v for k, v in params.items() if k != "stream"}


def wrap_openai(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> TrimmedOpenAI:
    """Wrap an ``openai.OpenAI`` (→ :class:`TrimmedOpenAI`) or ``openai.AsyncOpenAI``
    (→ :class:`AsyncTrimmedOpenAI`) client, or any client shaped like them."""
    if not callable(getattr(getattr(getattr(client, "chat", None), "completions", None), "create", None)):
        raise InvalidInputError(f"cannot wrap {type(client).__name__}: it needs .chat.completions.create (an openai.OpenAI-style client)")
    cls = AsyncTrimmedOpenAI if _client_is_async(client) else TrimmedOpenAI
    return cls(client, ttft_budget_s=ttft_budget_s, **kwargs)


def wrap_url(base_url: str, *, model: str | None = None, ttft_budget_s: float | None = None, api_key: str | None = None,
             asynchronous: bool = False, **kwargs: Any) -> TrimmedOpenAI:
    """The same ``.chat.completions.create(...)`` API for an OpenAI-compatible server, without
    the ``openai`` package: requests go out through ``httpx`` and responses are plain dicts in
    OpenAI's JSON shape (chunk dicts when streaming). ``asynchronous=True`` gives the async
    wrapper. ``model`` names the model when a call does not (default: the server's first);
    other keyword arguments as for :class:`TrimmedOpenAI`. A malformed URL raises
    :class:`~trimkit.errors.InvalidInputError` before anything is sent."""
    backend_kwargs = _split_kwargs(kwargs)
    backend = OpenAIHTTPBackend(base_url, model=model, api_key=api_key, **backend_kwargs)
    cls = AsyncTrimmedOpenAI if asynchronous else TrimmedOpenAI
    chat = cls(None, ttft_budget_s=ttft_budget_s, backend=backend, **kwargs)
    chat._bound_side_requests()
    return chat

