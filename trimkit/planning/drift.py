"""Drift: a profile that follows the machine as it runs.

Calibration measures the host once; its speed then changes (thermal throttling, other load, a
model moved to another device). :class:`LiveProfile` feeds every measured prefill back into the
profile's predictions: the ``drift`` factor follows the recent ratios measured / predicted (over
a window chosen by how well each candidate predicted the host so far), and every measured
request is a refit round of the model on calibration plus recent live samples, kept where it
explains them better than a change of speed alone. One engine's ``LiveProfile`` lives in its
:class:`~trimkit.planning.margin.EngineState`.

A *provisional* profile (a ~3 s micro-calibration, :attr:`Profile.provisional`) gains the most:
its refits and the live samples widen its probed range (:attr:`Profile.probed_new_tokens`,
:attr:`Profile.probed_context_tokens`), so the wider margin for extrapolation
(:mod:`trimkit.planning.margin`) stops applying to lengths
the engine has measured. Decode speed is learned the same way: each served request's stream is a
point of the decode-vs-context line (:mod:`trimkit.decode_model`) at its context, and the latest
ones set the line's level (:meth:`LiveProfile.decode_tokens_per_s_at`). Idle probes
(:mod:`trimkit.idle_probes`) swap a refined calibration in with
:meth:`LiveProfile.replace_calibration`.
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
from trimkit.profile import Profile

__all__ = ["LiveProfile", "covering"]

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
#: the drift windows :class:`LiveProfile` chooses among (requests whose median ratio is the
#: drift): from following a step in 2 requests to averaging over 17; and the one used while
#: they predict equally well
DRIFT_WINDOWS = (3, 5, 9, 17)
DEFAULT_DRIFT_WINDOW = 5
#: a refit must explain the live samples better than drift alone by more than this (median
#: absolute % error): a candidate only as good is no change of shape (exact ties, rounding)
REFIT_TIE_PCT = 1e-6
#: how many recent requests a drift window's score (its mean error predicting them) covers
WINDOW_SCORE_MEMORY = 16


def _log_ratio(measured_s: float, predicted_s: float) -> float | None:
    """log(measured / predicted), the ratio clipped to 0.2–5 (one wild measurement moves drift
    no further); None when nothing was predicted."""
    if predicted_s <= 0:
        return None
    return math.log(min(max(measured_s / predicted_s, 0.2), 5.0))


def _median_log_ratio(model: CostModel, samples: Sequence[PrefillSample]) -> float:
    """The median of log(measured / ``model``) over ``samples`` (0 when none is predicted)."""
    logs = [x for x in (_log_ratio(s.seconds, model.prefill_s(s.new_tokens, s.cached_tokens)) for s in samples) if x is not None]
    return statistics.median(logs) if logs else 0.0


def covering(profile: Profile, samples: Sequence[PrefillSample]) -> Profile:
    """``profile`` with its probed range grown to cover ``samples`` (measured lengths)."""
    new, context = profile.probed_range()
    new = max([new, *(s.new_tokens for s in samples)])
    context = max([context, *(s.new_tokens + s.cached_tokens for s in samples)])
    return attrs.evolve(profile, probed_new_tokens=new, probed_context_tokens=context)


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class LiveProfile:
    """A profile that follows the machine: live prefill measurements adjust its predictions.

    Each measured request contributes the ratio measured / predicted prefill (the model's
    prediction before drift, clipped to 0.2–5). The profile's ``drift`` factor is the median of
    the last few ratios; while fewer have been seen, the missing ones count as the starting
    drift. How many is chosen as the requests run (:data:`DRIFT_WINDOWS`): before each ratio
    joins, every candidate window's drift is scored on how well it would have predicted it, and
    the window with the smallest mean error over the last :data:`WINDOW_SCORE_MEMORY` requests is
    used (5 while they tie). A host whose speed holds for a while and then steps is followed by a
    short window — with 5, exactly after 3 requests (3 of the 5 agree) —; a host whose speed
    jumps back and forth from one request to the next is averaged over a long one, which chasing
    each jump would only make worse. A fixed ``drift_window`` turns the choice off.

    After every ``refit_every`` observations (default: each one; it costs 1–5 ms, after the
    response) the model is refitted (:meth:`_refit`: the live samples brought to the
    calibration's speed, fitted with the calibration's samples) and kept only if it explains
    the live samples better than the model at its best single speed factor (their median
    ratio: what drift alone could reach); drift is then measured against the refit, and the
    probed range grows to cover the live samples. So a shape the calibration got wrong — too
    little attention from short probes, an overhead read off a noisy moment — is corrected
    from the first requests, not from the sixteenth, while a host that only changed speed
    moves drift and leaves the model alone.
    Thread-safe.

    ``alpha`` is accepted for compatibility and ignored (drift used to be an exponentially
    weighted mean, which needed ~10 requests to follow a 30 % change of speed).
    """

    def __init__(
        self,
        profile: Profile,
        *,
        alpha: float | None = None,
        refit_every: int = 1,
        provisional_refit_every: int = 1,
        keep_live: int = 64,
        drift_window: int | None = None,
    ) -> None:
        checked = (("refit_every", refit_every), ("provisional_refit_every", provisional_refit_every))
        for name, value in checked + ((("drift_window", drift_window),) if drift_window is not None else ()):
            if not (_is_count(value) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1 (or None for drift_window), got {value!r}")
        self._profile = profile
        #: the calibration the live state started from (its model fitted to its samples alone)
        self._calibration = profile
        #: the model fitted on the calibration's samples alone (:meth:`_calibration_fit`; None until needed)
        self._calib_fit: CostModel | None = None
        self._refit_every = refit_every
        self._provisional_refit_every = provisional_refit_every
        self._live: deque[PrefillSample] = deque(maxlen=keep_live)
        #: the candidate drift windows (one when fixed), and each one's recent errors
        self._windows = DRIFT_WINDOWS if drift_window is None else (drift_window,)
        self._window = DEFAULT_DRIFT_WINDOW if drift_window is None else drift_window
        self._window_errors: dict[int, deque[float]] = {w: deque(maxlen=WINDOW_SCORE_MEMORY) for w in self._windows}
        self._recent: deque[PrefillSample] = deque(maxlen=max(self._windows))
        self._prior_log_drift = math.log(profile.drift)  # stands in for ratios not yet seen
        self._seen = 0
        #: decode speeds (tokens/s) measured by recent requests; their median replaces calibration's
        self._decode: deque[float] = deque(maxlen=self._window)
        #: the decode points of recent requests whose context is known (decode speed vs context),
        #: starting from those a stored refined profile kept
        self._decode_points: deque[DecodePoint] = deque((p for p in profile.decode_points if p.source == "live"), maxlen=KEEP_DECODE_POINTS)
        #: first-token overheads (client TTFT − engine prefill) measured by recent requests, with
        #: their prompt lengths (None where the request did not say)
        self._first_token: deque[tuple[int | None, float]] = deque(maxlen=KEEP_FIRST_TOKEN_POINTS)
        self._lock = threading.Lock()

    @property
    def current(self) -> Profile:
        return self._profile

    def _log_drift(self, model: CostModel, window: int | None = None) -> float:
        """The median log ratio measured / ``model`` over the last ``window`` samples (the window
        in use: :meth:`_best_window`), padded with the prior while fewer were seen."""
        window = self._best_window() if window is None else window
        logs = [_log_ratio(s.seconds, model.prefill_s(s.new_tokens, s.cached_tokens)) for s in list(self._recent)[-window:]]
        logs = [x for x in logs if x is not None]
        logs += [self._prior_log_drift] * (window - len(logs))
        return statistics.median(logs)

    def _best_window(self) -> int:
        """The candidate window whose drift predicted the recent samples best (mean absolute log
        error); the default window while it is among the best, else the shortest of them."""
        scores = {w: sum(e) / len(e) if e else 0.0 for w, e in self._window_errors.items()}
        best = min(scores.values())
        if scores.get(self._window, math.inf) <= best:
            return self._window
        return min(w for w, score in scores.items() if score <= best)

    def _score_windows(self, model: CostModel, sample: PrefillSample) -> None:
        """Under the lock, before ``sample`` joins the recent ones: how far each candidate
        window's drift was from it."""
        if len(self._windows) == 1:
            return
        measured = _log_ratio(sample.seconds, model.prefill_s(sample.new_tokens, sample.cached_tokens))
        if measured is None:
            return
        for w in self._windows:
            self._window_errors[w].append(abs(measured - self._log_drift(model, w)))

    def observe(self, new_tokens: int, cached_tokens: int, measured_prefill_s: float) -> None:
        """Feed one measured prefill back. Unusable measurements (no tokens, a negative or
        missing count, a time that is zero, negative, NaN or infinite) are ignored: this runs
        after a response was delivered and must never fail it."""
        if not (_is_count(new_tokens) and new_tokens >= 1 and _is_count(cached_tokens) and cached_tokens >= 0):
            return
        if isinstance(measured_prefill_s, bool) or not isinstance(measured_prefill_s, numbers.Real):
            return
        if not (measured_prefill_s > 0 and math.isfinite(measured_prefill_s)):
            return
        sample = PrefillSample(int(new_tokens), int(cached_tokens), float(measured_prefill_s), source="live")
        with self._lock:
            model = self._profile.model
            if model.prefill_s(sample.new_tokens, sample.cached_tokens) <= 0:
                return
            self._score_windows(model, sample)
            self._recent.append(sample)
            self._live.append(sample)
            self._seen += 1
            every = self._provisional_refit_every if self._profile.provisional else self._refit_every
            self._update(self._profile, refit=self._seen % every == 0)

    def observe_decode(self, tokens_per_s: Any, completion_tokens: Any, context_tokens: Any = None) -> None:
        """Feed one request's measured decode speed back; ``context_tokens`` is its prompt
        length (the KV cache its first decode step reads). The profile's decode speed becomes the
        median of the last ``drift_window`` (default 5) measured: calibration measures decode over a few
        steps only (or estimates it on a host too slow for even one within its budget), and a
        request's stream is what the user sees. With ``context_tokens`` the request is also a
        point of the decode-vs-context line (:meth:`decode_tokens_per_s_at`) at its mean context
        (:func:`~trimkit.decode_model.mean_context`). Answers of fewer than
        :data:`MIN_DECODE_TOKENS` tokens, and unusable numbers, are ignored."""
        if not (_is_count(completion_tokens) and completion_tokens >= MIN_DECODE_TOKENS):
            return
        if isinstance(tokens_per_s, bool) or not isinstance(tokens_per_s, numbers.Real):
            return
        if not (tokens_per_s > 0 and math.isfinite(tokens_per_s)):
            return
        with self._lock:
            self._decode.append(float(tokens_per_s))
            if _is_count(context_tokens) and context_tokens >= 0:
                context = mean_context(int(context_tokens), int(completion_tokens))
                self._decode_points.append(DecodePoint(context, float(tokens_per_s), int(completion_tokens) - 1, source="live"))
            self._profile = attrs.evolve(self._profile, decode_tokens_per_s=statistics.median(self._decode),
                                         decode_points=self._with_live_decode(self._profile))

    def _with_live_decode(self, profile: Profile) -> tuple[DecodePoint, ...]:
        """``profile``'s calibration decode points followed by the served requests' (oldest first)."""
        return tuple(p for p in profile.decode_points if p.source != "live") + tuple(self._decode_points)

    def decode_tokens_per_s_at(self, context_tokens: int, output_tokens: int = 0) -> float | None:
        """Predicted decode speed at ``context_tokens`` prompt tokens, from calibration's decode
        points and the served requests' (:meth:`~trimkit.profile.Profile.decode_tokens_per_s_at`
        of :attr:`current`); None when nothing measured decode."""
        return self.current.decode_tokens_per_s_at(context_tokens, output_tokens)

    def observe_first_token(self, ttft_s: Any, engine_prefill_s: Any, prompt_tokens: Any = None) -> None:
        """Feed one request's first-token overhead back: its TTFT less the engine's own prefill
        time (template, tokenization, the first sampling step, the HTTP round trip for a
        server); ``prompt_tokens`` is its whole prompt's length, cached tokens included. A
        micro-calibration often has no time to measure the overhead and estimates it, and it is
        most of the TTFT of a short follow-up turn — which, after a long conversation, pays for
        tokenizing all of it. So the profile learns both parts (:meth:`_first_token_parts`): how
        the overhead grows per prompt token, from the last :data:`KEEP_FIRST_TOKEN_POINTS`
        requests once they span lengths :data:`FIRST_TOKEN_LENGTH_SPREAD` times apart, and the
        fixed part, from the last ``drift_window`` (default 5). Unusable numbers are ignored."""
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
        requests (Theil–Sen: one slow request moves it little), at least 0, once enough requests
        of lengths far enough apart were seen; else ``profile``'s. Fixed: the median over the
        last ``drift_window`` (default 5) requests of their overhead less the per-token part."""
        if not self._first_token:
            return profile.first_token_s, profile.first_token_per_token_s
        per = profile.first_token_per_token_s
        known = [(x, y) for x, y in self._first_token if x is not None]
        if len(known) >= MIN_FIRST_TOKEN_POINTS and max(x for x, _ in known) >= FIRST_TOKEN_LENGTH_SPREAD * min(x for x, _ in known):
            slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(known) for x2, y2 in known[i + 1:] if x2 != x1]
            per = max(statistics.median(slopes), 0.0)
        recent = list(self._first_token)[-self._window:]
        first = statistics.median(y - per * (x or 0) for x, y in recent)
        return max(first, 0.0), per

    def replace_calibration(self, profile: Profile) -> None:
        """Predict from ``profile`` from now on: a refined calibration of the same engine (idle
        probes measured more of it). Drift starts again from ``profile.drift`` and is measured
        against its model over the recent live samples; the live samples stay, and a refit round
        runs at once, so what the requests taught is not lost."""
        with self._lock:
            self._calibration = profile
            self._calib_fit = None
            self._prior_log_drift = math.log(profile.drift)
            self._update(profile, refit=bool(self._live))

    def speed_factor(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """How many times slower than when the calibration's samples were measured the host runs
        now for ``new_tokens`` after ``cached_tokens``: the prediction as served (the model after
        live refits, times drift) over the calibration's own model. A probe measured now, divided
        by it, joins the calibration's samples at their speed (:mod:`trimkit.idle_probes`): a fit
        mixing samples from a slower and a faster moment would bend its shape — a probe at one
        length taken while the host runs 30 % slower reads as attention costing more — where
        drift already accounts for the change of speed. 1 when either prediction is zero."""
        with self._lock:
            now = self._profile.model.prefill_s(new_tokens, cached_tokens) * self._profile.drift
            then = self._calibration.model.prefill_s(new_tokens, cached_tokens)
        return now / then if now > 0 and then > 0 else 1.0

    def _update(self, profile: Profile, *, refit: bool) -> None:
        """Under the lock: the current profile from ``profile``'s calibration, the drift over the
        recent samples and (``refit``) a refit round on calibration plus live samples."""
        model = profile.model
        log_drift = self._log_drift(model)
        if refit and self._live:
            live = list(self._live)
            try:
                refit_model, refit_log_drift = self._refit(profile, live)
            except (ValueError, ArithmeticError, np.linalg.LinAlgError) as exc:
                # a stored profile's samples no fit can use (absurd counts or times): drift alone;
                # learning runs after a response was delivered and must never fail it
                log.debug("trimkit: live refit skipped: %s", exc)
            else:
                if refit_model is not None:
                    model = refit_model
                    self._prior_log_drift = refit_log_drift  # the refit's speed stands in for the ratios not yet seen
                    log_drift = self._log_drift(model)
                # the measured lengths are no longer an extrapolation: either they are in the
                # refit, or the model explains them at least as well as a refit on them would
                profile = covering(profile, live)
        decode = statistics.median(self._decode) if self._decode else profile.decode_tokens_per_s
        first, per = self._first_token_parts(profile)
        self._profile = attrs.evolve(profile, model=model, drift=math.exp(log_drift), decode_tokens_per_s=decode, first_token_s=first,
                                     first_token_per_token_s=per, decode_points=self._with_live_decode(profile))

    def _refit(self, profile: Profile, live: list[PrefillSample]) -> tuple[CostModel | None, float]:
        """Under the lock: the refit round's model and its log speed factor, or ``(None, 0)``
        when the refit does not explain the live samples better than ``profile``'s model at its
        best single speed factor (their median ratio: what drift alone could reach).

        The live samples are first brought to the calibration's speed — divided by their median
        ratio to a fit of the calibration's samples alone — and fitted with the calibration's
        samples: a fit mixing samples measured at one speed with samples measured at another
        bends the model's shape, a change of speed read as a change of shape (the reason idle
        probes are brought there too, :meth:`speed_factor`). The refit predicts at that speed
        factor; the model kept is at the calibration's speed, so drift goes on measuring the
        host's speed against it."""
        model = profile.model
        calib = [s for s in profile.samples if s.source == "calibration"]
        kwargs = {"n_batch": model.n_batch, "batched": model.per_batch_s > 0, "depth_prior_tokens": profile.depth_prior_tokens}
        drift_only = error_stats((model.prefill_s(s.new_tokens, s.cached_tokens) * math.exp(_median_log_ratio(model, live)), s.seconds)
                                 for s in live)
        log_speed = _median_log_ratio(self._calibration_fit(calib, kwargs) if calib else self._calibration.model, live)
        speed = math.exp(log_speed)
        candidate = fit_cost_model(calib + [attrs.evolve(s, seconds=s.seconds / speed) for s in live], **kwargs)
        refit = error_stats((candidate.prefill_s(s.new_tokens, s.cached_tokens) * speed, s.seconds) for s in live)
        if refit.median_pct < drift_only.median_pct - REFIT_TIE_PCT:
            return candidate, log_speed
        return None, 0.0

    def _calibration_fit(self, calib: list[PrefillSample], kwargs: dict[str, Any]) -> CostModel:
        """Under the lock: the cost model of the calibration's samples ``calib`` alone, fitted
        once per calibration (:meth:`replace_calibration` forgets it)."""
        if self._calib_fit is None:
            self._calib_fit = fit_cost_model(calib, **kwargs)
        return self._calib_fit

    @property
    def observations(self) -> int:
        """How many live measurements were accepted."""
        return self._seen

    @property
    def live_samples(self) -> Sequence[PrefillSample]:
        with self._lock:
            return tuple(self._live)
