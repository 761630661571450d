"""Decode speed vs context on the real model: calibration's prediction against measured requests.

Each generated token reads the KV cache of every token before it, so on a small model decode
slows as the prompt grows (docs/design.md §2). The session's quick calibration measures decode
steps at an empty context and at the deepest one it holds; the profile predicts tokens/s at any
context. Here real chat requests at a short (~32-token) and a long (~2,000-token) prompt, 24
output tokens each (end-of-sequence banned), are measured with the engine's own timings — the
median of 3 — and the prediction must be within 20 % at both: a profile that took decode as
independent of the prompt misses the long one by more on the embedded model. (The sweep over
0–6k tokens, with its tighter target, is benchmarks/phases_decode.py.)
"""

from __future__ import annotations

import statistics

import pytest

from trimkit.backends.base import probe_text
from trimkit.backends.llama import LlamaBackend

OUTPUT_TOKENS = 24
REPEATS = 3
#: within 20 %: the bound of issue 12 (a shared 2-core host is noisy; the benchmark holds 10 %)
BOUND = 0.20


def _measured(backend: LlamaBackend, llm, content_tokens: int) -> tuple[int, int, float]:
    """(prompt tokens, output tokens, median decode tokens/s) of ``REPEATS`` chat requests whose
    message is ``content_tokens`` tokens of the probe corpus (the repeats hit the cache: only
    their decode costs)."""
    corpus = llm.tokenize(probe_text().encode("utf-8"), add_bos=False, special=False)
    content = llm.detokenize((corpus * (content_tokens // len(corpus) + 1))[:content_tokens]).decode("utf-8", errors="ignore")
    params = {"max_tokens": OUTPUT_TOKENS, "temperature": 0.0, "logit_bias": {str(llm.token_eos()): -100.0}}
    runs = [backend.send([{"role": "user", "content": content}], params).drain() for _ in range(REPEATS)]
    speeds = [m.decode_tokens_per_s for m in runs]
    assert all(s and s > 0 for s in speeds), speeds
    return runs[-1].prompt_tokens, runs[-1].completion_tokens, statistics.median(speeds)


def test_decode_prediction_follows_the_context(llm, quick_profile):
    model = quick_profile.decode_model()
    assert model is not None and len(quick_profile.decode_points) >= 2, quick_profile.decode_points
    assert {p.context_tokens for p in quick_profile.decode_points} >= {0.0}
    assert max(p.context_tokens for p in quick_profile.decode_points) >= 64  # the deep point: after the depth probes
    backend = LlamaBackend(llm)
    rows = []
    for content in (2000, 16):  # the long prompt's prefill first, then both decodes within seconds: the same host
        prompt, output, measured = _measured(backend, llm, content)
        assert output == OUTPUT_TOKENS
        predicted = quick_profile.decode_tokens_per_s_at(prompt, output_tokens=output)
        rows.append((prompt, measured, predicted))
    for _prompt, measured, predicted in rows:
        assert predicted == pytest.approx(measured, rel=BOUND), (rows, quick_profile.decode_points)
    assert rows[0][0] > 1900 and rows[1][0] < 64
