"""A fleet of OpenAI-compatible endpoints behind one TTFT budget: routing and failover from the client.

``trimkit.wrap_url([...])`` / ``trimkit.wrap([client, ...])`` give a :class:`FleetFrontEnd` (:class:`AsyncFleetFrontEnd`). It only routes: each endpoint is
a wrapper of its own (:class:`FleetEndpoint`) whose pipeline plans and sends; a request goes to the lowest predicted TTFT (:class:`FleetCall`), and one that
fails before its first token to the next. docs/scaling.md §2."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from trimkit.backends.base import Io, Steps, client_is_async, is_openai_client
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.server import NOT_GIVEN, RoutingOptions, ServerLoadReader
from trimkit.backends.transport import Wait, normalize_base_url
from trimkit.errors import (
    BackendError,
    FleetOverloadedError,
    FleetUnavailableError,
    InvalidInputError,
    MalformedReplyError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    StreamInterruptedError,
    TransientServerError,
    TrimkitError,
    positive_finite,
)
from trimkit.errors import budget as valid_budget
from trimkit.frontend import AsyncClosing, AsyncReportingStream, Closing, ReportingStream
from trimkit.openai_wrapper import AsyncTrimmedOpenAI, CallDeadlines, ClientChat, Send, TrimmedOpenAI, call_arguments, split_backend_kwargs, wrap_one_url
from trimkit.pipeline import Prepared, Request
from trimkit.planning.costs import CacheState
from trimkit.planning.profile import Profile
from trimkit.planning.queue import EngineQueue, Ticket, check_on_busy
from trimkit.report import Report, valid_tokens_per_s_target

__all__ = ["wrap_fleet", "wrap_url", "FleetFrontEnd", "AsyncFleetFrontEnd", "FleetStream", "AsyncFleetStream", "FleetEndpoint",
           "FleetUnavailableError", "FleetOverloadedError", "FLEET_BACKEND_DEFAULTS"]

log = logging.getLogger("trimkit")

#: requests an engine runs at once when the server does not say (llama.cpp-style servers: one per slot)
ENGINE_SLOTS = {"vllm": 64, "sglang": 64}
#: predicted TTFTs closer than this share are a tie (predictions are never that sure)
TIE_SHARE = 0.01
#: the shortest retry hint an overloaded fleet gives
MIN_RETRY_AFTER_S = 0.5
#: an endpoint gets at least this long to produce the first token before the call moves on
MIN_ATTEMPT_S = 1.0
#: after a failover the plan's budget is what is left of it, but never under this share of it
MIN_REPLAN_SHARE = 0.1
#: backend settings a fleet uses unless given: retry one endpoint briefly, then fail over
FLEET_BACKEND_DEFAULTS: Mapping[str, Any] = {"max_attempts": 2, "retry_backoff_s": 0.05, "retry_backoff_max_s": 0.2}


def slot_wait_s(remaining_s: Sequence[float], slots: int) -> float:
    """How long a new request waits on a server running ``slots`` requests at once, first come
    first served, behind requests with ``remaining_s`` of predicted work each."""
    free = [0.0] * max(int(slots), 1)  # when each slot is free
    for work in remaining_s:
        heapq.heapreplace(free, free[0] + max(work, 0.0))
    return free[0]


def is_overload(exc: BaseException) -> bool:
    """No first chunk within the attempt's deadline, or 429: what a live but busy endpoint gives."""
    return isinstance(exc, ServerTimeoutError) or (isinstance(exc, TransientServerError) and exc.status == 429)


def is_endpoint_failure(exc: BaseException) -> bool:
    """The endpoint (not the request) failed: unreachable, timed out, 429/5xx, a stream broken off."""
    if isinstance(exc, (ServerUnreachableError, TransientServerError, StreamInterruptedError)):
        return True
    return isinstance(exc, ServerError) and not isinstance(exc, MalformedReplyError) and (exc.status or 0) >= 500


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


@attrs.frozen
class RouteCost:
    """A request priced on one endpoint: the wait behind the requests ahead, the prefix held there, the untrimmed prompt's prefill and decode; with a
    budget, the prompt tokens it could keep within it (``kept_tokens``)."""

    endpoint: FleetEndpoint = attrs.field(eq=False, repr=lambda e: e.label)
    wait_s: float
    cached_tokens: int
    prefill_s: float
    decode_s: float
    in_flight: int
    kept_tokens: int | None = None
    budget_s: float | None = None

    @property
    def fits(self) -> bool:
        return self.budget_s is None or self.ttft_s <= self.budget_s

    @property
    def planned_prefill_s(self) -> float:
        """The prefill counted in the queue until the request is planned: at most the budget left after the wait."""
        if self.budget_s is None:
            return self.prefill_s
        return min(self.prefill_s, max(self.budget_s - self.wait_s, 0.0))

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.prefill_s


def best_route(costs: Sequence[RouteCost]) -> RouteCost:
    """The lowest predicted TTFT (ties, within :data:`TIE_SHARE` and a millisecond: fewest in flight, then the first). When no endpoint fits the budget
    untrimmed, the one keeping the most of the prompt wins: a replica holding the prefix behind a long queue would be trimmed to nothing."""
    fitting = [c for c in costs if c.fits]
    if not fitting and all(c.kept_tokens is not None for c in costs):
        most = max(c.kept_tokens or 0 for c in costs)
        costs = [c for c in costs if (c.kept_tokens or 0) >= most * (1.0 - TIE_SHARE)]
    elif fitting:
        costs = fitting
    best_s = min(c.ttft_s for c in costs)
    return min((c for c in costs if c.ttft_s <= best_s * (1.0 + TIE_SHARE) + 0.001), key=lambda c: c.in_flight)


class FleetEndpoint:
    """One replica: ``label`` (its base URL) names it in reports; ``build()`` makes its front-end (calibrating unless a profile is stored or given), at
    construction or when a probe finds it up. ``slots``: requests the server runs at once (None: ``/slots``, else :data:`ENGINE_SLOTS`, else 1);
    ``held_prompts``: prompts its prefix cache holds (None: one per slot). A failure takes it out of rotation for ``probe_after_s``; a probe then puts it
    back, or doubles the wait, up to ``probe_max_s``."""

    def __init__(self, label: str, backend: OpenAIHTTPBackend, build: Callable[[], Any], *, slots: int | None = None,
                 held_prompts: int | None = None, load: ServerLoadReader | None = None, probe_after_s: float = 1.0, probe_max_s: float = 30.0,
                 probe_timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.backend = backend
        self.build = build
        #: the front-end (its pipeline, profile, reports); None until the endpoint was first reached
        self.front: Any = None
        self.probe_after_s, self.probe_max_s = probe_after_s, probe_max_s
        #: out of rotation until then, when a probe is due (None: in rotation), for ``backoff_s``; ``last_error``: why
        self.retry_at: float | None = None
        self.backoff_s = 0.0
        self.last_error: str | None = None
        self._probing = False
        #: this client's requests in flight here (answer lengths learned as on an in-process engine)
        self.queue = EngineQueue(clock)
        #: the prompts its prefix cache is predicted to hold, by request: the last ``held_prompts`` sent
        self.held: dict[int, tuple[int, ...]] = {}
        self.load = load
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self._slots = slots
        #: how many recent prompts its prefix cache holds (None: one per slot)
        self.held_prompts = held_prompts
        self._lock = threading.Lock()
        #: when this endpoint last sent this client a chunk or finished a request of its (clock)
        self.last_progress_at: float | None = None
        #: taken out of rotation by a timeout (or 429) alone, not a refusal or an error
        self.timed_out = False
        # the backend predicts its cache from the prompts held here
        backend.cache_view, backend.cache_state_view = lambda tokens: self.cache_state().cached(tokens), self.cache_state

    def __repr__(self) -> str:
        state = "up" if self.is_up else f"down ({self.last_error})"
        return f"FleetEndpoint({self.label!r}, {state}, {self.in_flight} in flight)"

    @property
    def is_up(self) -> bool:
        """In rotation: reached at least once and not marked down since."""
        return self.front is not None and self.retry_at is None

    @property
    def in_flight(self) -> int:
        return len(self.queue)

    @property
    def profile(self) -> Any:
        return self.front.profile if self.front is not None else None

    @property
    def pipeline(self) -> Any:
        return self.front.pipeline if self.front is not None else None

    @property
    def slots(self) -> int:
        if self._slots is not None:
            return self._slots
        load = self.load.latest() if self.load is not None else None
        if load is not None and load.slots:
            return load.slots
        return ENGINE_SLOTS.get(self.backend.server_info().engine, 1)  # probed when the endpoint was reached: no I/O here

    # -- reaching it --------------------------------------------------------------------------------
    def probe(self, *, first: bool = False) -> bool:
        """Is it up? Builds the front-end and learns what the server is if it was never reached (``first``: at
        construction), else asks ``GET /v1/models`` within ``probe_timeout_s``; in rotation, or out and its backoff doubled."""
        try:
            if self.front is None:
                front = self.build()
                self.backend.server_info()
                self.front = front
            else:
                wait = Wait(self.probe_timeout_s, self.probe_timeout_s)
                self.backend.transport.request_json_once("GET", self.backend.base_url + "/models", wait=wait, missing_ok=True)
        except BackendError as exc:
            if first:
                log.warning("trimkit: fleet endpoint %s is not reachable yet (%s); it will be probed again", self.label, describe_error(exc))
            with self._lock:
                self._down(exc, probed=True)
                self._probing = False
            return False
        with self._lock:
            self.retry_at, self.backoff_s, self._probing = None, 0.0, False
        info = self.backend.server_info()
        if not first:
            log.info("trimkit: fleet endpoint %s is back in rotation", self.label)
        elif self.load is not None and info.engine == "llama.cpp" and info.metrics_off:
            log.warning("trimkit: fleet endpoint %s: start llama-server with --metrics so that the fleet sees the requests waiting "
                        "there (llamacpp:requests_deferred); /slots shows only those running", self.label)
        return True

    def maybe_probe(self, *, wait: bool = False) -> None:
        """Probe it if it is down and its backoff has passed: in a background thread, or here (``wait``)."""
        with self._lock:
            if self.retry_at is None or self._probing or self.clock() < self.retry_at:
                return
            self._probing = True
        if wait:
            self.probe()
        else:
            threading.Thread(target=self.probe, name=f"trimkit-probe-{self.label}", daemon=True).start()

    def _down(self, exc: BaseException, *, probed: bool = False) -> None:
        """Out of rotation for ``backoff_s``: ``probe_after_s`` at first, doubled by a failed probe (``probed``)."""
        if self.retry_at is None:
            self.backoff_s = self.probe_after_s
        elif probed:
            self.backoff_s = min(max(self.backoff_s * 2.0, self.probe_after_s), self.probe_max_s)
        self.last_error = describe_error(exc)
        self.retry_at = self.clock() + self.backoff_s

    def mark_down(self, exc: BaseException) -> None:
        with self._lock:
            first = self.retry_at is None
            self.timed_out = is_overload(exc) and (first or self.timed_out)
            self._down(exc)
        if first:
            log.warning("trimkit: fleet endpoint %s taken out of rotation: %s", self.label, describe_error(exc))

    def progressed(self) -> None:
        """It sent a chunk or finished a request: alive. Out of rotation by a timeout alone, it is back at once."""
        self.last_progress_at = self.clock()
        if self.timed_out and self.retry_at is not None:
            with self._lock:
                self.retry_at, self.backoff_s, self.timed_out = None, 0.0, False
            log.info("trimkit: fleet endpoint %s answered again: back in rotation", self.label)

    @property
    def busy_not_dead(self) -> bool:
        """Out of rotation by a timeout alone, with this client's requests still in flight here."""
        return self.retry_at is not None and self.timed_out and self.in_flight > 0

    def alive_since(self, since: float, *, ahead: int = 0) -> bool:
        """Whether a timeout of a request sent at ``since`` is the endpoint being busy, not dead:
        this client's requests were ahead of it, or it made progress while the request waited."""
        return ahead > 0 or (self.last_progress_at is not None and self.last_progress_at >= since)

    def predicted_wait_s(self, now: float | None = None) -> float:
        now = self.clock() if now is None else now
        return slot_wait_s([t.remaining_s(now) for t in self.queue.in_flight()], self.slots)

    # -- pricing a request --------------------------------------------------------------------------
    def cache_state(self) -> CacheState:
        """The prompts recently sent here, in its cache's blocks; the server's own evidence before
        anything was sent; nothing if it does not reuse prefixes."""
        if self.backend.prefix_reuse is False:
            return CacheState()
        with self._lock:
            held = list(self.held.values())
        return CacheState(prompts=held, block=self.backend.cache_block_tokens) if held else self.backend.evidence.cache_state()

    def cost(self, tokens: Sequence[int], params: Mapping[str, Any], now: float, budget_s: float | None = None) -> RouteCost:
        """The untrimmed prompt priced here by this endpoint's own profile: the wait behind this client's requests (and one like it for each other client's
        request the server reports), plus the prefill of what is not held."""
        priced = self.pipeline.price(tokens)  # by this endpoint's own pipeline and profile
        cached, prefill = priced.cached, priced.predicted_s
        decode = self.queue.decode_s(params, self.front.profile.decode_tokens_per_s)
        ahead = [t.remaining_s(now, prefill + decode) for t in self.queue.in_flight()]
        load = self.load.latest() if self.load is not None else None  # the server's own, if recent
        if load is not None:
            ahead += [prefill + decode] * max(load.requests - len(ahead), 0)
        wait = slot_wait_s(ahead, self.slots)
        kept = None
        if budget_s is not None:
            budget_s *= 1.0 - self.front.safety_margin  # what the plan will aim at here
            room = budget_s - wait
            kept = min(len(tokens), cached + max(self.front.profile.max_new_tokens(room, cached), 0)) if room > 0 else 0
        return RouteCost(self, wait, cached, prefill, decode, len(self.queue), kept, budget_s)

    # -- a request's life here ----------------------------------------------------------------------
    def sent(self, ticket: Ticket, prompt_tokens: Sequence[int]) -> None:
        """The request went out (its ticket's ``prompt_tokens`` say so): its prompt is held from now on, the oldest let go."""
        ticket.prompt_tokens = tokens = tuple(prompt_tokens)
        capacity = max(self.held_prompts if self.held_prompts is not None else self.slots, 1)
        with self._lock:
            self.held.pop(ticket.seq, None)
            self.held[ticket.seq] = tokens
            for seq in list(self.held)[:-capacity]:
                del self.held[seq]
        self._started()

    def release(self, ticket: Ticket, *, failed: bool = False) -> None:
        """The request ended (``failed``: before the server took it; its prompt is not held)."""
        ticket.done()
        if failed:
            with self._lock:
                self.held.pop(ticket.seq, None)
        else:
            self.progressed()
        self._started()

    def _started(self) -> None:
        """The first ``slots`` requests sent and in flight are being processed (first come, first served)."""
        sent = [t for t in self.queue.in_flight() if t.prompt_tokens is not None]
        for ticket in sent[: self.slots]:
            ticket.holding()

    def close(self) -> Any:
        """Close its front-end; the awaitable an async front-end returns, if any."""
        if self.front is not None:
            return self.front.close()
        self.backend.close()
        return None


@attrs.define(eq=False)
class Route:
    """One attempt of a call: the endpoint it goes to, priced (``cost``), its place in that endpoint's queue (``ticket``, until :meth:`release`) and the
    request that endpoint's pipeline planned; ``last``: no other endpoint was left (it gets the rest of the deadline). It is its stream's listener
    (:class:`~trimkit.frontend.StreamReporter`)."""

    cost: RouteCost
    ticket: Ticket
    prepared: Prepared
    at: float = 0.0
    last: bool = False
    open: bool = True
    #: how long it waits for its first chunk (:meth:`FleetCall.attempt_deadline_s`; None: the endpoint's own)
    deadline_s: float | None = None

    @property
    def endpoint(self) -> FleetEndpoint:
        return self.cost.endpoint

    def release(self, *, failed: bool = False) -> None:
        """Out of the endpoint's queue, once."""
        with self.endpoint._lock:
            was, self.open = self.open, False
        if was:
            self.endpoint.release(self.ticket, failed=failed)

    def went_out(self, prepared: Prepared) -> None:
        self.endpoint.sent(self.ticket, prepared.prompt_tokens)

    def read(self, rs: Any) -> Steps:
        """Its stream (``stream.endpoint``: this endpoint), read up to the first token; given back to
        the endpoint's queue when it ends, fails, is closed or is garbage-collected."""
        rs.listener, rs.endpoint = self, self.endpoint
        weakref.finalize(rs, self.release)
        try:
            return (yield from rs.read_ahead())
        except BaseException:  # it never took the request
            yield Io(rs.close, rs.close)
            raise

    def chunk(self, rs: Any) -> None:
        if rs.timed.first_output_at is not None:  # alive, and only the decode left
            self.endpoint.progressed()
            self.ticket.first_token()

    def ended(self, rs: Any, exc: BaseException | None) -> None:
        """Its stream ended (``exc``: how; None: closed). A failure before the first token is the
        call's to judge (it fails over); after it, the endpoint's."""
        if not self.open:
            return
        finished = isinstance(exc, (StopIteration, StopAsyncIteration))
        first = rs.timed.first_output_at is not None
        self.release(failed=exc is not None and not finished and not first)
        if finished and rs.report is not None:
            self.endpoint.queue.observe(rs.params, rs.report.measurement)  # the decode speed here, the answer's length
        elif first and isinstance(exc, TrimkitError) and is_endpoint_failure(exc):
            self.endpoint.mark_down(exc)


class FleetCall:
    """One ``create()`` on a fleet, routing only: the endpoint with the least predicted TTFT (its wait and its own profile's prefill) is chosen and its
    pipeline plans and sends the request, validated and counted once (:meth:`route`); after an endpoint failure before the first token, the next one
    (:meth:`failed`)."""

    def __init__(self, fleet: Any, messages: Any, rag_chunks: Any, budget: float | None, params: Mapping[str, Any], *,
                 on_busy: str | None = None, routing_key: Any = NOT_GIVEN) -> None:
        self.fleet, self.messages, self.routing_key = fleet, messages, routing_key
        self.on_busy = None if on_busy is None else check_on_busy(on_busy)
        self._given = (messages, rag_chunks, params)
        #: the request, validated before anything is asked of an endpoint and counted once, for every route of this call
        self.request: Request | None = None
        self.budget = fleet.ttft_budget_s if budget is None else valid_budget(budget)
        self.clock = fleet.clock
        self.start = self.clock()
        self.deadline_s = fleet.deadlines.first_chunk_s(self.budget)
        #: (endpoint, what went wrong) for every failed attempt of this call
        self.attempts: list[tuple[str, str]] = []
        self._tried: set[str] = set()
        self._overloaded: set[str] = set()  # endpoints that were alive but too busy for this call

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def budget_left_s(self) -> float | None:
        """All of the budget on the first attempt (planning is not in the TTFT); after a failover what is left of it."""
        if self.budget is None or not self.attempts:
            return self.budget
        return max(self.budget - self.elapsed_s(), MIN_REPLAN_SHARE * self.budget)

    def attempt_deadline_s(self, route: Route) -> float | None:
        """How long this attempt may wait for its first chunk: the budget left or twice the
        predicted TTFT there (at least :data:`MIN_ATTEMPT_S`), within the call's deadline."""
        if self.budget is None or self.deadline_s is None:
            return None
        if route.last:  # nowhere else to go: the rest of the call's deadline
            return max(self.deadline_s - self.elapsed_s(), 0.05)
        expected = route.prepared.predicted_ttft_s or 0.0  # the wait there included
        bound = max(self.budget - self.elapsed_s(), 2.0 * expected, MIN_ATTEMPT_S)
        return max(min(bound, self.deadline_s - self.elapsed_s()), 0.05)

    def route(self) -> Route:
        """The best endpoint for this request, reserved, with the request planned there. Endpoints that fail meanwhile are taken out and the next is tried."""
        if self.request is None:  # by any reached endpoint's pipeline (one was reached, or there is no fleet)
            self.request = next(ep.pipeline for ep in self.fleet.endpoints if ep.pipeline is not None).request(*self._given)
        while True:
            candidates = self._candidates()
            if self.request.tokens is None:  # by the endpoint with fewest in flight
                counter = min(candidates, key=lambda ep: (ep.in_flight, self.fleet.endpoints.index(ep)))
                asked = self.clock()
                try:
                    self.request = counter.pipeline.count(self.request)
                except TrimkitError as exc:
                    self.failed(counter, exc, since=asked, ahead=counter.in_flight)
                    continue
            with self.fleet.routing_lock:
                now = self.clock()
                best = best_route([ep.cost(self.request.tokens or (), self.request.params, now, self.budget_left_s()) for ep in candidates])
                ticket = best.endpoint.queue.enter()  # its place in the queue, as priced (before it is planned)
                ticket.estimate(best.planned_prefill_s, best.decode_s)
            try:
                prepared = self._prepare(best)
            except BaseException as exc:
                best.endpoint.release(ticket, failed=True)
                if not isinstance(exc, TrimkitError):
                    raise
                self.failed(best.endpoint, exc, since=now, ahead=best.in_flight)
                continue
            ticket.estimate((prepared.predicted_ttft_s or 0.0) - best.wait_s, ticket.decode_s)  # as planned
            return Route(best, ticket, prepared, at=now, last=len(candidates) == 1)

    def _candidates(self) -> list[FleetEndpoint]:
        if self.deadline_s is not None and self.elapsed_s() >= self.deadline_s:
            raise self.unavailable(f"no endpoint produced a first token within the call's deadline of {self.deadline_s:.2f} s")
        up = self.fleet.in_rotation(exclude=self._tried)
        if not up:
            raise self.unavailable("no endpoint of the fleet is in rotation" if not self._overloaded else "every endpoint was too busy")
        return up

    def _prepare(self, cost: RouteCost) -> Prepared:
        """The request planned by the chosen endpoint's pipeline, with the wait predicted there."""
        ep, plan_budget = cost.endpoint, self.budget_left_s()
        prepared = ep.pipeline.prepare(self.request, ttft_budget_s=plan_budget, queue_wait_s=cost.wait_s, on_busy=self.on_busy)
        for label, error in self.attempts:
            prepared = prepared.with_warning(
                f"failover: {label} failed before the first token ({error}); re-planned on {ep.label}"
                + (f" with {plan_budget:.3f} s of the {self.budget:.3f} s budget ({self.elapsed_s():.3f} s spent)" if self.budget is not None else "")
            )
        return prepared

    def failed(self, ep: FleetEndpoint, exc: BaseException, route: Route | None = None, *, since: float | None = None,
               ahead: int = 0) -> None:
        """``ep`` failed before this request's first token: out of rotation, and the call goes on elsewhere; the request's own error is raised. A timeout
        (or 429) of an endpoint alive since the request was sent (:meth:`FleetEndpoint.alive_since`) is overload: it stays in rotation."""
        if not is_endpoint_failure(exc):
            raise exc
        if route is not None:
            since, ahead = route.at, route.cost.in_flight
        self._tried.add(ep.label)
        if is_overload(exc) and ep.alive_since(self.start if since is None else since, ahead=ahead):
            self._overloaded.add(ep.label)
            self.attempts.append((ep.label, f"overloaded (kept in rotation): {describe_error(exc)}"))
            log.info("trimkit: fleet endpoint %s is busy (%s); it stays in rotation", ep.label, describe_error(exc))
            return
        ep.mark_down(exc)
        self.attempts.append((ep.label, describe_error(exc)))

    def unavailable(self, why: str) -> FleetUnavailableError | FleetOverloadedError:
        """The error when nothing is left to try; :class:`FleetOverloadedError` when an endpoint was alive but busy (retry after ``retry_after_s``)."""
        if self._overloaded or any(ep.busy_not_dead for ep in self.fleet.endpoints):
            waits = [ep.predicted_wait_s(self.clock()) for ep in self.fleet.endpoints if ep.is_up or ep.busy_not_dead]
            retry_after = max(min(waits, default=0.0), MIN_RETRY_AFTER_S)
            tried = "; ".join(f"{label}: {error}" for label, error in self.attempts) or "nothing"
            return FleetOverloadedError(f"the fleet is overloaded: {why}; retry in about {retry_after:.1f} s ({tried})",
                                        retry_after_s=retry_after, attempts=self.attempts)
        attempts = list(self.attempts)
        for ep in self.fleet.endpoints:
            if ep.label not in self._tried and not ep.is_up:
                attempts.append((ep.label, f"out of rotation: {ep.last_error or 'not reached yet'}"))
        tried = "; ".join(f"{label}: {error}" for label, error in attempts) or "nothing"
        return FleetUnavailableError(f"{why} ({tried})", attempts=attempts)


#: what ``create(stream=True)`` returns on a fleet: the endpoint's stream, read up to its first token
#: before it is returned (:meth:`~trimkit.frontend.StreamReporter.read_ahead`); ``report.endpoint`` names the replica
FleetStream = ReportingStream
AsyncFleetStream = AsyncReportingStream


class FleetFrontEnd(Closing):
    """Several OpenAI-compatible endpoints behind one sync ``chat.completions.create``: it returns what one endpoint's wrapper returns (with ``stream=True``
    a :class:`FleetStream`). It only routes: each endpoint's pipeline plans, and appends to the one list of ``reports``. ``close()`` / ``with`` close every
    endpoint."""

    is_async = False

    def __init__(self, endpoints: Sequence[FleetEndpoint], *, ttft_budget_s: float | None = None, retry_deadline_s: float | None = None,
                 unbudgeted_deadline_s: float = 30.0, reports: list[Report] | None = None) -> None:
        #: the replicas, in the order given (ties go to the earlier one)
        self.endpoints = tuple(endpoints)
        self._budget = None if ttft_budget_s is None else valid_budget(ttft_budget_s)
        self.deadlines = CallDeadlines(unbudgeted_deadline_s, retry_deadline_s)
        self.clock = time.monotonic
        #: held while a request is priced and reserved, so that concurrent calls see each other
        self.routing_lock = threading.Lock()
        #: recent reports, most recent last, whichever endpoint served them
        self.reports: list[Report] = [] if reports is None else reports
        self.chat = ClientChat(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.endpoints)})"

    def _client_part(self, *path: str) -> Any:
        raise AttributeError(f"{'.'.join(path)}: a fleet has no client of its own")

    @property
    def ttft_budget_s(self) -> float | None:
        """The default TTFT budget of a call."""
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
        return self.reports[-1] if self.reports else None

    def start(self, *, parallel: bool = False) -> None:
        """Reach every endpoint (build its wrapper), one after the other or in parallel threads; one that is down joins later."""
        if parallel and len(self.endpoints) > 1:
            with ThreadPoolExecutor(max_workers=len(self.endpoints), thread_name_prefix="trimkit-fleet-start") as pool:
                list(pool.map(lambda ep: ep.probe(first=True), self.endpoints))
        else:
            for ep in self.endpoints:
                ep.probe(first=True)

    def in_rotation(self, *, exclude: Collection[str] = ()) -> list[FleetEndpoint]:
        """The endpoints that may take a request now (those due a probe probed in the background, or here when none is up)."""
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
            if ep.retry_at is not None:
                ep.retry_at = 0.0
                ep.maybe_probe(wait=True)
        return [ep.label for ep in self.endpoints if ep.is_up]

    def idle(self, timeout_s: float | None = None) -> None:
        """Finish every endpoint's pending background summaries now."""
        for ep in self.endpoints:
            if ep.pipeline is not None:
                ep.pipeline.idle(timeout_s)

    def call_steps(self, kwargs: dict[str, Any]) -> Steps:
        """A ``create()`` call, sync or async: routed (:class:`FleetCall`; async: in a worker thread), then sent by that endpoint's
        :class:`~trimkit.openai_wrapper.Send` as this attempt (:class:`Route`); a failure before the first token routes it again."""
        messages, rag_chunks, budget, params, stream, options, key = call_arguments(kwargs)
        call = FleetCall(self, messages, rag_chunks, budget, params, routing_key=key, **options)
        while True:
            route = yield Io(call.route, functools.partial(_routed, call))
            front = route.endpoint.front
            route.deadline_s = call.attempt_deadline_s(route)
            send = Send(front, params, stream, front.routing.headers_for(call.routing_key, call.messages), attempt=route)
            try:
                out = yield from send.reply(route.prepared)
            except TrimkitError as exc:  # before the first token: the next endpoint, if it was this one's fault
                call.failed(route.endpoint, exc, route)
                continue
            return (yield from send.completion(out))

    def close(self) -> None:
        for ep in self.endpoints:
            ep.close()


class AsyncFleetFrontEnd(AsyncClosing, FleetFrontEnd):
    """:class:`FleetFrontEnd` for async clients (or ``asynchronous=True``): routing and planning
    run in a worker thread; build it before the loop starts (it may calibrate)."""

    is_async = True

    async def close(self) -> None:  # type: ignore[override]
        for ep in self.endpoints:
            closing = ep.close()
            if closing is not None:
                await closing


async def _routed(call: FleetCall) -> Route:
    """``call.route()`` in a worker thread, which cannot be stopped: if the caller is cancelled
    meanwhile, the reservation it makes is given back as soon as it is made."""
    future = asyncio.ensure_future(asyncio.to_thread(call.route))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(_release_abandoned)
        raise


def _release_abandoned(future: asyncio.Future[Route]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().release(failed=True)


# -- the fleet: building it ------------------------------------------------------------------------------
def _kind(targets: Any) -> str:
    """``"url"``, ``"sync"`` or ``"async"``: what the fleet is made of (anything else is invalid input)."""
    if not isinstance(targets, (list, tuple)):
        raise InvalidInputError(f"a fleet is a list of URLs or of openai clients, got {type(targets).__name__}")
    if not targets:
        raise InvalidInputError("a fleet needs at least one endpoint: got an empty list")
    kinds = set()
    for t in targets:
        if isinstance(t, str):
            kinds.add("url")
        elif is_openai_client(t):
            kinds.add("async" if client_is_async(t) else "sync")
        else:
            raise InvalidInputError(f"a fleet endpoint must be a URL or an openai-style client, got {type(t).__name__}")
    if len(kinds) > 1:
        raise InvalidInputError(f"a fleet's endpoints must be all URLs, all sync clients or all async clients; got {sorted(kinds)}")
    return kinds.pop()


def _base_url(target: Any) -> str:
    base = target if isinstance(target, str) else getattr(target, "base_url", None)
    if base is None:
        raise InvalidInputError(f"{type(target).__name__} has no base_url")
    return normalize_base_url(str(base))[0]


def _profiles(profile: Any, n: int) -> list[Profile | None]:
    if profile is None or isinstance(profile, Profile):
        return [profile] * n
    if isinstance(profile, (list, tuple)) and len(profile) == n and all(p is None or isinstance(p, Profile) for p in profile):
        return list(profile)
    raise InvalidInputError(f"profile must be a Profile (for every endpoint) or a list of {n} (one per endpoint), got {type(profile).__name__}")


def wrap_fleet(targets: Sequence[Any], ttft_budget_s: float | None = None, *, model: str | None = None, api_key: str | None = None,
               asynchronous: bool | None = None, profile: Profile | Sequence[Profile] | None = None, retry_deadline_s: float | None = None,
               slots: int | None = None, held_prompts: int | None = None, parallel_calibration: bool = False, read_load: bool = True,
               probe_after_s: float = 1.0, probe_max_s: float = 30.0, probe_timeout_s: float = 2.0, **kwargs: Any) -> FleetFrontEnd:
    """A fleet of OpenAI-compatible endpoints (docs/scaling.md §2): ``targets`` are base URLs (``asynchronous=True`` for the async front-end) or ``openai``
    clients, all sync or all async. ``profile``: one for all, one per endpoint, or None. Backend settings (:data:`FLEET_BACKEND_DEFAULTS` unless given)
    apply to every endpoint, the rest of ``kwargs`` to every endpoint's pipeline. No endpoint reachable: :class:`FleetUnavailableError`."""
    kind = _kind(targets)
    if kind != "url" and asynchronous is not None and asynchronous != (kind == "async"):
        raise InvalidInputError(f"asynchronous={asynchronous} does not match the {kind} clients given")
    if kind != "url" and api_key is not None:
        raise InvalidInputError("api_key is the clients' own: set it on them")
    urls = [_base_url(t) for t in targets]
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise InvalidInputError(f"the same endpoint is listed more than once: {twice}")
    if "backend" in kwargs:
        raise InvalidInputError("a fleet makes one backend per endpoint: pass URLs or clients, not backend=")
    for value, name in ((probe_after_s, "probe_after_s"), (probe_max_s, "probe_max_s"), (probe_timeout_s, "probe_timeout_s")):
        positive_finite(value, name)
    # checked now: an endpoint's pipeline may be built later
    valid_tokens_per_s_target(kwargs.get("tokens_per_s_target"))
    RoutingOptions.of(kwargs.get("auto_routing_key", False), kwargs.get("routing_headers"))
    profiles = _profiles(profile, len(targets))
    backend_kwargs = {**FLEET_BACKEND_DEFAULTS, **split_backend_kwargs(kwargs)}
    is_async = kind == "async" or (kind == "url" and bool(asynchronous))
    cls = AsyncTrimmedOpenAI if is_async else TrimmedOpenAI
    kwargs.update(ttft_budget_s=ttft_budget_s, retry_deadline_s=retry_deadline_s)
    endpoints: list[FleetEndpoint] = []
    reports: list[Report] = []
    twins: dict[Any, Profile] = {}
    turns: dict[Any, threading.Lock] = {}

    def build(client: Any, backend: OpenAIHTTPBackend, profile: Profile | None) -> Any:
        """One endpoint's wrapper: its profile given, else an identical replica's (engine, version, models, context: the
        first reached loads or calibrates it, a twin reached meanwhile waits), stored, or calibrated now."""
        twin, turn = None, contextlib.nullcontext()
        if profile is None:
            info = backend.server_info()
            twin = (info.engine, info.engine_version, info.model_ids, backend.n_ctx, backend.model or "")
            turn = turns.setdefault(twin, threading.Lock())  # type: ignore[assignment]  # atomic: one lock per twin
        with turn:
            front = cls(client, backend=backend, endpoint_label=backend.base_url, profile=profile or twins.get(twin), **kwargs)
            front.pipeline.watch_prefill = False  # the fleet sends in one piece: planned with the whole prediction's margin
            front.pipeline.reports = reports
            if twin is not None:
                twins.setdefault(twin, front.profile)  # calibration noise alone must not make one twin look faster
        return front

    try:
        for target, base, prof in zip(targets, urls, profiles):
            if kind == "url":
                backend, client = OpenAIHTTPBackend(base, model=model, api_key=api_key, **backend_kwargs), None
            else:
                backend, client = OpenAIHTTPBackend.from_openai_client(target, model=model, **backend_kwargs), target
            load = ServerLoadReader(backend.transport.http, backend.root_url, backend.transport.headers) if read_load else None
            endpoints.append(FleetEndpoint(backend.base_url, backend, functools.partial(build, client, backend, prof), slots=slots,
                                           held_prompts=held_prompts, load=load, probe_after_s=probe_after_s, probe_max_s=probe_max_s,
                                           probe_timeout_s=probe_timeout_s))
        fleet = (AsyncFleetFrontEnd if is_async else FleetFrontEnd)(endpoints, ttft_budget_s=ttft_budget_s, retry_deadline_s=retry_deadline_s,
                                                                    unbudgeted_deadline_s=endpoints[0].backend.retry_deadline_s, reports=reports)
        fleet.start(parallel=parallel_calibration)
        if not any(ep.is_up for ep in endpoints):
            attempts = [(ep.label, ep.last_error or "unreachable") for ep in endpoints]
            raise FleetUnavailableError("no endpoint of the fleet could be reached: " + "; ".join(f"{a}: {b}" for a, b in attempts), attempts=attempts)
    except BaseException:
        for ep in endpoints:
            ep.backend.close()
        raise
    return fleet


def wrap_url(base_url: str | Sequence[str], *, model: str | None = None, ttft_budget_s: float | None = None, api_key: str | None = None,
             asynchronous: bool = False, **kwargs: Any) -> Any:
    """``trimkit.wrap_url``: one URL gives :func:`~trimkit.openai_wrapper.wrap_one_url`'s wrapper, a list a fleet (:func:`wrap_fleet`)."""
    if isinstance(base_url, (list, tuple)):
        return wrap_fleet(base_url, ttft_budget_s, model=model, api_key=api_key, asynchronous=asynchronous, **kwargs)
    return wrap_one_url(base_url,  # type: ignore[arg-type]  # anything else is checked there (a typed error)
                        model=model, ttft_budget_s=ttft_budget_s, api_key=api_key, asynchronous=asynchronous, **kwargs)
