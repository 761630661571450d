"""Calibration: measure what prefill costs on this host within a wall-time budget, fit the cost model and
store the profile (docs/design.md §2). In three parts: the schedule, pure (a :class:`Mode`, :func:`schedule`,
:class:`CostPredictor`, :func:`choose_top`); the run (:class:`CalibrationRun`, :func:`calibrate`); the
profile store (:func:`save_profile`, :func:`load_profile`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import platformdirs

from trimkit.backends.base import Backend, client_kind
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.errors import CalibrationError, ContextTooSmallError, InvalidInputError, ProfileError, budget
from trimkit.planning.costs import CostModel, ErrorStats, PrefillSample, error_stats, fit_cost_model, heldout_predictions, per_token_rate
from trimkit.planning.profile import CALIBRATION_MODES, DecodePoint, Profile, ProfileKey

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
#: the first probe measures the host's speed: cheap on any host, yet the per-token cost shows over the fixed one
FIRST_PROBE_TOKENS = 32
#: the cost model has three coefficients: fewer samples cannot fit it
MIN_SAMPLES = 3
#: the whole remaining schedule must be predicted to fit in this share of the time left (the rest absorbs noise)
PLAN_SHARE = 0.7
#: a single step runs only if this many times its predicted wall time fits in the time left
STEP_SAFETY = 1.25
#: the attention allowance: beyond the context probed, the per-token cost is assumed to double every this many
#: tokens. A 100M–300M model on a CPU gets there between ~500 and a few thousand: 512 errs long, never short.
ATTENTION_PRIOR_TOKENS = 512
#: a measured attention term is never taken flatter than doubling every this many times the prior
ATTENTION_PRIOR_MAX_FACTOR = 4
#: decode is measured over at most this share of the budget (it is only reported and checked)
DECODE_SHARE = 0.1
#: before decode is measured, a step is priced as this many prefill tokens (5–30 on CPUs)
DECODE_STEP_PRIOR_TOKENS = 32
#: the prompt a decode measurement prefills first (the in-process probe uses 16, a server 64)
DECODE_PROMPT_TOKENS = 64
#: a decode point is the median of at least this many timed steps (one or two on a shared host are noise)
MIN_DECODE_POINT_STEPS = 3
#: the first-token overhead is measured only when its requests are predicted within this share of the budget
FIRST_TOKEN_SHARE = 0.25
#: measuring it takes this many chat requests of about this many prompt tokens and 2 output tokens
FIRST_TOKEN_REQUESTS = 3
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
    """The shape of a calibration; its size comes from the time budget. ``repeat_rules``: ``(divisor, repeats)``,
    a cold length at most ``top / divisor`` is measured ``repeats`` times; ``depth_shares``: depth probes after the top."""

    name: str
    budget_s: float
    max_top: int
    ladder: tuple[int, ...]
    repeat_rules: tuple[tuple[int, int], ...]
    depth_shares: tuple[float, ...]
    max_decode_tokens: int
    decode_point_steps: int = 8


MODES: Mapping[str, Mode] = {
    "micro": Mode("micro", MICRO_BUDGET_S, 1024, (32, 128, 512), (), (0.5,), 8, 4),
    "quick": Mode("quick", QUICK_BUDGET_S, 2048, (32, 128, 512), ((8, 2),), (0.125, 0.5), 16),
    # reach before repeats: a prompt beyond the longest probe is extrapolated, while live refits absorb noise anyway
    "full": Mode("full", FULL_BUDGET_S, 4096, (16, 32, 64, 128, 256, 512, 1024, 2048), ((8, 2),), (0.125, 0.5), 32),
}
if tuple(MODES) != CALIBRATION_MODES:  # pragma: no cover
    raise ImportError("calibration modes and the profile's CALIBRATION_MODES disagree")


def get_mode(name: str) -> Mode:
    if not isinstance(name, str) or name not in MODES:
        raise InvalidInputError(f"mode must be one of {', '.join(map(repr, MODES))}, got {name!r}")
    return MODES[name]


def mode_for_budget(budget_s: float) -> str:
    """The most thorough mode whose default budget fits in ``budget_s`` (micro below them all)."""
    return ([name for name, mode in MODES.items() if mode.budget_s <= budget_s] or ["micro"])[-1]


def mode_and_budget(mode: str | None, time_budget_s: float | None, what: str = "time_budget_s") -> tuple[str, float]:
    """The calibration mode and its time budget, each given or derived from the other (neither: full, 30 s)."""
    budget_s = None if time_budget_s is None else budget(time_budget_s, what)
    name = get_mode(mode).name if mode is not None else mode_for_budget(budget_s) if budget_s is not None else "full"
    return name, get_mode(name).budget_s if budget_s is None else budget_s


def context_cap(n_ctx: int) -> int:
    if n_ctx < MIN_N_CTX:
        raise ContextTooSmallError(f"n_ctx={n_ctx} is too small to calibrate (need at least {MIN_N_CTX} tokens)")
    return int(n_ctx * CONTEXT_SHARE)


def top_candidates(mode: Mode, n_ctx: int) -> list[int]:
    """The top lengths ``mode`` may use in ``n_ctx``, shortest first."""
    limit = min(mode.max_top, int(context_cap(n_ctx) * TOP_SHARE))
    return [t for t in TOP_GRID if t <= limit]


def cold_lengths(mode: Mode, top: int) -> list[int]:
    """The cold probe lengths of a schedule with top ``top``, ascending (the top last)."""
    return [n for n in mode.ladder if n < top] + [top]


def repeats(mode: Mode, n: int, top: int) -> int:
    return next((count for divisor, count in mode.repeat_rules if n * divisor <= top), 1) if n < top else 1


def depth_lengths(mode: Mode, top: int, n_ctx: int) -> list[int]:
    """New-token counts of the depth probes after ``top`` cached tokens, shrunk to fit the context."""
    room = context_cap(n_ctx) - top
    return sorted({n for n in (min(max(MIN_PROBE_TOKENS, round(share * top)), room) for share in mode.depth_shares) if n >= MIN_PROBE_TOKENS})


def schedule(mode: Mode, top: int, n_ctx: int) -> list[Probe]:
    """The probes of ``mode`` with cold top ``top``: cold lengths (with repeats), then depth probes."""
    cold = [Probe(n, 0, repeats(mode, n, top)) for n in cold_lengths(mode, top)]
    return cold + [Probe(n, top, 1) for n in depth_lengths(mode, top, n_ctx)]


def calibration_probes(n_ctx: int, *, mode: str = "full") -> list[Probe]:
    """The schedule of ``mode`` with unlimited time: its largest top."""
    m = get_mode(mode)
    return schedule(m, top_candidates(m, n_ctx)[-1], n_ctx)


def missing(probes: Sequence[Probe], counts: Mapping[tuple[int, int], int]) -> list[Probe]:
    done = [counts.get((p.new_tokens, p.cached_tokens), 0) for p in probes]
    return [Probe(p.new_tokens, p.cached_tokens, p.repeats - d) for p, d in zip(probes, done) if d < p.repeats]


def _position_weight(n: int, k: int, doubling_tokens: float = ATTENTION_PRIOR_TOKENS) -> float:
    """Σ over the positions p = k … k+n-1 of (1 + p / doubling_tokens)."""
    return n * (1.0 + (k + n / 2.0) / doubling_tokens)


def attention_doubling_tokens(fit: CostModel | None, probed_context: int) -> float:
    """The context over which the allowance assumes the per-token cost doubles: :data:`ATTENTION_PRIOR_TOKENS`, or once
    probes reached that far, half what the fit shows (twice as steep as measured), within the prior's bounds."""
    if fit is None or probed_context < ATTENTION_PRIOR_TOKENS or fit.per_token_s <= 0:
        return float(ATTENTION_PRIOR_TOKENS)
    measured = fit.per_token_s / fit.depth_s if fit.depth_s > 0 else math.inf
    return min(max(ATTENTION_PRIOR_TOKENS, measured / 2.0), ATTENTION_PRIOR_MAX_FACTOR * ATTENTION_PRIOR_TOKENS)


class CostPredictor:
    """Predicts a probe's wall time from the probes so far: the larger of the fitted cost model and the deepest sample's
    rate grown by the attention allowance, plus the per-call cost, times how much slower than predicted the last steps ran."""

    def __init__(self, *, n_batch: int = 512) -> None:
        self.n_batch = n_batch
        self.samples: list[PrefillSample] = []
        self.call_overheads: list[float] = []
        self.ratios: list[float] = []
        self.decode_step_s: float | None = None
        self._fit: CostModel | None = None

    def observe(self, new_tokens: int, cached_tokens: int, engine_s: float, wall_s: float, predicted_wall_s: float | None = None,
                *, call_overhead: bool = True) -> None:
        """One probe; ``call_overhead=False``: the call did more than its probe (it sent its prefix first)."""
        self.samples.append(PrefillSample(new_tokens, cached_tokens, max(engine_s, 0.0)))
        if call_overhead:
            self.call_overheads.append(max(wall_s - engine_s, 0.0))
        self.observe_ratio(wall_s, predicted_wall_s)
        distinct = {(s.new_tokens, s.cached_tokens) for s in self.samples if s.seconds > 0}
        if len(self.samples) >= MIN_SAMPLES and len(distinct) >= 2:
            self._fit = fit_cost_model(self.samples, n_batch=self.n_batch)

    def observe_ratio(self, wall_s: float, predicted_wall_s: float | None) -> None:
        if predicted_wall_s and predicted_wall_s > 0:
            self.ratios.append(wall_s / predicted_wall_s)

    @property
    def slowness(self) -> float:
        """How much slower than predicted the slower of the last two steps ran, at least 1 (a busier host stays so)."""
        return max([1.0, *self.ratios[-2:]])

    @property
    def call_overhead_s(self) -> float:
        return statistics.median(self.call_overheads) if self.call_overheads else 0.0

    def engine_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
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

    def wall_s(self, new_tokens: int, cached_tokens: int = 0, *, prefix_tokens: int = 0, resend: bool = False) -> float:
        """Predicted wall seconds of a probe whose last ``prefix_tokens`` of prefix are prefilled first (``resend``: a server's,
        which sends its whole prefix first, in a call of its own)."""
        extra_call = resend and cached_tokens > 0
        prefix_tokens = cached_tokens if extra_call else prefix_tokens
        engine = self.engine_s(new_tokens, cached_tokens)
        if prefix_tokens > 0:
            engine += self.engine_s(prefix_tokens, max(cached_tokens - prefix_tokens, 0))
        return engine * self.slowness + (2 if extra_call else 1) * self.call_overhead_s

    def step_s(self) -> float:
        return self.decode_step_s if self.decode_step_s is not None else self.engine_s(DECODE_STEP_PRIOR_TOKENS, 0)

    def decode_wall_s(self, n_tokens: int) -> float:
        return (self.engine_s(DECODE_PROMPT_TOKENS, 0) + n_tokens * self.step_s()) * self.slowness + self.call_overhead_s


def remaining_cost(mode: Mode, top: int, n_ctx: int, predictor: CostPredictor, counts: Mapping[tuple[int, int], int],
                   *, resend_prefix: bool = False) -> float:
    """Predicted wall seconds of what the schedule with top ``top`` still lacks (``resend_prefix``: as a server)."""
    return sum(p.repeats * predictor.wall_s(p.new_tokens, p.cached_tokens, resend=resend_prefix) for p in missing(schedule(mode, top, n_ctx), counts))


def choose_top(mode: Mode, n_ctx: int, predictor: CostPredictor, counts: Mapping[tuple[int, int], int], time_left_s: float,
               *, resend_prefix: bool = False) -> int | None:
    """The largest top whose remaining schedule fits :data:`PLAN_SHARE` of ``time_left_s`` (None: not even the smallest)."""
    return max((top for top in top_candidates(mode, n_ctx)
                if remaining_cost(mode, top, n_ctx, predictor, counts, resend_prefix=resend_prefix) <= PLAN_SHARE * time_left_s), default=None)


def fits(predicted_s: float, time_left_s: float) -> bool:
    return predicted_s * STEP_SAFETY <= time_left_s


def decode_tokens(mode: Mode, budget_s: float, predictor: CostPredictor, time_left_s: float) -> int:
    """How many tokens to time decode over within :data:`DECODE_SHARE` of the budget and the time left."""
    step = predictor.step_s()
    n = min(int(DECODE_SHARE * budget_s / step), mode.max_decode_tokens) if step > 0 else mode.max_decode_tokens
    while n > 0 and not fits(predictor.decode_wall_s(n), time_left_s):
        n -= 1
    return n


log = logging.getLogger("trimkit")

Progress = Callable[[int, int, str], None]
#: an engine whose threads got less than this share of the CPU time they asked for is starved
STARVED_CPU_SHARE = 0.75


def starved_threads_hint(cpu_s: float, wall_s: float, threads: int | None, cpus: int | None) -> str:
    """A clause for the over-budget warning when the engine's threads were starved of CPU (on 2 busy vCPUs a 32-token
    probe took 3.5 s with 2 threads, 0.1 s with 1: they wait on each other at every graph step)."""
    if not threads or wall_s <= 0:
        return ""
    share = cpu_s / (wall_s * threads)
    if share >= STARVED_CPU_SHARE:
        return ""
    return (f"; llama.cpp's {threads} threads got {share:.0%} of the CPU time they asked for (other processes keep the "
            f"{cpus or '?'} CPUs busy) and wait on each other at every step: n_threads_batch at most the CPUs left free may help")


class CalibrationRun:
    """One bounded calibration, each step checked against the time left. Where the backend can stop a probe (in
    process), every probe after the minimum is stopped at the deadline: a host that slows down mid-probe ends on time."""

    def __init__(self, backend: Backend, n_batch: int, mode: Mode, budget_s: float, clock: Callable[[], float], progress: Progress | None,
                 *, threads: int | None = None) -> None:
        self.backend = backend
        self.threads = threads if threads else None
        self.mode = mode
        self.budget_s = budget_s
        self.clock = clock
        self.progress = progress
        self.n_ctx = backend.n_ctx
        self.resend = not getattr(backend, "depth_probe_keeps_prefix", True)
        self.predictor = CostPredictor(n_batch=n_batch)
        self.samples = self.predictor.samples
        self.counts: Counter[tuple[int, int]] = Counter()
        self.top = 0  # the longest cold probe measured
        self.holds = 0  # how many leading tokens of the probe text the engine's context holds (in process)
        self.planned_top = top_candidates(mode, self.n_ctx)[0]
        self.tail_steps = 2  # decode, first-token overhead
        self.done = self.total = 0
        self.decode_tps = 0.0
        self.decode_estimated = False
        self.decode_points: list[DecodePoint] = []
        self.first_token_s = 0.0
        self.first_token_per_token_s = 0.0
        self.first_token_estimated = False
        self.start = clock()
        self.wall_s = 0.0
        self.stopped = False  # a probe was stopped at the deadline: nothing more is measured
        self._within = getattr(backend, "measure_prefill_within", None)

    def left(self) -> float:
        return self.start + self.budget_s - self.clock()

    def _step(self, label: str) -> None:
        self.done += 1
        if self.progress is not None:
            planned = sum(p.repeats for p in missing(schedule(self.mode, max(self.planned_top, self.top), self.n_ctx), self.counts))
            self.total = self.done + planned + self.tail_steps
            self.progress(self.done, self.total, label)

    def predict(self, n: int, k: int) -> float:
        """A server resends the prefix; in process only what the context lacks of it is prefilled first."""
        return self.predictor.wall_s(n, k, prefix_tokens=max(k - self.holds, 0), resend=self.resend)

    def _past_deadline(self) -> bool:
        """One decode step before the deadline: llama.cpp stops at its next graph node, within a step."""
        return self.clock() >= self.start + self.budget_s - self.predictor.step_s()

    def _measure(self, n: int, k: int, force: bool) -> float | None:
        """One probe; None when stopped at the deadline (then nothing more is measured)."""
        if force or self._within is None:
            return self.backend.measure_prefill(n, k)
        seconds = self._within(n, k, self._past_deadline)
        if seconds is None:
            self.stopped = True
            self.holds = 0
            log.info("trimkit: calibration probe of %d tokens after %d stopped at the %.3g s deadline: it ran longer than "
                     "predicted (the host slowed down)", n, k, self.budget_s)
        return seconds

    def prefill(self, n: int, k: int, *, force: bool = False) -> bool:
        if self.stopped and not force:
            return False
        p = self.predictor
        predicted = self.predict(n, k) if p.samples else None
        if not force and predicted is not None and not fits(predicted, self.left()):
            return False
        t0 = self.clock()
        seconds = self._measure(n, k, force)
        if seconds is None:
            return False
        wall = self.clock() - t0
        p.observe(n, k, seconds, wall, predicted, call_overhead=not (k and (self.resend or self.holds < k)))
        self.holds = n + k
        self.counts[(n, k)] += 1
        if k == 0:
            self.top = max(self.top, n)
        self._step(f"prefill {n} tokens" + (f" after {k} cached" if k else ""))
        return True

    def execute(self) -> None:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        self.backend.warm_up()  # leaves the context empty (in process)
        # the overhead that grows with the prompt (tokenizing it), where the backend can time it: cheap, so always
        tokenize = getattr(self.backend, "measure_tokenize_s_per_token", None)
        if tokenize is not None:
            self.first_token_per_token_s = tokenize() or 0.0
        self._step("warm-up")
        # the minimum, whatever the time: the host's speed, a depth probe on its cached tokens, the shortest cold probe
        self.prefill(FIRST_PROBE_TOKENS, 0, force=True)
        self.prefill(MIN_PROBE_TOKENS, FIRST_PROBE_TOKENS, force=True)
        self.prefill(MIN_PROBE_TOKENS, 0, force=True)
        minimum_s = self.clock() - self.start  # the warm-up and the minimum of 3 probes, run whatever the budget
        minimum_cpu_s, minimum_wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        self._decode()
        self._first_token()
        while True:  # the first plan errs short: grow the top while time is left
            before = len(self.samples)
            self._cold()
            self._depth()
            self._repeats()
            top = choose_top(self.mode, self.n_ctx, self.predictor, self.counts, self.left(), resend_prefix=self.resend)
            if self.stopped or len(self.samples) == before or top is None or top <= self.top:
                break
        if self.progress is not None and self.total != self.done:
            self.progress(self.done, self.done, "calibrated")
        self.wall_s = self.clock() - self.start
        if self.wall_s > self.budget_s:
            if minimum_s > self.budget_s:
                why = (f"this host is too slow for even the minimum (the warm-up and 3 probes took {minimum_s:.1f} s)"
                       + starved_threads_hint(minimum_cpu_s, minimum_wall_s, self.threads, os.cpu_count()))
            else:
                why = "a step took far longer than predicted (the host slowed down while it ran)"
            log.warning("trimkit: calibration took %.1f s, over its %.3g s budget: %s; the profile is provisional, and improves as "
                        "requests run", self.wall_s, self.budget_s, why)

    def _decode(self) -> None:
        """One step first (it costs 5 to 100 prefill tokens: a guess could overrun), then what the budget affords."""
        p = self.predictor
        self.tail_steps -= 1
        if not fits(p.decode_wall_s(1), self.left()):
            self.decode_tps = 1.0 / p.step_s()
            self.decode_estimated = True
            log.info("trimkit: decode speed estimated (%.1f tokens/s), not measured: no time left for it", self.decode_tps)
            self._step("decode speed (estimated)")
            return
        self.decode_tps = self._time_decode(1)
        n = decode_tokens(self.mode, self.budget_s, p, self.left())
        if n > 1:
            self.decode_tps = self._time_decode(n)
        self._step(f"decode speed ({max(n, 1)} tokens)")

    def _decode_point(self, k: int) -> bool:
        """Decode speed after the ``k`` tokens the context holds: the median of one-token evaluations, in process only
        (a server would resend its context). True when the point was measured."""
        p = self.predictor
        if self.stopped or self.resend or p.decode_step_s is None or k + 1 > self.n_ctx:
            return False
        # the first step errs long: grown by the attention allowance for the context
        if not fits(p.step_s() * (1.0 + max(k, 0) / ATTENTION_PRIOR_TOKENS) * p.slowness + p.call_overhead_s, self.left()):
            return False
        times: list[float] = []
        slowest = 0.0
        while len(times) < self.mode.decode_point_steps and (not times or fits(slowest * p.slowness, self.left())):
            t0 = self.clock()
            step = self._measure(1, k, force=False)  # the context stays k (+ the step's token)
            if step is None:
                return False
            times.append(step)
            slowest = max(slowest, self.clock() - t0)
        self.holds = k + 1
        self._step(f"decode speed after {k} tokens")
        if len(times) < min(MIN_DECODE_POINT_STEPS, self.mode.decode_point_steps) or max(times) <= 0:
            return False  # too few steps to say much; or a clock too coarse for one step
        self.decode_points.append(DecodePoint.of_steps(k, times))
        return True

    def _time_decode(self, n: int) -> float:
        p = self.predictor
        predicted = p.decode_wall_s(n)
        t0 = self.clock()
        tps = self.backend.measure_decode(n)
        self.holds = 0
        p.observe_ratio(self.clock() - t0, predicted)
        if tps > 0:
            p.decode_step_s = 1.0 / tps
        return tps

    def _first_token(self) -> None:
        """Measure the first-token overhead if cheap enough, else estimate it (the wrapper learns it from requests)."""
        p = self.predictor
        cost = FIRST_TOKEN_REQUESTS * ((p.engine_s(FIRST_TOKEN_PROMPT_TOKENS, 0) + 2 * p.step_s()) * p.slowness + p.call_overhead_s)
        self.tail_steps -= 1
        if cost <= FIRST_TOKEN_SHARE * self.budget_s and fits(cost, self.left()):
            t0 = self.clock()
            self.first_token_s = self.backend.measure_first_token_overhead()
            self.holds = 0
            p.observe_ratio(self.clock() - t0, cost)
            self._step("first-token overhead")
        else:
            self.first_token_s = p.call_overhead_s
            self.first_token_estimated = True
            log.info("trimkit: first-token overhead estimated (%.4f s), not measured: its requests would take ~%.1f s of a %.1f s budget",
                     self.first_token_s, cost, self.budget_s)
            self._step("first-token overhead (estimated)")

    def _cold(self) -> None:
        while True:
            top = choose_top(self.mode, self.n_ctx, self.predictor, self.counts, self.left(), resend_prefix=self.resend)
            if top is None or top <= self.top:
                return
            self.planned_top = top
            todo = [n for n in cold_lengths(self.mode, top) if not self.counts[(n, 0)]]
            if not self.prefill(todo[0], 0):
                return

    def _depth(self) -> None:
        k = self.top
        for n in depth_lengths(self.mode, k, self.n_ctx):
            if self.counts[(n, k)]:
                continue
            while n >= MIN_PROBE_TOKENS and not fits(self.predict(n, k), self.left()):
                n = n * 3 // 4
            if n >= MIN_PROBE_TOKENS:
                self.prefill(n, k)
        # decode at the deepest context cached, then at once at an empty one: back to back, both see the host at one
        # speed (a shared machine's speed changes over seconds by as much as a few hundred tokens of context do)
        if self.holds > max((pt.context_tokens for pt in self.decode_points), default=0.0) and self._decode_point(self.holds):
            self._decode_point(0)

    def _repeats(self) -> None:
        lengths = cold_lengths(self.mode, self.top)
        rounds = max(repeats(self.mode, n, self.top) for n in lengths)
        for r in range(rounds):
            for n in lengths:
                if self.counts[(n, 0)] <= r < repeats(self.mode, n, self.top):
                    self.prefill(n, 0)


#: a fit whose cost grows by less than this factor from the shortest to the longest probe is flat
FLAT_GROWTH = 1.1


def as_backend(target: Any) -> Backend:
    """A :class:`Backend` for ``target``: a Backend, a wrapper's, a ``llama_cpp.Llama`` or an OpenAI-style client."""
    kind = client_kind(target)
    if kind == "backend":
        return target
    if kind == "wrapper":
        return target.backend
    if kind == "llama":
        from trimkit.backends.llama import LlamaBackend

        return LlamaBackend(target)
    if kind == "openai":
        return OpenAIHTTPBackend.from_openai_client(target)
    if kind == "ollama":
        raise InvalidInputError("an ollama client does not say which model to calibrate: pass "
                                "trimkit.backends.OllamaBackend(client, model=...) or the wrapper trimkit.wrap(client, model=...) gave")
    raise InvalidInputError(
        f"cannot use {type(target).__name__} as a model: pass a llama_cpp.Llama, an OpenAI-style client or a trimkit Backend"
    )


def calibrate(target: Any, *, mode: str | None = None, time_budget_s: float | None = None, recalibrate: bool = False, store: bool = True,
              progress: Progress | None = None, clock: Callable[[], float] | None = None) -> Profile:
    """Measure prefill cost on this host and return a :class:`~trimkit.planning.profile.Profile`, within ``time_budget_s``
    or the mode's: ``"micro"`` 3 s (provisional), ``"quick"`` 10 s, ``"full"`` 30 s (default: the most thorough the budget
    affords). A stored profile at least as thorough is returned unless ``recalibrate``; ``progress(done, total, label)``
    is called after each step; ``clock`` times the budget (default: the backend's)."""
    backend = as_backend(target)
    name, budget_s = mode_and_budget(mode, time_budget_s)
    context_cap(backend.n_ctx)  # ContextTooSmallError before anything is measured
    key = backend.profile_key()
    if not recalibrate:
        stored = load_profile(key)
        if stored is not None and CALIBRATION_MODES.index(stored.mode) >= CALIBRATION_MODES.index(name):
            log.info("trimkit: reusing stored %s profile for %s", stored.mode, key.model)
            if not stored.attention_prior_tokens and backend.attention_prior_tokens:
                stored = attrs.evolve(stored, attention_prior_tokens=backend.attention_prior_tokens)
            return stored
    run = CalibrationRun(backend, key.n_batch or 512, get_mode(name), budget_s, clock or getattr(backend, "clock", None) or time.perf_counter, progress,
                         threads=key.n_threads_batch)
    run.execute()
    if len(run.samples) < MIN_SAMPLES:  # pragma: no cover
        raise CalibrationError("calibration produced fewer than 3 samples")
    prior = backend.attention_prior_tokens
    model, err, heldout, alternatives = _fit(run.samples, key.n_batch or 512, prior)
    profile = Profile(
        key=key, model=model, first_token_s=run.first_token_s, decode_tokens_per_s=run.decode_tps, samples=tuple(run.samples), error=err,
        alternatives=alternatives, calibration_wall_s=run.wall_s, created_at=time.time(), residuals=tuple(heldout), mode=name, time_budget_s=budget_s,
        first_token_estimated=run.first_token_estimated, first_token_per_token_s=run.first_token_per_token_s, attention_prior_tokens=prior or 0.0,
        # no point measured but decode was: its speed stands as one point (the profile's default)
        **({"decode_points": tuple(run.decode_points)} if run.decode_points or run.decode_estimated else {}),
    )
    if store:
        path = save_profile(profile)
        if path is not None:
            log.info("trimkit: stored profile %s", path)
    return profile


def _fit(samples: Sequence[PrefillSample], n_batch: int,
         prior: float | None = None) -> tuple[CostModel, ErrorStats, list[tuple[float, float]], dict[str, Any]]:
    """The cost model for ``samples``, its held-out error and residuals, and the candidates; ``prior``: the
    architecture's attention doubling length, which the fit and the fallbacks lean on."""
    candidates = {}
    for batched in (False, True):
        model = fit_cost_model(samples, n_batch=n_batch, batched=batched, depth_prior_tokens=prior)
        heldout = heldout_predictions(samples, n_batch=n_batch, batched=batched, depth_prior_tokens=prior)
        candidates["batched" if batched else "design"] = (model, error_stats(heldout), heldout)
    d_err, b_err = candidates["design"][1], candidates["batched"][1]
    name = "batched" if math.isfinite(b_err.median_pct) and b_err.median_pct < d_err.median_pct * 0.9 else "design"
    model, err, heldout = candidates[name]
    alternatives = {n: {"model": m.to_dict(), "heldout_error": e.to_dict()} for n, (m, e, _) in candidates.items()}
    lo, hi = min(s.new_tokens for s in samples), max(s.new_tokens for s in samples)
    rate = per_token_rate(samples)
    # noisy probes over too short a range (a busy host's minimum) can fit a model no transformer has: attention
    # costing more than the weights before ATTENTION_PRIOR_TOKENS, or a cost that barely grows with the prompt.
    # A proportional rate instead (with the architecture's attention, else the allowance): it errs long.
    if model.depth_s * ATTENTION_PRIOR_TOKENS > max(model.per_token_s, rate):
        fallback, depth_s = "attention_prior", rate / (prior or ATTENTION_PRIOR_TOKENS)
        log.warning("trimkit: the fitted attention term was implausible (noisy probes over a short range); "
                    "using a conservative per-token rate with the attention allowance instead")
    elif model.prefill_s(hi) < FLAT_GROWTH * model.prefill_s(lo):
        fallback, depth_s = "proportional", rate / prior if prior else 0.0
    else:
        return model, err, heldout, alternatives
    model = CostModel(overhead_s=0.0, per_token_s=rate, depth_s=depth_s, n_batch=n_batch)
    heldout = [(model.prefill_s(s.new_tokens, s.cached_tokens), s.seconds) for s in samples]
    err = error_stats(heldout)
    alternatives[fallback] = {"model": model.to_dict(), "heldout_error": err.to_dict()}
    return model, err, heldout, alternatives


#: a stored profile larger than this is refused unread (a real one is a few KiB)
MAX_PROFILE_BYTES = 16 * 1024 * 1024
#: a ``.profile-*.tmp`` file older than this is left over from a killed save and is removed
STALE_TMP_S = 60.0


def cache_dir() -> Path:
    """``$TRIMKIT_CACHE_DIR`` when set, else the user cache folder (:func:`platformdirs.user_cache_dir`)."""
    env = os.environ.get("TRIMKIT_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("trimkit", appauthor=False))


def profile_path(key: ProfileKey) -> Path:
    return cache_dir() / "profiles" / f"{key.digest()}.json"


def _read_json(path: Path, st: os.stat_result) -> Any:
    """The parsed JSON of a regular file of at most :data:`MAX_PROFILE_BYTES`, else ProfileError. Never blocks: the type
    is checked before a non-blocking open (a FIFO swapped in between is caught by ``fstat``)."""
    if not stat.S_ISREG(st.st_mode):
        raise ProfileError("not a regular file")
    if st.st_size > MAX_PROFILE_BYTES:
        raise ProfileError(f"{st.st_size} bytes, over the {MAX_PROFILE_BYTES}-byte limit for a profile")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise ProfileError("not a regular file")
            raw = fh.read(MAX_PROFILE_BYTES + 1)
    except OSError as exc:
        raise ProfileError(f"unreadable ({exc.strerror or exc})") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(f"over the {MAX_PROFILE_BYTES}-byte limit for a profile")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProfileError("not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a 5000-digit int, [[[[…
        raise ProfileError(f"not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


#: unusable files (path, identity, reason) and unwritable folders already warned about: one warning each
_warned: set[Any] = set()
_warn_lock = threading.Lock()


def _first_time(mark: Any) -> bool:
    with _warn_lock:
        first = mark not in _warned
        _warned.add(mark)
    return first


def _clean_stale_tmp(folder: Path) -> None:
    """Remove ``.profile-*.tmp`` files older than :data:`STALE_TMP_S`, left by a killed save. Best effort."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            st = entry.stat(follow_symlinks=False)
            if entry.name.startswith(".profile-") and entry.name.endswith(".tmp") and stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > STALE_TMP_S:
                os.unlink(entry.path)


def save_profile(profile: Profile, path: Path | None = None) -> Path | None:
    """Write ``profile`` as JSON atomically and return the path. Without ``path``, to the user cache: an unwritable
    cache folder is then one warning per folder and None (the profile is kept in memory only)."""
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
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if explicit or not isinstance(exc, OSError):
            raise
        (log.warning if _first_time(str(path.parent)) else log.debug)(
            "trimkit: cannot store the calibration profile in %s (%s); it is kept in memory only, so the next "
            "process calibrates again (set TRIMKIT_CACHE_DIR to a writable folder)", path.parent, exc.strerror or exc,
        )
        return None
    with _warn_lock:
        _warned.discard(str(path.parent))
    return path


def load_profile(key: ProfileKey, path: Path | None = None) -> Profile | None:
    """The stored profile for ``key``; None when there is none, it was made under another key, or it is unusable
    (then one warning names the file and what is wrong)."""
    path = path or profile_path(key)
    st = None
    try:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError) as exc:  # permission denied, a name the OS refuses
            raise ProfileError(f"unreadable ({getattr(exc, 'strerror', None) or exc})") from None
        profile = Profile.from_dict(_read_json(path, st))
    except ProfileError as exc:
        ident = None if st is None else (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        (log.warning if _first_time((str(path), ident, str(exc))) else log.info)("stored profile %s is unusable: %s; calibrating again", path, exc)
        return None
    if profile.key != key:
        log.info("stored profile %s was made for another configuration; calibrating again", path)
        return None
    return profile
