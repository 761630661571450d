"""How much calibration fits in a time budget: the probe schedule, sized to the host's speed.

A fixed schedule in tokens takes a time that grows with the host's slowness and the model's
size (a 7B model on a laptop CPU prefills ~30 tokens/s, a 270M one on a GPU ~10,000), so
calibration schedules in **seconds** instead (docs/design.md, §2 "Calibration in bounded time").
Everything here is pure — no engine, no clock — so :func:`trimkit.calibration.calibrate` can be
tested on a fake host of any speed:

- a :class:`Mode` (``micro`` / ``quick`` / ``full``) is a *shape*: which cold lengths sit below
  the top one, how often each is repeated, which depth probes follow it, and the largest top;
- :func:`schedule` is that shape at one top length ``L``; :func:`calibration_probes` is the
  shape with unlimited time;
- :class:`CostPredictor` predicts the wall time of a probe from the ones measured so far,
  conservatively (a measured rate, with an allowance for attention growing with context beyond
  the context probed so far), and learns how much slower than predicted the host runs;
- :func:`choose_top` picks the largest ``L`` whose whole remaining schedule is predicted to fit
  in :data:`PLAN_SHARE` of the time left; :func:`fits` is the check before every single step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import attrs

from trimkit.errors import ContextTooSmallError, InvalidInputError
from trimkit.planning.costs import CostModel, PrefillSample, fit_cost_model
from trimkit.profile import CALIBRATION_MODES

__all__ = ["MICRO_BUDGET_S", "QUICK_BUDGET_S", "FULL_BUDGET_S", "MIN_N_CTX", "ATTENTION_PRIOR_TOKENS",
           "ATTENTION_PRIOR_MAX_FACTOR", "attention_doubling_tokens", "FIRST_PROBE_TOKENS", "MIN_SAMPLES", "MODES", "Mode",
           "Probe", "CostPredictor", "get_mode", "mode_for_budget", "context_cap", "top_limit", "top_candidates", "cold_lengths",
           "repeats", "depth_lengths", "schedule", "calibration_probes", "missing", "remaining_cost", "choose_top", "fits",
           "decode_tokens", "first_token_cost_s", "DECODE_PROMPT_TOKENS", "MIN_DECODE_POINT_STEPS"]

#: default wall-time budgets of the three modes, seconds (the whole calibrate() call)
MICRO_BUDGET_S = 3.0
QUICK_BUDGET_S = 10.0
FULL_BUDGET_S = 30.0

#: the smallest context calibration can work in (a 64-token top with a depth probe after it)
MIN_N_CTX = 128
#: no probe reaches past this share of n_ctx (new + cached tokens): room for the generated token
CONTEXT_SHARE = 0.9
#: the cold top stays under this share of the usable context, leaving the rest to depth probes
TOP_SHARE = 0.6
#: the shortest probe: below it a probe measures the engine's fixed cost only
MIN_PROBE_TOKENS = 16
#: the first probe, cold, right after the warm-up: it measures the host's speed. Short enough
#: to be cheap on any host, long enough that the per-token cost is not lost in the fixed one.
FIRST_PROBE_TOKENS = 32
#: the cost model has three coefficients: fewer samples cannot fit it
MIN_SAMPLES = 3
#: the whole remaining schedule must be predicted to fit in this share of the time left; the
#: rest absorbs what the predictions miss (a shared host's noise, a busier moment)
PLAN_SHARE = 0.7
#: a single step runs only if this many times its predicted wall time fits in the time left
STEP_SAFETY = 1.25
#: the attention allowance: beyond the context probed so far, the per-token cost is assumed to
#: grow by its own size every this many tokens of context. A 100M–300M-parameter model on a CPU
#: spends as much per token on attention as on its weights somewhere between ~500 and a few
#: thousand tokens of context (larger models later); 512 assumes the worst of that range, so a
#: prediction beyond what was measured errs long, never short. Within the probed context the
#: fitted depth term is used instead.
ATTENTION_PRIOR_TOKENS = 512
#: once depth probes measured the attention term, the allowance follows it (twice as steep as
#: measured), but never assumes attention flatter than doubling the per-token cost every this
#: many times :data:`ATTENTION_PRIOR_TOKENS` of context (large models sit beyond it: for them the
#: allowance still errs long; a probe that would not fit is skipped, never overrun)
ATTENTION_PRIOR_MAX_FACTOR = 4
#: decode is measured over at most this share of the budget (it is only reported and checked)
DECODE_SHARE = 0.1
#: before decode is measured, a decode step is assumed to cost as much as prefilling this many
#: tokens (on CPUs a step costs about 5–30 prefill tokens; on GPUs more, but everything is fast)
DECODE_STEP_PRIOR_TOKENS = 32
#: the prompt a decode measurement prefills first (the in-process probe uses 16, a server 64)
DECODE_PROMPT_TOKENS = 64
#: a decode point (decode speed at one context, :mod:`trimkit.decode_model`) is the median of at
#: least this many timed steps: one or two single steps on a shared host are mostly noise
MIN_DECODE_POINT_STEPS = 3
#: the first-token overhead is measured (three short chat requests) only when that is predicted
#: to take at most this share of the budget; otherwise it is estimated (see calibrate)
FIRST_TOKEN_SHARE = 0.25
#: what measuring the first-token overhead takes: this many chat requests ...
FIRST_TOKEN_REQUESTS = 3
#: ... of about this many prompt tokens (a short message and the chat template) and 2 output tokens
FIRST_TOKEN_PROMPT_TOKENS = 64

#: the top lengths a schedule can have (steps of 1.5 and 1.33: a budget is used within ~25 %)
TOP_GRID = (48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


@attrs.frozen
class Probe:
    """One calibration measurement to take: ``new_tokens`` after ``cached_tokens``, ``repeats`` times."""

    new_tokens: int
    cached_tokens: int = 0
    repeats: int = 1


@attrs.frozen
class Mode:
    """The shape of a calibration; its size comes from the time budget.

    ``ladder``: the cold lengths used below the top one. ``repeat_rules``: ``(divisor,
    repeats)`` — a cold length at most ``top / divisor`` is measured ``repeats`` times (short
    probes are cheap and noisy), first rule that matches; the top is measured once.
    ``depth_shares``: the depth probes, as shares of the top, measured after it (the top's
    tokens cached). ``max_top``: the longest cold probe however much time there is.
    ``max_decode_tokens``: the most steps decode speed is timed over. ``decode_point_steps``:
    the steps timed one by one at each context of the decode-vs-context line (their median).
    """

    name: str
    budget_s: float
    max_top: int
    ladder: tuple[int, ...]
    repeat_rules: tuple[tuple[int, int], ...]
    depth_shares: tuple[float, ...]
    max_decode_tokens: int
    decode_point_steps: int = 8


MODES: Mapping[str, Mode] = {
    # serve after ~3 s (trimkit.wrap without a stored profile): a provisional profile
    "micro": Mode("micro", MICRO_BUDGET_S, 1024, (32, 128, 512), (), (0.5,), 8, 4),
    "quick": Mode("quick", QUICK_BUDGET_S, 2048, (32, 128, 512), ((8, 2),), (0.125, 0.5), 16),
    # reach before repeats: a prompt longer than the longest probe is extrapolated (attention
    # grows with context, steeply on some models), while a repeat only narrows noise that the
    # live drift correction and the learned margin absorb anyway
    "full": Mode("full", FULL_BUDGET_S, 4096, (16, 32, 64, 128, 256, 512, 1024, 2048), ((8, 2),), (0.125, 0.5), 32),
}
if tuple(MODES) != CALIBRATION_MODES:  # pragma: no cover - the profile's schema names the modes
    raise ImportError("calibration modes and the profile's CALIBRATION_MODES disagree")


def get_mode(name: str) -> Mode:
    if not isinstance(name, str) or name not in MODES:
        raise InvalidInputError(f"mode must be one of {', '.join(map(repr, MODES))}, got {name!r}")
    return MODES[name]


def mode_for_budget(budget_s: float) -> str:
    """The most thorough mode whose default budget fits in ``budget_s`` (micro below them all)."""
    chosen = "micro"
    for name, mode in MODES.items():
        if mode.budget_s <= budget_s:
            chosen = name
    return chosen


def context_cap(n_ctx: int) -> int:
    """The most tokens (new + cached) any probe may span in a context of ``n_ctx``."""
    if n_ctx < MIN_N_CTX:
        raise ContextTooSmallError(f"n_ctx={n_ctx} is too small to calibrate (need at least {MIN_N_CTX} tokens)")
    return int(n_ctx * CONTEXT_SHARE)


def top_limit(mode: Mode, n_ctx: int) -> int:
    return min(mode.max_top, int(context_cap(n_ctx) * TOP_SHARE))


def top_candidates(mode: Mode, n_ctx: int) -> list[int]:
    """The top lengths ``mode`` may use in ``n_ctx``, shortest first."""
    limit = top_limit(mode, n_ctx)
    return [t for t in TOP_GRID if t <= limit]


def cold_lengths(mode: Mode, top: int) -> list[int]:
    """The cold probe lengths of a schedule with top ``top``, ascending (the top last)."""
    return [n for n in mode.ladder if n < top] + [top]


def repeats(mode: Mode, n: int, top: int) -> int:
    if n >= top:
        return 1
    for divisor, count in mode.repeat_rules:
        if n * divisor <= top:
            return count
    return 1


def depth_lengths(mode: Mode, top: int, n_ctx: int) -> list[int]:
    """New-token counts of the depth probes after ``top`` cached tokens, ascending and distinct;
    each at least :data:`MIN_PROBE_TOKENS` and within :func:`context_cap` (shrunk to fit; none
    when there is no room)."""
    room = context_cap(n_ctx) - top
    out: list[int] = []
    for share in mode.depth_shares:
        n = min(max(MIN_PROBE_TOKENS, round(share * top)), room)
        if n >= MIN_PROBE_TOKENS and n not in out:
            out.append(n)
    return sorted(out)


def schedule(mode: Mode, top: int, n_ctx: int) -> list[Probe]:
    """The probes of ``mode`` with cold top ``top``: cold lengths (with repeats), then depth probes."""
    cold = [Probe(n, 0, repeats(mode, n, top)) for n in cold_lengths(mode, top)]
    return cold + [Probe(n, top, 1) for n in depth_lengths(mode, top, n_ctx)]


def calibration_probes(n_ctx: int, *, quick: bool = False, mode: str | None = None) -> list[Probe]:
    """The probe schedule of ``mode`` (default ``quick``/``full`` from ``quick``) in a context of
    ``n_ctx`` tokens with unlimited time: its largest top. A bounded calibration takes a
    prefix of it sized to the host (:func:`choose_top`)."""
    m = get_mode(mode or ("quick" if quick else "full"))
    candidates = top_candidates(m, n_ctx)
    return schedule(m, candidates[-1], n_ctx)


def missing(probes: Sequence[Probe], counts: Mapping[tuple[int, int], int]) -> list[Probe]:
    """``probes`` less what ``counts`` (measurements per (new, cached)) already holds."""
    out = []
    for p in probes:
        left = p.repeats - counts.get((p.new_tokens, p.cached_tokens), 0)
        if left > 0:
            out.append(Probe(p.new_tokens, p.cached_tokens, left))
    return out


def _position_weight(n: int, k: int, doubling_tokens: float = ATTENTION_PRIOR_TOKENS) -> float:
    """Σ over the positions p = k … k+n-1 of (1 + p / doubling_tokens)."""
    return n * (1.0 + (k + n / 2.0) / doubling_tokens)


def attention_doubling_tokens(fit: CostModel | None, probed_context: int) -> float:
    """The context over which the attention allowance assumes the per-token cost doubles.

    :data:`ATTENTION_PRIOR_TOKENS` until the depth term was measured; then half the doubling
    length the fitted model shows (``per_token_s / depth_s``): beyond what was probed,
    attention is assumed twice as steep as measured — still erring long, but by a factor the
    host and model chose, not the worst case of every small model — and never taken as flatter
    than :data:`ATTENTION_PRIOR_MAX_FACTOR` times the prior (a depth term lost in noise would
    otherwise look free). Only a fit whose probes reached at least the prior's own context
    counts, so a handful of short probes cannot vouch for long ones."""
    if fit is None or probed_context < ATTENTION_PRIOR_TOKENS or fit.per_token_s <= 0:
        return float(ATTENTION_PRIOR_TOKENS)
    measured = fit.per_token_s / fit.depth_s if fit.depth_s > 0 else math.inf
    return min(max(ATTENTION_PRIOR_TOKENS, measured / 2.0), ATTENTION_PRIOR_MAX_FACTOR * ATTENTION_PRIOR_TOKENS)


class CostPredictor:
    """Predicts a probe's wall time on this host from the probes measured so far.

    The engine time of ``n`` new tokens after ``k`` cached is the larger of (a) the cost model
    fitted on the samples so far (from :data:`MIN_SAMPLES` on) and (b) the rate of the sample
    spanning the most context, scaled by the attention allowance
    (:func:`attention_doubling_tokens`: :data:`ATTENTION_PRIOR_TOKENS` until depth was
    measured, then twice the measured steepness). (b) errs long wherever (a) would extrapolate; inside the
    probed range (a) is the better guess and is usually the larger. The wall time adds the
    per-call cost seen around probes (a server's HTTP round trips) and is multiplied by how much
    slower than predicted the last steps ran (a host that got busier) — never by less than 1.
    """

    def __init__(self, *, n_batch: int = 512) -> None:
        self.n_batch = n_batch
        self.samples: list[PrefillSample] = []
        self.call_overheads: list[float] = []
        self.ratios: list[float] = []
        self.decode_step_s: float | None = None
        self._fit: CostModel | None = None

    # -- learning -------------------------------------------------------------------------------
    def observe(self, new_tokens: int, cached_tokens: int, engine_s: float, wall_s: float, predicted_wall_s: float | None = None,
                *, call_overhead: bool = True) -> None:
        """One probe: its engine time, the wall time of the call, and what was predicted for it.
        ``call_overhead=False``: the call did more than its probe (a server depth probe sends
        its prefix first), so its wall time says nothing about the per-call cost."""
        self.samples.append(PrefillSample(new_tokens, cached_tokens, max(engine_s, 0.0)))
        if call_overhead:
            self.call_overheads.append(max(wall_s - engine_s, 0.0))
        self.observe_ratio(wall_s, predicted_wall_s)
        distinct = {(s.new_tokens, s.cached_tokens) for s in self.samples if s.seconds > 0}
        if len(self.samples) >= MIN_SAMPLES and len(distinct) >= 2:
            self._fit = fit_cost_model(self.samples, n_batch=self.n_batch)

    def observe_ratio(self, wall_s: float, predicted_wall_s: float | None) -> None:
        """How a step's wall time compared with its prediction (any step, probes or not)."""
        if predicted_wall_s and predicted_wall_s > 0:
            self.ratios.append(wall_s / predicted_wall_s)

    def observe_decode(self, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            self.decode_step_s = 1.0 / tokens_per_s

    @property
    def slowness(self) -> float:
        """How much slower than predicted the slower of the last two steps ran, at least 1: a
        host that just got busier is assumed to stay so (a lone spike costs one skipped probe,
        a missed slowdown the budget)."""
        return max([1.0, *self.ratios[-2:]])

    @property
    def call_overhead_s(self) -> float:
        return statistics.median(self.call_overheads) if self.call_overheads else 0.0

    # -- predicting -----------------------------------------------------------------------------
    def engine_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted engine (prefill) seconds of ``new_tokens`` after ``cached_tokens``."""
        if not self.samples:
            raise InvalidInputError("nothing measured yet: the first probe comes before any prediction")
        if new_tokens <= 0:
            return 0.0
        top_ctx = max(s.new_tokens + s.cached_tokens for s in self.samples)
        doubling = attention_doubling_tokens(self._fit, top_ctx)
        rate = max(s.seconds / _position_weight(s.new_tokens, s.cached_tokens, doubling)
                   for s in self.samples if s.new_tokens + s.cached_tokens == top_ctx)
        prior = rate * _position_weight(new_tokens, cached_tokens, doubling)
        fitted = self._fit.prefill_s(new_tokens, cached_tokens) if self._fit is not None else 0.0
        return max(prior, fitted)

    def wall_s(self, new_tokens: int, cached_tokens: int = 0, *, prefix_tokens: int = 0, extra_call: bool = False) -> float:
        """Predicted wall seconds of ``measure_prefill(new_tokens, cached_tokens)`` when the
        last ``prefix_tokens`` of the prefix are not cached and are prefilled first (in process:
        what the engine's context lacks; a server: the whole prefix, in a call of its own,
        ``extra_call``)."""
        engine = self.engine_s(new_tokens, cached_tokens)
        if prefix_tokens > 0:
            engine += self.engine_s(prefix_tokens, max(cached_tokens - prefix_tokens, 0))
        calls = 2 if extra_call else 1
        return engine * self.slowness + calls * self.call_overhead_s

    def step_s(self) -> float:
        """One decode step: measured, else :data:`DECODE_STEP_PRIOR_TOKENS` prefill tokens."""
        if self.decode_step_s is not None:
            return self.decode_step_s
        return self.engine_s(DECODE_STEP_PRIOR_TOKENS, 0)

    def decode_wall_s(self, n_tokens: int) -> float:
        return (self.engine_s(DECODE_PROMPT_TOKENS, 0) + n_tokens * self.step_s()) * self.slowness + self.call_overhead_s

    def decode_step_wall_s(self, context_tokens: int) -> float:
        """Predicted wall seconds of one decode step timed on its own after ``context_tokens``
        cached tokens (a one-token evaluation: the engine holds the context already). Errs long:
        the measured step, grown by the attention allowance for the context
        (:data:`ATTENTION_PRIOR_TOKENS`), plus the per-call cost."""
        grown = self.step_s() * (1.0 + max(context_tokens, 0) / ATTENTION_PRIOR_TOKENS)
        return grown * self.slowness + self.call_overhead_s


def remaining_cost(mode: Mode, top: int, n_ctx: int, predictor: CostPredictor, counts: Mapping[tuple[int, int], int],
                   *, resend_prefix: bool = False) -> float:
    """Predicted wall seconds of what the schedule with top ``top`` still lacks (depth probes
    right after the top, so in process their prefix is cached; ``resend_prefix``: a server's
    depth probe prefills its prefix again)."""
    total = 0.0
    for p in missing(schedule(mode, top, n_ctx), counts):
        resend = resend_prefix and p.cached_tokens > 0
        total += p.repeats * predictor.wall_s(p.new_tokens, p.cached_tokens, prefix_tokens=p.cached_tokens if resend else 0, extra_call=resend)
    return total


def choose_top(mode: Mode, n_ctx: int, predictor: CostPredictor, counts: Mapping[tuple[int, int], int], time_left_s: float,
               *, resend_prefix: bool = False) -> int | None:
    """The largest top whose remaining schedule is predicted to fit in :data:`PLAN_SHARE` of
    ``time_left_s``; None when not even the smallest does."""
    best = None
    for top in top_candidates(mode, n_ctx):
        if remaining_cost(mode, top, n_ctx, predictor, counts, resend_prefix=resend_prefix) <= PLAN_SHARE * time_left_s:
            best = top
    return best


def fits(predicted_s: float, time_left_s: float) -> bool:
    """Whether a step predicted to take ``predicted_s`` may start with ``time_left_s`` left."""
    return predicted_s * STEP_SAFETY <= time_left_s


def decode_tokens(mode: Mode, budget_s: float, predictor: CostPredictor, time_left_s: float) -> int:
    """How many tokens to time decode over: as many as :data:`DECODE_SHARE` of the budget
    affords at the predicted step cost, at most the mode's maximum, fewer when the time left is
    short (0 when not even one step fits)."""
    step = predictor.step_s()
    n = min(int(DECODE_SHARE * budget_s / step), mode.max_decode_tokens) if step > 0 else mode.max_decode_tokens
    while n > 0 and not fits(predictor.decode_wall_s(n), time_left_s):
        n -= 1
    return n


def first_token_cost_s(predictor: CostPredictor) -> float:
    """Predicted wall seconds of measuring the first-token overhead (three short chat requests)."""
    one = predictor.engine_s(FIRST_TOKEN_PROMPT_TOKENS, 0) + 2 * predictor.step_s()
    return FIRST_TOKEN_REQUESTS * (one * predictor.slowness + predictor.call_overhead_s)
