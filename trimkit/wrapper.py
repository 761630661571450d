"""The drop-in wrapper ``trimkit.wrap(client, ttft_budget_s=...)`` and the in-process and Ollama
front-ends (the OpenAI-client ones are :mod:`trimkit.openai_wrapper`). Each holds a
:class:`~trimkit.pipeline.Pipeline` (validate → plan → measure → report) and only sends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import httpx

from trimkit.backends.base import Backend, Measurement, client_kind
from trimkit.backends.ollama import OllamaBackend, client_tools, plain_messages
from trimkit.backends.replies import assemble_chat_completion
from trimkit.errors import InvalidInputError, PromptTruncatedError
from trimkit.fleet import wrap_fleet
from trimkit.frontend import AsyncReportingStream, FrontEnd, ReportingStream, adrain, drain, send_params, usage_counts
from trimkit.messages import validate_messages
from trimkit.openai_wrapper import wrap_openai
from trimkit.pipeline import Pipeline, Prepared
from trimkit.planning.queue import DEFAULT_ENGINE_WAIT_S, EngineLease, wait_bound_s

if TYPE_CHECKING:
    from trimkit.backends.llama import LlamaBackend


class Trimmer(FrontEnd):
    """A :class:`~trimkit.backends.base.Backend` behind a TTFT budget, with the chat API of
    ``llama_cpp.Llama`` (:meth:`create_chat_completion`); :meth:`prepare` plans a request and
    :meth:`execute` sends it, returning a :class:`ReportingStream`. Keyword arguments are those
    of :func:`wrap`."""

    def __init__(self, backend: Backend, **kwargs: Any) -> None:
        #: validate → plan → measure → report; this front-end only sends
        self.pipeline = Pipeline(backend, **kwargs)

    def execute(self, prepared: Prepared, params: Mapping[str, Any]) -> ReportingStream:
        """Send a prepared request; returns a stream of the engine's chunks that reports when done.

        An in-process engine is taken here, once, for the stream (restoring a snapshot and
        starting the stream are one step; requests are served first come, first served); the
        stream gives it back when it is finished, closed or garbage-collected, from any thread.
        This waits at most the request's TTFT budget
        (without one, the backend's ``engine_wait_s``) plus twice the wait predicted for it
        (:func:`~trimkit.planning.queue.wait_bound_s`), then raises
        :class:`~trimkit.errors.EngineBusyError`. The wait is reported (``measurement.queue_s``
        and a warning) and counted in the TTFT the report compares with the prediction
        (``report.measured_ttft_s``), not in ``measurement.ttft_s``."""
        backend = self.pipeline.backend
        ticket = getattr(prepared, "ticket", None)
        if ticket is not None:
            ticket.sent()  # in the count again: it waits for the engine now
        try:
            with self._engine_section(prepared) as waited:
                if ticket is not None:
                    ticket.holding()
                if prepared.snapshot is not None:
                    backend.restore_prefix(prepared.snapshot)  # type: ignore[attr-defined]
                # a budgeted request on an engine that evaluates in steps is watched while it prefills
                watch = self.pipeline.watched(prepared, waited_s=waited or 0.0)
                extra = {"watch": watch} if watch is not None else {}
                ts = backend.send(prepared.messages, send_params(params), prompt_tokens=prepared.prompt_tokens, **extra)
        except BaseException:
            if ticket is not None:
                ticket.done()  # never sent: out of the engine's queue
            raise
        if ticket is not None:
            ticket.attach(ts)
        if waited:
            ts.queue_s = getattr(ts, "queue_s", 0.0) + waited
        prepared = self.pipeline.sent(prepared, waited_s=waited or 0.0)
        if watch is not None:
            watch.prepared = prepared
        return ReportingStream(ts, self.pipeline, prepared, params, watch=watch)

    def _engine_section(self, prepared: Prepared) -> AbstractContextManager[float]:
        """The engine for this request (yields the seconds waited): a section of its lease;
        ``hold_engine`` for a backend without a lease; nothing for a server."""
        backend = self.pipeline.backend
        bound = wait_bound_s(prepared.budget_s, getattr(prepared, "queue_wait_s", None), getattr(backend, "engine_wait_s", DEFAULT_ENGINE_WAIT_S))
        lease = getattr(backend, "engine", None)
        if isinstance(lease, EngineLease):
            return lease.section(bound)
        hold_engine = getattr(backend, "hold_engine", None)
        return hold_engine(bound) if hold_engine is not None else contextlib.nullcontext(0.0)

    def create_chat_completion(self, messages: Any = None, **kwargs: Any) -> Any:
        """Like ``Llama.create_chat_completion``, inside the TTFT budget: the same arguments plus
        ``rag_chunks=``, a per-call ``ttft_budget_s=`` and ``on_busy=``; every other argument
        passes through unchanged. Returns a ``chat.completion`` dict, or with ``stream=True`` a
        :class:`ReportingStream` of the engine's chunks (with ``.report``)."""
        rag_chunks = kwargs.pop("rag_chunks", None)
        budget = kwargs.pop("ttft_budget_s", None)
        on_busy = kwargs.pop("on_busy", None)
        prepared = self.prepare(messages, rag_chunks, kwargs, ttft_budget_s=budget, on_busy=on_busy)
        rs = self.execute(prepared, kwargs)
        if kwargs.get("stream", False):
            return rs
        drain(rs)
        return self.assemble(rs)

    def assemble(self, rs: ReportingStream) -> dict[str, Any]:
        """The ``chat.completion`` dict of a drained stream, its ``usage`` trimkit's counts of the
        request as sent (a watched prefill's re-plan may have changed it)."""
        completion_tokens = rs.report.completion_tokens if rs.report is not None else None
        return assemble_chat_completion(rs.chunks, usage=usage_counts(len(rs.prepared.prompt_tokens), completion_tokens or 0))


class TrimmedLlama(Trimmer):
    """A ``llama_cpp.Llama`` whose chat calls keep TTFT inside a budget: ``create_chat_completion``
    as :meth:`Trimmer.create_chat_completion`; any other attribute is the wrapped ``Llama``'s own."""

    backend: LlamaBackend

    def __init__(self, llm: Any, *, backend: LlamaBackend | None = None, **kwargs: Any) -> None:
        self.llm = llm
        if backend is None:
            from trimkit.backends.llama import LlamaBackend  # a Llama was passed: llama-cpp-python is installed

            backend = LlamaBackend(llm)
        super().__init__(backend, **kwargs)

    def __getattr__(self, name: str) -> Any:  # drop-in: everything else is the Llama's
        if name in ("llm", "pipeline"):
            raise AttributeError(name)
        return getattr(self.llm, name)

    def prewarm(self, messages: Any, *, keep: bool = True) -> Any:
        """Prefill a known, stable prefix (system prompt, pinned documents) off the critical path.

        The rendered ``messages`` (without the generation prompt's last tokens) are evaluated
        into the KV cache; with ``keep`` their KV state (not the logits) is also stored, so a
        later conversation that starts with the same prefix restores it instead of prefilling
        it again — the restore time is counted in predictions. Returns the snapshot (or None).
        """
        validate_messages(messages)
        tokens = self.backend.tokenizer.prompt_tokens(messages)
        prefix = tokens[: max(len(tokens) - 1, 1)]
        if keep:
            return self.backend.save_prefix(prefix)
        self.backend.prefill(prefix)
        return None


def wrap(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> Any:
    """Wrap the client you already use so that each chat request meets a TTFT budget.

    ``client`` is a ``llama_cpp.Llama`` (→ :class:`TrimmedLlama`), an OpenAI-style client with
    ``.chat.completions.create`` (→ :func:`~trimkit.openai_wrapper.wrap_openai`), an
    ``ollama.Client`` / ``ollama.AsyncClient`` (→ :func:`wrap_ollama`), a trimkit
    :class:`~trimkit.backends.base.Backend` (→ :class:`Trimmer`), or a list of OpenAI-style
    clients, all sync or all async (→ a fleet: :func:`trimkit.fleet.wrap_fleet`). Each returned
    wrapper is a drop-in for the client's chat API. ``kwargs`` (``strategies``, ``values``,
    ``on_infeasible``, ``profile``, ``calibration``, ``watch_prefill``, ``summarizer``,
    ``attainment_target``, ``on_busy``, ``endpoint_label``, ``report_log``,
    ``tokens_per_s_target``, ``rag_template``, ...): the table in ``docs/reference.md``.
    """
    if isinstance(client, (list, tuple)):
        return wrap_fleet(client, ttft_budget_s, **kwargs)
    kind = client_kind(client)
    if kind == "llama":
        return TrimmedLlama(client, ttft_budget_s=ttft_budget_s, **kwargs)
    if kind == "backend":
        return Trimmer(client, ttft_budget_s=ttft_budget_s, **kwargs)
    if kind == "openai":
        return wrap_openai(client, ttft_budget_s=ttft_budget_s, **kwargs)
    if kind == "ollama":
        return wrap_ollama(client, ttft_budget_s=ttft_budget_s, **kwargs)
    raise InvalidInputError(
        f"cannot wrap {type(client).__name__}: pass a llama_cpp.Llama, an OpenAI-style client (with .chat.completions.create) "
        "or an ollama.Client"
    )


# -- the ``ollama`` client front-end: ``trimkit.wrap(ollama.Client(...))`` -------------------------------

_ON_TRUNCATION = ("raise", "warn")


def cold_load_note(m: Measurement, params: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The report's note when Ollama loaded the model for this request (``load_duration``) and
    the load is a tenth or more of the server's own time to the first token (load + prefill,
    both as the server timed them, so network noise does not move it): counted in the measured
    TTFT, not a prefill, and not learned (the pipeline learns the TTFT without it)."""
    load = m.server.get("load_s")
    if not isinstance(load, float) or load <= 0 or load < 0.1 * (load + (m.engine_prefill_s or 0.0)):
        return ()
    return (f"cold load: Ollama loaded the model for {load:.3f} s before this request (load_duration); it is in the measured TTFT, "
            "not a prefill, and not learned — keep the model loaded (keep_alive) to avoid it",)


def assemble_chat_response(chunks: list[Any]) -> Any:
    """The ``ChatResponse`` the client returns for ``stream=False``, from the streamed lines:
    the final line's numbers with the message joined (content, thinking, tool calls, logprobs)."""
    import ollama

    final = next((c for c in reversed(chunks) if getattr(c, "done", False)), chunks[-1])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(c.message.content or "" for c in chunks)}
    thinking = "".join(c.message.thinking or "" for c in chunks if getattr(c.message, "thinking", None))
    if thinking:
        message["thinking"] = thinking
    tool_calls = [call for c in chunks for call in (c.message.tool_calls or ())]
    if tool_calls:
        message["tool_calls"] = tool_calls
    data = final.model_dump(exclude_none=True)
    data["message"] = message
    logprobs = [lp for c in chunks for lp in (getattr(c, "logprobs", None) or ())]
    if logprobs:
        data["logprobs"] = logprobs
    return ollama.ChatResponse(**data)


class OllamaStream:
    """What ``chat(stream=True)`` returns: iterate it like the client's own iterator of
    ``ChatResponse`` (``async for`` for :class:`AsyncTrimmedOllama`); ``.report`` is set once it
    is exhausted, and a prompt the server cut raises :class:`PromptTruncatedError` then (with
    ``on_truncation="raise"``). ``close()`` (awaited when async) and ``with`` work."""

    def __init__(self, inner: ReportingStream | AsyncReportingStream, front: TrimmedOllama) -> None:
        self.inner = inner
        self.front = front

    @property
    def report(self) -> Any:
        return self.inner.report

    @property
    def chunks(self) -> list[Any]:
        return self.inner.chunks

    def _check(self) -> None:
        report = self.report
        missing = report.measurement.truncated_tokens if report is not None else 0
        if missing and self.front.on_truncation == "raise":
            raise PromptTruncatedError(f"the server took in {missing} fewer prompt tokens than trimkit sent: it cut the prompt to its "
                                       f"context window (num_ctx={self.front.backend.n_ctx}); raise n_ctx (and the server's memory) or "
                                       "shorten the prompt", truncated_tokens=missing, report=report)

    def __iter__(self) -> OllamaStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.inner)  # type: ignore[arg-type]
        except StopIteration:
            self._check()
            raise

    def __aiter__(self) -> OllamaStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.inner.__anext__()  # type: ignore[union-attr]
        except StopAsyncIteration:
            self._check()
            raise

    def close(self) -> Any:
        return self.inner.close()

    def __enter__(self) -> OllamaStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.close()

    async def __aenter__(self) -> OllamaStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.inner.close()  # type: ignore[misc]


class TrimmedOllama(Trimmer):
    """An ``ollama.Client`` whose ``chat()`` keeps TTFT inside a budget.

    ``model``: the model to calibrate and to name when a call does not; ``n_ctx``: the context
    window every request asks for (``options.num_ctx``) and the plan keeps prompt + answer
    (``options.num_predict``) inside — default 4096, Ollama's own default below 24 GiB of memory;
    ``chat_format``: the model's chat template for counting (default: a ChatML estimate,
    corrected by the server's counts); ``on_truncation``: ``"raise"`` or ``"warn"``. Other
    keyword arguments are :func:`trimkit.wrap`'s."""

    is_async = False

    def __init__(self, client: Any, ttft_budget_s: float | None = None, *, model: str | None = None, n_ctx: int | None = None,
                 n_batch: int | None = None, chat_format: str | None = None, on_truncation: str = "raise", **kwargs: Any) -> None:
        if on_truncation not in _ON_TRUNCATION:
            raise InvalidInputError(f"on_truncation must be one of {_ON_TRUNCATION}, got {on_truncation!r}")
        backend = OllamaBackend(client, model=model, n_ctx=n_ctx, n_batch=n_batch, chat_format=chat_format)
        if backend.client_is_async != self.is_async:
            raise InvalidInputError(f"{type(client).__name__} is {'an async' if backend.client_is_async else 'a sync'} client: "
                                    f"use {'AsyncTrimmedOllama' if backend.client_is_async else 'TrimmedOllama'} (or trimkit.wrap)")
        self.client = client
        self.on_truncation = on_truncation
        kwargs.setdefault("report_notes", cold_load_note)
        kwargs.setdefault("model_label", lambda params: f"{params.get('model') or model or ''} @ {backend.base_url}")
        super().__init__(backend, ttft_budget_s=ttft_budget_s, **kwargs)

    def __getattr__(self, name: str) -> Any:  # drop-in: everything else is the client's
        client = self.__dict__.get("client")
        if client is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(client, name)

    def _prepare(self, model: str, messages: Any, kwargs: dict[str, Any]) -> tuple[Prepared, dict[str, Any], bool]:
        """Split a ``chat()`` call: trimkit's arguments, the plan, and the parameters to send."""
        stream = kwargs.pop("stream", False)
        if not isinstance(stream, bool):
            raise InvalidInputError(f"stream must be a bool, got {type(stream).__name__}")
        rag_chunks = kwargs.pop("rag_chunks", None)
        budget = kwargs.pop("ttft_budget_s", None)
        params = {k: v for k, v in kwargs.items() if v is not None}
        if params.get("tools"):  # Python functions become their schema here, as the client makes them: counted as sent
            params["tools"] = client_tools(params["tools"])
        if model:
            params["model"] = model
        options = params.get("options")
        predict = (options.get("num_predict") if isinstance(options, Mapping) else getattr(options, "num_predict", None))
        if isinstance(predict, int) and not isinstance(predict, bool) and predict > 0:
            params["max_tokens"] = predict  # the answer the context must leave room for (planning only; sent as num_predict)
        prepared = self.prepare(plain_messages(messages if messages is not None else []), rag_chunks, params, ttft_budget_s=budget)
        return prepared, params, stream

    def chat(self, model: str = "", messages: Any = None, **kwargs: Any) -> Any:
        """``client.chat(...)`` inside the TTFT budget: the same arguments plus ``rag_chunks=``
        and ``ttft_budget_s=``; the client's ``ChatResponse`` (``stream=True``: an iterator of
        them with ``.report``)."""
        prepared, params, stream = self._prepare(model, messages, kwargs)
        out = OllamaStream(self.execute(prepared, params), self)
        if stream:
            return out
        drain(out)
        return assemble_chat_response(out.chunks)

    def close(self) -> None:
        self.backend.close()


class AsyncTrimmedOllama(TrimmedOllama):
    """:class:`TrimmedOllama` for ``ollama.AsyncClient``: ``await chat.chat(...)``. Planning runs
    in a worker thread, off the event loop; building the wrapper is synchronous (it may
    calibrate: build it before the loop starts, or through ``asyncio.to_thread``)."""

    is_async = True

    async def chat(self, model: str = "", messages: Any = None, **kwargs: Any) -> Any:
        import asyncio

        prepared, params, stream = await asyncio.to_thread(self._prepare, model, messages, kwargs)
        prepared = self.pipeline.sent(prepared)
        ts = await self.backend.asend(prepared.messages, send_params(params), prompt_tokens=prepared.prompt_tokens)
        out = OllamaStream(AsyncReportingStream(ts, self.pipeline, prepared, params), self)
        if stream:
            return out
        await adrain(out)
        return assemble_chat_response(out.chunks)


def wrap_ollama(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> TrimmedOllama:
    """Wrap an ``ollama.Client`` (→ :class:`TrimmedOllama`) or ``ollama.AsyncClient``
    (→ :class:`AsyncTrimmedOllama`)."""
    cls = AsyncTrimmedOllama if isinstance(getattr(client, "_client", None), httpx.AsyncClient) else TrimmedOllama
    return cls(client, ttft_budget_s=ttft_budget_s, **kwargs)

