"""The engine behind a LangChain chat model, reached through trimkit.

A LangChain chat model for a local engine already holds the client trimkit wraps:
``ChatLlamaCpp.client`` is a ``llama_cpp.Llama``, ``ChatOpenAI.root_client`` an ``openai.OpenAI``
pointed at its ``base_url``. :class:`Engine` wraps that client once with :func:`trimkit.wrap`
(the stored profile of that engine, else a micro-calibration through that very client, bounded
as ``wrap`` bounds it), and :class:`Call` stands in for the client during one request: the
LangChain model converts its messages and parameters exactly as it always does and calls
``create_chat_completion(...)`` (``ChatLlamaCpp``) or ``chat.completions.create(...)``
(``ChatOpenAI``) on the stand-in, which plans the request with trimkit and sends it through the
wrapper. trimkit streams every request (the only way to see the first token): a streamed call
gets the stream, a non-streamed call the completion assembled from it
(:func:`~trimkit.backends.completion.assemble_chat_completion`: the reply the inner model would
have got, with ``usage``), which the inner model then turns into its ``AIMessage`` as always.

``ChatOllama`` talks Ollama's own API, which trimkit does not speak: point a ``ChatOpenAI`` at
Ollama's OpenAI-compatible endpoint (``base_url="http://localhost:11434/v1"``) instead.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from trimkit.backends.base import client_kind
from trimkit.backends.replies import assemble_chat_completion
from trimkit.errors import BackendError, InvalidInputError
from trimkit.frontend import usage_counts
from trimkit.integrations.langchain_documents import find_context
from trimkit.integrations.openai_errors import as_openai_error
from trimkit.messages import Chunk
from trimkit.prepared import Prepared
from trimkit.report import Report
from trimkit.wrapper import wrap

__all__ = ["Engine", "Call", "Unsupported", "inner_client", "as_openai_error", "check_options"]


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


def _option_names(kind: str) -> frozenset[str]:
    """The keyword arguments :func:`trimkit.wrap` takes for an engine of this kind."""
    from trimkit.openai_wrapper import BACKEND_KWARGS, TrimmedOpenAI
    from trimkit.pipeline import Pipeline

    names = {n for n, p in inspect.signature(Pipeline.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
    if kind == "openai":
        names |= set(BACKEND_KWARGS) | {n for n, p in inspect.signature(TrimmedOpenAI.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
    return frozenset(names - {"backend", "ttft_budget_s"})


def check_options(kind: str, options: Mapping[str, Any]) -> None:
    """An option :func:`trimkit.wrap` does not take raises now, before anything is measured."""
    unknown = sorted(set(options) - _option_names(kind))
    if unknown:
        raise InvalidInputError(f"TrimmedChatModel: unexpected option(s) {', '.join(map(repr, unknown))} (trimkit.wrap's options, or the chat model's fields)")


class Engine:
    """The trimkit wrapper of the engine an inner chat model talks to, shared by its requests.

    ``options`` are :func:`trimkit.wrap`'s (``profile``, ``strategies``, ``values``,
    ``on_infeasible``, ``on_busy``, ``calibration``, ``rag_template``, ...).

    Nothing is measured here: the wrapper (the stored profile, else a calibration through the
    inner model's client) is made on first use (:attr:`chat`), so that building a chat model
    does no I/O (recorded-HTTP test harnesses, start-up time)."""

    def __init__(self, inner: Any, ttft_budget_s: float | None, options: Mapping[str, Any]) -> None:
        self.kind, self._client = inner_client(inner)
        options = dict(options)
        check_options(self.kind, options)
        if self.kind == "openai":
            options.setdefault("model", getattr(inner, "model_name", None))
        self._options = options
        self._ttft_budget_s = ttft_budget_s
        self._chat: Any = None
        self._made = threading.Lock()
        # a request found its context in the prompt: it is planned with its own RAG templates
        # (the wrapper's are swapped while it is prepared, so every preparation holds the lock)
        self._lock = threading.Lock()
        # llama-cpp-python's server (by default) cuts the stream in flight short when another
        # request arrives, even a tokenize request: its requests go one at a time (serial())
        self._one_at_a_time = threading.Lock()

    @property
    def chat(self) -> Any:
        """The trimkit wrapper (``TrimmedLlama`` or ``TrimmedOpenAI``): ``.profile``, ``.reports``,
        ... Made on first use: the stored profile, else a micro-calibration through the client."""
        chat = self._chat
        if chat is None:
            with self._made:
                if self._chat is None:
                    try:
                        self._chat = wrap(self._client, ttft_budget_s=self._ttft_budget_s, **self._options)
                    except TypeError as exc:  # an option trimkit.wrap does not take
                        raise InvalidInputError(f"TrimmedChatModel: {exc}") from None
                chat = self._chat
        return chat

    @property
    def made(self) -> bool:
        """Whether the wrapper exists yet (the first request makes it)."""
        return self._chat is not None

    def serial(self) -> threading.Lock | None:
        """The lock every request to this engine holds from its planning to the end of its
        stream where the server interrupts the stream in flight when another request arrives
        (``python -m llama_cpp.server``, whose ``interrupt_requests`` is on by default; the
        non-streamed calls the raw chat model sends are not cut there): None elsewhere."""
        if self.kind != "openai":
            return None
        backend = getattr(self.chat, "backend", None)
        info = getattr(backend, "server_info", None)
        try:
            engine = info().engine if info is not None else "unknown"
        except Exception:  # the request itself will say what is wrong with the server
            return None
        return self._one_at_a_time if engine == "llama-cpp-python" else None

    def client_fields(self, call: Call) -> dict[str, Any]:
        """What a copy of the inner model takes in place of its client(s) for one request."""
        if self.kind == "llama":
            return {"client": call}
        return {
            "client": call,
            "root_client": _RootClient(call),
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


class _Raw:
    """What ``with_raw_response.create(...)`` returns: ``.parse()`` is the reply; no headers."""

    def __init__(self, reply: Any) -> None:
        self._reply = reply
        self.headers: dict[str, str] = {}

    def parse(self) -> Any:
        return self._reply


class _RawCreate:
    def __init__(self, create: Any) -> None:
        self._create = create

    def create(self, **payload: Any) -> _Raw:
        return _Raw(self._create(**payload))

    parse = create


class _Completions:
    """``root_client.chat.completions`` for one request: ``parse`` (``response_format``
    structured output, non-streamed) goes through trimkit; the rest cannot keep the budget."""

    def __init__(self, call: Call) -> None:
        self.with_raw_response = _RawCreate(call.parse)
        self.parse = call.parse

    def __getattr__(self, name: str) -> Any:
        return getattr(Unsupported("ChatOpenAI.root_client.chat.completions"), name)


class _Chat:
    def __init__(self, call: Call) -> None:
        self.completions = _Completions(call)

    def __getattr__(self, name: str) -> Any:
        return getattr(Unsupported("ChatOpenAI.root_client.chat"), name)


class _RootClient:
    """``ChatOpenAI.root_client`` for one request: ``chat.completions.parse`` through trimkit,
    anything else (the Responses API, ``beta`` streaming helpers) raises before sending."""

    def __init__(self, call: Call) -> None:
        self.chat = _Chat(call)

    def __getattr__(self, name: str) -> Any:
        return getattr(Unsupported("ChatOpenAI.root_client"), name)


class _Converting:
    """The stream a ``ChatOpenAI`` reads: trimkit's, its backend errors raised as
    :func:`as_openai_error` makes them (``ChatOpenAI`` handles ``openai.APIError`` as always)."""

    def __init__(self, stream: Any, url: str) -> None:
        self._stream = stream
        self._url = url

    def __iter__(self) -> Any:
        try:
            yield from self._stream
        except BackendError as exc:
            raise as_openai_error(exc, self._url) from exc

    def __enter__(self) -> _Converting:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._stream.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Call:
    """The inner model's client for one request: plans it with trimkit and sends it (streamed).

    ``create_chat_completion(messages=..., **params)`` is ``ChatLlamaCpp``'s call,
    ``create(messages=..., **payload)`` ``ChatOpenAI``'s (its ``max_completion_tokens``, an
    OpenAI-only name local servers ignore, is sent as ``max_tokens``, which the user set), and
    ``with_raw_response.create`` / ``root_client.chat.completions.parse`` its non-streamed and
    ``response_format`` calls. A streamed call returns the stream; a non-streamed one drains it
    and returns the assembled completion (a dict for ``ChatLlamaCpp``, the client's
    ``ChatCompletion`` — ``ParsedChatCompletion`` for ``parse`` — for ``ChatOpenAI``)."""

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

    @property
    def with_raw_response(self) -> _RawCreate:
        return _RawCreate(self.create)

    def create(self, **payload: Any) -> Any:
        messages = payload.pop("messages", None)
        if "max_completion_tokens" in payload and "max_tokens" not in payload:
            payload["max_tokens"] = payload.pop("max_completion_tokens")
        return self._send(messages, payload)

    def parse(self, **payload: Any) -> Any:
        """``chat.completions.parse``: ``response_format`` (a pydantic class, sent as the
        ``openai`` client sends it, or a dict) and ``tools`` through trimkit, the reply parsed by
        the ``openai`` client's own parser."""
        from openai import omit
        from openai.lib._parsing._completions import parse_chat_completion, type_to_response_format_param

        response_format = payload.get("response_format")
        if isinstance(response_format, type):
            payload["response_format"] = type_to_response_format_param(response_format)
        tools = payload.get("tools")
        completion = self.create(**payload)
        return parse_chat_completion(response_format=response_format if response_format is not None else omit,
                                     input_tools=tools if tools is not None else omit, chat_completion=completion)

    def _send(self, messages: Any, params: dict[str, Any]) -> Any:
        if self.stream is not None:
            raise InvalidInputError("one TrimmedChatModel call sends one request")
        streamed = bool(params.get("stream", False))
        params = {**params, "stream": True}
        try:
            serial = self.engine.serial()
            if serial is not None:
                serial.acquire()
                self._serial = serial
            self.prepared, found_s = self.engine.prepare(messages, self.chunks, params, ttft_budget_s=self.ttft_budget_s, on_busy=self.on_busy)
            self.layer_s += found_s
            self.stream = self.engine.chat.execute(self.prepared, params)
            if streamed:
                return self.stream if self.engine.kind == "llama" else _Converting(self.stream, self._url())
            for _ in self.stream:
                pass
        except BackendError as exc:
            self.close()
            if self.engine.kind == "openai":
                raise as_openai_error(exc, self._url()) from exc
            raise
        except BaseException:
            self.close()
            raise
        self.release()
        return self._assembled()

    def _assembled(self) -> Any:
        """The completion of the drained stream, as the inner model's client returns it."""
        rs = self.stream
        if self.engine.kind == "openai":
            return self.engine.chat.assemble(rs)
        report = rs.report
        completion_tokens = report.completion_tokens if report is not None else None
        return assemble_chat_completion(rs.chunks, usage=usage_counts(len(rs.prepared.prompt_tokens), completion_tokens or 0))

    def _url(self) -> str:
        base = getattr(getattr(self.engine.chat, "backend", None), "base_url", None) or "http://localhost/v1"
        return str(base).rstrip("/") + "/chat/completions"

    _serial: threading.Lock | None = None

    def release(self) -> None:
        """Let the engine's next request go (where requests go one at a time)."""
        serial, self._serial = self._serial, None
        if serial is not None:
            serial.release()

    def close(self) -> None:
        """End the stream if the caller stopped reading it early (frees an in-process engine),
        and let the engine's next request go."""
        try:
            if self.stream is not None and self.report is None:
                self.stream.close()
        finally:
            self.release()
