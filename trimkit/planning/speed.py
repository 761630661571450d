"""What one engine learns as it runs (docs/design.md §2 "The host's speed", §6 "The safety margin").

:class:`SpeedEstimate`: measured ÷ predicted over recent prefills; its middle is the speed factor, its spread the margin.
:class:`LiveProfile`: calibration's cost model (refitted when served requests show a shape it got wrong), the speed
factor, the decode line and the first-token overhead. :class:`EngineState`: one engine's live profile
(:func:`engine_state`), the margin a request plans with and the slowdown notice.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import statistics
import threading
import weakref
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from trimkit.errors import count, positive_finite
from trimkit.planning.costs import CostModel, PrefillSample, error_stats, evaluated_tokens, fit_cost_model
from trimkit.planning.profile import DecodePoint, Profile, mean_context

log = logging.getLogger("trimkit")
#: measured prefills kept per engine (one a request): the spread the margin reads
WINDOW = 24
#: the speed factor is the middle of this many latest: a step of the host's speed is followed after 3 requests
FACTOR_WINDOW = 5
#: the share of budgeted requests whose TTFT should stay inside the budget
DEFAULT_TARGET = 0.97
#: the margin's floor and cap (beyond it trimming would throw away most of the budget)
MARGIN_FLOOR = 0.01
MARGIN_CAP = 0.60
#: slowed down: at least this many times slower than calibrated (beyond any measured host's noise)
SLOWDOWN_FACTOR = 2.0
#: one wild measurement moves nothing further than this factor either way
RATIO_CLIP = 5.0
#: watched requests' measured ÷ predicted TTFT kept per engine: at least 33, the fewest whose split-conformal rank for
#: the target 0.97 is not simply the largest seen
OUTCOME_WINDOW = 40
#: the outcomes a margin reads once this many are known (before, the prefill spread alone)
MIN_OUTCOMES = 4


def margin_for_ratio(ratio: float, floor: float = MARGIN_FLOOR, cap: float = MARGIN_CAP) -> float:
    """``1 − 1/ratio`` (0 when predictions are pessimistic), clamped to [floor, cap]."""
    raw = 1.0 - 1.0 / ratio if ratio > 1.0 else 0.0
    return min(max(raw, floor), cap)


def quantile(values: Iterable[float], target: float) -> float:
    """The ceil((n+1)·target)-th smallest of ``values`` (split-conformal rank; the largest for a small n); nan for none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = math.ceil((len(ordered) + 1) * target - 1e-9)
    return ordered[min(max(k, 1), len(ordered)) - 1]


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    """A finite real number > 0 (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and float(value) > 0


def usable_cores() -> int | None:
    """The CPU cores this process may run on (its affinity where the OS tells it), or None."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _clip(ratio: float) -> float:
    return min(max(ratio, 1.0 / RATIO_CLIP), RATIO_CLIP)


def _predicted(model: CostModel, s: PrefillSample) -> float | None:
    """``model``'s prefill seconds for ``s``; None where it cannot price it (a stored sample no model can price)."""
    try:
        predicted = model.prefill_s(s.new_tokens, s.cached_tokens)
    except (ValueError, ArithmeticError):
        return None
    return predicted if _positive(predicted) else None


def _ratio(model: CostModel, s: PrefillSample) -> float | None:
    predicted = _predicted(model, s)
    return _clip(s.seconds / predicted) if predicted and _positive(s.seconds) else None


class SpeedEstimate:
    """The host's current speed for one engine, from its recent measured prefills; ``seed`` (calibration's) stands in
    until served requests arrive. Thread-safe."""

    def __init__(self, seed: Iterable[PrefillSample] = (), *, prior: float = 1.0) -> None:
        self._samples: deque[PrefillSample] = deque(seed, maxlen=WINDOW)
        self._live = 0
        self._outcomes: deque[float] = deque(maxlen=OUTCOME_WINDOW)
        self.prior = positive_finite(prior, "prior")
        self._lock = threading.Lock()

    def observe(self, sample: PrefillSample) -> None:
        with self._lock:
            self._samples.append(sample)
            self._live += 1

    def observe_outcome(self, measured_s: float, predicted_s: float) -> None:
        """One watched request's TTFT as measured and as predicted for the prompt it sent: what the watch left to the margin."""
        if not (_positive(measured_s) and _positive(predicted_s)):
            return
        with self._lock:
            self._outcomes.append(_clip(measured_s / predicted_s))

    @property
    def outcomes(self) -> Sequence[float]:
        with self._lock:
            return tuple(self._outcomes)

    @property
    def samples(self) -> Sequence[PrefillSample]:
        with self._lock:
            return tuple(self._samples)

    @property
    def observations(self) -> int:
        return self._live

    def ratios(self, model: CostModel) -> list[float]:
        return [r for r in (_ratio(model, s) for s in self.samples) if r is not None]

    def factor(self, model: CostModel) -> float:
        """The median of the latest :data:`FACTOR_WINDOW` live ratios, :attr:`prior` standing in for those not yet seen."""
        with self._lock:
            live = list(self._samples)[len(self._samples) - min(self._live, len(self._samples)):]
        ratios = [r for r in (_ratio(model, s) for s in live[-FACTOR_WINDOW:]) if r is not None]
        ratios += [self.prior] * (FACTOR_WINDOW - len(ratios))
        return statistics.median(ratios)

    def margin(self, model: CostModel, target: float = DEFAULT_TARGET, *, fallback: float, share: float = 1.0) -> float:
        """The share of a budget to hold back so that ``target`` of the recent measurements would have fitted, for a
        prediction of which only ``share`` is uncertain (1: all of it). A watched one holds back at least what the
        latest outcomes needed: the prefill spread misses what the watch costs and how far the factor lags."""
        ratios = self.ratios(model)
        if len(ratios) < 4:
            spread_ratio = 1.0 / (1.0 - fallback)
        else:
            middle = self.factor(model)
            spread_ratio = quantile((r / middle for r in ratios), target)
        share = min(max(share, 0.0), 1.0)
        margin = margin_for_ratio(1.0 + share * (spread_ratio - 1.0), floor=MARGIN_FLOOR * share)
        outcomes = self.outcomes
        if share < 1 and len(outcomes) >= MIN_OUTCOMES:
            margin = max(margin, margin_for_ratio(quantile(outcomes, target)))
        return margin


#: a measured decode speed counts only over at least this many generated tokens (fewer is mostly noise)
MIN_DECODE_TOKENS = 4
#: how many served requests' decode points the profile keeps (the latest), besides calibration's
KEEP_DECODE_POINTS = 32
#: served requests' (prompt tokens, first-token overhead) pairs kept, and needed, to learn the per-token overhead
KEEP_FIRST_TOKEN_POINTS = 16
MIN_FIRST_TOKEN_POINTS = 4
#: ...spanning prompt lengths this many times apart (closer, a slope is mostly jitter)
FIRST_TOKEN_LENGTH_SPREAD = 2.0
#: the fixed part of the first-token overhead: the median over this many recent requests
FIRST_TOKEN_RECENT = 5
#: a refit must beat the speed factor alone by more than this (median absolute % error): ties are no change of shape
REFIT_TIE_PCT = 1e-6


def _median_ratio(model: CostModel, samples: Sequence[PrefillSample]) -> float:
    """The geometric middle of ``samples``' measured ÷ predicted (1 for none)."""
    logs = [math.log(r) for r in (_ratio(model, s) for s in samples) if r is not None]
    return math.exp(statistics.median(logs)) if logs else 1.0


def calibration_seed(profile: Profile) -> list[PrefillSample]:
    """The larger half of the calibration's samples (a small probe's time is mostly overhead and jitter), at its drift."""
    priced = [(p, s) for s in profile.samples if s.source == "calibration" and s.seconds > 0 and (p := _predicted(profile.model, s))]
    calib = [s for _, s in priced]
    if len(priced) >= 4:
        cut = sorted(p for p, _ in priced)[len(priced) // 2]
        calib = [s for p, s in priced if p >= cut]
    if profile.drift != 1.0:
        calib = [attrs.evolve(s, seconds=s.seconds * profile.drift) for s in calib]
    return calib


class LiveProfile:
    """A profile that follows the machine: every measured prefill joins :attr:`speed`; after every ``refit_every``
    requests (and each of the first ``eager_refits``) the model is refitted, kept only if it beats the speed factor."""

    def __init__(self, profile: Profile, *, refit_every: int = 1, eager_refits: int = 0, keep_live: int = 64) -> None:
        self._eager_refits = count(eager_refits, "eager_refits")
        self._calibration = profile
        self._calib_fit: CostModel | None = None
        self._refit_every = count(refit_every, "refit_every", minimum=1)
        self._live: deque[PrefillSample] = deque(maxlen=keep_live)
        self._seen = 0
        self.speed = SpeedEstimate(calibration_seed(profile), prior=profile.drift)
        self._first_token: deque[tuple[int | None, float]] = deque(maxlen=KEEP_FIRST_TOKEN_POINTS)
        self._lock = threading.Lock()
        self._profile = profile

    @property
    def current(self) -> Profile:
        return self._profile

    def speed_factor(self, new_tokens: int | None = None, cached_tokens: int = 0) -> float:
        """How many times slower than calibrated the host runs now for ``new_tokens`` (default: one batch)."""
        profile = self._profile
        n = max(int(new_tokens if new_tokens is not None else (profile.model.n_batch or 512)), 1)
        now = profile.model.prefill_s(n, cached_tokens) * profile.drift
        then = self._calibration.model.prefill_s(n, cached_tokens) * self._calibration.drift
        return now / then if now > 0 and then > 0 else 1.0

    def observe_step(self, new_tokens: int, cached_tokens: int, measured_s: float) -> None:
        """A watched prefill's steps so far, as one prefill: they join the speed estimate (the refit comes later)."""
        sample = self._sample(new_tokens, cached_tokens, measured_s)
        if sample is None:
            return
        with self._lock:
            self.speed.observe(sample)
            self._profile = attrs.evolve(self._profile, drift=self.speed.factor(self._profile.model))

    def observe(self, new_tokens: int, cached_tokens: int, measured_prefill_s: float, *, speed: bool = True) -> None:
        """One request's measured prefill (``speed=False``: its steps were fed already); unusable numbers are ignored."""
        sample = self._sample(new_tokens, cached_tokens, measured_prefill_s)
        if sample is None:
            return
        with self._lock:
            if speed:
                self.speed.observe(sample)
            self._live.append(sample)
            self._seen += 1
            self._update(refit=self._seen <= self._eager_refits or self._seen % self._refit_every == 0)

    @staticmethod
    def _sample(new_tokens: Any, cached_tokens: Any, seconds: Any) -> PrefillSample | None:
        if not (_is_count(new_tokens) and new_tokens >= 1 and _is_count(cached_tokens) and cached_tokens >= 0 and _positive(seconds)):
            return None
        return PrefillSample(int(new_tokens), int(cached_tokens), float(seconds), source="live")

    def observe_decode(self, tokens_per_s: Any, completion_tokens: Any, context_tokens: Any = None) -> None:
        """One request's measured decode speed at its mean context; ``context_tokens``: its prompt length."""
        if not (_is_count(completion_tokens) and completion_tokens >= MIN_DECODE_TOKENS and _positive(tokens_per_s)):
            return
        context = mean_context(int(context_tokens), int(completion_tokens)) if _is_count(context_tokens) and context_tokens >= 0 else 0
        point = DecodePoint(context, float(tokens_per_s), int(completion_tokens) - 1, source="live")
        with self._lock:
            points = self._profile.decode_points
            live = [p for p in points if p.source == "live"][1 - KEEP_DECODE_POINTS:]  # the latest, and this one
            profile = attrs.evolve(self._profile, decode_points=(*(p for p in points if p.source != "live"), *live, point))
            at = profile.decode_tokens_per_s_at(int(context), 0)
            self._profile = attrs.evolve(profile, decode_tokens_per_s=at if at is not None else float(tokens_per_s))

    def observe_first_token(self, ttft_s: Any, engine_prefill_s: Any, prompt_tokens: Any = None) -> None:
        """One request's first-token overhead: its TTFT less the engine's own prefill; ``prompt_tokens``: the whole prompt."""
        if not (_positive(ttft_s) and _positive(engine_prefill_s)):
            return
        prompt = int(prompt_tokens) if _is_count(prompt_tokens) and prompt_tokens >= 1 else None
        with self._lock:
            self._first_token.append((prompt, max(float(ttft_s) - float(engine_prefill_s), 0.0)))
            first, per = self._first_token_parts(self._profile)
            self._profile = attrs.evolve(self._profile, first_token_s=first, first_token_per_token_s=per)

    def _first_token_parts(self, profile: Profile) -> tuple[float, float]:
        """Under the lock: (fixed, per prompt token) overhead; per token: the Theil–Sen slope once lengths spread enough."""
        if not self._first_token:
            return profile.first_token_s, profile.first_token_per_token_s
        per = profile.first_token_per_token_s
        known = [(x, y) for x, y in self._first_token if x is not None]
        if len(known) >= MIN_FIRST_TOKEN_POINTS and max(x for x, _ in known) >= FIRST_TOKEN_LENGTH_SPREAD * min(x for x, _ in known):
            slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(known) for x2, y2 in known[i + 1:] if x2 != x1]
            per = max(statistics.median(slopes), 0.0)
        recent = list(self._first_token)[-FIRST_TOKEN_RECENT:]
        first = statistics.median(y - per * (x or 0) for x, y in recent)
        return max(first, 0.0), per

    def _update(self, *, refit: bool) -> None:
        profile = self._profile
        model = profile.model
        if refit and self._live:
            live = list(self._live)
            try:
                refit_model = self._refit(profile, live)
            except (ValueError, ArithmeticError, np.linalg.LinAlgError) as exc:
                # learning runs after a response was delivered and must never fail it
                log.debug("trimkit: live refit skipped: %s", exc)
            else:
                if refit_model is not None:
                    model = refit_model
                # the measured lengths are no longer an extrapolation
                new, context = profile.probed_range()
                profile = attrs.evolve(profile, probed_new_tokens=max([new, *(s.new_tokens for s in live)]),
                                       probed_context_tokens=max([context, *(s.new_tokens + s.cached_tokens for s in live)]))
        self._profile = attrs.evolve(profile, model=model, drift=self.speed.factor(model))

    def _refit(self, profile: Profile, live: list[PrefillSample]) -> CostModel | None:
        """The refit's model, or None when it does not beat ``profile``'s at its best single speed factor. The live samples
        are brought to the calibration's speed first: a fit mixing speeds would read a change of speed as one of shape."""
        model = profile.model
        calib = [s for s in profile.samples if s.source == "calibration"]
        kwargs: dict[str, Any] = {"n_batch": model.n_batch, "batched": model.per_batch_s > 0, "depth_prior_tokens": profile.depth_prior_tokens}
        speed_only = error_stats((model.prefill_s(s.new_tokens, s.cached_tokens) * _median_ratio(model, live), s.seconds) for s in live)
        if calib and self._calib_fit is None:
            self._calib_fit = fit_cost_model(calib, **kwargs)  # the calibration's own samples, fitted once
        speed = _median_ratio(self._calib_fit or self._calibration.model, live)
        candidate = fit_cost_model(calib + [attrs.evolve(s, seconds=s.seconds / speed) for s in live], **kwargs)
        refit = error_stats((candidate.prefill_s(s.new_tokens, s.cached_tokens) * speed, s.seconds) for s in live)
        return candidate if refit.median_pct < speed_only.median_pct - REFIT_TIE_PCT else None

    @property
    def observations(self) -> int:
        return self._seen

    @property
    def live_samples(self) -> Sequence[PrefillSample]:
        with self._lock:
            return tuple(self._live)


#: refit after each of the first EAGER_REFITS measured requests, then every REFIT_EVERY-th (a refit costs more than the
#: rest of a short request's bookkeeping)
EAGER_REFITS = 16
REFIT_EVERY = 4
#: a provisional profile is stored at least every this many measured requests (a short first session is not lost)
PROVISIONAL_PERSIST_EVERY = 4


class EngineState:
    """What one engine has learned: its live profile and speed estimate (its requests in flight are its lease's queue)."""

    def __init__(self, profile: Profile) -> None:
        self.live = LiveProfile(profile, refit_every=REFIT_EVERY, eager_refits=EAGER_REFITS)
        self.speed = self.live.speed
        self.calibration = (profile.key, profile.created_at)
        self._slowed = False  # the notice was logged in this spell of slowdown

    def safety_margin(self, target: float = DEFAULT_TARGET, *, extrapolation: float = 1.0, share: float = 1.0) -> float:
        """The share of a budget to hold back for ``target`` of requests inside it; ``share``: of the prediction uncertain,
        ``extrapolation``: how far beyond the probed range the prompt reaches (its spread counts that many times)."""
        profile = self.live.current
        base = self.speed.margin(profile.model, target, fallback=profile.safety_margin, share=share)
        if not (math.isfinite(extrapolation) and extrapolation > 1.0):
            return base
        return margin_for_ratio(1.0 + extrapolation * (1.0 / (1.0 - base) - 1.0))

    def request_margin(self, target: float, budget_s: float, prompt_tokens: int, cached_tokens: int, *, watched: bool = False) -> float:
        """:meth:`safety_margin` for the longest prompt the plan may send; ``watched``: only the tail after the last check."""
        profile = self.live.current
        n = evaluated_tokens(prompt_tokens, cached_tokens)
        first = self.safety_margin(target, share=tail_share(profile, n) if watched else 1.0)
        allowed = profile.max_new_tokens(budget_s * (1.0 - first), cached_tokens)
        new = max(min(n, allowed), 1)
        share = tail_share(profile, new) if watched else 1.0
        return self.safety_margin(target, extrapolation=profile.extrapolation(new, cached_tokens), share=share)

    def slowdown_warnings(self) -> list[str]:
        """The notice while the host runs at least :data:`SLOWDOWN_FACTOR` times slower than calibrated (logged once per
        spell), else none."""
        factor = self.live.speed_factor()
        with _lock:
            first, self._slowed = not self._slowed, factor >= SLOWDOWN_FACTOR
        if factor < SLOWDOWN_FACTOR:
            return []
        text = (f"the engine runs {factor:.1f}× slower than when it was calibrated (its recent prefills): in process the watched "
                "prefill re-plans each request at its measured pace; another busy process, thermal throttling or a power-saving "
                "mode slows a host this much") + _threads_hint(self.live.current)
        if first:
            log.warning("trimkit: %s", text)
        return [text]

    def learn(self, m: Any, *, persist_every: int = 0, watched: bool = False, outcome: tuple[float, float] | None = None) -> Profile | None:
        """What one finished request's Measurement ``m`` teaches the engine; returns the refined profile to store every
        ``persist_every`` measured prefills (more often while provisional), else None."""
        if outcome is not None:
            self.speed.observe_outcome(*outcome)
        self.live.observe_decode(m.decode_tokens_per_s, m.completion_tokens, m.prompt_tokens)
        self.live.observe_first_token(m.ttft_s, m.engine_prefill_s, m.prompt_tokens)
        if m.engine_prefill_s is None or not m.evaluated_tokens:
            return None
        self.live.observe(m.evaluated_tokens, m.cached_tokens or 0, m.engine_prefill_s, speed=not watched)
        seen = self.live.observations
        every = min(persist_every, PROVISIONAL_PERSIST_EVERY) if self.live.current.provisional else persist_every
        return self.live.current if every and seen and seen % every == 0 else None


def tail_share(profile: Profile, new_tokens: int) -> float:
    """The share of ``new_tokens``' prefill a watch cannot catch: what follows its last check (one batch)."""
    return min(1.0, max(int(profile.model.n_batch or 512), 1) / max(new_tokens, 1))


def _threads_hint(profile: Profile) -> str:
    """Why one other busy process stalls an engine computing prefill on every core, and the cure (docs/design.md §2)."""
    key = profile.key
    cores = usable_cores()
    if key.backend == "llama_cpp" and key.n_threads_batch and cores and key.n_threads_batch >= cores:
        return (f" — llama.cpp computes prefill on {key.n_threads_batch} threads and this process may use {cores} cores, so one "
                "other busy process stalls every step: fewer threads (n_threads_batch) than the cores left free keep their speed")
    return ""


_lock = threading.Lock()
_by_object: weakref.WeakKeyDictionary[Any, EngineState] = weakref.WeakKeyDictionary()
_by_value: dict[Hashable, EngineState] = {}
_MAX_BY_VALUE = 256


def engine_state(backend: Any, profile: Profile) -> EngineState:
    """The live state of ``backend``'s engine: the existing one if it grew from ``profile``'s calibration, else a new one.
    Engines named by an object are held weakly, by a value the 256 latest."""
    try:
        identity = backend.engine_identity()
    except Exception:  # no identity, or one that cannot be told: the backend object is its own engine
        identity = backend
    tag = (profile.key, profile.created_at)
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
