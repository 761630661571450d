"""Gemma 3's chat template (trimkit.backends.llama) on the real embedded model: the system prompt
reaches the model, and trimkit counts exactly the tokens the model evaluates."""

from __future__ import annotations

import httpx
import pytest

from tests._core_helpers import contains, evaluated_tokens
from trimkit.backends.llama import GEMMA3_CHAT_FORMAT, format_gemma3, gemma3_chat_handler

SYSTEM = "Always answer as Captain Quill, keeper of the Marrowby lighthouse."
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who lit the lamp?"}]


def render(messages, **kwargs):
    return format_gemma3(messages, **kwargs).prompt


@pytest.fixture(scope="module")
def plain_gemma(model_path):
    """The same model under llama-cpp-python's own "gemma" format (the trap)."""
    import trimkit

    return trimkit.default_llama(model_path=model_path, n_ctx=1024, chat_format="gemma")


# -- the rendering -------------------------------------------------------------------------------


def test_system_text_heads_the_first_user_turn():
    result = format_gemma3(ASK)
    assert result.prompt == (
        f"<start_of_turn>user\n{SYSTEM}\n\nWho lit the lamp?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert result.added_special is False  # no <bos> in the text: the tokenizer adds exactly one
    assert result.stop == "<end_of_turn>"


def test_no_system_message():
    assert render([{"role": "user", "content": "Hi"}]) == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_several_system_messages_are_joined_by_a_blank_line():
    text = render([
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Cite the document id."},
        {"role": "user", "content": "Hi"},
    ])
    assert text.startswith("<start_of_turn>user\nBe brief.\n\nCite the document id.\n\nHi<end_of_turn>\n")


def test_a_later_system_message_heads_the_next_user_turn_and_none_is_lost():
    text = render([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "From now on, answer in French."},
        {"role": "user", "content": "Where is the harbour?"},
        {"role": "system", "content": "Trailing note."},
    ])
    assert text == (
        "<start_of_turn>user\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nFrom now on, answer in French.\n\nWhere is the harbour?<end_of_turn>\n"
        "<start_of_turn>user\nTrailing note.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_assistant_is_model_and_tool_results_are_user_turns():
    text = render([
        {"role": "user", "content": "Weather in Marrowby?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"town": "Marrowby"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Fog, 9 °C."},
        {"role": "function", "name": "tides", "content": "High tide at 14:02."},
        {"role": "assistant", "content": "Foggy, 9 °C."},
    ])
    assert text == (
        "<start_of_turn>user\nWeather in Marrowby?<end_of_turn>\n"
        '<start_of_turn>model\nweather({"town": "Marrowby"})<end_of_turn>\n'
        "<start_of_turn>user\nFog, 9 °C.<end_of_turn>\n"
        "<start_of_turn>user\nHigh tide at 14:02.<end_of_turn>\n"
        "<start_of_turn>model\nFoggy, 9 °C.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_content_is_trimmed_and_text_parts_are_joined():
    text = render([{"role": "user", "content": [
        {"type": "text", "text": "  Read this. "},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "\nThen answer.\n"},
    ]}])
    assert text == "<start_of_turn>user\nRead this.Then answer.<end_of_turn>\n<start_of_turn>model\n"
    assert render([{"role": "user", "content": "\n  Hi  \n"}]).startswith("<start_of_turn>user\nHi<end_of_turn>")


@pytest.mark.parametrize("messages", [
    [],
    [{"role": "system", "content": "Only a system prompt."}],
    [{"role": "assistant", "content": "I speak first."}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"},
     {"role": "assistant", "content": "d"}],
    [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": None}],
])
def test_non_alternating_roles_never_raise(messages):
    text = render(messages)
    assert "<bos>" not in text and text.endswith("<start_of_turn>model\n")
    if messages and messages[0]["role"] == "system":
        assert messages[0]["content"] in text  # never dropped


def test_the_name_is_registered_with_llama_cpp_python():
    from llama_cpp import llama_chat_format

    from trimkit.backends.llama_format import chat_format_renderer

    assert llama_chat_format.get_chat_completion_handler(GEMMA3_CHAT_FORMAT) is gemma3_chat_handler
    assert chat_format_renderer(GEMMA3_CHAT_FORMAT)(ASK) == render(ASK)


# -- on the real model ---------------------------------------------------------------------------


def test_default_llama_uses_the_handler_and_passes_keywords_through(llm, plain_gemma):
    assert llm.chat_handler is gemma3_chat_handler and llm.chat_format == GEMMA3_CHAT_FORMAT
    assert llm.n_ctx() == 4096
    assert plain_gemma.chat_handler is None and plain_gemma.chat_format == "gemma" and plain_gemma.n_ctx() == 1024


def test_the_model_evaluates_the_system_text(llm):
    system_tokens = llm.tokenize(SYSTEM.encode(), add_bos=False, special=False)
    llm.create_chat_completion(messages=ASK, max_tokens=1)
    evaluated = evaluated_tokens(llm)
    assert contains(evaluated, system_tokens)
    assert evaluated[0] == llm.token_bos() and evaluated[1] != llm.token_bos()  # exactly one BOS


def test_plain_gemma_format_never_shows_the_system_text_to_the_model(plain_gemma):
    """The trap this module exists for: llama-cpp-python's "gemma" format drops system messages."""
    system_tokens = plain_gemma.tokenize(SYSTEM.encode(), add_bos=False, special=False)
    plain_gemma.create_chat_completion(messages=ASK, max_tokens=1)
    assert not contains(evaluated_tokens(plain_gemma), system_tokens)


CONVERSATIONS = {
    "system + user": ASK,
    "no system": ASK[1:],
    "several systems, history": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Ahoy."},
        {"role": "user", "content": "When was the lamp lit?"},
    ],
    "tool turns": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Fog."},
        {"role": "user", "content": "So?"},
    ],
    "text parts": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                   {"role": "user", "content": [{"type": "text", "text": "Who "}, {"type": "text", "text": "lit it?"}]}],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_trimkit_counts_exactly_the_tokens_the_model_evaluates(llm, name):
    from trimkit.backends.llama import llama_prompt_tokenizer

    messages = CONVERSATIONS[name]
    tok = llama_prompt_tokenizer(llm)
    counted = tok.prompt_tokens(messages)
    out = llm.create_chat_completion(messages=messages, max_tokens=1)
    assert out["usage"]["prompt_tokens"] == len(counted)
    assert evaluated_tokens(llm)[: len(counted)] == [int(t) for t in counted]
    assert tok.dropped_messages(messages) == ()


def test_segment_counts_split_the_template_in_order(llm):
    from trimkit.backends.llama import llama_prompt_tokenizer

    tok = llama_prompt_tokenizer(llm)
    messages = CONVERSATIONS["several systems, history"]
    pieces = tok.layout(messages, None)
    assert pieces == (
        "<start_of_turn>user\n", "\n\n", "\n\n",
        "<end_of_turn>\n<start_of_turn>model\n", "<end_of_turn>\n<start_of_turn>user\n",
        "<end_of_turn>\n<start_of_turn>model\n",
    )
    segments = tok.segment_counts(messages)
    assert all(n > 0 for n in segments.counts)
    assert sum(segments.counts) + segments.tail == len(tok.prompt_tokens(messages))


def test_a_wrapped_request_sends_what_trimkit_counted(llm, quick_profile):
    import trimkit

    chat = trimkit.wrap(llm, profile=quick_profile)
    messages = CONVERSATIONS["several systems, history"]
    out = chat.create_chat_completion(messages=messages, max_tokens=1)
    report = chat.last_report
    unwrapped = llm.create_chat_completion(messages=messages, max_tokens=1)
    assert report.prompt_tokens == out["usage"]["prompt_tokens"] == unwrapped["usage"]["prompt_tokens"]
    assert not any("chat template" in w for w in report.warnings)


# -- template-drop detection ---------------------------------------------------------------------


def test_dropped_messages_names_what_the_gemma_format_leaves_out(llm, plain_gemma):
    from trimkit.backends.llama import llama_prompt_tokenizer

    assert llama_prompt_tokenizer(plain_gemma).dropped_messages(ASK) == (0,)
    assert llama_prompt_tokenizer(llm).dropped_messages(ASK) == ()


def test_dropped_messages_with_a_template_that_drops_tool_results_too():
    from trimkit.planning.tokens import PromptTokenizer

    def render_(messages, tools=None):  # like "gemma": only user and assistant turns survive
        return "".join(f"<{m['role']}>{m['content']}" for m in messages if m["role"] in ("user", "assistant"))

    tok = PromptTokenizer(PromptTokenizer.estimate().tokenizer, render_)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "tool", "content": "t", "tool_call_id": "1"}, {"role": "user", "content": "v"}]
    assert tok.dropped_messages(messages) == (0, 2)


def test_dropped_messages_cannot_tell_for_a_template_that_rewrites_content():
    import json

    from trimkit.planning.tokens import PromptTokenizer

    def render_(messages, tools=None):  # escapes every non-ASCII character, the markers included
        return "".join(f"<{m['role']}>{json.dumps(m['content'])}" for m in messages)

    tok = PromptTokenizer(PromptTokenizer.estimate().tokenizer, render_)
    assert tok.dropped_messages(ASK) == ()


# -- the server ----------------------------------------------------------------------------------


def test_the_test_server_renders_the_system_prompt_as_trimkit_counts_it(llama_server):
    """tests/_server.py starts llama_cpp.server with --chat_format gemma-3 (registered by its launcher)."""
    from trimkit.backends.http import OpenAIHTTPBackend

    named = OpenAIHTTPBackend(llama_server, chat_format=GEMMA3_CHAT_FORMAT)
    try:
        out = httpx.post(named.base_url + "/chat/completions", json={"messages": ASK, "max_tokens": 1}, timeout=60).json()
        without_system = httpx.post(named.base_url + "/chat/completions", json={"messages": ASK[1:], "max_tokens": 1}, timeout=60).json()
        assert named.prompt_count_exact
        assert len(named.tokenizer.prompt_tokens(ASK)) == out["usage"]["prompt_tokens"]
        assert out["usage"]["prompt_tokens"] > without_system["usage"]["prompt_tokens"] + 10  # the system text was sent
    finally:
        named.close()
