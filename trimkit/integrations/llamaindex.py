"""trimkit in LlamaIndex (``pip install trimkit[llamaindex]``): :class:`TrimkitPostprocessor` keeps
the retrieved nodes worth their predicted prefill seconds for the query; :class:`TrimmedLLM` keeps
each chat's TTFT inside a budget (converted to OpenAI dicts, planned, sent and reported by a trimkit
front-end on the same engine, :func:`engine_of`, and converted back). The caller's messages and
nodes are never changed. Usage and where trimkit differs: ``docs/integrations.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    astream_chat_response_to_completion_response,
    chat_response_to_completion_response,
    prompt_to_messages,
    stream_chat_response_to_completion_response,
)
from llama_index.core.base.llms.types import (
    CacheControl,
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
from llama_index.core.llms import LLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.chat_prompts import TEXT_QA_PROMPT_TMPL_MSGS
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.types import Model

from trimkit.backends.base import client_kind, is_llama
from trimkit.backends.replies import assemble_chat_completion, parse_chunk
from trimkit.errors import InvalidChunkError, InvalidInputError, InvalidMessageError
from trimkit.errors import budget as valid_budget
from trimkit.fleet import wrap_url
from trimkit.frontend import drain, usage_counts
from trimkit.integrations import openai_errors
from trimkit.messages import Chunk, check_rag_templates
from trimkit.pipeline import place_chunks
from trimkit.planning.planner import Plan, plan
from trimkit.planning.profile import Profile
from trimkit.planning.tokens import PromptTokenizer
from trimkit.planning.values import ValueModel
from trimkit.strategies import cap_rag_chunks, chain, reuse_prefix
from trimkit.wrapper import wrap

__all__ = ["TrimkitPostprocessor", "TrimmedLLM", "QA_SYSTEM_PROMPT", "QA_RAG_TEMPLATE", "QA_CHUNK_TEMPLATE"]

#: a chunk's position among the nodes it came from (its metadata), to find the node again
POSITION_KEY = "llamaindex_position"
#: the metadata key an excerpt node carries: the span of its node that was kept (trimkit's ``excerpt`` metadata)
EXCERPT_KEY = "trimkit_excerpt"
#: The system message of LlamaIndex's question-answering prompt for chat models, as the installed LlamaIndex words it.
QA_SYSTEM_PROMPT: str = TEXT_QA_PROMPT_TMPL_MSGS[0].content or ""
#: Its user message, as a trimkit ``rag_template``: the nodes at ``{chunks}``, the query at ``{question}``.
QA_RAG_TEMPLATE: str = (TEXT_QA_PROMPT_TMPL_MSGS[1].content or "").replace("{context_str}", "{chunks}").replace("{query_str}", "{question}")
#: How the synthesizer joins nodes: their text, a blank line between them.
QA_CHUNK_TEMPLATE = "{text}"


def _call_dict(call: Any, where: str) -> dict[str, Any]:
    """One tool call (an OpenAI dict or ``openai`` object) as a new OpenAI dict, its arguments as JSON text."""
    if hasattr(call, "model_dump"):  # an openai ChatCompletionMessageToolCall
        call = call.model_dump(exclude_none=True)
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise InvalidMessageError(f"{where}: a tool call must be an OpenAI-style dict with a 'function', got {type(call).__name__}")
    arguments = call["function"].get("arguments", "")
    out = {"type": call.get("type", "function"),
           "function": {"name": call["function"].get("name"), "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
    return out if call.get("id") is None else {**out, "id": call["id"]}


def _openai_message(message: Any, i: int) -> dict[str, Any]:
    """One ``ChatMessage`` as an OpenAI dict: its text blocks joined by a newline, its tool calls from
    ``additional_kwargs["tool_calls"]``, else its ``ToolCallBlock``s. Thinking blocks and cache
    markers are not prompt text; images, audio and documents raise (trimkit plans text prompts)."""
    where = f"messages[{i}]"
    if not isinstance(message, ChatMessage):
        raise InvalidMessageError(f"{where} must be a llama_index ChatMessage, got {type(message).__name__}")
    role = message.role.value
    texts: list[str] = []
    block_calls: list[dict[str, Any]] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            block_calls.append(_call_dict({"id": block.tool_call_id, "function": {"name": block.tool_name, "arguments": block.tool_kwargs}}, where))
        elif not isinstance(block, (ThinkingBlock, CachePoint, CacheControl)):
            raise InvalidMessageError(f"{where} ({role}) holds a {type(block).__name__}: trimkit plans text prompts (text and tool calls only)")
    extra = message.additional_kwargs
    listed = extra.get("tool_calls")
    calls = [_call_dict(c, where) for c in listed] if listed else block_calls
    out: dict[str, Any] = {"role": "assistant" if role in ("chatbot", "model") else role, "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        out["tool_calls"] = calls
    out.update({k: extra[k] for k in ("tool_call_id", "name") if extra.get(k) is not None})
    return out


def to_openai_messages(messages: Any) -> list[dict[str, Any]]:
    """LlamaIndex ``ChatMessage`` objects as new OpenAI-style dicts, in order (tool calls whole)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidMessageError(f"messages must be a list of llama_index ChatMessage, got {type(messages).__name__}")
    return [_openai_message(m, i) for i, m in enumerate(messages)]


def reply_message(message: Mapping[str, Any]) -> ChatMessage:
    """An OpenAI-style message dict as a ``ChatMessage``: its tool calls as ``ToolCallBlock``s *and* in
    ``additional_kwargs["tool_calls"]`` (where agents look), a tool result's ``tool_call_id`` and ``name`` there too."""
    content = message.get("content")
    calls = [_call_dict(c, "reply") for c in message.get("tool_calls") or ()]
    blocks: list[Any] = [TextBlock(text=content)] if isinstance(content, str) and (content or not calls) else []
    for call in calls:
        function = call["function"]
        blocks.append(ToolCallBlock(tool_call_id=call.get("id"), tool_name=function["name"] or "", tool_kwargs=_arguments(function["arguments"])))
    extra: dict[str, Any] = {"tool_calls": calls} if calls else {}
    extra.update({k: message[k] for k in ("tool_call_id", "name") if message.get(k) is not None})
    return ChatMessage(role=MessageRole(message.get("role") or "assistant"), blocks=blocks, additional_kwargs=extra)


def from_openai_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    return [reply_message(m) for m in messages]


def _arguments(text: str) -> dict[str, Any] | str:
    """A tool call's JSON arguments as a dict (an unfinished object, cut by ``max_tokens``, as far as it goes); else the text."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        try:
            value = parse_partial_json(text)
        except ValueError:
            return text
    return value if isinstance(value, dict) else text


def _node_of(item: Any, i: int) -> tuple[BaseNode, float | None]:
    if isinstance(item, NodeWithScore):
        return item.node, item.score
    if isinstance(item, BaseNode):
        return item, None
    raise InvalidChunkError(f"nodes[{i}] must be a llama_index NodeWithScore or node, got {type(item).__name__}")


def node_chunk(item: Any, position: int = 0, metadata_mode: MetadataMode = MetadataMode.LLM) -> Chunk:
    """A retrieved node as a chunk: the text the LLM reads (metadata lines included), its id and score;
    ``metadata[POSITION_KEY]`` is ``position``, so :func:`kept_nodes` finds the node again."""
    node, score = _node_of(item, position)
    try:
        return Chunk(text=node.get_content(metadata_mode=metadata_mode), score=score, id=node.node_id, metadata={POSITION_KEY: position})
    except InvalidChunkError as exc:
        raise InvalidChunkError(f"nodes[{position}] ({node.node_id}): {exc}") from None


def nodes_to_chunks(nodes: Sequence[Any], metadata_mode: MetadataMode = MetadataMode.LLM) -> list[Chunk]:
    if isinstance(nodes, (str, bytes, Mapping)) or not isinstance(nodes, Sequence):
        raise InvalidChunkError(f"nodes must be a list of llama_index NodeWithScore, got {type(nodes).__name__}")
    return [node_chunk(item, i, metadata_mode) for i, item in enumerate(nodes)]


def kept_nodes(kept: Sequence[Chunk], nodes: Sequence[Any]) -> list[NodeWithScore]:
    """The nodes behind ``kept`` chunks, in that order: the caller's own ``NodeWithScore`` for a chunk
    kept whole, a new one holding a copy of the node for an excerpt (its metadata hidden from the LLM:
    the excerpt already holds what the LLM was to read of it)."""
    out = []
    for chunk in kept:
        item = nodes[chunk.metadata[POSITION_KEY]]
        node, score = _node_of(item, 0)
        if "excerpt" not in chunk.metadata:
            out.append(item if isinstance(item, NodeWithScore) else NodeWithScore(node=node, score=None))
            continue
        copy = node.model_copy(deep=True)
        copy.metadata[EXCERPT_KEY] = dict(chunk.metadata["excerpt"])
        copy.set_content(chunk.text)
        copy.excluded_llm_metadata_keys = list(copy.metadata)
        copy.excluded_embed_metadata_keys = list({*copy.excluded_embed_metadata_keys, EXCERPT_KEY})
        out.append(NodeWithScore(node=copy, score=score))
    return out


def _decode_params(llm: Any) -> dict[str, Any]:
    """The decode parameters a LlamaIndex LLM sends: ``LlamaCPP``'s ``generate_kwargs`` (less its
    ``stream`` flag), ``OpenAILike``'s ``temperature``, ``max_tokens`` and ``additional_kwargs``."""
    generate = getattr(llm, "generate_kwargs", None)
    params = {k: v for k, v in generate.items() if k != "stream"} if isinstance(generate, Mapping) else {}
    for key in ("temperature", "max_tokens"):
        if getattr(llm, key, None) is not None and key not in params:
            params[key] = getattr(llm, key)
    extra = getattr(llm, "additional_kwargs", None)
    if isinstance(extra, Mapping):
        params.update(extra)
    return params


def engine_of(target: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> tuple[Any, str]:
    """The sync trimkit front-end for ``target`` (a LlamaIndex ``LlamaCPP``, an ``OpenAILike`` or any LLM with an
    ``api_base``, a ``llama_cpp.Llama``, a server URL or a sync trimkit wrapper) and the model's name;
    ``kwargs`` go to :func:`trimkit.wrap` / :func:`trimkit.wrap_url`."""
    if isinstance(target, str):
        return wrap_url(target, ttft_budget_s=ttft_budget_s, **kwargs), kwargs.get("model") or target
    llama = getattr(target, "_model", None) if isinstance(target, LLM) else target  # LlamaCPP keeps its llama_cpp.Llama there
    if is_llama(llama):
        return wrap(llama, ttft_budget_s, **kwargs), str(getattr(target, "model_path", ""))
    if client_kind(target) == "wrapper":
        if kwargs:
            raise InvalidInputError(f"{sorted(kwargs)} configure a new trimkit wrapper: pass them where {type(target).__name__} was made")
        if getattr(target, "is_async", False):
            raise InvalidInputError("an async trimkit wrapper cannot serve LlamaIndex's sync calls: pass a sync one (trimkit.wrap_url(url))")
        return target, str(getattr(getattr(target, "backend", None), "name", ""))
    api_base = getattr(target, "api_base", None)
    if isinstance(target, LLM) and isinstance(api_base, str):  # OpenAILike, OpenAI with a local api_base, …
        name, api_key = getattr(target, "model", None), getattr(target, "api_key", None)
        headers = getattr(target, "default_headers", None)
        if isinstance(headers, Mapping) and headers and "headers" not in kwargs:  # what its client sends with every request
            kwargs["headers"] = dict(headers)
        return wrap_url(api_base, model=name, api_key=api_key, ttft_budget_s=ttft_budget_s, **kwargs), name or api_base
    raise InvalidInputError(
        f"cannot reach the engine behind {type(target).__name__}: pass a LlamaIndex LlamaCPP (its llama_cpp.Llama), a LlamaIndex LLM "
        "with an api_base (OpenAILike), a llama_cpp.Llama, a server URL, or a sync trimkit wrapper (trimkit.wrap / trimkit.wrap_url)"
    )


_END = object()


def _rag_chunks(items: Any) -> Any:
    """``rag_chunks=`` with LlamaIndex nodes as chunks; anything else passes on to trimkit's validation."""
    if not isinstance(items, (list, tuple)):
        return items
    return [node_chunk(item, i) if isinstance(item, (NodeWithScore, BaseNode)) else item for i, item in enumerate(items)]


def openai_family(llm: Any) -> bool:
    """Whether ``llm`` is llama-index-llms-openai's ``OpenAI`` (``OpenAILike`` is one), importing nothing."""
    module = sys.modules.get("llama_index.llms.openai.base")
    return module is not None and isinstance(llm, module.OpenAI)


class TrimmedLLM(FunctionCallingLLM):
    """A LlamaIndex LLM that keeps each chat's TTFT inside ``ttft_budget_s`` (docs/integrations.md).
    ``llm``: as :func:`engine_of` takes it; ``kwargs`` go to :func:`trimkit.wrap` / :func:`trimkit.wrap_url`;
    ``max_tokens``, ``temperature``, ``additional_kwargs`` go with every call, over the wrapped LLM's own."""

    ttft_budget_s: float | None = Field(default=None, description="The TTFT budget of a call (None: no budget; per call: ttft_budget_s=).")
    is_function_calling_model: bool = Field(default=False, description="Whether agents may call tools through this LLM.")
    model_name: str = Field(default="", description="The model, as the wrapped LLM names it.")

    _front: Any = PrivateAttr()
    _inner: Any = PrivateAttr(default=None)  # the wrapped LlamaIndex LLM, whose conversions are reused
    _decode: dict[str, Any] = PrivateAttr(default_factory=dict)  # its decode parameters, and this wrapper's over them
    _last: tuple[Any, Any, float] = PrivateAttr(default=(None, None, 0.0))
    _own: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, llm: Any, ttft_budget_s: float | None = None, *, max_tokens: int | None = None, temperature: float | None = None,
                 additional_kwargs: Mapping[str, Any] | None = None, is_function_calling_model: bool | None = None, **kwargs: Any) -> None:
        if ttft_budget_s is not None:
            ttft_budget_s = valid_budget(ttft_budget_s)
        front, model_name = engine_of(llm, ttft_budget_s, **kwargs)
        inner = llm if isinstance(llm, LLM) else None
        own = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None}
        own.update(additional_kwargs or {})
        if is_function_calling_model is None:
            try:
                is_function_calling_model = inner is not None and bool(inner.metadata.is_function_calling_model)
            except Exception:  # metadata of an LLM whose engine is not up: it did not say
                is_function_calling_model = False
        super().__init__(ttft_budget_s=ttft_budget_s, is_function_calling_model=is_function_calling_model, model_name=model_name,
                         callback_manager=getattr(llm, "callback_manager", None), system_prompt=getattr(inner, "system_prompt", None))
        self._front, self._inner, self._own = front, inner, own
        self._decode = {**(_decode_params(inner) if inner is not None else {}), **own}

    @classmethod
    def class_name(cls) -> str:
        return "TrimmedLLM"

    @property
    def trimkit_chat(self) -> Any:
        """The trimkit front-end requests go through (``TrimmedLlama`` or ``TrimmedOpenAI``)."""
        return self._front

    @property
    def decode_params(self) -> dict[str, Any]:
        """The decode parameters every call sends (a call's own override them)."""
        return self._params({})

    def _params(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A call's decode parameters: an ``OpenAI`` / ``OpenAILike`` builds them as for its own requests;
        this wrapper's own (``max_tokens=``, ...) come over the wrapped LLM's, a call's over both."""
        inner = self._inner
        if not openai_family(inner):
            return {**self._decode, **kwargs}
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
        """The wrapped LLM's metadata (``context_window`` capped at the engine's), sent as a chat."""
        n_ctx = int(self._front.backend.n_ctx)
        try:
            inner = self._inner.metadata if self._inner is not None else None
        except Exception:  # an LLM whose metadata needs what it cannot reach: the engine's own
            inner = None
        context_window = min(inner.context_window, n_ctx) if inner is not None and inner.context_window > 0 else n_ctx
        num_output = self._decode.get("max_tokens") or (inner.num_output if inner is not None else DEFAULT_NUM_OUTPUTS)
        return LLMMetadata(context_window=context_window, num_output=num_output, is_chat_model=True,
                           is_function_calling_model=self.is_function_calling_model, model_name=self.model_name)

    @property
    def _tool_llm(self) -> FunctionCallingLLM | None:
        """The wrapped LLM when it calls tools itself (``OpenAI``, ``OpenAILike``): its own tool conversions are used."""
        inner = self._inner
        return inner if isinstance(inner, FunctionCallingLLM) else None

    def _call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        kwargs.pop("formatted", None)  # LlamaIndex's, not a decode parameter
        budget, rag = kwargs.pop("ttft_budget_s", None), kwargs.pop("rag_chunks", None)
        call = {**self._params(kwargs), "messages": to_openai_messages(messages), "stream": True, "rag_chunks": _rag_chunks(rag),
                "ttft_budget_s": self.ttft_budget_s if budget is None else budget}  # None: none, the front-end's default
        return call, time.perf_counter() - t0

    def _convert(self, completion: Mapping[str, Any]) -> ChatMessage:
        """The reply as a wrapped ``OpenAI`` / ``OpenAILike`` builds it from its client's ``ChatCompletionMessage``; else
        (or a message its client would not parse) trimkit's :func:`reply_message`."""
        if openai_family(self._inner):
            from llama_index.llms.openai.utils import from_openai_message
            from openai.types.chat import ChatCompletionMessage

            try:
                message = ChatCompletionMessage.model_validate({**completion["choices"][0]["message"], "role": "assistant"})
            except (LookupError, TypeError, ValueError):  # no choice, or not the shape the openai client reads (pydantic's ValidationError)
                message = None
            if message is not None:
                return from_openai_message(message, modalities=list(getattr(self._inner, "modalities", None) or ["text"]))
        choices = completion.get("choices") or []
        return reply_message(choices[0]["message"]) if choices else ChatMessage(role=MessageRole.ASSISTANT, content="")

    def _final(self, stream: Any, layer_s: float) -> ChatResponse:
        """A finished stream's whole reply, its report in ``additional_kwargs["trimkit"]`` (with a wrapped ``OpenAI``'s token
        counts); remembered as the latest (``layer_s``: the seconds spent converting so far)."""
        t0 = time.perf_counter()
        report = stream.report
        usage = None if report is None else usage_counts(report.prompt_tokens, report.completion_tokens or 0)
        completion = assemble_chat_completion(stream.chunks, usage=usage)
        extra = dict(self._inner._get_response_token_counts(completion)) if openai_family(self._inner) else {}
        final = ChatResponse(message=self._convert(completion), delta="", raw=completion, additional_kwargs={**extra, "trimkit": report})
        self._last = (report, stream.prepared, layer_s + time.perf_counter() - t0)
        return final

    def _inner_errors(self) -> contextlib.AbstractContextManager[None]:
        """Around an ``OpenAI`` / ``OpenAILike``, trimkit's server errors as the ``openai`` errors its client raises."""
        return openai_errors(getattr(getattr(self._front, "backend", None), "base_url", None), openai_family(self._inner))

    def _open(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[Any, float]:
        call, layer_s = self._call(messages, kwargs)
        create = getattr(self._front, "create_chat_completion", None) or self._front.chat.completions.create
        with self._inner_errors():
            return create(**call), layer_s

    def _responses(self, stream: Any, layer_s: float) -> ChatResponseGen:
        """A response per chunk (the reply so far, the chunk's ``delta``), then :meth:`_final`'s."""
        text, calls, message = "", False, ChatMessage(role=MessageRole.ASSISTANT, content="")
        with contextlib.closing(stream), self._inner_errors():
            for chunk in stream:
                t0 = time.perf_counter()
                choices = [c for c in parse_chunk(chunk).choices if c.index == 0]
                delta = "".join(c.content or "" for c in choices)
                text += delta
                calls = calls or any(c.tool_calls for c in choices)  # a tool call began: the message is rebuilt from the chunks so far
                if calls:
                    message = self._convert(assemble_chat_completion(stream.chunks))
                elif delta:
                    message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
                response = ChatResponse(message=message, delta=delta, raw=chunk)
                layer_s += time.perf_counter() - t0
                yield response
            yield self._final(stream, layer_s)

    def _stream(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        return self._responses(*self._open(messages, kwargs))  # sent now, read as the caller reads

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        stream, layer_s = self._open(messages, kwargs)
        with contextlib.closing(stream), self._inner_errors():
            drain(stream)
        return self._final(stream, layer_s)

    @staticmethod
    async def _in_threads(responses: ChatResponseGen) -> ChatResponseAsyncGen:
        """A sync stream's responses for an async caller, each read in a worker thread (off the event loop)."""
        try:
            while (item := await asyncio.to_thread(next, responses, _END)) is not _END:
                yield item
        finally:
            await asyncio.to_thread(responses.close)

    def prepare(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        """Plan a chat as :meth:`chat` would send it, without sending it (trimkit's ``Prepared``)."""
        call, _ = self._call(messages, dict(kwargs))
        chat_messages, chunks, budget = call.pop("messages"), call.pop("rag_chunks"), call.pop("ttft_budget_s")
        return self._front.prepare(chat_messages, chunks, call, ttft_budget_s=budget)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return self._in_threads(await asyncio.to_thread(self._stream, messages, kwargs))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_response_to_completion_response(self._chat(prompt_to_messages(prompt), kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return stream_chat_response_to_completion_response(self._stream(prompt_to_messages(prompt), kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_response_to_completion_response(await asyncio.to_thread(self._chat, prompt_to_messages(prompt), kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        responses = self._in_threads(await asyncio.to_thread(self._stream, prompt_to_messages(prompt), kwargs))
        return astream_chat_response_to_completion_response(responses)

    def structured_predict(self, output_cls: type[Model], prompt: PromptTemplate, llm_kwargs: dict[str, Any] | None = None,
                           **prompt_args: Any) -> Model:
        """As the wrapped ``OpenAI`` / ``OpenAILike`` predicts it (a ``response_format``, else a forced tool call;
        LlamaIndex's own way for any other LLM), every call through trimkit."""
        kwargs, inner = dict(llm_kwargs or {}), self._inner
        if openai_family(inner) and inner._should_use_structure_outputs():
            response = self.chat(self._extend_messages(prompt.format_messages(**prompt_args)), **inner._prepare_schema(kwargs, output_cls))
            return output_cls.model_validate_json(str(response.message.content))
        if openai_family(inner):
            kwargs.setdefault("tool_choice", "required")
        return super().structured_predict(output_cls, prompt, llm_kwargs=kwargs, **prompt_args)

    async def astructured_predict(self, output_cls: type[Model], prompt: PromptTemplate, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Model:
        """:meth:`structured_predict` in a worker thread, as every async call here."""
        return await asyncio.to_thread(lambda: self.structured_predict(output_cls, prompt, llm_kwargs, **prompt_args))

    # -- tools (FunctionCallingLLM): the wrapped LLM's own where it calls tools itself (OpenAILike), else trimkit's
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False, **kwargs: Any) -> dict[str, Any]:
        """The chat arguments for a call that may use ``tools``, on a copy of ``chat_history``. Without a
        wrapped tool LLM (``LlamaCPP``): a required call to a single tool names it (llama-cpp-python then
        constrains the reply to its schema), ``"required"`` for several, ``"auto"`` otherwise."""
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
        """Without a wrapped tool LLM and ``allow_parallel_tool_calls``, only the first tool call is kept (in a new message)."""
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
        inner = self._tool_llm
        if inner is not None:
            return inner.get_tool_calls_from_response(response, error_on_no_tool_call=error_on_no_tool_call, **kwargs)
        selections = []
        for call in _openai_message(response.message, 0).get("tool_calls", ()):
            arguments = _arguments(call["function"]["arguments"])
            selections.append(ToolSelection(tool_id=call.get("id") or "", tool_name=call["function"]["name"] or "",
                                            tool_kwargs=arguments if isinstance(arguments, dict) else {}))
        if not selections and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but got 0 tool calls.")
        return selections


class TrimkitPostprocessor(BaseNodePostprocessor):
    """Keep the retrieved nodes worth their predicted prefill seconds for the query (docs/integrations.md). ``llm``:
    where the prompt runs (a :class:`TrimmedLLM`, or what :func:`engine_of` takes), or ``profile=`` and ``tokenizer=``;
    the templates default to LlamaIndex's question-answering prompt, the one a query engine sends."""

    ttft_budget_s: float | None = Field(default=None, description="The TTFT budget of the request carrying the nodes.")
    system_prompt: str | None = Field(default=QA_SYSTEM_PROMPT, description="The system message the nodes are planned with.")
    rag_template: str = Field(default=QA_RAG_TEMPLATE, description="Where the nodes ({chunks}) and the query ({question}) go.")
    rag_chunk_template: str = Field(default=QA_CHUNK_TEMPLATE, description="How one node is rendered ({text}, {id}, {n}).")
    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM, description="Which metadata of a node the LLM reads.")
    min_nodes: int = Field(default=0, ge=0, description="The most relevant nodes always kept whole.")
    excerpts: bool = Field(default=True, description="Whether a node may be cut to the sentences matching the query.")
    max_plans: int = Field(default=64, ge=1, description="How many recent plans are kept (plans).")

    _llm: Any = PrivateAttr(default=None)
    _front: Any = PrivateAttr(default=None)
    _engine: dict[str, Any] = PrivateAttr(default_factory=dict)  # profile= and tokenizer=, without an llm
    _values: ValueModel | None = PrivateAttr(default=None)
    _strategies: Any = PrivateAttr(default=None)
    _plans: deque[Plan] = PrivateAttr()
    _last_layer_s: float = PrivateAttr(default=0.0)
    _decode: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, llm: Any = None, *, ttft_budget_s: float | None = None, profile: Profile | None = None, tokenizer: Any = None,
                 values: ValueModel | None = None, strategies: Any = None, **fields: Any) -> None:
        super().__init__(ttft_budget_s=None if ttft_budget_s is None else valid_budget(ttft_budget_s), **fields)
        check_rag_templates(self.rag_template, self.rag_chunk_template)
        if values is not None and not isinstance(values, ValueModel):
            raise InvalidInputError(f"values must be a trimkit.ValueModel or None, got {type(values).__name__}")
        if llm is None and not isinstance(profile, Profile):
            raise InvalidInputError("TrimkitPostprocessor needs llm= (where the prompt runs) or profile= (a trimkit.Profile)")
        if llm is not None and (profile is not None or tokenizer is not None):
            raise InvalidInputError("give llm= or profile=/tokenizer=, not both: the llm's own profile and tokenizer are used")
        if isinstance(llm, TrimmedLLM):
            self._llm, self._front = llm, llm.trimkit_chat
        elif client_kind(llm) == "wrapper":
            self._front = llm
        elif llm is not None:
            self._front = engine_of(llm, self.ttft_budget_s, summarizer=None)[0]
            self._decode = _decode_params(llm) if isinstance(llm, LLM) else {}
        if self._budget() is None:
            raise InvalidInputError("TrimkitPostprocessor needs a TTFT budget: ttft_budget_s=, or an llm that has one")
        self._engine = {"profile": profile, "tokenizer": PromptTokenizer.estimate() if tokenizer is None and llm is None else tokenizer}
        self._values = values
        self._strategies = strategies
        self._plans = deque(maxlen=self.max_plans)

    @classmethod
    def class_name(cls) -> str:
        return "TrimkitPostprocessor"

    @property
    def last_plan(self) -> Plan | None:
        """The plan of the latest call: what it kept, dropped and cut, and the predicted TTFT."""
        return self._plans[-1] if self._plans else None

    @property
    def last_layer_s(self) -> float:
        """Seconds the latest call spent converting nodes to chunks and kept chunks back to nodes."""
        return self._last_layer_s

    @property
    def plans(self) -> list[Plan]:
        """The latest plans, oldest first (``max_plans`` of them)."""
        return list(self._plans)

    def _budget(self) -> float | None:
        if self.ttft_budget_s is not None:
            return self.ttft_budget_s
        return getattr(self._llm if self._llm is not None else self._front, "ttft_budget_s", None)

    def plan_nodes(self, nodes: list[NodeWithScore], query: str) -> tuple[Plan, list[NodeWithScore]]:
        if not isinstance(query, str):
            raise InvalidInputError(f"the query must be a str, got {type(query).__name__}")
        t0 = time.perf_counter()
        chunks = nodes_to_chunks(nodes, self.metadata_mode)
        layer = time.perf_counter() - t0
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [{"role": "user", "content": query}]
        strategies = self._strategies
        if strategies is None:  # an excerpt replaces a node's text: TextNodes only
            excerpts = self.excerpts and all(isinstance(_node_of(item, i)[0], TextNode) for i, item in enumerate(nodes))
            strategies = chain(reuse_prefix(), cap_rag_chunks(min_chunks=self.min_nodes, excerpts=excerpts))
        budget = self._budget()
        engine = self._engine
        front = self._front
        if front is not None:  # as the front-end plans its own requests: its margin for this prompt, its cache
            backend, tokenizer = front.backend, front.backend.tokenizer
            whole = tokenizer.prompt_tokens(place_chunks(messages, chunks, self.rag_template, self.rag_chunk_template))
            margin = front.engine.request_margin(front.attainment_target, budget, len(whole), backend.predict_cached_tokens(whole))
            max_tokens = (self._llm.decode_params if self._llm is not None else self._decode).get("max_tokens") or 0
            engine = {"profile": front.profile, "tokenizer": tokenizer, "safety_margin": margin, "cache": backend.cache_state(),
                      "max_prompt_tokens": max(int(backend.n_ctx) - int(max_tokens), 1)}  # room for the answer
        values = self._values if self._values is not None or front is None else front.values
        result = plan(messages, rag_chunks=chunks, ttft_budget_s=budget, strategies=strategies, values=values,
                      rag_template=self.rag_template, rag_chunk_template=self.rag_chunk_template, **engine)
        t0 = time.perf_counter()
        kept = kept_nodes(result.kept_chunks, nodes)
        self._plans.append(result)
        self._last_layer_s = layer + time.perf_counter() - t0
        return result, kept

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if query_bundle is None:
            raise InvalidInputError("TrimkitPostprocessor needs the query (query_bundle= or query_str=): nodes are worth what they add to it")
        return self.plan_nodes(nodes, query_bundle.query_str)[1] if nodes else []

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._postprocess_nodes, nodes, query_bundle)  # counting may ask a server: off the event loop
