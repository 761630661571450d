"""trimkit.report (the verdict): each phase judged against its own standard, at its boundaries, and the
truthful statement of what a shorter context did to decode."""

from __future__ import annotations

import math

import pytest

from trimkit.errors import InvalidBudgetError, InvalidNumberError
from trimkit.report import (
    DEFAULT_WAIT_THRESHOLD_S,
    MIN_STATED_DECODE_CHANGE_PCT,
    READING_SPEED_TOKENS_PER_S,
    STREAM_CURES,
    VERDICTS,
    WAIT_CURES,
    DecodeContext,
    judge,
    valid_tokens_per_s_target,
)

FAST = 50.0  # a stream well above every standard used here
SHORT = 0.1  # a wait well inside every standard used here
EPS = 1e-9


# -- the wait: against the budget, else the default threshold ---------------------------------------


@pytest.mark.parametrize(
    "ttft, budget, slow",
    [
        (1.0, 1.0, False),  # exactly at the budget: met, not slow
        (1.0 + EPS, 1.0, True),
        (1.0 - EPS, 1.0, False),
        (0.25, 0.25, False),
        (0.2501, 0.25, True),
    ],
)
def test_the_wait_at_its_budget(ttft, budget, slow):
    v = judge(ttft, FAST, ttft_budget_s=budget)
    assert v.wait_slow is slow
    assert v.verdict == ("wait" if slow else "none")
    assert (v.wait_limit_s, v.wait_limit_source) == (budget, "budget")


@pytest.mark.parametrize("ttft, slow", [(DEFAULT_WAIT_THRESHOLD_S, False), (DEFAULT_WAIT_THRESHOLD_S + EPS, True),
                                        (DEFAULT_WAIT_THRESHOLD_S - EPS, False)])
def test_the_wait_without_a_budget_is_judged_against_the_default(ttft, slow):
    v = judge(ttft, FAST)
    assert v.wait_slow is slow
    assert (v.wait_limit_s, v.wait_limit_source) == (1.0, "default")


def test_the_default_threshold_is_configurable_and_a_budget_overrides_it():
    assert judge(1.5, FAST, wait_threshold_s=2.0).verdict == "none"
    assert judge(1.5, FAST, wait_threshold_s=1.4).verdict == "wait"
    assert judge(1.5, FAST, ttft_budget_s=2.0, wait_threshold_s=0.1).verdict == "none"  # the budget is the standard
    assert judge(0.5, FAST, ttft_budget_s=0.4, wait_threshold_s=10.0).verdict == "wait"


# -- the stream: against the target, else reading speed -----------------------------------------------


@pytest.mark.parametrize("tps, slow", [(READING_SPEED_TOKENS_PER_S, False), (READING_SPEED_TOKENS_PER_S - EPS, True),
                                       (READING_SPEED_TOKENS_PER_S + EPS, False), (6.99, True), (7.01, False)])
def test_the_stream_at_reading_speed(tps, slow):
    v = judge(SHORT, tps)
    assert v.stream_slow is slow
    assert v.verdict == ("stream" if slow else "none")
    assert (v.stream_floor_tokens_per_s, v.stream_floor_source) == (7.0, "reading speed")


@pytest.mark.parametrize("tps, target, slow", [(20.0, 20.0, False), (20.0 - EPS, 20.0, True), (20.0 + EPS, 20.0, False),
                                               (6.0, 5.0, False), (4.9, 5.0, True)])
def test_the_stream_at_the_callers_target(tps, target, slow):
    v = judge(SHORT, tps, tokens_per_s_target=target)
    assert v.stream_slow is slow
    assert (v.stream_floor_tokens_per_s, v.stream_floor_source) == (target, "target")


def test_a_target_above_reading_speed_makes_a_readable_stream_slow():
    assert judge(SHORT, 10.0).verdict == "none"
    assert judge(SHORT, 10.0, tokens_per_s_target=12.0).verdict == "stream"


def test_a_target_below_reading_speed_is_the_callers_standard_and_the_text_says_so():
    v = judge(SHORT, 6.0, tokens_per_s_target=5.0)
    assert v.verdict == "none"
    assert "keeps up with your target of 5.0 tokens/s" in v.summary()
    assert "below reading speed" in v.summary()


def test_reading_speed_is_configurable():
    assert judge(SHORT, 6.0, reading_speed_tokens_per_s=5.0).verdict == "none"
    assert judge(SHORT, 6.0, reading_speed_tokens_per_s=6.5).verdict == "stream"


def test_the_answer_length_never_enters():
    """A long answer streamed faster than anyone reads is not slow (issue 12)."""
    v = judge(0.44, 11.0, ttft_budget_s=1.0)
    assert v.verdict == "none"


# -- the four verdicts and their cures -----------------------------------------------------------------


@pytest.mark.parametrize(
    "ttft, tps, verdict, cures",
    [
        (0.5, 10.0, "none", ()),
        (1.5, 10.0, "wait", WAIT_CURES),
        (0.5, 5.0, "stream", STREAM_CURES),
        (1.5, 5.0, "both", WAIT_CURES + STREAM_CURES),
    ],
)
def test_each_verdict_carries_the_cures_that_fit_it(ttft, tps, verdict, cures):
    v = judge(ttft, tps)
    assert v.verdict == verdict and v.verdict in VERDICTS
    assert v.cures == cures


def test_the_notes_say_nothing_needs_curing_or_that_trimming_is_not_the_streams_cure():
    assert judge(0.5, 10.0).notes == ("nothing needs curing",)
    assert judge(1.5, 10.0).notes == ()
    (stream_note,) = judge(0.5, 5.0).notes
    assert "trimming will not fix the stream" in stream_note
    (both_note,) = judge(1.5, 5.0).notes
    assert "wait" in both_note and "stream" in both_note


def test_summary_names_the_verdict_and_both_judgements():
    s = judge(2.5, 4.0, ttft_budget_s=2.0, tokens_per_s_target=8.0).summary()
    assert s.startswith("both the wait and the stream are slow")
    assert "2.500 s is over its 2.000 s budget" in s
    assert "4.0 tokens/s is below your target of 8.0 tokens/s" in s
    assert judge(0.3, 9.0).summary().startswith("nothing is slow")
    assert "1 s (no budget: the default)" in judge(0.3, 9.0).summary()


def test_an_unmeasured_phase_is_never_called_slow():
    v = judge(2.0, None)
    assert v.verdict == "wait" and v.stream_slow is None
    assert "too short to time" in v.summary()
    v = judge(None, 3.0)
    assert v.verdict == "stream" and v.wait_slow is None


def test_to_dict_carries_the_verdict_its_standards_and_cures():
    d = judge(1.5, 5.0).to_dict()
    assert d["verdict"] == "both" and d["label"].startswith("both")
    assert d["cures"] == list(WAIT_CURES + STREAM_CURES)
    assert d["wait_limit_s"] == 1.0 and d["stream_floor_tokens_per_s"] == 7.0


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"ttft_budget_s": 0.0}, InvalidBudgetError),
        ({"ttft_budget_s": -1.0}, InvalidBudgetError),
        ({"tokens_per_s_target": 0.0}, InvalidNumberError),
        ({"tokens_per_s_target": math.nan}, InvalidNumberError),
        ({"tokens_per_s_target": True}, InvalidNumberError),
        ({"reading_speed_tokens_per_s": -7.0}, InvalidNumberError),
        ({"wait_threshold_s": 0}, InvalidNumberError),
    ],
)
def test_bad_standards_raise_typed_errors(kwargs, error):
    with pytest.raises(error):
        judge(1.0, 10.0, **kwargs)


@pytest.mark.parametrize("ttft, tps", [(-1.0, 10.0), (math.nan, 10.0), (1.0, -2.0), (1.0, math.inf), ("1", 10.0)])
def test_bad_measurements_raise_typed_errors(ttft, tps):
    with pytest.raises(InvalidNumberError):
        judge(ttft, tps)


def test_valid_tokens_per_s_target():
    assert valid_tokens_per_s_target(None) is None
    assert valid_tokens_per_s_target(12) == 12.0
    with pytest.raises(InvalidNumberError, match="tokens_per_s_target"):
        valid_tokens_per_s_target(-3)


# -- decode: parameters untouched; a shorter context's side effect stated only when it shows ---------------


def test_no_trimming_states_no_difference():
    d = DecodeContext(measured_tokens_per_s=13.0, predicted_tokens_per_s=13.4, predicted_before_tokens_per_s=8.0, trimmed=False)
    assert d.side_effect_pct is None
    assert d.statement() == "decode parameters untouched by trimkit"


def test_a_trimmed_request_states_the_predicted_side_effect():
    d = DecodeContext(measured_tokens_per_s=13.6, predicted_tokens_per_s=13.5, predicted_before_tokens_per_s=9.0, trimmed=True)
    assert d.side_effect_pct == pytest.approx(50.0)
    text = d.statement()
    assert text.startswith("decode parameters untouched by trimkit; the stream was ~50 % faster because the context was shorter")
    assert "(a side effect, not what trimkit aims at: predicted 13.5 tokens/s at the context sent, 9.0 untrimmed; measured 13.6)" in text


@pytest.mark.parametrize("faster_pct, stated", [(MIN_STATED_DECODE_CHANGE_PCT - 0.1, False), (MIN_STATED_DECODE_CHANGE_PCT + 0.1, True), (2.0, False), (11.0, True)])
def test_a_difference_within_the_noise_is_not_stated(faster_pct, stated):
    before = 10.0 / (1 + faster_pct / 100)
    d = DecodeContext(measured_tokens_per_s=10.0, predicted_tokens_per_s=10.0, predicted_before_tokens_per_s=before, trimmed=True)
    assert (d.side_effect_pct is not None) is stated


def test_a_quiet_profile_still_needs_the_floor():
    d = DecodeContext(measured_tokens_per_s=10.3, predicted_tokens_per_s=10.4, predicted_before_tokens_per_s=10.0, trimmed=True, noise_pct=1.0)
    assert d.side_effect_pct is None  # +3 %: beyond a 1 % step noise, within the 5 % floor


def test_the_profiles_own_noise_sets_the_threshold():
    d = DecodeContext(measured_tokens_per_s=10.0, predicted_tokens_per_s=10.0, predicted_before_tokens_per_s=8.0, trimmed=True, noise_pct=30.0)
    assert d.side_effect_pct is None  # 25 % predicted, within a 30 % noise


def test_the_figure_never_exceeds_what_the_measurement_shows():
    d = DecodeContext(measured_tokens_per_s=11.0, predicted_tokens_per_s=15.0, predicted_before_tokens_per_s=10.0, trimmed=True)
    assert d.side_effect_pct == pytest.approx(10.0)  # predicted +50 %, measured +10 % over the untrimmed prediction
    d = DecodeContext(measured_tokens_per_s=20.0, predicted_tokens_per_s=12.0, predicted_before_tokens_per_s=10.0, trimmed=True)
    assert d.side_effect_pct == pytest.approx(20.0)  # a fast measurement does not inflate the predicted +20 %


def test_a_measurement_that_does_not_show_it_states_nothing():
    """Predicted faster, but the stream measured no faster than the untrimmed prediction."""
    d = DecodeContext(measured_tokens_per_s=8.0, predicted_tokens_per_s=12.0, predicted_before_tokens_per_s=8.0, trimmed=True)
    assert d.side_effect_pct is None
    assert DecodeContext(None, 12.0, 8.0, trimmed=True).side_effect_pct is None


def test_a_slower_prediction_or_unknown_predictions_state_nothing():
    assert DecodeContext(10.0, 9.0, 10.0, trimmed=True).side_effect_pct is None
    assert DecodeContext(10.0, None, 8.0, trimmed=True).side_effect_pct is None
    assert DecodeContext(10.0, 12.0, None, trimmed=True).side_effect_pct is None


def test_predictions_text_names_both_contexts_only_when_trimmed():
    d = DecodeContext(13.0, 13.4, 8.1, trimmed=True)
    assert d.predictions_text(1894, 4944) == "predicted 13.4 at the 1,894-token context sent, 8.1 at the untrimmed 4,944"
    assert DecodeContext(13.0, 13.4, 8.1).predictions_text(1894, 1894) == "predicted 13.4 at the 1,894-token context sent"
    assert DecodeContext(13.0).predictions_text(10, None) == ""
