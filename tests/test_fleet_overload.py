"""Overload through a fleet is not failure (issue 34, item 3): two REAL loopback servers that run
one request at a time and queue the rest (as llama.cpp-style servers do), twelve concurrent
requests through ``wrap_url([a, b])``. A timeout on a replica that is working through this
client's requests keeps it in rotation; every request ends in an answer or a typed
:class:`~trimkit.fleet.FleetOverloadedError` with a retry hint — never
``FleetUnavailableError`` while both servers are alive. Nothing here asserts a speed: which
requests are answered in time depends on the machine, what each outcome may be does not."""

from __future__ import annotations

import select
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import trimkit
from tests.test_server_faults import ASK, GOOD_STREAM, PROFILE, FaultServer, sse_reply
from trimkit.errors import FleetOverloadedError, FleetUnavailableError, OverloadedError, ServerTimeoutError
from trimkit.fleet import FleetCall, Route

pytestmark = pytest.mark.timeout(120)

WORK_S = 1.5  # what one request takes on a server: six of them take longer than the call's 5 s deadline


def one_at_a_time(work_s: float):
    """A single-slot server: requests queue on a lock; a request whose client went away while it
    queued is dropped (llama.cpp drops a cancelled task), the others take ``work_s`` each."""
    lock = threading.Lock()

    def reply(h, body):
        with lock:
            readable, _, _ = select.select([h.connection], [], [], 0)
            if readable and not h.connection.recv(1, 2):  # MSG_PEEK: the client closed its end
                return
            if h.server.owner.released.wait(work_s):
                return
            sse_reply(*GOOD_STREAM)(h, body)

    return reply


@pytest.fixture
def servers():
    s = [FaultServer(), FaultServer()]
    for x in s:
        x.chat(one_at_a_time(WORK_S))
    yield s
    for x in s:
        x.close()


def test_twelve_concurrent_requests_on_two_busy_replicas_lose_none_to_unavailability(servers):
    fleet = trimkit.wrap_url([s.base_url for s in servers], model="m", profile=PROFILE, ttft_budget_s=0.5, summarizer=None,
                             read_load=False)
    outcomes: list[object] = []

    def one(_: int) -> None:
        try:
            outcomes.append(fleet.chat.completions.create(messages=ASK))
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcomes.append(exc)

    try:
        with ThreadPoolExecutor(12) as pool:
            list(pool.map(one, range(12)))
        assert len(outcomes) == 12
        for out in outcomes:
            if isinstance(out, BaseException):
                assert isinstance(out, FleetOverloadedError), f"{type(out).__name__}: {out}"
                assert out.retry_after_s > 0 and "overloaded" in str(out)
            else:
                assert out["choices"][0]["message"]["content"] == "Hello there"
        assert [ep.is_up for ep in fleet.endpoints] == [True, True]  # a busy replica is not a dead one
        assert [ep.in_flight for ep in fleet.endpoints] == [0, 0]
    finally:
        fleet.close()


class _Fleet:
    def __init__(self, endpoints):
        self.endpoints = endpoints
        self.ttft_budget_s = 1.0
        self.clock = lambda: 100.0
        self.routing_lock = threading.Lock()

        class _D:
            def first_chunk_s(self, budget):
                return 5.0

        self.deadlines = _D()

    def in_rotation(self, *, exclude=()):
        return [ep for ep in self.endpoints if ep.is_up and ep.label not in exclude]


class _Ep:
    def __init__(self, label, progress=None):
        self.label, self.is_up, self.last_progress_at, self.down = label, True, progress, []
        self.busy_not_dead = False

    def alive_since(self, since, *, ahead=0):
        return ahead > 0 or (self.last_progress_at is not None and self.last_progress_at >= since)

    def mark_down(self, exc):
        self.down.append(exc)
        self.is_up = False

    def predicted_wait_s(self, now=None):
        return 2.5


def _route(ep, *, at=100.0, ahead=0):
    class _Cost:
        endpoint = ep
        in_flight = ahead

    return Route(_Cost(), 1, None, at=at)  # type: ignore[arg-type]


def test_a_timeout_on_a_live_endpoint_is_overload_and_on_a_silent_one_failure():
    busy, silent, answering = _Ep("busy"), _Ep("silent"), _Ep("answering", progress=100.5)
    call = FleetCall(_Fleet([busy, silent, answering]), ASK, None, 1.0, {})
    timeout = ServerTimeoutError("no first chunk")
    call.failed(busy, timeout, _route(busy, ahead=2))  # this client's own requests were ahead of it
    call.failed(answering, timeout, _route(answering))  # it sent chunks while the request waited
    assert busy.is_up and answering.is_up and not busy.down
    call.failed(silent, timeout, _route(silent))  # nothing ahead, silent since: down
    assert not silent.is_up
    err = call.unavailable("every endpoint was too busy")
    assert isinstance(err, FleetOverloadedError) and isinstance(err, OverloadedError) and isinstance(err, TimeoutError)
    assert not isinstance(err, FleetUnavailableError)
    assert err.retry_after_s == 2.5 and len(err.attempts) == 3
    fresh = FleetCall(_Fleet([silent]), ASK, None, 1.0, {})
    fresh.failed(silent, timeout, _route(silent))
    assert isinstance(fresh.unavailable("nothing"), FleetUnavailableError)  # a dead fleet is still said to be one
