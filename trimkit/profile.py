"""Calibration profiles: what prefill costs on this host, for one model and one set of settings.

A :class:`Profile` carries its samples, the fitted :class:`~trimkit.costmodel.CostModel`, its
own held-out error, the measured decode speed, and the :class:`ProfileKey` it is valid for. It
is stored as JSON in the user cache (``$TRIMKIT_CACHE_DIR`` or ``~/.cache/trimkit``) under a
file named by the key's hash, written atomically, and reused by the next run with the same key.

A stored file is untrusted input: :func:`load_profile` reads only a regular file of at most
:data:`MAX_PROFILE_BYTES` (a FIFO or a device at the path never blocks it), and
:meth:`Profile.from_dict` is the one place its JSON becomes a :class:`Profile` — every type,
count and number is checked there, and the model must predict a positive, finite time for a
1- and a 1000-token prompt. Anything else is a :class:`~trimkit.errors.ProfileError`, which
``load_profile`` turns into one warning naming the file and None (so the caller calibrates
again). A cache folder that cannot be written only costs the reuse: :func:`save_profile` warns
once and the profile stays in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import stat
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from trimkit._validate import count, non_negative_finite, positive_finite, real_float
from trimkit.costmodel import CostModel, ErrorStats, PrefillSample, error_stats
from trimkit.errors import InvalidInputError, InvalidNumberError, ProfileError

__all__ = ["ProfileKey", "Profile", "LiveProfile", "cache_dir", "profile_path", "load_profile", "save_profile"]

log = logging.getLogger("trimkit")

SCHEMA_VERSION = 1
#: a stored profile larger than this is refused unread (a real one is a few KiB)
MAX_PROFILE_BYTES = 16 * 1024 * 1024
#: a ``.profile-*.tmp`` file older than this is left over from a killed save and is removed
STALE_TMP_S = 60.0


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
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise InvalidNumberError(f"residuals must be a list of (predicted, measured) pairs, got {type(value).__name__}")
    out = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidNumberError(f"each residual must be a (predicted, measured) pair, got {type(pair).__name__}")
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
    calibration_wall_s: float = attrs.field(default=0.0, converter=real_float)
    quick: bool = attrs.field(default=False, converter=bool)  # a stored file must hold a real bool (from_dict)
    created_at: float = attrs.field(default=0.0, converter=real_float)
    drift: float = 1.0
    #: calibration's held-out residuals: (predicted, measured) prefill seconds per calibration
    #: sample, each predicted by a fit without its probe; they seed the learned safety margin
    #: (:mod:`trimkit.margin`). Empty for profiles stored before they were kept.
    residuals: tuple[tuple[float, float], ...] = attrs.field(default=(), converter=_pairs, repr=False)

    def __attrs_post_init__(self) -> None:
        # past construction, code trusts these types: check them once here
        for name, kind in (("key", ProfileKey), ("model", CostModel), ("error", ErrorStats), ("alternatives", Mapping)):
            if not isinstance(getattr(self, name), kind):
                raise InvalidInputError(f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        for i, s in enumerate(self.samples):
            if not isinstance(s, PrefillSample):
                raise InvalidInputError(f"samples[{i}] must be a PrefillSample, got {type(s).__name__}")
        non_negative_finite(self.first_token_s, "first_token_s")
        non_negative_finite(self.decode_tokens_per_s, "decode_tokens_per_s")
        non_negative_finite(self.calibration_wall_s, "calibration_wall_s")
        if not math.isfinite(self.created_at):
            raise InvalidNumberError(f"created_at must be finite, got {self.created_at!r}")
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
    def from_dict(cls, data: Any) -> Profile:
        """The profile stored as ``data`` (parsed JSON), fully checked: raises
        :class:`~trimkit.errors.ProfileError` naming the first field that is missing, of the
        wrong type or out of range, and never another exception."""
        return _structure(data)


def cache_dir() -> Path:
    """trimkit's cache folder: ``$TRIMKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/trimkit``, else ``~/.cache/trimkit``."""
    env = os.environ.get("TRIMKIT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trimkit"


def profile_path(key: ProfileKey) -> Path:
    return cache_dir() / "profiles" / f"{key.digest()}.json"


# -- reading a stored profile: the one boundary where untrusted JSON becomes a Profile ----------


def _where(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _obj(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where or 'the file'} must be a JSON object, got {type(value).__name__}")
    return value


def _field(data: Mapping[str, Any], name: str, where: str = "") -> Any:
    if name not in data:
        raise ProfileError(f"{_where(where, name)} is missing")
    return data[name]


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ProfileError(f"{where} must be a string, got {type(value).__name__}")
    return value


def _int(value: Any, where: str, minimum: int = 0) -> int:
    try:
        return count(value, where, minimum=minimum)
    except InvalidNumberError as exc:
        raise ProfileError(str(exc)) from None


def _number(value: Any, where: str, check: Any = None) -> float:
    try:
        v = real_float(value)
        if check is not None:
            check(v, where)
    except InvalidInputError as exc:
        raise ProfileError(f"{where}: {exc}" if where not in str(exc) else str(exc)) from None
    return v


def _finite(value: float, where: str) -> None:
    if not math.isfinite(value):
        raise InvalidNumberError(f"{where} must be finite, got {value!r}")


def _build(make: Any, where: str, **kwargs: Any) -> Any:
    """``make(**kwargs)``, its validation errors as a ProfileError naming ``where``."""
    try:
        return make(**kwargs)
    except InvalidInputError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def _structure_key(data: Any) -> ProfileKey:
    data = _obj(data, "key")
    values: dict[str, Any] = {}
    for f in attrs.fields(ProfileKey):
        if f.name not in data:
            if f.default is attrs.NOTHING:
                raise ProfileError(f"key.{f.name} is missing")
            continue
        if f.type in (int, "int"):
            values[f.name] = _int(data[f.name], f"key.{f.name}")
        else:
            values[f.name] = _str(data[f.name], f"key.{f.name}")
    return ProfileKey(**values)


def _structure_model(data: Any) -> CostModel:
    data = _obj(data, "model")
    kwargs = {name: _number(_field(data, name, "model"), f"model.{name}") for name in ("overhead_s", "per_token_s", "depth_s")}
    if "per_batch_s" in data:
        kwargs["per_batch_s"] = _number(data["per_batch_s"], "model.per_batch_s")
    if "n_batch" in data:
        kwargs["n_batch"] = _int(data["n_batch"], "model.n_batch", minimum=1)
    model: CostModel = _build(CostModel, "model", **kwargs)
    # an all-zero model predicts 0 s forever, and live drift (a ratio to it) can never correct it
    for n in (1, 1000):
        try:
            predicted = model.prefill_s(n, 0)
        except (OverflowError, ZeroDivisionError):  # pragma: no cover - coefficients are finite floats
            predicted = math.inf
        if not (predicted > 0 and math.isfinite(predicted)):
            raise ProfileError(f"model predicts {predicted!r} s for a {n}-token prompt (need a finite time > 0)")
    return model


def _structure_sample(data: Any, where: str) -> PrefillSample:
    data = _obj(data, where)
    kwargs: dict[str, Any] = {
        "new_tokens": _int(_field(data, "new_tokens", where), f"{where}.new_tokens", minimum=1),
        "cached_tokens": _int(_field(data, "cached_tokens", where), f"{where}.cached_tokens"),
        "seconds": _number(_field(data, "seconds", where), f"{where}.seconds", non_negative_finite),
    }
    if "source" in data:
        kwargs["source"] = _str(data["source"], f"{where}.source")
    return _build(PrefillSample, where, **kwargs)


def _structure_error(data: Any) -> ErrorStats:
    data = _obj(data, "error")
    kwargs: dict[str, Any] = {name: _number(_field(data, name, "error"), f"error.{name}") for name in ("median_pct", "p90_pct", "max_pct")}
    kwargs["n"] = _int(_field(data, "n", "error"), "error.n")
    return _build(ErrorStats, "error", **kwargs)


def _structure_residuals(data: Any) -> tuple[tuple[float, float], ...]:
    if not isinstance(data, list):
        raise ProfileError(f"residuals must be a list, got {type(data).__name__}")
    out = []
    for i, pair in enumerate(data):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ProfileError(f"residuals[{i}] must be a [predicted, measured] pair")
        out.append(tuple(_number(v, f"residuals[{i}][{j}]", non_negative_finite) for j, v in enumerate(pair)))
    return tuple(out)  # type: ignore[arg-type]


def _structure(data: Any) -> Profile:
    """Parsed profile JSON → :class:`Profile`, or :class:`ProfileError` saying what is wrong."""
    data = _obj(data, "")
    schema = data.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:  # not True, not 1.0
        shown = repr(schema) if isinstance(schema, (int, str, type(None))) and len(repr(schema)) < 40 else type(schema).__name__
        raise ProfileError(f"profile schema {shown} is not {SCHEMA_VERSION}")
    samples = _field(data, "samples")
    if not isinstance(samples, list):
        raise ProfileError(f"samples must be a list, got {type(samples).__name__}")
    alternatives = data.get("alternatives", {})
    if not isinstance(alternatives, dict):
        raise ProfileError(f"alternatives must be a JSON object, got {type(alternatives).__name__}")
    quick = data.get("quick", False)
    if not isinstance(quick, bool):
        raise ProfileError(f"quick must be true or false, got {type(quick).__name__}")
    return _build(
        Profile,
        "profile",
        key=_structure_key(_field(data, "key")),
        model=_structure_model(_field(data, "model")),
        first_token_s=_number(_field(data, "first_token_s"), "first_token_s", non_negative_finite),
        decode_tokens_per_s=_number(_field(data, "decode_tokens_per_s"), "decode_tokens_per_s", non_negative_finite),
        samples=tuple(_structure_sample(s, f"samples[{i}]") for i, s in enumerate(samples)),
        error=_structure_error(_field(data, "error")),
        alternatives=alternatives,
        calibration_wall_s=_number(data.get("calibration_wall_s", 0.0), "calibration_wall_s", non_negative_finite),
        quick=quick,
        created_at=_number(data.get("created_at", 0.0), "created_at", _finite),
        drift=_number(data.get("drift", 1.0), "drift", positive_finite),
        residuals=_structure_residuals(data.get("residuals", [])),
    )


def _stat(path: Path) -> os.stat_result | None:
    """The file's status, None when there is no file; ProfileError when it cannot be looked at."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as exc:  # permission denied, a name the OS refuses
        raise ProfileError(f"unreadable ({getattr(exc, 'strerror', None) or exc})") from None


def _read_json(path: Path, st: os.stat_result) -> Any:
    """The parsed JSON of the file at ``path`` (status ``st``); ProfileError when it is not a
    regular file, too large, not UTF-8 or not JSON. Never blocks: the type is checked before
    opening and the open is non-blocking (a FIFO swapped in between is caught by ``fstat``)."""
    if not stat.S_ISREG(st.st_mode):
        raise ProfileError("not a regular file")
    if st.st_size > MAX_PROFILE_BYTES:
        raise ProfileError(f"{st.st_size} bytes, over the {MAX_PROFILE_BYTES}-byte limit for a profile")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ProfileError(f"unreadable ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        try:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise ProfileError("not a regular file")
            raw = fh.read(MAX_PROFILE_BYTES + 1)
        except OSError as exc:
            raise ProfileError(f"unreadable ({exc.strerror or exc})") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(f"over the {MAX_PROFILE_BYTES}-byte limit for a profile")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProfileError("not UTF-8 text") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a 5000-digit int, [[[[…
        raise ProfileError(f"not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


#: (path, file identity, reason) of unusable profiles already warned about: one warning per file
_warned_unusable: set[tuple[Any, ...]] = set()
#: cache folders already warned about as unwritable (cleared when a save there succeeds)
_warned_unwritable: set[str] = set()
_warn_lock = threading.Lock()


def _warn_unusable(path: Path, ident: Any, reason: str) -> None:
    """One warning per unusable file (wrap() and the CLI may look at it twice before recalibrating)."""
    mark = (str(path), ident, reason)
    with _warn_lock:
        first = mark not in _warned_unusable
        _warned_unusable.add(mark)
    (log.warning if first else log.info)("stored profile %s is unusable: %s; calibrating again", path, reason)


def _clean_stale_tmp(folder: Path, now: float | None = None) -> None:
    """Remove ``.profile-*.tmp`` files older than :data:`STALE_TMP_S`: left by a save that was
    killed (SIGKILL, power loss) between writing and renaming. Best effort."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if not (entry.name.startswith(".profile-") and entry.name.endswith(".tmp")):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_TMP_S:
                os.unlink(entry.path)
        except OSError:
            continue


def _warn_unwritable(folder: Path, exc: OSError) -> None:
    with _warn_lock:
        first = str(folder) not in _warned_unwritable
        _warned_unwritable.add(str(folder))
    (log.warning if first else log.debug)(
        "trimkit: cannot store the calibration profile in %s (%s); it is kept in memory only, so the next "
        "process calibrates again (set TRIMKIT_CACHE_DIR to a writable folder)", folder, exc.strerror or exc,
    )


def save_profile(profile: Profile, path: Path | None = None) -> Path | None:
    """Write ``profile`` as JSON atomically (temp file + rename). Returns the path.

    Without ``path`` it goes to the user cache (:func:`profile_path`); a cache folder that
    cannot be written (read-only, a file in the way, disk full) is then no error: one warning
    per folder is logged, the profile is kept in memory only, and None is returned. An explicit
    ``path`` that cannot be written raises the OSError. Leftover temp files of a killed save
    older than a minute are removed from the folder."""
    explicit = path is not None
    path = path or profile_path(profile.key)
    blob = json.dumps(profile.to_dict(), indent=1)  # fails (TypeError) before anything is written
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale_tmp(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if explicit or not isinstance(exc, OSError):
            raise
        _warn_unwritable(path.parent, exc)
        return None
    with _warn_lock:
        _warned_unwritable.discard(str(path.parent))
    return path


def load_profile(key: ProfileKey, path: Path | None = None) -> Profile | None:
    """The stored profile for ``key``, or None when there is none, it was made under another
    key, or it is unusable: not a regular file, over :data:`MAX_PROFILE_BYTES`, not JSON, or
    any field missing, mistyped or out of range. An unusable file is reported by one warning
    naming it and what is wrong (the caller calibrates again and overwrites it)."""
    path = path or profile_path(key)
    st = None
    try:
        st = _stat(path)
        if st is None:
            return None
        profile = _structure(_read_json(path, st))
    except ProfileError as exc:
        ident = None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        _warn_unusable(path, ident, str(exc))
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
