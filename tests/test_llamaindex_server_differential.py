"""The LlamaIndex LLM wrapper over a real server, against the LLM it wraps: a raw ``OpenAILike``
(llama-index-llms-openai-like, a ``FunctionCallingLLM``) and ``TrimmedLLM(OpenAILike)`` on the
a real ``python -m llama_cpp.server`` on loopback (SmolLM2-135M-Instruct, greedy decoding), call for
call — ``chat``, ``stream_chat``, ``complete``, ``achat``, ``astream_chat``, the metadata, the
token counts — and tool calling as LlamaIndex does it (``chat_with_tools``, ``predict_and_call``,
``get_tool_calls_from_response``); then trimkit's node postprocessor inside a real query engine
(``VectorStoreIndex`` with LlamaIndex's ``MockEmbedding``), in front of the raw LLM and of the
wrapped one.

With a budget that trims nothing the wrapped LLM must send what the raw one sends, so greedy
decoding gives the same words and the same tool calls. Where trimkit differs (it streams every
request to see the first token; it never extends the caller's ``chat_history``):
docs/integrations.md, "LlamaIndex — where TrimmedLLM differs".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

try:
    from llama_index.core import VectorStoreIndex
    from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike
    from pydantic import BaseModel
except ImportError as exc:  # the dev extra is part of the suite's set-up: fail, do not skip
    raise ImportError(f"tests/test_llamaindex_server_differential.py needs the dev extra's LlamaIndex packages "
                      f"(llama-index-llms-openai-like, pinned in constraints.txt): {exc}") from exc

import trimkit
from tests._server import running_server
from trimkit.integrations.llamaindex import TrimkitPostprocessor, TrimmedLLM

#: the server's chat format: SmolLM2-135M-Instruct's template is ChatML (llama-cpp-python's "chatml")
CHAT_FORMAT = "chatml"
MAX_TOKENS = 32
ASK = [ChatMessage(role=MessageRole.SYSTEM, content="Answer briefly."), ChatMessage(role=MessageRole.USER, content="Name a colour of the sea.")]
NO_BUDGET = 1000.0  # a budget nothing exceeds: nothing is trimmed, the request is the raw one


def lookup_record(entity: str) -> str:
    """Look up the harbour ledger's record of a landmark (the lighthouse, the slipway, ...)."""
    return f"{entity}: first lit in 1887"


def harbour_ledger(entity: str, year: int) -> str:
    """Read the harbour ledger's entry about a landmark for one year."""
    return f"{entity} in {year}: rebuilt in stone"


class Events(BaseEventHandler):
    """The LLM events LlamaIndex dispatches: their class names, and the messages of each chat start."""

    names: list = []
    chats: list = []

    @classmethod
    def class_name(cls) -> str:
        return "Events"

    def handle(self, event, **kwargs) -> None:
        name = type(event).__name__
        if name.startswith("LLM"):
            self.names.append(name)
        if name == "LLMChatStartEvent":
            self.chats.append([m.model_copy(deep=True) for m in event.messages])


@pytest.fixture
def events():
    handler = Events(names=[], chats=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


@pytest.fixture(scope="module")
def served(smollm2_model_path) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of a real ``python -m llama_cpp.server`` serving SmolLM2-135M-Instruct
    (an instruction-tuned model; its GGUF's template is ChatML, named here), for this module."""
    with running_server(model_path=smollm2_model_path, chat_format=CHAT_FORMAT) as server:
        yield server.base_url, httpx.get(server.base_url + "/models", timeout=10).json()["data"][0]["id"]


def openai_like(url: str, model: str, **fields) -> OpenAILike:
    """An ``OpenAILike`` as a user configures one for a local server (greedy, a chat model)."""
    # reuse_client=False: a new openai client per call, so that no async client outlives the event loop of an asyncio.run
    config = {"is_chat_model": True, "context_window": 4096, "max_tokens": MAX_TOKENS, "temperature": 0.0, "max_retries": 0, "timeout": 120.0,
              "reuse_client": False}
    return OpenAILike(model=model, api_base=url, api_key="sk-local", **{**config, **fields})


@pytest.fixture(scope="module")
def raw(served) -> OpenAILike:
    return openai_like(*served, is_function_calling_model=True)


@pytest.fixture(scope="module")
def wrapped(raw) -> TrimmedLLM:
    # the server's template named: trimkit's counts are then exact, and fill the usage a stream lacks (docs/servers.md)
    return TrimmedLLM(raw, ttft_budget_s=NO_BUDGET, calibration="micro", chat_format=CHAT_FORMAT)


def arms(served: tuple[str, str], raw: OpenAILike, wrapped: TrimmedLLM) -> Iterator[tuple[str, object]]:
    """The raw arm, then the wrapped one, each from the same server state: llama-cpp-python reuses
    the longest cached prefix of the previous prompt, and a prompt evaluated from another split can
    round differently and change a greedy answer. An unrelated request first leaves both arms the
    same (short) prefix."""
    for arm, llm in (("raw", raw), ("wrapped", wrapped)):
        evict(served)
        yield arm, llm


def evict(served: tuple[str, str]) -> None:
    """Send the server an unrelated one-token request (see :func:`arms`)."""
    body = {"model": served[1], "messages": [{"role": "user", "content": "Unrelated."}], "max_tokens": 1}
    httpx.post(served[0] + "/chat/completions", json=body, timeout=120).raise_for_status()


def _calls(llm, response: ChatResponse) -> list[tuple[str, dict]]:
    """A reply's tool calls as LlamaIndex reads them: (name, arguments)."""
    return [(s.tool_name, s.tool_kwargs) for s in llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)]


# -- plain calls ------------------------------------------------------------------------------------
def test_chat_and_complete_answer_as_the_raw_llm(raw, wrapped, served, events):
    answers = {}
    for arm, llm in arms(served, raw, wrapped):
        events.names.clear()
        reply = llm.chat(ASK)
        assert isinstance(reply, ChatResponse) and reply.message.role == MessageRole.ASSISTANT
        assert events.names[0] == "LLMChatStartEvent" and events.names[-1] == "LLMChatEndEvent"
        counts = {k: reply.additional_kwargs.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        done = llm.complete("The sea is")
        answers[arm] = (reply.message.content, [type(b).__name__ for b in reply.message.blocks], counts, done.text)
    assert answers["wrapped"] == answers["raw"]
    assert answers["raw"][0], "the model said nothing: the comparison would be empty"
    report = wrapped.last_report
    assert report.passthrough and report.decode_params["max_tokens"] == MAX_TOKENS and report.decode_params["temperature"] == 0.0


def test_streams_add_up_to_the_raw_llm_s_answer(raw, wrapped, served):
    answers = {}
    for arm, llm in arms(served, raw, wrapped):
        parts = list(llm.stream_chat(ASK))
        assert parts and all(isinstance(p, ChatResponse) for p in parts)
        assert "".join(p.delta or "" for p in parts) == parts[-1].message.content
        answers[arm] = parts[-1].message.content
    assert answers["wrapped"] == answers["raw"] and answers["raw"]
    assert parts[-1].additional_kwargs["trimkit"] is wrapped.last_report  # documented: one more response, with the report


def test_async_calls_answer_as_the_raw_llm(raw, wrapped, served):
    async def run(llm):
        reply = await llm.achat(ASK)
        parts = [p async for p in await llm.astream_chat(ASK)]
        return reply.message.content, "".join(p.delta or "" for p in parts)

    answers = {arm: asyncio.run(run(llm)) for arm, llm in arms(served, raw, wrapped)}
    assert answers["wrapped"] == answers["raw"] and answers["raw"][0]
    assert answers["raw"][0] == answers["raw"][1]


def test_metadata_is_the_raw_llm_s(raw, wrapped, served):
    m_raw, m_wrapped = raw.metadata, wrapped.metadata
    for field in ("context_window", "num_output", "is_chat_model", "is_function_calling_model", "model_name"):
        assert getattr(m_wrapped, field) == getattr(m_raw, field), field
    # a context window larger than the server's is capped at the server's (trimkit reads it)
    big = TrimmedLLM(openai_like(*served, context_window=1 << 20, default_headers={"X-Team": "harbour"}), profile=wrapped.trimkit_chat.profile)
    assert big.metadata.context_window == int(wrapped.trimkit_chat.backend.n_ctx) < 1 << 20
    assert big.metadata.is_function_calling_model is False  # the raw LLM's default, kept
    assert big.trimkit_chat.backend.transport.headers["X-Team"] == "harbour"  # the headers its client sends, sent by trimkit


# -- tools --------------------------------------------------------------------------------------------
def test_chat_with_tools_returns_the_raw_llm_s_tool_calls(raw, wrapped, served):
    tools = [FunctionTool.from_defaults(fn=lookup_record), FunctionTool.from_defaults(fn=harbour_ledger)]
    history = [ChatMessage(role=MessageRole.SYSTEM, content="Use the tools.")]
    outcomes = {}
    for arm, llm in arms(served, raw, wrapped):
        mine = list(history)
        forced = llm.chat_with_tools(tools, user_msg="Look up the lighthouse.", chat_history=mine, tool_choice="lookup_record")
        calls = _calls(llm, forced)
        blocks = [type(b).__name__ for b in forced.message.blocks]
        listed = forced.message.additional_kwargs["tool_calls"]
        # without a forced choice llama-cpp-python's chat formats do not constrain the reply: whatever it does, both arms do
        required = llm.chat_with_tools(tools[:1], user_msg="Look up the slipway.", tool_required=True)
        outcomes[arm] = (calls, blocks, [c.function.name for c in listed], _calls(llm, required), required.message.content, len(mine))
    assert outcomes["wrapped"][:5] == outcomes["raw"][:5]
    assert outcomes["raw"][0] and outcomes["raw"][0][0][0] == "lookup_record" and isinstance(outcomes["raw"][0][0][1], dict)
    # the raw OpenAILike appends the user message to the caller's chat_history; trimkit leaves it alone (documented)
    assert outcomes["raw"][5] == len(history) + 1 and outcomes["wrapped"][5] == len(history)


def test_predict_and_call_calls_the_tool_as_the_raw_llm(raw, wrapped, served):
    tool = FunctionTool.from_defaults(fn=harbour_ledger)
    outcomes = {}
    for arm, llm in arms(served, raw, wrapped):
        out = llm.predict_and_call([tool], user_msg="What does the ledger say about the lighthouse in 1902?", tool_choice="harbour_ledger",
                                   max_tokens=48)
        outcomes[arm] = (out.response, [(s.tool_name, s.raw_input) for s in out.sources])
    assert outcomes["wrapped"] == outcomes["raw"]
    assert outcomes["raw"][1] and outcomes["raw"][1][0][0] == "harbour_ledger"
    report = wrapped.last_report
    assert report.decode_params["max_tokens"] == MAX_TOKENS  # as the raw OpenAILike sends it: its own max_tokens over the call's
    assert report.decode_params["tool_choice"] == {"type": "function", "function": {"name": "harbour_ledger"}}
    assert [t["function"]["name"] for t in report.decode_params["tools"]] == ["harbour_ledger"]


def test_async_and_streamed_tool_calls_end_as_the_raw_llm_s(raw, wrapped, served):
    tool = FunctionTool.from_defaults(fn=lookup_record)

    async def run(llm):
        reply = await llm.achat_with_tools([tool], user_msg="Look up the slipway.", tool_choice="lookup_record")
        out = await llm.apredict_and_call([tool], user_msg="Look up the slipway.", tool_choice="lookup_record")
        return _calls(llm, reply), out.response

    answers = {arm: asyncio.run(run(llm)) for arm, llm in arms(served, raw, wrapped)}
    assert answers["wrapped"] == answers["raw"] and answers["raw"][0]
    evict(served)
    parts = list(wrapped.stream_chat_with_tools([tool], user_msg="Look up the slipway.", tool_choice="lookup_record"))
    # whole names: llama-cpp-python repeats a call's name in every streamed chunk (docs/integrations.md)
    assert _calls(wrapped, parts[-1]) == answers["raw"][0]


def test_a_tool_turn_goes_back_to_the_server_as_the_raw_llm_sends_it(raw, wrapped, served):
    """The assistant's tool-call message (as the raw LLM's own conversion builds it) and its result
    in the history of the next call: both arms send it, and end the same way — the same answer,
    or, where llama-cpp-python's server refuses an assistant turn holding only tool calls (a 500),
    the same ``openai`` error: the wrapped one is also trimkit's ``ServerError``."""
    tool = FunctionTool.from_defaults(fn=lookup_record)
    outcomes = {}
    for arm, llm in arms(served, raw, wrapped):
        call = llm.chat_with_tools([tool], user_msg="Look up the lighthouse.", tool_choice="lookup_record")
        selection = llm.get_tool_calls_from_response(call)[0]
        history = [ChatMessage(role=MessageRole.USER, content="Look up the lighthouse."), call.message,
                   ChatMessage(role=MessageRole.TOOL, content=lookup_record(**selection.tool_kwargs),
                               additional_kwargs={"tool_call_id": selection.tool_id, "name": selection.tool_name})]
        try:
            outcomes[arm] = llm.chat(history + [ChatMessage(role=MessageRole.USER, content="When was it lit?")]).message.content
        except openai.APIError as exc:
            openai_type = next(t for t in type(exc).__mro__ if t.__module__.startswith("openai"))
            outcomes[arm] = (openai_type, getattr(exc, "status_code", None))
            if arm == "wrapped":
                assert isinstance(exc, trimkit.errors.ServerError) and exc.status == exc.status_code
    assert outcomes["wrapped"] == outcomes["raw"]


class Colour(BaseModel):
    name: str


def _outcome(call) -> object:
    """What a call returned, or the kind of error it raised (its ``openai`` type where it has one)."""
    try:
        return call()
    except Exception as exc:
        return next((t for t in type(exc).__mro__ if t.__module__.startswith("openai")), ValueError if isinstance(exc, ValueError) else type(exc))


def test_structured_predict_ends_as_the_raw_llm_s(raw, wrapped, served):
    """``OpenAI.structured_predict`` asks for a forced tool call (``tool_choice="required"``: LlamaIndex's
    program drops a ``tool_choice`` of the call's), or, with ``should_use_structured_outputs``, for a
    ``response_format``. Both arms end the same way, whatever the server and the model make of it: an
    object, or the same kind of error (llama-cpp-python's chat formats do not constrain
    ``"required"``, and its server refuses ``json_schema`` response formats)."""
    prompt = PromptTemplate("Name the colour of {what}.")
    schema_raw = openai_like(*served, is_function_calling_model=True, should_use_structured_outputs=True)
    schema_wrapped = TrimmedLLM(schema_raw, ttft_budget_s=NO_BUDGET, profile=wrapped.trimkit_chat.profile, chat_format=CHAT_FORMAT)
    outcomes = {}
    for arm, llm, schema_llm in (("raw", raw, schema_raw), ("wrapped", wrapped, schema_wrapped)):
        outcomes[arm] = (_outcome(lambda llm=llm: llm.structured_predict(Colour, prompt, what="the sea")),
                         _outcome(lambda llm=llm: asyncio.run(llm.astructured_predict(Colour, prompt, what="grass"))),
                         _outcome(lambda llm=schema_llm: llm.structured_predict(Colour, prompt, what="the sky")))
    assert outcomes["wrapped"] == outcomes["raw"]
    assert outcomes["raw"][2] is not ValueError  # the response_format was sent, not a tool call


# -- the node postprocessor in a real query engine ----------------------------------------------------
LEDGER = [
    ("ledger-12", "The harbour light was first lit in 1887 and rebuilt in stone in 1902, after the great storm of that winter "
                  "had broken the wooden tower and carried its lamp room into the sea."),
    ("ledger-40", "The harbour has moorings for forty boats and a slipway that the fishing fleet uses in every season; the "
                  "moorings were renewed in 1958 and again in 1996, when the outer wall was raised."),
    ("ledger-7", "The lifeboat station opened in 1911 beside the old fish market, and its first boat was rowed by twelve "
                 "volunteers who answered the maroons at any hour of the day or night."),
    ("ledger-3", "The customs house on the quay kept the harbour's records from 1820 until 1931, when the ledgers moved to "
                 "the town hall and the building became a chandlery and later a museum of the fleet."),
    ("ledger-21", "The breakwater was begun in 1870 with granite from the quarry above the town and finished in 1879, "
                  "sheltering the inner harbour from the north-easterly gales that had wrecked so many boats."),
    ("ledger-33", "The ferry to the island ran twice a day from the north pier until 1964, carrying mail, sheep and the "
                  "doctor, and in winter it often waited a week for the sea to calm."),
]
QUESTION = "When was the harbour light first lit?"


def _ledger(tag: str = "") -> list[TextNode]:
    """The ledger's nodes; a ``tag`` opens each text, so that no earlier prompt on the server
    holds them (a cached prefix would make them nearly free to keep)."""
    return [TextNode(text=f"{tag}{text}", id_=node_id) for node_id, text in LEDGER]


def _sent(events) -> str:
    """The text of the latest chat the LLM received."""
    return "\n".join(m.content or "" for m in events.chats[-1])


def _squeezing_budget(llm, nodes: list[NodeWithScore]) -> float:
    """A budget whose target lies halfway between the predicted TTFT of the question alone and
    with every node (after the margin the postprocessor plans with): some nodes must go."""
    def plan(budget, items):
        return TrimkitPostprocessor(llm=llm, ttft_budget_s=budget).plan_nodes(items, QUESTION)[0]

    alone, full = plan(1e6, []).predicted_ttft_s, plan(1e6, nodes).predicted_ttft_before_s
    assert alone < full, f"predicted {alone:.3f} s without nodes and {full:.3f} s with all: nothing to choose"
    target, budget = (alone + full) / 2, full
    for _ in range(3):  # the margin depends a little on the budget
        budget = target / (1.0 - plan(budget, nodes).safety_margin)
    return budget


def test_query_engine_with_the_postprocessor_sends_the_kept_nodes(raw, wrapped, served, events):
    nodes = _ledger()
    before = [n.model_dump() for n in nodes]
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    retrieved = index.as_retriever(similarity_top_k=len(nodes)).retrieve(QUESTION)
    assert len(retrieved) == len(nodes)

    # no trimming: the postprocessor keeps every node (most relevant first: trimkit's ranking, documented), and the
    # wrapped LLM behind it answers what the raw one answers behind it
    plain = index.as_query_engine(llm=raw, similarity_top_k=len(nodes)).query(QUESTION)
    answers = {}
    for arm, llm in arms(served, raw, wrapped):
        kept_all = TrimkitPostprocessor(llm=llm, ttft_budget_s=NO_BUDGET)
        response = index.as_query_engine(llm=llm, similarity_top_k=len(nodes), node_postprocessors=[kept_all]).query(QUESTION)
        assert kept_all.last_plan.passthrough and [n.node.node_id for n in response.source_nodes] == [c.id for c in kept_all.last_plan.kept_chunks]
        answers[arm] = ([n.node.node_id for n in response.source_nodes], _sent(events), response.response)
    assert answers["wrapped"] == answers["raw"] and answers["raw"][2]
    assert sorted(answers["raw"][0]) == sorted(n.node.node_id for n in plain.source_nodes)
    assert answers["raw"][0][-1] == "ledger-12"  # the node that answers the question comes last, next to it

    # a budget that keeps some nodes: with the raw LLM behind it, and with the wrapped one (nodes new to the server each time)
    for tag, llm in (("Ledger A. ", raw), ("Ledger B. ", wrapped)):
        tagged = _ledger(tag)
        tagged_index = VectorStoreIndex(tagged, embed_model=MockEmbedding(embed_dim=8))
        budget = _squeezing_budget(llm, tagged_index.as_retriever(similarity_top_k=len(nodes)).retrieve(QUESTION))
        pp = TrimkitPostprocessor(llm=llm, ttft_budget_s=budget)
        events.chats.clear()
        response = tagged_index.as_query_engine(llm=llm, similarity_top_k=len(nodes), node_postprocessors=[pp]).query(QUESTION)
        plan = pp.last_plan
        assert plan.feasible and plan.dropped_chunks and plan.predicted_ttft_s <= plan.target_s < plan.predicted_ttft_before_s
        kept_ids = [c.id for c in plan.kept_chunks]
        assert [n.node.node_id for n in response.source_nodes] == kept_ids and 0 < len(kept_ids) < len(nodes)
        sent = _sent(events)  # what reached the LLM: the kept nodes' text (or their excerpts), none of the dropped ones
        for node in response.source_nodes:
            assert node.node.get_content() in sent
        for chunk in plan.dropped_chunks:
            assert chunk.text not in sent
        assert isinstance(response.response, str) and response.response
        if llm is wrapped:  # the wrapped LLM measured the request the postprocessor planned, and sent it as planned
            report = wrapped.last_report
            assert report is not None and report.measured_ttft_s is not None and report.ttft_budget_s == NO_BUDGET
            assert wrapped.last_prepared.messages == plan.messages

    # nothing the user passed was changed: the nodes, the index's nodes, the retrieved NodeWithScore objects
    assert [n.model_dump() for n in nodes] == before
    assert [index.docstore.get_node(i).model_dump() for i, _ in LEDGER] == before
    again = [n.model_dump() for n in retrieved]
    pp.postprocess_nodes(retrieved, query_bundle=QueryBundle(QUESTION))
    assert [n.model_dump() for n in retrieved] == again


def test_query_engine_async_with_the_postprocessor(wrapped, events):
    nodes = _ledger("Ledger C. ")
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    retrieved = index.as_retriever(similarity_top_k=len(nodes)).retrieve(QUESTION)
    pp = TrimkitPostprocessor(llm=wrapped, ttft_budget_s=_squeezing_budget(wrapped, retrieved))
    engine = index.as_query_engine(llm=wrapped, similarity_top_k=len(nodes), node_postprocessors=[pp])
    response = asyncio.run(engine.aquery(QUESTION))
    assert [n.node.node_id for n in response.source_nodes] == [c.id for c in pp.last_plan.kept_chunks]
    assert pp.last_plan.dropped_chunks and wrapped.last_report.measured_ttft_s is not None
    assert wrapped.last_prepared.messages == pp.last_plan.messages
    assert json.dumps([m.content for m in events.chats[-1]])  # the synthesizer's chat reached the LLM
