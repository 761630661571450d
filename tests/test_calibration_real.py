"""Calibration and prediction on the real embedded model (generous bounds; the benchmark holds the targets)."""

from __future__ import annotations

import json
import logging

import trimkit
import trimkit.cli
from trimkit._calibration import profile_path
from trimkit.backends.llama import LlamaBackend


def test_quick_calibration_measures_a_sensible_profile(quick_profile):
    p = quick_profile
    assert (p.mode != "full")
    # how many probes fit the time budget depends on the host; the minimum schedule is 3
    assert len(p.samples) >= 3
    assert p.mode == "quick" and p.probed_new_tokens >= 32
    assert any(s.cached_tokens > 0 for s in p.samples), "depth probes missing"
    # the probed range is what the samples reached (how far depends on the host's speed now)
    assert p.probed_new_tokens == max(s.new_tokens for s in p.samples)
    assert p.probed_context_tokens == max(s.new_tokens + s.cached_tokens for s in p.samples)
    assert p.model.per_token_s > 0
    assert 0 < p.decode_tokens_per_s < 10_000
    # tokenizing the prompt, measured on llama.cpp's own tokenizer: more than nothing, and far
    # less per token than prefill (the bound is loose for any host)
    assert 0 < p.first_token_per_token_s < p.model.per_token_s
    # prefill grows with the prompt
    assert p.predict_ttft_s(1024) > p.predict_ttft_s(128) > p.predict_ttft_s(16)
    assert p.key.backend == "llama_cpp" and p.key.n_ctx == 4096


def test_prediction_is_close_to_a_measured_request(llm, quick_profile):
    backend = LlamaBackend(llm)
    text = " ".join(d["text"] for d in trimkit.cli.load_corpus()[:4])
    messages = [{"role": "user", "content": "Summarise in one line: " + text}]
    with backend.lock:
        llm.reset()  # cold, so the prediction is for the whole prompt
    tokens = backend.tokenizer.prompt_tokens(messages)
    predicted = quick_profile.predict_ttft_s(len(tokens), 0)
    m = backend.send(messages, {"max_tokens": 2, "logit_bias": {str(llm.token_eos()): -100.0}}, prompt_tokens=tokens).drain()
    assert m.ttft_s is not None and m.ttft_s > 0 and m.prompt_tokens == len(tokens)
    # how close the prediction comes depends on the host's load now: benchmarks/prediction_accuracy.py
    # measures it; what does not depend on it: a longer prompt is predicted to take longer
    assert 0 < quick_profile.predict_ttft_s(len(tokens) // 2, 0) < predicted


def test_stored_profile_is_reused_and_recovered_when_corrupt(llm, quick_profile, caplog):
    key = LlamaBackend(llm).profile_key()
    path = profile_path(key)
    assert path.exists()
    again = trimkit.calibrate(llm, mode="quick")
    assert again == quick_profile  # loaded, not measured: same samples, same timestamps
    path.write_text('{"schema": 1, "key": {')  # corrupt it
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        fresh = trimkit.calibrate(llm, mode="quick")
    assert "is unusable" in caplog.text and "calibrating again" in caplog.text
    assert fresh.created_at > quick_profile.created_at
    assert json.loads(path.read_text())["created_at"] == fresh.created_at


def test_a_probe_stopped_at_the_deadline_gives_none_and_leaves_the_engine_usable(llm):
    """Calibration stops a probe that overruns its deadline (llama.cpp's abort callback): the
    real engine stops within the probe, the call says None, and the engine measures and answers
    normally afterwards."""
    backend = LlamaBackend(llm)
    asked = []

    def deadline_passed() -> bool:
        asked.append(1)
        return len(asked) > 2  # passes while the probe runs

    assert backend.measure_prefill_within(1024, 0, deadline_passed) is None
    assert len(asked) == 3  # llama.cpp asked while it computed, and stopped at the first yes
    assert backend.measure_prefill_within(64, 0, lambda: False) > 0
    assert backend.measure_prefill(32, 64) > 0
    out = llm.create_chat_completion(messages=[{"role": "user", "content": "Say hello."}], max_tokens=2)
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
