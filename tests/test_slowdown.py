"""The notice when the engine runs far slower than it was calibrated: the one speed estimate's
factor at 2× or more (trimkit/planning/speed.py, EngineState.slowdown_warnings)."""

from __future__ import annotations

import logging

import attrs
import pytest

import trimkit
from trimkit.planning.costs import CostModel
from trimkit.planning.profile import ProfileKey
from trimkit.planning.speed import SLOWDOWN_FACTOR, EngineState, usable_cores
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
    # noted once the speed estimate has followed (a few requests), then on every report
    first = next(i for i, w in enumerate(slow) if _noted(w))
    assert 1 <= first <= 6 and all(_noted(w) for w in slow[first:])
    text = next(w for w in slow[-1] if NOTICE in w)
    assert "3.0× slower" in text
    assert sum(NOTICE in r.getMessage() for r in caplog.records) == 1  # logged once a spell
    fake.cost_model = BASE  # the other process ended
    calm = _serve(chat, fake, 12)
    assert not _noted(calm[-1])


def test_a_host_half_again_as_slow_is_followed_without_a_notice(isolated_cache):
    fake = FakeBackend(BASE)
    profile = trimkit.calibrate(fake, mode="quick", store=False)
    chat = trimkit.wrap(fake, ttft_budget_s=5.0, profile=profile)
    fake.cost_model = _scaled(BASE, 1.5)
    reports = _serve(chat, fake, 14)
    assert chat.pipeline.engine.live.speed_factor() == pytest.approx(1.5, rel=0.05)  # followed
    assert not any(_noted(w) for w in reports)


def _slowed(key, factor: float) -> EngineState:
    fake = FakeBackend(BASE)
    profile = attrs.evolve(trimkit.calibrate(fake, mode="micro", store=False), key=key)
    state = EngineState(profile)
    for n in (300, 500, 700, 300, 500, 700, 300, 500, 700):
        state.live.observe(n, 0, BASE.prefill_s(n, 0) * factor)
    return state


@pytest.mark.parametrize("threads, hinted", [(0, False), (1, None), (64, True)])
def test_the_threads_hint_goes_to_an_in_process_engine_using_every_core(isolated_cache, threads, hinted):
    cores = usable_cores()
    assert cores is not None and cores >= 1
    key = ProfileKey(backend="llama_cpp", model="m", n_ctx=8192, n_batch=512, n_threads_batch=threads)
    [text] = _slowed(key, 4.0).slowdown_warnings()
    assert "4.0× slower" in text
    expected = (threads >= cores) if hinted is None else hinted
    assert ("n_threads_batch" in text) is expected


def test_a_server_gets_no_threads_hint(isolated_cache):
    key = ProfileKey(backend="openai_http", model="m", n_ctx=8192, n_batch=512, n_threads_batch=64, cpu="remote")
    [text] = _slowed(key, 4.0).slowdown_warnings()
    assert "n_threads_batch" not in text and "another busy process" in text


def test_a_faster_host_is_no_slowdown(isolated_cache):
    key = ProfileKey(backend="llama_cpp", model="m", n_ctx=8192, n_batch=512, n_threads_batch=64)
    assert _slowed(key, 1.0 / 4.0).slowdown_warnings() == []
    assert _slowed(key, SLOWDOWN_FACTOR * 0.9).slowdown_warnings() == []
