"""The prefill cost model: fitting, predicting, inverting, and measuring its own error."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._core_helpers import PROBES, TRUE_MODEL, exact_samples
from trimkit.errors import InvalidNumberError
from trimkit.planning.costs import CostModel, ErrorStats, PrefillSample, error_stats, fit_cost_model, heldout_predictions


def _rel(actual: float, expected: float) -> float:
    return abs(actual - expected) / abs(expected)


# -- prefill_s ----------------------------------------------------------------------------------


def test_prefill_s_follows_the_design_formula():
    m = CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-6)
    # b + a·n + c·(n·k + n²/2) with n=100, k=50: 0.01 + 0.2 + 1e-6·(5000 + 5000)
    assert m.prefill_s(100, 50) == pytest.approx(0.01 + 0.2 + 0.01)


def test_prefill_s_adds_one_per_batch_cost_per_started_chunk():
    m = CostModel(overhead_s=0.0, per_token_s=0.0, depth_s=0.0, per_batch_s=0.5, n_batch=100)
    assert [m.prefill_s(n) for n in (1, 100, 101, 250)] == [0.5, 0.5, 1.0, 1.5]


def test_prefill_of_no_tokens_costs_nothing():
    assert TRUE_MODEL.prefill_s(0, 1000) == 0.0
    assert TRUE_MODEL.prefill_s(-5) == 0.0


def test_model_name_says_whether_the_per_batch_term_is_used():
    assert CostModel(0.01, 0.001, 0.0).name == "design"
    assert CostModel(0.01, 0.001, 0.0, per_batch_s=0.001).name == "batched"


@pytest.mark.parametrize("field", ["overhead_s", "per_token_s", "depth_s", "per_batch_s"])
@pytest.mark.parametrize("bad", [-1e-9, float("nan"), float("inf"), True, "0.1", None])
def test_cost_model_refuses_bad_coefficients(field, bad):
    kwargs = {"overhead_s": 0.01, "per_token_s": 0.001, "depth_s": 0.0, field: bad}
    with pytest.raises(InvalidNumberError):
        CostModel(**kwargs)


@pytest.mark.parametrize("bad", [0, -512, True, 512.0])
def test_cost_model_refuses_bad_n_batch(bad):
    with pytest.raises(InvalidNumberError):
        CostModel(0.01, 0.001, 0.0, n_batch=bad)


# -- fitting ------------------------------------------------------------------------------------


def test_fit_recovers_design_coefficients_from_noise_free_samples():
    fitted = fit_cost_model(exact_samples(TRUE_MODEL))
    assert fitted.name == "design"
    assert fitted.overhead_s == pytest.approx(TRUE_MODEL.overhead_s, rel=1e-6)
    assert fitted.per_token_s == pytest.approx(TRUE_MODEL.per_token_s, rel=1e-6)
    assert fitted.depth_s == pytest.approx(TRUE_MODEL.depth_s, rel=1e-6)


def test_fit_recovers_batched_coefficients_from_noise_free_samples():
    true = CostModel(overhead_s=0.005, per_token_s=0.001, depth_s=2e-7, per_batch_s=0.03, n_batch=256)
    probes = [(16, 0), (64, 0), (256, 0), (300, 0), (1024, 0), (2048, 0), (256, 2048), (1024, 2048)]
    fitted = fit_cost_model(exact_samples(true, probes), n_batch=256, batched=True)
    assert fitted.n_batch == 256
    for name in ("overhead_s", "per_token_s", "depth_s", "per_batch_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6), name


def test_unbatched_fit_has_no_per_batch_term():
    fitted = fit_cost_model(exact_samples(TRUE_MODEL), batched=False)
    assert fitted.per_batch_s == 0.0


def test_fit_never_returns_a_negative_overhead():
    # timings on the line 1 ms/token − 10 ms: least squares wants overhead −0.01 s
    samples = [PrefillSample(n, 0, 0.001 * n - 0.01) for n in (64, 128, 512, 1024, 2048)]
    rows = np.array([[1.0, n, n * n / 2] for n in (64, 128, 512, 1024, 2048)])
    unconstrained, *_ = np.linalg.lstsq(rows, [s.seconds for s in samples], rcond=None)
    assert unconstrained[0] < 0  # the data really do push the overhead negative
    fitted = fit_cost_model(samples)
    assert min(fitted.overhead_s, fitted.per_token_s, fitted.depth_s) >= 0.0


def test_fit_never_returns_a_negative_depth_cost():
    # per-token time that falls with length (concave): least squares wants depth_s < 0
    ns = (64, 256, 1024, 4096)
    samples = [PrefillSample(n, 0, 0.002 * n**0.8) for n in ns]
    rows = np.array([[1.0, n, n * n / 2] for n in ns])
    unconstrained, *_ = np.linalg.lstsq(rows, [s.seconds for s in samples], rcond=None)
    assert unconstrained[2] < 0
    fitted = fit_cost_model(samples)
    assert fitted.depth_s == 0.0
    assert fitted.overhead_s >= 0.0 and fitted.per_token_s > 0.0


def test_fit_weighs_a_short_sample_as_much_as_a_long_one():
    # exact at 16/32/64 tokens; the long samples are off by ±3 %. An absolute least-squares fit
    # lets the long samples' noise set the overhead (174 % error at 16 tokens); a relative one
    # keeps the short samples right.
    true = CostModel(overhead_s=0.002, per_token_s=0.001, depth_s=0.0)
    noise = {16: 1.0, 32: 1.0, 64: 1.0, 4096: 1.03, 8192: 0.97}
    samples = [PrefillSample(n, 0, true.prefill_s(n) * f) for n, f in noise.items()]
    fitted = fit_cost_model(samples)
    for s in samples[:3]:
        assert _rel(fitted.prefill_s(s.new_tokens), s.seconds) < 0.01
    for s in samples[3:]:
        assert _rel(fitted.prefill_s(s.new_tokens), s.seconds) < 0.05


def test_fit_is_unchanged_when_every_time_is_scaled():
    # relative error is scale-free: a machine twice as slow fits coefficients twice as large
    samples = exact_samples(TRUE_MODEL)
    slow = [PrefillSample(s.new_tokens, s.cached_tokens, 2 * s.seconds) for s in samples]
    a, b = fit_cost_model(samples), fit_cost_model(slow)
    assert b.per_token_s == pytest.approx(2 * a.per_token_s, rel=1e-6)
    assert b.overhead_s == pytest.approx(2 * a.overhead_s, rel=1e-6)


def test_fit_ignores_zero_time_samples():
    samples = exact_samples(TRUE_MODEL) + [PrefillSample(512, 0, 0.0)]
    assert fit_cost_model(samples).per_token_s == pytest.approx(TRUE_MODEL.per_token_s, rel=1e-6)


def test_fit_without_a_positive_time_raises():
    with pytest.raises(ValueError):
        fit_cost_model([PrefillSample(16, 0, 0.0)])
    with pytest.raises(ValueError):
        fit_cost_model([])


# -- max_new_tokens: the inverse of prefill_s ---------------------------------------------------


@pytest.mark.parametrize("cached", [0, 1000])
@pytest.mark.parametrize("n", [1, 17, 512, 3000])
def test_max_new_tokens_boundary_n_fits_and_n_plus_one_does_not(n, cached):
    budget = TRUE_MODEL.prefill_s(n, cached)
    assert TRUE_MODEL.max_new_tokens(budget, cached) == n
    assert TRUE_MODEL.max_new_tokens(math.nextafter(budget, 0.0), cached) == n - 1


def test_max_new_tokens_is_zero_when_one_token_does_not_fit():
    assert TRUE_MODEL.max_new_tokens(TRUE_MODEL.overhead_s) == 0
    assert TRUE_MODEL.max_new_tokens(-1.0) == 0


def test_max_new_tokens_is_smaller_deeper_in_the_context():
    assert TRUE_MODEL.max_new_tokens(2.0, cached_tokens=4000) < TRUE_MODEL.max_new_tokens(2.0)


def test_max_new_tokens_stops_at_the_limit_when_tokens_are_free():
    free = CostModel(0.0, 0.0, 0.0)
    assert free.max_new_tokens(1.0, limit=5000) == 5000


@given(
    overhead=st.floats(0.0, 0.1),
    per_token=st.floats(1e-5, 1e-2),
    depth=st.floats(0.0, 1e-6),
    cached=st.integers(0, 8000),
    seconds=st.floats(0.0, 30.0),
)
def test_max_new_tokens_brackets_the_budget(overhead, per_token, depth, cached, seconds):
    m = CostModel(overhead, per_token, depth)
    n = m.max_new_tokens(seconds, cached, limit=1 << 30)
    if n > 0:
        assert m.prefill_s(n, cached) <= seconds
    assert m.prefill_s(n + 1, cached) > seconds


# -- error_stats of heldout_predictions (leave one probe out) ---------------------------------------


def test_error_stats_on_a_hand_computed_example():
    # absolute errors 10, 10, 0, 30 % → sorted 0, 10, 10, 30
    stats = error_stats([(110.0, 100.0), (90.0, 100.0), (100.0, 100.0), (130.0, 100.0)])
    assert stats.n == 4
    assert stats.median_pct == pytest.approx(10.0)
    assert stats.p90_pct == pytest.approx(24.0)  # 10 + 0.7 · (30 − 10)
    assert stats.max_pct == pytest.approx(30.0)


def test_error_stats_is_relative_to_the_measurement():
    assert error_stats([(1.0, 2.0)]).max_pct == pytest.approx(50.0)
    assert error_stats([(2.0, 1.0)]).max_pct == pytest.approx(100.0)


def test_error_stats_skips_non_positive_measurements():
    stats = error_stats([(1.0, 0.0), (1.0, -1.0), (1.5, 1.0)])
    assert stats.n == 1 and stats.median_pct == pytest.approx(50.0)


def test_error_stats_of_nothing_is_nan():
    stats = error_stats([])
    assert stats.n == 0
    assert math.isnan(stats.median_pct) and math.isnan(stats.p90_pct) and math.isnan(stats.max_pct)


def test_heldout_error_on_a_hand_computed_example():
    # T(n) = n for n = 1, 2, 3 and T(100) = 110. Each fit of three points interpolates them
    # exactly with a quadratic q(n) = n + C·(n − i)(n − j) (non-negative coefficients), so the
    # held-out predictions can be written down:
    #   without 100: q = n          → predicts 100 for 110     → 10/110        = 9.0909 %
    #   without 1:   C = 10/(98·97) → predicts 1 + 2C for 1    → 2C            = 0.21039 %
    #   without 2:   C = 10/(99·97) → predicts 2 − C for 2     → C/2           = 0.052067 %
    #   without 3:   C = 10/(99·98) → predicts 3 + 2C for 3    → 2C/3          = 0.068714 %
    samples = [PrefillSample(1, 0, 1.0), PrefillSample(2, 0, 2.0), PrefillSample(3, 0, 3.0), PrefillSample(100, 0, 110.0)]
    errs = sorted([1000 / 110, 2000 / 9506, 500 / 9603, 2000 / (3 * 9702)])
    stats = error_stats(heldout_predictions(samples, n_batch=512, batched=False))
    assert stats.n == 4
    assert stats.max_pct == pytest.approx(errs[3], rel=1e-6)
    assert stats.median_pct == pytest.approx((errs[1] + errs[2]) / 2, rel=1e-6)
    assert stats.p90_pct == pytest.approx(errs[2] + 0.7 * (errs[3] - errs[2]), rel=1e-6)


def test_heldout_error_holds_out_every_repeat_of_a_probe_together():
    # with repeats, a probe's own samples must not predict it: held-out error stays the hand value
    samples = [PrefillSample(1, 0, 1.0), PrefillSample(2, 0, 2.0), PrefillSample(3, 0, 3.0)]
    samples += [PrefillSample(100, 0, 110.0), PrefillSample(100, 0, 110.0)]
    stats = error_stats(heldout_predictions(samples, n_batch=512, batched=False))
    assert stats.n == 5
    assert stats.max_pct == pytest.approx(1000 / 110, rel=1e-6)


def test_heldout_error_of_noise_free_samples_is_zero():
    stats = error_stats(heldout_predictions(exact_samples(TRUE_MODEL), n_batch=512, batched=False))
    assert stats.n == len(PROBES)
    assert stats.max_pct < 1e-6


def test_heldout_error_with_fewer_than_four_probes_uses_the_in_sample_fit():
    # three probes, three coefficients: leaving one out could not fit, so the in-sample error is given
    samples = [PrefillSample(1, 0, 1.0), PrefillSample(2, 0, 2.0), PrefillSample(100, 0, 110.0)]
    stats = error_stats(heldout_predictions(samples, n_batch=512, batched=False))
    assert stats.n == 3
    assert stats.max_pct < 1e-6


def test_error_stats_to_dict():
    assert ErrorStats(1.0, 2.0, 3.0, 4).to_dict() == {"median_pct": 1.0, "p90_pct": 2.0, "max_pct": 3.0, "n": 4}


# -- PrefillSample validation -------------------------------------------------------------------


def test_prefill_sample_keeps_its_values_and_source():
    s = PrefillSample(16, 32, 1, source="live")
    assert (s.new_tokens, s.cached_tokens, s.seconds, s.source) == (16, 32, 1.0, "live")
    assert isinstance(s.seconds, float)
    assert s.to_dict() == {"new_tokens": 16, "cached_tokens": 32, "seconds": 1.0, "source": "live"}


def test_prefill_sample_accepts_zero_seconds_and_numpy_numbers():
    assert PrefillSample(1, 0, 0.0).seconds == 0.0
    assert PrefillSample(1, 0, np.float32(0.5)).seconds == 0.5


@pytest.mark.parametrize("new_tokens", [0, -1, True, 16.0, "16", None])
def test_prefill_sample_refuses_bad_new_tokens(new_tokens):
    with pytest.raises(InvalidNumberError, match="new_tokens"):
        PrefillSample(new_tokens, 0, 0.1)


@pytest.mark.parametrize("cached_tokens", [-1, False, 1.5])
def test_prefill_sample_refuses_bad_cached_tokens(cached_tokens):
    with pytest.raises(InvalidNumberError, match="cached_tokens"):
        PrefillSample(16, cached_tokens, 0.1)


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -0.001, True, "0.1", None])
def test_prefill_sample_refuses_bad_seconds(seconds):
    with pytest.raises(InvalidNumberError):
        PrefillSample(16, 0, seconds)
