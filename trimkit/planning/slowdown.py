"""Telling the caller when the engine runs far slower than it was calibrated.

The live profile (:class:`~trimkit.planning.drift.LiveProfile`) follows the host's speed, so a
host that slows down gets its budgets held by trimming harder once drift has followed (2–5
requests). What it cannot do is say *why* the budgets went over before that, or why the prompts
now lose more than they used to. When the engine runs at least :data:`SLOWDOWN_FACTOR` times
slower than its calibration measured, every report says so, with the likely causes, and the
first such report logs it once (again after the speed came back).

The commonest cause on a CPU is another busy process: llama.cpp computes prefill on
``n_threads_batch`` threads that wait for each other at every step, so when they are as many as
the cores, one competing process stalls all of them. Measured on a 2-core host with both models
(docs/benchmarks.md, "When the host changes speed while trimkit serves"): one busy process made
prefill 2.4–3.2× slower and erratic (single requests 2.4–21× their calibrated time) with
llama-cpp-python's default ``n_threads_batch`` (all cores), and left it unchanged with
``n_threads_batch=1``. So an in-process engine whose profile says it uses every core the process
may run on gets that hint.
"""

from __future__ import annotations

import logging
import os
import threading

from trimkit.planning.drift import LiveProfile

__all__ = ["SLOWDOWN_FACTOR", "SlowdownWatch", "usable_cores"]

log = logging.getLogger("trimkit")

#: the engine counts as slowed down when it runs at least this many times slower than calibrated:
#: twice the time is beyond the noise of any host (a shared host's speed moves by tens of percent
#: over minutes, docs/design.md §2)
SLOWDOWN_FACTOR = 2.0


def usable_cores() -> int | None:
    """The CPU cores this process may run on (its affinity where the OS tells it), or None."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


class SlowdownWatch:
    """The slowdown notice of the engine whose live profile is ``live``: :meth:`warnings` for
    each request's report, logged once per slow spell. Thread-safe."""

    def __init__(self, live: LiveProfile) -> None:
        self.live = live
        self._lock = threading.Lock()
        self._logged = False

    def factor(self) -> float:
        """How many times slower than calibrated the engine runs now, for one batch of new
        tokens (:meth:`LiveProfile.speed_factor`: the model after live refits, times drift)."""
        model = self.live.current.model
        return self.live.speed_factor(max(int(model.n_batch), 1), 0)

    def warnings(self) -> list[str]:
        """The notice (a one-item list) while the engine runs :data:`SLOWDOWN_FACTOR` times slower
        than calibrated, else none."""
        slower = self.factor()
        with self._lock:
            if slower < SLOWDOWN_FACTOR:
                self._logged = False
                return []
            first, self._logged = not self._logged, True
        text = _notice(slower, self.live)
        if first:
            log.warning("trimkit: %s", text)
        return [text]


def _notice(slower: float, live: LiveProfile) -> str:
    key = live.current.key
    text = (f"the engine runs {slower:.1f}× slower than when it was calibrated (its recent requests): budgets are held by "
            "trimming harder once the profile has followed, requests planned before it did went over; another busy process, "
            "thermal throttling or a power-saving mode slows a host this much")
    cores = usable_cores()
    if key.backend == "llama_cpp" and key.n_threads_batch and cores and key.n_threads_batch >= cores:
        text += (f" — llama.cpp computes prefill on {key.n_threads_batch} threads and this process may use {cores} cores, so one "
                 "other busy process stalls every step: fewer threads (n_threads_batch) than the cores left free keep their speed")
    return text
