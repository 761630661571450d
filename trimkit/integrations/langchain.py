"""trimkit for LangChain: the chat model you already use, inside a TTFT budget.

``TrimmedChatModel(inner, ttft_budget_s=...)`` is a LangChain chat model wrapping one that talks
to a local engine — ``ChatLlamaCpp`` (langchain-community) or ``ChatOpenAI`` pointed at a local
OpenAI-compatible server (langchain-openai; also Ollama through its ``/v1`` endpoint). An
existing chain changes by one line::

    chain = prompt | llm                                              # before
    chain = prompt | TrimmedChatModel(llm, ttft_budget_s=1.0)         # after

Every request is converted by ``inner`` exactly as ``inner`` converts it (messages, tool calls,
``bind_tools``, stop words, decode parameters), then planned and sent by :func:`trimkit.wrap`
on the engine ``inner`` talks to (its ``Llama``, or its ``base_url``): the same planner, the same
guarantees and the same :class:`~trimkit.report.Report` as the direct path. Retrieved documents
come with the call (``model.invoke(messages, rag_chunks=[Document, ...])``) or through the
prompt's context variable formatted by :func:`trimkit_context`
(:mod:`trimkit.integrations.langchain_documents`).

The report of each request is

- in the response: ``response_metadata["trimkit"]`` (``report.to_dict()``) of the ``AIMessage``,
  or of the last chunk of a stream (so also of the chunks added up);
- on the model: ``model.last_report`` (the :class:`~trimkit.report.Report`),
  ``model.trimkit.reports`` (recent ones);
- in callbacks: a custom event ``"trimkit_report"`` with ``report.to_dict()``
  (``on_custom_event``; ``astream_events`` shows it as ``on_custom_event``) — sent with the model's
  run when LangChain hands the model its run (``invoke``, ``ainvoke``, ``batch``), else with the
  enclosing chain's run (``stream`` and ``astream`` inside a chain); and in every handler's
  ``on_llm_end`` as the generation's ``response_metadata["trimkit"]``.

The wrapped model behaves as ``inner`` wherever trimkit has no reason to differ: a call runs
``inner``'s own ``_generate`` / ``_stream`` on trimkit's stand-in client (a non-streamed call gets
the completion assembled from trimkit's stream, so tool calls, ``response_metadata``,
``usage_metadata`` and ``llm_output`` are ``inner``'s as raw), ``inner``'s callbacks, tags,
metadata and ``output_version`` apply, tracing reads ``inner``'s ``_get_ls_params``,
``bind_tools`` (``tool_choice`` included) and ``with_structured_output`` are ``inner``'s, nothing
is measured at construction (the first request loads the profile or calibrates), it pickles and
serialises as ``inner`` does, and with a ``ChatOpenAI`` trimkit's server errors are also the
``openai`` errors the raw client raises (:func:`~trimkit.integrations.langchain_engines.as_openai_error`).
The async calls run the sync path in a worker thread (LangChain's default for a chat model),
which is what trimkit's planning does anyway; with a ``ChatOpenAI`` they use its sync client. Not
through trimkit (they raise :class:`~trimkit.errors.InvalidInputError` instead of sending around
the budget): ``ChatOpenAI``'s Responses API and its ``response_format`` streaming helper.
``ChatOllama`` (Ollama's own API) is not supported: use ``ChatOpenAI`` on Ollama's ``/v1``. Bad
input raises a typed :mod:`trimkit.errors` error before anything is sent; the caller's messages
and documents are never changed. See ``docs/integrations.md``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

try:
    from langchain_core.callbacks import CallbackManager, CallbackManagerForLLMRun, dispatch_custom_event
    from langchain_core.language_models import BaseChatModel
    from langchain_core.language_models.base import LangSmithParams
    from langchain_core.load.serializable import Serializable
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
    from langchain_core.outputs import ChatGenerationChunk, ChatResult
    from langchain_core.runnables import Runnable
    from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"trimkit.integrations.langchain needs langchain-core: pip install 'trimkit[langchain]' ({exc})") from exc

from trimkit.errors import InvalidInputError
from trimkit.integrations.langchain_documents import as_chunks, trimkit_context
from trimkit.integrations.langchain_engines import Call, Engine
from trimkit.integrations.langchain_trimmer import PLAN_EVENT, TrimkitTrimmer, trimkit_trimmer
from trimkit.report import Report

__all__ = ["TrimmedChatModel", "trimkit_trimmer", "trimkit_context", "TrimkitTrimmer", "REPORT_EVENT", "PLAN_EVENT"]

#: the name of the custom callback event carrying ``report.to_dict()``
REPORT_EVENT = "trimkit_report"


def _emit(data: dict[str, Any], run_manager: CallbackManagerForLLMRun | None) -> None:
    """The report as a custom callback event: with the model's run when LangChain gave it one,
    else with the enclosing run (outside any run there is nobody to tell)."""
    if run_manager is not None:
        if run_manager.handlers:
            manager = CallbackManager(handlers=run_manager.handlers, inheritable_handlers=run_manager.inheritable_handlers,
                                      parent_run_id=run_manager.parent_run_id, tags=run_manager.tags, metadata=run_manager.metadata)
            manager.on_custom_event(REPORT_EVENT, data, run_id=run_manager.run_id)
        return
    try:
        dispatch_custom_event(REPORT_EVENT, data)
    except RuntimeError:  # not inside a run
        pass


#: the chat-model fields a ``TrimmedChatModel`` takes from its inner model unless given: what
#: LangChain reads from the model it runs (callbacks, tags, metadata, cache, rate limiter, the
#: message format, streaming switches), so that the wrapped model runs as the inner one did
INHERITED_FIELDS = ("callbacks", "tags", "metadata", "verbose", "cache", "rate_limiter", "disable_streaming", "output_version",
                    "custom_get_token_ids")
#: the per-call keywords trimkit takes (never sent to the inner model)
CALL_KEYWORDS = ("rag_chunks", "ttft_budget_s", "on_busy")


def _usage(report: Report | None) -> dict[str, int] | None:
    """``usage_metadata`` from trimkit's counts (prompt tokens as sent, completion tokens)."""
    m = getattr(report, "measurement", None)
    prompt, completion = getattr(m, "prompt_tokens", None), getattr(m, "completion_tokens", None)
    if prompt is None or completion is None:
        return None
    return {"input_tokens": int(prompt), "output_tokens": int(completion), "total_tokens": int(prompt) + int(completion)}


def _retarget(node: Any, inner: BaseChatModel, outer: BaseChatModel) -> tuple[Any, bool]:
    """``node`` (a runnable the inner model built around itself: ``with_structured_output``'s
    binding and parser) with ``outer`` in place of ``inner``; and whether ``inner`` was found."""
    if node is inner:
        return outer, True
    if isinstance(node, (list, tuple)):
        items = [_retarget(x, inner, outer) for x in node]
        return type(node)(x for x, _ in items), any(f for _, f in items)
    if isinstance(node, dict):
        items = {k: _retarget(v, inner, outer) for k, v in node.items()}
        return {k: v for k, (v, _) in items.items()}, any(f for _, f in items.values())
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
    """A LangChain chat model that keeps each request's TTFT inside a budget (module docstring).

    ``TrimmedChatModel(inner, ttft_budget_s=None, **options)``: ``options`` that are LangChain
    chat-model fields (``callbacks``, ``tags``, ``metadata``, ``cache``, ``rate_limiter``,
    ``output_version``, ...) configure this model — those not given are ``inner``'s
    (:data:`INHERITED_FIELDS`); the rest go to :func:`trimkit.wrap` (``profile`` — trimkit's;
    the model's LangChain ``.profile``, its capabilities, is ``inner``'s —, ``strategies``,
    ``values``, ``on_infeasible``, ``on_busy``, ``calibration``, ``rag_template``,
    ``rag_chunk_template``, ...), checked here. Nothing is measured at construction: on first use
    the engine's stored profile is used, else a micro-calibration (about 3 s) runs through
    ``inner``'s own client.

    Per call: ``rag_chunks=[Document | trimkit.Chunk | str, ...]``, ``ttft_budget_s=`` (else
    :attr:`ttft_budget_s`; None: no budget, nothing trimmed), ``on_busy=``; every other keyword
    reaches ``inner`` as it would without trimkit.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    #: the wrapped chat model (never modified: each request uses a copy holding trimkit's stand-in client)
    inner: BaseChatModel
    #: the default TTFT budget in seconds (None: no budget)
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
        for name in INHERITED_FIELDS:
            if name not in own and name in inner.model_fields_set:
                own[name] = getattr(inner, name)
        if "output_version" not in own and getattr(inner, "output_version", None) is not None:
            own["output_version"] = inner.output_version
        if ttft_budget_s is not None:
            from trimkit.validation import budget

            budget(ttft_budget_s)
        engine = Engine(inner, ttft_budget_s, options)  # checks the options; measures nothing
        super().__init__(inner=inner, ttft_budget_s=ttft_budget_s, trimkit_options=options, **own)
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        """Any other public attribute is the inner model's (``model_name``, ``openai_api_key``,
        ``client``'s settings, ...), read as on the inner model; set them on the inner model."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            if name.startswith("_"):
                raise
            inner = self.__dict__.get("inner")
            if inner is None:
                raise
            return getattr(inner, name)

    # -- pickling and serialisation, as the inner model's ------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["__pydantic_private__"] = None  # the engine (locks, the wrapper): made again on first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__({**state, "__pydantic_private__": {"_last_report": None, "_last_layer_s": None}})
        self._engine = Engine(self.inner, self.ttft_budget_s, self.trimkit_options)

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """Serialisable (``dumpd``/``dumps``/``load``) when its inner model is (``to_json``)."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return cls.__module__.split(".")

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {}

    def to_json(self) -> Any:
        """The inner model's serialisation inside this model's; "not implemented" (as the inner
        model's) where the inner model is not serialisable or trimkit's options are not JSON."""
        import json

        if not self.inner.is_lc_serializable():
            return self.to_json_not_implemented()
        try:
            json.dumps(self.trimkit_options)
        except (TypeError, ValueError):
            return self.to_json_not_implemented()
        return Serializable.to_json(self)

    # -- what the model exposes ---------------------------------------------------------------------
    @property
    def trimkit(self) -> Any:
        """The trimkit wrapper requests go through (``TrimmedLlama`` or ``TrimmedOpenAI``):
        ``.profile``, ``.reports``, ``.safety_margin``, ``.idle()``, ... (made on first use: the
        stored profile, else a micro-calibration)."""
        return self._engine.chat

    @property
    def last_report(self) -> Report | None:
        """The report of the most recent finished request through this model (any thread)."""
        return self._last_report

    @property
    def last_layer_s(self) -> float | None:
        """Seconds this integration's own code took in the most recent request: converting the
        documents, finding a context in the prompt, copying the inner model, attaching and
        emitting the report. Not trimkit's planning (``trimkit.last_prepared.prepare_s``), not
        LangChain's own conversions, not the model."""
        return self._last_layer_s

    def _resolve_model_profile(self) -> Any:
        """LangChain's model profile (context window, tool calling, ...): the inner model's."""
        return self.inner.profile

    @property
    def _llm_type(self) -> str:
        return f"trimkit-{self.inner._llm_type}"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self.inner._identifying_params, "trimkit_inner": self.inner._llm_type, "ttft_budget_s": self.ttft_budget_s}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """Tracing's standard parameters (provider, model name, temperature, max tokens): the inner model's."""
        return self.inner._get_ls_params(stop=stop, **{k: v for k, v in kwargs.items() if k not in CALL_KEYWORDS})

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any) -> Runnable[Any, BaseMessage]:
        """Bind tools as ``inner.bind_tools`` formats and checks them (same arguments, ``tool_choice``
        included), on this model."""
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        bound = self.inner.bind_tools(tools, **kwargs)
        if getattr(bound, "bound", None) is not self.inner or not isinstance(getattr(bound, "kwargs", None), dict):
            raise InvalidInputError(f"{type(self.inner).__name__}.bind_tools did not return a binding of the model: bind its tools on it directly")
        return self.bind(**bound.kwargs)

    def with_structured_output(self, schema: Any = None, *, include_raw: bool = False, **kwargs: Any) -> Runnable[Any, Any]:
        """``inner.with_structured_output(...)`` — the inner model's own method, schema conversion
        and parser (``ChatLlamaCpp``: a forced tool call; ``ChatOpenAI``: ``json_schema``,
        ``function_calling`` or ``json_mode``) — with every call of the model going through
        trimkit. A structured output the inner model builds without a binding of itself (nothing
        trimkit could send) raises :class:`~trimkit.errors.InvalidInputError` here."""
        runnable = self.inner.with_structured_output(schema, include_raw=include_raw, **kwargs)
        retargeted, found = _retarget(runnable, self.inner, self)
        if not found:
            raise InvalidInputError(f"{type(self.inner).__name__}.with_structured_output built no call of the model trimkit can send: "
                                    "use the model's bind_tools and an output parser")
        return retargeted

    # -- one request -------------------------------------------------------------------------------------
    def _call(self, kwargs: dict[str, Any]) -> tuple[Call, BaseChatModel, float]:
        """The stand-in client for one request, the inner model's copy holding it, and the seconds that took."""
        t0 = time.perf_counter()
        docs = kwargs.pop("rag_chunks", None)
        budget = kwargs.pop("ttft_budget_s", None)
        call = Call(self._engine, None if docs is None else as_chunks(docs), self.ttft_budget_s if budget is None else budget,
                    kwargs.pop("on_busy", None))
        inner = self.inner.model_copy(update=self._engine.client_fields(call))
        return call, inner, time.perf_counter() - t0

    def _finish(self, call: Call, layer_s: float, events: CallbackManagerForLLMRun | None) -> dict[str, Any] | None:
        """Record and emit the report of a finished request; returns ``report.to_dict()``."""
        t1 = time.perf_counter()
        report = call.report
        data = report.to_dict() if report is not None else None
        if report is not None:
            self._last_report = report
        if data is not None:
            _emit(data, events)
        self._last_layer_s = layer_s + time.perf_counter() - t1 + call.layer_s
        return data

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        """The inner model's own ``_generate`` on the stand-in client: it sends what it always
        sends (non-streamed calls get the completion assembled from trimkit's stream, streamed
        ones the stream) and builds its ``ChatResult`` (message, ``response_metadata``,
        ``usage_metadata``, ``llm_output``) as always; trimkit adds ``response_metadata["trimkit"]``
        (and ``usage_metadata`` from its counts where the inner model set none)."""
        call, inner, layer_s = self._call(kwargs)
        try:
            result = inner._generate(messages, stop=stop, run_manager=run_manager, **kwargs)
            t1 = time.perf_counter()
            data = self._finish(call, 0.0, run_manager)
            usage = _usage(call.report)
            for generation in result.generations:
                message = generation.message
                message.response_metadata = {**message.response_metadata, "trimkit": data}
                if isinstance(message, AIMessage) and message.usage_metadata is None and usage is not None:
                    message.usage_metadata = usage  # type: ignore[assignment]
            self._last_layer_s = (self._last_layer_s or 0.0) + layer_s + time.perf_counter() - t1
        finally:
            call.close()
        return result

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """The inner model's chunks for one request sent through trimkit, then a last chunk
        carrying the report (and ``usage_metadata`` from trimkit's counts where no chunk had any)."""
        call, inner, layer_s = self._call(kwargs)
        try:
            had_usage = False
            for chunk in inner._stream(messages, stop=stop, run_manager=run_manager, **kwargs):
                had_usage = had_usage or getattr(chunk.message, "usage_metadata", None) is not None
                yield chunk
            t1 = time.perf_counter()
            data = self._finish(call, layer_s, run_manager)
            usage = None if had_usage else _usage(call.report)
            last = ChatGenerationChunk(message=AIMessageChunk(content="", response_metadata={"trimkit": data}, usage_metadata=usage,
                                                              chunk_position="last"))
            self._last_layer_s = (self._last_layer_s or 0.0) + time.perf_counter() - t1
        finally:
            call.close()
        yield last
