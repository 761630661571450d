"""One engine's concurrency: the requests in flight, the wait they predict, and the lock they take (docs/scaling.md §1).

One in-process ``Llama`` serves one request at a time (:class:`EngineLease`, in the order the waits were predicted). Every wrapper of
the engine shares one :class:`EngineQueue`: a request's predicted wait is the remaining work of those in flight ahead of
it, and the context it finds is the last one's prompt. A request is in flight while it is planned and from the moment it
asks for the engine until its stream lets go of it (ends, fails, is closed or collected).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

from trimkit.errors import EngineBusyError, InvalidInputError, non_negative_finite

#: what a request does when the predicted wait for the engine breaks its budget
ON_BUSY = ("trim", "wait")
#: the answer length predicted for a request without ``max_tokens`` until one such answer finished
DEFAULT_ANSWER_TOKENS = 256
#: how many recent answers the typical answer length and the decode speed are medians of
ANSWER_WINDOW = 32
#: a request waits for the engine at most its budget plus this many times its predicted wait
WAIT_BOUND_FACTOR = 2.0
#: the budget a prompt is planned to when the wait leaves no room (the plan is then infeasible)
MIN_PLAN_BUDGET_S = 1e-6
#: how long a request without a TTFT budget (and each calibration step) waits for a busy engine
DEFAULT_ENGINE_WAIT_S = 120.0


def check_on_busy(value: Any) -> str:
    if not isinstance(value, str) or value not in ON_BUSY:
        raise InvalidInputError(f"on_busy must be 'trim' or 'wait', got {value!r}")
    return value


def queue_wait(value: Any) -> float | None:
    """A caller's predicted wait (``queue_wait_s=``): None, or a finite number >= 0."""
    return None if value is None else non_negative_finite(value, "queue_wait_s")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Ticket:
    """One request on an engine: its predicted work and how far it has got. It is in its queue while it waits for or holds
    the engine (see :meth:`EngineLease.section`) or while it is planned; :meth:`done` (idempotent) takes it out."""

    def __init__(self, queue: EngineQueue, seq: int) -> None:
        self.queue = queue
        self.seq = seq
        self.ttft_s: float | None = None  # predicted TTFT of the prompt sent (engine side)
        self.decode_s = 0.0
        self.prompt_tokens: Sequence[int] | None = None  # what the context holds after it
        self.held_at: float | None = None
        self.first_token_at: float | None = None

    def estimate(self, ttft_s: float, decode_s: float, prompt_tokens: Sequence[int] | None = None) -> None:
        self.ttft_s, self.decode_s = max(float(ttft_s), 0.0), max(float(decode_s), 0.0)
        if prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens

    def holding(self) -> None:
        if self.held_at is None:
            self.held_at = self.queue.clock()

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = self.queue.clock()

    def done(self) -> None:
        self.queue.leave(self)

    def work_s(self, default_s: float = 0.0) -> float:
        """All its predicted work: TTFT + decode (``default_s`` while its TTFT is not known yet)."""
        return default_s if self.ttft_s is None else self.ttft_s + self.decode_s

    def remaining_s(self, now: float, default_s: float = 0.0) -> float:
        if self.first_token_at is not None:
            return max(self.decode_s - (now - self.first_token_at), 0.0)
        if self.held_at is not None and self.ttft_s is not None:
            return max(self.ttft_s - (now - self.held_at), 0.0) + self.decode_s
        return self.work_s(default_s)


class EngineQueue:
    """The requests in flight on one engine, in the order they entered; ``clock`` is the engine's. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._tickets: list[Ticket] = []
        self._answers: deque[int] = deque(maxlen=ANSWER_WINDOW)
        self._speeds: deque[float] = deque(maxlen=ANSWER_WINDOW)  # decode tokens/s of recent streams
        self.on_leave: Callable[[], None] | None = None  # called after a ticket left (its lease wakes its waiters)

    def enter(self, ticket: Ticket | None = None) -> Ticket:
        """``ticket`` (default: a new one, at the end of the line) in the line; one coming back (planned, now sent) takes
        the place it entered first, before the requests that entered after it."""
        with self._lock:
            ticket = Ticket(self, next(self._seq)) if ticket is None else ticket
            if ticket not in self._tickets:
                bisect.insort(self._tickets, ticket, key=lambda t: t.seq)
            return ticket

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket not in self._tickets:
                return
            self._tickets.remove(ticket)
        if self.on_leave is not None:  # (outside the lock: the lease's waiters look at the queue)
            self.on_leave()

    def in_flight(self) -> list[Ticket]:
        """The requests in flight, in entry order."""
        with self._lock:
            return list(self._tickets)

    def __len__(self) -> int:
        return len(self.in_flight())

    def ahead(self, ticket: Ticket | None = None) -> list[Ticket]:
        tickets = self.in_flight()
        return tickets[: tickets.index(ticket)] if ticket in tickets else tickets

    def context_after(self, ticket: Ticket | None = None) -> Sequence[int] | None:
        """The prompt of the last request ahead of ``ticket`` (``()`` while unknown); None when nobody is ahead."""
        ahead = self.ahead(ticket)
        return (ahead[-1].prompt_tokens or ()) if ahead else None

    def wait_s(self, ticket: Ticket | None = None, *, default_s: float | None = None) -> float:
        return self.predict(ticket, default_s=default_s)[0]

    def predict(self, ticket: Ticket | None = None, *, default_s: float | None = None) -> tuple[float, int]:
        """``(predicted wait, requests ahead)``: the remaining work ahead of ``ticket``; one whose TTFT is not known
        yet counts ``default_s`` (default: ``ticket``'s own work)."""
        default = (ticket.work_s() if ticket is not None else 0.0) if default_s is None else default_s
        now = self.clock()
        ahead = self.ahead(ticket)
        return sum(t.remaining_s(now, default) for t in ahead), len(ahead)

    def answer_tokens(self, params: Mapping[str, Any], room: int | None = None) -> int:
        """The answer length a request with ``params`` is predicted to decode (its cap, else the median of recent unbounded
        answers), at most ``room``."""
        with self._lock:
            answers = list(self._answers)
        n = answer_cap(params) or (int(statistics.median(answers)) if answers else DEFAULT_ANSWER_TOKENS)
        return max(min(n, room), 1) if room is not None else n

    def tokens_per_s(self, fallback: float) -> float:
        """The recent streams' median decode speed, else ``fallback``."""
        with self._lock:
            speeds = list(self._speeds)
        return statistics.median(speeds) if speeds else fallback

    def decode_s(self, params: Mapping[str, Any], tokens_per_s: float, room: int | None = None) -> float:
        """The predicted decode time after the first token (0 when no speed is known)."""
        speed = self.tokens_per_s(tokens_per_s)
        return (self.answer_tokens(params, room) - 1) / speed if speed > 0 else 0.0

    def observe(self, params: Mapping[str, Any], m: Any) -> None:
        """A request with ``params`` finished, measured as ``m``: its stream's decode speed (tokens after the first over the
        time after it), and (without ``max_tokens``) its answer's length."""
        tokens, first, total = m.completion_tokens, m.ttft_s if m.ttft_s is not None else m.first_output_s, m.total_s
        with self._lock:
            if all(_real(x) for x in (tokens, first, total)) and tokens >= 2 and total > first:
                self._speeds.append((tokens - 1) / (total - first))
            if answer_cap(params) is None and isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
                self._answers.append(tokens)


def answer_cap(params: Mapping[str, Any]) -> int | None:
    """``max_tokens`` or ``max_completion_tokens`` (> 0), else None."""
    for key in ("max_tokens", "max_completion_tokens"):
        v = params.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


@attrs.frozen
class BusyDecision:
    """What the predicted wait does to one request's plan (:func:`busy_decision`)."""

    on_busy: str
    wait_s: float | None
    ahead: int = 0
    margin: float = 0.0
    plan_budget_s: float | None = None
    counted_wait_s: float = 0.0
    refuse: bool = False

    def warnings(self, budget_s: float | None, engine_s: float) -> list[str]:
        """What the report says of the wait; ``engine_s``: the prompt's own TTFT."""
        wait = self.wait_s
        if not wait:
            return []
        who = f"{self.ahead} request(s) ahead on the engine" if self.ahead else "the requests ahead (as the caller predicted)"
        head = f"{who}: predicted wait {wait:.3f} s, counted in the predicted TTFT"
        if budget_s is None or self.refuse:
            return [head]
        if self.on_busy == "wait":
            over = " — predicted to break the budget" if wait + engine_s > budget_s else ""
            return [f"{head}; on_busy='wait': the prompt was planned to the whole budget as if the engine were free{over}"]
        return [f"{head}; the prompt was planned to the budget less that wait (on_busy={self.on_busy!r})"]

    def refusal(self, budget_s: float) -> str:
        return (f"the {self.ahead} request(s) ahead on the engine are predicted to take {self.wait_s or 0.0:.3f} s of the "
                f"{budget_s:.3f} s TTFT budget (on_infeasible='raise'): no prompt can meet it; nothing was sent")


def busy_decision(on_busy: str, budget_s: float | None, wait_s: float | None, margin: float, ahead: int = 0, *,
                  refuse: bool = False) -> BusyDecision:
    """With ``"trim"``, wait + TTFT must fit ``budget × (1 − margin)``: the plan budget is ``budget − wait / (1 − margin)``
    (``refuse``: a wait that alone reaches it refuses the request). With ``"wait"`` the whole budget."""
    decision = BusyDecision(on_busy, wait_s, ahead, margin, budget_s)
    wait = wait_s or 0.0
    if budget_s is None or on_busy == "wait" or wait <= 0.0:
        return decision
    keep = max(1.0 - margin, 1e-9)
    if refuse and wait >= budget_s * keep:
        return attrs.evolve(decision, plan_budget_s=None, counted_wait_s=wait, refuse=True)
    return attrs.evolve(decision, plan_budget_s=max(budget_s - wait / keep, MIN_PLAN_BUDGET_S), counted_wait_s=wait)


def wait_bound_s(budget_s: float | None, wait_s: float | None, default_s: float) -> float:
    """How long a request waits for the engine before :class:`~trimkit.errors.EngineBusyError`."""
    return (default_s if budget_s is None else budget_s) + WAIT_BOUND_FACTOR * (wait_s or 0.0)


class EngineLease:
    """One ``Llama``'s lock and its :attr:`queue` (``clock``: the engine's): one holder at a time, requests served in the order
    they entered the queue (a request's ticket: the order its wait was predicted in), others first come, first served.

    A request does not take the engine ahead of one that entered the queue before it and is still being planned: that one's
    predicted wait did not count it. It takes it anyway once its own wait bound has passed (a plan that never ends), and a
    waiter without a request (a calibration step, any engine use a plan itself makes) is never held back by a plan.

    ``with lease.section(timeout_s, ticket):`` holds it for a block in this thread (re-entrant; ``with lease:`` uses the
    default bound), the request's ticket in the engine's queue meanwhile; :meth:`hold` takes it for a stream, released once
    from any thread (a stream opened in a section takes over its ticket). A waiter past ``timeout_s`` gets EngineBusyError.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.queue = EngineQueue(clock)
        # re-entrant: a stream collected while this thread holds the lock gives the engine back from inside
        self._cond = threading.Condition(threading.RLock())
        self._thread: int | None = None  # the thread whose section holds the engine
        self._depth = 0
        self._ticket: Ticket | None = None  # the section's request, until a stream takes it over
        self._streams = 0  # open stream holds
        self._line: list[tuple[int, object, Ticket | None]] = []  # the waiters, by their request's place in the queue
        self.queue.on_leave = self._wake  # a plan ended: a request held back by it may go

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._depth > 0 or self._streams > 0

    @property
    def waiters(self) -> int:
        with self._cond:
            return len(self._line)

    def _planning(self) -> float:
        """The place in the queue of the first request still being planned (neither waiting here nor served yet), or inf."""
        waiting = {id(t) for _, _, t in self._line}
        return min((t.seq for t in self.queue.in_flight() if t.held_at is None and id(t) not in waiting), default=math.inf)

    def _next(self) -> object | None:
        """The waiter whose turn it is: the first in line not held back by an earlier request still planned."""
        planning = self._planning()
        return next((key for seq, key, t in self._line if t is None or seq < planning), None)

    def _wait(self, timeout_s: float, what: str, ticket: Ticket | None = None) -> float:
        """Wait (under ``_cond``) until this thread may use the engine, in line (``ticket``: at its request's place in the
        queue, which a request that finished planning later may reach the lock before); seconds waited."""
        held_back = ticket is not None and self._planning() < ticket.seq
        if (self._depth > 0 and self._thread == threading.get_ident()) or not (self.busy or self._line or held_back):
            return 0.0  # its own section, or a free engine nobody waits for or plans ahead of it
        me = (ticket.seq if ticket is not None else next(self.queue._seq), object(), ticket)
        bisect.insort(self._line, me, key=operator.itemgetter(0))
        self._cond.notify_all()  # a request held back by this one's plan may go
        t0 = time.perf_counter()
        deadline = t0 + max(float(timeout_s), 0.0)
        try:
            while self.busy or self._next() is not me[1]:
                left = deadline - time.perf_counter()
                if left <= 0 and not self.busy and self._next() is None:
                    break  # only plans that have not ended held it back: its bound has passed, it goes
                if left <= 0:
                    waited = time.perf_counter() - t0
                    holder = "an unfinished stream" if self._streams else "another thread" if self._depth else "a request ahead"
                    raise EngineBusyError(
                        f"the llama.cpp engine stayed busy ({holder} holds it) for {waited:.3f} s, this {what}'s wait bound; "
                        "finish or close() streams you do not read to the end",
                        waited_s=waited,
                    )
                self._cond.wait(left)
        finally:
            self._line.remove(me)
            self._cond.notify_all()  # the head of the line may have changed
        return time.perf_counter() - t0

    def __enter__(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S, ticket: Ticket | None = None) -> float:
        with self._cond:
            waited = self._wait(timeout_s, "call", ticket)
            self._thread = threading.get_ident()
            self._ticket = self._ticket or ticket
            self._depth += 1
        if ticket is not None:
            ticket.holding()
        return waited

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth > 0:
                return
            ticket, self._thread, self._ticket = self._ticket, None, None
            self._cond.notify_all()
        if ticket is not None:  # no stream took it over: out of the queue
            ticket.done()

    @contextmanager
    def section(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S, ticket: Ticket | None = None) -> Iterator[float]:
        """Hold the engine for a block of code in this thread; yields the seconds waited. ``ticket``: the request's, in its
        queue from now until the block ends or, if the block opens a stream (:meth:`hold`), until that stream lets go."""
        if ticket is not None:
            self.queue.enter(ticket)
        try:
            waited = self.__enter__(timeout_s, ticket)
        except BaseException:
            if ticket is not None:
                ticket.done()
            raise
        try:
            yield waited
        finally:
            self.__exit__()

    def hold(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S) -> tuple[Callable[[], None], float]:
        """Take the engine for a stream: ``(release, seconds waited)``; only the first ``release()`` counts."""
        with self._cond:
            waited = self._wait(timeout_s, "request")
            self._streams += 1
            ticket = None
            if self._thread == threading.get_ident():
                ticket, self._ticket = self._ticket, None
        done = threading.Lock()

        def release() -> None:
            if not done.acquire(blocking=False):
                return
            with self._cond:
                self._streams -= 1
                self._cond.notify_all()
            if ticket is not None:
                ticket.done()

        return release, waited


_ENGINES: weakref.WeakKeyDictionary[Any, EngineLease] = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def engine_lease(engine: Any, clock: Callable[[], float] = time.perf_counter) -> EngineLease:
    """The one lease of ``engine``, shared by every backend over it (a fresh one if it cannot be weakly referenced); ``clock``:
    its queue's, if it is made now."""
    with _ENGINES_LOCK:
        try:
            lease = _ENGINES.get(engine)
            if lease is None:
                lease = _ENGINES[engine] = EngineLease(clock)
            return lease
        except TypeError:
            return EngineLease(clock)
