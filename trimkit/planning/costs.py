"""The prefill cost model (docs/design.md §2): ``T(n | k) = b + a·n + c·(n·k + n²/2)`` for ``n`` new tokens after ``k``
cached ones, optionally plus ``d·ceil(n / n_batch)``; fitted by non-negative least squares on relative error, with the
architecture's attention doubling length as a prior on ``c`` where it is known. Also the KV cache state a plan reads."""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np

from trimkit.errors import InvalidInputError, InvalidNumberError, attrs_non_negative, count, positive_finite, real_float

#: the attention prior's relative standard deviation: a FLOP ratio says nothing of how efficiently an engine runs attention
ATTENTION_PRIOR_SPREAD = 0.5
#: a probe's relative noise where the probes are too few to show it (:func:`probe_noise`), and its floor
PROBE_NOISE = 0.1
PROBE_NOISE_FLOOR = 0.02


def evaluated_tokens(n_tokens: int, cached_tokens: int) -> int:
    """At least one: llama.cpp evaluates the last prompt token even on a full cache hit (it needs its logits)."""
    return max(n_tokens - cached_tokens, 1)


def reusable_cached_tokens(n_tokens: int, cached_tokens: int) -> int:
    """The part of ``cached_tokens`` an ``n_tokens`` prompt can reuse: 0 to ``n_tokens - 1``."""
    return max(0, min(cached_tokens, n_tokens - 1))


def _tokens_copy(tokens: Iterable[int]) -> Sequence[int]:
    """A tuple, or a read-only copy of a numpy array (an engine's input ids, which it overwrites)."""
    if isinstance(tokens, tuple):
        return tokens
    if isinstance(tokens, np.ndarray):
        copy = tokens.copy()
        copy.flags.writeable = False
        return copy  # type: ignore[return-value]
    return tuple(tokens)


@attrs.frozen(eq=False)
class CacheState:
    """What the engine's KV cache holds, as data a plan reads: ``prompts`` it reuses as they are, ``(tokens, restore_s)``
    ``snapshots``, reuse in ``block``s, and ``after``: the prompt the context holds when this request's turn comes."""

    prompts: tuple[Sequence[int], ...] = attrs.field(default=(), converter=lambda ps: tuple(_tokens_copy(p) for p in ps))
    snapshots: tuple[tuple[Sequence[int], float], ...] = attrs.field(default=(), converter=lambda ss: tuple((_tokens_copy(t), float(r)) for t, r in ss))
    block: int = attrs.field(default=1, validator=lambda _i, _a, v: count(v, "block", minimum=1))
    after: Sequence[int] | None = attrs.field(default=None, converter=attrs.converters.optional(_tokens_copy))

    def cached(self, tokens: Sequence[int], cost: Callable[[int, int], float] | None = None) -> int:
        """How many leading tokens of ``tokens`` the engine reuses: a held prompt's prefix, or a snapshot's where restoring
        it is predicted faster (``cost(new, cached)`` → seconds)."""
        return self.best(tokens, cost)[0]

    def best(self, tokens: Sequence[int], cost: Callable[[int, int], float] | None = None) -> tuple[int, int | None]:
        """:meth:`cached`, and the index of the snapshot to restore first (None: none)."""
        from trimkit.planning.tokens import reusable_prefix_len  # tokens imports this module

        current = max((reusable_prefix_len(p, tokens) for p in self.prompts), default=0) // self.block * self.block
        n = len(tokens)

        def seconds(cached: int, restore_s: float) -> float:
            return restore_s + (cost(n - cached, cached) if cost is not None else (n - cached) * 1e-3)

        best, best_s, which = current, seconds(current, 0.0) if self.snapshots else 0.0, None
        for i, (snap, restore_s) in enumerate(self.snapshots):
            k = reusable_prefix_len(snap, tokens)
            if k > current and seconds(k, restore_s) < best_s:
                best, best_s, which = k, seconds(k, restore_s), i
        if self.after is not None and which is None:
            best = min(best, reusable_prefix_len(self.after, tokens))
        return best, which


def _check_str(value: object, name: str) -> None:
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a str, got {type(value).__name__}")


def _check_pct(instance: object, attribute: attrs.Attribute, value: float) -> None:
    """An error percentage: >= 0, or NaN when nothing was measured (infinity: a near-zero measurement)."""
    if value < 0:
        raise InvalidNumberError(f"{attribute.name} must be >= 0 (or NaN), got {value!r}")


@attrs.frozen
class PrefillSample:
    """One measurement: ``new_tokens`` evaluated after ``cached_tokens``, taking ``seconds``."""

    new_tokens: int = attrs.field(validator=lambda i, a, v: count(v, a.name, minimum=1))
    cached_tokens: int = attrs.field(validator=lambda i, a, v: count(v, a.name, minimum=0))
    seconds: float = attrs.field(converter=real_float, validator=attrs_non_negative)
    source: str = attrs.field(default="calibration", validator=lambda i, a, v: _check_str(v, a.name))

    def to_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


@attrs.frozen
class CostModel:
    """Fitted prefill coefficients. ``prefill_s(n, k)`` is the predicted prefill time in seconds."""

    overhead_s: float = attrs.field(converter=real_float, validator=attrs_non_negative)
    per_token_s: float = attrs.field(converter=real_float, validator=attrs_non_negative)
    depth_s: float = attrs.field(converter=real_float, validator=attrs_non_negative)
    per_batch_s: float = attrs.field(default=0.0, converter=real_float, validator=attrs_non_negative)
    n_batch: int = attrs.field(default=512, validator=lambda i, a, v: count(v, a.name, minimum=1))

    @property
    def name(self) -> str:
        return "batched" if self.per_batch_s > 0 else "design"

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        n = max(int(new_tokens), 0)
        if n == 0:
            return 0.0
        k = max(int(cached_tokens), 0)
        return self.overhead_s + self.per_token_s * n + self.depth_s * (n * k + n * n / 2.0) + self.per_batch_s * math.ceil(n / self.n_batch)

    def max_new_tokens(self, seconds: float, cached_tokens: int = 0, limit: int = 1 << 20) -> int:
        """The most new tokens whose prefill fits in ``seconds`` after ``cached_tokens`` (binary search)."""
        if self.prefill_s(1, cached_tokens) > seconds:
            return 0
        lo, hi = 1, 2
        while hi < limit and self.prefill_s(hi, cached_tokens) <= seconds:
            lo, hi = hi, hi * 2
        return largest_fitting(lambda n: self.prefill_s(n, cached_tokens) <= seconds, lo, min(hi, limit))

    def to_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest ``n`` in ``lo..hi`` with ``fits(n)`` (monotone, ``fits(lo)`` holds): a binary search."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _features(s: PrefillSample, n_batch: int, batched: bool) -> list[float]:
    n, k = s.new_tokens, s.cached_tokens
    return [1.0, float(n), n * k + n * n / 2.0] + ([float(math.ceil(n / n_batch))] if batched else [])


def _nnls_small(rows: Sequence[Sequence[float]], target: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Exact non-negative least squares for a handful of variables: try every active set."""
    A = np.asarray(rows, dtype=float) * np.asarray(weights, dtype=float)[:, None]
    y = np.asarray(target, dtype=float) * np.asarray(weights, dtype=float)
    # scale columns so that tiny depth coefficients are not lost to conditioning
    scale = np.where(np.abs(A).max(axis=0) > 0, np.abs(A).max(axis=0), 1.0)
    As = A / scale
    m = As.shape[1]
    best: tuple[float, list[float]] | None = None
    for r in range(m, 0, -1):
        for subset in itertools.combinations(range(m), r):
            cols = list(subset)
            coef, *_ = np.linalg.lstsq(As[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(m)
            full[cols] = coef
            resid = float(np.sum((As @ full - y) ** 2))
            if best is None or resid < best[0] - 1e-18:
                best = (resid, list(full / scale))
    return [0.0] * m if best is None else best[1]


def probe_noise(rows: Sequence[Sequence[float]], target: Sequence[float], weights: Sequence[float]) -> float:
    """The RMS relative residual of the fit without the prior over its degrees of freedom (:data:`PROBE_NOISE` for none)."""
    free = len(rows) - len(rows[0])
    if free <= 0:
        return PROBE_NOISE
    coef = np.asarray(_nnls_small(rows, target, weights))
    resid = (np.asarray(rows, dtype=float) @ coef - np.asarray(target, dtype=float)) * np.asarray(weights, dtype=float)
    return max(PROBE_NOISE_FLOOR, float(math.sqrt(float(np.sum(resid ** 2)) / free)))


def per_token_rate(samples: Iterable[PrefillSample]) -> float:
    """Seconds per new token over ``samples``: the least-squares proportional rate on relative error."""
    timed = [s for s in samples if s.seconds > 0]
    if not timed:
        raise ValueError("no samples with a positive time")
    return sum(s.new_tokens / s.seconds for s in timed) / sum((s.new_tokens / s.seconds) ** 2 for s in timed)


def fit_cost_model(samples: Iterable[PrefillSample], *, n_batch: int = 512, batched: bool = False,
                   depth_prior_tokens: float | None = None) -> CostModel:
    """Fit a :class:`CostModel` (``batched``: with the per-batch term); ``depth_prior_tokens``: the attention doubling
    length ``D``, added as one weighted observation ``c·D − a = 0``."""
    prior = None if depth_prior_tokens is None else positive_finite(depth_prior_tokens, "depth_prior_tokens")
    data = [s for s in samples if s.seconds > 0]
    if not data:
        raise ValueError("no samples with a positive time to fit")
    rows = [_features(s, n_batch, batched) for s in data]
    target = [s.seconds for s in data]
    weights = [1.0 / s.seconds for s in data]
    if prior is not None:
        # weighted so that a departure of ATTENTION_PRIOR_SPREAD weighs as one probe off by the probes' noise
        noise = probe_noise(rows, target, weights)
        rows.append([0.0, -1.0, prior] + ([0.0] if batched else []))
        target.append(0.0)
        weights.append(noise / ATTENTION_PRIOR_SPREAD / per_token_rate(data))
    coef = _nnls_small(rows, target, weights)
    return CostModel(overhead_s=coef[0], per_token_s=coef[1], depth_s=coef[2], per_batch_s=coef[3] if batched else 0.0, n_batch=n_batch)


@attrs.frozen
class ErrorStats:
    """Absolute percentage errors of predictions against measurements (NaN when none: ``n`` 0)."""

    median_pct: float = attrs.field(converter=real_float, validator=_check_pct)
    p90_pct: float = attrs.field(converter=real_float, validator=_check_pct)
    max_pct: float = attrs.field(converter=real_float, validator=_check_pct)
    n: int = attrs.field(validator=lambda i, a, v: count(v, a.name, minimum=0))

    def to_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated between the closest ranks (as ``statistics.quantiles(method="inclusive")``)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def error_stats(pairs: Iterable[tuple[float, float]]) -> ErrorStats:
    """``pairs`` of (predicted, measured) → median / p90 / max absolute percentage error."""
    errs = [abs(p - m) / m * 100.0 for p, m in pairs if m > 0]
    if not errs:
        return ErrorStats(float("nan"), float("nan"), float("nan"), 0)
    return ErrorStats(statistics.median(errs), quantile(errs, 0.9), max(errs), len(errs))


def heldout_predictions(samples: Sequence[PrefillSample], *, n_batch: int, batched: bool,
                        depth_prior_tokens: float | None = None) -> list[tuple[float, float]]:
    """(predicted, measured) prefill seconds for every sample, each predicted by a fit without its probe (new, cached) —
    leave-one-probe-out; the in-sample fit with fewer than 4 probes. In the order of ``samples``."""
    groups: dict[tuple[int, int], list[PrefillSample]] = {}
    for s in samples:
        groups.setdefault((s.new_tokens, s.cached_tokens), []).append(s)
    fit = functools.partial(fit_cost_model, n_batch=n_batch, batched=batched, depth_prior_tokens=depth_prior_tokens)
    whole = fit(samples) if len(groups) < 4 else None
    fits = {key: whole or fit([s for k, g in groups.items() if k != key for s in g]) for key in groups}
    return [(fits[(s.new_tokens, s.cached_tokens)].prefill_s(s.new_tokens, s.cached_tokens), s.seconds) for s in samples]
