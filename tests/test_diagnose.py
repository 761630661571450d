"""trimkit.diagnose (in trimkit.report): the verdict for measured numbers, its cures, its text and JSON, bad input.

The judging itself, at every boundary, is tests/test_verdict.py; here, what diagnose adds."""

from __future__ import annotations

import json
import math

import pytest

from trimkit.errors import InvalidBudgetError, InvalidNumberError
from trimkit.report import DEFAULT_WAIT_THRESHOLD_S, NOT_THE_STREAM_CURE, READING_SPEED_TOKENS_PER_S, STREAM_CURES, WAIT_CURES, diagnose


def test_the_documented_defaults():
    assert DEFAULT_WAIT_THRESHOLD_S == 1.0
    assert READING_SPEED_TOKENS_PER_S == 7.0


def test_a_long_wait_with_a_fast_stream_is_the_wait_with_wait_cures():
    d = diagnose(ttft_s=6.0, decode_tokens_per_s=50.0, prompt_tokens=3000, output_tokens=256)
    assert d.verdict == "wait"
    assert d.cures == WAIT_CURES
    assert d.wait_slow and not d.stream_slow


def test_a_slow_stream_after_a_short_wait_is_the_stream_with_stream_cures():
    d = diagnose(ttft_s=0.3, decode_tokens_per_s=4.0, output_tokens=64)
    assert d.verdict == "stream"
    assert d.cures == STREAM_CURES
    assert NOT_THE_STREAM_CURE in str(d)


def test_both_slow_gives_both_lists_of_cures():
    d = diagnose(ttft_s=3.0, decode_tokens_per_s=3.0)
    assert d.verdict == "both"
    assert d.cures == WAIT_CURES + STREAM_CURES


def test_nothing_slow_says_so_and_prescribes_nothing():
    d = diagnose(ttft_s=0.44, decode_tokens_per_s=11.0, output_tokens=32, ttft_budget_s=1.0)
    assert d.verdict == "none"
    assert d.cures == ()
    text = str(d)
    assert "nothing is slow" in text and "nothing needs curing" in text
    assert "what helps" not in text


def test_the_issue_case_a_long_answer_streamed_faster_than_reading_is_not_slow():
    """Issue 12: 0.44 s wait within a 1 s budget, 32 tokens at 11 tokens/s was named 'the stream'."""
    d = diagnose(0.44, 11.0, output_tokens=32, ttft_budget_s=1.0)
    assert d.verdict == "none"
    assert d.dominant_phase == "decode"  # the old comparison, kept as information only
    long_answer = diagnose(0.2, 20.0, output_tokens=5000)
    assert long_answer.verdict == "none" and long_answer.dominant_phase == "decode"


def test_the_budget_replaces_the_default_threshold():
    assert diagnose(1.5, 50.0).verdict == "wait"  # over 1 s, no budget
    assert diagnose(1.5, 50.0, ttft_budget_s=2.0).verdict == "none"
    assert diagnose(0.5, 50.0, ttft_budget_s=0.4).verdict == "wait"
    assert diagnose(1.5, 50.0, wait_threshold_s=2.0).verdict == "none"


def test_the_target_and_the_reading_speed_are_the_streams_standard():
    assert diagnose(0.1, 10.0, tokens_per_s_target=20.0).verdict == "stream"
    assert diagnose(0.1, 6.0, tokens_per_s_target=5.0).verdict == "none"  # the user's target rules
    assert "below reading speed" in str(diagnose(0.1, 6.0, tokens_per_s_target=5.0))
    assert diagnose(0.1, 6.0).verdict == "stream"
    assert diagnose(0.1, 6.0, reading_speed_tokens_per_s=5.0).verdict == "none"


def test_stream_cures_never_offer_trimming_and_the_note_says_it_will_not_fix_it():
    assert not set(STREAM_CURES) & set(WAIT_CURES)
    for cure in STREAM_CURES:
        assert not any(word in cure.lower() for word in ("trim", "cache", "summar", "rag", "prewarm")), cure
    assert "will not fix" in NOT_THE_STREAM_CURE and "side effect" in NOT_THE_STREAM_CURE


def test_stream_cures_name_the_decode_levers():
    text = " ".join(STREAM_CURES).lower()
    assert "smaller" in text and "quantization" in text and "bandwidth" in text and "gpu" in text


def test_wait_cures_offer_trimming_and_cache_reuse():
    text = " ".join(WAIT_CURES).lower()
    assert "trim" in text and "cache" in text


def test_prefill_cost_per_prompt_token():
    assert diagnose(2.0, 50.0, prompt_tokens=1000).prefill_ms_per_token == pytest.approx(2.0)
    assert diagnose(2.0, 50.0).prefill_ms_per_token is None


def test_stream_time_and_dominant_phase_are_informational():
    d = diagnose(ttft_s=6.0, decode_tokens_per_s=50.0, output_tokens=256)
    assert d.stream_s == pytest.approx(5.12)
    assert d.dominant_phase == "prefill" and d.dominant_label == "the wait (prefill)"
    assert diagnose(2.0, 50.0, output_tokens=100).dominant_phase == "prefill"  # a tie goes to prefill


def test_text_prints_the_verdict_the_numbers_and_the_cures():
    d = diagnose(3.0, 20.0, prompt_tokens=300, ttft_budget_s=2.0)
    text = str(d)
    assert "verdict: the wait (prefill) is slow" in text
    assert "over its 2.000 s budget" in text
    assert "300 prompt tokens" in text
    for cure in WAIT_CURES:
        assert cure in text
    assert "dominant" not in text


def test_to_dict_is_json_with_the_verdict_and_the_standards():
    d = json.loads(json.dumps(diagnose(6.0, 50.0, prompt_tokens=3000, tokens_per_s_target=60.0).to_dict(), allow_nan=False))
    assert d["verdict"] == "both"
    assert d["cures"] == list(WAIT_CURES + STREAM_CURES)
    assert d["wait_limit_s"] == 1.0 and d["wait_limit_source"] == "default"
    assert d["stream_floor_tokens_per_s"] == 60.0 and d["stream_floor_source"] == "target"
    assert d["dominant_phase"] == "prefill"


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan, math.inf, -math.inf, True, "1.0", None])
def test_bad_ttft_is_refused(bad):
    with pytest.raises(InvalidNumberError, match="ttft_s"):
        diagnose(bad, 50.0)


@pytest.mark.parametrize("bad", [0, -5.0, math.nan, math.inf, False, "50"])
def test_bad_decode_speed_is_refused(bad):
    with pytest.raises(InvalidNumberError, match="decode_tokens_per_s"):
        diagnose(1.0, bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_prompt_tokens_are_refused(bad):
    with pytest.raises(InvalidNumberError, match="prompt_tokens"):
        diagnose(1.0, 50.0, prompt_tokens=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_bad_output_tokens_are_refused(bad):
    with pytest.raises(InvalidNumberError, match="output_tokens"):
        diagnose(1.0, 50.0, output_tokens=bad)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"ttft_budget_s": 0}, InvalidBudgetError, "ttft_budget_s"),
        ({"ttft_budget_s": math.nan}, InvalidBudgetError, "ttft_budget_s"),
        ({"tokens_per_s_target": -1.0}, InvalidNumberError, "tokens_per_s_target"),
        ({"tokens_per_s_target": "fast"}, InvalidNumberError, "tokens_per_s_target"),
        ({"reading_speed_tokens_per_s": 0}, InvalidNumberError, "reading_speed_tokens_per_s"),
        ({"wait_threshold_s": math.inf}, InvalidNumberError, "wait_threshold_s"),
    ],
)
def test_bad_standards_are_refused(kwargs, error, name):
    with pytest.raises(error, match=name):
        diagnose(1.0, 50.0, **kwargs)
