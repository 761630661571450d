"""One estimate of the host's speed per engine: measured ÷ predicted over a recent window.

A host's speed moves between requests (another process, thermal throttling, a power-saving
mode), so every prediction is the cost model's times a **speed factor**. There is one source of
it: :class:`SpeedEstimate` keeps the last :data:`WINDOW` measured prefills of one engine —
calibration's probes to start with, then every served request (open loop: a server) and every
watched prefill (closed loop, :mod:`trimkit.planning.watch`) — as samples, and reads
them against the current cost model:

- its **middle** (the median of measured ÷ predicted over the latest :data:`FACTOR_WINDOW` live
  measurements, a stored profile's factor standing in for those not seen yet) is the speed factor
  the profile predicts with (:attr:`Profile.drift`);
- the **spread** around that middle sets the safety margin: the ``target`` quantile (default
  0.97) of ratio ÷ factor over the whole window, as the fraction of a budget that would have
  absorbed it (after a slowdown the older, faster ratios fall below the new middle and widen
  nothing; after a speed-up the older, slower ones widen it until they leave the window). In process,
  where the watched prefill re-plans with the measured pace, the margin only has to cover the
  stretch after the last step (:meth:`margin` with ``share`` < 1); over a server it covers the
  whole prediction;
- a factor of at least :data:`SLOWDOWN_FACTOR` is the slowdown notice every report carries
  (:meth:`slowdown_warnings`), logged once per slow spell.

The samples are kept (not their ratios), so a refit of the model's shape re-reads them all.
Thread-safe.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from trimkit.planning.costs import CostModel, PrefillSample

__all__ = [
    "SpeedEstimate",
    "WINDOW",
    "FACTOR_WINDOW",
    "DEFAULT_TARGET",
    "MARGIN_FLOOR",
    "MARGIN_CAP",
    "SLOWDOWN_FACTOR",
    "margin_for_ratio",
    "quantile",
    "usable_cores",
]

log = logging.getLogger("trimkit")

#: measured prefills kept per engine (one a request): the spread the margin reads
WINDOW = 24
#: the speed factor is the middle of this many latest: a step of the host's speed is followed
#: after 3 requests, one request's hiccup moves nothing
FACTOR_WINDOW = 5
#: the share of budgeted requests whose TTFT should stay inside the budget
DEFAULT_TARGET = 0.97
#: the margin never drops below this, nor rises above the cap (beyond it trimming would throw
#: away most of the budget)
MARGIN_FLOOR = 0.01
MARGIN_CAP = 0.60
#: the engine counts as slowed down when it runs at least this many times slower than calibrated:
#: twice the time is beyond any measured host's noise (docs/design.md, "The host's speed")
SLOWDOWN_FACTOR = 2.0
#: one wild measurement moves nothing further than this factor either way
RATIO_CLIP = 5.0


def margin_for_ratio(ratio: float, floor: float = MARGIN_FLOOR, cap: float = MARGIN_CAP) -> float:
    """The fraction of a budget to hold back so that a prediction ``ratio`` times too low still
    fits: ``1 − 1/ratio`` (0 when predictions are pessimistic), clamped to [floor, cap]."""
    raw = 1.0 - 1.0 / ratio if ratio > 1.0 else 0.0
    return min(max(raw, floor), cap)


def quantile(values: Iterable[float], target: float) -> float:
    """The ceil((n+1)·target)-th smallest of ``values`` (split-conformal rank), the largest
    when n is too small for that rank; nan when there are none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = math.ceil((len(ordered) + 1) * target - 1e-9)
    return ordered[min(max(k, 1), len(ordered)) - 1]


def usable_cores() -> int | None:
    """The CPU cores this process may run on (its affinity where the OS tells it), or None."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _ratio(model: CostModel, s: PrefillSample) -> float | None:
    try:
        predicted = model.prefill_s(s.new_tokens, s.cached_tokens)
    except (ValueError, ArithmeticError):
        return None
    if not (math.isfinite(predicted) and predicted > 0 and s.seconds > 0 and math.isfinite(s.seconds)):
        return None
    return min(max(s.seconds / predicted, 1.0 / RATIO_CLIP), RATIO_CLIP)


class SpeedEstimate:
    """The host's current speed for one engine, from its recent measured prefills (see the
    module docstring). ``seed``: calibration's samples (the held-out ones, or all), which stand
    in until served requests arrive."""

    def __init__(self, seed: Iterable[PrefillSample] = (), *, window: int = WINDOW, prior: float = 1.0) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if not (isinstance(prior, (int, float)) and not isinstance(prior, bool) and math.isfinite(prior) and prior > 0):
            raise ValueError(f"prior must be a finite number > 0, got {prior!r}")
        self._samples: deque[PrefillSample] = deque(maxlen=window)
        self._live = 0
        #: the speed factor that stands in for live ratios not yet seen (a stored profile's)
        self.prior = float(prior)
        self._lock = threading.Lock()
        self._logged = False
        for s in seed:
            self._samples.append(s)

    def observe(self, sample: PrefillSample) -> None:
        """One measured prefill (a served request or one step of a watched prefill)."""
        with self._lock:
            self._samples.append(sample)
            self._live += 1

    @property
    def samples(self) -> Sequence[PrefillSample]:
        with self._lock:
            return tuple(self._samples)

    @property
    def observations(self) -> int:
        """How many live measurements (not calibration's) joined the window."""
        return self._live

    def ratios(self, model: CostModel) -> list[float]:
        """measured ÷ ``model``'s prediction for each sample in the window, oldest first."""
        return [r for r in (_ratio(model, s) for s in self.samples) if r is not None]

    def factor(self, model: CostModel) -> float:
        """The speed factor: the median of the latest :data:`FACTOR_WINDOW` live ratios, the
        :attr:`prior` standing in for those not yet seen (calibration's samples shape the spread,
        not the speed: the calibrated model already prices them)."""
        with self._lock:
            live = list(self._samples)[len(self._samples) - min(self._live, len(self._samples)):]
        ratios = [r for r in (_ratio(model, s) for s in live[-FACTOR_WINDOW:]) if r is not None]
        ratios += [self.prior] * (FACTOR_WINDOW - len(ratios))
        return statistics.median(ratios)

    def margin(self, model: CostModel, target: float = DEFAULT_TARGET, *, fallback: float, share: float = 1.0) -> float:
        """The fraction of a budget to hold back so that ``target`` of the recent measurements,
        each taken relative to the factor, would have fitted — for a prediction of which only
        ``share`` is uncertain (the stretch of a watched prefill after its last step; 1: the
        whole prediction, as over a server). ``fallback`` while fewer than 4 samples are known."""
        ratios = self.ratios(model)
        if len(ratios) < 4:
            spread_ratio = 1.0 / (1.0 - fallback)
        else:
            middle = self.factor(model)
            spread_ratio = quantile((r / middle for r in ratios), target)
        share = min(max(share, 0.0), 1.0)
        return margin_for_ratio(1.0 + share * (spread_ratio - 1.0), floor=MARGIN_FLOOR * share if share < 1 else MARGIN_FLOOR)

    def slowdown_warnings(self, factor: float, hint: Callable[[], str]) -> list[str]:
        """The notice (a one-item list) while ``factor`` (this engine's current one, relative to
        its calibration) is at least :data:`SLOWDOWN_FACTOR`, else none; logged once per spell.
        ``hint()``: what to add about the engine's threads."""
        with self._lock:
            if factor < SLOWDOWN_FACTOR:
                self._logged = False
                return []
            first, self._logged = not self._logged, True
        text = (f"the engine runs {factor:.1f}× slower than when it was calibrated (its recent prefills): in process the watched "
                "prefill re-plans each request at its measured pace; another busy process, thermal throttling or a power-saving "
                "mode slows a host this much") + hint()
        if first:
            log.warning("trimkit: %s", text)
        return [text]
