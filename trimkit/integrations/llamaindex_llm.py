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
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
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

from trimkit.backends.completion import assemble_chat_completion
from trimkit.backends.replies import parse_chunk
from trimkit.integrations.llamaindex_convert import is_node, node_chunk, reply_message, to_openai_messages, tool_selections
from trimkit.integrations.llamaindex_engine import Engine, engine_of, send
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


class StreamReplies:
    """LlamaIndex responses from a trimkit stream, one per chunk, shared by the sync and async
    paths: :meth:`step` turns a chunk into a ``ChatResponse`` (the text so far, the tool calls so
    far, the chunk's ``delta``), :meth:`final` is the last response — the whole reply, ``raw`` the
    assembled completion, the report in ``additional_kwargs["trimkit"]``. ``layer_s`` adds up the
    time spent converting."""

    def __init__(self, stream: Any, layer_s: float) -> None:
        self.stream = stream
        self.layer_s = layer_s
        self.text = ""
        self.calls = False  # a tool call began: the message is rebuilt from the chunks so far
        self.message = ChatMessage(role=MessageRole.ASSISTANT, content="")

    def step(self, chunk: Any) -> ChatResponse:
        t0 = time.perf_counter()
        choices = [c for c in parse_chunk(chunk).choices if c.index == 0]
        delta = "".join(c.content or "" for c in choices)
        self.text += delta
        self.calls = self.calls or any(c.tool_calls for c in choices)
        if self.calls:
            self.message = _first_message(assemble_chat_completion(self.stream.chunks))
        elif delta:
            self.message = ChatMessage(role=MessageRole.ASSISTANT, content=self.text)
        response = ChatResponse(message=self.message, delta=delta, raw=chunk)
        self.layer_s += time.perf_counter() - t0
        return response

    def final(self) -> ChatResponse:
        t0 = time.perf_counter()
        completion = assemble_chat_completion(self.stream.chunks)
        response = ChatResponse(message=_first_message(completion), delta="", raw=completion,
                                additional_kwargs={"trimkit": self.stream.report})
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
        return dict(self._engine.params)

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
        max_tokens = self._engine.params.get("max_tokens")
        return LLMMetadata(context_window=int(self._engine.front_end.backend.n_ctx), num_output=max_tokens or DEFAULT_NUM_OUTPUTS,
                           is_chat_model=True, is_function_calling_model=self.is_function_calling_model, model_name=self.model_name)

    # -- one request --------------------------------------------------------------------------------
    def _call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        budget = kwargs.pop("ttft_budget_s", None)
        rag = _rag_chunks(kwargs.pop("rag_chunks", None))
        call = {**self._engine.params, **kwargs, "messages": to_openai_messages(messages), "stream": True}
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

    def _open(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> StreamReplies:
        call, layer = self._call(messages, kwargs)
        return StreamReplies(send(self._engine.front_end, call), layer)

    def _responses(self, replies: StreamReplies) -> Iterator[ChatResponse]:
        try:
            for chunk in replies.stream:
                yield replies.step(chunk)
            yield self._finish(replies)
        finally:
            replies.stream.close()

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        replies = self._open(messages, kwargs)
        try:
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
        return StreamReplies(await send(front, call), layer), True

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
        replies = StreamReplies(await send(front, call), layer)
        try:
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

    # -- tools (FunctionCallingLLM) -------------------------------------------------------------------
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False, **kwargs: Any) -> dict[str, Any]:
        """The chat arguments for a call that may use ``tools``: OpenAI tool specs, and
        ``tool_choice`` — the one tool by name when a call is required and there is one tool
        (llama-cpp-python then constrains the reply to its JSON schema), ``"required"`` for
        several, ``"auto"`` otherwise."""
        messages = list(chat_history or [])
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
        """Without ``allow_parallel_tool_calls``, only the first tool call is kept (in a new message)."""
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if allow_parallel_tool_calls or len(calls) <= 1:
            return response
        first = reply_message({"role": "assistant", "content": response.message.content, "tool_calls": calls[:1]})
        return response.model_copy(update={"message": first})

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        selections = tool_selections(response.message)
        if not selections and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but got 0 tool calls.")
        return selections
