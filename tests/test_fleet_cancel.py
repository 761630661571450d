"""An async fleet request cancelled at any point (``asyncio.wait_for``, a task cancelled) gives its
route reservation back: the endpoints' in-flight counts return to zero, so the next request on an
idle fleet is not planned around a phantom wait (issue 34, item 2). REAL loopback servers."""

from __future__ import annotations

import asyncio
import threading

import pytest

import trimkit
from tests.test_server_faults import ASK, PROFILE, FaultServer, hang
from trimkit.fleet import FleetCall

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def servers():
    s = [FaultServer(), FaultServer()]
    yield s
    for x in s:
        x.close()


def _fleet(servers):
    return trimkit.wrap_url([s.base_url for s in servers], model="m", profile=PROFILE, ttft_budget_s=0.5, retry_deadline_s=1.0,
                            summarizer=None, asynchronous=True, read_load=False)


def test_a_request_cancelled_while_it_is_routed_gives_its_reservation_back(servers, monkeypatch):
    fleet = _fleet(servers)
    reserved, go_on = threading.Event(), threading.Event()
    prepare = FleetCall._prepare

    def slow_prepare(self, cost):  # the route is reserved: the caller goes away now
        reserved.set()
        go_on.wait(10)
        return prepare(self, cost)

    monkeypatch.setattr(FleetCall, "_prepare", slow_prepare)

    async def run() -> None:
        task = asyncio.ensure_future(fleet.chat.completions.create(messages=ASK))
        await asyncio.to_thread(reserved.wait, 10)
        assert sum(ep.in_flight for ep in fleet.endpoints) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go_on.set()  # the worker thread finishes routing after its caller is gone
        for _ in range(200):
            if sum(ep.in_flight for ep in fleet.endpoints) == 0:
                break
            await asyncio.sleep(0.01)
        await fleet.close()

    asyncio.run(run())
    assert [ep.in_flight for ep in fleet.endpoints] == [0, 0]


def test_requests_cancelled_before_their_first_token_leave_no_request_in_flight(servers):
    for s in servers:
        s.chat(hang)
    fleet = _fleet(servers)

    async def run() -> None:
        for _ in range(6):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(fleet.chat.completions.create(messages=ASK), 0.05)
        await fleet.close()

    asyncio.run(run())
    for _ in range(200):  # a routing thread still running gives its reservation back when it ends
        if sum(ep.in_flight for ep in fleet.endpoints) == 0:
            break
        threading.Event().wait(0.01)
    assert [ep.in_flight for ep in fleet.endpoints] == [0, 0]
