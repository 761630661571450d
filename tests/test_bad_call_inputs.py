"""Inputs that are valid JSON or valid Python but no engine can take end in a typed
``InvalidInputError`` before anything is sent (issue 34, items 12, 8, 13): a lone surrogate, tools
that are not JSON objects, a NaN number, a message field nested too deep for a summary's
snapshot; and trimkit's own per-call options are never sent to the server. REAL loopback server;
surrogates are generated."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trimkit
from tests._core_helpers import make_profile
from tests.test_server_faults import ASK, FORMS, GOOD_STREAM, call, expect, sse_reply
from trimkit.errors import InvalidChunkError, InvalidInputError, InvalidMessageError
from trimkit.messages import coerce_chunks, validate_messages, validate_params
from trimkit.planning.summaries import messages_key
from trimkit.testing import FakeBackend

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["surrogate", "surrogate_part", "surrogate_chunk", "tools_object", "tools_not_json", "nan", "inf"])
def test_inputs_no_engine_can_take_are_a_typed_error_before_anything_is_sent(server, form, case):
    messages, params = [{"role": "user", "content": "Say hello."}], {}
    if case == "surrogate":
        messages = [{"role": "user", "content": "Say \ud800 hello."}]
    elif case == "surrogate_part":
        messages = [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]
    elif case == "surrogate_chunk":
        params["rag_chunks"] = ["retrieved \udc00 text"]
    elif case == "tools_object":
        params["tools"] = [object()]
    elif case == "tools_not_json":
        params["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"x": object()}}}]
    else:
        params["max_tokens" if case == "nan" else "temperature"] = float(case)
    out = call(form, server, stream=False, messages=messages, **params)
    expect(out, InvalidInputError)
    assert server.count("/v1/chat/completions") == 0


_surrogate = st.integers(0xD800, 0xDFFF).map(chr)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=20), _surrogate, st.text(max_size=20))
def test_a_lone_surrogate_anywhere_in_a_message_or_chunk_is_refused(before, surrogate, after):
    text = before + surrogate + after
    with pytest.raises(InvalidMessageError, match="lone surrogate"):
        validate_messages([{"role": "user", "content": text}])
    with pytest.raises(InvalidChunkError, match="lone surrogate"):
        coerce_chunks([text if text.strip() else text + "x"])


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([float("nan"), float("inf"), float("-inf"), -float("nan")]),
       st.sampled_from(["max_tokens", "temperature", "top_p", "presence_penalty"]))
def test_a_number_that_is_not_finite_is_refused_whatever_the_parameter(value, name):
    with pytest.raises(InvalidInputError, match=name):
        validate_params({name: value})


def _deep(depth: int) -> dict:
    root = cur = {}
    for _ in range(depth):
        cur["x"] = {}
        cur = cur["x"]
    return root


def test_a_message_field_nested_too_deep_does_not_break_summaries_or_their_keys():
    deep = _deep(5000)
    assert len(messages_key([{"role": "user", "content": "x", "meta": deep}])) == 64
    chat = trimkit.wrap(FakeBackend(), ttft_budget_s=0.3, profile=make_profile(), background_summaries=False)
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        messages += [{"role": "user", "content": f"question {i} " + "word " * 60, **({"meta": deep} if i == 1 else {})},
                     {"role": "assistant", "content": "answer " * 40}]
    messages.append({"role": "user", "content": "final?"})
    for _ in range(3):  # the second and third requests plan with the summaries the first left
        out = chat.create_chat_completion(messages=messages, max_tokens=2)
        assert out["choices"][0]["message"]["role"] == "assistant"
        chat.idle()


def test_a_per_call_on_busy_is_trimkits_not_sent_to_the_server(server):
    bodies = []

    def reply(h, body):
        bodies.append(body)
        sse_reply(*GOOD_STREAM)(h, body)

    server.chat(reply)
    for wrapped in (trimkit.wrap_url(server.base_url, model="m", profile=make_profile(), summarizer=None),
                    trimkit.wrap_url([server.base_url], model="m", profile=make_profile(), summarizer=None)):
        try:
            wrapped.chat.completions.create(messages=ASK, on_busy="wait", ttft_budget_s=1.0)
            assert "on_busy" not in bodies[-1] and "ttft_budget_s" not in bodies[-1]
            with pytest.raises(InvalidInputError):
                wrapped.chat.completions.create(messages=ASK, on_busy="sometimes")
        finally:
            wrapped.close()
