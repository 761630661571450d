"""trimkit in LlamaIndex (``pip install trimkit[llamaindex]``): keep the retrieved nodes worth
their predicted prefill seconds, and keep every chat's TTFT inside a budget.

Two pieces, each a one-line change to an existing pipeline (``docs/integrations.md``):

- :class:`TrimkitPostprocessor`, a node postprocessor for any query engine or context chat
  engine (``node_postprocessors=[TrimkitPostprocessor(llm=llm, ttft_budget_s=1.0)]``). For the
  query it plans the prompt the response synthesizer will send — LlamaIndex's question-answering
  prompt with the nodes in it — with trimkit's planner (:func:`trimkit.plan`, value per
  predicted second: docs/design.md, §4) and returns the nodes it keeps, most relevant first: whole,
  or (a copy) cut to the sentences that match the query. Retriever scores are used when every
  node has one. The caller's nodes are never changed; the plan is ``last_plan``.
- :class:`TrimmedLLM` (:mod:`trimkit.integrations.llamaindex_llm`), a LlamaIndex LLM around
  ``LlamaCPP`` or ``OpenAILike``: every chat, stream, async call and completion is planned,
  measured and reported by trimkit (``llm.last_report``), for chat engines and agents.

With both, the postprocessor chooses the context and the LLM measures the request and trims what
is left to trim: the older turns of a chat.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.chat_prompts import TEXT_QA_PROMPT_TMPL_MSGS
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from trimkit.backends.base import client_kind
from trimkit.errors import InvalidInputError
from trimkit.integrations.llamaindex_convert import excerpts_possible, kept_nodes, nodes_to_chunks
from trimkit.integrations.llamaindex_engine import engine_of
from trimkit.integrations.llamaindex_llm import TrimmedLLM
from trimkit.messages import check_rag_templates
from trimkit.planning.planner import Plan, plan
from trimkit.planning.values import ValueModel
from trimkit.prepared import place_chunks
from trimkit.profile import Profile
from trimkit.strategies import cap_rag_chunks, chain, reuse_prefix
from trimkit.tokens import PromptTokenizer
from trimkit.validation import budget as valid_budget

__all__ = ["TrimkitPostprocessor", "TrimmedLLM", "QA_SYSTEM_PROMPT", "QA_RAG_TEMPLATE", "QA_CHUNK_TEMPLATE"]

#: The system message of LlamaIndex's question-answering prompt for chat models (what a query
#: engine's response synthesizer sends), as the installed LlamaIndex words it.
QA_SYSTEM_PROMPT: str = TEXT_QA_PROMPT_TMPL_MSGS[0].content or ""
#: Its user message, as a trimkit ``rag_template``: the nodes at ``{chunks}``, the query at ``{question}``.
QA_RAG_TEMPLATE: str = (TEXT_QA_PROMPT_TMPL_MSGS[1].content or "").replace("{context_str}", "{chunks}").replace("{query_str}", "{question}")
#: How the synthesizer joins nodes: their text, a blank line between them.
QA_CHUNK_TEMPLATE = "{text}"


class TrimkitPostprocessor(BaseNodePostprocessor):
    """Keep the retrieved nodes worth their predicted prefill seconds for the query.

    ``llm``: where the prompt will run — a :class:`TrimmedLLM` (its profile, exact token
    counts, learned safety margin and KV cache), a LlamaIndex ``LlamaCPP`` / ``OpenAILike``, a
    ``llama_cpp.Llama``, a server URL or a trimkit wrapper (a trimkit front-end is made for
    it: :func:`trimkit.wrap`, calibrating once unless a profile is stored). Or no ``llm`` and a
    ``profile=`` (:func:`trimkit.calibrate`), with ``tokenizer=`` (default: an estimate).

    ``ttft_budget_s``: the budget of the request that carries the nodes (default: the
    ``TrimmedLLM``'s). In a context chat engine the history shares it: give the postprocessor
    a smaller one to leave room for history (the ``TrimmedLLM`` then trims the older turns).

    The prompt planned is ``system_prompt`` (None: none) and the query placed into
    ``rag_template`` with each node rendered by ``rag_chunk_template`` — by default LlamaIndex's
    own question-answering prompt for chat models, so the prompt planned is the prompt a query
    engine sends. ``min_nodes``: the most relevant nodes always kept whole; ``excerpts``: a node may
    be cut to the sentences matching the query (a copy of it, see
    :mod:`trimkit.integrations.llamaindex_convert`); ``values`` (default: the llm's trimkit
    wrapper's), ``strategies`` (default: count the cached prefix, then drop or cut nodes): as for
    :func:`trimkit.plan`. When even no node fits, none is kept (the plan says infeasible)."""

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
    _profile: Profile | None = PrivateAttr(default=None)
    _tokenizer: Any = PrivateAttr(default=None)
    _values: ValueModel | None = PrivateAttr(default=None)
    _strategies: Any = PrivateAttr(default=None)
    _plans: deque[Plan] = PrivateAttr()
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
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
            engine = engine_of(llm, self.ttft_budget_s, summarizer=None)
            self._front, self._decode = engine.front_end, dict(engine.params)
        if self.ttft_budget_s is None and self._budget() is None:
            raise InvalidInputError("TrimkitPostprocessor needs a TTFT budget: ttft_budget_s=, or an llm that has one")
        self._profile = profile
        self._tokenizer = tokenizer if tokenizer is not None else (PromptTokenizer.estimate() if llm is None else None)
        self._values = values
        self._strategies = strategies
        self._plans = deque(maxlen=self.max_plans)

    @classmethod
    def class_name(cls) -> str:
        return "TrimkitPostprocessor"

    @property
    def last_plan(self) -> Plan | None:
        """The plan of the latest call: what it kept, dropped and cut, and the predicted TTFT."""
        with self._lock:
            return self._plans[-1] if self._plans else None

    @property
    def last_layer_s(self) -> float:
        """Seconds the latest call spent converting nodes to chunks and kept chunks back to nodes."""
        with self._lock:
            return self._last_layer_s

    @property
    def plans(self) -> list[Plan]:
        """Recent plans, most recent last (at most ``max_plans``)."""
        with self._lock:
            return list(self._plans)

    def _budget(self) -> float | None:
        if self.ttft_budget_s is not None:
            return self.ttft_budget_s
        if self._llm is not None:
            return self._llm.ttft_budget_s
        return getattr(self._front, "ttft_budget_s", None)

    def plan_nodes(self, nodes: list[NodeWithScore], query: str) -> tuple[Plan, list[NodeWithScore]]:
        """Plan ``nodes`` for ``query``: the plan, and the nodes to send in its order."""
        if not isinstance(query, str):
            raise InvalidInputError(f"the query must be a str, got {type(query).__name__}")
        t0 = time.perf_counter()
        chunks = nodes_to_chunks(nodes, self.metadata_mode)
        layer = time.perf_counter() - t0
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [{"role": "user", "content": query}]
        strategies = self._strategies
        if strategies is None:
            strategies = chain(reuse_prefix(), cap_rag_chunks(min_chunks=self.min_nodes, excerpts=self.excerpts and excerpts_possible(nodes)))
        budget = self._budget()
        engine: dict[str, Any] = {"profile": self._profile, "tokenizer": self._tokenizer}
        front = self._front
        if front is not None:  # as the front-end plans its own requests: its margin for this prompt, its cache
            backend, tokenizer = front.backend, front.backend.tokenizer
            whole = tokenizer.prompt_tokens(place_chunks(messages, chunks, self.rag_template, self.rag_chunk_template))
            margin = front.engine.request_margin(front.attainment_target, budget, len(whole), backend.predict_cached_tokens(whole))
            decode = self._llm.decode_params if self._llm is not None else self._decode
            max_tokens = decode.get("max_tokens") or 0  # the context window keeps room for the answer
            engine = {"profile": front.profile, "tokenizer": tokenizer, "safety_margin": margin,
                      "cache_probe": lambda m: backend.predict_cached_tokens(tokenizer.prompt_tokens(m)),
                      "max_prompt_tokens": max(int(backend.n_ctx) - int(max_tokens), 1)}
        values = self._values if self._values is not None or front is None else front.values
        result = plan(messages, rag_chunks=chunks, ttft_budget_s=budget, strategies=strategies, values=values,
                      rag_template=self.rag_template, rag_chunk_template=self.rag_chunk_template, **engine)
        t0 = time.perf_counter()
        kept = kept_nodes(result.kept_chunks, nodes)
        with self._lock:
            self._plans.append(result)
            self._last_layer_s = layer + time.perf_counter() - t0
        return result, kept

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if query_bundle is None:
            raise InvalidInputError("TrimkitPostprocessor needs the query (query_bundle= or query_str=): nodes are worth what they add to it")
        if not nodes:
            return []
        return self.plan_nodes(nodes, query_bundle.query_str)[1]

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        # counting may ask a server's tokenizer: off the event loop
        return await asyncio.to_thread(self._postprocess_nodes, nodes, query_bundle)
