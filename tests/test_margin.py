"""The learned safety margin (conformal quantile of measured / predicted TTFT) and the live state
one engine shares between wrappers (drift + margin window), on the deterministic fake backend."""

from __future__ import annotations

import math
import random
import threading

import attrs
import pytest

import trimkit
from tests._core_helpers import TRUE_MODEL, exact_samples, make_profile
from trimkit.testing import FakeBackend, FakeClock
from trimkit.wrapper import Trimmer
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.llama import LlamaBackend
from trimkit.planning.costs import CostModel, heldout_predictions
from trimkit.planning.margin import (
    DEFAULT_WINDOW,
    MARGIN_CAP,
    MARGIN_FLOOR,
    EngineState,
    MarginWindow,
    calibration_ratios,
    conformal_quantile,
    conformal_rank,
    engine_state,
    margin_for_ratio,
)

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


# -- the conformal quantile -----------------------------------------------------------------------


@pytest.mark.parametrize("n, target, rank", [(100, 0.97, 98), (99, 0.97, 97), (33, 0.97, 33), (32, 0.97, 33), (9, 0.9, 9), (19, 0.9, 18), (1, 0.5, 1)])
def test_conformal_rank_is_ceil_of_n_plus_one_times_target(n, target, rank):
    assert conformal_rank(n, target) == rank


def test_conformal_quantile_is_the_ceil_n_plus_one_q_th_smallest():
    values = [1.0 + i / 100 for i in range(100)]
    random.Random(4).shuffle(values)
    assert conformal_quantile(values, 0.97) == pytest.approx(1.97)  # the 98th smallest, not the 97th
    assert conformal_quantile(values, 0.5) == pytest.approx(1.50)  # ceil(101 / 2) = 51st
    assert conformal_quantile(values[:33], 0.97) == max(values[:33])  # 33 values: the largest


@pytest.mark.parametrize("n", [0, 1, 10, 32])
def test_conformal_quantile_is_infinite_when_too_few_values_for_the_rank(n):
    assert conformal_quantile([1.0] * n, 0.97) == math.inf


@pytest.mark.parametrize("ratio, margin", [(1.25, 0.20), (2.0, 0.50), (1.0, MARGIN_FLOOR), (0.8, MARGIN_FLOOR), (10.0, MARGIN_CAP)])
def test_margin_is_one_minus_one_over_the_ratio_clamped(ratio, margin):
    assert margin_for_ratio(ratio) == pytest.approx(margin)


def test_a_prediction_at_the_margin_times_the_quantile_ratio_is_exactly_the_budget():
    budget, ratio = 2.0, 1.3
    predicted = budget * (1 - margin_for_ratio(ratio))
    assert predicted * ratio == pytest.approx(budget)


# -- the window ----------------------------------------------------------------------------------


def test_window_with_too_few_ratios_falls_back():
    w = MarginWindow(seed=[1.5] * 32)
    assert w.quantile_ratio() is None
    assert w.margin(0.07) == 0.07
    w.add(1.5)
    assert w.margin(0.07) == pytest.approx(1 - 1 / 1.5)


def test_window_margin_is_the_conformal_quantile_of_its_ratios():
    ratios = [1.0 + i / 100 for i in range(100)]
    w = MarginWindow(seed=ratios)
    assert w.quantile_ratio() == pytest.approx(1.97)
    assert w.margin(0.5) == pytest.approx(1 - 1 / 1.97)
    assert w.quantile_ratio(0.5) == pytest.approx(1.50)  # another target from the same ratios


def test_window_widens_when_the_host_gets_noisy_and_narrows_when_it_is_steady():
    rng = random.Random(7)
    w = MarginWindow()
    for _ in range(DEFAULT_WINDOW):
        w.add(rng.uniform(0.99, 1.02))
    steady = w.margin(0.25)
    assert MARGIN_FLOOR <= steady < 0.03
    for _ in range(DEFAULT_WINDOW):
        w.add(rng.uniform(0.8, 1.4))
    noisy = w.margin(0.25)
    assert 0.25 < noisy < 1 - 1 / 1.4 + 1e-9
    for _ in range(DEFAULT_WINDOW):
        w.add(rng.uniform(0.99, 1.02))
    assert w.margin(0.25) == pytest.approx(steady, abs=0.01)


def test_window_keeps_the_last_window_ratios():
    w = MarginWindow(window=3, seed=[1.0, 2.0])
    for r in (3.0, 4.0):
        w.add(r)
    assert w.ratios == (2.0, 3.0, 4.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0, None, "1.2", True])
def test_window_ignores_unusable_ratios(bad):
    w = MarginWindow()
    assert w.add(bad) is False
    assert w.observe(bad, 1.0) is False and w.observe(1.0, bad) is False
    assert w.ratios == ()


def test_window_refuses_bad_settings():
    for kwargs in ({"target": 1.0}, {"target": 0.0}, {"window": 0}, {"floor": 0.5, "cap": 0.4}, {"cap": 1.0}):
        with pytest.raises(ValueError):
            MarginWindow(**kwargs)


def test_window_is_thread_safe():
    w = MarginWindow(window=10_000)

    def feed() -> None:
        for i in range(500):
            w.observe(1.0, 1.0 + i / 1000)
            w.margin(0.1)

    threads = [threading.Thread(target=feed) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(w) == 4000


# -- seeded from calibration -------------------------------------------------------------------------


class NoisyCalibrationFake(FakeBackend):
    """A fake whose calibration probes are off by a repeating set of factors."""

    factors = (1.0, 1.12, 0.95, 1.3, 0.9)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.i = 0

    def measure_prefill(self, new_tokens, cached_tokens=0):
        seconds = super().measure_prefill(new_tokens, cached_tokens) * self.factors[self.i % len(self.factors)]
        self.i += 1
        return seconds


def test_calibration_keeps_its_held_out_residuals(isolated_cache):
    p = trimkit.calibrate(NoisyCalibrationFake(COST, clock=FakeClock()), store=False)
    model = p.model
    expected = heldout_predictions(p.samples, n_batch=model.n_batch, batched=model.per_batch_s > 0)
    assert len(p.residuals) == len(p.samples)
    assert [m for _, m in p.residuals] == pytest.approx([s.seconds for s in p.samples])
    assert [x for pair in p.residuals for x in pair] == pytest.approx([x for pair in expected for x in pair])
    assert any(abs(pred - meas) > 0.01 * meas for pred, meas in p.residuals)


def test_calibration_ratios_are_of_ttft_first_token_time_included():
    p = attrs.evolve(make_profile(first_token_s=0.1), residuals=((0.1, 0.3), (0.4, 0.4), (0.9, 0.5)))
    assert calibration_ratios(p) == pytest.approx([0.4 / 0.2, 1.0, 0.6 / 1.0])


def test_calibration_ratios_without_kept_residuals_compare_samples_with_the_model():
    samples = exact_samples(TRUE_MODEL, [(16, 0), (256, 0)])
    samples[1] = attrs.evolve(samples[1], seconds=samples[1].seconds * 2)
    p = make_profile(samples=samples, first_token_s=0.0)
    assert p.residuals == ()
    assert calibration_ratios(p) == pytest.approx([1.0, 2.0])


def test_a_new_engine_state_is_seeded_from_calibration():
    # 40 held-out residuals, measured 20 % over predicted at worst: enough for the 0.97 rank
    residuals = tuple((1.0, 1.0 + 0.2 * i / 39) for i in range(40))
    p = attrs.evolve(make_profile(first_token_s=0.0, p90_pct=5.0), residuals=residuals)
    state = EngineState(p)
    assert state.margin.ratios == pytest.approx([m for _, m in residuals])
    assert state.safety_margin() == pytest.approx(1 - 1 / 1.2)  # not the profile's 5 %


def test_too_few_calibration_samples_fall_back_to_the_profiles_rule():
    p = attrs.evolve(make_profile(p90_pct=12.0), residuals=tuple((1.0, 1.5) for _ in range(8)))  # a quick calibration
    assert EngineState(p).safety_margin() == pytest.approx(p.safety_margin) == pytest.approx(0.12)


def test_a_profile_round_trip_keeps_the_residuals(isolated_cache):
    p = attrs.evolve(make_profile(), residuals=((0.1, 0.12), (0.5, 0.45)))
    trimkit.profile_store.save_profile(p)
    assert trimkit.load_profile(p.key) == p


# -- which requests feed the window ------------------------------------------------------------------


def test_only_budgeted_requests_near_their_budget_or_over_it_feed_the_margin():
    state = EngineState(make_profile())
    seeded = len(state.margin)
    assert state.observe_ttft(0.9, 1.0, None) is False  # no budget: no operating point
    assert state.observe_ttft(0.2, 0.3, 1.0) is False  # far under the budget and met it
    assert state.observe_ttft(0.6, 0.7, 1.0) is True  # near the budget
    assert state.observe_ttft(0.2, 1.1, 1.0) is True  # a miss always counts
    assert state.observe_ttft(None, 1.0, 1.0) is False
    assert state.margin.ratios[seeded:] == pytest.approx((0.7 / 0.6, 1.1 / 0.2))


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

    from trimkit.planning import margin

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
        p = make_profile(key=trimkit.profile.ProfileKey(backend="openai_http", model="http://mock.test/v1|m", n_ctx=4096, n_batch=512))
        assert engine_state(a, p) is engine_state(b, p) is not engine_state(c, p)
    finally:
        for x in (a, b, c):
            x.close()


def test_a_second_wrap_starts_from_the_first_wraps_drift_and_margin(fake, profile):
    first = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)  # requests predicted at ≥ half of it
    fake.cost_model = scaled(COST, 1.3)
    for i in range(4):
        ask(first, i)
    assert first.profile.drift == pytest.approx(1.3, rel=0.01)
    second = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    assert second.profile.drift == pytest.approx(1.3, rel=0.01)
    assert second.engine.margin.ratios == first.engine.margin.ratios
    assert len(second.engine.margin) > len(calibration_ratios(profile))
    assert second.safety_margin == first.safety_margin
    assert abs(ask(second, 9).ttft_error_pct) < 1.0  # already predicts the slower speed


# -- following the host's speed ---------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [1.3, 1 / 1.3], ids=["30%-slower", "30%-faster"])
def test_a_30_percent_change_of_speed_is_followed_within_3_requests(fake, profile, factor):
    t = Trimmer(fake, ttft_budget_s=3.0, profile=profile, clock=fake.clock)
    assert abs(ask(t, 0).ttft_error_pct) < 1.0
    fake.cost_model = scaled(COST, factor)
    reports = [ask(t, i) for i in range(1, 5)]
    assert abs(reports[0].ttft_error_pct) > 15  # the change itself was not predicted
    assert t.profile.drift == pytest.approx(factor, rel=0.02)
    assert abs(reports[3].ttft_error_pct) < 5.0  # the 4th request after the change is predicted right


def test_one_outlier_does_not_move_the_drift(fake, profile):
    t = Trimmer(fake, ttft_budget_s=3.0, profile=profile, clock=fake.clock)
    for i in range(5):
        ask(t, i)
    fake.cost_model = scaled(COST, 3.0)  # one request hit by a hiccup on the host
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

    def send(self, messages, params, *, prompt_tokens=None):
        self.cost_model = scaled(self.base, self.rng.uniform(*self.spread))
        return super().send(messages, params, prompt_tokens=prompt_tokens)


def run_requests(spread, n):
    fake = NoisyFake(COST, clock=FakeClock(), spread=spread, seed=3)
    profile = trimkit.calibrate(fake, store=False)
    t = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    reports = [ask(t, i) for i in range(n)]
    return t, reports


def test_the_margin_narrows_on_a_steady_host_and_widens_on_a_noisy_one(isolated_cache):
    steady, reports = run_requests((1.0, 1.0), 24)
    assert all(r.ttft_budget_s for r in reports)
    # 11 calibration ratios (the larger half) + 24 requests, all exact: the conformal rank exists
    # and the margin is the floor
    assert steady.safety_margin == pytest.approx(MARGIN_FLOOR)
    assert steady.safety_margin < steady.profile.safety_margin
    noisy, _ = run_requests((0.85, 1.35), 60)
    ratios = noisy.engine.margin.ratios
    assert noisy.safety_margin > 0.15
    assert noisy.safety_margin == pytest.approx(margin_for_ratio(conformal_quantile(ratios, 0.97)))


def test_the_attainment_target_picks_the_quantile(isolated_cache):
    fake = NoisyFake(COST, clock=FakeClock(), spread=(0.85, 1.35), seed=3)
    profile = trimkit.calibrate(fake, store=False)
    strict = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    for i in range(60):
        ask(strict, i)
    loose = Trimmer(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock, attainment_target=0.8)
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


def test_small_calibration_probes_do_not_seed_the_window():
    """A 16-token probe is mostly fixed overhead and jitter: it says nothing of a budgeted request."""
    residuals = ((0.01, 0.03), (0.02, 0.05), (0.04, 0.09), (0.5, 0.51), (1.0, 1.02), (2.0, 1.96))
    p = attrs.evolve(make_profile(first_token_s=0.0), residuals=residuals)
    assert calibration_ratios(p) == pytest.approx([0.51 / 0.5, 1.02, 0.98])
