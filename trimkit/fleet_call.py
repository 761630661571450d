"""One call on a fleet, apart from sending it: which endpoint takes it, the plan there, and what a
failure before the first token means (:class:`FleetCall`). The sync and async front-ends of
:mod:`trimkit.fleet` share it and differ only in how they send.

Routing: the untrimmed prompt is counted once (by the endpoint with the fewest requests in
flight: replicas of one model count alike) and priced on every endpoint in rotation
(:meth:`~trimkit.fleet_endpoint.FleetEndpoint.cost`: predicted wait + prefill of what it does
not hold); the lowest predicted TTFT wins, ties going to the endpoint with fewest in flight.
Its pipeline then plans against the budget less that wait (``queue_wait_s``).

Overload is not failure: an endpoint that times out (or says 429) while it is alive — it had this
client's own requests to work through first, or it sent chunks while the request waited — stays
in rotation; the request tries the next endpoint, and the last endpoint left gets the rest of the
call's deadline (the request queues there). When every endpoint was busy:
:class:`~trimkit.fleet_endpoint.FleetOverloadedError` with ``retry_after_s``, never
:class:`~trimkit.fleet_endpoint.FleetUnavailableError`.

Failover: an endpoint that fails before the first token (:func:`~trimkit.fleet_endpoint.is_endpoint_failure`)
is taken out of rotation and the request is routed again among the others, each tried at most
once per call, planned against what is left of its budget (the time already spent counts) and
within the call's deadline (``max(2 × budget, 5 s)``, as for one endpoint). When none is left:
:class:`~trimkit.fleet_endpoint.FleetUnavailableError`, listing what was tried.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import attrs

from trimkit.errors import TrimkitError
from trimkit.fleet_endpoint import (
    MIN_RETRY_AFTER_S,
    FleetEndpoint,
    FleetOverloadedError,
    FleetUnavailableError,
    RouteCost,
    best_route,
    describe_error,
    is_endpoint_failure,
    is_overload,
)
from trimkit.messages import coerce_chunks, validate_messages
from trimkit.planning.queue import check_on_busy
from trimkit.prepared import Prepared, place_chunks
from trimkit.validation import budget as valid_budget

__all__ = ["FleetCall", "Fleet", "Route", "MIN_ATTEMPT_S", "MIN_REPLAN_SHARE"]

log = logging.getLogger("trimkit")

#: an endpoint gets at least this long to produce the first token before the call moves on
MIN_ATTEMPT_S = 1.0
#: after a failover the plan's budget is what is left of it, but never under this share of it
MIN_REPLAN_SHARE = 0.1


class Fleet(Protocol):
    """What a call needs of its fleet (:class:`trimkit.fleet.FleetFrontEnd` and its async twin)."""

    endpoints: Sequence[FleetEndpoint]
    ttft_budget_s: float | None
    clock: Callable[[], float]
    deadlines: Any  # a trimkit.call_deadlines.CallDeadlines
    routing_lock: threading.Lock

    def in_rotation(self, *, exclude: Collection[str] = ()) -> list[FleetEndpoint]: ...


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

    def __init__(self, fleet: Fleet, messages: Any, rag_chunks: Any, budget: float | None, params: Mapping[str, Any], *,
                 on_busy: str | None = None) -> None:
        validate_messages(messages)
        self.on_busy = None if on_busy is None else check_on_busy(on_busy)
        self.chunks = coerce_chunks(rag_chunks)
        self.fleet = fleet
        self.messages, self.rag_chunks, self.params = messages, rag_chunks, params
        self.budget = fleet.ttft_budget_s if budget is None else valid_budget(budget)
        self.clock = fleet.clock
        self.start = self.clock()
        self.deadline_s = fleet.deadlines.first_chunk_s(self.budget)
        #: (endpoint, what went wrong) for every failed attempt of this call
        self.attempts: list[tuple[str, str]] = []
        self._tried: set[str] = set()
        self._overloaded: set[str] = set()  # endpoints that were alive but too busy for this call

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
            counter = min(candidates, key=lambda ep: (ep.in_flight, self.fleet.endpoints.index(ep)))
            asked = self.clock()
            try:
                tokens = self._untrimmed_tokens(counter)
            except TrimkitError as exc:
                self.failed(counter, exc, since=asked, ahead=counter.in_flight)
                continue
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

    def _untrimmed_tokens(self, ep: FleetEndpoint) -> list[int]:
        """The prompt as the caller gave it (chunks placed as the pipeline places them), counted by ``ep``."""
        pipeline = ep.pipeline
        as_is = place_chunks(self.messages, self.chunks, pipeline.rag_template, pipeline.rag_chunk_template) if self.chunks else self.messages
        return ep.backend.tokenizer.prompt_tokens(as_is, self.params.get("tools"))

    def _prepare(self, cost: RouteCost) -> Prepared:
        ep = cost.endpoint
        plan_budget = self.budget_left_s()
        prepared = ep.pipeline.prepare(self.messages, self.rag_chunks, self.params, ttft_budget_s=plan_budget, queue_wait_s=cost.wait_s,
                                       on_busy=self.on_busy)
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
        with ``ahead`` of this client's requests there: :meth:`~trimkit.fleet_endpoint.FleetEndpoint.alive_since`)
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
        state; :class:`~trimkit.fleet_endpoint.FleetOverloadedError` when an endpoint tried was
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
