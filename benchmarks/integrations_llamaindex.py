"""The LlamaIndex paths of ``benchmarks/integrations.py`` (the interface agreed in issue 13's notes).

Two paths, each on the harness's shared ``llama_cpp.Llama`` (no second model) with the harness's
profile and options:

- ``llamaindex``: :class:`~trimkit.integrations.llamaindex.TrimmedLLM` over that Llama;
  ``llm.chat(messages, rag_chunks=nodes, ttft_budget_s=budget)`` with the history as LlamaIndex
  ``ChatMessage`` objects (assistant tool calls in ``additional_kwargs["tool_calls"]``, tool
  results with their ``tool_call_id``) and the chunks as ``NodeWithScore`` (the retriever's score
  where the set has one) — the same planning as the direct path, reached through LlamaIndex's types.
- ``llamaindex_postprocessor``: a :class:`~trimkit.integrations.llamaindex.TrimkitPostprocessor`
  chooses the nodes for the question first (with the request's system prompt and trimkit's own
  chunk templates, so it plans the prompt the LLM will place them in, without the history it
  cannot see), then the same ``TrimmedLLM`` sends the chat with the nodes it kept, trimming the
  history to what is left of the budget. Its chunk choice may differ from the direct path's: the
  postprocessor weighs nodes against the question only.

A chunk without an id (the set's ``plain`` form) becomes a node with id ``chunk-<i>``, the id
trimkit gives a bare string, so every path renders the same prompt.

    python benchmarks/integrations.py     # runs these paths beside the direct and LangChain ones
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

ARMS: tuple[str, ...] = ("llamaindex", "llamaindex_postprocessor")

_LLMS: dict[tuple[int, int], Any] = {}


def _trimmed_llm(llm: Any, profile: Any, options: dict[str, Any]) -> Any:
    """One TrimmedLLM per shared Llama and profile, reused across requests."""
    from trimkit.integrations.llamaindex import TrimmedLLM

    key = (id(llm), id(profile))
    if key not in _LLMS:
        _LLMS[key] = TrimmedLLM(llm, profile=profile, **options)
    return _LLMS[key]


def _nodes(request: dict[str, Any]) -> list[Any]:
    """The request's chunks as a LlamaIndex retriever returns them."""
    from llama_index.core.schema import NodeWithScore, TextNode

    return [NodeWithScore(node=TextNode(text=c["text"], id_=c["id"] if c["id"] is not None else f"chunk-{i}"), score=c["score"])
            for i, c in enumerate(request["chunks"])]


def _postprocessor(trimmed: Any, request: dict[str, Any], budget_s: float) -> Any:
    """The postprocessor of the ``llamaindex_postprocessor`` path: the request's system prompt and
    the chunk templates the LLM places nodes with, so it plans what the LLM will send."""
    from trimkit.integrations.llamaindex import TrimkitPostprocessor

    system = next((m["content"] for m in request["messages"] if m["role"] == "system"), None)
    pipeline = trimmed.trimkit_chat.pipeline
    return TrimkitPostprocessor(llm=trimmed, ttft_budget_s=budget_s, system_prompt=system, rag_template=pipeline.rag_template,
                                rag_chunk_template=pipeline.rag_chunk_template)


def prepare_llamaindex_arm(arm: str, llm: Any, request: dict[str, Any], *, budget_s: float, profile: Any, params: dict[str, Any],
                           options: dict[str, Any] | None = None) -> Any:
    """Plan one request as ``arm`` would send it, without sending it (trimkit's ``Prepared``): for
    comparing plans made from the same engine state, and it warms this path's token counts as the
    harness's preparation warms the direct path's."""
    from trimkit.integrations.llamaindex import from_openai_messages

    trimmed = _trimmed_llm(llm, profile, dict(options or {}))
    messages, nodes = from_openai_messages(request["messages"]), _nodes(request)
    if arm == "llamaindex_postprocessor":
        nodes = _postprocessor(trimmed, request, budget_s).postprocess_nodes(nodes, query_str=messages[-1].content or "")
    return trimmed.prepare(messages, rag_chunks=nodes, ttft_budget_s=budget_s, **params)


def run_llamaindex_arm(arm: str, llm: Any, request: dict[str, Any], *, budget_s: float, profile: Any, params: dict[str, Any],
                       reset: Callable[[], None], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send one request of the set through LlamaIndex and trimkit's LlamaIndex integration, cold
    (see ``benchmarks/integrations.py`` for the returned dict)."""
    from trimkit.integrations.llamaindex import from_openai_messages

    if arm not in ARMS:
        raise ValueError(f"unknown LlamaIndex arm {arm!r}: one of {ARMS}")
    trimmed = _trimmed_llm(llm, profile, dict(options or {}))
    # what a LlamaIndex app holds before it calls the model: its chat history and its retriever's nodes
    messages = from_openai_messages(request["messages"])
    nodes = _nodes(request)
    pp, pp_s, pp_layer_s = None, 0.0, 0.0
    if arm == "llamaindex_postprocessor":  # set up once per query engine in an app: not timed
        pp = _postprocessor(trimmed, request, budget_s)
    reset()
    t0 = time.perf_counter()
    if pp is not None:
        t_pp = time.perf_counter()
        nodes = pp.postprocess_nodes(nodes, query_str=messages[-1].content or "")
        pp_s, pp_layer_s = time.perf_counter() - t_pp, pp.last_layer_s
    reply = trimmed.chat(messages, rag_chunks=nodes, ttft_budget_s=budget_s, **params)
    wall = time.perf_counter() - t0
    prepared = trimmed.last_prepared
    return {"report": trimmed.last_report, "messages_sent": list(prepared.messages), "wall_s": wall,
            "layer_s": trimmed.last_layer_s + pp_layer_s, "prepare_s": prepared.prepare_s + pp_s - pp_layer_s,
            "text": reply.message.content or ""}
