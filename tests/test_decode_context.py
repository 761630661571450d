"""Decode speed vs context: what the profile predicts, and what the real model's requests measure.

Each generated token reads the KV cache of every token before it, so on a small model decode
slows as the prompt grows (docs/design.md §2); the profile predicts tokens/s at any context from
its decode points. Nothing here compares a measured speed with a predicted one: a busy host
changes speed by more than any band a test could hold (the suite must pass with other programs
on every core), so how close the prediction comes is measured by ``benchmarks/phases_decode.py``,
a benchmark. What is asserted does not depend on the host's speed:

- from known decode points, the predicted slowdown of a long prompt is the line through them
  (the measured shape of the embedded Gemma: about 0.8 of the short prompt's speed at 2,000
  tokens), averaged over the answer as a measured stream is;
- on the real model, a request at a short and one at a long prompt report exactly what was asked
  (prompt and output token counts, the engine's own decode timing), and the calibrated profile
  never predicts a longer context to decode faster.
"""

from __future__ import annotations

import attrs
import pytest

from tests._core_helpers import make_profile
from trimkit.backends.base import probe_text
from trimkit.backends.llama import LlamaBackend
from trimkit.planning.profile import DecodePoint

OUTPUT_TOKENS = 24


def _profile_with(points) -> object:
    return attrs.evolve(make_profile(), decode_points=tuple(points))


def test_the_predicted_slowdown_is_the_line_through_the_decode_points():
    # 100 tokens/s at an empty context, 80 at 2,000 tokens: 10 ms + 1.25 µs per token of context per step
    profile = _profile_with([DecodePoint(0, 100.0, steps=16), DecodePoint(2000, 80.0, steps=16)])
    short, long_ = profile.decode_tokens_per_s_at(16), profile.decode_tokens_per_s_at(2000)
    assert long_ / short == pytest.approx((0.01 + 16 * 1.25e-6) / (0.01 + 2000 * 1.25e-6), rel=1e-3)
    assert long_ == pytest.approx(80.0, rel=1e-3)
    # averaged over the answer: each token decodes at the context before it
    averaged = profile.decode_tokens_per_s_at(2000, output_tokens=OUTPUT_TOKENS)
    assert averaged < long_ and averaged == pytest.approx(1 / (0.01 + (2000 + (OUTPUT_TOKENS - 1) / 2) * 1.25e-6), rel=1e-3)


def test_a_profile_of_one_context_predicts_the_same_speed_everywhere():
    profile = _profile_with([DecodePoint(0, 90.0, steps=16)])
    assert profile.decode_tokens_per_s_at(16) == pytest.approx(profile.decode_tokens_per_s_at(4000))


def _request(backend: LlamaBackend, llm, content_tokens: int):
    corpus = llm.tokenize(probe_text().encode("utf-8"), add_bos=False, special=False)
    content = llm.detokenize((corpus * (content_tokens // len(corpus) + 1))[:content_tokens]).decode("utf-8", errors="ignore")
    params = {"max_tokens": OUTPUT_TOKENS, "temperature": 0.0, "logit_bias": {str(llm.token_eos()): -100.0}}
    return backend.send([{"role": "user", "content": content}], params).drain()


def test_real_requests_report_their_counts_and_the_profile_never_speeds_up_with_context(llm, quick_profile):
    backend = LlamaBackend(llm)
    long_, short = _request(backend, llm, 2000), _request(backend, llm, 16)
    assert long_.prompt_tokens > 1900 and short.prompt_tokens < 64
    for m in (long_, short):
        assert m.completion_tokens == OUTPUT_TOKENS and m.timing_source == "llama_perf"
        assert m.engine_decode_s is not None and m.engine_decode_s > 0 and m.decode_tokens_per_s > 0
    at = [quick_profile.decode_tokens_per_s_at(n, output_tokens=OUTPUT_TOKENS) for n in (short.prompt_tokens, long_.prompt_tokens)]
    if at[0] is not None:  # a quick calibration that found time for its decode steps
        assert 0 < at[1] <= at[0]
