"""The host's speed trend during calibration (trimkit.host_trend): read from repeated probes,
kept only when the pairs agree on it, and used to steady the samples before the fit."""

from __future__ import annotations

import math
import random

import pytest

import trimkit
from trimkit.host_trend import HostTrend, host_trend, normalized, t_critical
from trimkit.planning.costs import CostModel, PrefillSample, fit_cost_model
from trimkit.testing import FakeBackend

TRUE = CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=5e-7)


def _run(times: list[float], probes: list[tuple[int, int]], speed) -> list[PrefillSample]:
    """Samples of ``probes`` measured at ``times`` on a host whose cost factor is ``speed(t)``."""
    return [PrefillSample(n, k, TRUE.prefill_s(n, k) * speed(t)) for (n, k), t in zip(probes, times, strict=True)]


# a calibration's shape: short probes, long ones, then the short ones repeated
PROBES = [(16, 0), (32, 0), (64, 0), (128, 0), (512, 0), (1024, 0), (256, 1024), (16, 0), (32, 0), (64, 0), (128, 0)]
TIMES = [1.0, 1.5, 2.0, 3.0, 5.0, 9.0, 12.0, 14.0, 14.5, 15.0, 16.0]


def test_a_steady_host_shows_no_trend():
    assert host_trend(_run(TIMES, PROBES, lambda t: 1.0), TIMES) is None


def test_too_few_repeated_pairs_say_nothing():
    probes, times = PROBES[:9], TIMES[:9]  # two repeated pairs
    assert host_trend(_run(times, probes, lambda t: 1.0 + 0.02 * t), times) is None


def test_a_host_slowing_down_is_measured_and_the_samples_steadied():
    speed = lambda t: math.exp(0.02 * t)  # noqa: E731 - 2 % slower every second
    samples = _run(TIMES, PROBES, speed)
    trend = host_trend(samples, TIMES)
    assert isinstance(trend, HostTrend) and trend.pairs == 4
    assert trend.log_per_s == pytest.approx(0.02, rel=1e-6)
    assert trend.to_dict()["pct_per_10_s"] == pytest.approx(100 * math.expm1(0.2))
    steady = normalized(samples, TIMES, trend)
    assert trend.middle_s == pytest.approx((trend.first_s + trend.last_s) / 2)
    middle = speed(trend.middle_s)
    assert speed(min(TIMES)) < middle < speed(max(TIMES))
    for s in steady:  # every sample at the host's speed at the middle of the pairs' span
        assert s.seconds == pytest.approx(TRUE.prefill_s(s.new_tokens, s.cached_tokens) * middle, rel=1e-9)
    assert [s.seconds for s in samples] != [s.seconds for s in steady]  # new objects; the input is kept
    assert samples == _run(TIMES, PROBES, speed)
    # the fit on the raw samples takes the host's change for the model's shape; the steadied one does not
    steady_fit, raw_fit = fit_cost_model(steady), fit_cost_model(samples)
    assert steady_fit.prefill_s(2048) == pytest.approx(TRUE.prefill_s(2048) * middle, rel=0.01)
    assert steady_fit.depth_s == pytest.approx(TRUE.depth_s * middle, rel=0.05)
    assert raw_fit.depth_s > 1.3 * TRUE.depth_s * middle  # the slowing read as a steeper attention term


def test_noise_without_a_trend_is_not_taken_for_one():
    rng = random.Random(7)
    found = 0
    for _ in range(200):
        noise = {t: math.exp(rng.gauss(0.0, 0.05)) for t in TIMES}
        found += host_trend(_run(TIMES, PROBES, noise.__getitem__), TIMES) is not None
    assert found <= 20  # a two-sided 5 % test: ~10 of 200 noise-only runs; 20 leaves room for the draw


def test_the_trend_is_not_extrapolated_beyond_the_pairs_span():
    trend = HostTrend(log_per_s=0.1, pairs=3, t_stat=5.0, first_s=2.0, last_s=4.0)
    assert trend.factor(0.0, 100.0) == pytest.approx(math.exp(0.2))
    assert trend.factor(100.0, 0.0) == pytest.approx(math.exp(-0.2))
    assert trend.factor(3.0, 4.0) == pytest.approx(math.exp(0.1))
    assert trend.factor(5.0, 5.0) == 1.0


def test_t_critical_follows_the_table():
    assert t_critical(3) == pytest.approx(3.182)
    assert t_critical(11) == t_critical(10)  # between rows: the stricter one
    assert t_critical(1000) == 1.96
    with pytest.raises(ValueError):
        t_critical(0)


def test_samples_and_times_must_match():
    with pytest.raises(ValueError, match="samples but"):
        host_trend(_run(TIMES, PROBES, lambda t: 1.0), TIMES[:-1])
    with pytest.raises(ValueError, match="samples but"):
        normalized(_run(TIMES, PROBES, lambda t: 1.0), TIMES[:-1], HostTrend(0.01, 3, 3.0, 0.0, 1.0))


class _SlowingHost(FakeBackend):
    """A fake host whose prefill gets ``rate`` slower per second of its clock."""

    def __init__(self, rate: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rate = rate
        self.t0 = self.clock()

    def factor(self) -> float:
        return math.exp(self.rate * (self.clock() - self.t0))

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        seconds = self.cost_model.prefill_s(new_tokens, cached_tokens) * self.factor()
        self.clock.advance(seconds)
        return seconds


def test_calibration_steadies_a_host_that_slows_while_it_runs(isolated_cache):
    host = _SlowingHost(0.01)  # 1 % slower every second
    profile = trimkit.calibrate(host, mode="full", store=False)
    trend = profile.alternatives["host_trend"]
    assert trend["log_per_s"] == pytest.approx(0.01, rel=0.02) and trend["pairs"] >= 3
    ratios = [profile.predict_prefill_s(n, k) / host.cost_model.prefill_s(n, k) for n, k in ((64, 0), (1024, 0), (256, 512))]
    middle = math.exp(host.rate * (trend["first_s"] + trend["last_s"]) / 2)  # the host midway through its pairs
    assert ratios == pytest.approx([middle] * 3, rel=0.03)
    assert max(ratios) < host.factor() / 1.05  # not the speed at the end: a spell may not last
    assert profile.error.median_pct < 1.0  # the steadied samples fit the model's shape


def test_calibration_of_a_steady_host_records_no_trend(isolated_cache):
    profile = trimkit.calibrate(FakeBackend(), mode="full", store=False)
    assert "host_trend" not in profile.alternatives
