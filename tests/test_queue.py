"""Queue-aware prediction in process (trimkit/planning/queue.py), on the deterministic fake engine.

Requests ahead are made by starting streams and not reading them (the fake's clock moves only
while a stream is read), so every predicted wait here can be worked out by hand. Threads appear
only where a request must really wait for the engine; every wait is bounded."""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
import weakref
from types import SimpleNamespace

import attrs
import httpx
import pytest

import trimkit
from tests._core_helpers import make_measurement, make_profile
from trimkit.backends.base import TimedStream
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.replies import chunk_content
from trimkit.errors import (
    EngineBusyError,
    InfeasibleBudgetError,
    InvalidInputError,
    QueueBudgetError,
    StreamInterruptedError,
)
from trimkit.planning.costs import CostModel
from trimkit.planning.queue import (
    DEFAULT_ANSWER_TOKENS,
    MIN_PLAN_BUDGET_S,
    EngineLease,
    EngineQueue,
    busy_decision,
    wait_bound_s,
)
from trimkit.report import Report
from trimkit.testing import FakeBackend, FakeClock, FakeOpenAIServer
from trimkit.wrapper import Trimmer

JOIN_S = 30.0
MAX_TOKENS = 10
DECODE_S = (MAX_TOKENS - 1) / 50.0  # after the first token, at the fake's 50 tokens/s (calibration measures that)
WORDS = "the harbour lamp keeper rows out at dawn and counts the fishing boats along the quay".split()


def text(n_words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i + seed) % len(WORDS)] for i in range(n_words))


def ask(i: int = 0, words: int = 20) -> list[dict]:
    return [{"role": "user", "content": f"question {i}: " + text(words, i)}]


def conversation(turns: int = 12, words: int = 60) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {t}: " + text(words // 3, t)})
        msgs.append({"role": "assistant", "content": f"answer {t}: " + text(words, t)})
    msgs.append({"role": "user", "content": "What time do the boats come back?"})
    return msgs


@pytest.fixture
def fake(isolated_cache):
    return FakeBackend(CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-7), clock=FakeClock(), reuse_prefix=False)


@pytest.fixture
def profile(fake):
    return trimkit.calibrate(fake)  # exact for the fake


@pytest.fixture
def chat(fake, profile):
    return Trimmer(fake, profile=profile, clock=fake.clock, summarizer=None)


def start(chat, messages, **kw):
    """A request ahead: prepared, sent, holding the engine, not read yet."""
    params = {"max_tokens": MAX_TOKENS, **kw.pop("params", {})}
    prepared = chat.prepare(messages, None, params, **kw)
    return prepared, chat.execute(prepared, params)


def engine_part(prepared) -> float:
    return prepared.predicted_ttft_s - (prepared.queue_wait_s or 0.0)


# -- the wait is the remaining work of the requests ahead ---------------------------------------------------


def test_a_request_alone_waits_for_nothing(chat):
    prepared = chat.prepare(ask(), None, {"max_tokens": MAX_TOKENS})
    assert prepared.queue_wait_s == 0.0 and prepared.queue_ahead == 0
    rs = chat.execute(prepared, {"max_tokens": MAX_TOKENS})
    list(rs)
    r = rs.report
    assert r.queue_wait_predicted_s == 0.0 and r.measurement.queue_s == 0.0
    assert r.predicted_ttft_s == pytest.approx(r.measured_ttft_s, rel=1e-6)  # the fake is exact
    assert "queue " not in str(r)


def send_in_thread(chat, prepared, params):
    """Send ``prepared`` from another thread (it waits there for the engine) and read it to the end."""
    box: dict[str, object] = {}

    def run():
        try:
            rs = chat.execute(prepared, params)
            list(rs)
            box["report"] = rs.report
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_the_wait_is_the_predicted_work_of_every_request_ahead(chat, fake):
    params = {"max_tokens": MAX_TOKENS}
    a, rs_a = start(chat, ask(1))  # sent: holds the engine
    b = chat.prepare(ask(2, 40), None, params)
    work_a = engine_part(a) + DECODE_S
    assert b.queue_wait_s == pytest.approx(work_a) and b.queue_ahead == 1
    assert b.predicted_ttft_s == pytest.approx(work_a + engine_part(b))
    thread, box = send_in_thread(chat, b, params)  # b waits for the engine now: it counts
    wait_until(lambda: fake.engine.waiters == 1, "b waiting for the engine")
    c = chat.prepare(ask(3), None, {"max_tokens": 5})
    work_b = engine_part(b) + DECODE_S
    assert c.queue_wait_s == pytest.approx(work_a + work_b) and c.queue_ahead == 2
    assert [t.seq for t in chat.queue.in_flight()] == [a.ticket.seq, b.ticket.seq]  # c: planned, not sent
    # a's first token arrives: only the rest of its decode is left
    next(rs_a), next(rs_a)
    assert chat.queue.wait_s() == pytest.approx(DECODE_S + work_b)
    fake.clock.advance(DECODE_S / 2)
    assert chat.queue.wait_s() == pytest.approx(DECODE_S / 2 + work_b)
    list(rs_a)  # finished: a leaves, b gets the engine
    thread.join(JOIN_S)
    assert not thread.is_alive() and "error" not in box
    assert box["report"].queue_wait_predicted_s == pytest.approx(work_a)
    assert len(chat.queue) == 0
    list(chat.execute(c, {"max_tokens": 5}))
    assert len(chat.queue) == 0


def test_a_request_planned_and_not_sent_counts_for_no_one(chat):
    a, rs = start(chat, ask(1))
    kept = chat.prepare(ask(2), None, {"max_tokens": MAX_TOKENS})  # planned, kept, not sent (yet)
    later = chat.prepare(ask(3), None, {"max_tokens": MAX_TOKENS})
    assert later.queue_ahead == 1 and later.queue_wait_s == pytest.approx(engine_part(a) + DECODE_S)
    assert len(chat.queue) == 1
    rs.close()
    del later
    rs = chat.execute(kept, {"max_tokens": MAX_TOKENS})  # sent after all: it counts again
    assert [t.seq for t in chat.queue.in_flight()] == [kept.ticket.seq]
    list(rs)
    assert len(chat.queue) == 0


def test_a_request_sent_at_once_keeps_its_place_from_its_plan_to_its_send(chat):
    # create_chat_completion plans with send_now=True: between plan and send it is still ahead of later requests, so a
    # later one finding the engine free waits for it
    now = chat.prepare(ask(1), None, {"max_tokens": MAX_TOKENS}, send_now=True)
    assert [t.seq for t in chat.queue.in_flight()] == [now.ticket.seq]
    later = chat.prepare(ask(2), None, {"max_tokens": MAX_TOKENS})
    assert later.queue_ahead == 1 and len(chat.queue) == 1
    list(chat.execute(now, {"max_tokens": MAX_TOKENS}))
    assert len(chat.queue) == 0
    with pytest.raises(InvalidInputError):
        chat.prepare(ask(3), None, {"max_tokens": MAX_TOKENS}, ttft_budget_s=-1.0, send_now=True)
    assert len(chat.queue) == 0


def test_a_request_sent_after_it_was_planned_takes_its_place_before_those_planned_after_it():
    # planned first, it left the line; sent (back in) after a later request entered: still ahead of it
    q = EngineQueue(FakeClock())
    first = q.enter()
    first.done()  # planned, not sent yet
    second = q.enter()
    second.estimate(0.5, 0.1)
    first.estimate(1.0, 0.2)
    q.enter(first)  # sent now
    assert q.in_flight() == [first, second]
    assert q.ahead(second) == [first] and q.wait_s(second) == pytest.approx(1.2)


def test_a_request_whose_prompt_is_not_counted_yet_counts_as_much_as_the_one_asking():
    q = EngineQueue(FakeClock())
    first = q.enter()  # still counting its prompt
    me = q.enter()
    me.estimate(0.4, 0.1)
    assert q.wait_s(me) == pytest.approx(0.5)
    first.estimate(1.0, 0.2)
    assert q.wait_s(me) == pytest.approx(1.2)
    assert q.wait_s(me, default_s=0.0) == pytest.approx(1.2)


def test_answer_length_rule():
    q = EngineQueue(FakeClock())
    assert q.answer_tokens({"max_tokens": 64}) == 64
    assert q.answer_tokens({"max_completion_tokens": 32}) == 32
    assert q.answer_tokens({}) == DEFAULT_ANSWER_TOKENS  # nothing learned yet
    assert q.answer_tokens({"max_tokens": 0}) == DEFAULT_ANSWER_TOKENS  # 0 / -1: no cap
    assert q.answer_tokens({"max_tokens": 64}, room=20) == 20  # never past the context
    for n in (10, 30, 20, 1000, 25):
        q.observe({}, SimpleNamespace(completion_tokens=n, ttft_s=None, first_output_s=None, total_s=None))
    assert q.answer_tokens({}) == 25  # the median of recent unbounded answers
    assert q.decode_s({"max_tokens": 51}, 25.0) == pytest.approx(2.0)  # 50 tokens after the first
    assert q.decode_s({"max_tokens": 50}, 0.0) == 0.0  # decode speed unknown
    # 10 tokens after the first in 0.5 s, as the caller saw them (a capped answer: its length is not learned)
    q.observe({"max_tokens": 11}, SimpleNamespace(completion_tokens=11, ttft_s=1.0, first_output_s=None, total_s=1.5))
    q.observe({"max_tokens": 1}, SimpleNamespace(completion_tokens=1, ttft_s=None, first_output_s=1.0, total_s=1.5))  # no decode to time
    assert q.tokens_per_s(25.0) == pytest.approx(20.0)
    assert q.decode_s({"max_tokens": 51}, 25.0) == pytest.approx(2.5)  # the streams' speed wins
    assert q.answer_tokens({}) == 25


def test_an_unbounded_answer_teaches_the_typical_length(chat):
    list(chat.create_chat_completion(messages=ask(), stream=True))  # no max_tokens: the fake answers 16 words at most
    assert chat.queue.answer_tokens({}) == chat.last_report.completion_tokens
    list(chat.create_chat_completion(messages=ask(), stream=True, max_tokens=3))  # capped: not a natural length
    assert chat.queue.answer_tokens({}) == chat.reports[0].completion_tokens


# -- the plan trims against budget − wait ----------------------------------------------------------------


def test_more_is_trimmed_when_others_are_ahead(chat, fake):
    msgs = conversation(10)
    alone = chat.prepare(msgs, None, {"max_tokens": MAX_TOKENS}, ttft_budget_s=1.0)
    alone_tokens, alone_engine = len(alone.prompt_tokens), engine_part(alone)
    del alone
    gc.collect()
    assert len(chat.queue) == 0
    ahead, rs = start(chat, ask(1, 60))
    queued = chat.prepare(msgs, None, {"max_tokens": MAX_TOKENS}, ttft_budget_s=1.0)
    wait = queued.queue_wait_s
    assert wait == pytest.approx(engine_part(ahead) + DECODE_S) and wait > 0.1
    assert len(queued.prompt_tokens) < alone_tokens and engine_part(queued) < alone_engine
    margin = queued.plan.safety_margin
    assert queued.predicted_ttft_s <= 1.0 * (1 - margin) + 1e-9  # wait + prompt fit the budget less the margin
    assert queued.feasible is True
    assert any("planned to the budget less that wait" in w for w in queued.warnings)
    rs.close()


def test_a_wait_that_leaves_no_room_sends_the_minimal_prompt_or_raises_as_on_infeasible_says(chat, fake):
    ahead, rs = start(chat, conversation(8), params={"max_tokens": 200})  # 4 s of decode ahead
    msgs = conversation(6)
    best = chat.prepare(msgs, None, {"max_tokens": 4}, ttft_budget_s=2.0)  # on_busy="trim", wait > budget
    assert best.plan.minimal and best.feasible is False
    assert best.predicted_ttft_s > 2.0
    chat.on_infeasible = "raise"  # the wait alone breaks the budget: refused unplanned, as the queue's fault
    with pytest.raises(QueueBudgetError) as info:
        chat.prepare(msgs, None, {"max_tokens": 4}, ttft_budget_s=2.0)
    assert info.value.plan is None and info.value.report.queue_wait_predicted_s > 2.0
    del best
    gc.collect()
    assert [t.seq for t in chat.queue.in_flight()] == [ahead.ticket.seq]  # neither stayed in the queue
    rs.close()


def test_on_busy_wait_plans_the_whole_budget_and_says_the_wait_breaks_it(chat, fake):
    msgs = conversation(6)
    alone = chat.prepare(msgs, None, {"max_tokens": 4}, ttft_budget_s=1.0)
    alone_tokens = len(alone.prompt_tokens)
    del alone
    gc.collect()
    _, rs = start(chat, conversation(8), params={"max_tokens": 100})  # 2 s of decode ahead
    queued = chat.prepare(msgs, None, {"max_tokens": 4}, ttft_budget_s=1.0, on_busy="wait")
    assert len(queued.prompt_tokens) == alone_tokens  # planned as if the engine were free
    assert queued.predicted_ttft_s > 1.0 and queued.feasible is False
    assert any("on_busy='wait'" in w and "break the budget" in w for w in queued.warnings)
    chat.on_infeasible = "raise"  # the wait is not the prompt's fault: nothing raised
    again = chat.prepare(msgs, None, {"max_tokens": 4}, ttft_budget_s=1.0, on_busy="wait")
    assert again.plan.feasible
    rs.close()
    del queued, again
    gc.collect()
    assert len(chat.queue) == 0


def test_on_infeasible_raise_refuses_a_late_request_before_anything_is_sent_with_the_report(fake, profile):
    chat = Trimmer(fake, profile=profile, clock=fake.clock, summarizer=None, on_infeasible="raise")
    _, rs = start(chat, conversation(8), params={"max_tokens": 100})
    sent_before = len(fake.calls)
    with pytest.raises(QueueBudgetError) as info:
        chat.create_chat_completion(messages=conversation(2), ttft_budget_s=1.0, max_tokens=4)
    err = info.value
    assert isinstance(err, InfeasibleBudgetError) and isinstance(err, trimkit.TrimkitError)
    assert len(fake.calls) == sent_before  # nothing was sent
    assert err.wait_s > 1.0 and err.ahead == 1 and err.plan is None
    r = err.report
    assert r is not None and r.queue_wait_predicted_s == err.wait_s and r.queue_ahead == 1
    assert r.predicted_ttft_s > 1.0 and r.feasible is False and "not sent" in r.warnings
    assert r.measurement.ttft_s is None and "request(s) ahead" in str(err)
    assert len(chat.queue) == 1  # the refused request left no ticket behind
    # a wait that leaves room is planned as with "trim"; per call, another mode applies
    small = chat.prepare(conversation(2), None, {"max_tokens": 4}, ttft_budget_s=10.0)
    assert small.queue_wait_s == pytest.approx(err.wait_s) and small.feasible
    waited = chat.prepare(conversation(2), None, {"max_tokens": 4}, ttft_budget_s=1.0, on_busy="wait")
    assert waited.plan is not None
    rs.close()


@pytest.mark.parametrize("bad", ["queue", "", None, 3, "TRIM", "raise"])
def test_a_bad_on_busy_is_refused(fake, profile, chat, bad):
    with pytest.raises(InvalidInputError):
        Trimmer(fake, profile=profile, on_busy=bad)
    with pytest.raises(InvalidInputError):
        chat.on_busy = bad
    if bad is not None:  # None per call means "the wrapper's"
        with pytest.raises(InvalidInputError):
            chat.create_chat_completion(messages=ask(), on_busy=bad)
    assert len(chat.queue) == 0 and chat.on_busy == "trim"


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, "1", True])
def test_a_bad_queue_wait_is_refused(chat, bad):
    with pytest.raises(InvalidInputError):
        chat.prepare(ask(), queue_wait_s=bad)
    assert len(chat.queue) == 0


# -- a wait given by the caller (a fleet router), and the endpoint label ---------------------------------------


def test_a_callers_wait_is_planned_with_and_reported(fake, profile, caplog):
    chat = Trimmer(fake, profile=profile, clock=fake.clock, summarizer=None, endpoint_label="replica-2")
    msgs = conversation(10)
    alone = chat.prepare(msgs, None, {"max_tokens": 4}, ttft_budget_s=1.0)
    given = chat.prepare(msgs, None, {"max_tokens": 4}, ttft_budget_s=1.0, queue_wait_s=0.4)
    assert given.queue_wait_s == 0.4 and given.queue_ahead == 0
    assert len(given.prompt_tokens) < len(alone.prompt_tokens)
    assert given.predicted_ttft_s == pytest.approx(engine_part(given) + 0.4)
    del alone
    with caplog.at_level(logging.INFO, logger="trimkit"):
        rs = chat.execute(given, {"max_tokens": 4})
        list(rs)
    r = rs.report
    assert r.endpoint == "replica-2" and r.queue_wait_predicted_s == 0.4
    d = r.to_dict()
    assert d["endpoint"] == "replica-2" and d["queue_wait_predicted_s"] == 0.4 and d["queue_wait_s"] == 0.0
    assert "@ replica-2" in str(r) and "predicted 0.400 s" in str(r)
    assert any("endpoint=replica-2" in rec.message and "queue_pred=0.400 s" in rec.message for rec in caplog.records)
    with pytest.raises(InvalidInputError):
        Trimmer(fake, profile=profile, endpoint_label=3)


def test_a_server_has_no_queue_unless_its_caller_predicts_one(isolated_cache):
    server = FakeOpenAIServer(model="m")
    backend = OpenAIHTTPBackend("http://fake.test/v1", model="m", http_client=httpx.Client(transport=server.transport))
    chat = trimkit.wrap(backend, profile=attrs.evolve(make_profile(), key=backend.profile_key()), summarizer=None)
    assert chat.queue is None
    plain = chat.prepare(ask())
    assert plain.queue_wait_s is None and plain.ticket is None
    given = chat.prepare(ask(), queue_wait_s=0.25)
    assert given.queue_wait_s == 0.25 and given.predicted_ttft_s == pytest.approx(plain.predicted_ttft_s + 0.25)


# -- the report: predicted and measured are both the TTFT the caller felt ---------------------------------


def test_the_report_compares_the_felt_ttft_wait_included():
    m = make_measurement(ttft_s=1.0, first_output_s=1.0, queue_s=0.5)
    r = Report(backend="fake", measurement=m, prompt_tokens=10, predicted_ttft_s=1.65, ttft_budget_s=1.6,
               queue_wait_predicted_s=0.6, queue_ahead=2)
    assert r.engine_ttft_s == 1.0 and r.queue_wait_s == 0.5
    assert r.measured_ttft_s == pytest.approx(1.5)
    assert r.ttft_error_pct == pytest.approx(10.0)
    assert r.budget_met is True  # 1.5 s felt ≤ 1.6 s (the stream's own 1.0 s says nothing of the wait)
    assert r.dominant_phase == "prefill"  # from the start of the stream: 1.0 s > 0.8 s of decode
    text = str(r)
    assert "waited 0.500 s for the engine (predicted 0.600 s, 2 request(s) ahead)" in text
    d = r.to_dict()
    assert d["measured_ttft_s"] == pytest.approx(1.5) and d["engine_ttft_s"] == 1.0 and d["queue_ahead"] == 2
    late = Report(backend="fake", measurement=m, prompt_tokens=10, predicted_ttft_s=1.65, ttft_budget_s=1.2)
    assert late.budget_met is False


# -- nothing leaks ----------------------------------------------------------------------------------------


def test_the_queue_empties_on_finish_close_and_garbage_collection(chat):
    rs = chat.create_chat_completion(messages=ask(1), stream=True, max_tokens=3)
    assert len(chat.queue) == 1
    list(rs)
    assert len(chat.queue) == 0  # finished
    rs = chat.create_chat_completion(messages=ask(2), stream=True, max_tokens=3)
    next(rs)
    rs.close()
    assert len(chat.queue) == 0  # closed midway
    rs = chat.create_chat_completion(messages=ask(3), stream=True, max_tokens=3)
    next(rs), next(rs)
    del rs
    gc.collect()
    assert len(chat.queue) == 0  # dropped unfinished (the wrapper still remembers the request it sent)
    assert chat.last_prepared is not None and chat.last_prepared.ticket not in chat.queue.in_flight()
    prepared = chat.prepare(ask(4))  # planned, never sent, dropped
    ticket = weakref.ref(prepared.ticket)
    assert len(chat.queue) == 0
    del prepared
    gc.collect()
    assert len(chat.queue) == 0 and ticket() is None  # nothing kept of it
    rs = chat.create_chat_completion(messages=ask(5), stream=True, max_tokens=3)
    rs.timed.close()  # the engine's stream closed under the wrapper: it no longer holds the engine
    assert len(chat.queue) == 0
    assert not chat.backend.engine.busy


def test_a_request_sent_inside_a_section_of_the_engine_leaves_the_queue_with_its_stream(chat, fake):
    with fake.lock:  # this thread holds the engine already: the request goes ahead of no one, its stream takes over its ticket
        rs = chat.create_chat_completion(messages=ask(1), stream=True, max_tokens=3)
        assert len(chat.queue) == 1
    assert len(chat.queue) == 1  # the stream still holds the engine
    list(rs)
    assert len(chat.queue) == 0 and not fake.engine.busy


class BreakingFake(FakeBackend):
    """A fake whose stream (holding the engine) breaks after its first content chunk."""

    def send(self, messages, params, *, prompt_tokens=None):
        release, waited = self.engine.hold(self.engine_wait_s)

        def chunks():
            yield {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            self.clock.advance(0.25)
            yield {"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}
            raise StreamInterruptedError("the engine went away")

        return TimedStream(chunks(), started=None, clock=self.clock, content_of=chunk_content,
                           finish=lambda ts: None, release=release, queue_s=waited)


def test_the_queue_empties_when_a_stream_fails_or_a_send_fails(isolated_cache):
    fake = BreakingFake(clock=FakeClock())
    chat = Trimmer(fake, profile=trimkit.calibrate(fake), clock=fake.clock, summarizer=None)
    rs = chat.create_chat_completion(messages=ask(), stream=True, max_tokens=3)
    with pytest.raises(StreamInterruptedError) as info:
        list(rs)
    assert len(chat.queue) == 0 and info.value.report.queue_wait_predicted_s == 0.0
    # the engine stays busy past the wait bound: the send fails, and leaves the queue too
    holder, _ = fake.engine.hold()
    try:
        with pytest.raises(EngineBusyError):
            chat.create_chat_completion(messages=ask(), ttft_budget_s=0.05, max_tokens=3)
    finally:
        holder()
    assert len(chat.queue) == 0 and not fake.engine.busy


# -- one engine, several wrappers, several threads ----------------------------------------------------------


def test_wrappers_of_one_engine_share_its_queue(fake, profile, chat):
    other = Trimmer(fake, profile=profile, clock=fake.clock, summarizer=None)
    assert other.queue is chat.queue and other.engine is chat.engine
    a, rs = start(chat, ask(1))
    seen = other.prepare(ask(2), None, {"max_tokens": MAX_TOKENS})
    assert seen.queue_wait_s == pytest.approx(engine_part(a) + DECODE_S) and seen.queue_ahead == 1
    rs.close()


def test_queued_threads_are_served_in_turn_and_report_their_waits(chat, fake):
    _, holder = start(chat, ask(0))  # holds the engine until every worker waits
    reports: dict[int, Report] = {}
    order: list[int] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            rs = chat.create_chat_completion(messages=ask(i + 1), stream=True, max_tokens=3)
            order.append(i)
            list(rs)
            reports[i] = rs.report
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = []
    for i in range(3):  # each planned while the ones before it wait for the engine
        t = threading.Thread(target=worker, args=(i,), daemon=True)
        t.start()
        threads.append(t)
        wait_until(lambda n=i + 1: fake.engine.waiters == n, f"{i + 1} worker(s) waiting")
    list(holder)
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert order == [0, 1, 2]  # the engine goes in the order the waits were predicted in
    waits = [reports[i].queue_wait_predicted_s for i in range(3)]
    assert 0 < waits[0] < waits[1] < waits[2]
    for i in range(3):
        r = reports[i]
        assert r.queue_ahead == i + 1 and r.measurement.queue_s > 0
        assert r.measured_ttft_s == pytest.approx(r.engine_ttft_s + r.measurement.queue_s)
    assert len(chat.queue) == 0


def test_the_lease_serves_waiters_first_come_first_served_and_bounds_each_wait():
    lease = EngineLease()
    release, _ = lease.hold()
    got: list[int] = []
    box: dict[str, object] = {}

    def wait(i: int) -> None:
        with lease.section(JOIN_S):
            got.append(i)

    threads = []
    for i in range(3):
        t = threading.Thread(target=wait, args=(i,), daemon=True)
        t.start()
        threads.append(t)
        wait_until(lambda n=i + 1: lease.waiters == n, f"{i + 1} waiter(s)")
    try:
        with lease.section(0.05):
            pass
    except EngineBusyError as exc:  # bounded: a stream holds it, three are ahead
        box["error"] = exc
    assert isinstance(box.get("error"), EngineBusyError) and "unfinished stream" in str(box["error"])
    release()
    release()  # only the first release counts
    for t in threads:
        t.join(JOIN_S)
    assert got == [0, 1, 2] and not lease.busy and lease.waiters == 0
    with lease.section(0.05) as waited, lease.section(0.05) as again:  # re-entrant for its thread
        assert waited == 0.0 and again == 0.0


def test_the_lease_serves_requests_in_the_order_their_waits_were_predicted_not_the_order_they_reach_it():
    # the first request planned takes longer to plan and reaches the lock second: it is still served first, as the
    # second one's predicted wait (the first one's work) assumed; a waiter without a request keeps its arrival's place
    lease = EngineLease()
    first, second = lease.queue.enter(), lease.queue.enter()
    first.done()
    second.done()  # both planned; neither sent yet
    release, _ = lease.hold()
    got: list[str] = []

    def send(name: str, ticket: object) -> None:
        with lease.section(JOIN_S, ticket):  # type: ignore[arg-type]
            got.append(name)

    threads = []
    for n, (name, ticket) in enumerate((("second", second), ("first", first), ("no ticket", None))):
        t = threading.Thread(target=send, args=(name, ticket), daemon=True)
        t.start()
        threads.append(t)
        wait_until(lambda n=n + 1: lease.waiters == n, f"{n + 1} waiter(s)")
    assert lease.queue.ahead(second) == [first]
    release()
    for t in threads:
        t.join(JOIN_S)
    assert got == ["first", "second", "no ticket"] and lease.waiters == 0 and len(lease.queue) == 0


def test_a_request_does_not_take_the_free_engine_ahead_of_one_planned_before_it():
    # the second request's predicted wait counted the first one's work: while the first is still planned, the second
    # waits for it even though the engine is free; the first one's plan may use the engine itself (an inline summary)
    lease = EngineLease()
    first, second = lease.queue.enter(), lease.queue.enter()
    second.done()  # planned; the first is still being planned
    got: list[str] = []

    def send(name: str, ticket: object) -> None:
        with lease.section(JOIN_S, ticket):  # type: ignore[arg-type]
            got.append(name)

    later = threading.Thread(target=send, args=("second", second), daemon=True)
    later.start()
    wait_until(lambda: lease.waiters == 1, "the second request waiting")
    with lease.section(JOIN_S):  # the first one's plan summarizes on the same engine: not held back
        got.append("summary")
    assert got == ["summary"] and not lease.busy and lease.waiters == 1
    earlier = threading.Thread(target=send, args=("first", first), daemon=True)
    earlier.start()  # its plan ended; it is sent
    for t in (earlier, later):
        t.join(JOIN_S)
    assert got == ["summary", "first", "second"] and lease.waiters == 0 and len(lease.queue) == 0


def test_a_plan_that_ends_unsent_or_never_ends_holds_nobody_back_for_long():
    lease = EngineLease()
    first, second = lease.queue.enter(), lease.queue.enter()
    second.done()
    got: list[str] = []

    def send() -> None:
        with lease.section(JOIN_S, second):
            got.append("second")

    t = threading.Thread(target=send, daemon=True)
    t.start()
    wait_until(lambda: lease.waiters == 1, "the second request waiting")
    assert got == []
    first.done()  # planned, then refused or only prepared: nothing is sent
    t.join(JOIN_S)
    assert got == ["second"] and not lease.busy
    stuck, third = lease.queue.enter(), lease.queue.enter()
    third.done()
    with lease.section(0.05, third) as waited:  # a plan that never ends: the request goes once its own bound has passed
        assert waited >= 0.05 and stuck in lease.queue.in_flight()
    assert not lease.busy and lease.waiters == 0


def test_busy_decision_and_wait_bound():
    assert busy_decision("trim", 1.0, 0.0, 0.1).plan_budget_s == 1.0
    d = busy_decision("trim", 1.0, 0.45, 0.1, ahead=2)
    assert d.plan_budget_s == pytest.approx(0.5) and d.counted_wait_s == 0.45 and not d.refuse
    assert d.plan_budget_s * 0.9 + 0.45 == pytest.approx(0.9)  # wait + prompt = budget × (1 − margin)
    assert busy_decision("trim", 1.0, 5.0, 0.1).plan_budget_s == MIN_PLAN_BUDGET_S
    assert busy_decision("wait", 1.0, 5.0, 0.1).plan_budget_s == 1.0
    assert busy_decision("trim", 1.0, 0.89, 0.1, refuse=True).refuse is False
    assert busy_decision("trim", 1.0, 0.9, 0.1, refuse=True).refuse is True
    assert busy_decision("trim", 1.0, 0.9, 0.1).refuse is False  # on_infeasible="best_effort": the minimal prompt
    assert busy_decision("wait", 1.0, 5.0, 0.1, refuse=True).refuse is False
    assert busy_decision("trim", None, 5.0, 0.0).plan_budget_s is None
    assert wait_bound_s(1.0, 0.5, 120.0) == 2.0 and wait_bound_s(None, None, 120.0) == 120.0
