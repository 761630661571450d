"""Who may use an in-process engine now: :class:`EngineLease`, one per engine object.

An in-process llama.cpp context runs one request at a time. Every backend over the same
``Llama`` shares one lease (:func:`engine_lease`); a request holds it from ``send`` until its
stream is finished, closed or garbage-collected — in whichever thread that happens.
"""

from __future__ import annotations

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
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._thread: int | None = None  # the thread whose section holds the engine
        self._depth = 0  # nesting depth of that section
        self._streams = 0  # open stream holds
        self._waiters = 0  # threads waiting now
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
            return self._waiters

    def _wait(self, timeout_s: float, what: str) -> float:
        """Wait (under ``_cond``) until this thread may use the engine; seconds waited."""
        me = threading.get_ident()

        def free() -> bool:
            return (self._depth == 0 and self._streams == 0) or (self._depth > 0 and self._thread == me)

        if free():
            return 0.0
        t0 = time.perf_counter()
        self._waiters += 1
        try:
            ok = self._cond.wait_for(free, timeout=max(float(timeout_s), 0.0))
        finally:
            self._waiters -= 1
        waited = time.perf_counter() - t0
        if not ok:
            holder = "an unfinished stream" if self._streams else "another thread"
            raise EngineBusyError(
                f"the llama.cpp engine stayed busy ({holder} holds it) for {waited:.3f} s, this {what}'s wait bound; "
                "finish or close() streams you do not read to the end",
                waited_s=waited,
            )
        return waited

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
