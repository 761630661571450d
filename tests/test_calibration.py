"""Calibration against the deterministic fake engine: the probe schedule, the fit, the store."""

from __future__ import annotations

import logging

import pytest

from trimkit.testing import FakeBackend
from trimkit.calibration import MIN_N_CTX, as_backend, calibrate, calibration_probes
from trimkit.planning.costs import CostModel
from trimkit.errors import ContextTooSmallError, InvalidInputError
from trimkit.profile_store import load_profile, profile_path

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
@pytest.mark.parametrize("quick", [False, True])
def test_probes_refuse_a_context_below_min_n_ctx(n_ctx, quick):
    with pytest.raises(ContextTooSmallError, match="n_ctx"):
        calibration_probes(n_ctx, quick=quick)


N_CTXS = [MIN_N_CTX, 200, 512, 1000, 2048, 4096, 8192, 131072]


@pytest.mark.parametrize("n_ctx", N_CTXS)
@pytest.mark.parametrize("quick", [False, True])
def test_no_probe_reaches_past_90_percent_of_the_context(n_ctx, quick):
    probes = calibration_probes(n_ctx, quick=quick)
    assert max(p.new_tokens + p.cached_tokens for p in probes) <= int(0.9 * n_ctx)


@pytest.mark.parametrize("n_ctx", N_CTXS)
@pytest.mark.parametrize("quick", [False, True])
def test_probes_are_distinct_and_include_depth_probes(n_ctx, quick):
    probes = calibration_probes(n_ctx, quick=quick)
    keys = [(p.new_tokens, p.cached_tokens) for p in probes]
    assert len(set(keys)) == len(keys)
    assert len(keys) >= 4  # enough for leave-one-probe-out cross-validation
    assert any(p.cached_tokens > 0 for p in probes)
    assert all(p.new_tokens >= 16 and p.repeats >= 1 for p in probes)


@pytest.mark.parametrize("n_ctx", N_CTXS)
def test_quick_probes_evaluate_at_most_1024_new_tokens(n_ctx):
    assert max(p.new_tokens for p in calibration_probes(n_ctx, quick=True)) <= 1024


def test_a_large_context_is_probed_to_2048_cold_and_4096_deep():
    probes = calibration_probes(8192)
    assert max(p.new_tokens for p in probes if p.cached_tokens == 0) == 2048
    assert max(p.new_tokens + p.cached_tokens for p in probes) == 4096
    assert calibration_probes(131072) == probes  # more room does not make calibration longer


def test_quick_schedule_is_cheaper_than_the_full_one():
    def tokens(probes):
        return sum(p.new_tokens * p.repeats for p in probes)

    assert tokens(calibration_probes(8192, quick=True)) < tokens(calibration_probes(8192)) / 2


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


def test_calibrate_measures_every_scheduled_probe_after_warming_up(isolated_cache):
    backend = fake(n_ctx=4096)
    profile = calibrate(backend)
    scheduled = sorted((p.new_tokens, p.cached_tokens) for p in calibration_probes(4096) for _ in range(p.repeats))
    measured = sorted(e[1:] for e in backend.events if e[0] == "prefill")
    assert measured == scheduled
    assert backend.events[0] == ("warm_up",)
    assert sorted((s.new_tokens, s.cached_tokens) for s in profile.samples) == scheduled
    assert {s.source for s in profile.samples} == {"calibration"}


def test_calibrate_profile_carries_the_backends_key_and_the_quick_flag(isolated_cache):
    backend = fake()
    assert calibrate(backend, quick=True, store=False).key == backend.profile_key()
    assert calibrate(backend, quick=True, store=False).quick is True
    assert calibrate(backend, store=False).quick is False


def test_calibrate_times_itself_with_the_injected_clock(isolated_cache):
    backend = fake()
    profile = calibrate(backend, clock=backend.clock)
    expected = sum(s.seconds for s in profile.samples) + 32 / backend.decode_tokens_per_s
    assert profile.calibration_wall_s == pytest.approx(expected)


def test_calibrate_in_the_smallest_context_works(isolated_cache):
    profile = calibrate(fake(n_ctx=MIN_N_CTX), quick=True)
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
    calibrate(fake(), quick=True)
    backend = fake()
    profile = calibrate(backend)
    assert backend.prefill_calls > 0
    assert profile.quick is False
    assert load_profile(backend.profile_key()).quick is False


def test_a_stored_full_profile_satisfies_a_quick_calibration(isolated_cache):
    full = calibrate(fake())
    backend = fake()
    assert calibrate(backend, quick=True) == full
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


@pytest.mark.parametrize("quick", [False, True])
def test_progress_counts_up_to_the_total(isolated_cache, quick):
    calls: list[tuple[int, int, str]] = []
    calibrate(fake(), quick=quick, progress=lambda done, total, label: calls.append((done, total, label)))
    dones = [c[0] for c in calls]
    totals = {c[1] for c in calls}
    assert dones == list(range(1, len(calls) + 1))
    assert totals == {len(calls)}
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
