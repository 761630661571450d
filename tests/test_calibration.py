"""Calibration against the deterministic fake engine: the probe schedule, the fit, the store."""

from __future__ import annotations

import logging

import pytest

from trimkit._calibration import MIN_N_CTX, MODES, as_backend, calibrate, calibration_probes, load_profile, profile_path, schedule
from trimkit.errors import ContextTooSmallError, InvalidInputError
from trimkit.planning.costs import CostModel, PrefillSample
from trimkit.planning.profile import FLAT_NOTE
from trimkit.testing import FakeBackend

FAKE_MODEL = CostModel(overhead_s=0.01, per_token_s=0.0014, depth_s=1e-7)


class SpyBackend(FakeBackend):
    """The fake engine, recording every calibration call in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple] = []

    @property
    def prefill_calls(self) -> int:
        return sum(1 for e in self.events if e[0] == "prefill")

    def warm_up(self) -> None:
        self.events.append(("warm_up",))

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        self.events.append(("prefill", new_tokens, cached_tokens))
        return super().measure_prefill(new_tokens, cached_tokens)

    def measure_decode(self, n_tokens: int = 32) -> float:
        self.events.append(("decode", n_tokens))
        return super().measure_decode(n_tokens)



def fake(**kwargs) -> SpyBackend:
    kwargs.setdefault("first_token_s", 0.03)
    kwargs.setdefault("decode_tokens_per_s", 42.0)
    return SpyBackend(kwargs.pop("cost_model", FAKE_MODEL), **kwargs)


# -- the probe schedule -------------------------------------------------------------------------


@pytest.mark.parametrize("n_ctx", [0, 64, MIN_N_CTX - 1])
@pytest.mark.parametrize("mode", ["full", "quick"])
def test_probes_refuse_a_context_below_min_n_ctx(n_ctx, mode):
    with pytest.raises(ContextTooSmallError, match="n_ctx"):
        calibration_probes(n_ctx, mode=mode)


N_CTXS = [MIN_N_CTX, 200, 512, 1000, 2048, 4096, 8192, 131072]


@pytest.mark.parametrize("n_ctx", N_CTXS)
@pytest.mark.parametrize("mode", ["full", "quick"])
def test_no_probe_reaches_past_90_percent_of_the_context(n_ctx, mode):
    probes = calibration_probes(n_ctx, mode=mode)
    assert max(p.new_tokens + p.cached_tokens for p in probes) <= int(0.9 * n_ctx)


@pytest.mark.parametrize("n_ctx", N_CTXS)
@pytest.mark.parametrize("mode", ["full", "quick"])
def test_probes_are_distinct_and_include_depth_probes(n_ctx, mode):
    probes = calibration_probes(n_ctx, mode=mode)
    keys = [(p.new_tokens, p.cached_tokens) for p in probes]
    assert len(set(keys)) == len(keys)
    assert len(keys) >= 4  # enough for leave-one-probe-out cross-validation
    assert any(p.cached_tokens > 0 for p in probes)
    assert all(p.new_tokens >= 16 and p.repeats >= 1 for p in probes)


@pytest.mark.parametrize("n_ctx", N_CTXS)
@pytest.mark.parametrize(("mode", "longest"), [("micro", 1024), ("quick", 2048), ("full", 4096)])
def test_each_mode_caps_its_longest_cold_probe(n_ctx, mode, longest):
    assert max(p.new_tokens for p in calibration_probes(n_ctx, mode=mode)) <= longest


def test_a_large_context_is_probed_to_4096_cold_and_depth_probes_go_half_as_far_again():
    probes = calibration_probes(8192)
    assert max(p.new_tokens for p in probes if p.cached_tokens == 0) == 4096
    assert max(p.new_tokens + p.cached_tokens for p in probes) == 4096 + 2048 <= int(0.9 * 8192)
    # a smaller context caps the cold top (60 % of the usable context) and the depth probe with it
    assert max(p.new_tokens + p.cached_tokens for p in calibration_probes(4096)) == 2048 + 1024 <= int(0.9 * 4096)
    # more room does not make the cold probes longer
    assert [p for p in calibration_probes(131072) if not p.cached_tokens] == [p for p in probes if not p.cached_tokens]


def test_quick_schedule_is_cheaper_than_the_full_one():
    def tokens(probes):
        return sum(p.new_tokens * p.repeats for p in probes)

    assert tokens(calibration_probes(8192, mode="quick")) < tokens(calibration_probes(8192)) / 2


def test_short_probes_are_repeated_more_than_long_ones():
    probes = {p.new_tokens: p.repeats for p in calibration_probes(8192) if p.cached_tokens == 0}
    assert probes[16] > probes[2048]


# -- calibrate: the fit -------------------------------------------------------------------------


def test_calibrate_recovers_the_engines_cost_model(isolated_cache):
    profile = calibrate(fake())
    for name in ("overhead_s", "per_token_s", "depth_s"):
        assert getattr(profile.model, name) == pytest.approx(getattr(FAKE_MODEL, name), rel=0.01), name
    for n, k in ((1, 0), (300, 0), (3000, 0), (500, 3000)):
        assert profile.predict_prefill_s(n, k) == pytest.approx(FAKE_MODEL.prefill_s(n, k), rel=0.01)


def test_calibrate_held_out_error_is_zero_on_an_exact_engine(isolated_cache):
    profile = calibrate(fake())
    assert profile.error.n == len(profile.samples)
    assert profile.error.max_pct < 1e-6
    assert profile.safety_margin == pytest.approx(0.03)  # the floor


def test_calibrate_picks_the_batched_model_for_a_chunked_engine(isolated_cache):
    chunked = CostModel(overhead_s=0.01, per_token_s=0.0014, depth_s=1e-7, per_batch_s=0.05, n_batch=512)
    profile = calibrate(fake(cost_model=chunked))
    assert profile.model.name == "batched"
    assert profile.model.per_batch_s == pytest.approx(0.05, rel=0.01)
    assert profile.error.max_pct < 1e-6
    assert set(profile.alternatives) == {"design", "batched"}
    assert profile.alternatives["design"]["heldout_error"]["median_pct"] > 0.1


def test_calibrate_measures_decode_speed_and_first_token_time(isolated_cache):
    profile = calibrate(fake(first_token_s=0.03, decode_tokens_per_s=42.0))
    assert profile.decode_tokens_per_s == 42.0
    assert profile.first_token_s == 0.03
    assert profile.predict_ttft_s(100) == pytest.approx(FAKE_MODEL.prefill_s(100) + 0.03, rel=0.01)


def test_calibrate_measures_a_prefix_of_the_schedule_after_warming_up(isolated_cache):
    backend = fake(n_ctx=4096)
    profile = calibrate(backend)
    top = max(s.new_tokens for s in profile.samples if s.cached_tokens == 0)
    allowed = {(p.new_tokens, p.cached_tokens) for p in schedule(MODES["full"], top, 4096)} | {(16, 32)}
    measured = [e[1:] for e in backend.events if e[0] == "prefill" and e[1] > 1]  # one-token evaluations are decode steps
    assert set(measured) <= allowed
    assert measured[:3] == [(32, 0), (16, 32), (16, 0)]  # the speed, then the cheapest two: the minimum
    assert backend.events[0] == ("warm_up",)
    assert sorted((s.new_tokens, s.cached_tokens) for s in profile.samples) == sorted(measured)
    assert {s.source for s in profile.samples} == {"calibration"}
    # the depth probes run right after the longest cold probe, whose tokens are still cached
    first_deep = next(i for i, e in enumerate(measured) if e[1] == top)
    assert measured[first_deep - 1] == (top, 0)


def test_calibrate_measures_decode_after_the_deepest_context_then_an_empty_one(isolated_cache):
    """Decode steps (one-token evaluations) right after the depth probes, at the context they
    left cached, then at once at an empty context: back to back, so both see the host at the
    same speed. The profile's decode line goes through them."""
    backend = fake(n_ctx=4096)
    profile = calibrate(backend, mode="quick")
    events = [e for e in backend.events if e[0] == "prefill"]
    first_step = next(i for i, e in enumerate(events) if e[1] == 1)
    deep = events[first_step - 1][1] + events[first_step - 1][2]  # what the last depth probe left cached
    steps = MODES["quick"].decode_point_steps
    assert events[first_step - 1][2] > 0  # a depth probe
    assert events[first_step:first_step + 2 * steps] == [("prefill", 1, deep)] * steps + [("prefill", 1, 0)] * steps
    assert [(p.context_tokens, p.steps) for p in profile.decode_points] == [(deep, steps), (0.0, steps)]
    model = profile.decode_model()
    # the fake's decode step is its one-token prefill: the line is exact
    assert model.base_s == pytest.approx(FAKE_MODEL.prefill_s(1, 0)) and model.per_context_s == pytest.approx(FAKE_MODEL.depth_s)
    assert profile.decode_tokens_per_s_at(3000) == pytest.approx(1 / FAKE_MODEL.prefill_s(1, 3000))
    assert profile.decode_tokens_per_s == 42.0  # the decode probe's own speed, as before


def test_a_server_calibration_has_its_decode_speed_as_one_flat_point(isolated_cache):
    """A server's decode step would resend its whole context: no decode points are measured, the
    decode probe's speed stands for every context (the line is learned from served requests)."""
    backend = fake(n_ctx=4096)
    backend.depth_probe_keeps_prefix = False
    profile = calibrate(backend, mode="quick")
    assert not [e for e in backend.events if e[0] == "prefill" and e[1] == 1]
    assert profile.decode_model().note == FLAT_NOTE
    assert profile.decode_tokens_per_s_at(3000) == profile.decode_tokens_per_s_at(0) == pytest.approx(42.0)


def test_a_decode_speed_only_estimated_predicts_none(isolated_cache):
    profile = calibrate(fake(n_ctx=4096), mode="quick", time_budget_s=0.05)  # the minimum only: decode estimated
    assert profile.decode_tokens_per_s > 0 and profile.decode_points == ()
    assert profile.decode_tokens_per_s_at(100) is None


def test_calibrate_profile_carries_the_backends_key_and_the_quick_flag(isolated_cache):
    backend = fake()
    assert calibrate(backend, mode="quick", store=False).key == backend.profile_key()
    assert (calibrate(backend, mode="quick", store=False).mode != "full")
    assert (calibrate(backend, store=False).mode == "full")


def test_calibrate_times_itself_with_the_backends_clock(isolated_cache):
    backend = fake()
    before = backend.clock()
    profile = calibrate(backend)
    assert profile.calibration_wall_s == pytest.approx(backend.clock() - before)
    assert profile.calibration_wall_s >= sum(s.seconds for s in profile.samples)
    assert profile.calibration_wall_s <= profile.time_budget_s == 30.0


def test_an_injected_clock_replaces_the_backends(isolated_cache):
    ticks = iter(range(0, 10_000, 1))  # one second a reading: the budget runs out after the minimum
    profile = calibrate(fake(), time_budget_s=5.0, store=False, clock=lambda: float(next(ticks)))
    assert profile.time_budget_s == 5.0
    assert len(profile.samples) >= 3


def test_calibrate_in_the_smallest_context_works(isolated_cache):
    profile = calibrate(fake(n_ctx=MIN_N_CTX), mode="quick")
    assert profile.model.per_token_s == pytest.approx(FAKE_MODEL.per_token_s, rel=0.01)


def test_calibrate_refuses_a_context_too_small(isolated_cache):
    with pytest.raises(ContextTooSmallError):
        calibrate(fake(n_ctx=MIN_N_CTX - 1))
    assert not (isolated_cache / "profiles").exists()


# -- calibrate: the store -----------------------------------------------------------------------


def test_calibrate_stores_the_profile(isolated_cache):
    backend = fake()
    profile = calibrate(backend)
    assert profile_path(backend.profile_key()).is_file()
    assert load_profile(backend.profile_key()) == profile


def test_calibrate_without_store_writes_nothing(isolated_cache):
    calibrate(fake(), store=False)
    assert not (isolated_cache / "profiles").exists()


def test_a_second_calibrate_reuses_the_stored_profile_without_measuring(isolated_cache):
    first = calibrate(fake())
    again = fake()
    assert calibrate(again) == first
    assert again.events == []


def test_a_different_configuration_is_calibrated_afresh(isolated_cache):
    calibrate(fake(n_ctx=4096))
    other = fake(n_ctx=8192)
    assert calibrate(other).key.n_ctx == 8192
    assert other.prefill_calls > 0


def test_recalibrate_measures_again_and_replaces_the_stored_profile(isolated_cache):
    calibrate(fake())
    slower = fake(cost_model=CostModel(overhead_s=0.02, per_token_s=0.0028, depth_s=2e-7))
    profile = calibrate(slower, recalibrate=True)
    assert slower.prefill_calls > 0
    assert profile.model.per_token_s == pytest.approx(0.0028, rel=0.01)
    assert load_profile(slower.profile_key()) == profile


def test_a_stored_quick_profile_does_not_satisfy_a_full_calibration(isolated_cache):
    calibrate(fake(), mode="quick")
    backend = fake()
    profile = calibrate(backend)
    assert backend.prefill_calls > 0
    assert (profile.mode == "full")
    assert (load_profile(backend.profile_key()).mode == "full")


def test_a_stored_full_profile_satisfies_a_quick_calibration(isolated_cache):
    full = calibrate(fake())
    backend = fake()
    assert calibrate(backend, mode="quick") == full
    assert backend.events == []


def test_a_corrupt_stored_profile_is_measured_again_with_a_warning(isolated_cache, caplog):
    backend = fake()
    path = profile_path(backend.profile_key())
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": 1, "key": {"backend": "fa')
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        profile = calibrate(backend)
    assert backend.prefill_calls > 0
    assert any(r.levelno == logging.WARNING and r.name == "trimkit" for r in caplog.records)
    assert load_profile(backend.profile_key()) == profile


# -- progress and targets -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["micro", "quick", "full"])
def test_progress_counts_up_to_the_total(isolated_cache, mode):
    calls: list[tuple[int, int, str]] = []
    calibrate(fake(), mode=mode, progress=lambda done, total, label: calls.append((done, total, label)))
    dones = [c[0] for c in calls]
    assert dones == sorted(dones) and dones[0] == 1 and len(set(dones)) >= len(dones) - 1  # the last may say "calibrated"
    assert all(done <= total for done, total, _ in calls)  # the total is the current plan: it may change
    assert calls[-1][0] == calls[-1][1]
    assert all(isinstance(c[2], str) and c[2] for c in calls)


def test_progress_is_not_called_for_a_stored_profile(isolated_cache):
    calibrate(fake())
    calls = []
    calibrate(fake(), progress=lambda *a: calls.append(a))
    assert calls == []


def test_as_backend_returns_a_backend_unchanged():
    backend = fake()
    assert as_backend(backend) is backend


def test_as_backend_unwraps_an_object_with_a_backend():
    backend = fake()

    class Wrapper:
        pass

    w = Wrapper()
    w.backend = backend
    assert as_backend(w) is backend


@pytest.mark.parametrize("target", [42, "model.gguf", None, object()])
def test_as_backend_refuses_what_is_not_a_model(target):
    with pytest.raises(InvalidInputError, match="cannot use"):
        as_backend(target)


def test_calibrate_refuses_an_int(isolated_cache):
    with pytest.raises(InvalidInputError):
        calibrate(42)


def test_an_implausible_attention_term_is_replaced_by_the_conservative_allowance(caplog):
    """Noisy minimum probes on a busy host can fit an attention term that prices a 1,000-token
    prompt in minutes; the fit falls back to a per-token rate with the schedule's allowance."""
    from trimkit._calibration import ATTENTION_PRIOR_TOKENS, _fit

    samples = [PrefillSample(32, 0, 0.060), PrefillSample(16, 32, 0.400), PrefillSample(16, 0, 0.050)]
    with caplog.at_level("WARNING", logger="trimkit"):
        model, err, heldout, alternatives = _fit(samples, 512)
    assert "attention_prior" in alternatives and "implausible" in caplog.text
    assert model.depth_s * ATTENTION_PRIOR_TOKENS <= model.per_token_s * 1.0000001
    # a 1,000-token prompt is priced in seconds, not minutes, and still errs long of the rate
    assert model.prefill_s(1000) < 20 * model.per_token_s * 1000


def test_a_plausible_fit_is_kept():
    from trimkit._calibration import _fit

    truth = CostModel(overhead_s=0.02, per_token_s=0.002, depth_s=1e-6)
    samples = [PrefillSample(n, k, truth.prefill_s(n, k)) for n, k in ((16, 0), (64, 0), (256, 0), (1024, 0), (128, 1024), (512, 1024))]
    model, *_rest, alternatives = _fit(samples, 512)
    assert "attention_prior" not in alternatives and "proportional" not in alternatives
    assert model.depth_s == pytest.approx(1e-6, rel=0.05)
