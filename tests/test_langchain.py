"""trimkit inside LangChain: the real framework (langchain-core, langchain-community's
ChatLlamaCpp, langchain-openai's ChatOpenAI) on the real embedded model, in process and through a
real ``python -m llama_cpp.server`` on loopback.

Prompts are short and answers a few tokens: what is checked is what trimkit sends, keeps and
reports from inside the framework, not the model's words.
"""

from __future__ import annotations

import asyncio
import copy
import pickle
from operator import itemgetter

import httpx
import openai
import pytest

try:
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.language_models import FakeListChatModel
    from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables import RunnableLambda
    from langchain_openai import ChatOpenAI
except ImportError as exc:  # the dev extra is part of the suite's set-up: fail, do not skip
    raise ImportError(f"tests/test_langchain.py needs the dev extra's LangChain packages (pip install -e '.[dev]'): {exc}") from exc

from tests.conftest import OTHER_MODEL, tool_turns_render
from trimkit.errors import InvalidBudgetError, InvalidChunkError, InvalidInputError
from trimkit.integrations.langchain import PLAN_EVENT, REPORT_EVENT, TrimmedChatModel, trimkit_context, trimkit_trimmer

TOOL = {"type": "function", "function": {"name": "lookup_record", "description": "Look up a record.",
                                         "parameters": {"type": "object", "properties": {"entity": {"type": "string"}}, "required": ["entity"]}}}
DOCS = [
    Document(page_content=f"Record {i}: the Varnow mill was inspected in {1880 + i}; it had {i + 2} wheels and a slate roof.",
             id=f"rec-{i}", metadata={"score": round(1.0 - i / 10, 2), "source": "ledger"})
    for i in range(6)
]
HISTORY = [
    HumanMessage("Who are you?"),
    AIMessage("The records assistant."),
    HumanMessage("Look up the Varnow mill."),
    AIMessage("", tool_calls=[{"name": "lookup_record", "args": {"entity": "Varnow mill"}, "id": "call-1"}]),
    ToolMessage("3 records found for the Varnow mill.", tool_call_id="call-1"),
    AIMessage("I found three records."),
]
PROMPT = ChatPromptTemplate.from_messages([
    ("system", "Answer briefly from the records."),
    MessagesPlaceholder("history"),
    ("human", "Records:\n{context}\n\nQuestion: {question}"),
])
QUESTION = "When was the Varnow mill inspected?"
AMPLE_S = 1000.0  # a budget nothing here comes near, whatever the host's load does to a provisional profile


def _retriever(question: str) -> list[Document]:
    return DOCS


def rag_chain(model):
    """retriever → trimkit_context() → prompt → model: the documents reach trimkit through the
    prompt's context variable."""
    return {"context": itemgetter("question") | RunnableLambda(_retriever) | trimkit_context(), "question": itemgetter("question"),
            "history": itemgetter("history")} | PROMPT | model


class Recorder(BaseCallbackHandler):
    """Keeps the custom events and the chat model runs a handler sees."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object, object]] = []
        self.model_runs: list[object] = []
        self.ends: list[dict] = []

    def on_chat_model_start(self, serialized, messages, *, run_id, **kwargs):
        self.model_runs.append(run_id)

    def on_llm_end(self, response, *, run_id, **kwargs):
        self.ends.append(response.generations[0][0].message.response_metadata)

    def on_custom_event(self, name, data, *, run_id, **kwargs):
        self.events.append((name, data, run_id))


def sent_messages(model) -> list[dict]:
    return list(model.trimkit.last_prepared.messages)


def tool_pairs_whole(messages: list[dict]) -> bool:
    """Every tool result has its call in the list, and every call its result."""
    calls = {c["id"] for m in messages for c in (m.get("tool_calls") or [])}
    results = {m["tool_call_id"] for m in messages if m.get("role") == "tool"}
    return calls == results


@pytest.fixture(scope="module")
def chat_llama(model_path):
    """A real ChatLlamaCpp, built as a user builds it (its own Llama on the embedded model)."""
    import trimkit.backends.llama  # noqa: F401 - registers "gemma-3", which ChatLlamaCpp's Llama looks up by name

    return ChatLlamaCpp(model_path=model_path, n_ctx=4096, n_batch=512, max_tokens=4, temperature=0.0, verbose=False,
                        model_kwargs={} if OTHER_MODEL else {"chat_format": "gemma-3"})


@pytest.fixture(scope="module")
def model(chat_llama):
    """The one-line change: the stored profile of that Llama, else a micro-calibration through it."""
    return TrimmedChatModel(chat_llama, ttft_budget_s=AMPLE_S)


@pytest.fixture
def tool_turns(chat_llama):
    """The history's tool turns need a template that renders them (TRIMKIT_TEST_MODEL may name one that cannot)."""
    if not tool_turns_render(chat_llama.client):
        pytest.skip("this model's chat template cannot render a tool-call turn (trimkit raises InvalidMessageError: tests/test_second_model.py)")


def cold(model) -> None:
    """Empty the engine's KV cache (the harness's doing: trimkit itself never resets it)."""
    with model.trimkit.backend.lock:
        model.trimkit.llm.reset()


def cold_untrimmed_s(model, messages, docs) -> float:
    """The predicted TTFT of the request untrimmed, with nothing cached (a plan only)."""
    trimmer = trimkit_trimmer(model, ttft_budget_s=1e6)
    trimmer.invoke({"messages": messages, "documents": docs})
    return trimmer.last_plan.predicted_ttft_before_s


# -- the in-process engine: ChatLlamaCpp ---------------------------------------------------------------
def test_wraps_the_llama_of_chat_llama_cpp_and_calibrates_through_it(model, chat_llama):
    assert model.trimkit.llm is chat_llama.client
    assert model.trimkit.profile.key.backend == "llama_cpp"
    assert model.inner is chat_llama and chat_llama.client is model.trimkit.llm  # the inner model is not changed
    assert model._llm_type == "trimkit-llama-cpp-python"


def test_multi_turn_rag_chain_keeps_the_callers_data_and_reports(model, tool_turns):
    chain = rag_chain(model)
    history = list(HISTORY)
    before = copy.deepcopy((history, DOCS))
    recorder = Recorder()
    first = chain.invoke({"question": QUESTION, "history": history}, config={"callbacks": [recorder]})
    report = model.last_report
    assert isinstance(first, AIMessage) and first.response_metadata["trimkit"] == report.to_dict()
    assert report.passthrough and report.ttft_budget_s == AMPLE_S  # ample: sent as built, every record in it
    last = sent_messages(model)[-1]["content"]
    assert last.startswith("Records:\n[rec-") and last.endswith(f"Question: {QUESTION}")
    assert all(f"[{d.id}] {d.page_content}" in last for d in DOCS)
    # the report went through the callbacks: a custom event with the model's own run, and on_llm_end
    assert [(name, run) for name, _, run in recorder.events] == [(REPORT_EVENT, recorder.model_runs[-1])]
    assert recorder.events[0][1] == report.to_dict() and recorder.ends[-1]["trimkit"] == report.to_dict()

    # the second turn, under a budget the whole request cannot meet: records and old turns go first
    history += [HumanMessage(QUESTION), first]
    prompt = PROMPT.invoke({"question": QUESTION, "history": history, "context": trimkit_context().invoke(DOCS)}).to_messages()
    tight = 0.3 * cold_untrimmed_s(model, prompt, None)
    cold(model)
    second = rag_chain(model.bind(ttft_budget_s=tight)).invoke({"question": QUESTION, "history": history})
    report = model.last_report
    assert second.response_metadata["trimkit"]["ttft_budget_s"] == pytest.approx(tight)
    assert report.trimmed and report.prompt_tokens < report.prompt_tokens_before
    dropped = {c for a in report.actions for c in a.removed_chunks}
    assert dropped and dropped <= {d.id for d in DOCS}  # the documents were trimmed as chunks, by their ids
    sent = sent_messages(model)
    assert sent[0]["content"] == "Answer briefly from the records." and sent[-1]["content"].endswith(f"Question: {QUESTION}")
    assert sent[-1]["content"].startswith("Records:\n")  # the text around the context stays in place
    assert tool_pairs_whole(sent)
    assert (history[:6], DOCS) == before and history[6].content == QUESTION


def test_stream_astream_and_ainvoke_carry_the_report(model):
    messages = [SystemMessage("Be brief."), HumanMessage("Name a colour.")]
    chunks = list(model.stream(messages, rag_chunks=DOCS[:2]))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.response_metadata["trimkit"] == model.last_report.to_dict()
    assert model.last_report.measured_ttft_s is not None and model.last_report.measurement.completion_tokens <= 4

    async def both():
        streamed = [c async for c in model.astream(messages)]
        return streamed, await model.ainvoke(messages, rag_chunks=DOCS[:1])

    streamed, answer = asyncio.run(both())
    assert streamed[-1].response_metadata["trimkit"]["prompt_tokens"] > 0
    assert answer.response_metadata["trimkit"] == model.last_report.to_dict()
    assert [a.removed_chunks for a in model.last_report.actions] == []  # one record, ample budget: kept


def test_bind_tools_reaches_the_engine_and_tool_turns_stay_whole(model, tool_turns):
    messages = [SystemMessage("Be brief."), *HISTORY, HumanMessage(QUESTION)]
    before = copy.deepcopy(messages)
    tight = 0.4 * cold_untrimmed_s(model, messages, DOCS)
    cold(model)
    out = model.bind_tools([TOOL]).invoke(messages, rag_chunks=DOCS, ttft_budget_s=tight)
    report = model.last_report
    assert out.response_metadata["trimkit"]["decode_params"]["tools"] == [TOOL]  # formatted by ChatLlamaCpp.bind_tools
    assert report.trimmed and tool_pairs_whole(sent_messages(model))
    assert messages == before
    # planning alone, at many budgets: a tool call and its result are always kept or dropped together
    untrimmed = cold_untrimmed_s(model, messages, DOCS)
    for share in (0.15, 0.25, 0.35, 0.5, 0.7):
        trimmer = trimkit_trimmer(model, ttft_budget_s=share * untrimmed)
        out_messages = trimmer.invoke({"messages": messages, "documents": DOCS})
        calls = [m for m in out_messages if isinstance(m, AIMessage) and m.tool_calls]
        results = [m for m in out_messages if isinstance(m, ToolMessage)]
        assert len(calls) == len(results) and all(m is messages[4] for m in calls)  # whole: the caller's own message
        assert all(m is messages[5] for m in results)


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


def test_as_the_inner_model_forced_tool_calls_tokens_tracing_fields_and_pickling(model, chat_llama):
    """What passes through from ChatLlamaCpp: a forced tool call's whole name (llama-cpp-python
    repeats it in every streamed chunk: trimkit assembles the completion), one on_llm_new_token per
    token on invoke, tracing params, the inner model's callbacks and tags, bind_tools' tool_choice,
    with_structured_output through trimkit, pickling; no calibration at construction."""
    forced = {"type": "function", "function": {"name": "lookup_record"}}
    out = model.bind_tools([TOOL], tool_choice=forced).invoke([HumanMessage("Look up the Varnow mill.")], max_tokens=24)
    assert out.response_metadata["trimkit"]["decode_params"]["tool_choice"] == forced
    assert [c["name"] for c in out.tool_calls] in ([], ["lookup_record"]) and all(c["name"] == "lookup_record" for c in out.invalid_tool_calls)
    assert out.usage_metadata["input_tokens"] == model.last_report.prompt_tokens
    tokens, raw_tokens = Tokens(), Tokens()
    model.invoke([HumanMessage("Say hi.")], config={"callbacks": [tokens]})
    chat_llama.invoke([HumanMessage("Say hi.")], config={"callbacks": [raw_tokens]})
    assert len(tokens.tokens) == len(raw_tokens.tokens) > 0
    assert model._get_ls_params() == chat_llama._get_ls_params()
    structured = model.with_structured_output(TOOL["function"])  # ChatLlamaCpp's own: a forced tool call, then a parser
    n = len(model.trimkit.reports)
    try:
        structured.invoke("Look up the Varnow mill.")
    except Exception:  # a 270M model may write no valid arguments: the parser says so, as raw
        pass
    assert len(model.trimkit.reports) == n + 1  # sent through trimkit

    recorder = Recorder()
    inner = chat_llama.model_copy(update={"callbacks": [recorder], "tags": ["inner-tag"]})
    lazy = TrimmedChatModel(inner, ttft_budget_s=AMPLE_S)
    assert lazy._engine._chat is None  # nothing measured at construction
    assert lazy.callbacks == [recorder] and lazy.tags == ["inner-tag"] and lazy.model_path == chat_llama.model_path
    lazy.invoke([HumanMessage("Say hi.")])
    assert recorder.model_runs and recorder.ends[-1]["trimkit"]["measured_ttft_s"] is not None
    clone = pickle.loads(pickle.dumps(model))  # as ChatLlamaCpp pickles: its Llama reloads; trimkit's wrapper is made on first use
    assert type(clone) is TrimmedChatModel and clone.ttft_budget_s == model.ttft_budget_s and clone._engine._chat is None
    assert clone.inner.client is not chat_llama.client and clone.inner.model_path == chat_llama.model_path


def test_trimkit_errors_are_the_openai_errors_the_raw_client_raises():
    from trimkit.errors import ServerError, ServerTimeoutError, StreamInterruptedError
    from trimkit.integrations import as_openai_error

    busy = as_openai_error(ServerError("busy", status=503, server_message="overloaded"))
    assert isinstance(busy, ServerError) and isinstance(busy, openai.InternalServerError) and busy.status_code == 503
    assert isinstance(as_openai_error(ServerError("bad", status=400)), openai.BadRequestError)
    assert isinstance(as_openai_error(ServerError("slow", status=429)), openai.RateLimitError)
    late = as_openai_error(ServerTimeoutError("late"))
    assert isinstance(late, openai.APITimeoutError) and isinstance(late, TimeoutError)
    assert isinstance(as_openai_error(StreamInterruptedError("cut")), openai.APIError)
    plain = ValueError("x")
    assert as_openai_error(plain) is plain


def test_the_one_line_change_keeps_the_answer_when_nothing_needs_trimming(chat_llama, model):
    prompt = ChatPromptTemplate.from_messages([("system", "Be brief."), ("human", "{question}")])
    before = (prompt | chat_llama | StrOutputParser()).invoke({"question": "Name a fruit."})
    after = (prompt | model | StrOutputParser()).invoke({"question": "Name a fruit."})
    assert after == before
    assert model.last_report.passthrough and model.last_report.decode_params["max_tokens"] == 4


def test_the_trimmer_step_returns_the_callers_messages_and_records_the_plan(model, chat_llama):
    messages = PROMPT.invoke({"question": QUESTION, "history": HISTORY, "context": trimkit_context().invoke(DOCS)}).to_messages()
    tight = 0.3 * cold_untrimmed_s(model, messages, None)
    trimmer = trimkit_trimmer(model, ttft_budget_s=tight)
    recorder = Recorder()
    answer = (PROMPT | trimmer | chat_llama).invoke({"question": QUESTION, "history": HISTORY, "context": trimkit_context().invoke(DOCS)},
                                                     config={"callbacks": [recorder]})
    plan = trimmer.last_plan
    assert isinstance(answer, AIMessage) and not plan.passthrough
    assert {c for a in plan.actions for c in a.removed_chunks} <= {d.id for d in DOCS}
    assert [name for name, _, _ in recorder.events] == [PLAN_EVENT] and recorder.events[0][1] == plan.to_dict()
    out = trimmer.invoke(messages)
    assert out[0] is messages[0]  # kept messages are the caller's objects
    assert all(any(m is o for o in messages) for m in out[:-1])
    assert out[-1] is not messages[-1] and out[-1].content.startswith("Records:\n")
    assert messages[-1].content.count("[rec-") == len(DOCS)  # the caller's message is unchanged


def test_bad_input_raises_typed_errors_before_anything_is_sent(model, chat_llama):
    n = len(model.trimkit.reports)
    ask = [HumanMessage("Hi.")]
    with pytest.raises(InvalidChunkError):
        model.invoke(ask, rag_chunks="not a list")
    with pytest.raises(InvalidChunkError):
        model.invoke(ask, rag_chunks=[Document(page_content="  ")])
    with pytest.raises(InvalidChunkError):
        model.invoke(ask, rag_chunks=[Document(page_content="x", metadata={"score": "high"})])
    with pytest.raises(InvalidBudgetError):
        model.invoke(ask, ttft_budget_s=-1)
    with pytest.raises(InvalidInputError):
        model.invoke([SystemMessage("no question")])
    assert len(model.trimkit.reports) == n
    with pytest.raises(InvalidInputError):
        TrimmedChatModel(FakeListChatModel(responses=["x"]))  # no engine trimkit can reach
    with pytest.raises(InvalidInputError):
        TrimmedChatModel(chat_llama.client)  # the Llama itself: use trimkit.wrap
    with pytest.raises(InvalidInputError):
        TrimmedChatModel(chat_llama, no_such_option=1)
    with pytest.raises(InvalidInputError):
        trimkit_trimmer(model.trimkit.profile, ttft_budget_s=1.0)  # a profile needs tokenizer=


# -- a local server: ChatOpenAI(base_url=...) -----------------------------------------------------------
@pytest.fixture(scope="module")
def served(llama_server):  # noqa: F811
    """ChatOpenAI on the real server, trimmed; calibrated (micro) through that server at construction."""
    served_model = httpx.get(llama_server + "/models", timeout=10).json()["data"][0]["id"]  # the name the server gives its model
    inner = ChatOpenAI(base_url=llama_server, api_key="none", model=served_model, max_tokens=4, temperature=0.0, max_retries=0)
    return TrimmedChatModel(inner, ttft_budget_s=AMPLE_S)


def test_chat_openai_on_a_local_server(served, llama_server):  # noqa: F811
    profile = served.trimkit.profile
    assert profile.key.backend == "openai_http" and profile.key.model.startswith(llama_server)
    out = served.invoke([SystemMessage("Be brief."), HumanMessage(QUESTION)], rag_chunks=DOCS[:3])
    report = served.last_report
    assert out.response_metadata["trimkit"] == report.to_dict() and report.measured_ttft_s is not None
    assert report.decode_params["max_tokens"] == 4  # ChatOpenAI's max_completion_tokens, sent as the max_tokens the server reads
    assert report.measurement.completion_tokens <= 4
    assert all(d.id in served.trimkit.last_prepared.messages[-1]["content"] for d in DOCS[:3])
    chunks = list(served.stream([HumanMessage("Say hi.")]))
    assert chunks[-1].response_metadata["trimkit"] == served.last_report.to_dict()
    answer = asyncio.run(served.ainvoke([HumanMessage("Say hi.")]))
    assert answer.response_metadata["trimkit"]["model"].endswith(llama_server)
    n = len(served.trimkit.reports)
    # response_format (ChatOpenAI sends it through chat.completions.parse) goes through trimkit, and
    # ends as the raw model's does: 4 tokens of JSON is cut short, and openai's parser says so
    with pytest.raises(openai.LengthFinishReasonError):
        served.invoke([HumanMessage("Hi.")], response_format={"type": "json_object"})
    assert len(served.trimkit.reports) == n + 1
    responses_api = TrimmedChatModel(served.inner.model_copy(update={"use_responses_api": True}), ttft_budget_s=AMPLE_S)
    with pytest.raises(InvalidInputError):  # the Responses API goes around chat.completions: refused, not sent unbudgeted
        responses_api.invoke([HumanMessage("Hi.")])
