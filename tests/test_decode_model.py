"""The decode-vs-context model (trimkit/planning/profile.py): the line, its clamps, its level from
served requests, its noise; and the profile's interface to it (decode_tokens_per_s_at)."""

from __future__ import annotations

import json
import math

import attrs
import pytest

from tests._core_helpers import make_profile
from trimkit.errors import InvalidInputError, InvalidNumberError, ProfileError
from trimkit.planning.profile import FLAT_NOTE, LEGACY_DECODE_CONTEXT_TOKENS, WITHIN_NOISE_NOTE, DecodeModel, DecodePoint, Profile, fit_decode, mean_context
from trimkit.planning.speed import LiveProfile

#: a small model on a CPU: 60 ms a token with an empty cache, +12 µs per token of context
BASE, SLOPE = 0.060, 12e-6


def speed(context: float) -> float:
    return 1.0 / (BASE + SLOPE * context)


def points(*contexts: float, source: str = "calibration", factor: float = 1.0) -> list[DecodePoint]:
    return [DecodePoint(c, speed(c) / factor, 5, source) for c in contexts]


# -- the line -----------------------------------------------------------------------------------


def test_two_points_give_the_exact_line():
    model = fit_decode(points(0, 1536))
    assert model.base_s == pytest.approx(BASE) and model.per_context_s == pytest.approx(SLOPE)
    assert model.context_dependent and model.note == "" and model.context_range == (0.0, 1536.0)
    assert model.tokens_per_s_at(6000) == pytest.approx(speed(6000))


def test_more_points_on_a_line_recover_it():
    model = fit_decode(points(0, 300, 900, 2000, 4000))
    assert model.base_s == pytest.approx(BASE) and model.per_context_s == pytest.approx(SLOPE)


def test_the_fit_is_on_relative_error():
    """A point 10 % off weighs as much at a slow (long) context as at a fast one: the line passes
    between a fast point measured 10 % slow and a slow one measured 10 % fast, not near either."""
    noisy = [DecodePoint(0, speed(0) / 1.1), DecodePoint(0, speed(0) * 1.1), DecodePoint(4000, speed(4000) / 1.1), DecodePoint(4000, speed(4000) * 1.1)]
    model = fit_decode(noisy)
    for c in (0, 4000):
        assert model.tokens_per_s_at(c) == pytest.approx(speed(c), rel=0.02)


def test_one_context_is_flat_and_says_so():
    model = fit_decode(points(512, 512))
    assert model.per_context_s == 0.0 and model.note == FLAT_NOTE and not model.context_dependent
    assert model.tokens_per_s_at(0) == model.tokens_per_s_at(6000) == pytest.approx(speed(512))


def test_a_slope_below_zero_is_clamped_to_flat():
    """A decode step never gets cheaper with more context: a falling fit is noise."""
    model = fit_decode([DecodePoint(0, 15.0), DecodePoint(2000, 16.0)])
    assert model.per_context_s == 0.0 and not model.context_dependent and model.note == ""
    assert 15.0 < model.tokens_per_s_at(1000) < 16.0


def test_a_line_through_zero_seconds_is_taken_as_flat():
    """Only wild noise fits a line reaching 0 s per token with no context: no infinite speed."""
    model = fit_decode([DecodePoint(100, 100.0), DecodePoint(110, 10.0)])
    assert model.per_context_s == 0.0 and math.isfinite(model.tokens_per_s_at(0))


def test_a_slowdown_within_the_noise_is_not_extrapolated():
    """Two back-to-back points 144 tokens apart, each the median of 8 steps spread ±5 %: the
    2.5 % slowdown between them is within their noise, and extrapolated 40× it would predict a
    slowdown no measurement showed. The same slowdown measured with ±0.5 % steps is a slope."""
    def pair(spread):
        return [attrs.evolve(p, steps=8, spread_pct=spread) for p in points(144, 0)]

    noisy = fit_decode(pair(5.0))
    assert noisy.per_context_s == 0.0 and noisy.note == WITHIN_NOISE_NOTE and not noisy.context_dependent
    assert speed(144) < noisy.tokens_per_s_at(6000) < speed(0)
    steady = fit_decode(pair(0.5))
    assert steady.per_context_s == pytest.approx(SLOPE) and steady.note == ""
    # far apart, the same ±5 % steps measure the slope
    assert fit_decode([attrs.evolve(p, steps=8, spread_pct=5.0) for p in points(2048, 0)]).per_context_s == pytest.approx(SLOPE)


def test_no_points_no_model():
    assert fit_decode([]) is None


def test_mean_context_of_a_stream():
    """N output tokens time N-1 steps at positions P … P+N-2."""
    assert mean_context(1000, 32) == 1015.0
    assert mean_context(1000, 1) == mean_context(1000, 0) == 1000.0
    model = fit_decode(points(0, 1536))
    # the stream's measured speed is 1 / the step time at its mean context
    steps = [model.step_s(1000 + i) for i in range(31)]
    assert model.tokens_per_s_at(1000, 32) == pytest.approx(31 / sum(steps))


# -- the level from served requests -------------------------------------------------------------


def test_served_requests_set_the_level_and_keep_the_shape():
    """A host 30 % slower than calibration saw: the latest live points scale the whole line."""
    model = fit_decode(points(0, 1536) + points(300, 800, 1200, 500, 900, source="live", factor=1.3))
    for c in (0, 3000, 6000):
        assert model.tokens_per_s_at(c) == pytest.approx(speed(c) / 1.3, rel=0.03)


def test_only_the_latest_live_points_set_the_level():
    old = points(300, 400, 500, 600, 700, source="live", factor=2.0)
    new = points(300, 400, 500, 600, 700, source="live", factor=1.0)
    model = fit_decode(points(0, 1536) + old + new)
    assert model.tokens_per_s_at(500) == pytest.approx(speed(500), rel=0.15)


def test_noise_is_the_step_spread_or_the_live_deviation():
    steady = [DecodePoint.of_steps(0, [0.060, 0.061, 0.059, 0.060, 0.062]), DecodePoint.of_steps(1000, [0.072] * 5)]
    assert steady[0].tokens_per_s == pytest.approx(1 / 0.060) and steady[0].spread_pct == pytest.approx(0.001 / 0.060 * 100)
    assert fit_decode(steady).noise_pct == pytest.approx((steady[0].spread_pct + 0.0) / 2)  # the median over the points
    assert fit_decode(points(0, 1000)).noise_pct is None  # not timed step by step: unknown
    factors = (1.1, 0.9, 1.05, 0.95, 1.0)
    jittery = points(0, 1536) + [DecodePoint(c, speed(c) * f, 20, "live") for c, f in zip((200, 400, 600, 800, 1000), factors, strict=True)]
    assert fit_decode(jittery).noise_pct == pytest.approx(5.0, abs=1.5)
    assert fit_decode(jittery[:-1]).noise_pct is None  # fewer live points than the window: not yet


def test_points_refuse_bad_numbers():
    for bad in (dict(context_tokens=-1, tokens_per_s=10.0), dict(context_tokens=0, tokens_per_s=0.0),
                dict(context_tokens=0, tokens_per_s=math.inf), dict(context_tokens=0, tokens_per_s=10.0, steps=0),
                dict(context_tokens=0, tokens_per_s=10.0, source="guess"), dict(context_tokens=True, tokens_per_s=10.0)):
        with pytest.raises(InvalidInputError):
            DecodePoint(**bad)
    with pytest.raises(InvalidInputError):
        DecodePoint.of_steps(0, [0.0, -1.0])


# -- the profile's interface --------------------------------------------------------------------


def test_profile_predicts_decode_at_a_context():
    p = attrs.evolve(make_profile(), decode_points=tuple(points(0, 1536)))
    assert p.decode_tokens_per_s_at(0) == pytest.approx(speed(0))
    assert p.decode_tokens_per_s_at(4944) == pytest.approx(speed(4944))
    assert p.decode_tokens_per_s_at(4944, output_tokens=32) == pytest.approx(1 / DecodeModel(BASE, SLOPE).step_s(4959))
    assert p.decode_model().context_dependent


def test_profile_without_a_decode_measurement_predicts_none():
    p = attrs.evolve(make_profile(decode_tokens_per_s=0.0), decode_points=())
    assert p.decode_tokens_per_s_at(100) is None and p.decode_model() is None and p.decode_noise_pct is None


def test_a_profile_made_without_points_has_its_decode_speed_as_one_flat_point():
    p = make_profile(decode_tokens_per_s=25.0)
    assert p.decode_points == (DecodePoint(LEGACY_DECODE_CONTEXT_TOKENS, 25.0),)
    assert p.decode_tokens_per_s_at(0) == p.decode_tokens_per_s_at(6000) == pytest.approx(25.0)
    assert p.decode_model().note == FLAT_NOTE


@pytest.mark.parametrize("bad", [-1, 1.5, "100", None, True])
def test_profile_refuses_a_bad_context(bad):
    with pytest.raises(InvalidNumberError):
        make_profile().decode_tokens_per_s_at(bad)


def test_decode_points_round_trip_through_a_stored_file():
    pts = (DecodePoint.of_steps(0, [0.06, 0.061, 0.059]), DecodePoint(1536.0, 14.2, 5), DecodePoint(800.5, 15.0, 31, "live"))
    p = attrs.evolve(make_profile(), decode_points=pts)
    loaded = Profile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert loaded == p and loaded.decode_points == pts


def test_a_file_stored_before_decode_points_loads_with_one_flat_point():
    data = make_profile(decode_tokens_per_s=21.0).to_dict()
    del data["decode_points"]
    loaded = Profile.from_dict(data)
    assert loaded.decode_points == (DecodePoint(LEGACY_DECODE_CONTEXT_TOKENS, 21.0),)
    assert loaded.decode_tokens_per_s_at(3000) == pytest.approx(21.0)


@pytest.mark.parametrize("edit, names", [
    (lambda d: d.update(decode_points={"a": 1}), "decode_points must be a list"),
    (lambda d: d.update(decode_points=[[0, 10.0]]), "decode_points[0]"),
    (lambda d: d.update(decode_points=[{"tokens_per_s": 10.0}]), "decode_points[0].context_tokens"),
    (lambda d: d.update(decode_points=[{"context_tokens": 0, "tokens_per_s": -1.0}]), "decode_points[0]"),
    (lambda d: d.update(decode_points=[{"context_tokens": 0, "tokens_per_s": 9.0, "steps": 2.5}]), "decode_points[0].steps"),
    (lambda d: d.update(decode_points=[{"context_tokens": 0, "tokens_per_s": 9.0, "source": "guess"}]), "decode_points[0]"),
    (lambda d: d.update(decode_points=[{"context_tokens": 0, "tokens_per_s": 9.0, "spread_pct": "low"}]), "decode_points[0].spread_pct"),
])
def test_a_bad_decode_point_in_a_file_is_a_profile_error_naming_it(edit, names):
    data = make_profile().to_dict()
    edit(data)
    with pytest.raises(ProfileError, match=names.replace("[", r"\[").replace("]", r"\]")):
        Profile.from_dict(data)


# -- learning from served requests --------------------------------------------------------------


def test_live_profile_learns_the_line_from_served_requests():
    """Calibration measured one context only (flat); served requests at several contexts teach
    the slope, and the live profile predicts it."""
    live = LiveProfile(attrs.evolve(make_profile(), decode_points=(DecodePoint(0, speed(0), 5),)))
    assert live.current.decode_tokens_per_s_at(4000) == pytest.approx(speed(0))
    for prompt in (200, 1800, 3500, 900, 2600):
        live.observe_decode(1.0 / DecodeModel(BASE, SLOPE).step_s(mean_context(prompt, 32)), 32, prompt)
    assert live.current.decode_tokens_per_s_at(4000) == pytest.approx(speed(4000), rel=0.02)
    assert [p.source for p in live.current.decode_points] == ["calibration"] + ["live"] * 5


def test_live_decode_points_are_bounded():
    from trimkit.planning.speed import KEEP_DECODE_POINTS

    live = LiveProfile(attrs.evolve(make_profile(), decode_points=tuple(points(0, 1536))))
    for i in range(KEEP_DECODE_POINTS + 10):
        live.observe_decode(speed(100 + i), 16, 100 + i)
    assert sum(p.source == "live" for p in live.current.decode_points) == KEEP_DECODE_POINTS
    assert [p.context_tokens for p in live.current.decode_points[:2]] == [0.0, 1536.0]


def test_a_request_without_its_context_is_a_point_at_an_empty_context():
    """One decode estimate: the line, whose latest points set its level; a request that does not
    say its context counts as one at context 0 (never a bad count)."""
    live = LiveProfile(attrs.evolve(make_profile(), decode_points=tuple(points(0, 1536))))
    for _ in range(3):
        live.observe_decode(10.0, 16)
    assert live.current.decode_tokens_per_s == pytest.approx(10.0, rel=0.01)
    assert all(p.context_tokens == 0 for p in live.current.decode_points if p.source == "live")
    for bad in (-1, 2.5, "100", True):
        live.observe_decode(12.0, 16, bad)
    assert sum(p.source == "live" for p in live.current.decode_points) == 7


def test_a_stored_profile_keeps_what_served_requests_taught():
    """The refined profile is stored with its live points; the next process's live profile starts
    from them instead of dropping them at its first request."""
    live = LiveProfile(attrs.evolve(make_profile(), decode_points=tuple(points(0))))
    for prompt in (500, 3000):
        live.observe_decode(speed(mean_context(prompt, 16)), 16, prompt)
    stored = Profile.from_dict(json.loads(json.dumps(live.current.to_dict())))
    again = LiveProfile(stored)
    again.observe_decode(speed(mean_context(1500, 16)), 16, 1500)
    assert [p.context_tokens for p in again.current.decode_points] == [0.0, mean_context(500, 16), mean_context(3000, 16), mean_context(1500, 16)]
