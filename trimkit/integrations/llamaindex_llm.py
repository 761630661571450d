"""A LlamaIndex LLM whose every chat keeps its time to first token inside a budget:
:class:`TrimmedLLM`, for chat engines, agents and query engines.

::

    from llama_index.llms.llama_cpp import LlamaCPP
    from trimkit.integrations.llamaindex import TrimmedLLM

    llm = TrimmedLLM(LlamaCPP(model_path=path, model_kwargs={"chat_format": "gemma-3"}), ttft_budget_s=1.0)
    chat_engine = index.as_chat_engine(llm=llm)              # or an agent, or Settings.llm = llm
    print(llm.last_report)

It is a LlamaIndex ``FunctionCallingLLM`` around a trimkit front-end on the same engine
(:mod:`trimkit.integrations.llamaindex_engine`): LlamaIndex's messages are converted to OpenAI
dicts (tool calls whole, :mod:`trimkit.integrations.llamaindex_convert`), trimkit plans and
sends them — dropping whole old turns (a tool call with its results), using a ready summary,
and dropping or cutting the ``rag_chunks=`` a caller passes (nodes or text) — and the reply
comes back as a ``ChatMessage`` (tool calls in ``additional_kwargs["tool_calls"]`` and as
``ToolCallBlock`` blocks). The report is in the response's ``additional_kwargs["trimkit"]`` (a
stream's last response carries it), ``raw`` holds the completion as the engine returned it, and
``llm.last_report`` is the latest. Decode parameters (``max_tokens``, ``temperature``, …) are the
wrapped LLM's, overridden per call, and pass through untouched.

The chat template is the engine's (the ``Llama``'s ``chat_format``, the server's), since that is
what trimkit counts: a ``LlamaCPP``'s own ``messages_to_prompt`` is not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import PromptTemplate
from llama_index.core.types import Model

from trimkit.backends.replies import assemble_chat_completion, parse_chunk
from trimkit.errors import BackendError
from trimkit.frontend import usage_counts
from trimkit.integrations.llamaindex_convert import is_node, node_chunk, reply_message, to_openai_messages, tool_selections
from trimkit.integrations.llamaindex_engine import Engine, engine_of, send
from trimkit.integrations.openai_errors import as_openai_error
from trimkit.validation import budget as valid_budget

__all__ = ["TrimmedLLM", "StreamReplies"]

_END = object()


def _rag_chunks(items: Any) -> Any:
    """``rag_chunks=`` as trimkit takes them: LlamaIndex nodes become chunks (their LLM text,
    id and score); strings, :class:`~trimkit.messages.Chunk` and dicts pass as they are (and
    anything else on to trimkit's validation)."""
    if not isinstance(items, (list, tuple)):
        return items
    return [node_chunk(item, i) if is_node(item) else item for i, item in enumerate(items)]


def _first_message(completion: Mapping[str, Any]) -> ChatMessage:
    choices = completion.get("choices") or []
    return reply_message(choices[0]["message"]) if choices else ChatMessage(role=MessageRole.ASSISTANT, content="")


def openai_family(llm: Any) -> bool:
    """Whether ``llm`` is llama-index-llms-openai's ``OpenAI`` (``OpenAILike`` is one). Nothing is
    imported: an instance exists only once its module is."""
    module = sys.modules.get("llama_index.llms.openai.base")
    return module is not None and isinstance(llm, module.OpenAI)


def _openai_reply(inner: Any) -> Callable[[Mapping[str, Any]], ChatMessage]:
    """Reply messages as ``inner`` (an ``OpenAI`` / ``OpenAILike``) builds them from its client's
    ``ChatCompletionMessage``: a text block only for text, ``ToolCallBlock`` blocks whose
    ``tool_kwargs`` are the arguments' JSON text, the ``openai`` tool-call objects in
    ``additional_kwargs["tool_calls"]``. A message its client would not parse gets trimkit's."""
    from llama_index.llms.openai.utils import from_openai_message
    from openai.types.chat import ChatCompletionMessage

    modalities = list(getattr(inner, "modalities", None) or ["text"])

    def convert(completion: Mapping[str, Any]) -> ChatMessage:
        choices = completion.get("choices") or []
        if not choices:
            return ChatMessage(role=MessageRole.ASSISTANT, content="")
        try:
            message = ChatCompletionMessage.model_validate({**choices[0]["message"], "role": "assistant"})
        except ValueError:  # pydantic's ValidationError: not the shape the openai client reads
            return reply_message(choices[0]["message"])
        return from_openai_message(message, modalities=modalities)

    return convert


class StreamReplies:
    """LlamaIndex responses from a trimkit stream, one per chunk, shared by the sync and async
    paths: :meth:`step` turns a chunk into a ``ChatResponse`` (the text so far, the tool calls so
    far, the chunk's ``delta``), :meth:`final` is the last response — the whole reply, ``raw`` the
    assembled completion (``usage`` from trimkit's counts where the server sent none), the report
    in ``additional_kwargs["trimkit"]``, with ``extra(completion)`` (the wrapped LLM's token
    counts). ``message`` turns a completion into the reply message (by default trimkit's
    :func:`~trimkit.integrations.llamaindex_convert.reply_message`). ``layer_s`` adds up the time
    spent converting."""

    def __init__(self, stream: Any, layer_s: float, message: Callable[[Mapping[str, Any]], ChatMessage] | None = None,
                 extra: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None) -> None:
        self.stream = stream
        self.layer_s = layer_s
        self.text = ""
        self.calls = False  # a tool call began: the message is rebuilt from the chunks so far
        self.message = ChatMessage(role=MessageRole.ASSISTANT, content="")
        self.convert = message or _first_message
        self.extra = extra

    def step(self, chunk: Any) -> ChatResponse:
        t0 = time.perf_counter()
        choices = [c for c in parse_chunk(chunk).choices if c.index == 0]
        delta = "".join(c.content or "" for c in choices)
        self.text += delta
        self.calls = self.calls or any(c.tool_calls for c in choices)
        if self.calls:
            self.message = self.convert(assemble_chat_completion(self.stream.chunks))
        elif delta:
            self.message = ChatMessage(role=MessageRole.ASSISTANT, content=self.text)
        response = ChatResponse(message=self.message, delta=delta, raw=chunk)
        self.layer_s += time.perf_counter() - t0
        return response

    def final(self) -> ChatResponse:
        t0 = time.perf_counter()
        report = self.stream.report
        usage = None if report is None else usage_counts(report.prompt_tokens, report.completion_tokens or 0)
        completion = assemble_chat_completion(self.stream.chunks, usage=usage)
        extra = dict(self.extra(completion)) if self.extra is not None else {}
        response = ChatResponse(message=self.convert(completion), delta="", raw=completion, additional_kwargs={**extra, "trimkit": report})
        self.layer_s += time.perf_counter() - t0
        return response


def _as_completion(response: ChatResponse) -> CompletionResponse:
    return CompletionResponse(text=response.message.content or "", delta=response.delta, raw=response.raw,
                              additional_kwargs=dict(response.additional_kwargs))


def _prompt_messages(prompt: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, content=prompt)]


class TrimmedLLM(FunctionCallingLLM):
    """A LlamaIndex LLM that keeps each chat's TTFT inside ``ttft_budget_s`` (see the module
    docstring). ``llm``: a LlamaIndex ``LlamaCPP`` or ``OpenAILike`` (any LlamaIndex LLM with
    an ``api_base``), a ``llama_cpp.Llama``, a server URL, or a sync trimkit wrapper.
    ``kwargs`` go to :func:`trimkit.wrap` / :func:`trimkit.wrap_url` (``profile``,
    ``strategies``, ``values``, ``on_infeasible``, …). ``max_tokens``, ``temperature`` and
    ``additional_kwargs`` (any other decode parameter) are sent with every call, over what the
    wrapped LLM was configured with. Per call: ``ttft_budget_s=`` and
    ``rag_chunks=`` (LlamaIndex nodes, text or :class:`~trimkit.messages.Chunk`).

    ``is_function_calling_model``: whether agents may call tools through it (default: what the
    wrapped LLM's metadata says, else False); tool calls need an engine whose chat template
    handles tools (or a forced ``tool_choice``: llama-cpp-python then constrains the reply to
    the tool's JSON schema). Async calls use an async client on a server; in process they run
    the engine in a worker thread (it runs one request at a time either way)."""

    ttft_budget_s: float | None = Field(default=None, description="The TTFT budget of a call (None: no budget; per call: ttft_budget_s=).")
    is_function_calling_model: bool = Field(default=False, description="Whether agents may call tools through this LLM.")
    model_name: str = Field(default="", description="The model, as the wrapped LLM names it.")

    _engine: Engine = PrivateAttr()
    _async_front: Any = PrivateAttr(default=None)
    _last: tuple[Any, Any, float] = PrivateAttr(default=(None, None, 0.0))
    _own: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, llm: Any, ttft_budget_s: float | None = None, *, max_tokens: int | None = None, temperature: float | None = None,
                 additional_kwargs: Mapping[str, Any] | None = None, is_function_calling_model: bool | None = None, **kwargs: Any) -> None:
        if ttft_budget_s is not None:
            ttft_budget_s = valid_budget(ttft_budget_s)
        engine = engine_of(llm, ttft_budget_s, **kwargs)
        own = {**({} if max_tokens is None else {"max_tokens": max_tokens}), **({} if temperature is None else {"temperature": temperature}),
               **(additional_kwargs or {})}
        if own:
            engine = attrs.evolve(engine, params={**engine.params, **own})
        calling = is_function_calling_model if is_function_calling_model is not None else bool(engine.function_calling)
        super().__init__(ttft_budget_s=ttft_budget_s, is_function_calling_model=calling, model_name=engine.model_name,
                         callback_manager=getattr(llm, "callback_manager", None), system_prompt=engine.system_prompt)
        self._engine = engine
        self._own = own

    @classmethod
    def class_name(cls) -> str:
        return "TrimmedLLM"

    # -- what users read ----------------------------------------------------------------------------
    @property
    def trimkit_chat(self) -> Any:
        """The trimkit front-end requests go through (``TrimmedLlama`` or ``TrimmedOpenAI``):
        its ``profile``, ``safety_margin``, ``reports``, ``backend``."""
        return self._engine.front_end

    @property
    def decode_params(self) -> dict[str, Any]:
        """The decode parameters every call sends (the wrapped LLM's; a call's own override them)."""
        return self._params({})

    def _params(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A call's decode parameters. An ``OpenAI`` / ``OpenAILike`` builds them itself, as for
        its own requests (its ``max_tokens`` and ``additional_kwargs`` over the call's, as it
        sends them); what this wrapper was given (``max_tokens=``, ...) comes over the wrapped
        LLM's configuration, and a call's own arguments over both."""
        inner = self._engine.inner
        if not openai_family(inner):
            return {**self._engine.params, **kwargs}
        params = dict(inner._get_model_kwargs(**{**self._own, **kwargs}))
        params.update({k: v for k, v in self._own.items() if k not in kwargs})
        return params

    @property
    def last_report(self) -> Any:
        """The :class:`~trimkit.report.Report` of the latest finished request (sync or async)."""
        return self._last[0]

    @property
    def last_prepared(self) -> Any:
        """The latest request as trimkit sent it (``.messages``, ``.plan``, ``.prepare_s``)."""
        return self._last[1]

    @property
    def last_layer_s(self) -> float:
        """Seconds the latest request spent converting LlamaIndex types to trimkit's and back."""
        return self._last[2]

    @property
    def metadata(self) -> LLMMetadata:
        """The wrapped LLM's metadata where it describes the engine (``context_window``, capped at
        the engine's context; ``num_output``; ``model_name``), sent as a chat (``is_chat_model``)."""
        n_ctx = int(self._engine.front_end.backend.n_ctx)
        max_tokens = self._engine.params.get("max_tokens")
        inner = self._inner_metadata()
        context_window = min(inner.context_window, n_ctx) if inner is not None and inner.context_window > 0 else n_ctx
        num_output = max_tokens or (inner.num_output if inner is not None else DEFAULT_NUM_OUTPUTS)
        return LLMMetadata(context_window=context_window, num_output=num_output, is_chat_model=True,
                           is_function_calling_model=self.is_function_calling_model, model_name=self.model_name)

    def _inner_metadata(self) -> LLMMetadata | None:
        inner = self._engine.inner
        if inner is None:
            return None
        try:
            return inner.metadata
        except Exception:  # an LLM whose metadata needs what it cannot reach: the engine's own
            return None

    @property
    def _tool_llm(self) -> FunctionCallingLLM | None:
        """The wrapped LLM when it calls tools itself (``OpenAI``, ``OpenAILike``): its own
        conversions of tools and tool calls are used, so that the request is the one it sends."""
        inner = self._engine.inner
        return inner if isinstance(inner, FunctionCallingLLM) else None

    def _replies(self, stream: Any, layer_s: float) -> StreamReplies:
        inner = self._engine.inner
        if openai_family(inner):
            return StreamReplies(stream, layer_s, _openai_reply(inner), inner._get_response_token_counts)
        return StreamReplies(stream, layer_s)

    # -- one request --------------------------------------------------------------------------------
    def _call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        budget = kwargs.pop("ttft_budget_s", None)
        rag = _rag_chunks(kwargs.pop("rag_chunks", None))
        call = {**self._params(kwargs), "messages": to_openai_messages(messages), "stream": True}
        if rag is not None:
            call["rag_chunks"] = rag
        budget = budget if budget is not None else self.ttft_budget_s
        if budget is not None:
            call["ttft_budget_s"] = budget
        return call, time.perf_counter() - t0

    def _finish(self, replies: StreamReplies) -> ChatResponse:
        """The last response of a finished stream (with the report); remembered as the latest."""
        final = replies.final()
        self._last = (replies.stream.report, replies.stream.prepared, replies.layer_s)
        return final

    @contextlib.contextmanager
    def _inner_errors(self) -> Iterator[None]:
        """Where the wrapped LLM is an ``OpenAI`` / ``OpenAILike``, trimkit's server errors are
        raised as the ``openai`` errors its client raises for the same failure (still trimkit's:
        the type subclasses both; :func:`~trimkit.integrations.openai_errors.as_openai_error`)."""
        try:
            yield
        except BackendError as exc:
            if not openai_family(self._engine.inner):
                raise
            base = self._engine.url[0] if self._engine.url is not None else "http://localhost/v1"
            raise as_openai_error(exc, base.rstrip("/") + "/chat/completions") from exc

    def _open(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> StreamReplies:
        call, layer = self._call(messages, kwargs)
        with self._inner_errors():
            return self._replies(send(self._engine.front_end, call), layer)

    def _responses(self, replies: StreamReplies) -> Iterator[ChatResponse]:
        try:
            with self._inner_errors():
                for chunk in replies.stream:
                    yield replies.step(chunk)
            yield self._finish(replies)
        finally:
            replies.stream.close()

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        replies = self._open(messages, kwargs)
        try:
            with self._inner_errors():
                for _ in replies.stream:
                    pass
        finally:
            replies.stream.close()
        return self._finish(replies)

    def _async_engine(self) -> Any:
        """The async front-end on a server (made on first use); None in process."""
        if self._engine.url is None:
            return None
        if self._async_front is None:
            self._async_front = self._engine.async_twin()
        return self._async_front

    async def _aopen(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[StreamReplies, bool]:
        """The stream of one request, and whether it is async (a server) or a sync stream to be
        read in worker threads (in process)."""
        front = self._async_engine()
        if front is None:
            return await asyncio.to_thread(self._open, messages, kwargs), False
        call, layer = self._call(messages, kwargs)
        with self._inner_errors():
            return self._replies(await send(front, call), layer), True

    async def _aresponses(self, replies: StreamReplies, is_async: bool) -> AsyncIterator[ChatResponse]:
        if not is_async:
            sync = self._responses(replies)
            try:
                while (item := await asyncio.to_thread(next, sync, _END)) is not _END:
                    yield item
            finally:
                await asyncio.to_thread(sync.close)
            return
        try:
            with self._inner_errors():
                async for chunk in replies.stream:
                    yield replies.step(chunk)
            yield self._finish(replies)
        finally:
            await replies.stream.close()

    async def _achat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        front = self._async_engine()
        if front is None:
            return await asyncio.to_thread(self._chat, messages, kwargs)
        call, layer = self._call(messages, kwargs)
        with self._inner_errors():
            replies = self._replies(await send(front, call), layer)
        try:
            with self._inner_errors():
                async for _ in replies.stream:
                    pass
        finally:
            await replies.stream.close()
        return self._finish(replies)

    def prepare(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        """Plan a chat as :meth:`chat` would send it, without sending it: trimkit's
        :class:`~trimkit.prepared.Prepared` (``.messages``, ``.plan``, ``.predicted_ttft_s``).
        Same arguments as :meth:`chat`."""
        call, _ = self._call(messages, dict(kwargs))
        chat_messages, chunks, budget = call.pop("messages"), call.pop("rag_chunks", None), call.pop("ttft_budget_s", None)
        return self._engine.front_end.prepare(chat_messages, chunks, call, ttft_budget_s=budget)

    # -- LlamaIndex's LLM interface -------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._responses(self._open(messages, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._achat(messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        replies, is_async = await self._aopen(messages, kwargs)
        return self._aresponses(replies, is_async)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _as_completion(self._chat(_prompt_messages(prompt), kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return (_as_completion(r) for r in self._responses(self._open(_prompt_messages(prompt), kwargs)))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _as_completion(await self._achat(_prompt_messages(prompt), kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        replies, is_async = await self._aopen(_prompt_messages(prompt), kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            async for r in self._aresponses(replies, is_async):
                yield _as_completion(r)

        return gen()

    # -- structured outputs --------------------------------------------------------------------------
    def _structured_kwargs(self, output_cls: type[Model], llm_kwargs: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        """``llm_kwargs`` as an ``OpenAI`` / ``OpenAILike`` makes them for a structured prediction,
        and whether it asks for a ``response_format`` (its ``should_use_structured_outputs``)
        rather than a forced tool call (``tool_choice="required"`` unless the call names one)."""
        kwargs = dict(llm_kwargs or {})
        inner = self._engine.inner
        if not openai_family(inner):
            return kwargs, False
        if inner._should_use_structure_outputs():
            return inner._prepare_schema(kwargs, output_cls), True
        kwargs.setdefault("tool_choice", "required")
        return kwargs, False

    def structured_predict(self, output_cls: type[Model], prompt: PromptTemplate, llm_kwargs: dict[str, Any] | None = None,
                           **prompt_args: Any) -> Model:
        """As the wrapped LLM predicts it: an ``OpenAI`` / ``OpenAILike`` with a forced tool call
        (or its ``response_format``, when it uses structured outputs); any other LLM as LlamaIndex
        does for a function-calling or a plain LLM. Every call goes through trimkit."""
        kwargs, schema = self._structured_kwargs(output_cls, llm_kwargs)
        if schema:
            response = self.chat(self._extend_messages(prompt.format_messages(**prompt_args)), **kwargs)
            return output_cls.model_validate_json(str(response.message.content))
        return super().structured_predict(output_cls, prompt, llm_kwargs=kwargs, **prompt_args)

    async def astructured_predict(self, output_cls: type[Model], prompt: PromptTemplate, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Model:
        """The async :meth:`structured_predict`."""
        kwargs, schema = self._structured_kwargs(output_cls, llm_kwargs)
        if schema:
            response = await self.achat(self._extend_messages(prompt.format_messages(**prompt_args)), **kwargs)
            return output_cls.model_validate_json(str(response.message.content))
        return await super().astructured_predict(output_cls, prompt, llm_kwargs=kwargs, **prompt_args)

    # -- tools (FunctionCallingLLM) -------------------------------------------------------------------
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False, **kwargs: Any) -> dict[str, Any]:
        """The chat arguments for a call that may use ``tools``. A wrapped LLM that calls tools
        itself (``OpenAILike``) prepares them: its tool specs, ``tool_choice``, ``strict``,
        ``parallel_tool_calls`` — the request it would send (on a copy of ``chat_history``, which
        it would extend in place). Otherwise (``LlamaCPP``): OpenAI tool specs, and ``tool_choice``
        — the one tool by name when a call is required and there is one tool (llama-cpp-python
        then constrains the reply to its JSON schema), ``"required"`` for several, ``"auto"``
        otherwise."""
        history = list(chat_history) if chat_history is not None else None
        inner = self._tool_llm
        if inner is not None:
            return inner._prepare_chat_with_tools_compat(tools, user_msg=user_msg, chat_history=history, verbose=verbose,
                                                         allow_parallel_tool_calls=allow_parallel_tool_calls, tool_required=tool_required,
                                                         **kwargs)
        messages = history or []
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg)
        specs = [tool.metadata.to_openai_tool() for tool in tools]
        if not specs:
            return {"messages": messages, **kwargs}
        if tool_required and len(specs) == 1:
            choice: Any = {"type": "function", "function": {"name": specs[0]["function"]["name"]}}
        else:
            choice = "required" if tool_required else "auto"
        return {"messages": messages, "tools": specs, "tool_choice": choice, **kwargs}

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[Any], allow_parallel_tool_calls: bool = False,
                                           **kwargs: Any) -> ChatResponse:
        """The wrapped LLM's check where it calls tools itself; otherwise, without
        ``allow_parallel_tool_calls``, only the first tool call is kept (in a new message)."""
        inner = self._tool_llm
        if inner is not None:
            return inner._validate_chat_with_tools_response(response, tools, allow_parallel_tool_calls=allow_parallel_tool_calls, **kwargs)
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if allow_parallel_tool_calls or len(calls) <= 1:
            return response
        first = reply_message({"role": "assistant", "content": response.message.content, "tool_calls": calls[:1]})
        return response.model_copy(update={"message": first})

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The tool calls of a reply, read by the wrapped LLM where it calls tools itself (the
        reply is built as it builds its own), else by trimkit."""
        inner = self._tool_llm
        if inner is not None:
            return inner.get_tool_calls_from_response(response, error_on_no_tool_call=error_on_no_tool_call, **kwargs)
        selections = tool_selections(response.message)
        if not selections and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but got 0 tool calls.")
        return selections
