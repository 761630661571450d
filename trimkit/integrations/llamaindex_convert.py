"""LlamaIndex's types as trimkit's and back: chat messages (tool calls whole), retrieved nodes as
chunks, the nodes a plan keeps, and a finished reply as a LlamaIndex ``ChatMessage``.

Nothing here changes what it is given: a ``ChatMessage`` becomes a new OpenAI-style dict, a node
becomes a :class:`~trimkit.messages.Chunk`, and a node the planner cut to an excerpt comes back
as a *copy* whose text is the excerpt. Used by :mod:`trimkit.integrations.llamaindex_llm` (the
LLM wrapper) and :mod:`trimkit.integrations.llamaindex` (the node postprocessor).

**Messages.** A LlamaIndex message is text blocks (joined by a newline, as
``ChatMessage.content`` joins them) and tool calls, which LlamaIndex keeps either in
``additional_kwargs["tool_calls"]`` (OpenAI dicts or ``openai`` objects) or as ``ToolCallBlock``
blocks; the first wins where a message has both (they are the same calls). A ``tool`` message
answers the call named by ``additional_kwargs["tool_call_id"]``. Thinking blocks and cache
markers are not prompt text and are left out; images, audio, video and documents raise
:class:`~trimkit.errors.InvalidMessageError`, since trimkit counts and plans text prompts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    CacheControl,
    CachePoint,
    ChatMessage,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, TextNode

from trimkit.errors import InvalidChunkError, InvalidMessageError
from trimkit.messages import Chunk

__all__ = [
    "to_openai_messages",
    "from_openai_messages",
    "reply_message",
    "tool_selections",
    "node_chunk",
    "nodes_to_chunks",
    "is_node",
    "kept_nodes",
    "excerpts_possible",
    "POSITION_KEY",
    "EXCERPT_KEY",
]

#: LlamaIndex roles that are an assistant's in OpenAI's vocabulary
_ASSISTANT_ALIASES = frozenset({"chatbot", "model"})
#: blocks that carry nothing the model reads as prompt text
_SILENT_BLOCKS = (ThinkingBlock, CachePoint, CacheControl)
#: a chunk's position among the nodes it came from (its metadata), to find the node again
POSITION_KEY = "llamaindex_position"
#: the metadata key an excerpt node carries: the span of its node that was kept (trimkit's ``excerpt`` metadata)
EXCERPT_KEY = "trimkit_excerpt"


# -- messages ------------------------------------------------------------------------------------
def _call_dict(call: Any, where: str) -> dict[str, Any]:
    """One tool call as a new OpenAI dict (``{"id", "type", "function": {"name", "arguments"}}``)."""
    if hasattr(call, "model_dump"):  # an openai ChatCompletionMessageToolCall
        call = call.model_dump(exclude_none=True)
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise InvalidMessageError(f"{where}: a tool call must be an OpenAI-style dict with a 'function', got {type(call).__name__}")
    function = call["function"]
    arguments = function.get("arguments", "")
    out: dict[str, Any] = {
        "type": call.get("type", "function"),
        "function": {"name": function.get("name"), "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
    }
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _block_call(block: ToolCallBlock) -> dict[str, Any]:
    kwargs = block.tool_kwargs
    call: dict[str, Any] = {"type": "function",
                            "function": {"name": block.tool_name, "arguments": kwargs if isinstance(kwargs, str) else json.dumps(kwargs)}}
    if block.tool_call_id is not None:
        call["id"] = block.tool_call_id
    return call


def _openai_message(message: Any, i: int) -> dict[str, Any]:
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
            block_calls.append(_block_call(block))
        elif not isinstance(block, _SILENT_BLOCKS):
            raise InvalidMessageError(f"{where} ({role}) holds a {type(block).__name__}: trimkit plans text prompts (text and tool calls only)")
    extra = message.additional_kwargs
    listed = extra.get("tool_calls")
    calls = [_call_dict(c, where) for c in listed] if listed else block_calls
    out: dict[str, Any] = {"role": "assistant" if role in _ASSISTANT_ALIASES else role,
                           "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if extra.get(key) is not None:
            out[key] = extra[key]
    return out


def to_openai_messages(messages: Any) -> list[dict[str, Any]]:
    """LlamaIndex ``ChatMessage`` objects as new OpenAI-style dicts, in order (tool calls whole)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidMessageError(f"messages must be a list of llama_index ChatMessage, got {type(messages).__name__}")
    return [_openai_message(m, i) for i, m in enumerate(messages)]


def reply_message(message: Mapping[str, Any]) -> ChatMessage:
    """An OpenAI-style message dict (a reply's, or one of a conversation's) as a LlamaIndex
    ``ChatMessage``: its text as a text block, its tool calls as ``ToolCallBlock`` blocks *and* in
    ``additional_kwargs["tool_calls"]`` (OpenAI dicts), where LlamaIndex's agents look for them; a
    tool result's ``tool_call_id`` and ``name`` in ``additional_kwargs``."""
    content = message.get("content")
    calls = [_call_dict(c, "reply") for c in message.get("tool_calls") or ()]
    blocks: list[Any] = [TextBlock(text=content)] if isinstance(content, str) and (content or not calls) else []
    for call in calls:
        function = call["function"]
        blocks.append(ToolCallBlock(tool_call_id=call.get("id"), tool_name=function["name"] or "",
                                    tool_kwargs=_arguments(function["arguments"])))
    extra: dict[str, Any] = {"tool_calls": calls} if calls else {}
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            extra[key] = message[key]
    return ChatMessage(role=MessageRole(message.get("role") or "assistant"), blocks=blocks, additional_kwargs=extra)


def from_openai_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    """OpenAI-style message dicts as LlamaIndex ``ChatMessage`` objects (see :func:`reply_message`)."""
    return [reply_message(m) for m in messages]


def _arguments(text: str) -> dict[str, Any] | str:
    """A tool call's JSON arguments as a dict; an unfinished JSON object (a reply cut by
    ``max_tokens``) as far as it goes; text that is no JSON object as it is."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        try:
            value = parse_partial_json(text)
        except ValueError:
            return text
    return value if isinstance(value, dict) else text


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    """The tool calls of a reply (:func:`reply_message`) as LlamaIndex ``ToolSelection`` objects."""
    calls = [_call_dict(c, "reply") for c in message.additional_kwargs.get("tool_calls") or ()]
    calls = calls or [_block_call(b) for b in message.blocks if isinstance(b, ToolCallBlock)]
    out = []
    for call in calls:
        kwargs = _arguments(call["function"]["arguments"])
        out.append(ToolSelection(tool_id=call.get("id") or "", tool_name=call["function"]["name"] or "",
                                 tool_kwargs=kwargs if isinstance(kwargs, dict) else {}))
    return out


# -- nodes ----------------------------------------------------------------------------------------
def _node_of(item: Any, i: int) -> tuple[BaseNode, float | None]:
    if isinstance(item, NodeWithScore):
        return item.node, item.score
    if isinstance(item, BaseNode):
        return item, None
    raise InvalidChunkError(f"nodes[{i}] must be a llama_index NodeWithScore or node, got {type(item).__name__}")


def node_chunk(item: Any, position: int = 0, metadata_mode: MetadataMode = MetadataMode.LLM) -> Chunk:
    """One retrieved node (``NodeWithScore`` or a bare node) as a chunk: the text the LLM would
    read (``node.get_content(metadata_mode)``: metadata lines included, as the response
    synthesizer sends them), the node's id, and its retriever score where it has one.
    ``metadata[POSITION_KEY]`` is ``position``, so :func:`kept_nodes` finds the node again."""
    node, score = _node_of(item, position)
    try:
        return Chunk(text=node.get_content(metadata_mode=metadata_mode), score=score, id=node.node_id, metadata={POSITION_KEY: position})
    except InvalidChunkError as exc:
        raise InvalidChunkError(f"nodes[{position}] ({node.node_id}): {exc}") from None


def nodes_to_chunks(nodes: Sequence[Any], metadata_mode: MetadataMode = MetadataMode.LLM) -> list[Chunk]:
    """Retrieved nodes as chunks, in order (:func:`node_chunk`)."""
    if isinstance(nodes, (str, bytes, Mapping)) or not isinstance(nodes, Sequence):
        raise InvalidChunkError(f"nodes must be a list of llama_index NodeWithScore, got {type(nodes).__name__}")
    return [node_chunk(item, i, metadata_mode) for i, item in enumerate(nodes)]


def is_node(item: Any) -> bool:
    """Whether ``item`` is a LlamaIndex node (``NodeWithScore`` or a bare node)."""
    return isinstance(item, (NodeWithScore, BaseNode))


def _excerpt_node(item: Any, chunk: Chunk) -> NodeWithScore:
    """A copy of ``item``'s node whose LLM-facing text is the excerpt (metadata kept for the
    caller, hidden from the LLM: the excerpt already holds what the LLM was to read of it)."""
    node, score = _node_of(item, 0)
    copy = node.model_copy(deep=True)
    copy.metadata[EXCERPT_KEY] = dict(chunk.metadata.get("excerpt", {}))
    copy.set_content(chunk.text)
    copy.excluded_llm_metadata_keys = list(copy.metadata)
    copy.excluded_embed_metadata_keys = list({*copy.excluded_embed_metadata_keys, EXCERPT_KEY})
    return NodeWithScore(node=copy, score=score)


def kept_nodes(kept: Sequence[Chunk], nodes: Sequence[Any]) -> list[NodeWithScore]:
    """The nodes behind ``kept`` chunks (a plan's ``kept_chunks``), in that order: the caller's
    own ``NodeWithScore`` object for a chunk kept whole (a bare node gets one, score None), a new
    one holding a copy of the node for a chunk kept as an excerpt."""
    out = []
    for chunk in kept:
        item = nodes[chunk.metadata[POSITION_KEY]]
        if "excerpt" in chunk.metadata:
            out.append(_excerpt_node(item, chunk))
        else:
            out.append(item if isinstance(item, NodeWithScore) else NodeWithScore(node=item, score=None))
    return out


def excerpts_possible(nodes: Sequence[Any]) -> bool:
    """Whether every node can hold an excerpt (a ``TextNode``: its text can be replaced)."""
    return all(isinstance(_node_of(item, i)[0], TextNode) for i, item in enumerate(nodes))

