"""Decode speed vs context on the real model: calibration's prediction against measured requests.

Each generated token reads the KV cache of every token before it, so on a small model decode
slows as the prompt grows (docs/design.md §2). A quick calibration measures decode steps at an
empty context and at the deepest one it holds; the profile predicts tokens/s at any context.
Here real chat requests at a short (~32-token) and a long (~2,000-token) prompt, 24 output
tokens each (end-of-sequence banned), are measured with the engine's own timings — the median
of 3 — within seconds of each other. What is asserted is what the prediction is for, compared as
a ratio measured in the same run: how much slower the long prompt decodes than the short one,
predicted against measured, within 20 %. A profile that took decode as independent of the
prompt predicts a ratio of 1 and misses it (measured about 0.8 on the embedded Gemma, about
0.6 on SmolLM2). Each
prediction must also be within a factor of 2 of its measurement, which catches wrong units or a
mis-timed step but not the host's own drift.

A shared host changes speed by 20–30 % over minutes (docs/design.md §2) — more than 20 %, which
is why the level is not held to it here (the tighter level targets are benchmarks/phases_decode.py's,
a benchmark). The first attempt uses the session's quick profile (measured earlier in the run);
when it misses, the test calibrates afresh and measures at once, up to twice more (a fresh
calibration that a contended moment left without time for its decode steps is not compared). A
prediction that is biased misses on every attempt and fails.
"""

from __future__ import annotations

import statistics

import pytest

import trimkit
from trimkit.backends.base import probe_text
from trimkit.backends.llama import LlamaBackend

OUTPUT_TOKENS = 24
REPEATS = 3
#: the long prompt's decode slowdown, predicted against measured, within 20 %: the bound of issue 12
#: (a shared 2-core host is noisy; the benchmark holds 10 %)
BOUND = 0.20
#: fresh calibrations tried after the session profile's attempt
FRESH_ATTEMPTS = 2


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


def _has_decode_line(profile) -> bool:
    """The profile measured decode at an empty context and at a deep one (after the depth probes)."""
    contexts = {p.context_tokens for p in profile.decode_points}
    return profile.decode_model() is not None and len(profile.decode_points) >= 2 and 0.0 in contexts and max(contexts) >= 64


def _attempt(llm, profile) -> list[tuple[int, float, float]]:
    """(prompt tokens, measured, predicted) at the long then the short prompt: the long prompt's
    prefill first, then both decodes within seconds of each other."""
    backend = LlamaBackend(llm)
    rows = []
    for content in (2000, 16):
        prompt, output, measured = _measured(backend, llm, content)
        assert output == OUTPUT_TOKENS
        rows.append((prompt, measured, profile.decode_tokens_per_s_at(prompt, output_tokens=output)))
    assert rows[0][0] > 1900 and rows[1][0] < 64
    return rows


#: each prediction within this factor of its measurement (units, a mis-timed step; not drift)
LEVEL_FACTOR = 2.0


def _within(rows) -> bool:
    (_, long_measured, long_predicted), (_, short_measured, short_predicted) = rows
    level = all(1 / LEVEL_FACTOR <= predicted / measured <= LEVEL_FACTOR for _prompt, measured, predicted in rows)
    slowdown = (long_predicted / short_predicted) == pytest.approx(long_measured / short_measured, rel=BOUND)
    return level and slowdown


def test_decode_prediction_follows_the_context(llm, quick_profile):
    assert _has_decode_line(quick_profile), quick_profile.decode_points
    attempts = [(_attempt(llm, quick_profile), quick_profile.decode_points)]
    for _ in range(FRESH_ATTEMPTS):
        if _within(attempts[-1][0]):
            break
        fresh = trimkit.calibrate(llm, mode="quick", time_budget_s=2 * trimkit.calibration.QUICK_BUDGET_S, recalibrate=True, store=False)
        if not _has_decode_line(fresh):
            # a contended moment left its budget no time for the decode steps (a calibration
            # drops what does not fit): nothing to compare; the next attempt calibrates again
            continue
        attempts.append((_attempt(llm, fresh), fresh.decode_points))
    assert _within(attempts[-1][0]), attempts
