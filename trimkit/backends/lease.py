"""Who may use an in-process engine now: :class:`EngineLease`, one per engine object.

An in-process llama.cpp context runs one request at a time. Every backend over the same
``Llama`` shares one lease (:func:`engine_lease`); a request holds it from ``send`` until its
stream is finished, closed or garbage-collected — in whichever thread that happens.

Waiters get the engine in turn order: each takes a turn number when it starts waiting, or
earlier with :meth:`EngineLease.take_turn` — a wrapped request takes its turn when it starts
being planned, so that the engine is handed on in the order the in-flight queue predicted the
waits in (:mod:`trimkit.planning.queue`). A turn taken ahead of time is *reserved*: no later turn
takes the engine while it is planned, and for a short grace after (:meth:`EngineLease.keep_turn`)
in which it is sent; then it holds nobody back until it arrives (a request planned and never
sent, or sent much later, cannot block the engine).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trimkit.errors import EngineBusyError

__all__ = ["EngineLease", "engine_lease", "DEFAULT_ENGINE_WAIT_S"]

#: how long a request without a TTFT budget (and each calibration or prefill step) waits for the
#: engine while another request or an unfinished stream holds it, before EngineBusyError
DEFAULT_ENGINE_WAIT_S = 120.0


class EngineLease:
    """Who may use one ``Llama`` now: one request at a time.

    Two kinds of holder. A *section* (``with lease.section(timeout_s):``) is a block of ordinary
    code in one thread — prefill, a probe, restoring a snapshot; re-entrant for that thread,
    never held across a ``yield``. A *stream hold* (:meth:`hold`) belongs to a response stream,
    not to a thread: it is released (once) by whoever finishes, closes or garbage-collects the
    stream, from any thread. A thread inside a section may take a stream hold at once (the
    wrapper restores a snapshot and starts the stream as one step); the hold outlives the section.

    Waiting is bounded: past ``timeout_s`` a waiter gets :class:`~trimkit.errors.EngineBusyError`.
    Waiters are served lowest turn first (:meth:`take_turn`; a waiter without one takes the next
    turn when it starts waiting), so the engine passes on in arrival order, not at random, and
    none takes it before an earlier turn still reserved (see the module docstring).
    """

    def __init__(self) -> None:
        # re-entrant: a stream garbage-collected while this thread holds the lock gives the engine
        # back from inside (weakref finalizers run wherever the collector does)
        self._cond = threading.Condition(threading.RLock())
        self._thread: int | None = None  # the thread whose section holds the engine
        self._depth = 0  # nesting depth of that section
        self._streams = 0  # open stream holds
        self._waiters = 0  # threads waiting now
        self._local = threading.local()  # ``with lease:`` sections entered by each thread
        self._turns = itertools.count()  # turn numbers, in the order they are taken
        self._line: list[tuple[int, int]] = []  # (turn, arrival) of each thread waiting now
        self._reserved: dict[int, tuple[float, int]] = {}  # turns taken ahead → (when they lapse, monotonic; by which thread)

    @property
    def busy(self) -> bool:
        """True while a section or a stream holds the engine."""
        with self._cond:
            return self._depth > 0 or self._streams > 0

    @property
    def waiters(self) -> int:
        """Threads waiting for the engine now."""
        with self._cond:
            return self._waiters

    def take_turn(self) -> int:
        """A turn, reserved from now: among threads waiting for the engine the lowest turn goes
        first, and none with a later turn takes the engine until this one arrives
        (:meth:`hold` / :meth:`section` with ``turn=``), is cancelled (:meth:`cancel_turn`) or
        lapses (:meth:`keep_turn`)."""
        with self._cond:
            turn = next(self._turns)
            self._reserved[turn] = (math.inf, threading.get_ident())
            return turn

    def keep_turn(self, turn: int, for_s: float) -> None:
        """Keep ``turn`` reserved only ``for_s`` more seconds (its request is ready to send)."""
        with self._cond:
            if turn in self._reserved:
                self._reserved[turn] = (time.monotonic() + max(float(for_s), 0.0), self._reserved[turn][1])
                self._cond.notify_all()  # waiters behind it wait until then at most

    def cancel_turn(self, turn: int) -> None:
        """Give up a reserved turn (its request will not come); nothing if it arrived already."""
        with self._cond:
            if self._reserved.pop(turn, None) is not None:
                self._cond.notify_all()

    def _reserved_before(self, turn: float, me: int | None = None) -> float | None:
        """Under ``_cond``: when the last reservation ahead of ``turn`` lapses (None: none;
        ``inf``: not before it arrives or is cancelled), leaving out thread ``me``'s own (a
        thread never waits for a request it is planning itself). Lapsed reservations are dropped."""
        now = time.monotonic()
        for t in [t for t, (until, _) in self._reserved.items() if until <= now]:
            del self._reserved[t]
        ahead = [until for t, (until, owner) in self._reserved.items() if t < turn and owner != me]
        return max(ahead) if ahead else None

    def _wait(self, timeout_s: float, what: str, turn: int | None = None) -> float:
        """Wait (under ``_cond``) until this thread may use the engine, in turn; seconds waited."""
        if self._depth > 0 and self._thread == threading.get_ident():
            return 0.0  # re-entrant: this thread's section holds it
        if turn is not None:
            self._reserved.pop(turn, None)  # arrived: it waits in line now
        place = (next(self._turns) if turn is None else turn, next(self._turns))
        self._line.append(place)
        me = threading.get_ident()

        def free() -> bool:
            return (self._depth == 0 and self._streams == 0 and min(self._line) == place
                    and self._reserved_before(place[0], me) is None)

        t0 = time.perf_counter()
        deadline = time.monotonic() + max(float(timeout_s), 0.0)
        waiting = not free()
        ok = True
        if waiting:
            self._waiters += 1
        try:
            while waiting and not free():
                left = deadline - time.monotonic()
                if left <= 0:
                    ok = False
                    break
                lapse = self._reserved_before(place[0], me)
                self._cond.wait(min(left, max(lapse - time.monotonic(), 0.0)) if lapse is not None and lapse < math.inf else left)
        finally:
            if waiting:
                self._waiters -= 1
            self._line.remove(place)
            if waiting:
                self._cond.notify_all()  # the head of the line may have changed
        if not waiting:
            return 0.0
        waited = time.perf_counter() - t0
        if not ok:
            holder = "an unfinished stream" if self._streams else "another thread" if self._depth else "an earlier request being planned"
            raise EngineBusyError(
                f"the llama.cpp engine stayed busy ({holder} holds it) for {waited:.3f} s, this {what}'s wait bound; "
                "finish or close() streams you do not read to the end",
                waited_s=waited,
            )
        return waited

    @contextmanager
    def section(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S, *, turn: int | None = None) -> Iterator[float]:
        """Hold the engine for a block of code in this thread; yields the seconds waited
        (``turn``: a place in line taken earlier with :meth:`take_turn`)."""
        with self._cond:
            waited = self._wait(timeout_s, "call", turn)
            self._thread = threading.get_ident()
            self._depth += 1
        try:
            yield waited
        finally:
            self._leave()

    def _leave(self) -> None:
        """Leave a section; the outermost one gives the engine back."""
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._thread = None
                self._cond.notify_all()

    def hold(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S, *, turn: int | None = None) -> tuple[Callable[[], None], float]:
        """Take the engine for a stream: ``(release, seconds waited)``; ``release()`` may be
        called from any thread, and only its first call counts (``turn``: as for :meth:`section`)."""
        with self._cond:
            waited = self._wait(timeout_s, "request", turn)
            self._streams += 1
        done = threading.Lock()

        def release() -> None:
            if not done.acquire(blocking=False):
                return
            with self._cond:
                self._streams -= 1
                self._cond.notify_all()

        return release, waited

    def __enter__(self) -> float:  # ``with backend.lock:`` — a section with the default bound
        cm = self.section()
        waited = cm.__enter__()
        self._entered().append(cm)
        return waited

    def __exit__(self, *exc: Any) -> None:
        self._entered().pop().__exit__(*exc)

    def _entered(self) -> list[Any]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack


_ENGINES: weakref.WeakKeyDictionary[Any, EngineLease] = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def engine_lease(engine: Any) -> EngineLease:
    """The one lease of ``engine`` (a ``Llama``), shared by every backend over it; a fresh one
    for an object that cannot be weakly referenced (then each backend has its own)."""
    with _ENGINES_LOCK:
        try:
            lease = _ENGINES.get(engine)
            if lease is None:
                lease = _ENGINES[engine] = EngineLease()
            return lease
        except TypeError:
            return EngineLease()
