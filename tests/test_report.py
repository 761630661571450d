"""The per-request report: derived figures, the human text, and the JSON form."""

from __future__ import annotations

import json
import math
import types

import attrs
import pytest

import trimkit
from tests._core_helpers import make_measurement
from trimkit.errors import InvalidNumberError
from trimkit.pipeline import Prepared
from trimkit.planning.profile import DecodePoint
from trimkit.report import DECODE_PARAMETERS_UNTOUCHED, NOT_THE_STREAM_CURE, STREAM_CURES, WAIT_CURES, Report
from trimkit.testing import FakeBackend


def make_report(measurement=None, **overrides) -> Report:
    fields = {
        "backend": "fake",
        "measurement": measurement or make_measurement(),
        "prompt_tokens": 700,
        "predicted_ttft_s": 1.1,
        "ttft_budget_s": 1.5,
        "model": "gemma",
    }
    fields.update(overrides)
    return Report(**fields)


@attrs.frozen
class Action:
    strategy: str
    summary: str


# -- derived figures ----------------------------------------------------------------------------


@pytest.mark.parametrize("predicted, expected", [(1.2, 20.0), (0.8, -20.0), (1.0, 0.0)])
def test_ttft_error_is_predicted_minus_measured_over_measured(predicted, expected):
    assert make_report(predicted_ttft_s=predicted).ttft_error_pct == pytest.approx(expected)


def test_ttft_error_is_none_without_a_prediction_or_a_measurement():
    assert make_report(predicted_ttft_s=None).ttft_error_pct is None
    assert make_report(make_measurement(ttft_s=None, first_output_s=None)).ttft_error_pct is None
    assert make_report(make_measurement(ttft_s=0.0, first_output_s=0.0)).ttft_error_pct is None


def test_measured_ttft_falls_back_to_the_first_output_when_no_content_came():
    r = make_report(make_measurement(ttft_s=None, first_output_s=0.5), predicted_ttft_s=0.6)
    assert r.measured_ttft_s == 0.5
    assert r.ttft_error_pct == pytest.approx(20.0)


@pytest.mark.parametrize("budget, met", [(1.5, True), (1.0, True), (0.999, False)])
def test_budget_met_compares_the_measured_ttft_with_the_budget(budget, met):
    assert make_report(ttft_budget_s=budget).budget_met is met


def test_budget_met_is_none_without_a_budget_or_a_measurement():
    assert make_report(ttft_budget_s=None).budget_met is None
    assert make_report(make_measurement(ttft_s=None, first_output_s=None)).budget_met is None


def test_prefill_dominates_when_the_wait_is_longer_than_the_stream():
    r = make_report(make_measurement(ttft_s=2.0, engine_decode_s=0.5))
    assert r.dominant_phase == "prefill"  # informational: the verdict is what advises


def test_decode_dominates_when_the_stream_is_longer_than_the_wait():
    r = make_report(make_measurement(ttft_s=0.2, engine_decode_s=3.0, client_decode_s=3.1))
    assert r.dominant_phase == "decode"


# -- the verdict: each phase against its own standard ------------------------------------------------


def _timed(ttft_s: float, tokens_per_s: float, n: int = 33):
    """A measurement of ``n`` output tokens streamed at ``tokens_per_s`` after ``ttft_s``."""
    return make_measurement(ttft_s=ttft_s, first_output_s=ttft_s, completion_tokens=n, engine_decode_s=(n - 1) / tokens_per_s)


@pytest.mark.parametrize(
    "ttft, tps, budget, target, verdict",
    [
        (1.0, 40.0, 1.0, None, "none"),  # exactly at the budget
        (1.001, 40.0, 1.0, None, "wait"),
        (0.999, 40.0, 1.0, None, "none"),
        (0.2, 7.0, None, None, "none"),  # exactly at reading speed
        (0.2, 6.9, None, None, "stream"),
        (0.2, 7.1, None, None, "none"),
        (0.2, 20.0, None, 20.0, "none"),  # exactly at the target
        (0.2, 19.9, None, 20.0, "stream"),
        (1.2, 6.0, None, None, "both"),  # no budget: over 1 s
        (0.9, 6.0, None, 5.0, "none"),  # the caller's target, below reading speed
        (3.0, 19.0, 2.0, 20.0, "both"),
    ],
)
def test_verdict_at_its_boundaries(ttft, tps, budget, target, verdict):
    r = make_report(_timed(ttft, tps), ttft_budget_s=budget, tokens_per_s_target=target)
    assert r.verdict == verdict
    assert r.advice == {"none": (), "wait": WAIT_CURES, "stream": STREAM_CURES, "both": WAIT_CURES + STREAM_CURES}[verdict]


def test_the_issue_case_is_nothing_slow():
    """Issue 12: waited 0.44 s of a 1 s budget, streamed 32 tokens at 11 tokens/s — the old
    report named the stream and prescribed a faster model."""
    r = make_report(_timed(0.44, 11.0), ttft_budget_s=1.0)
    assert r.dominant_phase == "decode"
    assert r.verdict == "none" and r.advice == ()
    text = str(r)
    assert "verdict    nothing is slow" in text and "nothing needs curing" in text
    assert "quantization" not in text


def test_the_wait_the_caller_felt_is_judged_queue_included():
    r = make_report(make_measurement(ttft_s=0.8, first_output_s=0.8, queue_s=0.5), ttft_budget_s=1.0)
    assert r.measured_ttft_s == pytest.approx(1.3)
    assert r.verdict == "wait"


def test_no_first_token_no_verdict():
    r = make_report(make_measurement(ttft_s=None, first_output_s=None))
    assert r.verdict is None and r.judgement is None and r.advice == ()
    assert "verdict" not in str(r)


def test_a_stream_too_short_to_time_is_judged_on_the_wait_alone():
    r = make_report(make_measurement(completion_tokens=1, engine_decode_s=None, client_decode_s=None), ttft_budget_s=0.5)
    assert r.verdict == "wait"
    assert "too short to time" in str(r)


def test_text_prints_the_verdict_its_cures_and_notes():
    text = str(make_report(_timed(0.2, 3.0)))
    assert "verdict    the stream (decode) is slow" in text
    for cure in STREAM_CURES:
        assert f"cure     {cure}" in text
    assert NOT_THE_STREAM_CURE in text
    assert "dominant" not in text


def test_dominant_phase_uses_client_decode_time_when_the_engine_gives_none():
    r = make_report(make_measurement(ttft_s=0.5, engine_decode_s=None, client_decode_s=2.0))
    assert r.stream_s == 2.0
    assert r.dominant_phase == "decode"


def test_dominant_phase_without_a_stream_is_prefill_and_without_a_ttft_is_unknown():
    assert make_report(make_measurement(engine_decode_s=None, client_decode_s=None)).dominant_phase == "prefill"
    unknown = make_report(make_measurement(ttft_s=None, first_output_s=None))
    assert unknown.dominant_phase is None
    assert unknown.advice == ()


def test_decode_speed_comes_from_the_measurement():
    r = make_report(make_measurement(completion_tokens=33, engine_decode_s=0.8, timing_source="llama_perf"))
    assert r.decode_tokens_per_s == pytest.approx(40.0)  # 32 decode steps after the first token
    assert r.time_per_output_token_s == pytest.approx(0.025)


def test_engine_figures_pass_through():
    r = make_report(make_measurement(cached_tokens=100, evaluated_tokens=600, completion_tokens=33))
    assert (r.cached_tokens, r.evaluated_tokens, r.completion_tokens) == (100, 600, 33)


def test_trimmed_is_the_opposite_of_passthrough():
    assert make_report(passthrough=True).trimmed is False
    assert make_report(passthrough=False).trimmed is True


# -- the human text -----------------------------------------------------------------------------


def test_text_mentions_prediction_measurement_error_and_verdict():
    text = str(make_report(predicted_ttft_s=1.1, ttft_budget_s=1.5))
    assert "predicted 1.100 s" in text
    assert "measured 1.000 s" in text
    assert "error +10.0 %" in text
    assert "1.500 s → met" in text


def test_text_states_the_safety_margin_and_what_the_plan_aimed_at():
    text = str(make_report(ttft_budget_s=1.5, safety_margin=0.04))
    assert "1.500 s → met · safety margin 4.0 % (planned to 1.440 s)" in text


def test_text_has_no_margin_without_one():
    assert "safety margin" not in str(make_report(ttft_budget_s=1.5))
    assert "safety margin" not in str(make_report(ttft_budget_s=None, safety_margin=0.04))


def test_text_says_missed_when_the_budget_was_missed():
    text = str(make_report(ttft_budget_s=0.5))
    assert "MISSED" in text and "→ met" not in text


def test_text_says_decode_parameters_were_untouched_with_its_speed():
    text = str(make_report())
    assert "decode parameters untouched by trimkit" in text
    assert "40.0 tokens/s measured" in text
    assert "25.0 ms per output token" in text


def test_text_says_decode_parameters_were_untouched_even_when_too_short_to_time():
    text = str(make_report(make_measurement(completion_tokens=1, engine_decode_s=None, client_decode_s=None)))
    assert "decode parameters untouched by trimkit" in text
    assert "too few to time" in text


def test_no_false_claim_about_decode_in_any_text():
    for r in (make_report(), make_report(passthrough=False, prompt_tokens_before=2000, decode_predicted_tokens_per_s=40.0,
                                         decode_predicted_before_tokens_per_s=30.0)):
        text = (str(r) + r.log_line() + json.dumps(r.to_dict())).lower()
        assert "decode untouched" not in text and "(untouched)" not in text and "independent" not in text


def test_text_lists_every_trimming_action():
    actions = (Action("rag_cap", "kept 2 of 5 chunks"), Action("drop_turns", "dropped turns 1-2"))
    text = str(make_report(actions=actions, passthrough=False, predicted_ttft_before_s=3.0, prompt_tokens_before=2000))
    assert "rag_cap: kept 2 of 5 chunks" in text
    assert "drop_turns: dropped turns 1-2" in text
    assert "before trimming 3.000 s" in text
    assert "before trimming 2,000" in text


def test_text_says_an_untrimmed_request_passed_through():
    assert "passed through unchanged" in str(make_report(actions=(), passthrough=True))


def test_an_infeasible_request_with_nothing_to_trim_is_not_called_under_budget():
    text = str(make_report(actions=(), passthrough=True, feasible=False, ttft_budget_s=0.5))
    assert "none possible" in text and "under budget" not in text


def test_text_flags_an_infeasible_budget_and_engine_truncation():
    text = str(make_report(make_measurement(truncated_tokens=120), feasible=False, warnings=("summary was stale",)))
    assert "infeasible" in text
    assert "120 fewer prompt tokens" in text
    assert "summary was stale" in text


def test_text_survives_missing_numbers():
    m = make_measurement(ttft_s=None, first_output_s=None, cached_tokens=None, evaluated_tokens=None,
                         engine_prefill_s=None, completion_tokens=None, engine_decode_s=None, client_decode_s=None)
    text = str(make_report(m, predicted_ttft_s=None, ttft_budget_s=1.0))
    assert "n/a" in text and "decode parameters untouched by trimkit" in text


def test_log_line_is_one_line_with_the_verdict_and_decode():
    line = make_report().log_line()
    assert "\n" not in line
    assert "verdict=none" in line and "met=True" in line
    assert "decode=40.0tok/s" in line and "decode_params=untouched" in line
    assert "verdict=stream" in make_report(_timed(0.2, 3.0)).log_line()
    trimmed = make_report(passthrough=False, prompt_tokens_before=2000, decode_predicted_tokens_per_s=41.0,
                          decode_predicted_before_tokens_per_s=30.0).log_line()
    assert "decode_pred=41.0tok/s decode_pred_untrimmed=30.0tok/s" in trimmed
    assert "decode_side_effect=+33%(shorter context)" in trimmed  # measured 40 vs 30 untrimmed caps the predicted +37 %


# -- the JSON form ------------------------------------------------------------------------------


def test_to_dict_round_trips_through_strict_json():
    r = make_report(actions=(Action("rag_cap", "kept 2"),), decode_params={"max_tokens": 64, "temperature": 0.2})
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert d["predicted_ttft_s"] == 1.1
    assert d["measured_ttft_s"] == 1.0
    assert d["ttft_error_pct"] == pytest.approx(10.0)
    assert d["budget_met"] is True
    assert d["dominant_phase"] == "prefill"
    assert d["verdict"] == "none" and d["advice"] == [] and d["judgement"]["verdict"] == "none"
    assert d["decode_untouched"] == DECODE_PARAMETERS_UNTOUCHED
    assert d["decode_statement"] == "decode parameters untouched by trimkit"
    assert d["decode_side_effect_pct"] is None and d["tokens_per_s_target"] is None
    assert d["decode_tokens_per_s"] == pytest.approx(40.0)
    assert d["decode_params"] == {"max_tokens": 64, "temperature": 0.2}
    assert d["actions"] == [{"strategy": "rag_cap", "summary": "kept 2"}]
    assert d["measurement"]["ttft_s"] == 1.0
    assert d["safety_margin"] is None


def test_to_dict_carries_the_safety_margin():
    assert make_report(safety_margin=0.125).to_dict()["safety_margin"] == 0.125


def test_to_dict_turns_nan_and_infinity_into_null():
    m = make_measurement(engine_prefill_s=math.nan, server={"timings": {"prompt_ms": math.inf}})
    r = make_report(m, predicted_ttft_s=math.nan, planning_s=math.inf, profile_error_pct=-math.inf)
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert d["predicted_ttft_s"] is None
    assert d["ttft_error_pct"] is None
    assert d["planning_s"] is None and d["profile_error_pct"] is None
    assert d["measurement"]["engine_prefill_s"] is None
    assert d["measurement"]["server"]["timings"]["prompt_ms"] is None


def test_to_dict_turns_unknown_objects_into_strings():
    d = make_report(decode_params={"stop": ("\n",), "logits_processor": object()}).to_dict()
    json.dumps(d, allow_nan=False)
    assert d["decode_params"]["stop"] == ["\n"]
    assert isinstance(d["decode_params"]["logits_processor"], str)


def test_to_json_is_the_dict_as_json():
    r = make_report()
    assert json.loads(r.to_json()) == json.loads(json.dumps(r.to_dict()))


# -- decode measured vs predicted, built from a request and its profile --------------------------------


def _profile(noise_spread: float | None = None):
    """A fake-engine profile whose decode slows with context: 20 tokens/s empty, 8 at 5,000."""
    profile = trimkit.calibrate(FakeBackend(), store=False)
    points = (DecodePoint(0, 20.0, 8, spread_pct=noise_spread), DecodePoint(5000, 8.0, 8, spread_pct=noise_spread))
    return attrs.evolve(profile, decode_points=points)


def _prepared(sent: int, before: int, trimmed: bool) -> Prepared:
    plan = types.SimpleNamespace(feasible=True, actions=(), passthrough=not trimmed, planning_s=0.01, safety_margin=0.05)
    return Prepared(messages=[], prompt_tokens=tuple(range(sent)), cached_tokens=0, predicted_ttft_s=0.5, predicted_ttft_before_s=2.0,
                    prompt_tokens_before=before, budget_s=1.0, plan=plan, feasible=True)


def _of_request(prepared: Prepared, tps: float, profile=None, **kwargs) -> Report:
    m = _timed(0.5, tps)
    return Report.of_request(prepared, m, {"max_tokens": 33}, backend="fake", model="m", profile=profile or _profile(), **kwargs)


def test_of_request_predicts_decode_at_the_context_sent_and_untrimmed():
    profile = _profile()
    r = _of_request(_prepared(1900, 4900, trimmed=True), 13.0, profile)
    assert r.decode_predicted_tokens_per_s == pytest.approx(profile.decode_tokens_per_s_at(1900, 33))
    assert r.decode_predicted_before_tokens_per_s == pytest.approx(profile.decode_tokens_per_s_at(4900, 33))
    assert r.decode_predicted_tokens_per_s > r.decode_predicted_before_tokens_per_s
    side = r.decode.side_effect_pct
    assert side == pytest.approx((r.decode_predicted_tokens_per_s / r.decode_predicted_before_tokens_per_s - 1) * 100)
    text = str(r)
    assert f"the stream was ~{side:.0f} % faster because the context was shorter" in text
    assert "at the 1,900-token context sent" in text and "at the untrimmed 4,900" in text
    assert r.to_dict()["decode_side_effect_pct"] == pytest.approx(side)


def test_of_request_untrimmed_states_no_difference():
    r = _of_request(_prepared(1900, 1900, trimmed=False), 13.0)
    assert r.decode.side_effect_pct is None
    assert "faster because" not in str(r) and "untrimmed" not in str(r)


def test_of_request_states_nothing_the_measurement_does_not_show():
    r = _of_request(_prepared(1900, 4900, trimmed=True), 8.0)  # measured below the untrimmed prediction (~8.1)
    assert r.decode.side_effect_pct is None
    assert "faster because" not in str(r)
    capped = _of_request(_prepared(1900, 4900, trimmed=True), 9.0)  # predicted ~57 % faster, measured ~11 % over untrimmed
    assert capped.decode.side_effect_pct == pytest.approx((9.0 / capped.decode_predicted_before_tokens_per_s - 1) * 100)


def test_of_request_uses_the_profiles_decode_noise():
    r = _of_request(_prepared(1900, 2600, trimmed=True), 13.0, _profile(noise_spread=40.0))
    assert r.decode_noise_pct == 40.0
    pred, before = r.decode_predicted_tokens_per_s, r.decode_predicted_before_tokens_per_s
    assert (pred / before - 1) * 100 > 5.0  # beyond the floor ...
    assert r.decode.side_effect_pct is None  # ... but within the profile's 40 % noise


def test_of_request_carries_the_target_into_the_verdict():
    r = _of_request(_prepared(100, 100, trimmed=False), 13.0, tokens_per_s_target=15.0)
    assert r.tokens_per_s_target == 15.0 and r.verdict == "stream"


def test_wrap_takes_a_validated_target_and_every_report_is_judged_by_it():
    chat = trimkit.wrap(FakeBackend(), ttft_budget_s=5.0, tokens_per_s_target=1000.0)
    chat.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert chat.last_report.tokens_per_s_target == 1000.0
    assert chat.last_report.verdict == "stream"  # the fake streams at 50 tokens/s
    assert "verdict=stream" in chat.last_report.log_line()
    with pytest.raises(InvalidNumberError, match="tokens_per_s_target"):
        trimkit.wrap(FakeBackend(), tokens_per_s_target=0)
    with pytest.raises(InvalidNumberError, match="tokens_per_s_target"):
        chat.pipeline.tokens_per_s_target = math.nan


@pytest.mark.parametrize("urls", ["http://127.0.0.1:9/v1", ["http://127.0.0.1:9/v1", "http://127.0.0.2:9/v1"]])
def test_wrap_url_refuses_a_bad_target_before_anything_is_sent(urls):
    with pytest.raises(InvalidNumberError, match="tokens_per_s_target"):
        trimkit.wrap_url(urls, model="m", tokens_per_s_target=-1.0)
