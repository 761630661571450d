"""The front-ends of a fleet (:mod:`trimkit.fleet`): :class:`FleetFrontEnd` (sync) and
:class:`AsyncFleetFrontEnd`, and the streams their calls return (:class:`FleetStream`,
:class:`AsyncFleetStream`). Routing and failover decisions are :class:`FleetCall`'s;
each attempt goes out by the endpoint's own send path (:class:`FleetSend`, a
:class:`~trimkit.openai_wrapper.Send`), reported by its pipeline, and is read up to its first
token, where a failure still moves the request to another endpoint.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import weakref
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from trimkit.backends.base import Measurement
from trimkit.backends.server import NOT_GIVEN
from trimkit.errors import FleetOverloadedError, FleetUnavailableError, TrimkitError
from trimkit.errors import budget as valid_budget
from trimkit.fleet._endpoint import MIN_RETRY_AFTER_S, FleetEndpoint, RouteCost, best_route, describe_error, is_endpoint_failure, is_overload
from trimkit.frontend import Io, Steps, StreamReporter
from trimkit.messages import coerce_chunks, validate_messages
from trimkit.openai_wrapper import CallDeadlines, ClientChat, Send, call_arguments, call_options, call_routing_key
from trimkit.planning.queue import check_on_busy
from trimkit.prepared import Prepared
from trimkit.report import Report

log = logging.getLogger("trimkit")

#: an endpoint gets at least this long to produce the first token before the call moves on
MIN_ATTEMPT_S = 1.0
#: after a failover the plan's budget is what is left of it, but never under this share of it
MIN_REPLAN_SHARE = 0.1


@attrs.define
class Route:
    """Where one attempt of a call goes, and the request planned for it."""

    cost: RouteCost
    key: int  # its place in the endpoint's in-flight queue
    prepared: Prepared
    at: float = 0.0  # when it was routed (the fleet's clock)
    last: bool = False  # no other endpoint was left to try: the attempt gets the rest of the call's deadline

    @property
    def endpoint(self) -> FleetEndpoint:
        return self.cost.endpoint

    def release(self, *, failed: bool = False) -> None:
        self.endpoint.release(self.key, failed=failed)


class FleetCall:
    """One ``create()`` on a fleet: validated at once (bad input raises
    :class:`~trimkit.errors.InvalidInputError` before anything is sent), then routed
    (:meth:`route`) and, after each endpoint failure before the first token, routed again
    (:meth:`failed`)."""

    def __init__(self, fleet: FleetBase, messages: Any, rag_chunks: Any, budget: float | None, params: Mapping[str, Any], *,
                 on_busy: str | None = None, routing_key: Any = NOT_GIVEN) -> None:
        validate_messages(messages)
        #: the call's routing key as given (validated by :func:`~trimkit.openai_wrapper.call_routing_key`);
        #: each endpoint's wrapper decides the headers (:meth:`headers_for`)
        self.routing_key = routing_key
        self.on_busy = None if on_busy is None else check_on_busy(on_busy)
        self.chunks = coerce_chunks(rag_chunks)
        self.fleet = fleet
        self.messages, self.params = messages, params
        #: the prompt as given, counted for routing: (the tokenizer's name, its tokens); None until counted
        self.counted: tuple[str, list[int]] | None = None
        self.budget = fleet.ttft_budget_s if budget is None else valid_budget(budget)
        self.clock = fleet.clock
        self.start = self.clock()
        self.deadline_s = fleet.deadlines.first_chunk_s(self.budget)
        #: (endpoint, what went wrong) for every failed attempt of this call
        self.attempts: list[tuple[str, str]] = []
        self._tried: set[str] = set()
        self._overloaded: set[str] = set()  # endpoints that were alive but too busy for this call

    def headers_for(self, ep: FleetEndpoint) -> dict[str, str]:
        """The routing-key headers of this call on ``ep`` (a router behind a fleet endpoint reads them)."""
        return ep.front.routing.headers_for(self.routing_key, self.messages)

    # -- time ----------------------------------------------------------------------------------------
    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def budget_left_s(self) -> float | None:
        """The budget to plan against: all of it on the first attempt (planning is not in the
        TTFT, as on one endpoint); after a failover what is left of it, counted from the call."""
        if self.budget is None or not self.attempts:
            return self.budget
        return max(self.budget - self.elapsed_s(), MIN_REPLAN_SHARE * self.budget)

    def attempt_deadline_s(self, route: Route) -> float | None:
        """How long this attempt may wait for its first chunk before the call moves on: what is
        left of the budget or twice the predicted TTFT there (at least :data:`MIN_ATTEMPT_S`),
        within the call's deadline. None without a budget (the backend's timeouts apply)."""
        if self.budget is None or self.deadline_s is None:
            return None
        if route.last:  # nowhere else to go: wait in this endpoint's queue for the rest of the call's deadline
            return max(self.deadline_s - self.elapsed_s(), 0.05)
        p = route.prepared
        expected = route.cost.wait_s + route.endpoint.prefill_s(len(p.prompt_tokens), p.cached_tokens)
        bound = max(self.budget - self.elapsed_s(), 2.0 * expected, MIN_ATTEMPT_S)
        return max(min(bound, self.deadline_s - self.elapsed_s()), 0.05)

    # -- routing -------------------------------------------------------------------------------------
    def route(self) -> Route:
        """The best endpoint for this request, reserved, with the request planned there.
        Endpoints that fail while this is decided are taken out and the next is tried."""
        while True:
            candidates = self._candidates()
            if self.counted is None:  # counted once, by the endpoint with fewest in flight, for every route of this call
                counter = min(candidates, key=lambda ep: (ep.in_flight, self.fleet.endpoints.index(ep)))
                asked = self.clock()
                try:
                    self.counted = (counter.backend.tokenizer.name, counter.pipeline.untrimmed_tokens(self.messages, self.chunks, self.params))
                except TrimkitError as exc:
                    self.failed(counter, exc, since=asked, ahead=counter.in_flight)
                    continue
            tokens = self.counted[1]
            with self.fleet.routing_lock:
                now = self.clock()
                budget_left = self.budget_left_s() if self.budget is not None else None
                costs = [ep.cost(tokens, self.params, now, budget_left) for ep in candidates]
                best = best_route(costs)
                key = best.endpoint.reserve(best)
            try:
                prepared = self._prepare(best)
            except BaseException as exc:
                best.endpoint.release(key, failed=True)
                if not isinstance(exc, TrimkitError):
                    raise
                self.failed(best.endpoint, exc, since=now, ahead=best.in_flight)
                continue
            best.endpoint.planned(key, prepared.prompt_tokens, prepared.cached_tokens)
            return Route(best, key, prepared, at=now, last=len(candidates) == 1)

    def _candidates(self) -> list[FleetEndpoint]:
        if self.deadline_s is not None and self.elapsed_s() >= self.deadline_s:
            raise self.unavailable(f"no endpoint produced a first token within the call's deadline of {self.deadline_s:.2f} s")
        up = self.fleet.in_rotation(exclude=self._tried)
        if not up:
            raise self.unavailable("no endpoint of the fleet is in rotation" if not self._overloaded else "every endpoint was too busy")
        return up

    def _prepare(self, cost: RouteCost) -> Prepared:
        ep = cost.endpoint
        plan_budget = self.budget_left_s()
        name, tokens = self.counted or ("", None)
        untrimmed = tokens if ep.backend.tokenizer.name == name else None  # counted by the same tokenizer: not again
        prepared = ep.pipeline.prepare(self.messages, self.chunks, self.params, ttft_budget_s=plan_budget, queue_wait_s=cost.wait_s,
                                       on_busy=self.on_busy, untrimmed=untrimmed)
        for label, error in self.attempts:
            prepared = prepared.with_warning(
                f"failover: {label} failed before the first token ({error}); re-planned on {ep.label}"
                + (f" with {plan_budget:.3f} s of the {self.budget:.3f} s budget ({self.elapsed_s():.3f} s spent)" if self.budget is not None else "")
            )
        return prepared

    # -- failures ------------------------------------------------------------------------------------
    def failed(self, ep: FleetEndpoint, exc: BaseException, route: Route | None = None, *, since: float | None = None,
               ahead: int = 0) -> None:
        """``ep`` failed before this request's first token: take it out of rotation and let the
        call go on elsewhere; an error that is the request's own (not the endpoint's) is raised.
        A timeout (or 429) of an endpoint that is alive (``route``'s, or one asked at ``since``
        with ``ahead`` of this client's requests there: :meth:`~trimkit.fleet.FleetEndpoint.alive_since`)
        is overload: it stays in rotation, and the call goes on elsewhere."""
        if not is_endpoint_failure(exc):
            raise exc
        if route is not None:
            since, ahead = route.at, route.cost.in_flight
        if is_overload(exc) and ep.alive_since(self.start if since is None else since, ahead=ahead):
            self._overloaded.add(ep.label)
            self._tried.add(ep.label)
            self.attempts.append((ep.label, f"overloaded (kept in rotation): {describe_error(exc)}"))
            log.info("trimkit: fleet endpoint %s is busy (%s); it stays in rotation", ep.label, describe_error(exc))
            return
        ep.mark_down(exc)
        self._tried.add(ep.label)
        self.attempts.append((ep.label, describe_error(exc)))

    def unavailable(self, why: str) -> FleetUnavailableError:
        """The error when nothing is left to try: what this call tried, and every other endpoint's
        state; :class:`~trimkit.fleet.FleetOverloadedError` when an endpoint tried was
        alive but busy (the fleet is not unavailable: retry after ``retry_after_s``)."""
        if self._overloaded or any(ep.busy_not_dead for ep in self.fleet.endpoints):
            return self.overloaded(why)
        attempts = list(self.attempts)
        for ep in self.fleet.endpoints:
            if ep.label not in self._tried and not ep.is_up:
                attempts.append((ep.label, f"out of rotation: {ep.last_error or 'not reached yet'}"))
        tried = "; ".join(f"{label}: {error}" for label, error in attempts) or "nothing"
        return FleetUnavailableError(f"{why} ({tried})", attempts=attempts)


    def overloaded(self, why: str) -> FleetOverloadedError:
        now = self.clock()
        waits = [ep.predicted_wait_s(now) for ep in self.fleet.endpoints if ep.is_up or ep.busy_not_dead]
        retry_after = max(min(waits, default=0.0), MIN_RETRY_AFTER_S)
        tried = "; ".join(f"{label}: {error}" for label, error in self.attempts) or "nothing"
        return FleetOverloadedError(f"the fleet is overloaded: {why}; retry in about {retry_after:.1f} s ({tried})",
                                    retry_after_s=retry_after, attempts=self.attempts)


__all__ = ["FleetBase", "FleetFrontEnd", "AsyncFleetFrontEnd", "FleetStream", "AsyncFleetStream"]


# -- the streams a call returns ---------------------------------------------------------------------
class _FleetStreamBase:
    """What the sync and async fleet streams share: the endpoint's reporting stream, the chunks
    read before the first token (held back until it is known the endpoint answers), and the
    request's place in the endpoint's queue, given back once when the stream ends, fails, is
    closed or is garbage-collected."""

    def __init__(self, fleet: FleetBase, route: Route, inner: StreamReporter) -> None:
        self.fleet = fleet
        self.endpoint = route.endpoint
        self.key = route.key
        #: the endpoint's own reporting stream
        self.inner = inner
        self._head: list[Any] = []
        self._release = weakref.finalize(self, route.endpoint.release, route.key)

    @property
    def report(self) -> Report | None:
        """The report, once the stream is exhausted (``report.endpoint`` names the replica)."""
        return self.inner.report

    def _has_output(self) -> bool:
        return self.inner.timed.first_output_at is not None

    def _failed_early(self) -> None:
        """The endpoint failed before the first token: it never took the request."""
        self._release.detach()
        self.endpoint.release(self.key, failed=True)

    def _finished(self) -> None:
        if self._release.alive:
            self._release()
            report = self.inner.report
            if report is not None:
                self.endpoint.observe(self.inner.params, report.measurement)
                self.fleet.record(report)

    def _broke(self, exc: BaseException) -> None:
        """The stream failed after its first token: the caller gets the error (with its report)."""
        self._release()
        if isinstance(exc, TrimkitError) and is_endpoint_failure(exc):
            self.endpoint.mark_down(exc)


class FleetStream(_FleetStreamBase):
    """What ``create(stream=True)`` returns: iterate it like one endpoint's stream (the client's
    chunk objects, or dicts for URLs); ``.report`` once exhausted; ``with`` and :meth:`close` work."""

    def open(self) -> None:
        """Read up to the first token (chunks before it are held back and yielded first)."""
        try:
            while not self._has_output():
                self._head.append(next(self.inner))  # type: ignore[call-overload]
        except StopIteration:
            self._finished()
            return
        except BaseException:
            self._failed_early()
            self.inner.close()  # type: ignore[attr-defined]
            raise
        self.endpoint.first_token(self.key)

    def __iter__(self) -> FleetStream:
        return self

    def __next__(self) -> Any:
        if self._head:
            return self._head.pop(0)
        try:
            chunk = next(self.inner)  # type: ignore[call-overload]
        except StopIteration:
            self._finished()
            raise
        except BaseException as exc:
            self._broke(exc)
            raise
        self.endpoint.progressed()
        return chunk

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]
        self._release()

    def __enter__(self) -> FleetStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncFleetStream(_FleetStreamBase):
    """:class:`FleetStream` for ``async for``; ``async with`` and ``await close()`` work."""

    async def open(self) -> None:
        try:
            while not self._has_output():
                self._head.append(await self.inner.__anext__())  # type: ignore[attr-defined]
        except StopAsyncIteration:
            self._finished()
            return
        except BaseException:
            self._failed_early()
            await self.inner.close()  # type: ignore[attr-defined]
            raise
        self.endpoint.first_token(self.key)

    def __aiter__(self) -> AsyncFleetStream:
        return self

    async def __anext__(self) -> Any:
        if self._head:
            return self._head.pop(0)
        try:
            chunk = await self.inner.__anext__()  # type: ignore[attr-defined]
        except StopAsyncIteration:
            self._finished()
            raise
        except BaseException as exc:
            self._broke(exc)
            raise
        self.endpoint.progressed()
        return chunk

    async def close(self) -> None:
        await self.inner.close()  # type: ignore[attr-defined]
        self._release()

    async def __aenter__(self) -> AsyncFleetStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


# -- the front-ends ---------------------------------------------------------------------------------
class FleetBase:
    """What the sync and async fleet front-ends share: the endpoints, the default budget, the
    reports, and which endpoints are in rotation. Build one with :func:`wrap_fleet`."""

    is_async = False

    def __init__(self, endpoints: Sequence[FleetEndpoint], *, ttft_budget_s: float | None = None, retry_deadline_s: float | None = None,
                 unbudgeted_deadline_s: float = 30.0) -> None:
        #: the replicas, in the order given (ties go to the earlier one)
        self.endpoints = tuple(endpoints)
        self._budget = None if ttft_budget_s is None else valid_budget(ttft_budget_s)
        #: a call's deadlines (as for one endpoint: the first chunk by max(2 × budget, 5 s))
        self.deadlines = CallDeadlines(unbudgeted_deadline_s, retry_deadline_s)
        self.clock = time.monotonic
        #: held while a request is priced and reserved, so that concurrent calls see each other
        self.routing_lock = threading.Lock()
        self.reports: list[Report] = []  # most recent last, every endpoint's; bounded
        self.max_reports = 256
        self._last_report: Report | None = None
        self._lock = threading.Lock()
        self.chat = ClientChat(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.endpoints)})"

    def _client_part(self, *path: str) -> Any:
        raise AttributeError(f"{'.'.join(path)}: a fleet has no client of its own")

    @property
    def ttft_budget_s(self) -> float | None:
        """The default TTFT budget of a call (a per-call ``ttft_budget_s=`` overrides it)."""
        return self._budget

    @ttft_budget_s.setter
    def ttft_budget_s(self, value: float | None) -> None:
        self._budget = None if value is None else valid_budget(value)
        for ep in self.endpoints:
            if ep.front is not None:
                ep.front.ttft_budget_s = self._budget
                ep.front.bound_side_requests()

    @property
    def last_report(self) -> Report | None:
        """The report of the most recent finished request, whichever endpoint served it."""
        with self._lock:
            return self._last_report

    def record(self, report: Report) -> None:
        with self._lock:
            self._last_report = report
            self.reports.append(report)
            del self.reports[: -self.max_reports]

    def start(self, *, parallel: bool = False) -> None:
        """Reach every endpoint (build its wrapper: profile, calibration): one after the other,
        or in parallel threads (servers on separate machines). One that is down joins later."""
        if parallel and len(self.endpoints) > 1:
            with ThreadPoolExecutor(max_workers=len(self.endpoints), thread_name_prefix="trimkit-fleet-start") as pool:
                list(pool.map(lambda ep: ep.start(), self.endpoints))
        else:
            for ep in self.endpoints:
                ep.start()

    def in_rotation(self, *, exclude: Collection[str] = ()) -> list[FleetEndpoint]:
        """The endpoints that may take a request now (probing, in the background, those due a
        probe). When none is up, the ones due a probe are probed here first."""
        for ep in self.endpoints:
            ep.maybe_probe()
        up = [ep for ep in self.endpoints if ep.is_up and ep.label not in exclude]
        if not up:
            for ep in self.endpoints:
                if ep.label not in exclude:
                    ep.maybe_probe(wait=True)
            up = [ep for ep in self.endpoints if ep.is_up and ep.label not in exclude]
        return up

    def probe_now(self) -> list[str]:
        """Probe every endpoint out of rotation now, whatever its backoff; the labels back in rotation."""
        for ep in self.endpoints:
            if not ep.is_up:
                ep.health.retry_at = 0.0
                ep.maybe_probe(wait=True)
        return [ep.label for ep in self.endpoints if ep.is_up]

    def idle(self, timeout_s: float | None = None) -> None:
        """Finish every endpoint's pending background summaries now."""
        for ep in self.endpoints:
            if ep.pipeline is not None:
                ep.pipeline.idle(timeout_s)

    def call_steps(self, kwargs: dict[str, Any]) -> Steps:
        """A ``create()`` call, sync or async: routed (:class:`FleetCall`), then sent through the
        endpoint's send path (:class:`FleetSend`); a failure before the first token routes it
        again."""
        messages, rag_chunks, budget, params, stream = call_arguments(kwargs)
        call = FleetCall(self, messages, rag_chunks, budget, params, routing_key=call_routing_key(kwargs), **call_options(kwargs))
        while True:
            route = yield Io(call.route, functools.partial(_routed, call))
            send = FleetSend(self, call, route, params, stream)
            try:
                out = yield from send.reply(route.prepared)
            except TrimkitError as exc:  # before the first token: the next endpoint, if it was this one's fault
                call.failed(route.endpoint, exc, route)
                continue
            return (yield from send.completion(out))


class FleetSend(Send):
    """One attempt of a fleet's call, on the endpoint it was routed to: that endpoint's send
    path (:class:`~trimkit.openai_wrapper.Send`) with the attempt's deadline, the request's
    place in the endpoint's queue, and its stream read up to the first token (:class:`FleetStream`)."""

    def __init__(self, fleet: FleetBase, call: FleetCall, route: Route, params: Mapping[str, Any], stream: bool) -> None:
        super().__init__(route.endpoint.front, params, stream, call.headers_for(route.endpoint))
        self.fleet, self.call, self.route = fleet, call, route

    def stream_args(self, prepared: Prepared) -> dict[str, Any]:
        deadline = self.call.attempt_deadline_s(self.route)
        return {"prompt_tokens": prepared.prompt_tokens, "retry_deadline_s": deadline, "deadline_s": deadline}

    def answered(self, prepared: Prepared, m: Measurement) -> None:
        """Sent whole (``n > 1``) and answered: it leaves the queue; its report."""
        ep = self.route.endpoint
        ep.sent(self.route.key, prepared.prompt_tokens)
        self.route.release()
        self.fleet.record(ep.pipeline.finish(prepared, m, self.params))
        ep.observe(self.params, m)

    def went_out(self, prepared: Prepared) -> None:
        self.route.endpoint.sent(self.route.key, prepared.prompt_tokens)

    def failed(self) -> None:
        self.route.release(failed=True)

    def reading(self, rs: StreamReporter) -> Steps:
        fs = (AsyncFleetStream if self.front.is_async else FleetStream)(self.fleet, self.route, rs)
        yield Io(fs.open, fs.open)
        return fs


class FleetFrontEnd(FleetBase):
    """Several OpenAI-compatible endpoints behind one sync ``chat.completions.create`` (see the
    module). Returns what one endpoint's wrapper returns: a ``ChatCompletion`` (a dict for
    URLs), or with ``stream=True`` a :class:`FleetStream`. ``close()`` / ``with`` close every
    endpoint (and the clients wrapped)."""

    def close(self) -> None:
        for ep in self.endpoints:
            ep.close()

    def __enter__(self) -> FleetFrontEnd:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _routed(call: FleetCall) -> Route:
    """``call.route()`` in a worker thread. The thread cannot be stopped: if the caller is
    cancelled while it runs (``asyncio.wait_for``, a task cancelled), the reservation it makes
    is given back as soon as it is made — an endpoint's in-flight count never keeps a request
    whose caller is gone."""
    future = asyncio.ensure_future(asyncio.to_thread(call.route))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_release_abandoned)
        raise


def _release_abandoned(future: asyncio.Future[Route]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release(failed=True)


class AsyncFleetFrontEnd(FleetBase):
    """:class:`FleetFrontEnd` for ``openai.AsyncOpenAI`` clients (or ``asynchronous=True``):
    ``await chat.completions.create(...)``; routing and planning run in a worker thread, off the
    event loop. Build it before the loop starts or through ``asyncio.to_thread`` (it may calibrate)."""

    is_async = True

    async def close(self) -> None:
        for ep in self.endpoints:
            closing = ep.close()
            if closing is not None:
                await closing

    async def __aenter__(self) -> AsyncFleetFrontEnd:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
