"""The LlamaIndex LLM wrapper against the LLM it wraps: the raw ``LlamaCPP`` and
``TrimmedLLM(LlamaCPP)`` on one real in-process model, call for call — ``chat``, ``stream_chat``,
``complete``, ``stream_complete``, ``achat``, ``astream_chat``, ``structured_predict``, the
instrumentation events each call emits, and ``metadata``.

What is compared is the shape of what LlamaIndex code reads (types, roles, how a stream adds up,
the events, the metadata fields), not the words: the raw ``LlamaCPP`` formats prompts with its
``messages_to_prompt`` and calls the completion API, while trimkit sends the chat through the
engine's chat template (docs/integrations.md: "LlamaIndex — where trimkit differs").
"""

from __future__ import annotations

import asyncio

import pytest

try:
    from llama_index.core.base.llms.types import ChatMessage, ChatResponse, CompletionResponse, MessageRole
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.llama_cpp import LlamaCPP
    from pydantic import BaseModel
except ImportError as exc:  # the dev extra is part of the suite's set-up: fail, do not skip
    raise ImportError(f"tests/test_llamaindex_differential.py needs the dev extra's LlamaIndex packages: {exc}") from exc

import trimkit.backends.llama  # noqa: F401 - registers chat_format="gemma-3", which the raw LlamaCPP's Llama looks up when it is made
from tests.conftest import OTHER_MODEL
from trimkit.integrations.llamaindex import TrimmedLLM

MAX_TOKENS = 6
ASK = [ChatMessage(role=MessageRole.USER, content="Name a colour.")]


class Events(BaseEventHandler):
    """The instrumentation events LlamaIndex dispatches, by class name."""

    names: list = []

    @classmethod
    def class_name(cls) -> str:
        return "Events"

    def handle(self, event, **kwargs) -> None:
        self.names.append(type(event).__name__)


@pytest.fixture(scope="module")
def raw(model_path):
    return LlamaCPP(model_path=model_path, context_window=4096, max_new_tokens=MAX_TOKENS, temperature=0.0, verbose=False,
                    model_kwargs={} if OTHER_MODEL else {"chat_format": "gemma-3"})


@pytest.fixture(scope="module")
def wrapped(raw):
    return TrimmedLLM(raw, ttft_budget_s=1000.0)


@pytest.fixture
def events():
    handler = Events(names=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


def _events_of(events, call) -> tuple[object, list[str]]:
    events.names.clear()
    out = call()
    return out, [n for n in events.names if n.startswith("LLM")]


def test_chat_and_complete_answer_as_the_raw_llm_does(raw, wrapped, events):
    for llm in (raw, wrapped):
        reply, chat_events = _events_of(events, lambda llm=llm: llm.chat(ASK))
        assert isinstance(reply, ChatResponse) and reply.message.role == MessageRole.ASSISTANT and isinstance(reply.message.content, str)
        assert reply.raw is not None
        assert chat_events[0] == "LLMChatStartEvent" and chat_events[-1] == "LLMChatEndEvent"
        done, completion_events = _events_of(events, lambda llm=llm: llm.complete("A colour:"))
        assert isinstance(done, CompletionResponse) and isinstance(done.text, str)
        assert completion_events[0] == "LLMCompletionStartEvent" and completion_events[-1] == "LLMCompletionEndEvent"
    assert wrapped.chat(ASK).additional_kwargs["trimkit"] is wrapped.last_report


def test_streams_add_up_as_the_raw_llm_s(raw, wrapped, events):
    for llm in (raw, wrapped):
        events.names.clear()
        parts = list(llm.stream_chat(ASK))
        assert parts and all(isinstance(p, ChatResponse) for p in parts)
        assert "".join(p.delta or "" for p in parts) == parts[-1].message.content
        assert events.names.count("LLMChatInProgressEvent") >= 1 and events.names[-1] == "LLMChatEndEvent"
        pieces = list(llm.stream_complete("A colour:"))
        assert pieces and "".join(p.delta or "" for p in pieces) == pieces[-1].text


def test_async_calls_answer_as_the_raw_llm_does(raw, wrapped):
    async def run(llm):
        reply = await llm.achat(ASK)
        parts = [p async for p in await llm.astream_chat(ASK)]
        return reply, parts

    for llm in (raw, wrapped):
        reply, parts = asyncio.run(run(llm))
        assert isinstance(reply, ChatResponse) and reply.message.role == MessageRole.ASSISTANT
        assert parts and "".join(p.delta or "" for p in parts) == parts[-1].message.content


class Colour(BaseModel):
    name: str


def test_structured_predict_ends_as_the_raw_llm_s(raw, wrapped):
    """A 270M model may not write the JSON: then both raise (the same kind of error), never a
    silent None; when the raw LLM returns an object, so does the wrapped one."""
    prompt = PromptTemplate('Reply with JSON like {{"name": "red"}} for a colour: {what}')
    outcomes = {}
    for arm, llm in (("raw", raw), ("wrapped", wrapped)):
        try:
            out = llm.structured_predict(Colour, prompt, what="the sky", llm_kwargs={"max_tokens": 24})
            assert isinstance(out, Colour)
            outcomes[arm] = "object"
        except (ValueError, TypeError) as exc:  # LlamaIndex's parsers raise ValueError (pydantic's ValidationError is one)
            outcomes[arm] = f"error:{isinstance(exc, ValueError)}"
    assert outcomes["raw"] != "object" or outcomes["wrapped"] == "object", outcomes


def test_metadata_is_the_raw_llm_s_where_it_names_the_engine(raw, wrapped):
    m_raw, m_wrapped = raw.metadata, wrapped.metadata
    assert m_wrapped.context_window == m_raw.context_window
    assert m_wrapped.num_output == m_raw.num_output
    assert m_wrapped.is_chat_model  # documented: trimkit sends chats through the engine's chat template
