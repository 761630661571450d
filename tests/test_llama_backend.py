"""The llama.cpp backend on the real embedded model."""

from __future__ import annotations

import copy
import os

import pytest

from trimkit.backends.llama import LlamaBackend
from trimkit.backends.replies import chunk_content
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
    assert backend.cache_state().cached(tokens) == predicted  # the same count, as data a plan reads
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
    assert backend.cache_state().cached(q_tokens) == cached  # the snapshot counts in the data a plan reads
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
    assert key.model.startswith(os.path.basename(llm.model_path))


def test_chunk_content_skips_bare_role_delta():
    assert chunk_content({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}) is None
    assert chunk_content({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}) == "Hi"
    assert chunk_content({"choices": [{"delta": {}, "finish_reason": "stop"}]}) == ""


# -- a context llama.cpp rounds up (n_ctx not a multiple of 256) --------------------------------

SENTENCE = "The ferry to the island leaves the quay at nine and returns before dusk."


@pytest.fixture(scope="module")
def llm_300(model_path):
    import trimkit

    llm = trimkit.default_llama("gemma", model_path=model_path, n_ctx=300)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def llm_1000(model_path):
    import trimkit

    llm = trimkit.default_llama("gemma", model_path=model_path, n_ctx=1000)
    yield llm
    llm.close()


def user_prompt(backend, low, high):
    """A one-message prompt whose exact token count lies in [low, high]."""
    words = SENTENCE.split()
    lo, hi = 1, 4 * high
    while lo <= hi:
        mid = (lo + hi) // 2
        messages = [{"role": "user", "content": " ".join(words[i % len(words)] for i in range(mid))}]
        n = len(backend.tokenizer.prompt_tokens(messages))
        if low <= n <= high:
            return messages, n
        lo, hi = (mid + 1, hi) if n < low else (lo, mid - 1)
    raise AssertionError(f"no prompt of {low}..{high} tokens")


def test_n_ctx_is_what_the_llama_can_hold_not_what_llama_cpp_rounded_to(llm_300, llm_1000):
    for llm, asked in ((llm_300, 300), (llm_1000, 1000)):
        assert llm.n_ctx() > asked  # llama.cpp rounded the context up ...
        backend = LlamaBackend(llm)
        assert backend.n_ctx == asked  # ... but the Llama records only `asked` tokens
        assert backend.profile_key().n_ctx == asked


def test_a_rounded_context_calibrates_and_serves(llm_300, isolated_cache):
    import trimkit

    profile = trimkit.calibrate(llm_300, mode="quick")
    assert profile.key.n_ctx == 300
    assert max(s.new_tokens + s.cached_tokens for s in profile.samples) <= 300
    chat = trimkit.wrap(llm_300, profile=profile, summarizer=None)
    out = chat.create_chat_completion(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert chat.last_report.measurement.ttft_s is not None


def test_a_prompt_over_the_effective_window_is_a_clear_error(llm_1000, quick_profile):
    import trimkit

    backend = LlamaBackend(llm_1000)
    messages, n = user_prompt(backend, 1001, 1020)  # fits llama.cpp's 1024, not the Llama's 1000
    chat = trimkit.wrap(llm_1000, profile=quick_profile, summarizer=None)
    with pytest.raises(ContextTooSmallError, match="1000"):
        chat.create_chat_completion(messages=messages, max_tokens=4)
    with pytest.raises(ContextTooSmallError, match=rf"{n} tokens.*n_ctx=1000.*1024"):
        backend.send(messages, {"max_tokens": 4})
    assert not backend.engine.busy  # nothing was taken
    # and the engine still works
    m = backend.send([{"role": "user", "content": "Name a colour."}], {"max_tokens": 2}).drain()
    assert m.ttft_s is not None


def test_a_budget_trims_the_prompt_into_the_effective_window(llm_1000, quick_profile):
    import trimkit
    from trimkit.messages import coerce_chunks

    chat = trimkit.wrap(llm_1000, profile=quick_profile, summarizer=None)
    question = [{"role": "user", "content": "When does the ferry leave?"}]
    words = SENTENCE.split()
    base = [f"Note {i}: " + " ".join([SENTENCE] * 8) for i in range(6)]
    for k in range(1, 400):  # untrimmed: inside llama.cpp's 1024 less max_tokens, over the Llama's 1000
        chunks = [*base, "Last note: " + " ".join(words[i % len(words)] for i in range(k))]
        untrimmed = len(chat.backend.tokenizer.prompt_tokens(trimkit.pipeline.place_chunks(question, coerce_chunks(chunks))))
        if untrimmed > 1001:
            break
    assert 1001 < untrimmed <= 1016, untrimmed
    out = chat.create_chat_completion(messages=question, rag_chunks=chunks, ttft_budget_s=600.0, max_tokens=8)
    report = chat.last_report
    assert report.prompt_tokens_before == untrimmed
    assert report.prompt_tokens <= 1000 - 8
    assert out["choices"][0]["message"]["content"] is not None


def test_generation_stops_at_the_effective_window(llm_1000):
    if os.environ.get("TRIMKIT_TEST_MODEL"):
        pytest.skip("biases the embedded model's end-of-turn token (EOS) away; another model stops on its own token")
    backend = LlamaBackend(llm_1000)
    messages, n = user_prompt(backend, 980, 990)
    eos = llm_1000.token_eos()
    ts = backend.send(messages, {"temperature": 0.0, "logit_bias": {str(eos): -100.0}})  # no max_tokens: "as long as fits"
    m = ts.drain()
    assert m.finish_reason == "length"
    assert m.prompt_tokens == n and n + m.completion_tokens <= 1000
    # the Llama's record of its context stays whole (llama-cpp-python drops tokens past it silently)
    assert llm_1000.n_tokens <= len(llm_1000.input_ids)


def test_cli_with_a_context_too_small_exits_with_one_line(isolated_cache, capsys):
    from trimkit.cli import main

    rc = main(["calibrate", "--quick", "--n-ctx", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("trimkit: error:") and "n_ctx=64" in err[0], err
