"""The first run: wrap() serves after a micro-calibration, says when its profile is provisional,
plans a prompt beyond the probed range with a wider margin and says so, and the provisional
profile learns from every measured request. On the deterministic fake backend."""

from __future__ import annotations

import attrs
import pytest

import trimkit
from tests._core_helpers import make_measurement, make_profile
from trimkit._calibration import load_profile
from trimkit.errors import InvalidInputError
from trimkit.planning.costs import CostModel, PrefillSample, fit_cost_model
from trimkit.planning.speed import MARGIN_CAP, MARGIN_FLOOR, EngineState, LiveProfile, margin_for_ratio
from trimkit.report import Report
from trimkit.testing import FakeBackend, FakeClock
from trimkit.wrapper import Trimmer

COST = CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-7)
WORDS = "the harbour lamp keeper rows out at dawn and counts the fishing boats along the quay".split()


def text(n_words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i + seed) % len(WORDS)] for i in range(n_words))


def fake(**kwargs) -> FakeBackend:
    return FakeBackend(kwargs.pop("cost", COST), clock=FakeClock(), **kwargs)


def ask(t: Trimmer, words: int, seed: int = 0, chunks=None, budget=None) -> Report:
    """One cold request (the fake's KV cache emptied first); its report."""
    with t.backend.lock:
        t.backend.kv = []
    t.create_chat_completion(messages=[{"role": "user", "content": text(words, seed)}], rag_chunks=chunks, max_tokens=2,
                             ttft_budget_s=budget)
    return t.last_report


def provisional(profile):
    return attrs.evolve(profile, mode="micro")


# -- wrap() without a profile -------------------------------------------------------------------------


def test_wrap_without_a_profile_serves_after_a_micro_calibration(isolated_cache):
    engine = fake()
    chat = trimkit.wrap(engine, ttft_budget_s=1.0)
    assert chat.profile.mode == "micro" and chat.profile.provisional
    assert chat.profile.calibration_wall_s <= 3.0 + 1e-9
    chat.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.last_report.provisional
    assert load_profile(engine.profile_key()).mode == "micro"  # stored and keyed as before


@pytest.mark.parametrize("stored_mode", ["micro", "quick", "full"])
def test_wrap_uses_a_stored_profile_of_any_mode_without_measuring(isolated_cache, stored_mode):
    stored = trimkit.calibrate(fake(), mode=stored_mode)
    engine = fake()
    before = engine.clock()
    chat = trimkit.wrap(engine, ttft_budget_s=1.0)
    assert engine.clock() == before  # nothing was measured: the fake clock moves only when it works
    assert chat.profile.created_at == stored.created_at and chat.profile.mode == stored_mode


@pytest.mark.parametrize(
    ("kwargs", "mode"),
    [({}, "micro"), ({"calibration": "quick"}, "quick"), ({"calibration": "full"}, "full")],
)
def test_the_calibration_up_front_can_be_chosen(isolated_cache, kwargs, mode):
    engine = fake()
    assert Trimmer(engine, clock=engine.clock, **kwargs).profile.mode == mode


@pytest.mark.parametrize("kwargs", [{"calibration": "slow"}, {"calibration": True}])
def test_a_bad_calibration_choice_is_invalid_input(isolated_cache, kwargs):
    with pytest.raises(InvalidInputError):
        Trimmer(fake(), **kwargs)


# -- the wider margin -----------------------------------------------------------------------------------


def widened(base: float, x: float) -> float:
    """The margin for a prompt ``x`` times beyond the probed range: the spread's ratio taken x times."""
    return margin_for_ratio(1 + x * (1 / (1 - base) - 1), cap=MARGIN_CAP)


def test_the_extrapolation_rule_takes_the_spread_x_times():
    state = EngineState(make_profile(p90_pct=5.0))  # exact seed: the spread is the floor
    base = state.safety_margin()
    assert base == pytest.approx(MARGIN_FLOOR)
    assert state.safety_margin(extrapolation=3.0) == pytest.approx(widened(base, 3.0))
    assert state.safety_margin(extrapolation=1e9) == MARGIN_CAP
    assert state.safety_margin(extrapolation=float("nan")) == base


def test_a_provisional_profile_is_reported_and_planned_with_the_one_estimates_margin(isolated_cache):
    full = trimkit.calibrate(fake(), store=False)
    a, b = fake(), fake()
    steady = Trimmer(a, ttft_budget_s=1.0, profile=full, clock=a.clock)
    early = Trimmer(b, ttft_budget_s=1.0, profile=provisional(full), clock=b.clock)
    assert early.safety_margin == steady.safety_margin  # no separate widening: the spread measured decides
    report = ask(early, 300)
    assert report.provisional and not report.extrapolated
    assert "provisional" in str(report)
    assert "profile=provisional" in report.log_line()
    assert report.to_dict()["provisional"] is True and report.to_dict()["extrapolated"] is False
    plain = ask(steady, 300)
    assert not plain.provisional and "profile " not in str(plain) and "profile=" not in plain.log_line()


def narrow(profile, top: int):
    """``profile`` as if it had probed nothing beyond ``top`` tokens (same, exact model)."""
    kept = tuple(s for s in profile.samples if s.new_tokens + s.cached_tokens <= top)
    return attrs.evolve(profile, samples=kept, probed_new_tokens=top, probed_context_tokens=top)


def test_a_prompt_beyond_the_probed_range_is_reported_and_gets_a_wider_margin(isolated_cache):
    engine = fake()
    profile = narrow(trimkit.calibrate(fake(), store=False), 256)
    t = Trimmer(engine, ttft_budget_s=10.0, profile=profile, clock=engine.clock)
    short = ask(t, 60)
    assert not short.extrapolated and short.safety_margin == pytest.approx(MARGIN_FLOOR)
    long = ask(t, 900)
    assert long.passthrough and long.extrapolated and "extrapolated" in str(long) and "profile=extrapolated" in long.log_line()
    assert "wider safety margin" in str(long)
    x = profile.extrapolation(long.prompt_tokens, 0)
    assert x > 3
    # a watched prompt holds back only its share after the last step, and that share's spread x times
    share = min(1.0, 512 / long.prompt_tokens)
    base = t.engine.speed.margin(profile.model, fallback=profile.safety_margin, share=share)
    assert long.safety_margin == pytest.approx(widened(base, x))


def test_a_budget_that_keeps_the_prompt_in_range_needs_no_extrapolation_margin(isolated_cache):
    engine = fake()
    profile = narrow(trimkit.calibrate(fake(), store=False), 256)
    t = Trimmer(engine, ttft_budget_s=0.4, profile=profile, clock=engine.clock)
    chunks = [trimkit.Chunk(text=text(80, i), id=f"doc-{i}") for i in range(10)]
    report = ask(t, 10, chunks=chunks)
    assert report.trimmed and report.prompt_tokens_before > 256 >= report.prompt_tokens
    assert not report.extrapolated and report.safety_margin < 0.03


# -- learning from every measured request ------------------------------------------------------------------

TRUE = CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-6)


def micro_guess() -> tuple:
    """A provisional profile as a micro-calibration on a noisy host leaves it: four short probes of
    ``TRUE`` timed 15-20 % off, and the model fitted on them."""
    noisy = [PrefillSample(n, 0, TRUE.prefill_s(n, 0) * f) for n, f in ((32, 1.15), (64, 0.85), (128, 1.2), (256, 0.8))]
    model = fit_cost_model(noisy, n_batch=512)
    profile = attrs.evolve(make_profile(model=model, samples=noisy, first_token_s=0.02, p90_pct=15.0), mode="micro",
                           probed_new_tokens=256, probed_context_tokens=256)
    return profile


def apes(reports) -> list[float]:
    return [abs(r.ttft_error_pct) for r in reports]


def test_a_provisional_profile_learns_fast_from_measured_requests(isolated_cache):
    engine = fake(cost=TRUE, first_token_s=0.02)
    t = Trimmer(engine, profile=micro_guess(), clock=engine.clock)
    reports = [ask(t, words, seed=i) for i, words in enumerate([700, 1100, 500, 900, 1200, 600, 1000, 800])]
    early, late = apes(reports[:2]), apes(reports[-3:])
    assert max(early) > 10  # the micro-probes did not see these lengths
    assert max(late) < 5 and sum(late) / 3 < sum(early) / 2 / 4
    assert reports[0].extrapolated and not reports[-1].extrapolated  # the measured lengths joined the range
    assert t.profile.probed_range()[0] >= max(r.evaluated_tokens for r in reports)


def test_every_profile_refits_from_its_first_requests_unless_told_to_wait():
    """By default a profile refits on each measured request (a shape its calibration got wrong is
    corrected at once); ``refit_every`` spaces the refits."""
    guess = micro_guess()
    full = attrs.evolve(guess, mode="full")
    fast, default, slow = LiveProfile(guess), LiveProfile(full), LiveProfile(full, refit_every=16)
    for n in (700, 1100, 500):
        for live in (fast, default, slow):
            live.observe(n, 0, TRUE.prefill_s(n, 0))
    assert fast.current.model != guess.model
    assert default.current.model != full.model
    assert default.current.predict_prefill_s(900) == pytest.approx(TRUE.prefill_s(900), rel=0.08)
    assert abs(fast.current.predict_prefill_s(900) / TRUE.prefill_s(900) - 1) < abs(guess.predict_prefill_s(900) / TRUE.prefill_s(900) - 1)
    assert slow.current.model == full.model  # the speed factor only, until the 16th observation


def test_the_provisional_profile_is_stored_every_few_requests(isolated_cache):
    engine = fake(cost=TRUE, first_token_s=0.02)
    guess = attrs.evolve(micro_guess(), key=engine.profile_key())
    t = Trimmer(engine, profile=guess, clock=engine.clock)
    for i in range(4):
        ask(t, 600 + 100 * i, seed=i)
    stored = load_profile(engine.profile_key())
    assert stored is not None and stored.provisional and stored.model == t.profile.model != guess.model


def test_a_report_without_the_flags_reads_as_before():
    report = Report(backend="fake", measurement=make_measurement(), prompt_tokens=700, predicted_ttft_s=1.0)
    assert not report.provisional and not report.extrapolated
    assert "profile " not in str(report) and "profile=" not in report.log_line()


def test_decode_speed_is_learned_from_measured_requests():
    """Calibration measures decode over a few steps (or estimates it on a very slow host); the
    profile's one decode speed follows what requests measure: the decode-vs-context line, whose
    latest points set its level, at the latest request's context."""
    live = LiveProfile(make_profile())
    calibrated = live.current.decode_tokens_per_s
    for tps in (30.0, 31.0, 29.0):
        live.observe_decode(tps, 16)
    assert live.current.decode_tokens_per_s == pytest.approx(30.0, rel=0.01) and calibrated != pytest.approx(30.0, rel=0.1)
    live.observe_decode(1000.0, 2)  # too few tokens to say anything
    live.observe_decode(float("nan"), 16)
    live.observe_decode(True, 16)
    live.observe_decode(-5.0, 16)
    assert live.current.decode_tokens_per_s == pytest.approx(30.0, rel=0.01)


def test_a_wrapped_request_teaches_the_decode_speed(isolated_cache):
    t = trimkit.wrap(fake(), profile=attrs.evolve(make_profile(), decode_tokens_per_s=0.5))
    t.create_chat_completion(messages=[{"role": "user", "content": text(20)}], max_tokens=12)
    measured = t.last_report.measurement.decode_tokens_per_s
    assert measured is not None and measured > 0
    assert t.profile.decode_tokens_per_s == pytest.approx(measured)


def test_a_wrapped_request_is_a_point_of_the_decode_line_at_its_context(isolated_cache):
    """Each served request's stream is a decode point at its mean context (prompt + (output − 2) / 2)."""
    t = trimkit.wrap(fake(), profile=make_profile())
    t.create_chat_completion(messages=[{"role": "user", "content": text(60)}], max_tokens=12)
    m = t.last_report.measurement
    live = [p for p in t.profile.decode_points if p.source == "live"]
    assert len(live) == 1 and live[0].context_tokens == m.prompt_tokens + (m.completion_tokens - 2) / 2
    assert live[0].tokens_per_s == pytest.approx(m.decode_tokens_per_s) and live[0].steps == m.completion_tokens - 1
    assert t.profile.decode_tokens_per_s_at(m.prompt_tokens, output_tokens=m.completion_tokens) is not None


def test_the_first_token_overheads_growth_with_the_prompt_is_learned_from_requests():
    """Requests of many lengths: the overhead's per-prompt-token part (tokenizing the whole
    conversation) and its fixed part are both learned, one slow request barely moves them, and
    short follow-ups after a long conversation are predicted with what tokenizing it costs."""
    live = LiveProfile(attrs.evolve(make_profile(), first_token_s=0.001))
    lengths = [120, 2400, 300, 1800, 60, 3100, 900, 1500]
    for i, n in enumerate(lengths):
        overhead = 0.004 + 8e-6 * n + (0.05 if i == 3 else 0.0002 * (i % 2))  # request 4 a slow one
        live.observe_first_token(0.5 + overhead, 0.5, n)
    p = live.current
    assert p.first_token_per_token_s == pytest.approx(8e-6, rel=0.15)
    assert p.first_token_s == pytest.approx(0.004, abs=0.001)
    assert p.first_token_overhead_s(2500) == pytest.approx(0.024, rel=0.1)


def test_the_per_token_overhead_is_not_learned_from_lengths_close_together_or_unknown():
    start = attrs.evolve(make_profile(), first_token_s=0.001, first_token_per_token_s=5e-6)
    close = LiveProfile(start)
    for n, overhead in ((1000, 0.010), (1100, 0.019), (1050, 0.012), (1150, 0.011), (1020, 0.013)):
        close.observe_first_token(0.5 + overhead, 0.5, n)
    assert close.current.first_token_per_token_s == 5e-6  # jitter over 15 % of length says nothing of a slope
    unknown = LiveProfile(start)
    for overhead in (0.010, 0.012, 0.011):
        unknown.observe_first_token(0.5 + overhead, 0.5)  # a backend that does not count the prompt
    assert unknown.current.first_token_per_token_s == 5e-6 and unknown.current.first_token_s == pytest.approx(0.011)


def test_first_token_overhead_is_learned_from_measured_requests():
    """A micro-calibration may only estimate the first-token overhead; each request measures it
    (its TTFT less the engine's prefill) and the profile follows the median of recent ones."""
    live = LiveProfile(attrs.evolve(make_profile(), first_token_s=0.001))
    for ttft, prefill in ((0.30, 0.25), (0.42, 0.36), (0.20, 0.16)):
        live.observe_first_token(ttft, prefill)
    assert live.current.first_token_s == pytest.approx(0.05)
    for bad in ((None, 0.1), (0.1, None), (float("inf"), 0.1), (True, 0.1), (0.0, 0.1), (0.1, -1.0)):
        live.observe_first_token(*bad)
    assert live.current.first_token_s == pytest.approx(0.05)
    live.observe_first_token(0.10, 0.15)  # the engine's clock ran past the client's: no negative overhead
    assert live.current.first_token_s >= 0.0
