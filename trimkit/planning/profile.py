"""Calibration profiles: what prefill and decode cost on this host, for one model and one set of settings."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attr
import attrs
import numpy as np

from trimkit.errors import InvalidInputError, InvalidNumberError, ProfileError, attrs_non_negative, count, non_negative_finite, positive_finite, real_float
from trimkit.planning.costs import CostModel, ErrorStats, PrefillSample, evaluated_tokens, largest_fitting

# -- the decode line: decode speed as a function of context ----------------------------------------------

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


def _one_of(choices: tuple[str, ...]) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: the value is one of ``choices``, else InvalidInputError."""
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            raise InvalidInputError(f"{attribute.name} must be one of {', '.join(choices)}, got {value!r}")

    return check


@attrs.frozen
class DecodePoint:
    """One measured decode speed: ``tokens_per_s`` over ``steps`` decode steps whose mean context (tokens in the KV cache
    before each step) was ``context_tokens``. ``spread_pct``: how much the single steps varied around their median
    (median absolute deviation, % of the median; None when the steps were not timed one by one)."""

    context_tokens: float = attrs.field(converter=lambda v: non_negative_finite(v, "context_tokens"))
    tokens_per_s: float = attrs.field(converter=lambda v: positive_finite(v, "tokens_per_s"))
    steps: int = attrs.field(default=1, converter=lambda v: count(v, "steps", minimum=1))
    source: str = attrs.field(default="calibration", validator=_one_of(DECODE_SOURCES))
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
        return attrs.asdict(self)


@attrs.frozen
class DecodeModel:
    """Seconds per generated token as a line in the context: ``base_s + per_context_s · c``; ``note``: :data:`FLAT_NOTE`,
    :data:`WITHIN_NOISE_NOTE` or empty; ``noise_pct``: how much a decode measurement varies on this host."""

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


def _flat(ys: list[float]) -> float:
    """The constant nearest every ``y`` in relative error: Σ(1/y) / Σ(1/y²)."""
    return sum(1.0 / y for y in ys) / sum(1.0 / (y * y) for y in ys)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(base, slope)`` of the least-squares line through the points on relative error (weights 1/y²), flat (slope 0) when
    the points share one context, when the slope comes out below 0 (a decode step never gets cheaper with more context:
    noise) or when the line reaches 0 s at no context (wild noise)."""
    if len(set(xs)) > 1:
        slope, base = np.polyfit(xs, ys, 1, w=[1.0 / y for y in ys])
        if slope >= 0 and base > 0:
            return float(base), float(slope)
    return _flat(ys), 0.0


def _slope_within_noise(points: list[DecodePoint], slope: float) -> bool:
    """True when ``slope`` (s per token of context, > 0) is smaller than :data:`SLOPE_SIGNIFICANCE` standard errors, the
    errors known from the points' own step spreads (each point's median of ``steps`` single steps: relative standard
    error ``MEDIAN_SE_PER_MAD · spread / √steps``)."""
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
    """The decode line ``t(c) = base_s + per_context_s · c`` through ``points`` (calibration's, then live ones oldest first);
    None for none. The older points are scaled by one level (clipped to :data:`LEVEL_CLIP`) so that the ``level_window``
    latest live ones fit: a busier host moves the whole line, its shape comes from every context measured."""
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


# -- the attention prior: what the model's architecture says before anything is measured -----------------

def attention_doubling_prior(*, n_params: int, n_vocab: int, n_embd: int, n_layer: int, n_head: int, head_dim: int,
                             idle_params: float = 0.0) -> float | None:
    """The context length (tokens) over which the per-token prefill cost doubles by the FLOP ratio ``D = P /
    (2·L·H·d_head)`` (docs/design.md §2); None when the numbers do not describe a transformer (any of them not positive,
    or no parameters left outside the vocabulary table)."""
    values = (n_params, n_vocab, n_embd, n_layer, n_head, head_dim)
    if any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values):
        return None
    if isinstance(idle_params, bool) or not isinstance(idle_params, (int, float)) or not (0 <= idle_params < math.inf):
        return None
    per_token = n_params - n_vocab * n_embd - idle_params
    if per_token <= 0:
        return None
    doubling = per_token / (2.0 * n_layer * n_head * head_dim)
    return doubling if math.isfinite(doubling) and doubling > 0 else None


def idle_expert_params(*, n_layer: int, n_embd: int, expert_count: int, expert_used_count: int, expert_ff: int) -> float:
    """The parameters a token of a mixture-of-experts model does not use: of the ``expert_count`` experts per layer (each a
    gated feed-forward block of ``3·n_embd·expert_ff`` parameters), all but ``expert_used_count``."""
    if expert_count < 2 or expert_used_count >= expert_count or min(n_layer, n_embd, expert_used_count, expert_ff) <= 0:
        return 0.0
    return float(n_layer) * (expert_count - expert_used_count) * 3.0 * n_embd * expert_ff


# -- reading a stored profile: the one boundary where untrusted JSON becomes a Profile -------------------


def json_object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where or 'the file'} must be a JSON object, got {type(value).__name__}")
    return value


def checked(make: Callable[..., Any], where: str, **kwargs: Any) -> Any:
    """``make(**kwargs)``, its validation errors as a ProfileError naming ``where``."""
    try:
        return make(**kwargs)
    except InvalidInputError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def _json(kind: str, value: Any, where: str) -> Any:
    """``value`` as a field annotated ``kind`` takes it (its JSON type checked; the class it goes into checks the rest)."""
    if kind.startswith("tuple[") and kind.endswith(", ...]"):
        if not isinstance(value, list):
            raise ProfileError(f"{where} must be a list, got {type(value).__name__}")
        return tuple(_json(kind[6:-6], item, f"{where}[{i}]") for i, item in enumerate(value))
    if kind in _RECORDS:
        return checked(_RECORDS[kind], where, **_fields(_RECORDS[kind], value, where))
    if kind == "tuple[float, float]":
        if not isinstance(value, list) or len(value) != 2:
            raise ProfileError(f"{where} must be a [predicted, measured] pair")
        return (_json("float", value[0], f"{where}[0]"), _json("float", value[1], f"{where}[1]"))
    expected = {"str": str, "bool": bool, "Mapping[str, Any]": dict}.get(kind)
    if expected is not None:
        if not isinstance(value, expected):
            raise ProfileError(f"{where} must be a {expected.__name__}, got {type(value).__name__}")
        return value
    number = {"int": lambda v: count(v, where), "float": real_float, "float | None": real_float}[kind]  # a field of another type: add it
    try:
        return number(value)
    except InvalidInputError as exc:
        raise ProfileError(str(exc) if where in str(exc) else f"{where}: {exc}") from None


def _fields(cls: Any, data: Any, where: str) -> dict[str, Any]:
    """``cls``'s fields read from the JSON object ``data`` by their annotations (a field with a default may be absent or null)."""
    data = json_object(data, where)
    out = {}
    for f in attrs.fields(cls):
        name = f"{where}.{f.name}" if where else f.name
        if data.get(f.name) is not None or f.default is attrs.NOTHING:
            if f.name not in data:
                raise ProfileError(f"{name} is missing")
            out[f.name] = _json(str(f.type), data[f.name], name)
    return out


SCHEMA_VERSION = 1
#: how a profile was calibrated, least thorough first (trimkit._calibration.MODES)
CALIBRATION_MODES = ("micro", "quick", "full")
#: the context of a decode speed stored before decode points were kept (measured after a 16-token prompt)
LEGACY_DECODE_CONTEXT_TOKENS = 16


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


def _pairs(value: Any) -> tuple[tuple[float, float], ...]:
    """(predicted, measured) pairs, seconds >= 0, as a tuple of float 2-tuples (JSON gives lists)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise InvalidNumberError(f"residuals must be a list of (predicted, measured) pairs, got {type(value).__name__}")
    if any(not isinstance(pair, (list, tuple)) or len(pair) != 2 for pair in value):
        raise InvalidNumberError("each residual must be a (predicted, measured) pair")
    return tuple((non_negative_finite(p, "residuals"), non_negative_finite(m, "residuals")) for p, m in value)


def _is(kind: Any) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: ``isinstance(value, kind)``, else InvalidInputError."""
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, kind):
            raise InvalidInputError(f"{attribute.name} must be a {kind.__name__}, got {type(value).__name__}")

    return check


def _finite(instance: Any, attribute: Any, value: Any) -> None:
    if not math.isfinite(value):
        raise InvalidNumberError(f"{attribute.name} must be finite, got {value!r}")


def _legacy_decode_points(profile: Any) -> tuple[DecodePoint, ...]:
    """A profile given no decode points: its decode speed (if any) as one point at a short context."""
    tps = profile.decode_tokens_per_s
    return (DecodePoint(LEGACY_DECODE_CONTEXT_TOKENS, tps),) if tps > 0 and math.isfinite(tps) else ()


def _tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)


def _reach(samples: Sequence[PrefillSample]) -> tuple[int, int]:
    """(most new tokens, deepest context) of ``samples``; (0, 0) for none."""
    ok = [s for s in samples if isinstance(s, PrefillSample)]
    return max((s.new_tokens for s in ok), default=0), max((s.new_tokens + s.cached_tokens for s in ok), default=0)


@attrs.frozen
class Profile:
    """A measured prefill profile. Use :meth:`predict_ttft_s` to predict a request's TTFT."""

    key: ProfileKey = attrs.field(validator=_is(ProfileKey))
    model: CostModel = attrs.field(validator=_is(CostModel))
    first_token_s: float = attrs.field(converter=real_float, validator=attrs_non_negative)
    decode_tokens_per_s: float = attrs.field(converter=real_float, validator=attrs_non_negative)
    samples: tuple[PrefillSample, ...] = attrs.field(converter=tuple, validator=attrs.validators.deep_iterable(_is(PrefillSample)), repr=False)
    error: ErrorStats = attrs.field(validator=_is(ErrorStats))
    alternatives: Mapping[str, Any] = attrs.field(factory=dict, validator=_is(Mapping), repr=False)
    calibration_wall_s: float = attrs.field(default=0.0, converter=real_float, validator=attrs_non_negative)
    created_at: float = attrs.field(default=0.0, converter=real_float, validator=_finite)
    #: predictions multiply by drift and budgets divide by it: 0, negative or NaN would poison both
    drift: float = attrs.field(default=1.0, validator=lambda i, a, v: positive_finite(v, a.name))
    #: calibration's held-out (predicted, measured) prefill seconds: they seed the learned safety margin
    residuals: tuple[tuple[float, float], ...] = attrs.field(default=(), converter=_pairs, repr=False)
    #: how it was calibrated: "micro" (provisional), "quick" or "full"
    mode: str = attrs.field(default="full", validator=_one_of(CALIBRATION_MODES))
    #: the most new tokens and the deepest context (new + cached) probed; by default read off the samples
    probed_new_tokens: int = attrs.field(default=attrs.Factory(lambda self: _reach(self.samples)[0], takes_self=True), validator=lambda i, a, v: count(v, a.name))
    probed_context_tokens: int = attrs.field(default=attrs.Factory(lambda self: _reach(self.samples)[1], takes_self=True), validator=lambda i, a, v: count(v, a.name))
    #: the wall-time budget calibration ran under, seconds (0.0: unknown)
    time_budget_s: float = attrs.field(default=0.0, converter=real_float, validator=attrs_non_negative)
    #: True when the first-token overhead was estimated, not measured
    first_token_estimated: bool = attrs.field(default=False, validator=_is(bool))
    #: measured decode speeds at known contexts (calibration's, then served requests'); default: ``decode_tokens_per_s`` at
    #: :data:`LEGACY_DECODE_CONTEXT_TOKENS`; empty when decode was not measured
    decode_points: tuple[DecodePoint, ...] = attrs.field(default=attrs.Factory(_legacy_decode_points, takes_self=True), converter=_tuple,
                                                         validator=attrs.validators.deep_iterable(_is(DecodePoint)), repr=False)
    #: the architecture's attention doubling length, tokens: the prior of every fit of the samples (0.0: unknown)
    attention_prior_tokens: float = attrs.field(default=0.0, converter=real_float, validator=attrs_non_negative)
    #: first-token overhead per prompt token, cached ones included (tokenizing the prompt), on top of ``first_token_s``
    first_token_per_token_s: float = attrs.field(default=0.0, converter=real_float, validator=attrs_non_negative)

    @property
    def depth_prior_tokens(self) -> float | None:
        """:attr:`attention_prior_tokens` as the fits take it: None when unknown."""
        return self.attention_prior_tokens or None

    @property
    def provisional(self) -> bool:
        """A micro-calibration's profile: a few seconds of probes, planned with a wider margin."""
        return self.mode == "micro"

    def probed_range(self) -> tuple[int, int]:
        """``(most new tokens, deepest context)`` this profile has measured: the recorded range,
        widened by any sample it holds beyond it (a profile refined after it was recorded)."""
        new, ctx = _reach(self.samples)
        return max(self.probed_new_tokens, new), max(self.probed_context_tokens, ctx)

    def extrapolation(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """How far a prediction for ``new_tokens`` after ``cached_tokens`` reaches beyond what was measured: 1.0 inside the
        probed range, else the larger of new tokens / the most new tokens probed and context / the deepest context probed
        (2.0: twice as far). A profile without samples has probed nothing: the ratio is to one token."""
        probed_new, probed_ctx = self.probed_range()
        n = evaluated_tokens(int(new_tokens), 0)
        ctx = n + max(int(cached_tokens), 0)
        return max(1.0, n / max(probed_new, 1), ctx / max(probed_ctx, 1))

    def extrapolated(self, new_tokens: int, cached_tokens: int = 0) -> bool:
        """True when :meth:`extrapolation` is above 1: the prediction leaves the probed range."""
        return self.extrapolation(new_tokens, cached_tokens) > 1.0

    def decode_model(self) -> DecodeModel | None:
        """Seconds per generated token as a function of context, fitted on :attr:`decode_points`
        (:func:`~trimkit.planning.profile.fit_decode`); None when decode was not measured."""
        return _fit_decode(tuple(self.decode_points))

    def decode_tokens_per_s_at(self, context_tokens: int, output_tokens: int = 0) -> float | None:
        """Predicted decode speed (tokens/s) of a request whose prompt is ``context_tokens``
        tokens long (with ``output_tokens`` > 1: averaged over them, as a measured stream is);
        None when the profile has no decode measurement."""
        n = count(context_tokens, "context_tokens")
        out = count(output_tokens, "output_tokens")
        model = self.decode_model()
        return None if model is None else model.tokens_per_s_at(n, out)

    @property
    def decode_noise_pct(self) -> float | None:
        """How much a decode measurement varies on this host, percent (:attr:`DecodeModel.noise_pct`); None when unknown. A
        predicted difference of decode speed smaller than this is within noise."""
        model = self.decode_model()
        return None if model is None else model.noise_pct

    def predict_prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted prefill time for ``new_tokens`` evaluated after ``cached_tokens`` cached ones."""
        return self.model.prefill_s(evaluated_tokens(int(new_tokens), 0), cached_tokens) * self.drift

    def first_token_overhead_s(self, prompt_tokens: int) -> float:
        """The first-token overhead of a request whose whole prompt is ``prompt_tokens`` long."""
        return self.first_token_s + self.first_token_per_token_s * max(int(prompt_tokens), 0)

    def predict_ttft_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted time to first token: prefill of the tokens the engine must evaluate plus the
        per-request cost (:meth:`first_token_overhead_s` of the whole prompt). llama.cpp always
        evaluates at least one token, even on a full hit."""
        prompt = evaluated_tokens(int(new_tokens), 0) + int(cached_tokens)
        return self.predict_prefill_s(new_tokens, cached_tokens) + self.first_token_overhead_s(prompt)

    def max_new_tokens(self, ttft_budget_s: float, cached_tokens: int = 0) -> int:
        """The most new tokens that fit ``ttft_budget_s`` after ``cached_tokens`` cached ones."""
        prefill_budget = (ttft_budget_s - self.first_token_overhead_s(cached_tokens)) / self.drift
        hi = self.model.max_new_tokens(prefill_budget, cached_tokens)
        if self.first_token_per_token_s <= 0 or hi == 0:
            return hi
        # the overhead grows with the new tokens too (0 always "fits": the caller reads it as nothing fits)
        return largest_fitting(lambda n: n == 0 or self.predict_ttft_s(n, cached_tokens) <= ttft_budget_s, 0, hi)

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
            measured = statistics.median_high(times)
            predicted = self.model.prefill_s(n, k)
            rows.append({"new_tokens": n, "cached_tokens": k, "measured_s": measured, "predicted_s": predicted,
                         "error_pct": (predicted - measured) / measured * 100 if measured > 0 else float("nan"),
                         "ms_per_token": measured / n * 1000, "repeats": len(times)})
        return rows

    def to_dict(self) -> dict[str, Any]:
        # "quick": what files before ``mode`` said (older readers check it); ``attr.asdict`` makes every tuple a list
        return {"schema": SCHEMA_VERSION, "quick": self.mode != "full", **attr.asdict(self)}

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """The profile stored as ``data`` (parsed JSON), fully checked: raises :class:`~trimkit.errors.ProfileError` naming
        the first field that is missing, of the wrong type or out of range, and never another exception."""
        data = json_object(data, "")
        schema = data.get("schema")
        if type(schema) is not int or schema != SCHEMA_VERSION:  # not True, not 1.0
            shown = repr(schema) if isinstance(schema, (int, str, type(None))) and len(repr(schema)) < 40 else type(schema).__name__
            raise ProfileError(f"profile schema {shown} is not {SCHEMA_VERSION}")
        if "mode" not in data:  # a file from before ``mode`` (its ``quick`` is not read): calibrated again
            raise ProfileError("mode is missing (a profile stored by an older trimkit)")
        kwargs = _fields(Profile, data, "")
        for n in (1, 1000):
            predicted = kwargs["model"].prefill_s(n, 0)
            if not (predicted > 0 and math.isfinite(predicted)):
                raise ProfileError(f"model predicts {predicted!r} s for a {n}-token prompt (need a finite time > 0)")
        return checked(Profile, "profile", **kwargs)


#: the records a stored profile holds, by the name its fields are annotated with
_RECORDS: dict[str, Any] = {"ProfileKey": ProfileKey, "CostModel": CostModel, "PrefillSample": PrefillSample, "ErrorStats": ErrorStats,
                            "DecodePoint": DecodePoint}


@functools.lru_cache(maxsize=16)
def _fit_decode(points: tuple[DecodePoint, ...]) -> DecodeModel | None:
    """:func:`~trimkit.planning.profile.fit_decode`, memoised by the points: a request asks its
    profile's decode speed several times, and the profile changes only when a request finishes."""
    return fit_decode(points)


