"""Calibration profiles: what prefill costs on this host, for one model and one set of settings.

A :class:`Profile` carries its samples, the fitted :class:`~trimkit.costmodel.CostModel`, its
own held-out error, the measured decode speed, and the :class:`ProfileKey` it is valid for. It
is stored as JSON in the user cache (``$TRIMKIT_CACHE_DIR`` or ``~/.cache/trimkit``) under a
file named by the key's hash, written atomically, and reused by the next run with the same key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import statistics
import tempfile
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from trimkit._validate import non_negative_finite, positive_finite, real_float
from trimkit.costmodel import CostModel, ErrorStats, PrefillSample, error_stats

__all__ = ["ProfileKey", "Profile", "LiveProfile", "cache_dir", "profile_path", "load_profile", "save_profile"]

log = logging.getLogger("trimkit")

SCHEMA_VERSION = 1


@attrs.frozen
class ProfileKey:
    """Everything that changes prefill timings. A profile is only reused under an equal key."""

    backend: str
    model: str
    n_ctx: int
    n_batch: int
    n_ubatch: int = 0
    n_threads: int = 0
    n_threads_batch: int = 0
    flash_attn: str = ""
    n_gpu_layers: int = 0
    engine_version: str = ""
    cpu: str = ""
    extra: str = ""

    def digest(self) -> str:
        blob = json.dumps(attrs.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:20]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileKey:
        return cls(**{f.name: data[f.name] for f in attrs.fields(cls) if f.name in data})


def _pairs(value: Any) -> tuple[tuple[float, float], ...]:
    """(predicted, measured) pairs as a tuple of float 2-tuples (JSON gives lists)."""
    out = []
    for pair in value:
        p, m = pair
        out.append((real_float(p), real_float(m)))
    return tuple(out)


@attrs.frozen
class Profile:
    """A measured prefill profile. Use :meth:`predict_ttft_s` to predict a request's TTFT.

    ``first_token_s`` is what a request adds on top of prefill before its first content chunk
    (chat template, tokenization, the first sampling step), measured end to end during
    calibration. ``error`` is the cost model's leave-one-probe-out error on its own samples.
    """

    key: ProfileKey
    model: CostModel
    first_token_s: float = attrs.field(converter=real_float)
    decode_tokens_per_s: float = attrs.field(converter=real_float)
    samples: tuple[PrefillSample, ...] = attrs.field(converter=tuple, repr=False)
    error: ErrorStats
    alternatives: Mapping[str, Any] = attrs.field(factory=dict, repr=False)
    calibration_wall_s: float = 0.0
    quick: bool = False
    created_at: float = 0.0
    drift: float = 1.0
    #: calibration's held-out residuals: (predicted, measured) prefill seconds per calibration
    #: sample, each predicted by a fit without its probe; they seed the learned safety margin
    #: (:mod:`trimkit.margin`). Empty for profiles stored before they were kept.
    residuals: tuple[tuple[float, float], ...] = attrs.field(default=(), converter=_pairs, repr=False)

    def __attrs_post_init__(self) -> None:
        non_negative_finite(self.first_token_s, "first_token_s")
        non_negative_finite(self.decode_tokens_per_s, "decode_tokens_per_s")
        # predictions multiply by drift and budgets divide by it: 0, negative or NaN would poison both
        positive_finite(self.drift, "drift")

    def predict_prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted prefill time for ``new_tokens`` evaluated after ``cached_tokens`` cached ones."""
        return self.model.prefill_s(max(int(new_tokens), 1), cached_tokens) * self.drift

    def predict_ttft_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted time to first token: prefill of the tokens the engine must evaluate plus the
        fixed per-request cost. llama.cpp always evaluates at least one token, even on a full hit."""
        return self.predict_prefill_s(new_tokens, cached_tokens) + self.first_token_s

    def max_new_tokens(self, ttft_budget_s: float, cached_tokens: int = 0) -> int:
        """The most new tokens that fit ``ttft_budget_s`` after ``cached_tokens`` cached ones."""
        prefill_budget = (ttft_budget_s - self.first_token_s) / self.drift
        return self.model.max_new_tokens(prefill_budget, cached_tokens)

    @property
    def safety_margin(self) -> float:
        """Fraction of a budget to hold back: the profile's own p90 held-out error, 3–25 %."""
        p90 = self.error.p90_pct if math.isfinite(self.error.p90_pct) else 10.0
        return min(max(p90 / 100.0, 0.03), 0.25)

    def table(self) -> list[dict[str, float]]:
        """Per probe: tokens, measured (median) and predicted prefill time, per-token cost."""
        groups: dict[tuple[int, int], list[float]] = {}
        for s in self.samples:
            if s.source == "calibration":
                groups.setdefault((s.new_tokens, s.cached_tokens), []).append(s.seconds)
        rows = []
        for (n, k), times in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            times.sort()
            measured = times[len(times) // 2]
            predicted = self.model.prefill_s(n, k)
            rows.append({
                "new_tokens": n,
                "cached_tokens": k,
                "measured_s": measured,
                "predicted_s": predicted,
                "error_pct": (predicted - measured) / measured * 100 if measured > 0 else float("nan"),
                "ms_per_token": measured / n * 1000,
                "repeats": len(times),
            })
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "key": self.key.to_dict(),
            "model": self.model.to_dict(),
            "first_token_s": self.first_token_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "samples": [s.to_dict() for s in self.samples],
            "error": self.error.to_dict(),
            "alternatives": dict(self.alternatives),
            "calibration_wall_s": self.calibration_wall_s,
            "quick": self.quick,
            "created_at": self.created_at,
            "drift": self.drift,
            "residuals": [list(pair) for pair in self.residuals],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"profile schema {data.get('schema')!r} != {SCHEMA_VERSION}")
        return cls(
            key=ProfileKey.from_dict(data["key"]),
            model=CostModel(**data["model"]),
            first_token_s=data["first_token_s"],
            decode_tokens_per_s=data["decode_tokens_per_s"],
            samples=tuple(PrefillSample(**s) for s in data["samples"]),
            error=ErrorStats(**data["error"]),
            alternatives=data.get("alternatives", {}),
            calibration_wall_s=data.get("calibration_wall_s", 0.0),
            quick=bool(data.get("quick", False)),
            created_at=data.get("created_at", 0.0),
            drift=data.get("drift", 1.0),
            residuals=data.get("residuals", ()),
        )


def cache_dir() -> Path:
    """trimkit's cache folder: ``$TRIMKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/trimkit``, else ``~/.cache/trimkit``."""
    env = os.environ.get("TRIMKIT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trimkit"


def profile_path(key: ProfileKey) -> Path:
    return cache_dir() / "profiles" / f"{key.digest()}.json"


def save_profile(profile: Profile, path: Path | None = None) -> Path:
    """Write ``profile`` as JSON atomically (temp file + rename). Returns the path."""
    path = path or profile_path(profile.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(profile.to_dict(), fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_profile(key: ProfileKey, path: Path | None = None) -> Profile | None:
    """The stored profile for ``key``, or None when there is none, it is corrupt (a warning is
    logged) or it was made under another key."""
    path = path or profile_path(key)
    if not path.exists():
        return None
    try:
        profile = Profile.from_dict(json.loads(path.read_text()))
    except Exception as exc:  # corrupt, truncated, old schema, unreadable
        log.warning("stored profile %s is unreadable (%s: %s); calibrating again", path, type(exc).__name__, exc)
        return None
    if profile.key != key:
        log.info("stored profile %s was made for another configuration; calibrating again", path)
        return None
    return profile


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
        self._keep_live = keep_live
        self._live: list[PrefillSample] = []
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
            self._live = self._live[-self._keep_live :]
            self._seen += 1
            log_drift = self._log_drift(model)
            if self._seen % self._refit_every == 0:
                from trimkit.costmodel import fit_cost_model

                calib = [s for s in self._profile.samples if s.source == "calibration"]
                refit = fit_cost_model(calib + self._live, n_batch=model.n_batch, batched=model.per_batch_s > 0)
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
