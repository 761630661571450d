"""trimkit inside LlamaIndex (trimkit.integrations.llamaindex): the real framework (llama-index-core,
llama-index-llms-llama-cpp) on the real embedded model, in process and through a real
``python -m llama_cpp.server`` on loopback.

The index is built in memory from the demo corpus with a word-hashing embedding defined here
(nothing is downloaded). Budgets are set from the profile's own predictions, so each test trims
whatever the host's speed.
"""

from __future__ import annotations

import asyncio
import hashlib
import re

import pytest

import trimkit
from tests.conftest import tool_turns_render
from trimkit.cli import load_corpus

try:
    from llama_index.core import VectorStoreIndex
    from llama_index.core.base.llms.types import ChatMessage, LLMMetadata, MessageRole
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.core.llms import CustomLLM
    from llama_index.core.memory import ChatMemoryBuffer
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.llama_cpp import LlamaCPP
except ImportError as exc:  # the dev extra installs them: fail, do not skip
    pytest.fail(f"LlamaIndex is missing ({exc}): install the dev extra (`.venv/bin/pip install -e '.[dev]'`, which pins "
                "llama-index-core and llama-index-llms-llama-cpp)", pytrace=False)

from trimkit.backends.llama import llama_prompt_tokenizer
from trimkit.integrations.llamaindex import EXCERPT_KEY, TrimkitPostprocessor, TrimmedLLM, from_openai_messages, nodes_to_chunks, to_openai_messages

QUESTION = "When was the Marrowby lighthouse lamp lit for the first time?"
ANSWER = "1863"  # in doc-04 (trimkit/data/questions.jsonl)


class WordEmbedding(BaseEmbedding):
    """Bag of hashed words: similar texts get similar vectors, offline and deterministic."""

    dim: int = 256

    def _vector(self, text: str) -> list[float]:
        v = [0.0] * self.dim
        for word in re.findall(r"[a-z0-9]+", text.lower()):
            v[int(hashlib.md5(word.encode()).hexdigest(), 16) % self.dim] += 1.0
        return v

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)


class ServerLLM(CustomLLM):
    """A LlamaIndex LLM configured the way ``OpenAILike`` is (``api_base``, ``model``, ``api_key``):
    TrimmedLLM reads the server's URL from it and sends through trimkit, never through it."""

    api_base: str
    model: str | None = None
    api_key: str = "fake"
    max_tokens: int | None = None

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(is_chat_model=True)

    def complete(self, prompt, formatted=False, **kwargs):
        raise AssertionError("TrimmedLLM must not send through the wrapped LLM")

    def stream_complete(self, prompt, formatted=False, **kwargs):
        raise AssertionError("TrimmedLLM must not send through the wrapped LLM")


def corpus_nodes(n: int = 6, sentences: int | None = 3) -> list[TextNode]:
    """The demo corpus's first ``n`` documents as nodes, each cut to its first ``sentences``
    (short prompts keep the real-model tests quick; doc-04's third sentence holds the answer)."""
    docs = load_corpus()[:n]
    texts = [d["text"] if sentences is None else " ".join(re.split(r"(?<=\.) ", d["text"])[:sentences]) for d in docs]
    return [TextNode(text=t, id_=d["id"]) for t, d in zip(texts, docs, strict=True)]


@pytest.fixture
def trimmed(llm, quick_profile) -> TrimmedLLM:
    """No default budget: each test gives the budget it needs (the postprocessor's, or per call)."""
    return TrimmedLLM(llm, profile=quick_profile, max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def index() -> VectorStoreIndex:
    return VectorStoreIndex(corpus_nodes(), embed_model=WordEmbedding())


def squeezing_budget(make, nodes: list, query: str) -> float:
    """A budget whose target (after the safety margin the postprocessor ``make(budget)`` plans
    with) lies halfway between the predicted TTFT of the question alone and with all ``nodes``:
    some nodes must go, and the question alone fits."""
    alone = make(1e6).plan_nodes([], query)[0].predicted_ttft_s
    full = make(1e6).plan_nodes(nodes, query)[0].predicted_ttft_before_s
    assert alone < full, f"the profile predicts {alone:.3f} s without nodes and {full:.3f} s with all: nothing to choose"
    target, budget = (alone + full) / 2, full
    for _ in range(3):  # the margin depends a little on the budget (a longer allowed prompt may extrapolate)
        budget = target / (1.0 - make(budget).plan_nodes(nodes, query)[0].safety_margin)
    return budget


def sent_text(llm: TrimmedLLM) -> str:
    return "\n".join(m["content"] or "" for m in llm.last_prepared.messages)


def test_query_engine_gets_the_postprocessor_in_one_line(index, trimmed):
    nodes = [NodeWithScore(node=n, score=None) for n in corpus_nodes()]
    budget = squeezing_budget(lambda b: TrimkitPostprocessor(llm=trimmed, ttft_budget_s=b), nodes, QUESTION)
    pp = TrimkitPostprocessor(llm=trimmed, ttft_budget_s=budget)
    query_engine = index.as_query_engine(llm=trimmed, similarity_top_k=6, node_postprocessors=[pp])  # the one line

    response = query_engine.query(QUESTION)

    plan = pp.last_plan
    assert plan.feasible and not plan.passthrough and plan.dropped_chunks
    assert plan.predicted_ttft_s <= plan.target_s < plan.predicted_ttft_before_s
    assert [n.node.node_id for n in response.source_nodes] == [c.id for c in plan.kept_chunks]
    assert ANSWER in sent_text(trimmed)  # the chunk worth its seconds: the answer's
    report = trimmed.last_report
    assert report is not None and report.measured_ttft_s is not None
    # the prompt planned is, to the character, the prompt the response synthesizer sent
    assert trimmed.last_prepared.messages == plan.messages


def test_postprocessor_never_changes_the_callers_nodes(llm, quick_profile):
    nodes = [NodeWithScore(node=n, score=1.0 - i / 10) for i, n in enumerate(corpus_nodes(sentences=None))]
    nodes[3].node.metadata["source"] = "harbour guide"
    before = [n.model_dump() for n in nodes]
    assert [c.score for c in nodes_to_chunks(nodes)] == [n.score for n in nodes]  # retriever scores go to the planner
    tokenizer = llama_prompt_tokenizer(llm)
    budget = squeezing_budget(lambda b: TrimkitPostprocessor(profile=quick_profile, tokenizer=tokenizer, ttft_budget_s=b), nodes, QUESTION)
    pp = TrimkitPostprocessor(profile=quick_profile, tokenizer=tokenizer, ttft_budget_s=budget, min_nodes=0)

    kept = pp.postprocess_nodes(nodes, query_str=QUESTION)

    assert [n.model_dump() for n in nodes] == before
    assert 0 < len(kept) < len(nodes) or any(EXCERPT_KEY in n.node.metadata for n in kept)
    for n in kept:
        original = next(o for o in nodes if o.node.node_id == n.node.node_id)
        if EXCERPT_KEY in n.node.metadata:  # a copy, cut
            assert n.node is not original.node and "…" in n.node.text and n.node.text != original.node.text
            assert n.node.get_content(metadata_mode="llm") == n.node.text
        else:
            assert n is original
    assert ANSWER in "".join(n.node.get_content(metadata_mode="llm") for n in kept)
    with pytest.raises(trimkit.errors.InvalidInputError):
        pp.postprocess_nodes(nodes)  # no query: nothing to weigh the nodes against


def test_multi_turn_context_chat_engine_sync_and_stream(index, trimmed):
    pp = TrimkitPostprocessor(llm=trimmed, ttft_budget_s=1e4)  # roomy: this test is about the conversation
    engine = index.as_chat_engine(chat_mode="context", llm=trimmed, similarity_top_k=1, node_postprocessors=[pp],
                                  memory=ChatMemoryBuffer.from_defaults(token_limit=3000))
    first = engine.chat("Tell me about the lighthouse.")
    report_one = trimmed.last_report
    assert report_one is not None and isinstance(first.response, str)
    assert {n.node.node_id for n in first.source_nodes} == {c.id for c in pp.last_plan.kept_chunks}
    streamed = engine.stream_chat(QUESTION)
    text = "".join(streamed.response_gen)
    assert text == streamed.response
    report_two = trimmed.last_report
    assert report_two is not report_one and report_two.measured_ttft_s is not None
    sent = trimmed.last_prepared.messages
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1]["content"] == "Tell me about the lighthouse." and sent[-1]["content"] == QUESTION


def test_async_chat_and_stream_report(trimmed):
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Answer briefly."), ChatMessage(role=MessageRole.USER, content=QUESTION)]
    before = [m.model_dump() for m in messages]
    nodes = corpus_nodes(4)[2:]

    async def run():
        reply = await trimmed.achat(messages, rag_chunks=nodes, max_tokens=4)  # nodes as rag_chunks: trimkit places them
        placed = trimmed.last_prepared
        stream = await trimmed.astream_chat(messages, max_tokens=4)
        return reply, placed, [r async for r in stream]

    reply, placed, parts = asyncio.run(run())
    assert reply.additional_kwargs["trimkit"].decode_params == {"max_tokens": 4, "temperature": 0.0, "stream": True}
    placed_text = placed.messages[-1]["content"]
    assert all(f"[{n.node_id}] {n.text}" in placed_text for n in nodes) and placed_text.endswith(QUESTION)
    assert parts[-1].additional_kwargs["trimkit"] is trimmed.last_report
    assert parts[-1].message.content == "".join(p.delta for p in parts)
    assert [m.model_dump() for m in messages] == before


def test_tool_calls_come_back_and_stay_whole(trimmed, llm):
    if not tool_turns_render(llm):
        pytest.skip("this model's chat template cannot render a tool-call turn (trimkit raises InvalidMessageError: tests/test_second_model.py)")

    def lookup_record(entity: str) -> str:
        """Look up the record of a Marrowby landmark."""
        return f"{entity}: first lit in 1863"

    tool = FunctionTool.from_defaults(fn=lookup_record)
    call = trimmed.chat_with_tools([tool], user_msg="Look up the lighthouse.", tool_required=True, max_tokens=16)
    selections = trimmed.get_tool_calls_from_response(call, error_on_no_tool_call=True)
    assert [s.tool_name for s in selections] == ["lookup_record"]
    tool_call = call.message.additional_kwargs["tool_calls"][0]
    history = [
        ChatMessage(role=MessageRole.SYSTEM, content="Answer briefly."),
        ChatMessage(role=MessageRole.USER, content="Look up the lighthouse."),
        call.message,
        ChatMessage(role=MessageRole.TOOL, content="lighthouse: first lit in 1863", additional_kwargs={"tool_call_id": tool_call["id"]}),
        ChatMessage(role=MessageRole.ASSISTANT, content="It was first lit in 1863."),
        ChatMessage(role=MessageRole.USER, content="And who keeps it?"),
    ]
    before = [m.model_dump() for m in history]
    as_sent = to_openai_messages(history)
    assert as_sent[2]["tool_calls"] == [tool_call] and as_sent[3]["tool_call_id"] == tool_call["id"]
    assert to_openai_messages(from_openai_messages(as_sent)) == as_sent  # and back, unchanged

    trimmed.chat(history, max_tokens=4)  # no budget: everything is sent, the call as the model made it
    assert trimmed.last_prepared.messages == as_sent
    planned = trimmed.prepare(history, max_tokens=4, ttft_budget_s=1e-3)  # planned, not sent
    trimmed.chat(history, max_tokens=4, ttft_budget_s=1e-3)  # no history fits: the call goes with its result
    assert [m["role"] for m in trimmed.last_prepared.messages] == ["system", "user"]
    assert trimmed.last_prepared.messages == planned.messages
    assert trimmed.last_report.feasible is False
    assert [m.model_dump() for m in history] == before


def test_llamacpp_is_wrapped_in_one_line(quick_profile, model_path):
    inner = LlamaCPP(model_path=model_path, context_window=4096, max_new_tokens=6, temperature=0.0, verbose=False,
                     model_kwargs={"chat_format": "gemma-3"} if "gemma" in model_path.lower() else {})
    llm = TrimmedLLM(inner, ttft_budget_s=30.0)  # the one line (the profile: the session's quick one, stored for this model)
    reply = llm.complete("Name a colour.")
    report = reply.additional_kwargs["trimkit"]
    assert report is llm.last_report and report.decode_params == {"temperature": 0.0, "max_tokens": 6, "stream": True}
    assert llm.metadata.context_window == inner._model.n_ctx() and llm.metadata.num_output == 6
    inner._model.reset()  # the same cold start as the call above: greedy decoding then gives the same answer on any model
    parts = list(llm.stream_complete("Name a colour."))
    assert parts[-1].text == reply.text  # temperature 0: the same answer, streamed


def test_openai_like_server_sync_and_async(llama_server):
    llm = TrimmedLLM(ServerLLM(api_base=llama_server, max_tokens=4), ttft_budget_s=30.0, calibration="micro")
    messages = [ChatMessage(role=MessageRole.USER, content="Say hi.")]
    reply = llm.chat(messages)
    assert reply.additional_kwargs["trimkit"].model.endswith(llama_server)
    assert reply.raw["choices"][0]["message"]["content"] == reply.message.content

    async def run():
        return [r async for r in await llm.astream_chat(messages)], await llm.achat(messages)

    parts, again = asyncio.run(run())
    assert parts[-1].additional_kwargs["trimkit"].measured_ttft_s is not None
    assert again.additional_kwargs["trimkit"] is llm.last_report
    assert llm.last_report.decode_params == {"max_tokens": 4, "stream": True}  # always streamed: TTFT is measured


def test_bad_input_is_refused_before_anything_is_sent(trimmed):
    with pytest.raises(trimkit.errors.InvalidInputError):
        TrimmedLLM(object())
    with pytest.raises(trimkit.errors.InvalidInputError):
        TrimkitPostprocessor(ttft_budget_s=1.0)  # neither llm nor profile
    with pytest.raises(trimkit.errors.InvalidMessageError):
        trimmed.chat([{"role": "user", "content": "not a ChatMessage"}])
    with pytest.raises(trimkit.errors.InvalidInputError):
        trimmed.chat([ChatMessage(role=MessageRole.USER, content="hi")], ttft_budget_s=-1.0)
    assert trimmed.last_report is None
