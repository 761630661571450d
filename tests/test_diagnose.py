"""Which phase makes a request slow, and which cures fit it."""

from __future__ import annotations

import json
import math

import pytest

from trimkit.diagnose import READING_SPEED_TOKENS_PER_S, STREAM_CURES, WAIT_CURES, diagnose
from trimkit.errors import InvalidNumberError


def test_a_long_wait_is_diagnosed_as_prefill_with_wait_cures():
    d = diagnose(ttft_s=6.0, decode_tokens_per_s=50.0, prompt_tokens=3000, output_tokens=256)
    assert d.stream_s == pytest.approx(5.12)
    assert d.dominant_phase == "prefill"
    assert d.cures == WAIT_CURES
    assert d.dominant_label == "the wait (prefill)"


def test_a_long_stream_is_diagnosed_as_decode_with_stream_cures():
    d = diagnose(ttft_s=0.4, decode_tokens_per_s=20.0, output_tokens=256)
    assert d.stream_s == pytest.approx(12.8)
    assert d.dominant_phase == "decode"
    assert d.cures == STREAM_CURES
    assert d.dominant_label == "the stream (decode)"


def test_a_tie_goes_to_prefill():
    assert diagnose(ttft_s=2.0, decode_tokens_per_s=50.0, output_tokens=100).dominant_phase == "prefill"


def test_output_length_decides_the_phase():
    assert diagnose(1.0, 50.0, output_tokens=10).dominant_phase == "prefill"
    assert diagnose(1.0, 50.0, output_tokens=1000).dominant_phase == "decode"


def test_stream_cures_never_offer_trimming_as_a_fix():
    assert not set(STREAM_CURES) & set(WAIT_CURES)
    for cure in STREAM_CURES:
        text = cure.lower()
        if any(word in text for word in ("trim", "cache", "summar", "rag", "prewarm")):
            assert "not" in text, cure  # only ever to say it will not help


def test_stream_cures_name_the_decode_levers():
    text = " ".join(STREAM_CURES).lower()
    assert "smaller" in text and "quantization" in text and "bandwidth" in text and "gpu" in text


def test_wait_cures_offer_trimming_and_cache_reuse():
    text = " ".join(WAIT_CURES).lower()
    assert "trim" in text and "cache" in text


def test_prefill_cost_per_prompt_token():
    assert diagnose(2.0, 50.0, prompt_tokens=1000).prefill_ms_per_token == pytest.approx(2.0)
    assert diagnose(2.0, 50.0).prefill_ms_per_token is None


def test_a_stream_slower_than_reading_is_flagged():
    assert diagnose(1.0, READING_SPEED_TOKENS_PER_S - 1).stream_slow is True
    assert diagnose(1.0, READING_SPEED_TOKENS_PER_S).stream_slow is False
    assert "slower than reading speed" in str(diagnose(1.0, 2.0))


def test_text_names_the_phase_and_lists_the_cures():
    d = diagnose(0.4, 20.0, prompt_tokens=300)
    text = str(d)
    assert "dominant phase: the stream (decode)" in text
    assert "300 prompt tokens" in text
    for cure in STREAM_CURES:
        assert cure in text


def test_to_dict_is_json():
    d = json.loads(json.dumps(diagnose(6.0, 50.0, prompt_tokens=3000).to_dict(), allow_nan=False))
    assert d["dominant_phase"] == "prefill"
    assert d["cures"] == list(WAIT_CURES)
    assert d["dominant_label"] == "the wait (prefill)"


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
