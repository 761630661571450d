"""One endpoint of a fleet (:mod:`trimkit.fleet`): its own front-end — an
:class:`~trimkit.backends.http.OpenAIHTTPBackend` and a :class:`~trimkit.pipeline.Pipeline`
with its own profile — and what the fleet knows of it (:class:`Health`, :class:`HeldPrompts`, below): the requests
this client has in flight there, the prompts its prefix cache holds, its load where the server
says it (:mod:`trimkit.backends.server`) and whether it is in rotation.

:meth:`FleetEndpoint.cost` prices a request on it: the predicted wait behind the requests ahead
plus the predicted prefill of what it does not hold. An endpoint that refuses, times out or
fails (:func:`is_endpoint_failure`) is taken out of rotation (:meth:`FleetEndpoint.mark_down`)
and probed again later with a cheap ``GET /v1/models`` (:meth:`FleetEndpoint.probe`), after a
backoff that doubles while it stays down.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from trimkit.backends.base import Measurement
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.server import ServerLoad, ServerLoadReader
from trimkit.backends.transport import Wait
from trimkit.errors import (
    BackendError,
    MalformedReplyError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    StreamInterruptedError,
    TransientServerError,
)
from trimkit.planning.costs import CacheState, evaluated_tokens
from trimkit.planning.queue import EngineQueue, Ticket, answer_cap
from trimkit.planning.tokens import reusable_prefix_len


def slot_wait_s(remaining_s: Sequence[float], slots: int) -> float:
    """How long a new request waits on a server that runs ``slots`` requests at once, first come
    first served, behind requests with ``remaining_s`` of predicted work each (in the order they
    came): with one slot, their sum; with more, until a slot frees once they have all started."""
    slots = max(int(slots), 1)
    free = [0.0] * slots  # when each slot is free
    for work in remaining_s:
        heapq.heapreplace(free, free[0] + max(work, 0.0))
    return free[0]


class HeldPrompts:
    """The prompts an endpoint's prefix cache is predicted to hold: the last ``capacity`` sent
    to it (one per slot on llama.cpp; llama-cpp-python's server holds the last one). Recorded
    when a request is sent — a request queued behind others finds the cache as the last one
    ahead of it left it — and forgotten if it failed before the server took it."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(int(capacity), 1)
        self._prompts: deque[tuple[int, tuple[int, ...]]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._prompts)

    def hold(self, key: int, tokens: Sequence[int]) -> None:
        """``tokens`` were sent (``key``: the request; holding it again replaces its prompt)."""
        with self._lock:
            kept = [(k, t) for k, t in self._prompts if k != key]
            kept.append((key, tuple(tokens)))
            self._prompts = deque(kept[-self.capacity :])

    def forget(self, key: int) -> None:
        with self._lock:
            self._prompts = deque((k, t) for k, t in self._prompts if k != key)

    def prompts(self) -> list[tuple[int, ...]]:
        with self._lock:
            return [t for _, t in self._prompts]

    def cached(self, tokens: Sequence[int]) -> int:
        """The longest prefix of ``tokens`` a held prompt shares (leaving one token to evaluate)."""
        return max((reusable_prefix_len(p, tokens) for p in self.prompts()), default=0)


@attrs.define
class Health:
    """Whether an endpoint is in rotation. A failure takes it out (``down``) until ``retry_at``;
    a probe then puts it back (``up``) or doubles the wait (``probe_failed``), up to ``max_s``."""

    after_s: float = 1.0
    max_s: float = 30.0
    down_since: float | None = None
    retry_at: float = 0.0
    backoff_s: float = 0.0
    failures: int = 0
    last_error: str | None = None
    probing: bool = False

    @property
    def is_up(self) -> bool:
        return self.down_since is None

    def down(self, now: float, error: str) -> None:
        if self.down_since is None:
            self.down_since = now
            self.backoff_s = self.after_s
        self.failures += 1
        self.last_error = error
        self.retry_at = now + self.backoff_s

    def probe_due(self, now: float) -> bool:
        return self.down_since is not None and not self.probing and now >= self.retry_at

    def probe_failed(self, now: float, error: str) -> None:
        self.backoff_s = min(max(self.backoff_s * 2.0, self.after_s), self.max_s)
        self.last_error = error
        self.retry_at = now + self.backoff_s

    def up(self) -> None:
        self.down_since = None
        self.backoff_s = 0.0
        self.retry_at = 0.0


__all__ = ["FleetEndpoint", "RouteCost", "best_route", "is_endpoint_failure",
           "is_overload", "describe_error", "ENGINE_SLOTS", "TIE_SHARE", "MIN_RETRY_AFTER_S"]

log = logging.getLogger("trimkit")

#: requests an engine runs at once when the server does not say (continuous batching engines:
#: many; llama.cpp-style servers: one per slot, and llama-cpp-python's server has one)
ENGINE_SLOTS = {"vllm": 64, "sglang": 64}
#: predicted TTFTs closer than this share are a tie (predictions are never that sure)
TIE_SHARE = 0.01
#: the shortest retry hint an overloaded fleet gives
MIN_RETRY_AFTER_S = 0.5






def is_overload(exc: BaseException) -> bool:
    """An error a live but busy endpoint gives: no first chunk within the attempt's deadline
    (:class:`~trimkit.errors.ServerTimeoutError`), or 429 Too Many Requests. Whether the endpoint
    is alive is the caller's to judge (:meth:`FleetEndpoint.alive_since`)."""
    return isinstance(exc, ServerTimeoutError) or (isinstance(exc, TransientServerError) and exc.status == 429)


def is_endpoint_failure(exc: BaseException) -> bool:
    """An error that says the endpoint (not the request) failed: unreachable or timed out,
    a 429/5xx status, or a stream broken off. Another endpoint may serve the request."""
    if isinstance(exc, (ServerUnreachableError, TransientServerError, StreamInterruptedError)):
        return True
    return isinstance(exc, ServerError) and not isinstance(exc, MalformedReplyError) and (exc.status or 0) >= 500


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


@attrs.frozen
class RouteCost:
    """A request priced on one endpoint: the predicted wait behind the requests ahead of it,
    the prefix the endpoint holds, and the predicted prefill and decode of the untrimmed prompt."""

    endpoint: FleetEndpoint = attrs.field(eq=False, repr=lambda e: e.label)
    wait_s: float
    cached_tokens: int
    prefill_s: float
    decode_s: float
    in_flight: int
    #: with a budget: the prompt tokens this endpoint could keep within it (its cached prefix
    #: plus the new tokens that fit the budget left after the wait); None without a budget
    kept_tokens: int | None = None
    budget_s: float | None = None

    @property
    def fits(self) -> bool:
        """The untrimmed prompt is predicted to start within the budget here (or there is none)."""
        return self.budget_s is None or self.ttft_s <= self.budget_s

    @property
    def planned_prefill_s(self) -> float:
        """The prefill to count for this request in the queue until it is planned: the untrimmed
        prompt's, but never more than the budget left after the wait (it will be trimmed to that)."""
        if self.budget_s is None:
            return self.prefill_s
        return min(self.prefill_s, max(self.budget_s - self.wait_s, 0.0))

    @property
    def ttft_s(self) -> float:
        """The predicted TTFT on this endpoint: wait + prefill."""
        return self.wait_s + self.prefill_s

    def ties(self, best_s: float) -> bool:
        """Within :data:`TIE_SHARE` (and a millisecond) of the lowest predicted TTFT ``best_s``:
        closer than any prediction is sure, so the endpoint with fewer requests in flight wins."""
        return self.ttft_s <= best_s * (1.0 + TIE_SHARE) + 0.001


def best_route(costs: Sequence[RouteCost]) -> RouteCost:
    """The lowest predicted TTFT; among those tied with it, fewest in flight, then the first given.

    With a budget that no endpoint meets with the untrimmed prompt, every choice trims: the
    endpoint that keeps the most of the prompt (cached prefix plus what fits the budget left
    after its wait) wins instead — a replica with the prefix but a long queue would otherwise
    be chosen for its total and then trimmed to nothing while another sits idle."""
    fitting = [c for c in costs if c.fits]
    if not fitting and all(c.kept_tokens is not None for c in costs):
        most = max(c.kept_tokens or 0 for c in costs)
        costs = [c for c in costs if (c.kept_tokens or 0) >= most * (1.0 - TIE_SHARE)]
    elif fitting:
        costs = fitting
    best_s = min(c.ttft_s for c in costs)
    return min((c for c in costs if c.ties(best_s)), key=lambda c: c.in_flight)


class FleetEndpoint:
    """One replica: ``label`` names it (its base URL) in reports; ``build()`` makes its
    front-end (a :class:`~trimkit.openai_wrapper.TrimmedOpenAI` or
    :class:`~trimkit.openai_wrapper.AsyncTrimmedOpenAI`; it calibrates unless a profile is
    stored or given), at construction or, if the server was down then, when a probe finds it up.

    ``slots``: how many requests the server runs at once (None: what ``/slots`` says, else
    :data:`ENGINE_SLOTS` for its engine, else 1); ``held_prompts``: how many recent prompts its
    prefix cache holds (None: one per slot). Both may be set on the instance.
    """

    def __init__(self, label: str, backend: OpenAIHTTPBackend, build: Callable[[], Any], *, health: Health | None = None,
                 slots: int | None = None, held_prompts: int | None = None, load: ServerLoadReader | None = None,
                 probe_timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.backend = backend
        self.build = build
        #: the front-end (its pipeline, profile, reports); None until the endpoint was first reached
        self.front: Any = None
        self.health = health or Health()
        #: this client's requests in flight here (answer lengths learned as on an in-process engine)
        self.queue = EngineQueue(clock)
        self.held = HeldPrompts(1)
        self._tickets: dict[int, Ticket] = {}  # key → the request's ticket, from reserve to release
        self._sent: set[int] = set()
        self.load = load
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self._slots, self._held_arg = slots, held_prompts
        self._lock = threading.Lock()
        #: when this endpoint last sent this client a chunk or finished a request of its (clock)
        self.last_progress_at: float | None = None
        #: taken out of rotation by a timeout (or 429) alone, not a refusal or an error
        self.timed_out = False
        backend.cache_view, backend.cache_state_view = self.cache_view, self.cache_state

    def __repr__(self) -> str:
        state = "up" if self.is_up else f"down ({self.health.last_error})"
        return f"FleetEndpoint({self.label!r}, {state}, {self.in_flight} in flight)"

    # -- state --------------------------------------------------------------------------------------
    @property
    def is_up(self) -> bool:
        """In rotation: reached at least once and not marked down since."""
        return self.front is not None and self.health.is_up

    @property
    def in_flight(self) -> int:
        """Requests this client sent here and has not finished."""
        return len(self.queue)

    @property
    def profile(self) -> Any:
        """This endpoint's profile (None until it was reached)."""
        return self.front.profile if self.front is not None else None

    @property
    def pipeline(self) -> Any:
        return self.front.pipeline if self.front is not None else None

    @property
    def last_error(self) -> str | None:
        return self.health.last_error

    @property
    def slots(self) -> int:
        """How many requests the server runs at once."""
        if self._slots is not None:
            return self._slots
        load = self.load.latest() if self.load is not None else None
        if load is not None and load.slots:
            return load.slots
        info = self.backend.server_info()  # probed when the endpoint was reached: no I/O here
        return ENGINE_SLOTS.get(info.engine, 1)

    @slots.setter
    def slots(self, value: int | None) -> None:
        self._slots = value

    @property
    def held_prompts(self) -> int:
        """How many recent prompts its prefix cache is assumed to hold."""
        return self._held_arg if self._held_arg is not None else self.slots

    @held_prompts.setter
    def held_prompts(self, value: int | None) -> None:
        self._held_arg = value

    def server_load(self) -> ServerLoad | None:
        """The server's own load reading, if recent (None: it says none)."""
        return self.load.latest() if self.load is not None else None

    # -- reaching it --------------------------------------------------------------------------------
    def start(self) -> None:
        """Build the front-end and learn what the server is; a failure leaves it down."""
        try:
            front = self.build()
            info = self.backend.server_info()
        except BackendError as exc:
            log.warning("trimkit: fleet endpoint %s is not reachable yet (%s); it will be probed again", self.label, describe_error(exc))
            self.health.down(self.clock(), describe_error(exc))
            return
        self.front = front
        if self.load is not None and info.engine == "llama.cpp" and info.metrics_off:
            log.warning("trimkit: fleet endpoint %s: start llama-server with --metrics so that the fleet sees the requests waiting "
                        "there (llamacpp:requests_deferred); /slots shows only those running", self.label)

    def probe(self) -> bool:
        """Is it back? Builds the front-end if it was never reached (calibrating if needed),
        else asks ``GET /v1/models`` within ``probe_timeout_s``. Puts it back in rotation or
        doubles its backoff."""
        try:
            if self.front is None:
                front = self.build()
                self.backend.server_info()
                self.front = front
            else:
                wait = Wait(self.probe_timeout_s, self.probe_timeout_s)
                self.backend.transport.request_json_once("GET", self.backend.base_url + "/models", wait=wait, missing_ok=True)
        except BackendError as exc:
            with self._lock:
                self.health.probe_failed(self.clock(), describe_error(exc))
                self.health.probing = False
            return False
        with self._lock:
            self.health.up()
            self.health.probing = False
        log.info("trimkit: fleet endpoint %s is back in rotation", self.label)
        return True

    def maybe_probe(self, *, wait: bool = False) -> None:
        """Probe it if it is down and its backoff has passed: in a background thread, or here (``wait``)."""
        with self._lock:
            if not self.health.probe_due(self.clock()):
                return
            self.health.probing = True
        if wait:
            self.probe()
        else:
            threading.Thread(target=self.probe, name=f"trimkit-probe-{self.label}", daemon=True).start()

    def mark_down(self, exc: BaseException) -> None:
        """Take it out of rotation after ``exc``."""
        with self._lock:
            first = self.health.is_up
            self.timed_out = is_overload(exc) and (first or self.timed_out)
            self.health.down(self.clock(), describe_error(exc))
        if first:
            log.warning("trimkit: fleet endpoint %s taken out of rotation: %s", self.label, describe_error(exc))

    def progressed(self) -> None:
        """It sent a chunk, or finished a request: it is alive. Taken out of rotation by a
        timeout alone (it may have been busy, not dead), it is back at once."""
        self.last_progress_at = self.clock()
        if self.timed_out and not self.health.is_up:
            with self._lock:
                self.health.up()
                self.timed_out = False
            log.info("trimkit: fleet endpoint %s answered again: back in rotation", self.label)

    @property
    def busy_not_dead(self) -> bool:
        """Out of rotation after a timeout alone, with this client's requests still in flight
        here: as far as the client can tell it is working through them, not dead."""
        return not self.health.is_up and self.timed_out and self.in_flight > 0

    def alive_since(self, since: float, *, ahead: int = 0) -> bool:
        """Whether a timeout of a request sent at ``since`` (with ``ahead`` of this client's
        requests in flight here before it) is the endpoint being busy, not dead: it had this
        client's own requests to work through first, or it made progress while the request waited."""
        return ahead > 0 or (self.last_progress_at is not None and self.last_progress_at >= since)

    def predicted_wait_s(self, now: float | None = None) -> float:
        """How long a new request is predicted to wait here behind the requests in flight."""
        now = self.clock() if now is None else now
        return slot_wait_s([t.remaining_s(now) for t in self.queue.in_flight()], self.slots)

    # -- pricing a request --------------------------------------------------------------------------
    def cache_view(self, tokens: Sequence[int]) -> int:
        """The prefix of ``tokens`` this server is predicted to hold (its backend's
        ``predict_cached_tokens``): the longest shared with a prompt recently sent to it, in its
        cache's blocks; the server's own evidence before anything was sent; 0 once it showed it
        does not reuse prefixes."""
        if self.backend.prefix_reuse is False:
            return 0
        if not len(self.held):
            return self.backend.evidence.predict_cached_tokens(tokens)
        block = self.backend.cache_block_tokens
        return self.held.cached(tokens) // block * block

    def cache_state(self) -> CacheState:
        """:meth:`cache_view` as data, for a plan: the held prompts and the cache block."""
        if self.backend.prefix_reuse is False:
            return CacheState()
        if not len(self.held):
            return self.backend.evidence.cache_state()
        return CacheState(prompts=self.held.prompts(), block=self.backend.cache_block_tokens)

    def prefill_s(self, n_tokens: int, cached: int) -> float:
        """The predicted TTFT of an ``n_tokens`` prompt with ``cached`` of them held, once started."""
        return float(self.front.profile.predict_ttft_s(evaluated_tokens(n_tokens, cached), cached))

    def cost(self, tokens: Sequence[int], params: Mapping[str, Any], now: float, budget_s: float | None = None) -> RouteCost:
        """``tokens`` (the untrimmed prompt) priced here: the wait behind this client's requests
        (and, where the server says its load, one request like this one for each other
        client's request there), plus the prefill of what is not held; its decode from
        ``max_tokens`` (else the typical answer here) at the profile's decode speed."""
        self.held.capacity = self.held_prompts
        cached = self.backend.predict_cached_tokens(tokens)
        prefill = self.prefill_s(len(tokens), cached)
        decode = self.queue.decode_s(params, self.front.profile.decode_tokens_per_s)
        ahead = [t.remaining_s(now, prefill + decode) for t in self.queue.in_flight()]
        load = self.server_load()
        if load is not None:  # other clients' requests, each as much work as this one
            ahead += [prefill + decode] * max(load.requests - len(ahead), 0)
        wait = slot_wait_s(ahead, self.slots)
        kept = None
        if budget_s is not None:
            budget_s *= 1.0 - self.front.safety_margin  # what the plan will aim at here
            room = budget_s - wait
            new = self.front.profile.max_new_tokens(room, cached) if room > 0 else 0
            kept = min(len(tokens), cached + max(new, 0)) if room > 0 else 0
        return RouteCost(self, wait, cached, prefill, decode, len(self.queue), kept, budget_s)

    # -- a request's life here ----------------------------------------------------------------------
    def reserve(self, cost: RouteCost) -> int:
        """Count a request in, as priced (before it is planned); returns its key."""
        ticket = self.queue.enter()
        ticket.estimate(cost.planned_prefill_s, cost.decode_s)
        with self._lock:
            self._tickets[ticket.seq] = ticket
        return ticket.seq

    def planned(self, key: int, prompt_tokens: Sequence[int], cached_tokens: int) -> None:
        """The request was planned: its prefill as trimmed."""
        ticket = self._tickets.get(key)
        if ticket is not None:
            ticket.estimate(self.prefill_s(len(prompt_tokens), cached_tokens), ticket.decode_s)

    def sent(self, key: int, prompt_tokens: Sequence[int]) -> None:
        """The request went out (after the backend predicted its cached prefix): its prompt is
        held from now on, and it is processed once the requests ahead are."""
        self.held.hold(key, prompt_tokens)
        self._sent.add(key)
        self._started()

    def first_token(self, key: int) -> None:
        self.progressed()
        ticket = self._tickets.get(key)
        if ticket is not None:
            ticket.first_token()

    def release(self, key: int, *, failed: bool = False) -> None:
        """The request ended (``failed``: before the server took it; its prompt is not held)."""
        with self._lock:
            ticket = self._tickets.pop(key, None)
        self._sent.discard(key)
        if ticket is not None:
            ticket.done()
        if failed:
            self.held.forget(key)
        elif ticket is not None:
            self.progressed()
        self._started()

    def observe(self, params: Mapping[str, Any], m: Measurement) -> None:
        """A request finished: its stream teaches the decode speed here, and an answer without
        ``max_tokens`` the typical answer length (the queue's predictions)."""
        self.queue.observe_stream(m.completion_tokens, m.ttft_s, m.total_s)
        if answer_cap(params) is None:
            self.queue.observe_answer(m.completion_tokens)

    def _started(self) -> None:
        """The first ``slots`` requests sent and in flight are being processed (first come, first served)."""
        sent = [t for t in self.queue.in_flight() if t.seq in self._sent]
        for ticket in sent[: self.slots]:
            ticket.holding()

    def close(self) -> Any:
        """Close its front-end (its backend and client); the awaitable an async front-end returns, if any."""
        if self.front is not None:
            return self.front.close()
        self.backend.close()
        return None
