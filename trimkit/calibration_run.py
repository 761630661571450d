"""One bounded calibration run: the probes in order, each checked against the time left.

:func:`trimkit.calibration.calibrate` builds a :class:`CalibrationRun` for a backend, a mode and
a budget, calls :meth:`CalibrationRun.execute`, and fits the profile on what it measured: the
prefill samples, the decode speed and its points at a short and a long context
(:mod:`trimkit.decode_model`), the first-token overhead. What fits the time is decided by
:mod:`trimkit.calibration_schedule` (pure); this module runs it against the engine
(docs/design.md, §2 "Calibration in bounded time").
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable

from trimkit.backends.base import Backend
from trimkit.calibration_schedule import (FIRST_PROBE_TOKENS, FIRST_TOKEN_SHARE, MIN_DECODE_POINT_STEPS,
                                          MIN_PROBE_TOKENS, CostPredictor, Mode, choose_top, cold_lengths, decode_tokens,
                                          depth_lengths, first_token_cost_s, fits, missing, repeats, schedule, top_candidates)
from trimkit.decode_model import DecodePoint
from trimkit.planning.costs import PrefillSample

__all__ = ["CalibrationRun", "Progress"]

log = logging.getLogger("trimkit")

#: ``progress(done, total, label)``, called after each step of a calibration
Progress = Callable[[int, int, str], None]
#: an engine whose threads got less than this share of the CPU time they asked for during the
#: minimum is said to be starved (a diagnostic in the over-budget warning, nothing else)
STARVED_CPU_SHARE = 0.75


def starved_threads_hint(cpu_s: float, wall_s: float, threads: int | None, cpus: int | None) -> str:
    """A clause for the over-budget warning when the engine's ``threads`` got less than
    :data:`STARVED_CPU_SHARE` of the CPU time they asked for over ``wall_s`` real seconds (this
    process used ``cpu_s``): other processes keep the CPUs busy, and llama.cpp's threads then
    wait on each other at every step of its graph — on 2 vCPUs with two busy processes a
    32-token probe took 3.5 s with 2 threads, 0.1 s with 1. Empty otherwise."""
    if not threads or wall_s <= 0:
        return ""
    share = cpu_s / (wall_s * threads)
    if share >= STARVED_CPU_SHARE:
        return ""
    return (f"; llama.cpp's {threads} threads got {share:.0%} of the CPU time they asked for (other processes keep the "
            f"{cpus or '?'} CPUs busy) and wait on each other at every step: n_threads_batch at most the CPUs left free may help")


class CalibrationRun:
    """One bounded calibration: the steps in order, each checked against the time left.

    Order: warm-up (and what tokenizing costs per token); the first probe (the speed) and two
    cheap ones — the minimum of 3 samples, taken whatever the time; decode (sized to the
    budget); the first-token overhead (or its estimate); cold probes ascending, the top re-chosen before each; the depth probes after the
    longest cold one (its tokens still cached in process), then, in process, decode steps at the
    deepest context they leave cached and at an empty one; the repeats, in round-robin rounds so
    slow drift spreads over all lengths; again from the cold probes while a longer top fits.
    Where the backend can stop a probe (``measure_prefill_within``: in process), every probe
    after the minimum is stopped at the deadline: a host that slows down in the middle of a
    probe (a 32-token probe once took 3.6 s instead of 0.05 s on a 2-core host with two busy
    processes) ends the run on time, without that probe.
    """

    def __init__(self, backend: Backend, n_batch: int, mode: Mode, budget_s: float, clock: Callable[[], float], progress: Progress | None,
                 *, threads: int | None = None) -> None:
        self.backend = backend
        #: the engine's prompt-processing threads where it runs in this process (its profile key's
        #: ``n_threads_batch``; None for a server): what the over-budget warning checks for starvation
        self.threads = threads if threads else None
        self.mode = mode
        self.budget_s = budget_s
        self.clock = clock
        self.progress = progress
        self.n_ctx = backend.n_ctx
        self.resend = not getattr(backend, "depth_probe_keeps_prefix", True)
        self.predictor = CostPredictor(n_batch=n_batch)
        self.samples: list[PrefillSample] = []
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
        #: seconds the warm-up and the minimum of 3 probes took (run whatever the budget)
        self.minimum_s = 0.0
        #: True once a probe was stopped at the deadline: nothing more is measured
        self.stopped = False
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
        """Predicted wall seconds of probing ``n`` after ``k``: a server resends the prefix; in
        process only what the context lacks of it is prefilled first (every probe is a prefix
        of one probe text, so the context holds the last probe's tokens)."""
        if self.resend and k:
            return self.predictor.wall_s(n, k, prefix_tokens=k, extra_call=True)
        return self.predictor.wall_s(n, k, prefix_tokens=max(k - self.holds, 0) if k else 0)

    def _past_deadline(self) -> bool:
        """Whether a probe running now must stop: one decode step's time before the deadline
        (llama.cpp stops at its next graph node, which takes less than a whole step)."""
        return self.clock() >= self.start + self.budget_s - self.predictor.step_s()

    def _measure(self, n: int, k: int, force: bool) -> float | None:
        """One probe; a probe not forced is stopped at the deadline where the backend can stop
        one (in process): None then, and the run measures nothing more."""
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
        """Measure ``n`` tokens after ``k`` if predicted to fit (always when ``force``)."""
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
        self.samples.append(PrefillSample(n, k, seconds))
        self.counts[(n, k)] += 1
        if k == 0:
            self.top = max(self.top, n)
        self._step(f"prefill {n} tokens" + (f" after {k} cached" if k else ""))
        return True

    def execute(self) -> None:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        self.backend.warm_up()  # leaves the context empty (in process)
        self._tokenizer()
        self._step("warm-up")
        # the minimum, whatever the time: the first probe measures the host's speed; then a
        # depth probe after it (its tokens are still cached: it costs 16 tokens in process) and
        # the shortest cold probe give the 3 samples the model needs, at the least cost
        self.prefill(FIRST_PROBE_TOKENS, 0, force=True)
        self.prefill(MIN_PROBE_TOKENS, FIRST_PROBE_TOKENS, force=True)
        self.prefill(MIN_PROBE_TOKENS, 0, force=True)
        self.minimum_s = self.clock() - self.start
        minimum_cpu_s, minimum_wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        self._decode()
        self._first_token()
        while True:  # grow the top again while time is left: the first plan errs short
            before = len(self.samples)
            self._cold()
            self._depth()
            self._repeats()
            top = choose_top(self.mode, self.n_ctx, self.predictor, self.counts, self.left(), resend_prefix=self.resend)
            if self.stopped or len(self.samples) == before or top is None or top <= self.top:
                break
        if self.progress is not None and self.total != self.done:  # what was planned but did not fit is dropped
            self.progress(self.done, self.done, "calibrated")
        self.wall_s = self.clock() - self.start
        if self.wall_s > self.budget_s:
            if self.minimum_s > self.budget_s:
                why = (f"this host is too slow for even the minimum (the warm-up and 3 probes took {self.minimum_s:.1f} s)"
                       + starved_threads_hint(minimum_cpu_s, minimum_wall_s, self.threads, os.cpu_count()))
            else:
                why = "a step took far longer than predicted (the host slowed down while it ran)"
            log.warning("trimkit: calibration took %.1f s, over its %.3g s budget: %s; the profile is provisional, and improves as "
                        "requests run", self.wall_s, self.budget_s, why)

    def _decode(self) -> None:
        """Decode speed: one step first (a decode step costs 5 to 100 prefill tokens' time,
        depending on the hardware: guessing it could overrun the budget), then as many steps
        as the budget affords at that speed. Estimated from the prefill rate when not even one
        step fits."""
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
        if n > 1:  # else the one step stands: a slow host's decode share affords no more
            self.decode_tps = self._time_decode(n)
        self._step(f"decode speed ({max(n, 1)} tokens)")

    def _decode_point(self, k: int) -> bool:
        """Decode speed after ``k`` tokens of context (in process): the median of up to the
        mode's ``decode_point_steps`` one-token evaluations after them — what one decode step
        is —, each timed by the engine call. The context must hold ``k`` tokens already (0:
        none), so a point costs a few steps and no prefill. The first step is priced with the
        attention allowance (:meth:`CostPredictor.decode_step_wall_s`), each next one at the
        slowest wall time seen so far; a point of fewer than :data:`MIN_DECODE_POINT_STEPS`
        steps is dropped. None on a server (each step would resend its context), nor when decode
        was not measured. True when the point was measured."""
        if self.stopped or self.resend or self.predictor.decode_step_s is None or k + 1 > self.n_ctx:
            return False
        if not fits(self.predictor.decode_step_wall_s(k), self.left()):
            return False
        times: list[float] = []
        slowest = 0.0
        while len(times) < self.mode.decode_point_steps and (not times or fits(slowest * self.predictor.slowness, self.left())):
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
        p.observe_decode(tps)
        return tps

    def _decode_pair(self) -> None:
        """The decode-vs-context line's points: after the depth probes, decode steps at the
        deepest context they leave cached, then at once at an empty context. Back to back, both
        see the host at the same speed: on a shared machine the speed changes over seconds, by
        as much as the difference a few hundred tokens of context make."""
        deepest = max((pt.context_tokens for pt in self.decode_points), default=0.0)
        if self.holds > deepest and self._decode_point(self.holds):
            self._decode_point(0)

    def _tokenizer(self) -> None:
        """The part of the first-token overhead that grows with the whole prompt — tokenizing
        it, every turn — where the backend can time its tokenizer: ~1,000 tokens three times,
        the time of a few prefill tokens, so it runs whatever the budget (and the schedule is
        sized after it). Other backends leave it to be learned from served requests."""
        tokenize = getattr(self.backend, "measure_tokenize_s_per_token", None)
        if tokenize is not None:
            self.first_token_per_token_s = tokenize() or 0.0

    def _first_token(self) -> None:
        """Measure the first-token overhead if it is cheap enough, else estimate it: the time a
        probe call takes beyond its prefill (what a request adds around the engine's work). The
        wrapper learns the real value from every measured request."""
        p = self.predictor
        cost = first_token_cost_s(p)
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
        """Cold probes, ascending; before each the top is chosen again from what is known now."""
        while True:
            top = choose_top(self.mode, self.n_ctx, self.predictor, self.counts, self.left(), resend_prefix=self.resend)
            if top is None or top <= self.top:
                return
            self.planned_top = top
            todo = [n for n in cold_lengths(self.mode, top) if not self.counts[(n, 0)]]
            if not self.prefill(todo[0], 0):
                return

    def _depth(self) -> None:
        """New tokens after the longest cold probe, shrunk to the time left, or left out."""
        k = self.top
        for n in depth_lengths(self.mode, k, self.n_ctx):
            if self.counts[(n, k)]:
                continue
            while n >= MIN_PROBE_TOKENS and not fits(self.predict(n, k), self.left()):
                n = n * 3 // 4
            if n >= MIN_PROBE_TOKENS:
                self.prefill(n, k)
        self._decode_pair()

    def _repeats(self) -> None:
        lengths = cold_lengths(self.mode, self.top)
        rounds = max(repeats(self.mode, n, self.top) for n in lengths)
        for r in range(rounds):
            for n in lengths:
                if self.counts[(n, 0)] <= r < repeats(self.mode, n, self.top):
                    self.prefill(n, 0)
