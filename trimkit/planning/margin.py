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

**The engine's state.** One ``Llama`` (or one server URL + model) runs at one speed: its drift
(:class:`~trimkit.planning.drift.LiveProfile`) and its margin window live in one :class:`EngineState`,
found by :func:`engine_state` from the backend's :meth:`~trimkit.backends.base.Backend.engine_identity`.
A second ``trimkit.wrap()`` of the same engine with the same calibration starts from what the
first learned; a different calibration (another profile key or creation time) starts afresh.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from trimkit.planning.drift import LiveProfile
from trimkit.profile import Profile

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
    and the margin window. Shared by every wrapper of that engine."""

    def __init__(self, profile: Profile, *, window: int = DEFAULT_WINDOW) -> None:
        self.live = LiveProfile(profile)
        self.margin = MarginWindow(window=window, seed=calibration_ratios(profile))
        #: which calibration this state grew from
        self.calibration = _calibration_tag(profile)

    def safety_margin(self, target: float | None = None) -> float:
        """The margin for ``target`` (default 0.97); the current profile's rule while too few ratios are known."""
        return self.margin.margin(self.live.current.safety_margin, target)

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
    calibration as ``profile``, else a new one started from ``profile`` (and remembered).

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
            state = EngineState(profile)
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
