"""The prefill cost model: how long the engine takes to evaluate ``n`` new prompt tokens after ``k`` tokens already in the
KV cache."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np

from trimkit.errors import InvalidInputError, InvalidNumberError, attrs_non_negative, count, positive_finite, real_float

#: how far the architecture's attention prior may be off, as a relative standard deviation of
#: the depth term: a FLOP ratio says nothing of how efficiently an engine runs attention next to
#: the weight matrices (:mod:`trimkit.planning.profile`), so it is trusted to within about half
ATTENTION_PRIOR_SPREAD = 0.5
#: the relative noise of one probe the prior is weighed against is read off the probes (the
#: scatter of a fit without the prior, :func:`probe_noise`); this where they are too few to
#: show it (no more probes than coefficients), and never less than PROBE_NOISE_FLOOR
PROBE_NOISE = 0.1
#: the least relative noise a probe is credited with (a clock's and a cache's jitter, on the
#: quietest host): the probes of a fit that matches them exactly do not overrule the prior alone
PROBE_NOISE_FLOOR = 0.02


def evaluated_tokens(n_tokens: int, cached_tokens: int) -> int:
    """The tokens the engine evaluates for an ``n_tokens`` prompt of which ``cached_tokens`` are in
    its KV cache: at least one, since llama.cpp evaluates the last prompt token even on a full
    cache hit (it needs that token's logits to sample)."""
    return max(n_tokens - cached_tokens, 1)


def reusable_cached_tokens(n_tokens: int, cached_tokens: int) -> int:
    """The part of ``cached_tokens`` an ``n_tokens`` prompt can reuse: never more than
    ``n_tokens - 1`` (see :func:`evaluated_tokens`), never negative."""
    return max(0, min(cached_tokens, n_tokens - 1))


def _tokens_copy(tokens: Iterable[int]) -> Sequence[int]:
    """``tokens`` as a sequence nobody changes: a tuple, or a read-only copy of a numpy array (an
    engine's input ids, which it overwrites as it evaluates)."""
    if isinstance(tokens, tuple):
        return tokens
    if isinstance(tokens, np.ndarray):
        copy = tokens.copy()
        copy.flags.writeable = False
        return copy  # type: ignore[return-value]
    return tuple(tokens)


def _token_tuples(prompts: Iterable[Iterable[int]]) -> tuple[Sequence[int], ...]:
    return tuple(_tokens_copy(p) for p in prompts)


def _snapshot_tuples(snapshots: Iterable[tuple[Iterable[int], float]]) -> tuple[tuple[Sequence[int], float], ...]:
    return tuple((_tokens_copy(tokens), float(restore_s)) for tokens, restore_s in snapshots)


@attrs.frozen(eq=False)
class CacheState:
    """What the engine's KV cache holds, as data a plan reads: planning asks the engine nothing. The caller reads it before
    planning (:meth:`~trimkit.backends.base.Backend.cache_state`)."""

    prompts: tuple[Sequence[int], ...] = attrs.field(default=(), converter=_token_tuples)
    snapshots: tuple[tuple[Sequence[int], float], ...] = attrs.field(default=(), converter=_snapshot_tuples)
    block: int = attrs.field(default=1, validator=lambda _i, _a, v: count(v, "block", minimum=1))
    after: Sequence[int] | None = attrs.field(default=None, converter=attrs.converters.optional(_tokens_copy))

    def cached(self, tokens: Sequence[int], cost: Callable[[int, int], float] | None = None) -> int:
        """How many leading tokens of ``tokens`` the engine reuses (at least one is evaluated):
        the longest prefix shared with a held prompt (in blocks, bounded by ``after``), or a
        snapshot's where restoring it is predicted faster (``cost(new, cached)`` → seconds)."""
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
    """An error percentage: >= 0, or NaN when nothing was measured (infinity is allowed: a
    prediction for a near-zero measurement). Negative would be no error at all."""
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
        return {"new_tokens": self.new_tokens, "cached_tokens": self.cached_tokens, "seconds": self.seconds, "source": self.source}


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
        return (
            self.overhead_s
            + self.per_token_s * n
            + self.depth_s * (n * k + n * n / 2.0)
            + self.per_batch_s * math.ceil(n / self.n_batch)
        )

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
    """The largest ``n`` in ``lo..hi`` with ``fits(n)``, for ``fits`` true up to some point and
    false after it, given that ``fits(lo)`` holds (binary search)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _features(s: PrefillSample, n_batch: int, batched: bool) -> list[float]:
    n, k = s.new_tokens, s.cached_tokens
    row = [1.0, float(n), n * k + n * n / 2.0]
    if batched:
        row.append(float(math.ceil(n / n_batch)))
    return row


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
    if best is None:
        return [0.0] * m
    return best[1]


def probe_noise(rows: Sequence[Sequence[float]], target: Sequence[float], weights: Sequence[float]) -> float:
    """The relative noise of one probe: the root-mean-square relative residual of the fit
    without the prior, over its degrees of freedom; :data:`PROBE_NOISE` when there are none
    (no more probes than coefficients); at least :data:`PROBE_NOISE_FLOOR`."""
    free = len(rows) - len(rows[0])
    if free <= 0:
        return PROBE_NOISE
    coef = np.asarray(_nnls_small(rows, target, weights))
    resid = (np.asarray(rows, dtype=float) @ coef - np.asarray(target, dtype=float)) * np.asarray(weights, dtype=float)
    return max(PROBE_NOISE_FLOOR, float(math.sqrt(float(np.sum(resid ** 2)) / free)))


def per_token_rate(samples: Iterable[PrefillSample]) -> float:
    """Seconds per new token over ``samples`` (those with a positive time): the least-squares
    proportional rate on relative error, overhead and attention included."""
    timed = [s for s in samples if s.seconds > 0]
    if not timed:
        raise ValueError("no samples with a positive time")
    return sum(s.new_tokens / s.seconds for s in timed) / sum((s.new_tokens / s.seconds) ** 2 for s in timed)


def fit_cost_model(samples: Iterable[PrefillSample], *, n_batch: int = 512, batched: bool = False,
                   depth_prior_tokens: float | None = None) -> CostModel:
    """Fit a :class:`CostModel` (``batched`` adds the per-``n_batch``-chunk term).
    ``depth_prior_tokens``: the architecture's attention doubling length (module docstring),
    added as one weighted observation ``c·D − a = 0``; None fits the probes alone."""
    prior = None if depth_prior_tokens is None else positive_finite(depth_prior_tokens, "depth_prior_tokens")
    data = [s for s in samples if s.seconds > 0]
    if not data:
        raise ValueError("no samples with a positive time to fit")
    rows = [_features(s, n_batch, batched) for s in data]
    target = [s.seconds for s in data]
    weights = [1.0 / s.seconds for s in data]
    if prior is not None:
        # (c·D − a) / a₀ is the depth term's relative departure from the prior; weighted so that
        # a departure of ATTENTION_PRIOR_SPREAD weighs as one probe off by the probes' noise
        noise = probe_noise(rows, target, weights)
        rows.append([0.0, -1.0, prior] + ([0.0] if batched else []))
        target.append(0.0)
        weights.append(noise / ATTENTION_PRIOR_SPREAD / per_token_rate(data))
    coef = _nnls_small(rows, target, weights)
    return CostModel(
        overhead_s=coef[0],
        per_token_s=coef[1],
        depth_s=coef[2],
        per_batch_s=coef[3] if batched else 0.0,
        n_batch=n_batch,
    )


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
    """The ``q`` quantile (any ``q`` in 0–1) of ``values`` with linear interpolation between the closest ranks (as
    ``statistics.quantiles(method="inclusive")`` places its cut points, which offers only ``q = i/n``); NaN when empty."""
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
    if len(groups) < 4:
        model = fit_cost_model(samples, n_batch=n_batch, batched=batched, depth_prior_tokens=depth_prior_tokens)
        return [(model.prefill_s(s.new_tokens, s.cached_tokens), s.seconds) for s in samples]
    fits = {}
    for key in groups:
        rest = [s for k, g in groups.items() if k != key for s in g]
        fits[key] = fit_cost_model(rest, n_batch=n_batch, batched=batched, depth_prior_tokens=depth_prior_tokens)
    return [(fits[(s.new_tokens, s.cached_tokens)].prefill_s(s.new_tokens, s.cached_tokens), s.seconds) for s in samples]


def cross_validate(samples: Sequence[PrefillSample], *, n_batch: int, batched: bool, depth_prior_tokens: float | None = None) -> ErrorStats:
    """Leave-one-probe-out error: every probe (new, cached) is predicted by a fit without it."""
    return error_stats(heldout_predictions(samples, n_batch=n_batch, batched=batched, depth_prior_tokens=depth_prior_tokens))
