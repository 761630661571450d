"""The safety margin learned from this host, and the live state one engine shares between wrappers.

**The margin.** Every measured request gives a ratio r = measured TTFT / predicted TTFT (the
prediction the planner used: drift-corrected prefill plus the first-token overhead). A
:class:`MarginWindow` keeps the last ``window`` (100) ratios of one engine, seeded with the
calibration's held-out residuals, and holds back the fraction of the budget that would have
kept a share ``target`` (0.97) of them inside it — split-conformal style: with the n ratios
sorted, r* is the ceil((n+1)·target)-th smallest, and the margin is ``1 − 1/r*`` (a prediction
at ``budget·(1 − margin)`` times r* is exactly the budget), clamped to 1–60 %. Under the
exchangeability assumption of conformal prediction, the next request's ratio is ≤ r* with
probability ≥ target. With fewer ratios than the rank needs (n < 33 at 0.97), the profile's
own rule (its p90 held-out error, 3–25 %) is used. A noisy host widens the margin, a steady
one narrows it, as the window turns over.

Only requests near their budget are kept (predicted ≥ half the budget, or the budget missed):
a request far under its budget meets it whatever the noise, and the relative jitter of tiny
prompts would otherwise widen the margin for nothing.

**Wider while the profile knows less.** Two cases get a wider margin than the one above, by one
rule derived from the profile's own error: with m₀ the profile's rule (its p90 held-out error,
3–25 %) as a ratio r₀ = 1/(1 − m₀), a prediction k times less certain gets the margin of the
ratio 1 + k·(r₀ − 1), clamped to the cap, or the margin above if that is wider.

- *Provisional* (a ~3 s micro-calibration, :attr:`Profile.provisional`): k = 2
  (:data:`PROVISIONAL_ERROR_FACTOR`) — its error was estimated from a handful of probes — until
  this engine has measured enough requests for the learned margin, which then stands on them.
- *Extrapolated* (the longest prompt the plan may send lies beyond the probed range,
  :meth:`Profile.extrapolation` = x > 1): k is multiplied by x — a cost model's error grows
  with the distance from what it measured. This holds whatever the learned margin says.

**What the margin learns is the TTFT the caller felt.** The prediction of a request that waited
for its engine includes the predicted wait (:mod:`trimkit.planning.queue`), and the measured
TTFT the ratio is taken of includes the measured wait (``Measurement.queue_s``): the margin
covers the error of both, and a request planned with others ahead holds back its share of the
whole budget. Without anyone ahead both are the engine's TTFT, as before.

**The engine's state.** One ``Llama`` (or one server URL + model) runs at one speed: its drift
(:class:`~trimkit.planning.drift.LiveProfile`), its margin window and its in-flight queue
(:class:`~trimkit.planning.queue.EngineQueue`) live in one :class:`EngineState`,
found by :func:`engine_state` from the backend's :meth:`~trimkit.backends.base.Backend.engine_identity`.
A second ``trimkit.wrap()`` of the same engine with the same calibration starts from what the
first learned; a different calibration (another profile key or creation time) starts afresh.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from trimkit.planning.costs import evaluated_tokens
from trimkit.planning.drift import LiveProfile
from trimkit.planning.queue import EngineQueue
from trimkit.planning.slowdown import SlowdownWatch
from trimkit.profile import Profile
from trimkit.profile_store import save_profile

__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_WINDOW",
    "MARGIN_FLOOR",
    "MARGIN_CAP",
    "RELEVANT_FRACTION",
    "conformal_rank",
    "conformal_quantile",
    "margin_for_ratio",
    "calibration_ratios",
    "MarginWindow",
    "PROVISIONAL_ERROR_FACTOR",
    "widened_margin",
    "EngineState",
    "engine_state",
    "forget_engines",
]

#: the share of requests whose measured TTFT should stay inside the budget
DEFAULT_TARGET = 0.97
#: ratios kept per engine: the smallest round window where the 0.97 rank (98 of 100) is not the
#: maximum, so two outliers do not set the margin; a noisy spell leaves it within 100 requests
DEFAULT_WINDOW = 100
#: the margin never drops below this (a host that is never slower than predicted)...
MARGIN_FLOOR = 0.01
#: ...nor rises above this (beyond it trimming would throw away most of the budget)
MARGIN_CAP = 0.60
#: a measured request counts for the margin when its prediction was at least this share of its budget
RELEVANT_FRACTION = 0.5


log = logging.getLogger("trimkit")

#: while the profile is provisional, the refined profile is stored at least every this many
#: measured requests (so a short first session is not lost)
PROVISIONAL_PERSIST_EVERY = 4
#: how many times less certain a provisional profile's predictions count than its own held-out
#: error says (that error rests on a handful of micro-probes)
PROVISIONAL_ERROR_FACTOR = 2.0


def _usable(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def conformal_rank(n: int, target: float) -> int:
    """The rank (1-based) of the split-conformal ``target`` quantile among ``n`` values: ceil((n+1)·target)."""
    # the small slack keeps float error from bumping an exact product (e.g. 100 × 0.97) up a rank
    return math.ceil((n + 1) * target - 1e-9)


def conformal_quantile(values: Iterable[float], target: float) -> float:
    """The ceil((n+1)·target)-th smallest of ``values``; ``inf`` when n is too small for that rank."""
    ordered = sorted(values)
    k = conformal_rank(len(ordered), target)
    if k > len(ordered) or not ordered:
        return math.inf
    return ordered[max(k, 1) - 1]


def margin_for_ratio(ratio: float, floor: float = MARGIN_FLOOR, cap: float = MARGIN_CAP) -> float:
    """The fraction of a budget to hold back so that a prediction ``ratio`` times too low still
    fits: ``1 − 1/ratio`` (0 when predictions are pessimistic), clamped to [floor, cap]."""
    raw = 1.0 - 1.0 / ratio if ratio > 1.0 else 0.0
    return min(max(raw, floor), cap)


def calibration_ratios(profile: Profile) -> list[float]:
    """Measured / predicted TTFT of the larger half of the calibration samples, with the
    first-token overhead added to both: held-out residuals (:attr:`Profile.residuals`) when the
    profile kept them, else its calibration samples against its own model (in-sample)."""
    ft = profile.first_token_s
    pairs: Sequence[tuple[float, float]] = profile.residuals
    if not pairs:
        pairs = [
            (profile.model.prefill_s(s.new_tokens, s.cached_tokens), s.seconds)
            for s in profile.samples
            if s.source == "calibration"
        ]
    usable = [
        (p, m) for p, m in pairs if _usable(p + ft) and _usable(m + ft) and p >= 0 and m >= 0
    ]
    # the larger half of the probes only: a small probe's time is mostly fixed overhead and its
    # jitter, which says nothing of a request large enough to need a budget (live requests far
    # under their budget are left out of the window for the same reason)
    if len(usable) >= 4:
        cut = sorted(p for p, _ in usable)[len(usable) // 2]
        usable = [(p, m) for p, m in usable if p >= cut]
    return [(m + ft) / (p + ft) for p, m in usable]


def widened_margin(base: float, profile: Profile, *, provisional: bool, extrapolation: float = 1.0, cap: float = MARGIN_CAP) -> float:
    """``base``, or the profile's own rule widened for a prediction ``k`` times less certain
    (k = :data:`PROVISIONAL_ERROR_FACTOR` when ``provisional``, times ``extrapolation`` ≥ 1),
    whichever is wider; at most ``cap`` (see the module docstring)."""
    k = (PROVISIONAL_ERROR_FACTOR if provisional else 1.0) * (extrapolation if math.isfinite(extrapolation) and extrapolation > 1.0 else 1.0)
    if k <= 1.0:
        return base
    r0 = 1.0 / (1.0 - profile.safety_margin)
    return max(base, margin_for_ratio(1.0 + k * (r0 - 1.0), floor=0.0, cap=cap))


class MarginWindow:
    """The last ``window`` ratios measured / predicted TTFT of one engine, and the margin they
    call for (see the module docstring). Thread-safe."""

    def __init__(
        self,
        *,
        target: float = DEFAULT_TARGET,
        window: int = DEFAULT_WINDOW,
        floor: float = MARGIN_FLOOR,
        cap: float = MARGIN_CAP,
        seed: Iterable[float] = (),
    ) -> None:
        _check_target(target)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if not (0.0 <= floor <= cap < 1.0):
            raise ValueError(f"need 0 <= floor <= cap < 1, got floor={floor!r}, cap={cap!r}")
        self.target = float(target)
        self.floor = float(floor)
        self.cap = float(cap)
        self._ratios: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        for r in seed:
            self.add(r)

    def add(self, ratio: float) -> bool:
        """Keep one ratio (ignored unless a finite number > 0). Returns whether it was kept."""
        if not _usable(ratio):
            return False
        with self._lock:
            self._ratios.append(float(ratio))
        return True

    def observe(self, predicted_ttft_s: float | None, measured_ttft_s: float | None) -> bool:
        """Keep measured / predicted (ignored unless both are finite numbers > 0)."""
        if not (_usable(predicted_ttft_s) and _usable(measured_ttft_s)):
            return False
        assert predicted_ttft_s is not None and measured_ttft_s is not None
        return self.add(measured_ttft_s / predicted_ttft_s)

    @property
    def ratios(self) -> tuple[float, ...]:
        """The kept ratios, oldest first."""
        with self._lock:
            return tuple(self._ratios)

    def __len__(self) -> int:
        return len(self._ratios)

    def quantile_ratio(self, target: float | None = None) -> float | None:
        """The conformal ``target`` quantile of the ratios; None while there are too few for its rank."""
        q = conformal_quantile(self.ratios, self.target if target is None else _check_target(target))
        return q if math.isfinite(q) else None

    def margin(self, fallback: float, target: float | None = None) -> float:
        """The fraction of a budget to hold back; ``fallback`` while there are too few ratios."""
        ratio = self.quantile_ratio(target)
        if ratio is None:
            return float(fallback)
        return margin_for_ratio(ratio, self.floor, self.cap)


def _check_target(target: float) -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 < target < 1.0:
        raise ValueError(f"the attainment target must be a number strictly between 0 and 1, got {target!r}")
    return float(target)


class EngineState:
    """What one engine has learned about its current speed: the live profile (drift, refits)
    and the margin window; and the requests in flight on it (``queue``). Shared by every wrapper
    of that engine. ``queue``: an existing one to keep (the requests in flight do not change
    when the engine is calibrated again); else a new one on ``clock``."""

    def __init__(self, profile: Profile, *, window: int = DEFAULT_WINDOW, queue: EngineQueue | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.live = LiveProfile(profile)
        self.margin = MarginWindow(window=window, seed=calibration_ratios(profile))
        #: the requests in flight on this engine, for the wait each new one is predicted to have
        self.queue = queue if queue is not None else EngineQueue(clock)
        #: which calibration this state grew from
        self.calibration = _calibration_tag(profile)
        #: the engine's idle prober (:mod:`trimkit.idle_probes`), once a wrapper asked for one
        self.prober: Any = None
        #: the notice when the engine runs far slower than calibrated (:mod:`trimkit.planning.slowdown`)
        self.slowdown = SlowdownWatch(self.live)

    def safety_margin(self, target: float | None = None, *, extrapolation: float = 1.0) -> float:
        """The margin for ``target`` (default 0.97): learned from measured requests, the current
        profile's rule while too few ratios are known; wider for a provisional profile (until
        the learned margin takes over) and for ``extrapolation`` > 1 (see the module docstring)."""
        profile = self.live.current
        learned = self.margin.quantile_ratio(target) is not None
        base = self.margin.margin(profile.safety_margin, target)
        return widened_margin(base, profile, provisional=profile.provisional and not learned, extrapolation=extrapolation,
                              cap=self.margin.cap)

    def request_margin(self, target: float, budget_s: float, prompt_tokens: int, cached_tokens: int) -> float:
        """One request's margin: :meth:`safety_margin`, wider when the longest prompt its plan may
        send (all ``prompt_tokens``, or what ``budget_s`` allows) lies beyond the probed range."""
        profile = self.live.current
        allowed = profile.max_new_tokens(budget_s * (1.0 - self.safety_margin(target)), cached_tokens)
        new = max(min(evaluated_tokens(prompt_tokens, cached_tokens), allowed), 1)
        return self.safety_margin(target, extrapolation=profile.extrapolation(new, cached_tokens))

    def learn(self, m: Any, predicted_ttft_s: float | None, budget_s: float | None, *, persist_every: int = 0,
              answer_capped: bool = True) -> None:
        """What one finished request (its :class:`~trimkit.backends.base.Measurement` ``m``)
        teaches the engine: measured / predicted TTFT to the margin window (both as the caller
        felt them: ``predicted_ttft_s`` includes the predicted wait for the engine, and the
        measured TTFT adds ``m.queue_s``, the measured wait); the engine's own
        prefill timing to the live profile (drift, refits), its decode speed and first-token overhead. Every ``persist_every`` measured
        prefills (every :data:`PROVISIONAL_PERSIST_EVERY` at most while the profile is
        provisional; 0: never) the refined profile is stored, so the next process starts from it.
        To the in-flight queue: how fast its answer streamed, and (``answer_capped`` False: the
        call set no ``max_tokens``) how long it was."""
        measured = m.ttft_s if m.ttft_s is not None else m.first_output_s
        self.queue.observe_stream(m.completion_tokens, measured, m.total_s)
        if not answer_capped:
            self.queue.observe_answer(m.completion_tokens)
        if measured is not None:
            measured += getattr(m, "queue_s", 0.0) or 0.0
        self.observe_ttft(predicted_ttft_s, measured, budget_s)
        self.live.observe_decode(m.decode_tokens_per_s, m.completion_tokens, m.prompt_tokens)
        self.live.observe_first_token(m.ttft_s, m.engine_prefill_s, m.prompt_tokens)
        if m.engine_prefill_s is None or not m.evaluated_tokens:
            return
        self.live.observe(m.evaluated_tokens, m.cached_tokens or 0, m.engine_prefill_s)
        seen = self.live.observations
        every = min(persist_every, PROVISIONAL_PERSIST_EVERY) if self.live.current.provisional else persist_every
        if every and seen and seen % every == 0:
            try:
                save_profile(self.live.current)
            except OSError as exc:  # a read-only cache must not break requests
                log.warning("trimkit: could not store the refined profile: %s", exc)

    def close(self, *, wait: bool = True) -> None:
        """Stop this engine's idle prober, if it has one (``wait``: until its thread has ended)."""
        prober = self.prober
        if prober is not None:
            prober.stop(wait=wait)

    def observe_ttft(self, predicted_ttft_s: float | None, measured_ttft_s: float | None, budget_s: float | None) -> bool:
        """Feed one request's predicted and measured TTFT. Kept only with a budget, and only when
        the prediction was at least :data:`RELEVANT_FRACTION` of it or the budget was missed."""
        if budget_s is None or not (_usable(predicted_ttft_s) and _usable(measured_ttft_s)):
            return False
        assert predicted_ttft_s is not None and measured_ttft_s is not None
        if predicted_ttft_s < RELEVANT_FRACTION * budget_s and measured_ttft_s <= budget_s:
            return False
        return self.margin.observe(predicted_ttft_s, measured_ttft_s)


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
            if old is not None:
                old.close(wait=False)  # one prober per engine: the new calibration's
            state = EngineState(profile, queue=old.queue if old is not None else None,
                                clock=getattr(backend, "clock", None) or time.perf_counter)
            if table is _by_value:
                _by_value.pop(identity, None)
                while len(_by_value) >= _MAX_BY_VALUE:
                    _by_value.pop(next(iter(_by_value)))
            table[identity] = state
        return state


def forget_engines() -> None:
    """Drop every engine's learned state (the next wrapper starts from its profile) and stop
    their idle probers."""
    with _lock:
        states = [*_by_object.values(), *_by_value.values()]
        _by_object.clear()
        _by_value.clear()
    for state in states:
        state.close()
