"""trimkit for LangChain (``pip install trimkit[langchain]``): :class:`TrimmedChatModel` wraps a
``ChatLlamaCpp`` or a local ``ChatOpenAI``, whose own ``_generate``/``_stream`` run on a stand-in
client (:class:`Call`) sending through :func:`trimkit.wrap`; :func:`trimkit_context` formats and
remembers retrieved documents so a later trimkit step finds them (:func:`find_context`);
:func:`trimkit_trimmer` only plans. Usage and where trimkit differs: ``docs/integrations.md``.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

try:
    from langchain_core.callbacks import CallbackManager, CallbackManagerForLLMRun, dispatch_custom_event
    from langchain_core.language_models import BaseChatModel
    from langchain_core.language_models.base import LangSmithParams
    from langchain_core.load.serializable import Serializable
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, convert_to_messages, convert_to_openai_messages
    from langchain_core.outputs import ChatGenerationChunk, ChatResult
    from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda
    from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"trimkit.integrations.langchain needs langchain-core: pip install 'trimkit[langchain]' ({exc})") from exc

from trimkit.backends.base import client_kind
from trimkit.errors import InvalidBudgetError, InvalidChunkError, InvalidInputError, InvalidMessageError
from trimkit.errors import budget as valid_budget
from trimkit.frontend import drain
from trimkit.integrations import openai_errors
from trimkit.messages import DEFAULT_RAG_CHUNK_TEMPLATE, SYSTEM_ROLES, Chunk, check_rag_templates, coerce_chunks, last_user_index, render_rag_question
from trimkit.pipeline import Prepared
from trimkit.planning.planner import Plan, plan
from trimkit.planning.profile import Profile
from trimkit.report import Report
from trimkit.wrapper import wrap

__all__ = ["TrimmedChatModel", "trimkit_trimmer", "trimkit_context", "TrimkitTrimmer", "REPORT_EVENT", "PLAN_EVENT"]

#: metadata keys read as a document's relevance score, in this order (higher = more relevant)
SCORE_KEYS = ("score", "relevance_score", "similarity_score", "similarity")
#: metadata keys read as a document's id when ``Document.id`` is empty, in this order
ID_KEYS = ("id", "doc_id", "chunk_id", "document_id")
#: how many formatted contexts are remembered (the most recent): a prompt is formatted and sent within one chain call
MAX_REMEMBERED = 256
#: the name of the custom callback event carrying ``report.to_dict()``
REPORT_EVENT = "trimkit_report"
#: the name of the custom callback event carrying ``plan.to_dict()``
PLAN_EVENT = "trimkit_plan"
#: the chat-model fields taken from the inner model unless given: what LangChain reads from the model it runs
INHERITED_FIELDS = ("callbacks", "tags", "metadata", "verbose", "cache", "rate_limiter", "disable_streaming", "output_version",
                    "custom_get_token_ids")
#: the per-call keywords trimkit takes (never sent to the inner model)
CALL_KEYWORDS = ("rag_chunks", "ttft_budget_s", "on_busy")

_BODY_ONLY = "{chunks}{question}"  # renders the chunks alone (the question is empty)
#: the recently formatted contexts: text -> (chunks, chunk template), most recent last
_CONTEXTS: collections.OrderedDict[str, tuple[tuple[Chunk, ...], str]] = collections.OrderedDict()
_CONTEXTS_LOCK = threading.Lock()


def _is_document(value: Any) -> bool:
    return isinstance(getattr(value, "page_content", None), str) and isinstance(getattr(value, "metadata", None), Mapping)


def document_chunk(doc: Any, index: int = 0) -> Chunk:
    """One ``Document`` as a :class:`~trimkit.messages.Chunk`: its id (else :data:`ID_KEYS`), the
    first of :data:`SCORE_KEYS` as its score; :class:`~trimkit.errors.InvalidChunkError` if invalid."""
    meta: Mapping[str, Any] = doc.metadata
    doc_id = getattr(doc, "id", None)
    if doc_id in (None, ""):
        doc_id = next((meta[k] for k in ID_KEYS if meta.get(k) not in (None, "")), None)
    score = next((meta[k] for k in SCORE_KEYS if meta.get(k) is not None), None)
    try:  # a score that is not a number, an empty text: Chunk says
        return Chunk(text=doc.page_content, score=score, id=None if doc_id is None else str(doc_id))
    except InvalidChunkError as exc:
        raise InvalidChunkError(f"rag_chunks[{index}]: {exc}") from None


def as_chunks(documents: Any) -> tuple[Chunk, ...]:
    """``rag_chunks`` as trimkit takes them: Documents converted, the rest as given, then validated (None: none)."""
    if isinstance(documents, Sequence) and not isinstance(documents, (str, bytes)):
        documents = [document_chunk(d, i) if _is_document(d) else d for i, d in enumerate(documents)]
    return coerce_chunks(documents)


def format_documents(documents: Any, chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE) -> str:
    """Documents (a list, or one) as a prompt's context text, remembered for :func:`find_context` (none: ``""``)."""
    chunks = as_chunks([documents] if _is_document(documents) else documents)
    if not chunks:
        return ""
    text = render_rag_question("", chunks, _BODY_ONLY, chunk_template)  # as trimkit places chunks in a prompt
    with _CONTEXTS_LOCK:
        _CONTEXTS[text] = (chunks, chunk_template)
        _CONTEXTS.move_to_end(text)
        while len(_CONTEXTS) > MAX_REMEMBERED:
            _CONTEXTS.popitem(last=False)
    return text


def trimkit_context(chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE) -> Any:
    """An LCEL step formatting retrieved documents for a prompt's context, in place of ``format_docs``;
    ``chunk_template`` must be the trimkit step's ``rag_chunk_template`` (both default to ``"[{id}] {text}"``)."""
    check_rag_templates(_BODY_ONLY, chunk_template)
    return RunnableLambda(lambda docs: format_documents(docs, chunk_template), name="trimkit_context")


def find_context(messages: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], tuple[Chunk, ...], str, str] | None:
    """The remembered context in the last user message: ``(messages without it, its chunks, a
    rag_template putting them back where it was, its chunk template)``, or None."""
    i = last_user_index(messages)
    content = messages[i].get("content")
    if not isinstance(content, str):
        return None
    with _CONTEXTS_LOCK:
        entries = list(_CONTEXTS.items())
    for text, (chunks, chunk_template) in reversed(entries):  # the newest match, the usual one
        if text in content:
            before, after = content.split(text, 1)
            out = list(messages)
            out[i] = {**messages[i], "content": before + after}
            escaped = [s.replace("{", "{{").replace("}", "}}") for s in (before, after)]
            return out, chunks, escaped[0] + "{chunks}" + escaped[1] + "{question:.0}", chunk_template
    return None


class Unsupported:
    """A client attribute trimkit cannot budget (the Responses API, the async client, ...): using it
    raises instead of sending around the budget. ``kept``: the attributes that go through trimkit."""

    def __init__(self, what: str, **kept: Any) -> None:
        self._what = what
        self.__dict__.update(kept)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise InvalidInputError(f"{self._what}.{name} is not supported through trimkit: it would send the request without its budget")


def check_options(kind: str, options: Mapping[str, Any]) -> None:
    """Raise now, before anything is measured, for an option :func:`trimkit.wrap` does not take."""
    from trimkit.openai_wrapper import BACKEND_KWARGS, TrimmedOpenAI
    from trimkit.pipeline import Pipeline

    def keyword_only(fn: Any) -> set[str]:
        return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}

    names = keyword_only(Pipeline.__init__)
    if kind == "openai":
        names |= set(BACKEND_KWARGS) | keyword_only(TrimmedOpenAI.__init__)
    unknown = sorted(set(options) - (names - {"backend", "ttft_budget_s"}))
    if unknown:
        raise InvalidInputError(f"TrimmedChatModel: unexpected option(s) {', '.join(map(repr, unknown))} (trimkit.wrap's options, or the chat model's fields)")


class Engine:
    """The trimkit wrapper of the engine an inner chat model talks to, shared by its requests; made
    on first use (:attr:`chat`), so that building a chat model does no I/O."""

    def __init__(self, inner: Any, ttft_budget_s: float | None, options: Mapping[str, Any]) -> None:
        self._args = (inner, ttft_budget_s, dict(options))
        client, root = getattr(inner, "client", None), getattr(inner, "root_client", None)
        if client_kind(client) == "llama":
            self.kind, self._client = "llama", client
        elif client_kind(root) == "openai":
            self.kind, self._client = "openai", root
        else:
            raise InvalidInputError(f"cannot trim {type(inner).__name__}: pass a ChatLlamaCpp (langchain-community) or a ChatOpenAI pointed at a "
                                    "local OpenAI-compatible server (langchain-openai; for Ollama: base_url='http://localhost:11434/v1'); "
                                    "bind tools and arguments on the TrimmedChatModel")
        check_options(self.kind, options)
        self._wrap_options = {"ttft_budget_s": ttft_budget_s, **options}
        if self.kind == "openai":
            self._wrap_options.setdefault("model", getattr(inner, "model_name", None))
        self._chat: Any = None
        # held while the wrapper is made and while a request is prepared (one found in the prompt swaps the RAG templates)
        self.lock = threading.RLock()
        # llama-cpp-python's server (by default) cuts the stream in flight short when another request arrives, even a tokenize request
        self._one_at_a_time = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        return Engine, self._args  # pickled as made: locks and the wrapper are made again (on first use)

    @property
    def chat(self) -> Any:
        if self._chat is None:
            with self.lock:
                if self._chat is None:
                    try:
                        self._chat = wrap(self._client, **self._wrap_options)
                    except TypeError as exc:  # an option trimkit.wrap does not take
                        raise InvalidInputError(f"TrimmedChatModel: {exc}") from None
        return self._chat

    def serial(self) -> threading.Lock | None:
        """The lock each request holds from planning to its stream's end on ``python -m llama_cpp.server``
        (its ``interrupt_requests`` cuts a stream when another request arrives); None elsewhere."""
        if self.kind != "openai":
            return None
        info = getattr(getattr(self.chat, "backend", None), "server_info", None)
        try:
            engine = info().engine if info is not None else "unknown"
        except Exception:  # the request itself will say what is wrong with the server
            return None
        return self._one_at_a_time if engine == "llama-cpp-python" else None

    def client_fields(self, call: Call) -> dict[str, Any]:
        if self.kind == "llama":
            return {"client": call}
        return {
            "client": call,
            # chat.completions.parse (``response_format``, non-streamed) through trimkit; anything else raises before sending
            "root_client": Unsupported("ChatOpenAI.root_client", chat=Unsupported("ChatOpenAI.root_client.chat", completions=Unsupported(
                "ChatOpenAI.root_client.chat.completions", parse=call.parse, with_raw_response=_with_raw_response(call.parse)))),
            "async_client": Unsupported("ChatOpenAI.async_client"),
            "root_async_client": Unsupported("ChatOpenAI.root_async_client"),
            "include_response_headers": False,
        }


def _with_raw_response(create: Any) -> Any:
    """``with_raw_response``: its ``create``/``parse`` return a raw response whose ``.parse()`` is the reply (no headers)."""
    def raw(**payload: Any) -> Any:
        reply = create(**payload)
        return types.SimpleNamespace(parse=lambda: reply, headers={})

    return types.SimpleNamespace(create=raw, parse=raw)


def _converting(stream: Any, base_url: str | None) -> Iterator[Any]:
    """The stream a ``ChatOpenAI`` reads (in a ``with``): trimkit's, its backend errors as the ``openai`` errors."""
    with openai_errors(base_url):
        yield from stream


class Call:
    """The inner model's client for one request (``ChatLlamaCpp``'s ``create_chat_completion``, ``ChatOpenAI``'s
    ``create``/``parse``): plans it with trimkit and sends it streamed; a non-streamed call gets the
    completion assembled as the inner model's client returns it."""

    def __init__(self, engine: Engine, chunks: tuple[Chunk, ...] | None, ttft_budget_s: float | None, on_busy: str | None) -> None:
        self.engine = engine
        self.chunks = chunks
        self.ttft_budget_s = ttft_budget_s
        self.on_busy = on_busy
        self.stream: Any = None
        self.layer_s = 0.0  # this layer's own seconds during the call (not trimkit's planning)
        self._serial: threading.Lock | None = None

    @property
    def report(self) -> Report | None:
        return getattr(self.stream, "report", None)

    @property
    def with_raw_response(self) -> Any:
        return _with_raw_response(self.create)

    def parse(self, **payload: Any) -> Any:
        """``chat.completions.parse``: ``response_format`` sent as the ``openai`` client sends it, the reply parsed by its parser."""
        from openai import omit
        from openai.lib._parsing._completions import parse_chat_completion, type_to_response_format_param

        response_format = payload.get("response_format")
        if isinstance(response_format, type):
            payload["response_format"] = type_to_response_format_param(response_format)
        tools = payload.get("tools")
        completion = self.create(**payload)
        return parse_chat_completion(response_format=response_format if response_format is not None else omit,
                                     input_tools=tools if tools is not None else omit, chat_completion=completion)

    def create(self, **payload: Any) -> Any:
        """The request (``ChatLlamaCpp``'s ``create_chat_completion``, ``ChatOpenAI``'s ``create``), planned and sent streamed."""
        if self.stream is not None:
            raise InvalidInputError("one TrimmedChatModel call sends one request")
        messages = payload.pop("messages", None)
        if "max_completion_tokens" in payload and "max_tokens" not in payload:  # an OpenAI-only name local servers ignore
            payload["max_tokens"] = payload.pop("max_completion_tokens")
        streamed = bool(payload.get("stream", False))
        params = {**payload, "stream": True}
        try:
            base_url = getattr(self.engine.chat.backend, "base_url", None)
            with openai_errors(base_url, self.engine.kind == "openai"):
                serial = self.engine.serial()
                if serial is not None:
                    serial.acquire()
                    self._serial = serial
                self.stream = self.engine.chat.execute(self._prepare(messages, params), params)
                if streamed:
                    return self.stream if self.engine.kind == "llama" else contextlib.closing(_converting(self.stream, base_url))
                drain(self.stream)
        except BaseException:
            self.close()
            raise
        self.close()
        return self.engine.chat.assemble(self.stream)

    create_chat_completion = create

    def _prepare(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Prepared:
        """Plan the request; without ``rag_chunks``, with the context :func:`find_context` finds in the prompt, put back where it was."""
        t0 = time.perf_counter()
        chunks, match = self.chunks, find_context(messages) if self.chunks is None and messages else None
        self.layer_s += time.perf_counter() - t0
        chat = self.engine.chat
        with self.engine.lock:
            saved = (chat.pipeline.rag_template, chat.pipeline.rag_chunk_template)
            if match is not None:
                messages, chunks, chat.pipeline.rag_template, chat.pipeline.rag_chunk_template = match
            try:
                return chat.prepare(messages, chunks, params, ttft_budget_s=self.ttft_budget_s, on_busy=self.on_busy, send_now=True)
            finally:
                chat.pipeline.rag_template, chat.pipeline.rag_chunk_template = saved

    def close(self) -> None:
        """End a stream the caller stopped reading early (frees an in-process engine); let the next request go."""
        serial, self._serial = self._serial, None
        try:
            if self.stream is not None and self.report is None:
                self.stream.close()
        finally:
            if serial is not None:
                serial.release()


def _emit(data: dict[str, Any], run_manager: CallbackManagerForLLMRun | None) -> None:
    """The report as a custom callback event: with the model's run when LangChain gave it one, else the enclosing run's."""
    if run_manager is not None:
        if run_manager.handlers:
            manager = CallbackManager(handlers=run_manager.handlers, inheritable_handlers=run_manager.inheritable_handlers,
                                      parent_run_id=run_manager.parent_run_id, tags=run_manager.tags, metadata=run_manager.metadata)
            manager.on_custom_event(REPORT_EVENT, data, run_id=run_manager.run_id)
        return
    with contextlib.suppress(RuntimeError):  # not inside a run
        dispatch_custom_event(REPORT_EVENT, data)


def _retarget(node: Any, inner: BaseChatModel, outer: BaseChatModel) -> tuple[Any, bool]:
    """``node`` (a runnable the inner model built around itself) with ``outer`` in place of ``inner``; and whether it was found."""
    if node is inner:
        return outer, True
    if isinstance(node, (list, tuple)):
        items = [_retarget(x, inner, outer) for x in node]
        return type(node)(x for x, _ in items), any(f for _, f in items)
    if isinstance(node, dict):
        pairs = {k: _retarget(v, inner, outer) for k, v in node.items()}
        return {k: v for k, (v, _) in pairs.items()}, any(f for _, f in pairs.values())
    if not isinstance(node, Runnable) or not isinstance(node, BaseModel):
        return node, False
    update = {}
    for name in type(node).model_fields:
        value = getattr(node, name, None)
        if isinstance(value, (Runnable, list, tuple, dict)):
            new, found = _retarget(value, inner, outer)
            if found:
                update[name] = new
    return (node.model_copy(update=update), True) if update else (node, False)


class TrimmedChatModel(BaseChatModel):
    """A LangChain chat model keeping each request's TTFT inside a budget (``docs/integrations.md``). LangChain
    fields in ``options`` configure it (unset ones are ``inner``'s, :data:`INHERITED_FIELDS`), the rest go
    to :func:`trimkit.wrap`. Per call: ``rag_chunks=``, ``ttft_budget_s=``, ``on_busy=``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    #: the wrapped chat model (never modified: each request uses a copy holding trimkit's stand-in client)
    inner: BaseChatModel
    ttft_budget_s: float | None = None
    #: the options given to :func:`trimkit.wrap`
    trimkit_options: dict[str, Any] = Field(default_factory=dict, repr=False)

    _engine: Engine = PrivateAttr()
    _last_report: Report | None = PrivateAttr(default=None)
    _last_layer_s: float | None = PrivateAttr(default=None)

    def __init__(self, inner: Any = None, /, ttft_budget_s: float | None = None, **options: Any) -> None:
        if inner is None:  # TrimmedChatModel(inner=...), as langchain_core.load rebuilds it
            inner = options.pop("inner", None)
        options.update(options.pop("trimkit_options", None) or {})
        if isinstance(inner, TrimmedChatModel):
            raise InvalidInputError("this chat model is trimmed already")
        if not isinstance(inner, BaseChatModel):
            raise InvalidInputError(f"TrimmedChatModel wraps a LangChain chat model (ChatLlamaCpp, ChatOpenAI), got {type(inner).__name__}")
        # ``profile`` is trimkit's (a BaseChatModel's ``profile`` field, its capabilities, is the inner model's)
        fields = set(type(self).model_fields) - {"inner", "ttft_budget_s", "trimkit_options", "profile"}
        own = {k: options.pop(k) for k in list(options) if k in fields}
        for name in INHERITED_FIELDS:  # and ``output_version`` where the inner model's class sets one
            if name not in own and (name in inner.model_fields_set or name == "output_version" and inner.output_version is not None):
                own[name] = getattr(inner, name)
        if ttft_budget_s is not None:
            valid_budget(ttft_budget_s)
        engine = Engine(inner, ttft_budget_s, options)  # checks the options; measures nothing
        super().__init__(inner=inner, ttft_budget_s=ttft_budget_s, trimkit_options=options, **own)
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        """Any other public attribute is the inner model's (``model_name``, ``openai_api_key``, ...)."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            inner = self.__dict__.get("inner")
            if name.startswith("_") or inner is None:
                raise
            return getattr(inner, name)

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    def to_json(self) -> Any:
        """Serialisable (``dumpd``/``load``) where the inner model is and trimkit's options are JSON."""
        import json

        if not self.inner.is_lc_serializable():
            return self.to_json_not_implemented()
        try:
            json.dumps(self.trimkit_options)
        except (TypeError, ValueError):
            return self.to_json_not_implemented()
        return Serializable.to_json(self)

    @property
    def trimkit(self) -> Any:
        """The trimkit wrapper requests go through (``TrimmedLlama`` or ``TrimmedOpenAI``), made on first use."""
        return self._engine.chat

    @property
    def last_report(self) -> Report | None:
        """The report of the most recent finished request through this model (any thread)."""
        return self._last_report

    @property
    def last_layer_s(self) -> float | None:
        """Seconds this integration's own code took in the most recent request (not trimkit's planning, not LangChain's)."""
        return self._last_layer_s

    def _resolve_model_profile(self) -> Any:
        return self.inner.profile  # LangChain's model profile (context window, tool calling, ...)

    @property
    def _llm_type(self) -> str:
        return f"trimkit-{self.inner._llm_type}"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self.inner._identifying_params, "trimkit_inner": self.inner._llm_type, "ttft_budget_s": self.ttft_budget_s}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self.inner._get_ls_params(stop=stop, **{k: v for k, v in kwargs.items() if k not in CALL_KEYWORDS})

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any) -> Runnable[Any, BaseMessage]:
        """Bind tools as ``inner.bind_tools`` formats and checks them, on this model."""
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        bound = self.inner.bind_tools(tools, **kwargs)
        if getattr(bound, "bound", None) is not self.inner or not isinstance(getattr(bound, "kwargs", None), dict):
            raise InvalidInputError(f"{type(self.inner).__name__}.bind_tools did not return a binding of the model: bind its tools on it directly")
        return self.bind(**bound.kwargs)

    def with_structured_output(self, schema: Any = None, *, include_raw: bool = False, **kwargs: Any) -> Runnable[Any, Any]:
        """``inner.with_structured_output(...)`` (its schema conversion and parser) with its model calls going through trimkit."""
        runnable = self.inner.with_structured_output(schema, include_raw=include_raw, **kwargs)
        retargeted, found = _retarget(runnable, self.inner, self)
        if not found:
            raise InvalidInputError(f"{type(self.inner).__name__}.with_structured_output built no call of the model trimkit can send: "
                                    "use the model's bind_tools and an output parser")
        return retargeted

    def _call(self, kwargs: dict[str, Any]) -> tuple[Call, BaseChatModel]:
        t0 = time.perf_counter()
        docs, budget = kwargs.pop("rag_chunks", None), kwargs.pop("ttft_budget_s", None)
        call = Call(self._engine, None if docs is None else as_chunks(docs), self.ttft_budget_s if budget is None else budget,
                    kwargs.pop("on_busy", None))
        inner = self.inner.model_copy(update=self._engine.client_fields(call))
        call.layer_s += time.perf_counter() - t0
        return call, inner

    def _finish(self, call: Call, run_manager: CallbackManagerForLLMRun | None, messages: Sequence[BaseMessage], fill_usage: bool = True) -> None:
        """Record and emit the report of a finished request; attach it (and trimkit's counts where there are none) to ``messages``."""
        t0 = time.perf_counter()
        report = call.report
        data = None
        if report is not None:
            self._last_report = report
            data = report.to_dict()
            _emit(data, run_manager)
        m = getattr(report, "measurement", None)
        prompt, completion = getattr(m, "prompt_tokens", None), getattr(m, "completion_tokens", None)
        usage = None
        if fill_usage and prompt is not None and completion is not None:  # trimkit's counts: the prompt as sent
            usage = {"input_tokens": int(prompt), "output_tokens": int(completion), "total_tokens": int(prompt) + int(completion)}
        for message in messages:
            message.response_metadata = {**message.response_metadata, "trimkit": data}
            if isinstance(message, AIMessage) and message.usage_metadata is None and usage is not None:
                message.usage_metadata = usage  # type: ignore[assignment]
        self._last_layer_s = call.layer_s + time.perf_counter() - t0

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        """The inner model's own ``_generate`` on the stand-in client, plus ``response_metadata["trimkit"]``."""
        call, inner = self._call(kwargs)
        try:
            result = inner._generate(messages, stop=stop, run_manager=run_manager, **kwargs)
            self._finish(call, run_manager, [g.message for g in result.generations])
        finally:
            call.close()
        return result

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """The inner model's chunks, then a last one carrying the report."""
        call, inner = self._call(kwargs)
        try:
            had_usage = False
            for chunk in inner._stream(messages, stop=stop, run_manager=run_manager, **kwargs):
                had_usage = had_usage or getattr(chunk.message, "usage_metadata", None) is not None
                yield chunk
            last = AIMessageChunk(content="", chunk_position="last")
            self._finish(call, run_manager, [last], fill_usage=not had_usage)
        finally:
            call.close()
        yield ChatGenerationChunk(message=last)


def as_langchain_messages(sent: Sequence[Mapping[str, Any]], planned: Sequence[Mapping[str, Any]], originals: Sequence[BaseMessage],
                          converted: Sequence[Mapping[str, Any]]) -> list[BaseMessage]:
    """The dicts ``sent`` (a plan of ``planned``) as LangChain messages: ``originals[i]`` itself where
    ``converted[i]`` was sent, a copy with the new content where edited, else converted."""
    at = {id(d): i for i, d in enumerate(planned)}
    kept = {id(d) for d in sent}
    out: list[BaseMessage] = []
    for d in sent:
        i = at.get(id(d))
        if i is None and d.get("role") == "user":  # the last user message, edited
            i = last_user_index(planned)
        elif i is None and d.get("role") in SYSTEM_ROLES:  # the first system message not sent as it was
            i = next((j for j, p in enumerate(planned) if p.get("role") in SYSTEM_ROLES and id(p) not in kept), None)
        if i is None:
            out.append(convert_to_messages([d])[0])
        else:
            out.append(originals[i] if d is converted[i] else originals[i].model_copy(update={"content": d.get("content")}))
    return out


class TrimkitTrimmer(Runnable[Any, list[BaseMessage]]):
    """An LCEL step trimming a prompt's messages to a TTFT budget (it plans only) with ``target``'s engine and
    settings: a :class:`TrimmedChatModel`, a trimkit wrapper, a ``ChatLlamaCpp`` / ``ChatOpenAI``, or a ``Profile``
    with ``tokenizer=``; ``plan_options`` go to :func:`trimkit.plan`. ``last_plan`` is also sent as :data:`PLAN_EVENT`."""

    def __init__(self, target: Any, ttft_budget_s: float | None = None, *, tokenizer: Any = None, **plan_options: Any) -> None:
        self.wrapper: Any = None
        self.profile: Profile | None = None
        self.tokenizer = tokenizer
        if isinstance(target, Profile):
            if tokenizer is None:
                raise InvalidInputError("trimkit_trimmer(profile) needs tokenizer=: the engine's PromptTokenizer (e.g. chat.backend.tokenizer)")
            self.profile = target
        elif getattr(getattr(target, "trimkit", None), "pipeline", None) is not None:  # a TrimmedChatModel
            self.wrapper = target.trimkit
        elif getattr(target, "pipeline", None) is not None and getattr(target, "backend", None) is not None:  # trimkit.wrap(...)
            self.wrapper = target
        elif isinstance(target, BaseChatModel):
            self.wrapper = Engine(target, ttft_budget_s, {}).chat
        else:
            raise InvalidInputError(f"trimkit_trimmer needs a TrimmedChatModel, a trimkit wrapper, a ChatLlamaCpp/ChatOpenAI or a "
                                    f"trimkit Profile (with tokenizer=), got {type(target).__name__}")
        default = getattr(self.wrapper, "ttft_budget_s", None) if ttft_budget_s is None else ttft_budget_s
        if default is None:
            raise InvalidBudgetError("trimkit_trimmer needs ttft_budget_s= (or a target with a default budget)")
        self.ttft_budget_s = valid_budget(default)
        self.plan_options = plan_options
        self.last_plan: Plan | None = None

    def trim(self, value: Any, ttft_budget_s: float | None = None) -> list[BaseMessage]:
        """Plan ``value`` (a prompt value, messages, a str, or a dict of ``messages`` and ``documents``); return the messages to send."""
        docs = None
        if isinstance(value, Mapping):
            if "messages" not in value:
                raise InvalidMessageError("a dict given to trimkit_trimmer needs 'messages' (and may have 'documents')")
            value, docs = value["messages"], value.get("documents")
        try:  # the caller's own message objects, as they are
            originals = convert_to_messages([HumanMessage(content=value)] if isinstance(value, str) else value)
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise InvalidMessageError(f"trimkit_trimmer takes a prompt value, messages, a str or a dict: {exc}") from None
        planned = converted = [convert_to_openai_messages(m) for m in originals]  # one dict each, tool calls whole
        w = self.wrapper
        options: dict[str, Any] = {"profile": self.profile, "tokenizer": self.tokenizer}
        if w is not None:  # the wrapper's engine and settings, as it plans its own requests
            options = {"profile": w.profile, "tokenizer": w.backend.tokenizer, "safety_margin": w.safety_margin, "strategies": w.strategies,
                       "values": w.values, "on_infeasible": w.on_infeasible, "summaries": w.summaries, "rag_template": w.pipeline.rag_template,
                       "rag_chunk_template": w.pipeline.rag_chunk_template}
        options.update(self.plan_options)
        chunks = as_chunks(docs) if docs is not None else None
        match = find_context(planned) if chunks is None and planned else None
        if match is not None:
            planned, chunks, options["rag_template"], options["rag_chunk_template"] = match
        try:
            result = plan(planned, ttft_budget_s=self.ttft_budget_s if ttft_budget_s is None else ttft_budget_s, rag_chunks=chunks or (),
                          **options)
        except TypeError as exc:  # an option trimkit.plan does not take
            raise InvalidInputError(f"trimkit_trimmer: {exc}") from None
        self.last_plan = result
        return as_langchain_messages(result.messages, planned, originals, converted)

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> list[BaseMessage]:
        return self._call_with_config(self._run, input, config, run_type="prompt", **kwargs)

    def _run(self, value: Any, **kwargs: Any) -> list[BaseMessage]:
        out = self.trim(value, kwargs.get("ttft_budget_s"))
        if self.last_plan is not None:
            dispatch_custom_event(PLAN_EVENT, self.last_plan.to_dict())
        return out


#: ``trimkit_trimmer(target, ttft_budget_s=None, *, tokenizer=None, **plan_options)``: ``prompt | trimkit_trimmer(model, 1.0) | llm``
trimkit_trimmer = TrimkitTrimmer
