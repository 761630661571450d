"""The llama.cpp backend on the real embedded model."""

from __future__ import annotations

import copy

import pytest

from trimkit.backends.llama import LlamaBackend, chunk_content
from trimkit.errors import ContextTooSmallError

HISTORY = [
    {"role": "user", "content": "Tell me about the harbour of Marrowby and its fishing boats."},
    {"role": "assistant", "content": "The harbour is small and sheltered; fishing boats leave at dawn and return by noon."},
]


@pytest.fixture
def backend(llm):
    return LlamaBackend(llm)


def test_prompt_tokens_match_what_llama_cpp_python_evaluates(backend, llm):
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY, {"role": "user", "content": "And the lighthouse?"}]
    ours = backend.tokenizer.prompt_tokens(messages)
    out = llm.create_chat_completion(messages=messages, max_tokens=1)
    assert out["usage"]["prompt_tokens"] == len(ours)


def test_segment_counts_add_up_to_the_exact_prompt(backend):
    messages = [*HISTORY, {"role": "user", "content": "What time do the boats come back?"}]
    seg = backend.tokenizer.segment_counts(messages)
    exact = len(backend.tokenizer.prompt_tokens(messages))
    assert abs(seg.total - exact) <= 2


def test_send_measures_ttft_prefill_and_decode(backend):
    messages = [{"role": "user", "content": "Name three colours of the sea, one per line."}]
    ts = backend.send(messages, {"max_tokens": 8, "temperature": 0.0, "logit_bias": {str(backend.llm.token_eos()): -100.0}})
    chunks = list(ts)
    m = ts.measurement
    assert chunks and m is not None
    assert m.ttft_s is not None and m.ttft_s > 0
    assert m.engine_prefill_s is not None and 0 < m.engine_prefill_s <= m.ttft_s
    assert m.timing_source == "llama_perf"
    assert m.prompt_tokens == len(backend.tokenizer.prompt_tokens(messages))
    assert m.evaluated_tokens + m.cached_tokens == m.prompt_tokens
    assert m.completion_tokens == 8
    assert m.decode_tokens_per_s is not None and m.decode_tokens_per_s > 0


def test_second_turn_reuses_the_cached_prefix_and_prediction_matches(backend):
    first = [*HISTORY[:1]]
    backend.send(first, {"max_tokens": 4}).drain()
    second = [*HISTORY, {"role": "user", "content": "And what about the ferry to the island?"}]
    tokens = backend.tokenizer.prompt_tokens(second)
    predicted = backend.predict_cached_tokens(tokens)
    m = backend.send(second, {"max_tokens": 4}, prompt_tokens=tokens).drain()
    assert predicted > 10
    assert m.cached_tokens == predicted
    assert m.evaluated_tokens == len(tokens) - predicted


def test_backend_never_resets_between_requests(backend, llm, monkeypatch):
    calls = []
    monkeypatch.setattr(llm, "reset", lambda: calls.append("reset"))
    backend.send([{"role": "user", "content": "hello"}], {"max_tokens": 2}).drain()
    backend.send([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "bye"}], {"max_tokens": 2}).drain()
    assert calls == []


def test_messages_and_params_are_not_mutated(backend):
    messages = [*HISTORY, {"role": "user", "content": "Is the harbour busy in winter?"}]
    params = {"max_tokens": 3, "temperature": 0.5, "stop": ["\n\n"]}
    before = (copy.deepcopy(messages), copy.deepcopy(params))
    backend.send(messages, params).drain()
    assert (messages, params) == before


def test_prefix_snapshot_restores_kv_without_prefill(backend):
    doc = {"role": "user", "content": "Reference notes: " + " ".join(["The tram runs along the quay every ten minutes."] * 30)}
    tokens = backend.tokenizer.prompt_tokens([doc])
    snap = backend.save_prefix(tokens[:-1])
    assert 0 < snap.size_bytes < 64 * 1024 * 1024  # KV only — never the 512 MiB logits copy
    assert snap.restore_s > 0
    backend.send([{"role": "user", "content": "something unrelated"}], {"max_tokens": 2}).drain()  # evicts
    question = [{"role": "user", "content": doc["content"] + "\nHow often does the tram run?"}]
    q_tokens = backend.tokenizer.prompt_tokens(question)
    cached, chosen = backend.best_cache(q_tokens)
    assert chosen is snap and cached >= len(tokens) - 8  # up to where the texts diverge
    backend.restore_prefix(chosen)
    m = backend.send(question, {"max_tokens": 2}, prompt_tokens=q_tokens).drain()
    assert m.cached_tokens == cached
    assert m.evaluated_tokens == len(q_tokens) - cached


def test_probe_that_does_not_fit_the_context_is_refused(backend):
    with pytest.raises(ContextTooSmallError):
        backend.measure_prefill(4000, 1000)


def test_profile_key_names_what_changes_timings(backend, llm):
    key = backend.profile_key()
    assert key.n_ctx == 4096 and key.n_batch == llm.n_batch
    assert key.n_threads == llm.context_params.n_threads
    assert "llama-cpp-python" in key.engine_version and key.cpu
    assert key.model.startswith("gemma-3-270m")


def test_chunk_content_skips_bare_role_delta():
    assert chunk_content({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}) is None
    assert chunk_content({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}) == "Hi"
    assert chunk_content({"choices": [{"delta": {}, "finish_reason": "stop"}]}) == ""
