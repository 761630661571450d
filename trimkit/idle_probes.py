"""The first run: a micro-calibration now, the rest of the probes while the engine is idle.

``trimkit.wrap()`` without a stored profile serves after a micro-calibration of about 3 s
(:func:`calibration_mode`; a *provisional* profile, planned with a wider margin and refined by
every measured request, :mod:`trimkit.planning.drift`). The probes a full calibration would take
that the profile still lacks (:func:`~trimkit.calibration.remaining_probes`, cheapest first) are
then measured by the engine's :class:`IdleProber`, one at a time, in a daemon thread:

- **Only when the engine is idle.** Not before the first request through a wrapper of the engine
  has finished; then only while nobody holds the engine or waits for it, and once it has been
  quiet — no request running, waiting or being planned — for at least ``max(quiet_s, the
  probe's predicted time)`` (``quiet_s`` = :data:`QUIET_S`, 1 s). So a probe starts only after
  an idle stretch at least as long as itself: probing takes at most about half of any idle
  stretch, and never starts between the requests of a burst.
- **Only when it is likely to finish.** Once :data:`MIN_GAPS` idle stretches between requests
  have been seen, a probe starts only if, of the recent stretches (:data:`GAP_MEMORY`) that
  lasted as long as this one has so far, at least half lasted long enough for the probe as well
  (:data:`FINISH_SHARE`); a stretch longer than any seen lets it start. A caller who pauses
  1.5 s between requests then gets no 1.2 s probe started at 1 s and stopped at 1.5 s — work
  thrown away, and the next request's wait for the stop. Counted as ``deferred``.
- **Never while a caller waits.** A probe holds the engine preemptibly
  (:meth:`~trimkit.backends.lease.EngineLease.preemptible`): the moment a request asks for the
  engine, llama.cpp's abort callback stops the decode (within one graph node), the sample is
  discarded and the context is put back as it was — tokens and KV cells — so the request finds
  the cache it was planned for (:meth:`~trimkit.backends.llama.LlamaBackend.idle_probe`). The
  probe is tried again in a later idle stretch.
- **What it learns.** After each probe the profile is refitted with it
  (:func:`~trimkit.calibration.refit_profile`) — the probe's time divided by how much slower
  the host runs now than during calibration (:meth:`~trimkit.planning.drift.LiveProfile.speed_factor`:
  the served prediction over the calibration's own), so that samples from a slower and a faster
  moment do not bend the model's shape while drift carries the speed — and swapped into the engine's
  :class:`~trimkit.planning.drift.LiveProfile` (:meth:`~trimkit.planning.drift.LiveProfile.replace_calibration`);
  when none remain, the profile becomes a full one (``mode="full"``) and is stored.
- **Which engines.** Only backends whose probes can be aborted (an ``idle_probe`` method:
  in-process llama.cpp). A server gets none: a request sent to a server cannot be called back,
  the server's other clients are invisible from here, and a request arriving would wait behind
  the probe. A server's profile improves from every measured request instead (its timings).
- **Lifetime.** One prober per engine (:attr:`~trimkit.planning.margin.EngineState.prober`),
  shared by every wrapper of it. It holds the backends weakly and its thread holds it weakly:
  the thread ends when the schedule is complete, when the prober is stopped
  (:meth:`IdleProber.stop`, :meth:`~trimkit.planning.margin.EngineState.close`,
  :func:`~trimkit.planning.margin.forget_engines`), when the last wrapper and backend of the
  engine are garbage-collected, and at interpreter exit. ``wrap(..., idle_probes=False)`` never
  starts one.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any

from trimkit.calibration import Probe, refit_profile, remaining_probes
from trimkit.errors import InvalidInputError
from trimkit.planning.costs import PrefillSample
from trimkit.planning.drift import LiveProfile
from trimkit.planning.margin import EngineState
from trimkit.profile import CALIBRATION_MODES, Profile
from trimkit.profile_store import save_profile

__all__ = ["IdleProber", "idle_prober", "QUIET_S", "can_probe_idle", "calibration_mode", "likely_to_finish"]

log = logging.getLogger("trimkit")

#: the shortest quiet stretch (seconds without a request running, waiting or being planned)
#: before an idle probe may start; a longer probe waits for a stretch as long as itself
QUIET_S = 1.0
#: how long :meth:`IdleProber.stop` waits for the thread by default (an abort takes one graph node)
STOP_WAIT_S = 10.0
#: a probe measured this many times without leaving the schedule stops the prober (a guard)
_MAX_RUNS_PER_PROBE = 8
#: idle stretches between requests remembered, to judge whether a probe would finish in one
GAP_MEMORY = 32
#: fewer stretches than this say nothing yet: probes start on the quiet rule alone
MIN_GAPS = 5
#: the least share of the comparable stretches that must have been long enough for the probe
FINISH_SHARE = 0.5
#: seconds between two looks while the stretches say a probe would not finish
DEFER_LOOK_S = 0.1


def likely_to_finish(gaps: Any, quiet_s: float, probe_s: float) -> bool:
    """Whether a probe of ``probe_s`` started after ``quiet_s`` of quiet is likely to finish
    before the next request, judged from the recent idle stretches ``gaps`` (seconds): of those
    that lasted at least ``quiet_s``, at least :data:`FINISH_SHARE` lasted ``quiet_s +
    probe_s``. True while fewer than :data:`MIN_GAPS` are known, and when none lasted this long
    (the caller is away longer than ever seen)."""
    gaps = list(gaps)
    if len(gaps) < MIN_GAPS:
        return True
    lasting = [g for g in gaps if g >= quiet_s]
    if not lasting:
        return True
    return sum(g >= quiet_s + probe_s for g in lasting) >= FINISH_SHARE * len(lasting)


def calibration_mode(calibration: str | None, quick_calibration: bool | None) -> str:
    """The calibration mode ``wrap()`` asks for when it has no profile (:data:`CALIBRATION_MODES`):
    ``calibration``, else the older ``quick_calibration`` (True: "quick", False: "full"), else
    "micro" (about 3 s, provisional)."""
    if calibration is None:
        return "micro" if quick_calibration is None else ("quick" if quick_calibration else "full")
    if quick_calibration is not None:
        raise InvalidInputError("pass calibration= or quick_calibration=, not both")
    if calibration not in CALIBRATION_MODES:
        raise InvalidInputError(f"calibration must be one of {', '.join(map(repr, CALIBRATION_MODES))}, got {calibration!r}")
    return calibration


_LIVE: weakref.WeakSet[IdleProber] = weakref.WeakSet()  # probers whose thread runs
_LIVE_LOCK = threading.Lock()


def can_probe_idle(backend: Any) -> bool:
    """Whether ``backend``'s probes can run as idle work: it has an engine lease and an
    abortable probe (``idle_probe``)."""
    return callable(getattr(backend, "idle_probe", None)) and getattr(backend, "engine", None) is not None


class IdleProber:
    """Measures the probes ``live``'s profile lacks while its engine is idle (module docstring).

    ``probed``, ``aborted``: probes measured, and given up because a request wanted the engine;
    ``deferred``: idle stretches in which no probe started because the caller's earlier
    stretches said it would not finish (:func:`likely_to_finish`); ``complete``: the schedule
    is done (the profile is a full one, stored when ``store``)."""

    def __init__(self, live: LiveProfile, *, quiet_s: float = QUIET_S, store: bool = True) -> None:
        self.live = live
        #: the shortest quiet stretch before a probe (:data:`QUIET_S`); settable
        self.quiet_s = float(quiet_s)
        self.store = store
        self.probed = 0
        self.aborted = 0
        self.deferred = 0
        self.complete = False
        #: the recent idle stretches between a request's end and the next request's start (seconds)
        self.gaps: deque[float] = deque(maxlen=GAP_MEMORY)
        self._idle_since: float | None = None
        self._deferred_stretch: float | None = None
        self._backends: weakref.WeakSet[Any] = weakref.WeakSet()
        self._runs: dict[tuple[int, int], int] = {}
        self._last_activity = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        weakref.finalize(self, self._stop.set)  # a collected prober's thread wakes and ends

    # -- what the pipelines tell it -------------------------------------------------------------
    def attach(self, backend: Any) -> None:
        """Probe through ``backend`` too (held weakly; any live one of the engine's will do)."""
        if can_probe_idle(backend):
            self._backends.add(backend)

    def activity(self) -> None:
        """A request is being planned or has just finished: the quiet period starts again (and
        the idle stretch since the last request's end, if any, is remembered)."""
        now = time.monotonic()
        with self._lock:
            if self._idle_since is not None:
                self.gaps.append(max(now - self._idle_since, 0.0))
                self._idle_since = None
        self._last_activity = now

    def request_done(self) -> None:
        """A request finished: start the thread (unless it runs, is stopped or is done) if the
        profile lacks probes."""
        self.activity()
        with self._lock:
            self._idle_since = self._last_activity
            if self.running or self._stop.is_set() or self.complete:
                return
            backend = self._backend()
            if backend is None or not remaining_probes(self.live.current, backend.n_ctx):
                return
            self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._stop), name="trimkit-idle-probes", daemon=True)
            with _LIVE_LOCK:
                _LIVE.add(self)
            self._thread.start()

    # -- control --------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True while the prober's thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        """The prober's thread, once the first request has started it."""
        return self._thread

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self, *, wait: bool = True, timeout_s: float = STOP_WAIT_S) -> None:
        """Stop probing: a probe running now is aborted and its context put back; ``wait``:
        until the thread has ended (at most ``timeout_s``)."""
        self._stop.set()
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def wait_complete(self, timeout_s: float) -> bool:
        """Wait until the thread has ended (schedule complete or stopped); whether it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return not self.running

    # -- the work -------------------------------------------------------------------------------
    def _backend(self) -> Any:
        for backend in list(self._backends):
            return backend
        return None

    def step(self) -> float | None:
        """One look at the engine: the next probe if it is idle enough. Returns the seconds to
        wait before the next look, or None when there is nothing more to do."""
        backend = self._backend()
        if backend is None or self._stop.is_set():
            return None
        profile = self.live.current
        todo = remaining_probes(profile, backend.n_ctx)
        if not todo:
            self._finish()
            return None
        probe = todo[0]
        lease = backend.engine
        predicted = _predicted_s(profile, probe)
        need = max(self.quiet_s, predicted)
        quiet = min(lease.idle_for(), time.monotonic() - self._last_activity)
        if quiet < need:
            return max(need - quiet, 0.01)
        with self._lock:
            gaps = tuple(self.gaps)
        if not likely_to_finish(gaps, quiet, predicted):
            if self._deferred_stretch != self._last_activity:  # counted once per idle stretch
                self._deferred_stretch = self._last_activity
                self.deferred += 1
            return DEFER_LOOK_S
        held, seconds = _probe_on_own_thread(backend, probe, lease, self._stop)
        if not held:
            return 0.05
        if seconds is None:
            self.aborted += 1
            log.debug("trimkit: idle probe %s aborted: a request wanted the engine", probe)
            return 0.01
        return self._learn(probe, seconds)

    def _learn(self, probe: Probe, seconds: float) -> float | None:
        key = (probe.new_tokens, probe.cached_tokens)
        self._runs[key] = self._runs.get(key, 0) + 1
        if self._runs[key] > _MAX_RUNS_PER_PROBE:
            log.warning("trimkit: idle probe %s keeps being scheduled after %d measurements; idle probing stops", probe, self._runs[key] - 1)
            self._stop.set()
            return None
        # joins the calibration's samples at their speed; drift carries the host's change since
        factor = self.live.speed_factor(probe.new_tokens, probe.cached_tokens)
        refined = refit_profile(self.live.current, [PrefillSample(probe.new_tokens, probe.cached_tokens, seconds / factor)])
        self.live.replace_calibration(refined)
        self.probed += 1
        return 0.0

    def _finish(self) -> None:
        """No probe remains: the profile is a full calibration now; store it."""
        profile = self.live.current
        if profile.mode != "full":
            self.live.replace_calibration(refit_profile(profile, [], mode="full"))
        self.complete = True
        if self.store:
            try:
                save_profile(self.live.current)
            except OSError as exc:  # a read-only cache must not end the process's learning
                log.warning("trimkit: could not store the profile completed by idle probes: %s", exc)
        log.info("trimkit: idle probes completed the calibration (%d probes, %d aborted for requests)", self.probed, self.aborted)


def _probe_on_own_thread(backend: Any, probe: Probe, lease: Any, stop: threading.Event) -> tuple[bool, float | None]:
    """Take the engine as idle work and run ``probe`` on a thread of its own that ends with it:
    (whether the engine was free, the probe's seconds or None if aborted). The prober's own
    thread never runs llama.cpp: with llama.cpp's OpenMP build, a live thread that has run its
    compute slowed every request after it while it stayed alive (Gemma, 2 vCPUs: a 20-token
    follow-up 47 → 56–60 ms; through the wrapper 48–72 → 80–124 ms), and a thread that ended
    left no trace (docs/quickstart.md §2, docs/benchmarks.md)."""
    out: dict[str, Any] = {"held": False, "seconds": None}

    def work() -> None:
        try:
            with lease.preemptible() as held:
                out["held"] = held
                if held:
                    out["seconds"] = backend.idle_probe(probe.new_tokens, probe.cached_tokens,
                                                        lambda: lease.preempt_requested or stop.is_set())
        except BaseException as exc:  # re-raised on the prober's thread, which reports it
            out["error"] = exc

    # a daemon thread, not a ThreadPoolExecutor: the interpreter joins a pool's threads at exit
    # before the atexit hook that aborts a running probe (_stop_all) could run
    thread = threading.Thread(target=work, name="trimkit-idle-probe", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["held"], out["seconds"]


def _predicted_s(profile: Profile, probe: Probe) -> float:
    """The probe's predicted engine time: its prefill, and the prefill of its cached prefix."""
    setup = profile.predict_prefill_s(probe.cached_tokens, 0) if probe.cached_tokens else 0.0
    return profile.predict_prefill_s(probe.new_tokens, probe.cached_tokens) + setup


def _run(ref: weakref.ReferenceType[IdleProber], stop: threading.Event) -> None:
    """The prober's thread: holds the prober only while it looks at the engine."""
    while not stop.is_set():
        prober = ref()
        if prober is None:
            return
        try:
            delay = prober.step()
        except Exception as exc:  # idle work must never take the process down
            log.warning("trimkit: idle probing stopped: %s: %s", type(exc).__name__, exc)
            stop.set()
            delay = None
        del prober
        if delay is None:
            return
        stop.wait(delay)


def idle_prober(engine: EngineState, backend: Any, *, quiet_s: float = QUIET_S) -> IdleProber | None:
    """The idle prober of ``engine`` (one per engine, made on first use), probing through
    ``backend`` too; None if ``backend``'s probes cannot be aborted (a server)."""
    if not can_probe_idle(backend):
        return None
    with _LIVE_LOCK:
        prober = engine.prober
        if prober is None or prober.stopped:
            prober = engine.prober = IdleProber(engine.live, quiet_s=quiet_s)
    prober.attach(backend)
    return prober


@atexit.register
def _stop_all() -> None:
    """At exit: stop every prober (a probe in llama.cpp is aborted, its context put back)."""
    with _LIVE_LOCK:
        probers = list(_LIVE)
    for prober in probers:
        prober.stop(wait=False)
    for prober in probers:
        prober.stop(wait=True, timeout_s=2.0)
