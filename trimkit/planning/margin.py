"""One engine's live state — its profile, its one speed estimate, its queue — and the safety margin.

**The engine's state.** One ``Llama`` (or one server URL + model) runs at one speed: its live
profile (:class:`~trimkit.planning.drift.LiveProfile`, which holds the one
:class:`~trimkit.planning.speed.SpeedEstimate`) and its in-flight queue
(:class:`~trimkit.planning.queue.EngineQueue`) live in one :class:`EngineState`, found by
:func:`engine_state` from the backend's :meth:`~trimkit.backends.base.Backend.engine_identity`.
A second ``trimkit.wrap()`` of the same engine with the same calibration starts from what the
first learned; a different calibration (another profile key or creation time) starts afresh.

**The margin** is read off the speed estimate's spread (:meth:`SpeedEstimate.margin`): the share
of a budget that would have absorbed the ``target`` quantile of recent measured ÷ predicted
prefills, each taken relative to the current speed factor. A request whose prefill is watched
(in process, :mod:`trimkit.planning.watch`) re-plans at its measured pace, so its margin covers
only what comes after the last step (``watched_share``); one sent to a server is open loop and
holds the margin for its whole prediction. A prompt longer than the profile has measured
(:meth:`Profile.extrapolation` = x > 1) is less certain: its spread is taken x times.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from trimkit.planning.costs import evaluated_tokens
from trimkit.planning.drift import LiveProfile
from trimkit.planning.queue import EngineQueue
from trimkit.planning.speed import DEFAULT_TARGET, MARGIN_CAP, margin_for_ratio, usable_cores
from trimkit.profile import Profile

__all__ = ["DEFAULT_TARGET", "EngineState", "engine_state", "forget_engines", "PROVISIONAL_PERSIST_EVERY"]

log = logging.getLogger("trimkit")

#: the cost model is refitted after each of the first EAGER_REFITS measured requests (a shape the
#: calibration got wrong is corrected at once), then after every REFIT_EVERY-th: a refit costs
#: more than the rest of a short request's bookkeeping, and the speed estimate moves every request
EAGER_REFITS = 16
REFIT_EVERY = 4

#: while the profile is provisional, the refined profile is stored at least every this many
#: measured requests (so a short first session is not lost)
PROVISIONAL_PERSIST_EVERY = 4


def _usable(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


class EngineState:
    """What one engine has learned: the live profile (its cost model, speed factor, decode and
    first-token overhead) and the requests in flight on it (``queue``). Shared by every wrapper of
    that engine. ``queue``: an existing one to keep (the requests in flight do not change when the
    engine is calibrated again); else a new one on ``clock``."""

    def __init__(self, profile: Profile, *, queue: EngineQueue | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.live = LiveProfile(profile, refit_every=REFIT_EVERY, eager_refits=EAGER_REFITS)
        #: the requests in flight on this engine, for the wait each new one is predicted to have
        self.queue = queue if queue is not None else EngineQueue(clock)
        #: which calibration this state grew from
        self.calibration = _calibration_tag(profile)

    @property
    def speed(self) -> Any:
        """The engine's one :class:`~trimkit.planning.speed.SpeedEstimate`."""
        return self.live.speed

    def safety_margin(self, target: float = DEFAULT_TARGET, *, extrapolation: float = 1.0, share: float = 1.0) -> float:
        """The fraction of a budget to hold back for ``target`` (default 0.97) of requests inside
        it (see the module docstring): ``share`` of the prediction uncertain (1: open loop),
        ``extrapolation`` ≥ 1 how far beyond the probed range the prompt reaches."""
        profile = self.live.current
        base = self.speed.margin(profile.model, target, fallback=profile.safety_margin, share=share)
        x = extrapolation if math.isfinite(extrapolation) and extrapolation > 1.0 else 1.0
        if x <= 1.0:
            return base
        return margin_for_ratio(1.0 + x * (1.0 / (1.0 - base) - 1.0), cap=MARGIN_CAP)

    def request_margin(self, target: float, budget_s: float, prompt_tokens: int, cached_tokens: int, *, watched_share: float = 1.0) -> float:
        """One request's margin: :meth:`safety_margin` for the longest prompt its plan may send
        (all ``prompt_tokens``, or what ``budget_s`` allows) with ``watched_share`` of it after the
        watch's last step (1: not watched)."""
        profile = self.live.current
        allowed = profile.max_new_tokens(budget_s * (1.0 - self.safety_margin(target, share=watched_share)), cached_tokens)
        new = max(min(evaluated_tokens(prompt_tokens, cached_tokens), allowed), 1)
        return self.safety_margin(target, extrapolation=profile.extrapolation(new, cached_tokens), share=watched_share)

    def slowdown_warnings(self) -> list[str]:
        """The slowdown notice while the engine runs ≥ 2× slower than calibrated (none otherwise)."""
        return self.speed.slowdown_warnings(self.live.speed_factor(), lambda: _threads_hint(self.live.current))

    def learn(self, m: Any, *, persist_every: int = 0, answer_capped: bool = True, watched: bool = False) -> Profile | None:
        """What one finished request (its :class:`~trimkit.backends.base.Measurement` ``m``)
        teaches the engine: its prefill to the live profile (the speed estimate — unless
        ``watched``: its steps joined it already — and the refit), its decode speed and
        first-token overhead. Every ``persist_every`` measured prefills (every
        :data:`PROVISIONAL_PERSIST_EVERY` at most while the profile is provisional; 0: never) it
        returns the refined profile for the caller to store, so the next process starts from it
        (planning writes nothing: the pipeline stores it); else None. To the in-flight queue:
        how fast its answer streamed, and (``answer_capped`` False: the call set no
        ``max_tokens``) how long it was."""
        measured = m.ttft_s if m.ttft_s is not None else m.first_output_s
        self.queue.observe_stream(m.completion_tokens, measured, m.total_s)
        if not answer_capped:
            self.queue.observe_answer(m.completion_tokens)
        self.live.observe_decode(m.decode_tokens_per_s, m.completion_tokens, m.prompt_tokens)
        self.live.observe_first_token(m.ttft_s, m.engine_prefill_s, m.prompt_tokens)
        if m.engine_prefill_s is None or not m.evaluated_tokens:
            return None
        self.live.observe(m.evaluated_tokens, m.cached_tokens or 0, m.engine_prefill_s, speed=not watched)
        seen = self.live.observations
        every = min(persist_every, PROVISIONAL_PERSIST_EVERY) if self.live.current.provisional else persist_every
        return self.live.current if every and seen and seen % every == 0 else None


def _threads_hint(profile: Profile) -> str:
    """For an in-process engine computing prefill on every core the process may use: why one
    other busy process stalls it, and the cure (measured: docs/design.md, "The host's speed")."""
    key = profile.key
    cores = usable_cores()
    if key.backend == "llama_cpp" and key.n_threads_batch and cores and key.n_threads_batch >= cores:
        return (f" — llama.cpp computes prefill on {key.n_threads_batch} threads and this process may use {cores} cores, so one "
                "other busy process stalls every step: fewer threads (n_threads_batch) than the cores left free keep their speed")
    return ""


def _calibration_tag(profile: Profile) -> tuple[Any, ...]:
    return (profile.key, profile.created_at)


_lock = threading.Lock()
_by_object: weakref.WeakKeyDictionary[Any, EngineState] = weakref.WeakKeyDictionary()
_by_value: dict[Hashable, EngineState] = {}
_MAX_BY_VALUE = 256


def _identity_of(backend: Any) -> Any:
    get = getattr(backend, "engine_identity", None)
    if get is None:
        return backend
    try:
        return get()
    except Exception:  # an identity that cannot be told: the backend object is its own engine
        return backend


def engine_state(backend: Any, profile: Profile) -> EngineState:
    """The live state of ``backend``'s engine: the existing one when it grew from the same
    calibration as ``profile``, else a new one started from ``profile`` (and remembered; it
    keeps the old one's in-flight queue, whose clock is the first backend's ``clock``).

    Engines named by an object (a ``Llama``, a backend) are held weakly: the state goes when
    the object does. Engines named by a value (``(url, model)``) are kept for the process
    (the 256 most recent)."""
    identity = _identity_of(backend)
    tag = _calibration_tag(profile)
    try:
        weakref.ref(identity)
        table: Any = _by_object
    except TypeError:
        table = _by_value
    with _lock:
        state = table.get(identity)
        if state is None or state.calibration != tag:
            old = state
            state = EngineState(profile, queue=old.queue if old is not None else None,
                                clock=getattr(backend, "clock", None) or time.perf_counter)
            if table is _by_value:
                _by_value.pop(identity, None)
                while len(_by_value) >= _MAX_BY_VALUE:
                    _by_value.pop(next(iter(_by_value)))
            table[identity] = state
        return state


def forget_engines() -> None:
    """Drop every engine's learned state (the next wrapper starts from its profile)."""
    with _lock:
        _by_object.clear()
        _by_value.clear()
