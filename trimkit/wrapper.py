"""The drop-in wrapper ``trimkit.wrap(client, ttft_budget_s=...)`` and the in-process and Ollama front-ends (the OpenAI-client ones are
:mod:`trimkit.openai_wrapper`). Each holds a :class:`~trimkit.pipeline.Pipeline` and only sends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import httpx

from trimkit.backends.base import Backend, Io, Measurement, Steps, client_kind, run_async, run_sync
from trimkit.backends.ollama import OllamaBackend, client_tools, plain_messages
from trimkit.backends.replies import assemble_chat_completion
from trimkit.errors import InvalidInputError, PromptTruncatedError
from trimkit.fleet import wrap_fleet
from trimkit.frontend import AsyncReportingStream, FrontEnd, ReportingStream, adrain, drain, send_params, usage_counts
from trimkit.messages import validate_messages
from trimkit.openai_wrapper import in_thread, wrap_openai
from trimkit.pipeline import Pipeline, Prepared
from trimkit.planning.queue import DEFAULT_ENGINE_WAIT_S, EngineLease, wait_bound_s
from trimkit.report import Report

if TYPE_CHECKING:
    from trimkit.backends.llama import LlamaBackend


class Trimmer(FrontEnd):
    """A :class:`~trimkit.backends.base.Backend` behind a TTFT budget, with the chat API of ``llama_cpp.Llama``; :meth:`prepare` plans a request and
    :meth:`execute` sends it. Keyword arguments are those of :func:`wrap`."""

    is_async = False

    def __init__(self, backend: Backend, **kwargs: Any) -> None:
        self.pipeline = Pipeline(backend, **kwargs)

    def execute(self, prepared: Prepared, params: Mapping[str, Any]) -> ReportingStream:
        """Send a prepared request: a stream that reports when done. An in-process engine is taken here for the stream, waiting at most the budget (else
        ``engine_wait_s``) plus twice the predicted wait (then :class:`~trimkit.errors.EngineBusyError`); the wait is reported."""
        return run_sync(self._send(prepared, params))

    def _send(self, prepared: Prepared, params: Mapping[str, Any]) -> Steps:
        """:meth:`execute`, sync or async: the stream, holding an in-process engine (its lease's section, the request's ticket
        in its queue until the stream ends) and watched while it prefills where the backend can."""
        backend = self.pipeline.backend
        lease = getattr(backend, "engine", None)
        section: AbstractContextManager[float] = contextlib.nullcontext(0.0)
        if isinstance(lease, EngineLease):
            bound = wait_bound_s(prepared.budget_s, prepared.queue_wait_s, getattr(backend, "engine_wait_s", DEFAULT_ENGINE_WAIT_S))
            section = lease.section(bound, prepared.ticket)
        with section as waited:
            if prepared.snapshot is not None:
                backend.restore_prefix(prepared.snapshot)  # type: ignore[attr-defined]
            watch = self.pipeline.watched(prepared, waited_s=waited)
            extra = {"watch": watch} if watch is not None else {}
            ts = yield Io(backend.send, getattr(backend, "asend", backend.send), prepared.messages, send_params(params), prompt_tokens=prepared.prompt_tokens,
                          **extra)
        if waited:
            ts.queue_s = getattr(ts, "queue_s", 0.0) + waited
        prepared = self.pipeline.sent(prepared, waited_s=waited, watch=watch)
        return (AsyncReportingStream if self.is_async else ReportingStream)(ts, self.pipeline, prepared, params, watch=watch)

    def create_chat_completion(self, messages: Any = None, **kwargs: Any) -> Any:
        """Like ``Llama.create_chat_completion`` inside the TTFT budget, plus ``rag_chunks=``, ``ttft_budget_s=`` and ``on_busy=``: a ``chat.completion``
        dict, or with ``stream=True`` a :class:`ReportingStream` (with ``.report``)."""
        rag_chunks = kwargs.pop("rag_chunks", None)
        budget = kwargs.pop("ttft_budget_s", None)
        on_busy = kwargs.pop("on_busy", None)
        prepared = self.prepare(messages, rag_chunks, kwargs, ttft_budget_s=budget, on_busy=on_busy, send_now=True)
        rs = self.execute(prepared, kwargs)
        if kwargs.get("stream", False):
            return rs
        drain(rs)
        return self.assemble(rs)

    def assemble(self, rs: ReportingStream) -> dict[str, Any]:
        """The ``chat.completion`` dict of a drained stream, its ``usage`` the request as sent."""
        completion_tokens = rs.report.completion_tokens if rs.report is not None else None
        return assemble_chat_completion(rs.chunks, usage=usage_counts(len(rs.prepared.prompt_tokens), completion_tokens or 0))


class TrimmedLlama(Trimmer):
    """A ``llama_cpp.Llama`` whose chat calls keep TTFT inside a budget; any other attribute is the ``Llama``'s own."""

    backend: LlamaBackend
    _drop_in = "llm"

    def __init__(self, llm: Any, *, backend: LlamaBackend | None = None, **kwargs: Any) -> None:
        self.llm = llm
        if backend is None:
            from trimkit.backends.llama import LlamaBackend  # a Llama was passed: llama-cpp-python is installed

            backend = LlamaBackend(llm)
        super().__init__(backend, **kwargs)

    def prewarm(self, messages: Any, *, keep: bool = True) -> Any:
        """Prefill a stable prefix (system prompt, pinned documents) off the critical path; with ``keep`` also store its KV state, which a later
        conversation starting with it restores. Returns the snapshot (or None)."""
        validate_messages(messages)
        tokens = self.backend.tokenizer.prompt_tokens(messages)
        prefix = tokens[: max(len(tokens) - 1, 1)]
        if keep:
            return self.backend.save_prefix(prefix)
        self.backend.prefill(prefix)
        return None


def wrap(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> Any:
    """Wrap the client you already use so that each chat request meets a TTFT budget: a ``llama_cpp.Llama``, an OpenAI-style client, an ``ollama`` client, a
    trimkit ``Backend``, or a list of OpenAI-style clients (a fleet). ``kwargs``: the table in ``docs/reference.md``."""
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
def cold_load_note(m: Measurement, params: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The report's note when Ollama loaded the model for this request and the load is a tenth or
    more of the server's own time to the first token (load + prefill, as the server timed them)."""
    load = m.server.get("load_s")
    if not isinstance(load, float) or load <= 0 or load < 0.1 * (load + (m.engine_prefill_s or 0.0)):
        return ()
    return (f"cold load: Ollama loaded the model for {load:.3f} s before this request (load_duration); it is in the measured TTFT, "
            "not a prefill, and not learned — keep the model loaded (keep_alive) to avoid it",)


def assemble_chat_response(chunks: list[Any]) -> Any:
    """The ``ChatResponse`` of ``stream=False``: the final line's numbers with the message joined."""
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


class TrimmedOllama(Trimmer):
    """An ``ollama.Client`` whose ``chat()`` keeps TTFT inside a budget. ``model``: the model to calibrate and to name when a call does not; ``n_ctx``: the
    context window every request asks for (default 4096, Ollama's own); ``chat_format``: the template for counting (default: a ChatML estimate);
    ``on_truncation``: ``"raise"`` (a prompt the server cut raises :class:`PromptTruncatedError` when the stream ends) or ``"warn"``."""

    def __init__(self, client: Any, ttft_budget_s: float | None = None, *, model: str | None = None, n_ctx: int | None = None,
                 n_batch: int | None = None, chat_format: str | None = None, on_truncation: str = "raise", **kwargs: Any) -> None:
        if on_truncation not in ("raise", "warn"):
            raise InvalidInputError(f"on_truncation must be one of ('raise', 'warn'), got {on_truncation!r}")
        backend = OllamaBackend(client, model=model, n_ctx=n_ctx, n_batch=n_batch, chat_format=chat_format)
        if backend.client_is_async != self.is_async:
            raise InvalidInputError(f"{type(client).__name__} is {'an async' if backend.client_is_async else 'a sync'} client: "
                                    f"use {'AsyncTrimmedOllama' if backend.client_is_async else 'TrimmedOllama'} (or trimkit.wrap)")
        self.client = client
        self.on_truncation = on_truncation
        kwargs.setdefault("report_notes", cold_load_note)
        kwargs.setdefault("model_label", lambda params: f"{params.get('model') or model or ''} @ {backend.base_url}")
        super().__init__(backend, ttft_budget_s=ttft_budget_s, **kwargs)

    def _truncated(self, report: Report | None) -> None:
        missing = report.measurement.truncated_tokens if report is not None else 0
        if missing and self.on_truncation == "raise":
            raise PromptTruncatedError(f"the server took in {missing} fewer prompt tokens than trimkit sent: it cut the prompt to its "
                                       f"context window (num_ctx={self.backend.n_ctx}); raise n_ctx (and the server's memory) or "
                                       "shorten the prompt", truncated_tokens=missing, report=report)

    def _prepare(self, model: str, messages: Any, kwargs: dict[str, Any]) -> tuple[Prepared, dict[str, Any], bool]:
        """Split a ``chat()`` call: the plan, the parameters to send, and ``stream``."""
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
        """``client.chat(...)`` inside the TTFT budget, plus ``rag_chunks=`` and ``ttft_budget_s=``:
        the client's ``ChatResponse`` (``stream=True``: an iterator of them with ``.report``)."""
        return run_sync(self._chat(model, messages, kwargs))

    def _chat(self, model: str, messages: Any, kwargs: dict[str, Any]) -> Steps:
        """A ``chat()`` call, sync or async (planned in a worker thread): sent, and drained unless streamed."""
        prepared, params, stream = yield Io(self._prepare, in_thread(self._prepare), model, messages, kwargs)
        out = yield from self._send(prepared, params)
        out.at_end = self._truncated
        if stream:
            return out
        yield Io(drain, adrain, out)
        return assemble_chat_response(out.chunks)

    def close(self) -> None:
        self.backend.close()


class AsyncTrimmedOllama(TrimmedOllama):
    """:class:`TrimmedOllama` for ``ollama.AsyncClient``: ``await chat.chat(...)``. Planning runs
    in a worker thread; building the wrapper is synchronous (it may calibrate)."""

    is_async = True

    async def chat(self, model: str = "", messages: Any = None, **kwargs: Any) -> Any:
        """``await client.chat(...)`` inside the TTFT budget (:meth:`TrimmedOllama.chat`)."""
        return await run_async(self._chat(model, messages, kwargs))


def wrap_ollama(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> TrimmedOllama:
    """Wrap an ``ollama.Client`` (→ :class:`TrimmedOllama`) or ``ollama.AsyncClient`` (→ :class:`AsyncTrimmedOllama`)."""
    cls = AsyncTrimmedOllama if isinstance(getattr(client, "_client", None), httpx.AsyncClient) else TrimmedOllama
    return cls(client, ttft_budget_s=ttft_budget_s, **kwargs)
