"""Calibration bounded in wall time on any host: fake hosts 1×, 10× and 50× slower (their clock
advances by what each step costs), the schedule sized to them, what the profile records, and
the embedded model's micro calibration (no speed asserted: speed is the benchmark's)."""

from __future__ import annotations

import json
import logging
import math
import random

import attrs
import pytest

from tests._core_helpers import exact_predictor
from trimkit._calibration import (
    FULL_BUDGET_S,
    MICRO_BUDGET_S,
    MODES,
    QUICK_BUDGET_S,
    calibrate,
    choose_top,
    decode_tokens,
    load_profile,
    mode_for_budget,
    remaining_cost,
    top_candidates,
)
from trimkit.cli import main
from trimkit.errors import InvalidBudgetError, InvalidInputError, ProfileError
from trimkit.planning.costs import CostModel
from trimkit.planning.profile import Profile
from trimkit.testing import FakeBackend

#: every calibration here measures, in a cache of its own: never a profile another test stored for
#: the same fake key
pytestmark = pytest.mark.usefixtures("isolated_cache")

#: the default fake engine: a per-token cost and a small attention term
LINEAR = CostModel(overhead_s=0.01, per_token_s=0.0014, depth_s=1e-7)
#: a small model whose attention soon costs more than its weights (per-token cost ×6 at 3,000 tokens)
STEEP = CostModel(overhead_s=0.02, per_token_s=0.0035, depth_s=5.8e-6)
#: a fast host (a GPU): 10,000 tokens/s prefill, 100 tokens/s decode
FAST = CostModel(overhead_s=0.002, per_token_s=0.0001, depth_s=2e-9)
MODELS = {"linear": (LINEAR, 12.0), "steep-attention": (STEEP, 12.0), "fast": (FAST, 100.0)}
BUDGETS = {"micro": MICRO_BUDGET_S, "quick": QUICK_BUDGET_S, "full": FULL_BUDGET_S}


class HostFake(FakeBackend):
    """The fake engine with every cost of a real calibration on its clock: the warm-up, the
    prompt a decode measurement prefills first, the three chat requests of the first-token
    overhead, and a depth probe's prefix when the context does not hold it (all of it when
    ``resend``, as a server). ``noise``: each cost × a seeded factor in [1 - noise, 1 + 2·noise];
    ``slow_after``: the host runs ``slow_factor`` (2) times as slow from that many seconds on."""

    def __init__(self, *args, noise: float = 0.0, seed: int = 0, slow_after: float | None = None, slow_factor: float = 2.0,
                 resend: bool = False, **kwargs) -> None:
        kwargs.setdefault("decode_tokens_per_s", 12.0)
        kwargs.setdefault("first_token_s", 0.014)
        super().__init__(*args, **kwargs)
        self.noise, self.rng, self.slow_after, self.slow_factor = noise, random.Random(seed), slow_after, slow_factor
        self.depth_probe_keeps_prefix = not resend
        self.holds = 0  # leading probe tokens the context holds
        self.started = self.clock()
        self.decode_calls: list[int] = []
        self.first_token_calls = 0

    def _factor(self) -> float:
        f = 1.0 + (self.rng.uniform(-self.noise, 2 * self.noise) if self.noise else 0.0)
        if self.slow_after is not None and self.clock() - self.started > self.slow_after:
            f *= self.slow_factor
        return f

    def _spend(self, seconds: float) -> float:
        seconds *= self._factor()
        self.clock.advance(seconds)
        return seconds

    def warm_up(self) -> None:
        self._spend(self.cost_model.prefill_s(64, 0) * 1.5)  # the first evaluation after loading costs extra
        self.holds = 0

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if cached_tokens and not self.depth_probe_keeps_prefix:
            self._spend(self.cost_model.prefill_s(cached_tokens, 0))
        elif cached_tokens > self.holds:
            self._spend(self.cost_model.prefill_s(cached_tokens - self.holds, self.holds))
        seconds = self._spend(self.cost_model.prefill_s(new_tokens, cached_tokens))
        self.holds = new_tokens + cached_tokens
        return seconds

    def measure_decode(self, n_tokens: int = 32) -> float:
        self.decode_calls.append(n_tokens)
        self._spend(self.cost_model.prefill_s(16, 0))
        self._spend(n_tokens / self.decode_tokens_per_s)
        self.holds = 0
        return self.decode_tokens_per_s

    def measure_first_token_overhead(self) -> float:
        self.first_token_calls += 1
        for _ in range(3):
            self._spend(self.cost_model.prefill_s(50, 0) + self.first_token_s + 2 / self.decode_tokens_per_s)
        self.holds = 0
        return self.first_token_s


def minimum_s(backend: HostFake) -> float:
    """What a calibration takes whatever its budget: the warm-up and its three first probes."""
    m = backend.cost_model
    return 1.5 * m.prefill_s(64) + m.prefill_s(32) + m.prefill_s(16, 32) + m.prefill_s(16)


def elapsed(backend: HostFake, **kwargs) -> tuple[Profile, float]:
    start = backend.clock()
    # a calibration, measured: never a profile another test stored for the same fake key
    kwargs.setdefault("recalibrate", True)
    profile = calibrate(backend, store=False, **kwargs)
    return profile, backend.clock() - start


# -- the bound ----------------------------------------------------------------------------------

HOSTS = {
    "exact": {},
    "noisy": {"noise": 0.3},
    "server": {"resend": True},
    "busier-midway": {"slow_after": 0.4},  # × the budget: set per test
}


@pytest.mark.parametrize("kind", list(HOSTS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("slowdown", [1, 10, 50])
@pytest.mark.parametrize("mode", ["micro", "quick", "full"])
def test_calibration_ends_within_its_budget_on_any_host(mode, slowdown, model, kind, caplog):
    options = dict(HOSTS[kind])
    if "slow_after" in options:
        options["slow_after"] *= BUDGETS[mode]
    cost, decode_tps = MODELS[model]
    backend = HostFake(cost, slowdown=slowdown, n_ctx=8192, decode_tokens_per_s=decode_tps, **options)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        profile, took = elapsed(backend, mode=mode)
    assert profile.calibration_wall_s == pytest.approx(took)
    assert len(profile.samples) >= 3 and profile.mode == mode
    if BUDGETS[mode] >= 1.5 * minimum_s(backend):
        assert took <= BUDGETS[mode], (took, [(s.new_tokens, s.cached_tokens) for s in profile.samples])
        assert "over its" not in caplog.text
    else:  # not even the minimum fits: it is taken all the same, and said
        assert took <= 2.5 * minimum_s(backend) + 3 / backend.decode_tokens_per_s
        if took > BUDGETS[mode]:
            assert "over its" in caplog.text


@pytest.mark.parametrize("slowdown", [1, 10])
@pytest.mark.parametrize("mode", ["quick", "full"])
def test_a_probe_that_runs_far_longer_than_predicted_is_stopped_at_the_deadline(mode, slowdown, caplog):
    """The host becomes 70× slower in the middle of the run (a 2-core host given two busy
    processes: a 32-token probe took 3.6 s instead of 0.05 s): the probe running then is
    stopped at the deadline and left out; the run ends on time with what it measured before."""
    budget = BUDGETS[mode]
    backend = HostFake(LINEAR, slowdown=slowdown, n_ctx=8192, slow_after=0.5 * budget, slow_factor=70.0)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        profile, took = elapsed(backend, mode=mode)
    assert took <= budget
    assert "over its" not in caplog.text
    assert len(profile.samples) >= 3
    # without a way to stop a probe (as for a server), the same host overruns, and it is said
    # why: a step took longer than predicted, not the minimum
    unstoppable = HostFake(LINEAR, slowdown=slowdown, n_ctx=8192, slow_after=0.5 * budget, slow_factor=70.0)
    unstoppable.measure_prefill_within = None
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        _, overran = elapsed(unstoppable, mode=mode)
    assert overran > budget
    assert "took far longer than predicted" in caplog.text


@pytest.mark.parametrize("model, slowdown", [("linear", 1), ("linear", 10), ("steep-attention", 1), ("fast", 1), ("fast", 50)])
def test_decode_points_fit_the_budget_in_process(model, slowdown):
    """Decode steps at the deepest context and at an empty one cost a few steps each: they are
    taken within the budget, and the line they give is the fake's (a step is a one-token prefill)."""
    cost = MODELS[model][0]
    # a real engine's decode step is its one-token evaluation: the decode probe agrees with it
    backend = HostFake(cost, slowdown=slowdown, n_ctx=8192, decode_tokens_per_s=1 / cost.prefill_s(1, 16))
    profile, took = elapsed(backend, mode="quick")
    assert took <= QUICK_BUDGET_S
    contexts = [p.context_tokens for p in profile.decode_points]
    assert len(contexts) >= 2 and contexts[1] == 0.0 and contexts[0] >= profile.probed_range()[1]
    step = cost.prefill_s(1, 4000) * slowdown
    assert 1 / profile.decode_tokens_per_s_at(4000) == pytest.approx(step, rel=0.01)


@pytest.mark.parametrize("budget_s", [2.0, 5.0, 20.0, 60.0])
@pytest.mark.parametrize("slowdown", [1, 10])
def test_a_custom_budget_is_held(budget_s, slowdown):
    backend = HostFake(LINEAR, slowdown=slowdown, n_ctx=8192, noise=0.2, seed=int(budget_s))
    profile, took = elapsed(backend, time_budget_s=budget_s)
    if budget_s >= 1.5 * minimum_s(backend):
        assert took <= budget_s
    assert profile.time_budget_s == budget_s
    assert profile.mode == mode_for_budget(budget_s)


def test_the_schedule_shrinks_as_the_host_slows():
    reach = []
    for slowdown in (0.05, 0.3, 1, 3, 10, 30):
        profile, _ = elapsed(HostFake(STEEP, slowdown=slowdown, n_ctx=8192), mode="full")
        reach.append((profile.probed_range()[1], len(profile.samples)))
    contexts = [r[0] for r in reach]
    assert contexts == sorted(contexts, reverse=True), reach
    assert contexts[0] == 4096 + 2048  # a fast host gets the whole schedule: the top and half as much again after it
    assert reach[-1][1] < reach[0][1]


def test_a_fast_host_gets_the_unbounded_schedule_and_leaves_time_over():
    backend = HostFake(LINEAR, slowdown=0.01, n_ctx=8192)
    profile, took = elapsed(backend, mode="full")
    assert took < 0.2 * FULL_BUDGET_S
    assert not profile.first_token_estimated and backend.first_token_calls == 1
    assert backend.decode_calls[-1] == MODES["full"].max_decode_tokens


def test_a_host_too_slow_for_the_minimum_still_gets_a_profile_and_a_warning(caplog):
    backend = HostFake(STEEP, slowdown=50, n_ctx=8192)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        profile, took = elapsed(backend, mode="micro")
    assert took > MICRO_BUDGET_S
    assert "over its 3 s budget" in caplog.text
    assert len(profile.samples) == 3 and profile.provisional
    assert profile.first_token_estimated and backend.first_token_calls == 0
    assert profile.predict_ttft_s(500) > profile.predict_ttft_s(50) > 0


def test_decode_and_first_token_overhead_are_sized_to_the_time_left():
    fast = HostFake(LINEAR, n_ctx=8192)
    profile, _ = elapsed(fast, mode="quick")
    assert fast.decode_calls[0] == 1 and 1 < fast.decode_calls[-1] <= MODES["quick"].max_decode_tokens
    assert not profile.first_token_estimated and profile.first_token_s == fast.first_token_s
    slow = HostFake(LINEAR, n_ctx=8192, slowdown=10)
    profile, _ = elapsed(slow, mode="micro")
    assert profile.first_token_estimated and slow.first_token_calls == 0
    assert profile.first_token_s >= 0 and profile.decode_tokens_per_s > 0


def test_a_server_pays_for_its_depth_prefixes_and_calibration_budgets_for_them():
    in_process, took_a = elapsed(HostFake(STEEP, n_ctx=8192), mode="quick")
    server, took_b = elapsed(HostFake(STEEP, n_ctx=8192, resend=True), mode="quick")
    assert took_a <= QUICK_BUDGET_S and took_b <= QUICK_BUDGET_S
    assert server.probed_range()[1] <= in_process.probed_range()[1]


# -- the schedule's pieces ----------------------------------------------------------------------


def test_predictions_beyond_the_probed_context_err_long():
    p = exact_predictor(STEEP, [(32, 0), (16, 32), (16, 0), (128, 0)])
    for n, k in ((512, 0), (1024, 0), (256, 512), (1024, 1024)):
        assert p.engine_s(n, k) >= STEEP.prefill_s(n, k), (n, k)
    # and within it, the fit is used: close to the truth
    assert p.engine_s(64, 0) == pytest.approx(STEEP.prefill_s(64, 0), rel=0.05)


def test_a_host_that_got_slower_inflates_the_next_predictions():
    p = exact_predictor(LINEAR, [(32, 0), (16, 32), (16, 0)])
    before = p.wall_s(256)
    p.observe_ratio(2.0, 1.0)
    assert p.wall_s(256) == pytest.approx(2 * before)


def test_choose_top_is_the_largest_top_that_fits_and_none_when_none_does():
    p = exact_predictor(LINEAR, [(32, 0), (16, 32), (16, 0)])
    counts = {(32, 0): 1, (16, 32): 1, (16, 0): 1}
    mode = MODES["quick"]
    tops = top_candidates(mode, 8192)
    costs = [remaining_cost(mode, t, 8192, p, counts) for t in tops]
    assert costs == sorted(costs)
    assert choose_top(mode, 8192, p, counts, 1e-6) is None
    assert choose_top(mode, 8192, p, counts, 1e6) == tops[-1]
    mid = choose_top(mode, 8192, p, counts, costs[4] / 0.7)
    assert mid == tops[4]


def test_decode_tokens_stay_within_the_modes_bounds():
    p = exact_predictor(LINEAR, [(32, 0), (16, 32), (16, 0)])
    for name, mode in MODES.items():
        assert 1 <= decode_tokens(mode, BUDGETS[name], p, 1e6) <= mode.max_decode_tokens
    assert decode_tokens(MODES["full"], 30.0, p, 1e-6) == 0


def test_mode_for_budget_picks_the_most_thorough_mode_it_affords():
    assert [mode_for_budget(b) for b in (0.5, 3.0, 9.9, 10.0, 29.0, 30.0, 600.0)] == ["micro", "micro", "micro", "quick", "quick", "full", "full"]


# -- what the profile records -------------------------------------------------------------------


def test_the_profile_records_its_mode_budget_and_probed_range():
    profile, _ = elapsed(HostFake(STEEP, n_ctx=8192), mode="quick", time_budget_s=7.5)
    assert (profile.mode, (profile.mode != "full"), profile.provisional, profile.time_budget_s) == ("quick", True, False, 7.5)
    new, ctx = profile.probed_range()
    assert (new, ctx) == (profile.probed_new_tokens, profile.probed_context_tokens)
    assert new == max(s.new_tokens for s in profile.samples)
    assert ctx == max(s.new_tokens + s.cached_tokens for s in profile.samples)
    micro, _ = elapsed(HostFake(STEEP, n_ctx=8192), mode="micro")
    assert micro.provisional and (micro.mode != "full") and micro.time_budget_s == MICRO_BUDGET_S


def test_extrapolation_is_one_inside_the_probed_range_and_the_overshoot_beyond():
    profile, _ = elapsed(HostFake(STEEP, n_ctx=8192), mode="quick")
    new, ctx = profile.probed_range()
    assert profile.extrapolation(new, ctx - new) == 1.0 and not profile.extrapolated(new, ctx - new)
    assert profile.extrapolation(1, 0) == 1.0 and profile.extrapolation(0, 0) == 1.0
    assert profile.extrapolation(2 * new, 0) == pytest.approx(max(2.0, 2 * new / ctx))
    assert profile.extrapolated(new + 1, 0)
    assert profile.extrapolation(16, 3 * ctx) == pytest.approx((16 + 3 * ctx) / ctx)
    assert profile.extrapolated(16, ctx)


def test_a_profile_stored_before_these_fields_loads_with_them_derived():
    profile, _ = elapsed(HostFake(STEEP, n_ctx=8192), mode="quick")
    data = json.loads(json.dumps(profile.to_dict()))
    for name in ("probed_new_tokens", "probed_context_tokens", "time_budget_s", "first_token_estimated"):
        del data[name]
    old = Profile.from_dict(data)
    assert old.mode == "quick" and old.time_budget_s == 0.0 and not old.first_token_estimated
    assert old.probed_range() == profile.probed_range()
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"mode": "fast"}, "mode"),
        ({"mode": 3}, "mode"),
        ({"probed_new_tokens": -1}, "probed_new_tokens"),
        ({"probed_context_tokens": "many"}, "probed_context_tokens"),
        ({"probed_new_tokens": True}, "probed_new_tokens"),
        ({"time_budget_s": -1.0}, "time_budget_s"),
        ({"time_budget_s": math.nan}, "time_budget_s"),
        ({"time_budget_s": "10"}, "time_budget_s"),
        ({"first_token_estimated": "yes"}, "first_token_estimated"),
    ],
)
def test_a_stored_profile_with_bad_new_fields_is_a_profile_error(edit, match):
    profile, _ = elapsed(HostFake(STEEP, n_ctx=8192), mode="quick")
    data = profile.to_dict()
    data.update(edit)
    with pytest.raises(ProfileError, match=match):
        Profile.from_dict(data)


def test_a_profile_refuses_an_unknown_mode_and_a_stored_file_from_before_mode():
    profile, _ = elapsed(HostFake(STEEP, n_ctx=8192), mode="quick")
    with pytest.raises(InvalidInputError):
        attrs.evolve(profile, mode="slow")
    assert attrs.evolve(profile, mode="micro").provisional
    data = profile.to_dict()
    assert data["quick"] is True and Profile.from_dict(data) == profile  # what older readers check
    legacy = {k: v for k, v in data.items() if k != "mode"}  # a file from before ``mode``: calibrated again
    with pytest.raises(ProfileError, match="mode is missing"):
        Profile.from_dict(legacy)


# -- budgets, modes and stored profiles ----------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 0.0, -3.0, math.nan, math.inf, "10", True, None.__class__])
def test_a_bad_time_budget_is_a_typed_error_before_anything_runs(bad):
    backend = HostFake(LINEAR)
    with pytest.raises(InvalidBudgetError, match="time_budget_s"):
        calibrate(backend, time_budget_s=bad, store=False)
    assert backend.clock() == backend.started


@pytest.mark.parametrize(("kwargs", "match"), [({"mode": "fast"}, "mode"), ({"mode": 3}, "mode")])
def test_a_bad_mode_is_a_typed_error(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        calibrate(HostFake(LINEAR), store=False, **kwargs)


@pytest.mark.parametrize("stored", ["micro", "quick", "full"])
@pytest.mark.parametrize("wanted", ["micro", "quick", "full"])
def test_a_stored_profile_serves_a_mode_at_most_as_thorough(isolated_cache, stored, wanted):
    first = calibrate(HostFake(LINEAR), mode=stored)
    again = HostFake(LINEAR)
    profile = calibrate(again, mode=wanted)
    order = ["micro", "quick", "full"]
    if order.index(stored) >= order.index(wanted):
        assert profile == first and again.clock() == again.started
    else:
        assert profile.mode == wanted and again.clock() > again.started
        assert load_profile(again.profile_key()).mode == wanted


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["0", "-2", "nan", "inf", "-inf"])
def test_cli_refuses_a_bad_time_budget_before_loading_a_model(bad, capsys):
    assert main(["calibrate", f"--time-budget={bad}", "--model", "/no/such/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "--time-budget" in err and "Traceback" not in err and "not found" not in err


def test_cli_quick_and_micro_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--quick", "--micro"])
    assert exc.value.code == 2


# -- the real model ------------------------------------------------------------------------------


def test_micro_calibration_of_the_real_model_is_usable(llm):
    profile = calibrate(llm, mode="micro", recalibrate=True, store=False)
    assert profile.provisional and profile.mode == "micro" and profile.time_budget_s == MICRO_BUDGET_S
    assert len(profile.samples) >= 3
    assert any(s.cached_tokens > 0 for s in profile.samples)
    assert profile.decode_tokens_per_s > 0 and profile.first_token_s >= 0
    assert profile.predict_ttft_s(1024) > profile.predict_ttft_s(16) > 0
    assert profile.extrapolated(4000, 0)


def test_probes_too_noisy_or_short_for_a_slope_give_a_proportional_model_not_a_flat_one():
    flat = FakeBackend(CostModel(overhead_s=0.5, per_token_s=0.0, depth_s=0.0))  # every probe the same time
    profile = calibrate(flat, time_budget_s=1.0, store=False, recalibrate=True)
    assert profile.model.per_token_s > 0 and "proportional" in profile.alternatives
    assert profile.predict_prefill_s(4000) > 10 * profile.predict_prefill_s(32)


def test_progress_ends_at_its_total_when_the_plan_is_cut_short():
    calls = []
    calibrate(HostFake(STEEP, slowdown=10, n_ctx=8192, noise=0.3), mode="quick", store=False, progress=lambda *a: calls.append(a))
    assert calls[-1][0] == calls[-1][1]
    assert all(d <= t for d, t, _ in calls)


def test_the_over_budget_warning_says_when_the_engine_threads_were_starved():
    from trimkit._calibration import starved_threads_hint

    # two threads busy the whole time (llama.cpp's threads spin): a host that was just slow
    assert starved_threads_hint(cpu_s=2.0, wall_s=1.0, threads=2, cpus=2) == ""
    # half the CPU time they asked for: other processes held the CPUs
    hint = starved_threads_hint(cpu_s=4.8, wall_s=4.8, threads=2, cpus=2)
    assert "2 threads got 50% of the CPU time" in hint and "n_threads_batch" in hint
    # a backend whose threads are unknown (a server, a fake) gets no hint
    assert starved_threads_hint(cpu_s=0.1, wall_s=4.8, threads=None, cpus=2) == ""
    assert starved_threads_hint(cpu_s=0.1, wall_s=0.0, threads=2, cpus=2) == ""


def test_calibration_checks_for_starved_threads_with_the_engine_threads_of_its_profile_key(monkeypatch):
    import trimkit._calibration as calibration_module

    seen = []
    real = calibration_module.CalibrationRun

    def recording(*args, **kwargs):
        run = real(*args, **kwargs)
        seen.append(run.threads)
        return run

    monkeypatch.setattr(calibration_module, "CalibrationRun", recording)
    in_process = FakeBackend(STEEP)
    monkeypatch.setattr(in_process, "profile_key", lambda: attrs.evolve(FakeBackend(STEEP).profile_key(), n_threads_batch=2))
    calibrate(in_process, mode="micro", store=False)
    calibrate(FakeBackend(STEEP), mode="micro", store=False)  # threads unknown (0 in its key): no hint
    assert seen == [2, None]
