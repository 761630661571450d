"""The notice when the engine runs far slower than it was calibrated (trimkit.planning.slowdown),
and the warning when the host's speed changed that much during calibration."""

from __future__ import annotations

import logging
import math

import attrs
import pytest

import trimkit
from trimkit.planning.costs import CostModel
from trimkit.planning.drift import LiveProfile
from trimkit.profile import ProfileKey
from trimkit.planning.slowdown import SLOWDOWN_FACTOR, SlowdownWatch, usable_cores
from trimkit.testing import FakeBackend

BASE = CostModel(overhead_s=0.01, per_token_s=0.0014, depth_s=1e-7)
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "word " * 300}]


def _scaled(m: CostModel, factor: float) -> CostModel:
    return CostModel(overhead_s=m.overhead_s * factor, per_token_s=m.per_token_s * factor, depth_s=m.depth_s * factor,
                     per_batch_s=m.per_batch_s * factor, n_batch=m.n_batch)


def _serve(chat, fake: FakeBackend, n: int) -> list[tuple[str, ...]]:
    out = []
    for _ in range(n):
        with fake.lock:
            fake.kv = []  # each request cold, as a new conversation
        chat.create_chat_completion(messages=MESSAGES, max_tokens=4)
        out.append(chat.last_report.warnings)
    return out


NOTICE = "slower than when it was calibrated"


def _noted(warnings: tuple[str, ...]) -> bool:
    return any(NOTICE in w for w in warnings)


def test_a_host_three_times_slower_is_named_in_every_report_until_it_recovers(isolated_cache, caplog):
    fake = FakeBackend(BASE)
    profile = trimkit.calibrate(fake, mode="quick", store=False)
    chat = trimkit.wrap(fake, ttft_budget_s=5.0, profile=profile)
    assert not any(_noted(w) for w in _serve(chat, fake, 4))
    fake.cost_model = _scaled(BASE, 3.0)  # another process started
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        slow = _serve(chat, fake, 8)
    # noted once the live profile has followed (a few requests), then on every report
    first = next(i for i, w in enumerate(slow) if _noted(w))
    assert 1 <= first <= 5 and all(_noted(w) for w in slow[first:])
    text = next(w for w in slow[-1] if NOTICE in w)
    assert "3.0× slower" in text
    assert sum(NOTICE in r.getMessage() for r in caplog.records) == 1  # logged once a spell
    fake.cost_model = BASE  # the other process ended
    calm = _serve(chat, fake, 8)
    assert not _noted(calm[-1])


def test_a_host_half_again_as_slow_is_left_to_drift(isolated_cache):
    fake = FakeBackend(BASE)
    profile = trimkit.calibrate(fake, mode="quick", store=False)
    chat = trimkit.wrap(fake, ttft_budget_s=5.0, profile=profile)
    fake.cost_model = _scaled(BASE, 1.5)
    reports = _serve(chat, fake, 10)
    assert chat.pipeline.engine.slowdown.factor() == pytest.approx(1.5, rel=0.05)  # followed
    assert not any(_noted(w) for w in reports)


def _slowed_live(key, factor: float) -> LiveProfile:
    fake = FakeBackend(BASE)
    profile = attrs.evolve(trimkit.calibrate(fake, mode="micro", store=False), key=key)
    live = LiveProfile(profile, drift_window=3)
    for n in (300, 500, 700):
        live.observe(n, 0, BASE.prefill_s(n, 0) * factor)
    return live


@pytest.mark.parametrize("threads, hinted", [(0, False), (1, None), (64, True)])
def test_the_threads_hint_goes_to_an_in_process_engine_using_every_core(isolated_cache, threads, hinted):
    cores = usable_cores()
    assert cores is not None and cores >= 1
    key = ProfileKey(backend="llama_cpp", model="m", n_ctx=8192, n_batch=512, n_threads_batch=threads)
    live = _slowed_live(key, 4.0)
    [text] = SlowdownWatch(live).warnings()
    assert "4.0× slower" in text
    expected = (threads >= cores) if hinted is None else hinted
    assert ("n_threads_batch" in text) is expected


def test_a_server_gets_no_threads_hint(isolated_cache):
    key = ProfileKey(backend="openai_http", model="m", n_ctx=8192, n_batch=512, n_threads_batch=64, cpu="remote")
    [text] = SlowdownWatch(_slowed_live(key, 4.0)).warnings()
    assert "n_threads_batch" not in text and "another busy process" in text


def test_a_faster_host_is_no_slowdown(isolated_cache):
    key = ProfileKey(backend="llama_cpp", model="m", n_ctx=8192, n_batch=512, n_threads_batch=64)
    assert SlowdownWatch(_slowed_live(key, 1.0 / 4.0)).warnings() == []
    assert SlowdownWatch(_slowed_live(key, SLOWDOWN_FACTOR * 0.9)).warnings() == []


class _SteppingHost(FakeBackend):
    """A host ``factor`` times slower from ``at_s`` seconds after it was made: another process starts."""

    def __init__(self, factor: float, at_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step, self.at = factor, self.clock() + at_s

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        seconds = self.cost_model.prefill_s(new_tokens, cached_tokens) * (self.step if self.clock() >= self.at else 1.0)
        self.clock.advance(seconds)
        return seconds


def _calibrate_logged(host, caplog):
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        profile = trimkit.calibrate(host, mode="full", store=False)
    return profile, [r.getMessage() for r in caplog.records if "during calibration (a probe repeated" in r.getMessage()]


@pytest.mark.parametrize("step, took, what", [(3.0, "3.0", "started"), (1 / 3, "0.3", "stopped")])
def test_a_calibration_the_host_changed_threefold_during_warns(isolated_cache, caplog, step, took, what):
    host = _SteppingHost(step, at_s=10.0, cost_model=BASE)  # another process starts (stops) a third of the way in
    profile, warned = _calibrate_logged(host, caplog)
    trend = profile.alternatives.get("host_trend")
    assert trend is not None and (trend["log_per_s"] > 0) is (step > 1)
    assert len(warned) == 1 and "changed 3.0× during calibration" in warned[0] and f"took {took}× its first time" in warned[0]
    assert what in warned[0] and "--recalibrate" in warned[0]


def test_a_calibration_on_a_host_drifting_slowly_does_not_warn(isolated_cache, caplog):
    class Drifting(FakeBackend):
        def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
            seconds = self.cost_model.prefill_s(new_tokens, cached_tokens) * math.exp(0.01 * (self.clock() - 1000.0))
            self.clock.advance(seconds)
            return seconds

    profile, warned = _calibrate_logged(Drifting(cost_model=BASE), caplog)
    assert "host_trend" in profile.alternatives and warned == []
