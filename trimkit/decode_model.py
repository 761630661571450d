"""Decode speed as a function of context: the time of one generated token grows with the KV cache.

Each decode step reads the model's weights *and* the KV cache of every token before it. On a
large model the weights dominate and the speed barely depends on the prompt; on a small one (a
100M–300M-parameter model on a CPU) the cache of a few thousand tokens is a large share of what
is read, and the stream slows visibly as the context grows. The model here is a line:

    t(c) = base_s + per_context_s · c          (seconds per generated token)

where ``c`` is the number of tokens in the cache before the step. It is fitted on measured
points (:class:`DecodePoint`: calibration's decode steps at a short and at a long context, and
the streams of served requests), by least squares on **relative** error, with
``per_context_s ≥ 0``. With points at a single context the slope is unknown and the speed is
taken as flat (:attr:`DecodeModel.note` says so). The latest served requests also set the
*level*: the older points are scaled so that the line meets those requests (median ratio 1), so
a host that got busier is followed while the shape still comes from every context measured.

A request of ``P`` prompt tokens that generates ``N`` tokens times ``N − 1`` decode steps (the
first token belongs to the prefill), evaluating the tokens at positions ``P … P + N − 2``: its
mean context is ``P + (N − 2) / 2`` (:func:`mean_context`), and its measured tokens/s is
``1 / t(mean context)``. Pure: no engine, no clock (docs/design.md, §2).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidInputError
from trimkit.validation import count, non_negative_finite, positive_finite

__all__ = ["DecodePoint", "DecodeModel", "fit_decode", "mean_context", "DECODE_SOURCES", "LEVEL_WINDOW", "FLAT_NOTE", "WITHIN_NOISE_NOTE"]

#: where a point comes from: calibration's decode steps, or a served request's stream
DECODE_SOURCES = ("calibration", "live")
#: the level of the line is the median ratio measured / predicted over this many latest live points
LEVEL_WINDOW = 5
#: the level correction is clipped to this range (as the prefill drift is: one absurd stream moves nothing far)
LEVEL_CLIP = (0.2, 5.0)
#: what a model fitted on a single context says about itself
FLAT_NOTE = ("decode measured at one context length only: how it slows as the context grows is not known yet "
             "(predicted flat until served requests at other lengths measure it)")
#: what a model says whose measured slowdown is within the noise of its measurements
WITHIN_NOISE_NOTE = "no slowdown measurable over the contexts measured: assumed flat beyond them"
#: the standard error of the median of n samples, per median absolute deviation, times √n:
#: 1.4826 (MAD → standard deviation, normal) × 1.2533 (the median's efficiency)
MEDIAN_SE_PER_MAD = 1.858
#: a slope is used only when it exceeds this many standard errors (about 95 % one-sided)
SLOPE_SIGNIFICANCE = 2.0


def mean_context(prompt_tokens: int, output_tokens: int = 0) -> float:
    """The mean number of cached tokens over the decode steps of a request of ``prompt_tokens``
    that generates ``output_tokens``: ``prompt + (output − 2) / 2`` (its ``output − 1`` steps
    evaluate positions ``prompt … prompt + output − 2``); ``prompt_tokens`` for fewer than 2."""
    return float(prompt_tokens) + max(int(output_tokens) - 2, 0) / 2.0


def _context(value: Any) -> float:
    return non_negative_finite(value, "context_tokens")


def _source(instance: Any, attribute: Any, value: Any) -> None:
    if value not in DECODE_SOURCES:
        raise InvalidInputError(f"source must be one of {', '.join(DECODE_SOURCES)}, got {value!r}")


@attrs.frozen
class DecodePoint:
    """One measured decode speed: ``tokens_per_s`` over ``steps`` decode steps whose mean
    context (tokens in the KV cache before each step) was ``context_tokens``. ``spread_pct``:
    how much the single steps varied around their median (median absolute deviation, % of the
    median; None when the steps were not timed one by one)."""

    context_tokens: float = attrs.field(converter=_context)
    tokens_per_s: float = attrs.field(converter=lambda v: positive_finite(v, "tokens_per_s"))
    steps: int = attrs.field(default=1, converter=lambda v: count(v, "steps", minimum=1))
    source: str = attrs.field(default="calibration", validator=_source)
    spread_pct: float | None = attrs.field(default=None, converter=lambda v: None if v is None else non_negative_finite(v, "spread_pct"))

    @classmethod
    def of_steps(cls, context_tokens: float, step_seconds: Sequence[float], source: str = "calibration") -> DecodePoint:
        """The point of single steps timed one by one at ``context_tokens``: their median and spread."""
        times = [t for t in step_seconds if t > 0 and math.isfinite(t)]
        if not times:
            raise InvalidInputError("no positive, finite step time to make a decode point of")
        mid = statistics.median(times)
        spread = statistics.median(abs(t - mid) for t in times) / mid * 100.0
        return cls(context_tokens, 1.0 / mid, len(times), source, spread)

    @property
    def step_s(self) -> float:
        return 1.0 / self.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"context_tokens": self.context_tokens, "tokens_per_s": self.tokens_per_s, "steps": self.steps, "source": self.source,
                "spread_pct": self.spread_pct}


@attrs.frozen
class DecodeModel:
    """Seconds per generated token as a line in the context: ``base_s + per_context_s · c``.

    ``context_range`` is the (shortest, longest) mean context measured; ``note`` is
    :data:`FLAT_NOTE` when every point had the same context (the slope could not be measured),
    :data:`WITHIN_NOISE_NOTE` when the slowdown measured was within the measurements' noise,
    else empty (a slope fitted below 0 is clamped to a flat line: measured, not assumed).
    ``noise_pct``: how much a decode measurement varies on this host, % (the larger of the
    steps' median spread within calibration's points and the median deviation of served
    requests from the line, once there are :data:`LEVEL_WINDOW`); None when unknown."""

    base_s: float
    per_context_s: float = 0.0
    context_range: tuple[float, float] = (0.0, 0.0)
    points: int = 1
    note: str = ""
    noise_pct: float | None = None

    @property
    def context_dependent(self) -> bool:
        """True when the fitted speed falls with context (a positive slope was measured)."""
        return self.per_context_s > 0

    def step_s(self, context_tokens: float) -> float:
        """Seconds of one decode step with ``context_tokens`` tokens already in the cache."""
        return self.base_s + self.per_context_s * max(float(context_tokens), 0.0)

    def tokens_per_s_at(self, context_tokens: int, output_tokens: int = 0) -> float:
        """Predicted decode speed of a request of ``context_tokens`` prompt tokens (with
        ``output_tokens`` > 1: averaged over its steps, as a measured stream is)."""
        return 1.0 / self.step_s(mean_context(context_tokens, output_tokens))


def _weighted_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares of ``y = a + b·x`` on relative error (weights 1/y²); None when singular."""
    ws = [1.0 / (y * y) for y in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    if sxx <= 0:
        return None
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / sxx
    return my - b * mx, b


def _flat(ys: list[float]) -> float:
    """The constant nearest every ``y`` in relative error: Σ(1/y) / Σ(1/y²)."""
    return sum(1.0 / y for y in ys) / sum(1.0 / (y * y) for y in ys)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(base, slope)`` of the relative-error line through the points, flat (slope 0) when
    the points share one context, when the slope comes out below 0 (a decode step never gets
    cheaper with more context: noise) or when the line reaches 0 s at no context (wild noise)."""
    line = _weighted_line(xs, ys) if len(set(xs)) > 1 else None
    if line is None or line[1] < 0 or line[0] <= 0:
        return _flat(ys), 0.0
    return line


def _slope_within_noise(points: list[DecodePoint], slope: float) -> bool:
    """True when ``slope`` (s per token of context, > 0) is smaller than :data:`SLOPE_SIGNIFICANCE`
    standard errors, the errors known from the points' own step spreads (each point's median of
    ``steps`` single steps: relative standard error ``MEDIAN_SE_PER_MAD · spread / √steps``). A
    slope over a short span of context, on a noisy host, is mostly noise, and extrapolated far it
    would predict a slowdown no measurement showed. False (significant) when a point's spread is
    unknown (served requests: many steps each)."""
    if any(p.spread_pct is None for p in points):
        return False
    ws = []
    for p in points:
        assert p.spread_pct is not None  # checked above
        sigma = max(MEDIAN_SE_PER_MAD * p.spread_pct / 100.0 / math.sqrt(p.steps), 1e-9) * p.step_s
        ws.append(1.0 / (sigma * sigma))
    mx = sum(w * p.context_tokens for w, p in zip(ws, points, strict=True)) / sum(ws)
    sxx = sum(w * (p.context_tokens - mx) ** 2 for w, p in zip(ws, points, strict=True))
    return sxx <= 0 or slope < SLOPE_SIGNIFICANCE / math.sqrt(sxx)


def _clip(level: float) -> float:
    return min(max(level, LEVEL_CLIP[0]), LEVEL_CLIP[1])


def fit_decode(points: Iterable[DecodePoint], *, level_window: int = LEVEL_WINDOW) -> DecodeModel | None:
    """The decode line through ``points`` (calibration first, then live points oldest first);
    None for no points.

    The ``level_window`` latest live points say how fast the host decodes *now*; every other
    point (calibration's, older requests') says how the speed falls with context, measured
    when the host may have run at another speed. So the older points are scaled by a common
    level ``λ`` and the line is fitted on all of them (relative error, slope ≥ 0, see
    :func:`_line`), with ``λ`` chosen so that the latest points' median ratio measured /
    predicted is 1 (clipped to :data:`LEVEL_CLIP`): a host that got busier moves the whole line,
    while its shape still comes from every context measured. A slope smaller than its own
    standard error allows (:func:`_slope_within_noise`) is not extrapolated: the line is flat,
    and says so (:data:`WITHIN_NOISE_NOTE`)."""
    pts = [p for p in points if isinstance(p, DecodePoint)]
    if not pts:
        return None
    xs = [p.context_tokens for p in pts]
    ys = [p.step_s for p in pts]
    live = [i for i, p in enumerate(pts) if p.source == "live"]
    latest = set(live[-level_window:]) if level_window > 0 else set()
    level = 1.0
    for _ in range(20):  # converges in a few rounds: each moves λ by the latest points' median ratio
        base, slope = _line(xs, [y if i in latest else y * level for i, y in enumerate(ys)])
        if not latest:
            break
        ratio = statistics.median(ys[i] / (base + slope * xs[i]) for i in latest)
        if abs(ratio - 1.0) < 1e-6 or len(latest) == len(pts) or _clip(level * ratio) == level:
            base, slope = base * ratio, slope * ratio  # what is left of the latest points' level
            break
        level = _clip(level * ratio)
    note = FLAT_NOTE if len(set(xs)) == 1 else ""
    if slope > 0 and _slope_within_noise(pts, slope):  # only calibration's points: no level was applied
        base, slope, note = _flat(ys), 0.0, WITHIN_NOISE_NOTE
    if not (math.isfinite(base) and base > 0):  # pragma: no cover - every y is positive and finite
        return None
    return DecodeModel(base_s=base, per_context_s=slope, context_range=(min(xs), max(xs)), points=len(pts), note=note,
                       noise_pct=_noise_pct(pts, base, slope, level_window))


def _noise_pct(points: list[DecodePoint], base: float, slope: float, window: int) -> float | None:
    """The larger of the median step spread of the points timed step by step and, over the
    latest ``window`` live points (when there are that many), their median |deviation| from the line."""
    spreads = [p.spread_pct for p in points if p.spread_pct is not None]
    live = [p for p in points if p.source == "live"][-window:] if window > 0 else []
    found = [statistics.median(spreads)] if spreads else []
    if live and len(live) >= window:
        found.append(statistics.median(abs(p.step_s / (base + slope * p.context_tokens) - 1.0) * 100.0 for p in live))
    return max(found) if found else None
