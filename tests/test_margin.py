"""The one estimate of the host's speed (trimkit/planning/speed.py: measured ÷ predicted over a
recent window — its middle the speed factor, its spread the margin, ≥ 2× the slowdown notice) and
the live state one engine shares between wrappers, on the deterministic fake backend."""

from __future__ import annotations

import random
import threading

import attrs
import pytest

import trimkit
from tests._core_helpers import TRUE_MODEL, exact_samples, make_profile
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.llama import LlamaBackend
from trimkit.planning.costs import CostModel, PrefillSample
from trimkit.planning.speed import (
    FACTOR_WINDOW,
    MARGIN_CAP,
    MARGIN_FLOOR,
    WINDOW,
    EngineState,
    SpeedEstimate,
    calibration_seed,
    engine_state,
    margin_for_ratio,
    quantile,
)
from trimkit.testing import FakeBackend, FakeClock
from trimkit.wrapper import Trimmer

COST = CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-7)
WORDS = "the harbour lamp keeper rows out at dawn and counts the fishing boats along the quay".split()


def text(n_words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i + seed) % len(WORDS)] for i in range(n_words))


def scaled(model: CostModel, factor: float) -> CostModel:
    """The same engine ``factor`` times slower (every coefficient scaled)."""
    return attrs.evolve(model, overhead_s=model.overhead_s * factor, per_token_s=model.per_token_s * factor,
                        depth_s=model.depth_s * factor, per_batch_s=model.per_batch_s * factor)


def ask(t: Trimmer, seed: int, words: int = 300):
    """One cold request (the fake's KV cache emptied first) through the Trimmer; its report."""
    with t.backend.lock:
        t.backend.kv = []
    prepared = t.prepare([{"role": "user", "content": text(words, seed)}], None, {"max_tokens": 2})
    rs = t.execute(prepared, {"max_tokens": 2})
    for _ in rs:
        pass
    return rs.report


@pytest.fixture
def fake(isolated_cache):
    return FakeBackend(COST, clock=FakeClock())


@pytest.fixture
def profile(fake):
    return trimkit.calibrate(fake)  # exact: every held-out ratio is 1


# -- the estimate ------------------------------------------------------------------------------------


def samples_at(ratios, model=TRUE_MODEL, n=512):
    return [PrefillSample(n, 0, model.prefill_s(n) * r, source="live") for r in ratios]


@pytest.mark.parametrize("ratio, margin", [(0.9, MARGIN_FLOOR), (1.0, MARGIN_FLOOR), (1.25, 0.2), (2.0, 0.5), (10.0, MARGIN_CAP)])
def test_margin_is_one_minus_one_over_the_ratio_clamped(ratio, margin):
    assert margin_for_ratio(ratio) == pytest.approx(margin)


def test_quantile_is_the_split_conformal_rank_or_the_largest():
    values = list(range(1, 101))
    assert quantile(values, 0.97) == 98  # ceil(101 × 0.97) = 98
    assert quantile([3.0, 1.0, 2.0], 0.97) == 3.0  # too few for the rank: the largest


def test_the_factor_is_the_middle_of_the_recent_ratios():
    est = SpeedEstimate(samples_at([0.7] * 4), prior=1.0)
    assert est.factor(TRUE_MODEL) == pytest.approx(1.0)  # calibration's samples shape the spread, not the speed
    for s in samples_at([1.5] * 5):
        est.observe(s)
    assert est.factor(TRUE_MODEL) == pytest.approx(1.5)  # the latest 5 say 1.5
    assert est.observations == 5
    assert SpeedEstimate(prior=1.3).factor(TRUE_MODEL) == pytest.approx(1.3)  # a stored speed stands in
    est.observe(samples_at([1.0])[0])
    assert est.factor(TRUE_MODEL) == pytest.approx(1.5)  # one of them back: still the middle


def test_one_outlier_does_not_move_the_factor():
    est = SpeedEstimate()
    for s in samples_at([1.0] * 8 + [4.0]):
        est.observe(s)
    assert est.factor(TRUE_MODEL) == pytest.approx(1.0)


def test_the_window_keeps_the_latest_measurements():
    est = SpeedEstimate(samples_at([1.0] * 4))
    for s in samples_at([2.0] * WINDOW):
        est.observe(s)
    assert len(est.samples) == WINDOW and est.factor(TRUE_MODEL) == pytest.approx(2.0)


def test_after_a_slowdown_the_older_faster_ratios_widen_nothing():
    est = SpeedEstimate(samples_at([1.0] * 12))
    for s in samples_at([2.0] * 5):
        est.observe(s)
    assert est.factor(TRUE_MODEL) == pytest.approx(2.0)
    assert est.margin(TRUE_MODEL, fallback=0.2) == pytest.approx(MARGIN_FLOOR)


def test_the_margin_is_the_spread_around_the_middle_and_narrows_for_a_watched_share():
    steady = SpeedEstimate(samples_at([1.0] * 12))
    assert steady.margin(TRUE_MODEL, fallback=0.2) == pytest.approx(MARGIN_FLOOR)
    rng = random.Random(1)
    ratios = [rng.uniform(0.85, 1.35) for _ in range(WINDOW)]
    noisy = SpeedEstimate()
    for s in samples_at(ratios):
        noisy.observe(s)
    middle = sorted(ratios[-FACTOR_WINDOW:])[FACTOR_WINDOW // 2]
    q = quantile([r / middle for r in ratios], 0.97)
    assert noisy.margin(TRUE_MODEL, fallback=0.2) == pytest.approx(margin_for_ratio(q), rel=1e-6)
    assert noisy.margin(TRUE_MODEL, fallback=0.2) > 0.1
    # a watched request: only the share after the last step is uncertain
    assert noisy.margin(TRUE_MODEL, fallback=0.2, share=0.25) == pytest.approx(margin_for_ratio(1 + 0.25 * (q - 1)), rel=1e-6)
    assert noisy.margin(TRUE_MODEL, 0.5, fallback=0.2) < noisy.margin(TRUE_MODEL, 0.97, fallback=0.2)


def test_too_few_measurements_fall_back_to_the_profiles_rule():
    assert SpeedEstimate(samples_at([1.0] * 3)).margin(TRUE_MODEL, fallback=0.2) == pytest.approx(0.2)


def test_a_refit_model_rereads_every_sample():
    est = SpeedEstimate()
    for s in samples_at([1.0] * 6):
        est.observe(s)
    half = attrs.evolve(TRUE_MODEL, overhead_s=TRUE_MODEL.overhead_s / 2, per_token_s=TRUE_MODEL.per_token_s / 2, depth_s=TRUE_MODEL.depth_s / 2)
    assert est.factor(half) == pytest.approx(2.0)


def test_the_estimate_is_thread_safe():
    est = SpeedEstimate(samples_at([1.0] * 4))

    def feed():
        for s in samples_at([1.2] * 200):
            est.observe(s)

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert est.observations == 800 and est.factor(TRUE_MODEL) == pytest.approx(1.2)


def test_refuses_a_bad_prior():
    with pytest.raises(ValueError):
        SpeedEstimate(prior=float("nan"))


def test_the_seed_is_the_larger_half_of_the_calibration_at_its_stored_speed():
    p = make_profile(samples=exact_samples(TRUE_MODEL))
    seed = calibration_seed(p)
    assert len(seed) == 4 and min(TRUE_MODEL.prefill_s(s.new_tokens, s.cached_tokens) for s in seed) >= TRUE_MODEL.prefill_s(256)
    stored = attrs.evolve(p, drift=1.4)
    assert EngineState(stored).live.current.drift == pytest.approx(1.4)


# -- one engine, one state ----------------------------------------------------------------------------


def test_wrappers_of_one_backend_share_one_state_and_another_calibration_starts_afresh(fake, profile):
    a = Trimmer(fake, profile=profile, clock=fake.clock)
    b = Trimmer(fake, profile=profile, clock=fake.clock)
    assert b.engine is a.engine and b.live is a.live
    other = FakeBackend(COST, clock=FakeClock())
    assert Trimmer(other, profile=profile, clock=other.clock).engine is not a.engine
    recalibrated = attrs.evolve(profile, created_at=profile.created_at + 1)
    fresh = Trimmer(fake, profile=recalibrated, clock=fake.clock)
    assert fresh.engine is not a.engine and fresh.live.observations == 0


def test_an_engine_named_by_an_object_is_forgotten_with_it():
    import gc

    from trimkit.planning import speed as margin

    fake = FakeBackend(COST, clock=FakeClock())
    engine_state(fake, make_profile())
    before = len(margin._by_object)
    del fake
    gc.collect()
    assert len(margin._by_object) == before - 1


def test_a_llama_is_its_backends_engine():
    llm = object.__new__(type("FakeLlama", (), {}))
    backends = []
    for _ in range(2):
        b = LlamaBackend.__new__(LlamaBackend)  # no real model: only the identity is asked
        b.llm = llm
        backends.append(b)
    assert backends[0].engine_identity() is llm
    p = make_profile()
    assert engine_state(backends[0], p) is engine_state(backends[1], p)


def test_a_server_and_model_is_one_engine_whatever_the_client_object():
    a = OpenAIHTTPBackend("http://mock.test/v1", model="m")
    b = OpenAIHTTPBackend("http://mock.test/v1/", model="m")
    c = OpenAIHTTPBackend("http://mock.test/v1", model="other")
    try:
        assert a.engine_identity() == b.engine_identity() != c.engine_identity()
        p = make_profile(key=trimkit.planning.profile.ProfileKey(backend="openai_http", model="http://mock.test/v1|m", n_ctx=4096, n_batch=512))
        assert engine_state(a, p) is engine_state(b, p) is not engine_state(c, p)
    finally:
        for x in (a, b, c):
            x.close()


def test_a_second_wrap_starts_from_the_first_wraps_speed(fake, profile):
    first = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    fake.cost_model = scaled(COST, 1.3)
    for i in range(12):
        ask(first, i)
    assert first.profile.drift == pytest.approx(1.3, rel=0.01)
    second = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    assert second.profile.drift == pytest.approx(1.3, rel=0.01)
    assert second.safety_margin == first.safety_margin
    assert abs(ask(second, 99).ttft_error_pct) < 1.0  # already predicts the slower speed


# -- following the host's speed ---------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [1.3, 1 / 1.3], ids=["30%-slower", "30%-faster"])
def test_a_30_percent_change_of_speed_is_followed(fake, profile, factor):
    t = Trimmer(fake, ttft_budget_s=3.0, profile=profile, clock=fake.clock)
    assert abs(ask(t, 0).ttft_error_pct) < 1.0
    fake.cost_model = scaled(COST, factor)
    reports = [ask(t, i) for i in range(1, 10)]
    assert abs(reports[0].ttft_error_pct) > 15  # the change itself was not predicted (open loop: no watch on a 300-word prompt)
    assert t.profile.drift == pytest.approx(factor, rel=0.02)
    assert abs(reports[-1].ttft_error_pct) < 5.0


def test_a_one_request_hiccup_does_not_move_the_speed(fake, profile):
    t = Trimmer(fake, ttft_budget_s=3.0, profile=profile, clock=fake.clock)
    for i in range(5):
        ask(t, i)
    fake.cost_model = scaled(COST, 3.0)
    ask(t, 5)
    fake.cost_model = COST
    assert t.profile.drift == pytest.approx(1.0, abs=0.02)
    assert abs(ask(t, 6).ttft_error_pct) < 2.0


# -- the margin through the wrapper ----------------------------------------------------------------------


class NoisyFake(FakeBackend):
    """A fake whose speed varies from request to request by a factor drawn from ``spread``."""

    def __init__(self, *args, spread=(1.0, 1.0), seed=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.base = self.cost_model
        self.spread = spread
        self.rng = random.Random(seed)

    def send(self, messages, params, *, prompt_tokens=None, **kw):
        self.cost_model = scaled(self.base, self.rng.uniform(*self.spread))
        return super().send(messages, params, prompt_tokens=prompt_tokens, **kw)


def run_requests(spread, n):
    fake = NoisyFake(COST, clock=FakeClock(), spread=spread, seed=3)
    profile = trimkit.calibrate(fake, store=False)
    t = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    reports = [ask(t, i) for i in range(n)]
    return t, reports


def test_the_margin_narrows_on_a_steady_host_and_widens_on_a_noisy_one(isolated_cache):
    steady, reports = run_requests((1.0, 1.0), 24)
    assert all(r.ttft_budget_s for r in reports)
    assert steady.safety_margin == pytest.approx(MARGIN_FLOOR)
    noisy, _ = run_requests((0.85, 1.35), 60)
    assert noisy.safety_margin > 3 * steady.safety_margin
    assert noisy.safety_margin == pytest.approx(noisy.engine.speed.margin(noisy.profile.model, fallback=0.0))


def test_the_attainment_target_picks_the_quantile(isolated_cache):
    fake = NoisyFake(COST, clock=FakeClock(), spread=(0.85, 1.35), seed=3)
    profile = trimkit.calibrate(fake, store=False)
    strict = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    for i in range(60):
        ask(strict, i)
    loose = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock, attainment_target=0.6)
    assert loose.engine is strict.engine
    assert loose.safety_margin < strict.safety_margin
    with pytest.raises(trimkit.errors.InvalidInputError):
        Trimmer(fake, profile=profile, attainment_target=1.0)


def test_the_report_states_the_margin_the_plan_held_back(fake, profile):
    t = Trimmer(fake, ttft_budget_s=1.5, profile=profile, clock=fake.clock)
    prepared = t.prepare([{"role": "user", "content": text(300)}], None, {"max_tokens": 2})
    rs = t.execute(prepared, {"max_tokens": 2})
    for _ in rs:
        pass
    report = rs.report
    assert report.safety_margin == prepared.plan.safety_margin
    assert f"safety margin {report.safety_margin * 100:.1f} %" in str(report)
    assert report.to_dict()["safety_margin"] == report.safety_margin
    unbudgeted = Trimmer(fake, profile=profile, clock=fake.clock)
    assert ask(unbudgeted, 1).safety_margin is None
