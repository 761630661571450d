"""Drift: a profile that follows the machine as it runs.

Calibration measures the host once; its speed then changes (thermal throttling, other load, a
model moved to another device). :class:`LiveProfile` feeds every measured prefill back into the
profile's predictions: the ``drift`` factor follows the recent ratios measured / predicted, and
the model is refitted now and then on calibration plus recent live samples. One engine's
``LiveProfile`` lives in its :class:`~trimkit.planning.margin.EngineState`.
"""

from __future__ import annotations

import math
import numbers
import statistics
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from trimkit.planning.costs import CostModel, PrefillSample, error_stats, fit_cost_model
from trimkit.profile import Profile

__all__ = ["LiveProfile"]


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class LiveProfile:
    """A profile that follows the machine: live prefill measurements adjust its predictions.

    Each measured request contributes the ratio measured / predicted prefill (the model's
    prediction before drift, clipped to 0.2–5). The profile's ``drift`` factor is the median of
    the last ``drift_window`` (5) ratios; while fewer have been seen, the missing ones count as
    the starting drift. So a step change in the host's speed is followed exactly after 3
    requests (3 of the 5 agree), while one or two outliers among the last five move it at most
    to a neighbouring ratio. Every ``refit_every`` observations the model is refitted on
    calibration plus recent live samples and kept only if it explains the live samples better
    than model × drift; drift is then measured against the refit. Thread-safe.

    ``alpha`` is accepted for compatibility and ignored (drift used to be an exponentially
    weighted mean, which needed ~10 requests to follow a 30 % change of speed).
    """

    def __init__(
        self,
        profile: Profile,
        *,
        alpha: float | None = None,
        refit_every: int = 16,
        keep_live: int = 64,
        drift_window: int = 5,
    ) -> None:
        if not (_is_count(drift_window) and drift_window >= 1):
            raise ValueError(f"drift_window must be an int >= 1, got {drift_window!r}")
        self._profile = profile
        self._refit_every = refit_every
        self._live: deque[PrefillSample] = deque(maxlen=keep_live)
        self._recent: deque[PrefillSample] = deque(maxlen=drift_window)
        self._window = drift_window
        self._prior_log_drift = math.log(profile.drift)  # stands in for ratios not yet seen
        self._seen = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> Profile:
        return self._profile

    def _log_drift(self, model: CostModel) -> float:
        """The median log ratio measured / ``model`` over the recent samples, padded with the prior."""
        logs = []
        for s in self._recent:
            base = model.prefill_s(s.new_tokens, s.cached_tokens)
            if base > 0:
                logs.append(math.log(min(max(s.seconds / base, 0.2), 5.0)))
        logs += [self._prior_log_drift] * (self._window - len(logs))
        return statistics.median(logs)

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
            self._recent.append(sample)
            self._live.append(sample)
            self._seen += 1
            log_drift = self._log_drift(model)
            if self._seen % self._refit_every == 0:
                calib = [s for s in self._profile.samples if s.source == "calibration"]
                refit = fit_cost_model(calib + list(self._live), n_batch=model.n_batch, batched=model.per_batch_s > 0)
                # keep the refit only if it explains the live samples better than model × drift
                old_err = error_stats((model.prefill_s(s.new_tokens, s.cached_tokens) * math.exp(log_drift), s.seconds) for s in self._live)
                new_err = error_stats((refit.prefill_s(s.new_tokens, s.cached_tokens), s.seconds) for s in self._live)
                if new_err.median_pct < old_err.median_pct:
                    model = refit
                    self._prior_log_drift = 0.0  # the refit absorbed the drift seen so far
                    log_drift = self._log_drift(model)
            self._profile = attrs.evolve(self._profile, model=model, drift=math.exp(log_drift))

    @property
    def observations(self) -> int:
        """How many live measurements were accepted."""
        return self._seen

    @property
    def live_samples(self) -> Sequence[PrefillSample]:
        with self._lock:
            return tuple(self._live)
