"""The server flags that decide whether cached tokens are seen: vLLM and SGLang report them only
when started with a flag; without it the field is ``null`` — "not reported", never 0 — and
trimkit names the flag once (trimkit.backends.server.CACHE_REPORT_FLAGS).

No GPU engine runs here: the replies are replayed on loopback in the shapes the engines send.

- VLLM_USAGE: a vLLM ``/v1/completions`` reply without ``--enable-prompt-tokens-details``
  (facebook/opt-125m), printed in llm-d-incubation/llm-d-modelservice ``README.md``:
  ``"usage":{"completion_tokens":16,"prompt_tokens":4,"prompt_tokens_details":null,"total_tokens":20}``;
- SGLANG_USAGE: SGLang's ``UsageInfo`` (sgl-project/sglang
  ``python/sglang/srt/entrypoints/openai/protocol.py``: ``prompt_tokens_details:
  Optional[Dict[str, int]] = None``), serialised as it is without ``--enable-cache-report``;
- VLLM_CACHED: ``prompt_tokens_details.cached_tokens`` as vLLM sends it with the flag
  (vllm-project/vllm ``vllm/entrypoints/openai/protocol.py``, ``PromptTokenUsageInfo``).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests._core_helpers import make_profile
from tests.test_server_faults import chunk, json_reply, sse_reply
from trimkit import wrap_url
from trimkit.backends.replies import SOURCE_USAGE, parse_server_stats

VLLM_USAGE = {"completion_tokens": 16, "prompt_tokens": 4, "prompt_tokens_details": None, "total_tokens": 20}
SGLANG_USAGE = {"prompt_tokens": 22, "total_tokens": 24, "completion_tokens": 2, "prompt_tokens_details": None}
VLLM_CACHED = {"prompt_tokens": 40, "total_tokens": 45, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 32}}


@pytest.mark.parametrize("usage", [VLLM_USAGE, SGLANG_USAGE, {**VLLM_USAGE, "prompt_tokens_details": {"cached_tokens": None}}])
def test_a_null_cached_count_is_not_reported_never_zero(usage):
    stats = parse_server_stats({"usage": usage}, strict=True)
    assert stats.source == SOURCE_USAGE and stats.prompt_tokens == usage["prompt_tokens"]
    assert stats.cached_tokens is None and stats.evaluated_tokens is None


def test_a_reported_cached_count_is_read():
    stats = parse_server_stats({"usage": VLLM_CACHED}, strict=True)
    assert stats.cached_tokens == 32 and stats.evaluated_tokens == 8


def engine_server(server: Any, owned_by: str, usage: dict[str, Any]) -> None:
    server.routes["/v1/models"] = json_reply({"object": "list", "data": [{"id": "m", "owned_by": owned_by}]})
    usage_chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": usage}
    server.chat(sse_reply(chunk(role="assistant"), chunk("Hello"), chunk(finish="stop"), usage_chunk))


def flag_warnings(caplog: Any, flag: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if flag in r.getMessage()]


@pytest.mark.parametrize("owned_by, usage, flag", [
    ("vllm", VLLM_USAGE, "--enable-prompt-tokens-details"),
    ("sglang", SGLANG_USAGE, "--enable-cache-report"),
])
def test_an_engine_that_reports_no_cached_tokens_is_told_its_flag_once(server, caplog, owned_by, usage, flag):
    engine_server(server, owned_by, usage)
    chat = wrap_url(server.base_url, model="m", profile=make_profile(), summarizer=None)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        for _ in range(3):
            out = chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out["choices"][0]["message"]["content"] == "Hello"
    assert len(flag_warnings(caplog, flag)) == 1
    m = chat.last_report.measurement
    assert m.cached_tokens is None and m.server["cached_tokens_reported"] is False


@pytest.mark.parametrize("owned_by, usage", [("vllm", VLLM_CACHED), ("llamacpp-python", VLLM_USAGE), ("fault", VLLM_USAGE)])
def test_no_flag_warning_where_it_would_not_help(server, caplog, owned_by, usage):
    # an engine that reports its cached tokens, and engines the flags do not exist for
    engine_server(server, owned_by, usage)
    chat = wrap_url(server.base_url, model="m", profile=make_profile(), summarizer=None)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert not [m for m in caplog.records if "--enable-" in m.getMessage()]


# -- vLLM's /tokenize with messages: exact counts ------------------------------------------------------
# The reply shapes are those vLLM's own tests check (vllm-project/vllm
# tests/entrypoints/openai/test_tokenization.py: /tokenize answers {"count", "max_model_len",
# "tokens", "token_strs": null} for a prompt or for messages with add_generation_prompt, and
# /detokenize {"prompt"}). The tokenizer behind them here is a word-level stand-in, so the test
# checks what trimkit asks and how it counts, not vLLM's tokenizer.
class WordVocab:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {"<s>": 1}
        self.words = {1: "<s>"}
        self.bodies: list[dict[str, Any]] = []

    def encode(self, text: str) -> list[int]:
        out = []
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.ids) + 1
                self.words[self.ids[word]] = word
            out.append(self.ids[word])
        return out

    def render(self, messages: list[dict[str, Any]]) -> str:  # a zephyr-like template, as in vLLM's test
        return " ".join(f"<|{m['role']}|> {m['content']} </s>" for m in messages) + " <|assistant|>"


def vllm_server(server: Any) -> WordVocab:
    vocab = WordVocab()
    server.routes["/v1/models"] = json_reply({"object": "list", "data": [{"id": "m", "owned_by": "vllm", "max_model_len": 8192}]})

    def tokenize(h: Any, body: dict[str, Any]) -> None:
        vocab.bodies.append(body)
        if "messages" in body:
            tokens = vocab.encode(vocab.render(body["messages"]))
        else:
            tokens = ([1] if body.get("add_special_tokens") else []) + vocab.encode(body["prompt"])
        json_reply({"count": len(tokens), "max_model_len": 8192, "tokens": tokens, "token_strs": None})(h, body)

    def detokenize(h: Any, body: dict[str, Any]) -> None:
        json_reply({"prompt": " ".join(vocab.words[t] for t in body["tokens"])})(h, body)

    server.routes["/tokenize"] = tokenize
    server.routes["/detokenize"] = detokenize
    engine_server(server, "vllm", VLLM_CACHED)
    server.routes["/v1/models"] = json_reply({"object": "list", "data": [{"id": "m", "owned_by": "vllm", "max_model_len": 8192}]})
    return vocab


def test_vllm_counts_come_from_its_tokenize_with_messages(server):
    vocab = vllm_server(server)
    chat = wrap_url(server.base_url, model="m", profile=make_profile(), summarizer=None)
    messages = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Nice to meet you!"},
                {"role": "user", "content": "Can I ask a question?"}]
    chat.chat.completions.create(messages=messages, max_tokens=4)
    assert chat.backend.server_info().engine == "vllm" and chat.backend.prompt_count_exact
    assert chat.backend.n_ctx == 8192
    asked = [b for b in vocab.bodies if "messages" in b]
    assert asked and asked[-1]["add_generation_prompt"] is True and asked[-1]["model"] == "m"
    expected = len(vocab.encode(vocab.render(messages)))  # vLLM's chat path adds no special tokens
    assert chat.last_report.prompt_tokens == expected


# -- llama-server's /props: a sleeping server ---------------------------------------------------------
# /props as llama-server builds it (ggml-org/llama.cpp tools/server/server-context.cpp,
# get_res_props: default_generation_settings.n_ctx, total_slots, build_info, is_sleeping, …);
# the real server is run in tests/test_llama_cpp_server.py, but sleeping takes --sleep-idle-seconds
# and an idle wait, so the reply is replayed here.
@pytest.mark.parametrize("sleeping", [True, False])
def test_a_sleeping_llama_server_is_warned_of_once(server, caplog, sleeping):
    from trimkit.backends.http import OpenAIHTTPBackend

    server.routes["/props"] = json_reply({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1, "build_info": "b8000-abc",
                                          "endpoint_slots": True, "endpoint_metrics": False, "is_sleeping": sleeping})
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        backend = OpenAIHTTPBackend(server.base_url, model="m")
        assert backend.n_ctx == 4096
        backend.server_info()
    warned = [r for r in caplog.records if "is sleeping" in r.getMessage()]
    assert len(warned) == (1 if sleeping else 0)
