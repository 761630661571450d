"""The live profile: calibration's cost model, the host's current speed, and what serving taught.

Calibration measures the host once; its speed then changes (thermal throttling, other load, a
model moved to another device). :class:`LiveProfile` keeps one engine's current
:class:`~trimkit.profile.Profile`: its cost model (calibration's, refitted when served requests
show a shape the calibration got wrong), its speed factor (:attr:`Profile.drift`) from the one
:class:`~trimkit.planning.speed.SpeedEstimate`, which every measured prefill feeds — served
requests, and each step of a watched prefill (:mod:`trimkit.planning.watch`) —, its decode speed
(the decode-vs-context line of :mod:`trimkit.decode_model`, whose latest served points set its
level) and its first-token overhead. One engine's ``LiveProfile`` lives in its
:class:`~trimkit.planning.margin.EngineState`.
"""

from __future__ import annotations

import logging
import math
import numbers
import statistics
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from trimkit.decode_model import DecodePoint, mean_context
from trimkit.planning.costs import CostModel, PrefillSample, error_stats, fit_cost_model
from trimkit.planning.speed import SpeedEstimate
from trimkit.profile import Profile

__all__ = ["LiveProfile", "covering", "calibration_seed"]

log = logging.getLogger("trimkit")


#: a measured decode speed counts only over at least this many generated tokens (the first
#: token belongs to the prefill; a speed over one or two steps is mostly noise)
MIN_DECODE_TOKENS = 4
#: how many served requests' decode points the profile keeps (the latest), besides calibration's
KEEP_DECODE_POINTS = 32
#: how many served requests' (prompt tokens, first-token overhead) pairs the profile keeps to
#: learn how the overhead grows with the prompt (tokenizing it), and how many it needs first
KEEP_FIRST_TOKEN_POINTS = 16
MIN_FIRST_TOKEN_POINTS = 4
#: ...spanning prompt lengths at least this many times apart (a slope from lengths close
#: together is mostly the overhead's jitter)
FIRST_TOKEN_LENGTH_SPREAD = 2.0
#: the fixed part of the first-token overhead: the median over this many recent requests
FIRST_TOKEN_RECENT = 5
#: a refit must explain the live samples better than the speed factor alone by more than this
#: (median absolute % error): a candidate only as good is no change of shape (exact ties, rounding)
REFIT_TIE_PCT = 1e-6


def _median_log_ratio(model: CostModel, samples: Sequence[PrefillSample]) -> float:
    """The median of log(measured / ``model``) over ``samples`` (0 when none is predicted)."""
    logs = []
    for s in samples:
        predicted = model.prefill_s(s.new_tokens, s.cached_tokens)
        if predicted > 0 and s.seconds > 0:
            logs.append(math.log(min(max(s.seconds / predicted, 0.2), 5.0)))
    return statistics.median(logs) if logs else 0.0


def covering(profile: Profile, samples: Sequence[PrefillSample]) -> Profile:
    """``profile`` with its probed range grown to cover ``samples`` (measured lengths)."""
    new, context = profile.probed_range()
    new = max([new, *(s.new_tokens for s in samples)])
    context = max([context, *(s.new_tokens + s.cached_tokens for s in samples)])
    return attrs.evolve(profile, probed_new_tokens=new, probed_context_tokens=context)


def calibration_seed(profile: Profile) -> list[PrefillSample]:
    """What the speed estimate starts from: the larger half of the calibration's samples (a
    small probe's time is mostly fixed overhead and its jitter, which says nothing of a request
    large enough to need a budget), at the profile's stored speed factor."""
    priced = []
    for s in profile.samples:
        try:
            predicted = profile.model.prefill_s(s.new_tokens, s.cached_tokens)
        except (ValueError, ArithmeticError):  # a stored sample no model can price: left out
            continue
        if s.source == "calibration" and s.seconds > 0 and math.isfinite(predicted):
            priced.append((predicted, s))
    calib = [s for _, s in priced]
    if len(priced) >= 4:
        cut = sorted(p for p, _ in priced)[len(priced) // 2]
        calib = [s for p, s in priced if p >= cut]
    if profile.drift != 1.0:
        calib = [attrs.evolve(s, seconds=s.seconds * profile.drift) for s in calib]
    return calib


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class LiveProfile:
    """A profile that follows the machine (see the module docstring). Thread-safe.

    Every measured prefill joins the engine's :class:`~trimkit.planning.speed.SpeedEstimate`
    (:attr:`speed`); the profile's ``drift`` is its middle. After every ``refit_every``
    whole-request observations (default: each one; it costs 1–5 ms, after the response; and after
    each of the first ``eager_refits``, while the shape is still being learned) the model
    is refitted on calibration plus the served requests brought to the calibration's speed, and
    kept only if it explains them better than the speed factor alone: a shape the calibration got
    wrong (too little attention from short probes) is corrected, while a host that only changed
    speed moves the factor and leaves the model alone."""

    def __init__(self, profile: Profile, *, refit_every: int = 1, eager_refits: int = 0, keep_live: int = 64) -> None:
        if not (_is_count(refit_every) and refit_every >= 1):
            raise ValueError(f"refit_every must be an int >= 1, got {refit_every!r}")
        if not (_is_count(eager_refits) and eager_refits >= 0):
            raise ValueError(f"eager_refits must be an int >= 0, got {eager_refits!r}")
        self._eager_refits = eager_refits
        self._calibration = profile
        self._calib_fit: CostModel | None = None
        self._refit_every = refit_every
        self._live: deque[PrefillSample] = deque(maxlen=keep_live)
        self._seen = 0
        #: the one estimate of this engine's speed
        self.speed = SpeedEstimate(calibration_seed(profile), prior=profile.drift)
        #: the decode points of recent requests (decode speed vs context), starting from those a
        #: stored refined profile kept
        self._decode_points: deque[DecodePoint] = deque((p for p in profile.decode_points if p.source == "live"), maxlen=KEEP_DECODE_POINTS)
        self._first_token: deque[tuple[int | None, float]] = deque(maxlen=KEEP_FIRST_TOKEN_POINTS)
        self._lock = threading.Lock()
        self._profile = profile

    @property
    def current(self) -> Profile:
        return self._profile

    @property
    def calibration(self) -> Profile:
        """The calibration this live state started from."""
        return self._calibration

    def speed_factor(self, new_tokens: int | None = None, cached_tokens: int = 0) -> float:
        """How many times slower than calibrated the host runs now for ``new_tokens`` (default:
        one batch) after ``cached_tokens``: the prediction as served (the model after live
        refits, times the speed factor) over the calibration's own model."""
        profile = self._profile
        n = max(int(new_tokens if new_tokens is not None else (profile.model.n_batch or 512)), 1)
        now = profile.model.prefill_s(n, cached_tokens) * profile.drift
        then = self._calibration.model.prefill_s(n, cached_tokens) * self._calibration.drift
        return now / then if now > 0 and then > 0 else 1.0

    def observe_step(self, new_tokens: int, cached_tokens: int, measured_s: float) -> None:
        """A watched prefill, as one prefill of what it evaluated: it joins the speed estimate
        (its whole request joins the refit after the response, :meth:`observe`)."""
        sample = self._sample(new_tokens, cached_tokens, measured_s)
        if sample is None:
            return
        with self._lock:
            self.speed.observe(sample)
            self._profile = attrs.evolve(self._profile, drift=self.speed.factor(self._profile.model))

    def observe(self, new_tokens: int, cached_tokens: int, measured_prefill_s: float, *, speed: bool = True) -> None:
        """Feed one request's measured prefill back (``speed=False``: its steps were fed already).
        Unusable measurements (no tokens, a negative or missing count, a time that is zero,
        negative, NaN or infinite) are ignored: this runs after a response was delivered and must
        never fail it."""
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
        if not (_is_count(new_tokens) and new_tokens >= 1 and _is_count(cached_tokens) and cached_tokens >= 0):
            return None
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not (float(seconds) > 0 and math.isfinite(seconds)):
            return None
        return PrefillSample(int(new_tokens), int(cached_tokens), float(seconds), source="live")

    def observe_decode(self, tokens_per_s: Any, completion_tokens: Any, context_tokens: Any = None) -> None:
        """Feed one request's measured decode speed back; ``context_tokens`` is its prompt
        length (the KV cache its first decode step reads). The request becomes a point of the
        decode-vs-context line (:meth:`decode_tokens_per_s_at`) at its mean context
        (:func:`~trimkit.decode_model.mean_context`), and the profile's one decode speed
        (``decode_tokens_per_s``) is that line at the latest request's context. Answers of fewer
        than :data:`MIN_DECODE_TOKENS` tokens, and unusable numbers, are ignored."""
        if not (_is_count(completion_tokens) and completion_tokens >= MIN_DECODE_TOKENS):
            return
        if isinstance(tokens_per_s, bool) or not isinstance(tokens_per_s, numbers.Real):
            return
        if not (float(tokens_per_s) > 0 and math.isfinite(tokens_per_s)):
            return
        context = mean_context(int(context_tokens), int(completion_tokens)) if _is_count(context_tokens) and context_tokens >= 0 else 0
        with self._lock:
            self._decode_points.append(DecodePoint(context, float(tokens_per_s), int(completion_tokens) - 1, source="live"))
            profile = attrs.evolve(self._profile, decode_points=self._with_live_decode(self._profile))
            at = profile.decode_tokens_per_s_at(int(context), 0)
            self._profile = attrs.evolve(profile, decode_tokens_per_s=at if at is not None else float(tokens_per_s))

    def _with_live_decode(self, profile: Profile) -> tuple[DecodePoint, ...]:
        """``profile``'s calibration decode points followed by the served requests' (oldest first)."""
        return tuple(p for p in profile.decode_points if p.source != "live") + tuple(self._decode_points)

    def decode_tokens_per_s_at(self, context_tokens: int, output_tokens: int = 0) -> float | None:
        """Predicted decode speed at ``context_tokens`` prompt tokens (:meth:`~trimkit.profile.Profile.decode_tokens_per_s_at`
        of :attr:`current`); None when nothing measured decode."""
        return self.current.decode_tokens_per_s_at(context_tokens, output_tokens)

    def observe_first_token(self, ttft_s: Any, engine_prefill_s: Any, prompt_tokens: Any = None) -> None:
        """Feed one request's first-token overhead back: its TTFT less the engine's own prefill
        time (template, tokenization, the first sampling step, the HTTP round trip for a
        server); ``prompt_tokens`` is its whole prompt's length, cached tokens included. The
        profile learns both parts (:meth:`_first_token_parts`): how the overhead grows per
        prompt token, from the last :data:`KEEP_FIRST_TOKEN_POINTS` requests once they span
        lengths :data:`FIRST_TOKEN_LENGTH_SPREAD` times apart, and the fixed part, from the last
        :data:`FIRST_TOKEN_RECENT`. Unusable numbers are ignored."""
        values = (ttft_s, engine_prefill_s)
        if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) for v in values):
            return
        if not (ttft_s > 0 and engine_prefill_s > 0):
            return
        prompt = int(prompt_tokens) if _is_count(prompt_tokens) and prompt_tokens >= 1 else None
        with self._lock:
            self._first_token.append((prompt, max(float(ttft_s) - float(engine_prefill_s), 0.0)))
            first, per = self._first_token_parts(self._profile)
            self._profile = attrs.evolve(self._profile, first_token_s=first, first_token_per_token_s=per)

    def _first_token_parts(self, profile: Profile) -> tuple[float, float]:
        """Under the lock: (fixed, per prompt token) first-token overhead from the requests seen
        (``profile``'s own while none). Per token: the median slope between pairs of recent
        requests (Theil–Sen), at least 0, once enough requests of lengths far enough apart were
        seen; else ``profile``'s. Fixed: the median over the last :data:`FIRST_TOKEN_RECENT`
        requests of their overhead less the per-token part."""
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
        """Under the lock: (``refit``) a refit round on calibration plus live samples, then the
        speed factor against the model in force."""
        profile = self._profile
        model = profile.model
        if refit and self._live:
            live = list(self._live)
            try:
                refit_model = self._refit(profile, live)
            except (ValueError, ArithmeticError, np.linalg.LinAlgError) as exc:
                # a stored profile's samples no fit can use: the speed factor alone; learning runs
                # after a response was delivered and must never fail it
                log.debug("trimkit: live refit skipped: %s", exc)
            else:
                if refit_model is not None:
                    model = refit_model
                # the measured lengths are no longer an extrapolation: either they are in the
                # refit, or the model explains them at least as well as a refit on them would
                profile = covering(profile, live)
        self._profile = attrs.evolve(profile, model=model, drift=self.speed.factor(model))

    def _refit(self, profile: Profile, live: list[PrefillSample]) -> CostModel | None:
        """Under the lock: the refit round's model, or None when it does not explain the live
        samples better than ``profile``'s model at its best single speed factor (their median
        ratio: what the speed factor alone could reach).

        The live samples are first brought to the calibration's speed — divided by their median
        ratio to a fit of the calibration's samples alone — and fitted with the calibration's
        samples: a fit mixing samples measured at one speed with samples measured at another
        bends the model's shape, a change of speed read as a change of shape. The model kept is
        at the calibration's speed, so the speed estimate goes on reading the host against it."""
        model = profile.model
        calib = [s for s in profile.samples if s.source == "calibration"]
        kwargs: dict[str, Any] = {"n_batch": model.n_batch, "batched": model.per_batch_s > 0, "depth_prior_tokens": profile.depth_prior_tokens}
        speed_only = error_stats((model.prefill_s(s.new_tokens, s.cached_tokens) * math.exp(_median_log_ratio(model, live)), s.seconds)
                                 for s in live)
        speed = math.exp(_median_log_ratio(self._calibration_fit(calib, kwargs) if calib else self._calibration.model, live))
        candidate = fit_cost_model(calib + [attrs.evolve(s, seconds=s.seconds / speed) for s in live], **kwargs)
        refit = error_stats((candidate.prefill_s(s.new_tokens, s.cached_tokens) * speed, s.seconds) for s in live)
        if refit.median_pct < speed_only.median_pct - REFIT_TIE_PCT:
            return candidate
        return None

    def _calibration_fit(self, calib: list[PrefillSample], kwargs: dict[str, Any]) -> CostModel:
        """Under the lock: the cost model of the calibration's samples ``calib`` alone, fitted once."""
        if self._calib_fit is None:
            self._calib_fit = fit_cost_model(calib, **kwargs)
        return self._calib_fit

    @property
    def observations(self) -> int:
        """How many whole-request measurements were accepted."""
        return self._seen

    @property
    def live_samples(self) -> Sequence[PrefillSample]:
        with self._lock:
            return tuple(self._live)
