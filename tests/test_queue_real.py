"""Queue-aware prediction on the real embedded model: several threads, one wrapped ``Llama``.

Each queued request's prediction includes the work of the requests ahead of it, the wait is
measured and reported, and the engine is handed on in the order the waits were predicted in.
Every wait is bounded (join timeouts), so a regression fails instead of hanging the suite; no
test asserts how fast anything is."""

from __future__ import annotations

import threading
import time

import pytest

import trimkit
from trimkit.errors import QueueBudgetError

pytestmark = pytest.mark.timeout(300)

JOIN_S = 90.0
MAX_TOKENS = 6


def ask(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: name one colour of the sea."}]


@pytest.fixture
def chat(llm, quick_profile):
    chat = trimkit.wrap(llm, profile=quick_profile, summarizer=None)
    yield chat
    assert not chat.backend.engine.busy, "a test left the engine held"
    assert len(chat.queue) == 0, "a test left a request in the engine's queue"


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_queued_threads_predict_and_measure_their_wait(chat):
    holder = chat.create_chat_completion(messages=ask(0), stream=True, max_tokens=MAX_TOKENS, temperature=0.0)
    next(holder)  # the engine is the holder's until its stream ends
    reports: dict[int, trimkit.Report] = {}
    served: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            rs = chat.create_chat_completion(messages=ask(i), stream=True, max_tokens=MAX_TOKENS, temperature=0.0)
            with lock:
                served.append(i)
            for _ in rs:
                pass
            reports[i] = rs.report
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = []
    for i in (1, 2, 3):
        t = threading.Thread(target=worker, args=(i,), daemon=True)
        t.start()
        threads.append(t)
        wait_for(lambda n=i: chat.backend.engine.waiters == n, f"{i} request(s) waiting for the engine")
    for _ in holder:  # the engine passes on
        pass
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a request never got the engine"
    assert not errors, errors
    assert served == [1, 2, 3]  # in the order they were planned, each behind the ones before it
    waits = [reports[i].queue_wait_predicted_s for i in (1, 2, 3)]
    assert 0 < waits[0] < waits[1] < waits[2]
    for n, i in enumerate((1, 2, 3), start=1):
        r = reports[i]
        m = r.measurement
        assert r.queue_ahead == n
        assert m.ttft_s is not None and m.queue_s > 0  # each waited for the ones ahead
        assert r.measured_ttft_s == pytest.approx(m.ttft_s + m.queue_s)  # the felt TTFT
        assert r.predicted_ttft_s > r.queue_wait_predicted_s > 0  # the prediction counts the wait too
        assert r.ttft_error_pct is not None
        assert "waited" in str(r) and r.to_dict()["queue_wait_s"] == m.queue_s
    assert holder.report.queue_wait_predicted_s == 0.0


def test_four_threads_at_once_with_a_budget_all_finish_consistently(llm, quick_profile):
    chat = trimkit.wrap(llm, ttft_budget_s=5.0, profile=quick_profile, summarizer=None)
    start = threading.Barrier(4, timeout=JOIN_S)
    reports: list[trimkit.Report] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            start.wait()
            chat.create_chat_completion(messages=ask(10 + i), max_tokens=MAX_TOKENS, temperature=0.0)
            reports.append(chat.last_report)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(chat.reports) == 4 and len(chat.queue) == 0 and not chat.backend.engine.busy
    for r in chat.reports:
        assert r.queue_wait_predicted_s is not None and r.queue_wait_predicted_s >= 0
        assert r.predicted_ttft_s >= r.queue_wait_predicted_s
        assert r.measured_ttft_s == pytest.approx(r.engine_ttft_s + r.measurement.queue_s)
    assert max(r.queue_ahead for r in chat.reports) >= 1  # they did not all run alone


def test_on_infeasible_raise_refuses_a_request_the_queue_makes_late_before_sending(chat):
    chat.on_infeasible = "raise"
    holder = chat.create_chat_completion(messages=ask(20), stream=True, max_tokens=MAX_TOKENS)
    next(holder)
    try:
        with pytest.raises(QueueBudgetError) as info:
            chat.create_chat_completion(messages=ask(21), max_tokens=MAX_TOKENS, ttft_budget_s=0.001)
        err = info.value
        assert err.report is not None and err.report.queue_wait_predicted_s == err.wait_s > 0
        assert err.report.measurement.ttft_s is None and len(chat.queue) == 1  # only the holder
    finally:
        holder.close()
