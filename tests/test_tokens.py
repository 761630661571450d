"""Counting prompt tokens with the offline tiktoken estimate (no engine, no model)."""

from __future__ import annotations

import numpy as np
import pytest

from trimkit.planning.tokens import PromptTokenizer, Segments, TiktokenTokenizer, chatml_render, common_prefix_len, reusable_prefix_len

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there, how are you doing today?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 20 C"},
    {"role": "user", "content": [{"type": "text", "text": "Thanks! And tomorrow?"}]},
]


@pytest.fixture
def tok() -> PromptTokenizer:
    return PromptTokenizer.estimate()


# -- count and its cache ------------------------------------------------------------------------


def test_count_is_the_number_of_tokens(tok):
    text = "Prefill reads the whole prompt at once."
    assert tok.count(text) == len(tok.tokenizer.encode(text)) > 0
    assert tok.count("") == 0


def test_a_recount_is_served_from_the_cache(tok):
    tok.count("some text to count")
    calls = tok.count_calls
    assert tok.count("some text to count") == tok.count("some text to count")
    assert tok.count_calls == calls


def test_each_new_text_is_tokenized_once(tok):
    tok.count("a")
    tok.count("b")
    tok.count("a")
    assert tok.count_calls == 2


def test_the_cache_forgets_the_least_recently_used_text():
    tok = PromptTokenizer(TiktokenTokenizer(), chatml_render, cache_size=2)  # a tiny cache, to see eviction
    tok.count("one")
    tok.count("two")
    tok.count("one")  # "one" is now the most recently used
    tok.count("three")  # evicts "two"
    calls = tok.count_calls
    tok.count("one")
    assert tok.count_calls == calls
    tok.count("two")
    assert tok.count_calls == calls + 1


def test_the_estimate_is_not_exact(tok):
    assert tok.exact is False
    assert "tiktoken" in tok.name


# -- segment_counts -----------------------------------------------------------------------------


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_segment_counts_add_up_to_about_the_whole_prompt(tok, tools):
    segments = tok.segment_counts(CONVERSATION, tools)
    whole = len(tok.prompt_tokens(CONVERSATION, tools))
    assert len(segments.counts) == len(CONVERSATION)
    assert all(n > 0 for n in segments.counts)
    # tokenizing at message boundaries splits at most one merge per boundary, and only upward
    assert whole <= segments.total <= whole + len(CONVERSATION)


def test_tool_definitions_are_counted(tok):
    assert tok.segment_counts(CONVERSATION, TOOLS).total > tok.segment_counts(CONVERSATION).total + 10


def test_a_longer_message_has_a_larger_segment(tok):
    short = [{"role": "user", "content": "hi"}]
    long = [{"role": "user", "content": "hi " * 200}]
    assert tok.segment_counts(long).counts[0] > tok.segment_counts(short).counts[0] + 150


def test_a_recount_of_the_same_conversation_tokenizes_nothing(tok):
    first = tok.segment_counts(CONVERSATION)
    calls = tok.count_calls
    assert tok.segment_counts(CONVERSATION) == first
    assert tok.count_calls == calls


def test_a_new_message_tokenizes_only_the_new_segment(tok):
    tok.segment_counts(CONVERSATION)
    calls = tok.count_calls
    longer = CONVERSATION + [{"role": "assistant", "content": "Rain, probably."}]
    segments = tok.segment_counts(longer)
    assert tok.count_calls == calls + 1
    assert segments.counts[:-1] == tok.segment_counts(CONVERSATION).counts


def test_segment_counts_do_not_change_the_messages(tok):
    import copy

    before = copy.deepcopy(CONVERSATION)
    tok.segment_counts(CONVERSATION, TOOLS)
    assert CONVERSATION == before


def test_an_unsplittable_template_falls_back_to_chatml_estimates():
    tok = PromptTokenizer(PromptTokenizer.estimate().tokenizer, lambda messages, tools=None: "no markers here")
    segments = tok.segment_counts([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    assert len(segments.counts) == 2 and all(n > 0 for n in segments.counts)
    assert segments.tail > 0


# the shape of Gemma 3's own chat template: system text folded into the first user turn, and
# every message's content passed through ``| trim``
GEMMA_LIKE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{{ '<start_of_turn>model\\n' }}"
)


def test_segments_survive_a_template_that_trims_content():
    import jinja2

    template = jinja2.Environment().from_string(GEMMA_LIKE_TEMPLATE)

    def render(messages, tools=None):
        return template.render(messages=messages, bos_token="<bos>")

    tok = PromptTokenizer(PromptTokenizer.estimate().tokenizer, render)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there, how are you doing today?"},
        {"role": "assistant", "content": "Fine, thanks."},
        {"role": "user", "content": "Tell me about prefill and decode."},
    ]
    segments = tok.segment_counts(messages)
    whole = len(tok.prompt_tokens(messages))
    assert all(n > 0 for n in segments.counts)
    assert abs(segments.total - whole) <= len(messages)


def test_a_template_that_rewrites_content_falls_back_to_estimates():
    import json

    def render(messages, tools=None):  # escapes every non-ASCII character, markers included
        return "".join(f"<{m['role']}>{json.dumps(m['content'])}" for m in messages) + "<assistant>"

    tok = PromptTokenizer(PromptTokenizer.estimate().tokenizer, render)
    segments = tok.segment_counts([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    assert all(n > 0 for n in segments.counts)


def test_a_template_that_drops_a_message_gives_it_no_tokens():
    # like llama-cpp-python's "gemma" format, which drops system messages
    def render(messages, tools=None):
        return "".join(f"<turn {m['role']}>{m['content']}</turn>" for m in messages if m["role"] != "system") + "<turn model>"

    tok = PromptTokenizer(PromptTokenizer.estimate().tokenizer, render)
    segments = tok.segment_counts([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert segments.counts[0] == 0 and segments.counts[1] > 0


def test_segments_total_is_the_messages_and_the_tail():
    assert Segments((3, 4), 2).total == 9


def test_the_estimate_adds_no_bos_token(tok):
    assert tok.prefix_tokens == 0


def test_chatml_render_ends_with_the_generation_prompt():
    text = chatml_render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# -- common_prefix_len --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([], [], 0),
        ([1, 2, 3], [], 0),
        ([], [1], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 3, 4, 5], 3),
        ([1, 2, 3, 4, 5], [1, 2], 2),
        ([9, 2, 3], [1, 2, 3], 0),
        ([1, 2, 9, 4], [1, 2, 3, 4], 2),
        ([1, 2, 3], [1, 2, 4], 2),
        ((5, 6, 7), [5, 6, 8], 2),
    ],
)
def test_common_prefix_len(a, b, expected):
    assert common_prefix_len(a, b) == expected
    assert common_prefix_len(b, a) == expected


def test_common_prefix_len_of_numpy_arrays():
    assert common_prefix_len(np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4])) == 2


def test_common_prefix_len_returns_a_plain_int():
    assert type(common_prefix_len([1, 2], [1, 3])) is int
    assert type(common_prefix_len([1, 2], [1, 2])) is int


@pytest.mark.parametrize(
    "cached, prompt, expected",
    [
        ([], [], 0),
        ([1, 2, 3], [], 0),
        ([], [1, 2], 0),
        ([1, 2, 3], [1, 2, 9], 2),
        ([1, 2, 3], [1, 2, 3], 2),  # all cached: one token is evaluated again all the same
        ([1, 2, 3, 4], [1, 2], 1),
        ([5], [5], 0),
    ],
)
def test_reusable_prefix_len_leaves_one_token_to_evaluate(cached, prompt, expected):
    assert reusable_prefix_len(cached, prompt) == expected
