"""The front-ends of a fleet (:mod:`trimkit.fleet`): :class:`FleetFrontEnd` (sync) and
:class:`AsyncFleetFrontEnd`, and the streams their calls return (:class:`FleetStream`,
:class:`AsyncFleetStream`). Routing and failover decisions are :class:`~trimkit.fleet_call.FleetCall`'s;
these only send — through the chosen endpoint's backend, reported by its pipeline — and read each
attempt up to its first token, where a failure still moves the request to another endpoint.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trimkit.call_deadlines import CallDeadlines
from trimkit.errors import TrimkitError
from trimkit.fleet_call import FleetCall, Route
from trimkit.fleet_endpoint import FleetEndpoint, is_endpoint_failure
from trimkit.frontend import AsyncReportingStream, ReportingOpenAIStream, StreamReporter, send_params
from trimkit.openai_wrapper import call_arguments, call_options
from trimkit.report import Report
from trimkit.validation import budget as valid_budget

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
class _Completions:
    def __init__(self, owner: FleetBase) -> None:
        self._owner = owner

    def create(self, **kwargs: Any) -> Any:
        """Like ``client.chat.completions.create``, routed to the best endpoint, inside the TTFT budget."""
        return self._owner._create(kwargs)


class _AsyncCompletions(_Completions):
    async def create(self, **kwargs: Any) -> Any:  # type: ignore[override]
        """Like ``await client.chat.completions.create``, routed to the best endpoint, inside the TTFT budget."""
        return await self._owner._create(kwargs)


class _Chat:
    def __init__(self, owner: FleetBase) -> None:
        self.completions = _AsyncCompletions(owner) if owner.is_async else _Completions(owner)


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
        self.chat = _Chat(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.endpoints)})"

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

    def _create(self, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _answered_whole(self, route: Route, prepared: Any, m: Any, params: Mapping[str, Any]) -> None:
        """A request sent whole (``n > 1``) was answered: it leaves the queue; its report."""
        ep = route.endpoint
        ep.sent(route.key, prepared.prompt_tokens)
        route.release()
        self.record(ep.pipeline.finish(prepared, m, params))
        ep.observe(params, m)


class FleetFrontEnd(FleetBase):
    """Several OpenAI-compatible endpoints behind one sync ``chat.completions.create`` (see the
    module). Returns what one endpoint's wrapper returns: a ``ChatCompletion`` (a dict for
    URLs), or with ``stream=True`` a :class:`FleetStream`. ``close()`` / ``with`` close every
    endpoint (and the clients wrapped)."""

    def _create(self, kwargs: dict[str, Any]) -> Any:
        messages, rag_chunks, budget, params, stream = call_arguments(kwargs)
        call = FleetCall(self, messages, rag_chunks, budget, params, **call_options(kwargs))
        while True:
            route = call.route()
            try:
                sent = self._send(call, route, params, stream)
            except TrimkitError as exc:  # before the first token: the next endpoint, if it was this one's fault
                call.failed(route.endpoint, exc, route)
                continue
            if not isinstance(sent, FleetStream) or stream:
                return sent
            for _ in sent:
                pass
            return route.endpoint.front.assemble(sent.inner)

    def _send(self, call: FleetCall, route: Route, params: Mapping[str, Any], stream: bool) -> Any:
        """Send one attempt and read it up to its first token."""
        ep = route.endpoint
        unstreamed = ep.front.unstreamed(route.prepared, params, stream)
        try:
            if unstreamed is not None:
                prepared, args = unstreamed
                response, m = ep.backend.complete(prepared.messages, send_params(params), **args)
                self._answered_whole(route, prepared, m, params)
                return response
            prepared = ep.pipeline.sent(route.prepared)
            deadline = call.attempt_deadline_s(route)
            ts = ep.backend.send(prepared.messages, send_params(params), prompt_tokens=prepared.prompt_tokens, retry_deadline_s=deadline,
                                 deadline_s=deadline)
            ep.sent(route.key, prepared.prompt_tokens)
        except BaseException:
            route.release(failed=True)
            raise
        fs = FleetStream(self, route, ReportingOpenAIStream(ts, ep.pipeline, prepared, params))
        fs.open()
        return fs

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

    async def _create(self, kwargs: dict[str, Any]) -> Any:  # type: ignore[override]
        messages, rag_chunks, budget, params, stream = call_arguments(kwargs)
        call = FleetCall(self, messages, rag_chunks, budget, params, **call_options(kwargs))
        while True:
            route = await _routed(call)
            try:
                sent = await self._send(call, route, params, stream)
            except TrimkitError as exc:
                call.failed(route.endpoint, exc, route)
                continue
            if not isinstance(sent, AsyncFleetStream) or stream:
                return sent
            async for _ in sent:
                pass
            return route.endpoint.front.assemble(sent.inner)

    async def _send(self, call: FleetCall, route: Route, params: Mapping[str, Any], stream: bool) -> Any:
        ep = route.endpoint
        unstreamed = ep.front.unstreamed(route.prepared, params, stream)
        try:
            if unstreamed is not None:
                prepared, args = unstreamed
                response, m = await ep.backend.acomplete(prepared.messages, send_params(params), **args)
                self._answered_whole(route, prepared, m, params)
                return response
            prepared = ep.pipeline.sent(route.prepared)
            deadline = call.attempt_deadline_s(route)
            ts = await ep.backend.asend(prepared.messages, send_params(params), prompt_tokens=prepared.prompt_tokens,
                                        retry_deadline_s=deadline, deadline_s=deadline)
            ep.sent(route.key, prepared.prompt_tokens)
        except BaseException:
            route.release(failed=True)
            raise
        fs = AsyncFleetStream(self, route, AsyncReportingStream(ts, ep.pipeline, prepared, params))
        await fs.open()
        return fs

    async def close(self) -> None:
        for ep in self.endpoints:
            closing = ep.close()
            if closing is not None:
                await closing

    async def __aenter__(self) -> AsyncFleetFrontEnd:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
