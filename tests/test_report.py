"""The per-request report: derived figures, the human text, and the JSON form."""

from __future__ import annotations

import json
import math

import attrs
import pytest

from tests._core_helpers import make_measurement
from trimkit.diagnose import STREAM_CURES, WAIT_CURES
from trimkit.report import DECODE_UNTOUCHED, Report


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
    assert r.dominant_phase == "prefill"
    assert r.advice == WAIT_CURES


def test_decode_dominates_when_the_stream_is_longer_than_the_wait():
    r = make_report(make_measurement(ttft_s=0.2, engine_decode_s=3.0, client_decode_s=3.1))
    assert r.dominant_phase == "decode"
    assert r.advice == STREAM_CURES


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


def test_text_says_decode_was_untouched_with_its_speed():
    text = str(make_report())
    assert "untouched by trimkit" in text
    assert "40.0 tokens/s" in text
    assert "25.0 ms per output token" in text


def test_text_says_decode_was_untouched_even_when_too_short_to_time():
    text = str(make_report(make_measurement(completion_tokens=1, engine_decode_s=None, client_decode_s=None)))
    assert "untouched by trimkit" in text
    assert "too few to time" in text


def test_text_names_the_dominant_phase():
    assert "dominant   the wait (prefill)" in str(make_report(make_measurement(ttft_s=2.0, engine_decode_s=0.5)))
    assert "dominant   the stream (decode)" in str(make_report(make_measurement(ttft_s=0.2, engine_decode_s=3.0)))


def test_text_lists_every_trimming_action():
    actions = (Action("rag_cap", "kept 2 of 5 chunks"), Action("drop_turns", "dropped turns 1-2"))
    text = str(make_report(actions=actions, passthrough=False, predicted_ttft_before_s=3.0, prompt_tokens_before=2000))
    assert "rag_cap: kept 2 of 5 chunks" in text
    assert "drop_turns: dropped turns 1-2" in text
    assert "before trimming 3.000 s" in text
    assert "before trimming 2,000" in text


def test_text_says_an_untrimmed_request_passed_through():
    assert "passed through unchanged" in str(make_report(actions=(), passthrough=True))


def test_text_flags_an_infeasible_budget_and_engine_truncation():
    text = str(make_report(make_measurement(truncated_tokens=120), feasible=False, warnings=("summary was stale",)))
    assert "infeasible" in text
    assert "120 fewer prompt tokens" in text
    assert "summary was stale" in text


def test_text_survives_missing_numbers():
    m = make_measurement(ttft_s=None, first_output_s=None, cached_tokens=None, evaluated_tokens=None,
                         engine_prefill_s=None, completion_tokens=None, engine_decode_s=None, client_decode_s=None)
    text = str(make_report(m, predicted_ttft_s=None, ttft_budget_s=1.0))
    assert "n/a" in text and "untouched by trimkit" in text


def test_log_line_is_one_line_and_says_decode_was_untouched():
    line = make_report().log_line()
    assert "\n" not in line
    assert "untouched" in line and "met=True" in line


# -- the JSON form ------------------------------------------------------------------------------


def test_to_dict_round_trips_through_strict_json():
    r = make_report(actions=(Action("rag_cap", "kept 2"),), decode_params={"max_tokens": 64, "temperature": 0.2})
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert d["predicted_ttft_s"] == 1.1
    assert d["measured_ttft_s"] == 1.0
    assert d["ttft_error_pct"] == pytest.approx(10.0)
    assert d["budget_met"] is True
    assert d["dominant_phase"] == "prefill"
    assert d["decode_untouched"] == DECODE_UNTOUCHED
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
