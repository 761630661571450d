"""The ``ollama`` client front-end: ``trimkit.wrap(ollama.Client(...))`` keeps TTFT inside a
budget on Ollama's native API::

    client = ollama.Client(host="http://127.0.0.1:11434")
    chat = trimkit.wrap(client, ttft_budget_s=1.0, model="llama3.2", n_ctx=8192)
    out = chat.chat(model="llama3.2", messages=[...], rag_chunks=[...])   # an ollama.ChatResponse
    print(chat.last_report)

:class:`TrimmedOllama` (``ollama.Client``) and :class:`AsyncTrimmedOllama` (``ollama.AsyncClient``)
are drop-ins for ``chat()``: the client's arguments plus ``rag_chunks=`` and a per-call
``ttft_budget_s=``, every other argument passed through, and the client's own return value (a
``ChatResponse``, or with ``stream=True`` an iterator of them that also has ``.report``). Any
other attribute is the client's own. Requests go through
:class:`~trimkit.backends.ollama.OllamaBackend`; planning, measuring and reporting are the
:class:`~trimkit.pipeline.Pipeline`'s.

``on_truncation``: what a prompt the server cut (fewer tokens evaluated and cached than sent)
does once the answer is in — ``"raise"`` (default) :class:`~trimkit.errors.PromptTruncatedError`
carrying the report, ``"warn"`` a WARNING on the ``trimkit`` logger and in the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from trimkit.backends.base import Measurement
from trimkit.backends.ollama import OllamaBackend, client_tools, plain_messages
from trimkit.errors import InvalidInputError, PromptTruncatedError
from trimkit.frontend import AsyncReportingStream, ReportingStream, send_params
from trimkit.prepared import Prepared
from trimkit.wrapper import Trimmer

__all__ = ["TrimmedOllama", "AsyncTrimmedOllama", "OllamaStream", "wrap_ollama", "assemble_chat_response", "cold_load_note"]

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
        for _ in out:
            pass
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
        async for _ in out:
            pass
        return assemble_chat_response(out.chunks)


def wrap_ollama(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> TrimmedOllama:
    """Wrap an ``ollama.Client`` (→ :class:`TrimmedOllama`) or ``ollama.AsyncClient``
    (→ :class:`AsyncTrimmedOllama`)."""
    cls = AsyncTrimmedOllama if isinstance(getattr(client, "_client", None), httpx.AsyncClient) else TrimmedOllama
    return cls(client, ttft_budget_s=ttft_budget_s, **kwargs)

