"""The engine behind a LangChain chat model, reached through trimkit.

A LangChain chat model for a local engine already holds the client trimkit wraps:
``ChatLlamaCpp.client`` is a ``llama_cpp.Llama``, ``ChatOpenAI.root_client`` an ``openai.OpenAI``
pointed at its ``base_url``. :class:`Engine` wraps that client once with :func:`trimkit.wrap`
(the stored profile of that engine, else a micro-calibration through that very client, bounded
as ``wrap`` bounds it), and :class:`Call` stands in for the client during one request: the
LangChain model converts its messages and parameters exactly as it always does and calls
``create_chat_completion(...)`` (``ChatLlamaCpp``) or ``chat.completions.create(...)``
(``ChatOpenAI``) on the stand-in, which plans the request with trimkit and sends it through the
wrapper. trimkit streams every request (the only way to see the first token); the stand-in
always returns the stream, and a non-streamed call is assembled from it by LangChain.

``ChatOllama`` talks Ollama's own API, which trimkit does not speak: point a ``ChatOpenAI`` at
Ollama's OpenAI-compatible endpoint (``base_url="http://localhost:11434/v1"``) instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from trimkit.backends.clients import client_kind
from trimkit.errors import InvalidInputError
from trimkit.integrations.langchain_documents import find_context
from trimkit.messages import Chunk
from trimkit.prepared import Prepared
from trimkit.report import Report
from trimkit.wrapper import wrap

__all__ = ["Engine", "Call", "Unsupported", "inner_client"]


def inner_client(inner: Any) -> tuple[str, Any]:
    """(``"llama"`` or ``"openai"``, the client) of a LangChain chat model trimkit can reach;
    :class:`~trimkit.errors.InvalidInputError` for any other."""
    client = getattr(inner, "client", None)
    if client_kind(client) == "llama":
        return "llama", client
    root = getattr(inner, "root_client", None)
    if client_kind(root) == "openai":
        return "openai", root
    name = type(inner).__name__
    if name == "ChatOllama":
        raise InvalidInputError(
            "ChatOllama talks Ollama's own API, which trimkit does not speak: use langchain_openai.ChatOpenAI("
            "base_url='http://localhost:11434/v1', api_key='ollama', model=...) (Ollama's OpenAI-compatible endpoint)"
        )
    raise InvalidInputError(
        f"cannot trim {name}: pass a ChatLlamaCpp (langchain-community; its .client is a llama_cpp.Llama) or a ChatOpenAI "
        "pointed at a local OpenAI-compatible server (langchain-openai); bind tools and arguments on the TrimmedChatModel, not before"
    )


class Unsupported:
    """Stands in for a client attribute trimkit cannot put a budget on (the Responses API,
    ``response_format`` streaming helpers, raw responses, the async client): using it raises
    instead of sending a request around the budget."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise InvalidInputError(f"{self._what}.{name} is not supported through trimkit: it would send the request without its budget")


class Engine:
    """The trimkit wrapper of the engine an inner chat model talks to, shared by its requests.

    ``options`` are :func:`trimkit.wrap`'s (``profile``, ``strategies``, ``values``,
    ``on_infeasible``, ``on_busy``, ``calibration``, ``rag_template``, ...)."""

    def __init__(self, inner: Any, ttft_budget_s: float | None, options: Mapping[str, Any]) -> None:
        self.kind, client = inner_client(inner)
        options = dict(options)
        if self.kind == "openai":
            options.setdefault("model", getattr(inner, "model_name", None))
        try:
            #: the trimkit wrapper (``TrimmedLlama`` or ``TrimmedOpenAI``): ``.profile``, ``.reports``, ...
            self.chat = wrap(client, ttft_budget_s=ttft_budget_s, **options)
        except TypeError as exc:  # an option trimkit.wrap does not take
            raise InvalidInputError(f"TrimmedChatModel: {exc}") from None
        # a request found its context in the prompt: it is planned with its own RAG templates
        # (the wrapper's are swapped while it is prepared, so every preparation holds the lock)
        self._lock = threading.Lock()

    def client_fields(self, call: Call) -> dict[str, Any]:
        """What a copy of the inner model takes in place of its client(s) for one request."""
        if self.kind == "llama":
            return {"client": call}
        return {
            "client": call,
            "root_client": Unsupported("ChatOpenAI.root_client"),
            "async_client": Unsupported("ChatOpenAI.async_client"),
            "root_async_client": Unsupported("ChatOpenAI.root_async_client"),
            "include_response_headers": False,
        }

    def prepare(self, messages: Sequence[Mapping[str, Any]], chunks: tuple[Chunk, ...] | None, params: Mapping[str, Any], *,
                ttft_budget_s: float | None, on_busy: str | None) -> tuple[Prepared, float]:
        """Plan one request (``chunks`` None: look for a context in the prompt). Returns the
        prepared request and the seconds spent finding the context (this layer's own work)."""
        t0 = time.perf_counter()
        match = find_context(messages) if chunks is None and messages else None
        found_s = time.perf_counter() - t0
        pipeline = self.chat.pipeline
        with self._lock:
            if match is None:
                return self.chat.prepare(messages, chunks, params, ttft_budget_s=ttft_budget_s, on_busy=on_busy), found_s
            saved = (pipeline.rag_template, pipeline.rag_chunk_template)
            pipeline.rag_template, pipeline.rag_chunk_template = match.rag_template, match.rag_chunk_template
            try:
                return self.chat.prepare(match.messages, match.chunks, params, ttft_budget_s=ttft_budget_s, on_busy=on_busy), found_s
            finally:
                pipeline.rag_template, pipeline.rag_chunk_template = saved


class Call:
    """The inner model's client for one request: plans it with trimkit and sends it (streamed).

    ``create_chat_completion(messages=..., **params)`` is ``ChatLlamaCpp``'s call,
    ``create(messages=..., **payload)`` ``ChatOpenAI``'s (its ``max_completion_tokens``, an
    OpenAI-only name local servers ignore, is sent as ``max_tokens``, which the user set)."""

    def __init__(self, engine: Engine, chunks: tuple[Chunk, ...] | None, ttft_budget_s: float | None, on_busy: str | None) -> None:
        self.engine = engine
        self.chunks = chunks
        self.ttft_budget_s = ttft_budget_s
        self.on_busy = on_busy
        self.prepared: Prepared | None = None
        self.stream: Any = None
        #: seconds this layer spent on its own work during the call (not trimkit's planning)
        self.layer_s = 0.0

    @property
    def report(self) -> Report | None:
        """The request's report, once its stream is finished."""
        return getattr(self.stream, "report", None)

    def create_chat_completion(self, messages: Any = None, **params: Any) -> Any:
        return self._send(messages, params)

    def create(self, **payload: Any) -> Any:
        messages = payload.pop("messages", None)
        if "max_completion_tokens" in payload and "max_tokens" not in payload:
            payload["max_tokens"] = payload.pop("max_completion_tokens")
        return self._send(messages, payload)

    def _send(self, messages: Any, params: dict[str, Any]) -> Any:
        if self.stream is not None:
            raise InvalidInputError("one TrimmedChatModel call sends one request")
        params = {**params, "stream": True}
        self.prepared, found_s = self.engine.prepare(messages, self.chunks, params, ttft_budget_s=self.ttft_budget_s, on_busy=self.on_busy)
        self.layer_s += found_s
        self.stream = self.engine.chat.execute(self.prepared, params)
        return self.stream

    def close(self) -> None:
        """End the stream if the caller stopped reading it early (frees an in-process engine)."""
        if self.stream is not None and self.report is None:
            self.stream.close()
