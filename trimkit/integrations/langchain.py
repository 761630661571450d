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

Streaming (``stream``, ``astream``), ``ainvoke`` and ``bind_tools`` work as on ``inner``. The
async calls run the sync path in a worker thread (LangChain's default for a chat model), which is
what trimkit's planning does anyway; with a ``ChatOpenAI`` they use its sync client. Not through
trimkit (they raise :class:`~trimkit.errors.InvalidInputError` instead of sending around the
budget): ``ChatOpenAI``'s Responses API and ``response_format`` / ``json_schema`` structured
output. ``ChatOllama`` (Ollama's own API) is not supported: use ``ChatOpenAI`` on Ollama's
``/v1``. Bad input raises a typed :mod:`trimkit.errors` error before anything is sent; the
caller's messages and documents are never changed. See ``docs/integrations.md``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

try:
    from langchain_core.callbacks import CallbackManager, CallbackManagerForLLMRun, dispatch_custom_event
    from langchain_core.language_models import BaseChatModel
    from langchain_core.language_models.chat_models import generate_from_stream
    from langchain_core.messages import AIMessageChunk, BaseMessage
    from langchain_core.outputs import ChatGenerationChunk, ChatResult
    from langchain_core.runnables import Runnable
    from pydantic import ConfigDict, Field, PrivateAttr
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


class TrimmedChatModel(BaseChatModel):
    """A LangChain chat model that keeps each request's TTFT inside a budget (module docstring).

    ``TrimmedChatModel(inner, ttft_budget_s=None, **options)``: ``options`` that are LangChain
    chat-model fields (``callbacks``, ``tags``, ``metadata``, ``cache``, ``rate_limiter``, ...)
    configure this model; the rest go to :func:`trimkit.wrap` (``profile`` — trimkit's; the
    model's LangChain ``.profile``, its capabilities, is ``inner``'s —, ``strategies``,
    ``values``, ``on_infeasible``, ``on_busy``, ``calibration``, ``rag_template``,
    ``rag_chunk_template``, ...). Without ``profile`` the engine's stored profile is used, else a
    micro-calibration (about 3 s) runs through ``inner``'s own client at construction.

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
        if isinstance(inner, TrimmedChatModel):
            raise InvalidInputError("this chat model is trimmed already")
        if not isinstance(inner, BaseChatModel):
            raise InvalidInputError(f"TrimmedChatModel wraps a LangChain chat model (ChatLlamaCpp, ChatOpenAI), got {type(inner).__name__}")
        # ``profile`` is trimkit's (a BaseChatModel's ``profile`` field, its capabilities, is the inner model's)
        fields = set(type(self).model_fields) - {"inner", "ttft_budget_s", "trimkit_options", "profile"}
        own = {k: options.pop(k) for k in list(options) if k in fields}
        engine = Engine(inner, ttft_budget_s, options)  # validates the budget and options; may calibrate
        super().__init__(inner=inner, ttft_budget_s=ttft_budget_s, trimkit_options=options, **own)
        self._engine = engine

    # -- what the model exposes ---------------------------------------------------------------------
    @property
    def trimkit(self) -> Any:
        """The trimkit wrapper requests go through (``TrimmedLlama`` or ``TrimmedOpenAI``):
        ``.profile``, ``.reports``, ``.safety_margin``, ``.idle()``, ..."""
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

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, BaseMessage]:
        """Bind tools as ``inner.bind_tools`` formats and checks them (same arguments), on this model."""
        bound = self.inner.bind_tools(tools, **kwargs)
        if getattr(bound, "bound", None) is not self.inner or not isinstance(getattr(bound, "kwargs", None), dict):
            raise InvalidInputError(f"{type(self.inner).__name__}.bind_tools did not return a binding of the model: bind its tools on it directly")
        return self.bind(**bound.kwargs)

    # -- one request -------------------------------------------------------------------------------------
    def _chunks(self, messages: list[BaseMessage], stop: list[str] | None, tokens: CallbackManagerForLLMRun | None,
                events: CallbackManagerForLLMRun | None, kwargs: dict[str, Any]) -> Iterator[ChatGenerationChunk]:
        """The inner model's chunks for one request sent through trimkit, then a last chunk
        carrying the report. ``tokens`` gets the inner's token callbacks, ``events`` the report."""
        t0 = time.perf_counter()
        docs = kwargs.pop("rag_chunks", None)
        budget = kwargs.pop("ttft_budget_s", None)
        call = Call(self._engine, None if docs is None else as_chunks(docs), self.ttft_budget_s if budget is None else budget,
                    kwargs.pop("on_busy", None))
        inner = self.inner.model_copy(update=self._engine.client_fields(call))
        layer_s = time.perf_counter() - t0
        try:
            yield from inner._stream(messages, stop=stop, run_manager=tokens, **kwargs)
            t1 = time.perf_counter()
            report = call.report
            data = report.to_dict() if report is not None else None
            if report is not None:
                self._last_report = report
            last = ChatGenerationChunk(message=AIMessageChunk(content="", response_metadata={"trimkit": data}, chunk_position="last"))
            if data is not None:
                _emit(data, events)
            layer_s += time.perf_counter() - t1 + call.layer_s
            self._last_layer_s = layer_s
        finally:
            call.close()
        yield last

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        return generate_from_stream(self._chunks(messages, stop, None, run_manager, kwargs))

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        yield from self._chunks(messages, stop, run_manager, run_manager, kwargs)
