"""Who may use an in-process engine now: :class:`EngineLease`, one FIFO lock per engine object.

An in-process llama.cpp context runs one request at a time. Every backend over the same
``Llama`` shares one lease (:func:`engine_lease`); a request holds it from ``send`` until its
stream is finished, closed or garbage-collected — in whichever thread that happens. Waiters get
the engine in the order they started waiting, each for a bounded time.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trimkit.errors import EngineBusyError

__all__ = ["EngineLease", "engine_lease", "DEFAULT_ENGINE_WAIT_S"]

#: how long a request without a TTFT budget (and each calibration or prefill step) waits for the
#: engine while another request or an unfinished stream holds it, before EngineBusyError
DEFAULT_ENGINE_WAIT_S = 120.0


class EngineLease:
    """One ``Llama``'s lock: one holder at a time, waiters served first come, first served.

    ``with lease.section(timeout_s) as waited:`` holds the engine for a block of code in this
    thread (re-entrant for that thread; ``with lease:`` is a section with the default bound).
    :meth:`hold` takes it for a response stream instead: released (once) by whoever finishes,
    closes or garbage-collects the stream, from any thread. A thread inside a section takes a
    stream hold at once (restoring a snapshot and starting the stream are one step); the hold
    outlives the section. Past ``timeout_s`` a waiter gets :class:`~trimkit.errors.EngineBusyError`.
    """

    def __init__(self) -> None:
        # re-entrant: a stream garbage-collected while this thread holds the lock gives the engine
        # back from inside (weakref finalizers run wherever the collector does)
        self._cond = threading.Condition(threading.RLock())
        self._thread: int | None = None  # the thread whose section holds the engine
        self._depth = 0  # nesting depth of that section
        self._streams = 0  # open stream holds
        self._line: deque[object] = deque()  # the waiters, first come first
        self._local = threading.local()  # ``with lease:`` sections entered by each thread

    @property
    def busy(self) -> bool:
        """True while a section or a stream holds the engine."""
        with self._cond:
            return self._depth > 0 or self._streams > 0

    @property
    def waiters(self) -> int:
        """Threads waiting for the engine now."""
        with self._cond:
            return len(self._line)

    def _wait(self, timeout_s: float, what: str) -> float:
        """Wait (under ``_cond``) until this thread may use the engine, in line; seconds waited."""
        if self._depth > 0 and self._thread == threading.get_ident():
            return 0.0  # re-entrant: this thread's section holds it
        if not self.busy and not self._line:
            return 0.0
        me = object()
        self._line.append(me)
        t0 = time.perf_counter()
        deadline = time.monotonic() + max(float(timeout_s), 0.0)
        try:
            while self.busy or self._line[0] is not me:
                left = deadline - time.monotonic()
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

    @contextmanager
    def section(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S) -> Iterator[float]:
        """Hold the engine for a block of code in this thread; yields the seconds waited."""
        with self._cond:
            waited = self._wait(timeout_s, "call")
            self._thread = threading.get_ident()
            self._depth += 1
        try:
            yield waited
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._thread = None
                    self._cond.notify_all()

    def hold(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S) -> tuple[Callable[[], None], float]:
        """Take the engine for a stream: ``(release, seconds waited)``; ``release()`` may be
        called from any thread, and only its first call counts."""
        with self._cond:
            waited = self._wait(timeout_s, "request")
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
