"""The host's speed trend during one calibration, read from its repeated probes.

A shared or throttling host changes speed over seconds (docs/design.md §2). Calibration measures
short probes first and long ones later, so a host that slows down while it runs makes the long
probes look dearer than they are, and the cost model's shape (per-token against attention term)
absorbs a change that is the host's, not the model's. Calibration repeats probes of the same
length at different times (:func:`trimkit.calibration_schedule.repeats`): each repeated pair says
how much slower or faster the host was between its two measurements, whatever the cost model.

:func:`host_trend` fits one rate of change of the log speed to those pairs (a line through the
origin: the pair's log ratio against the time between its two measurements) and keeps it only
when the pairs agree on it: from at least :data:`MIN_PAIRS` pairs, a slope two-sided significant
at 5 % by Student's t (:func:`t_critical`). The scatter of the pairs themselves says whether
there is a trend or only noise, so nothing here depends on the host's speed or its noise level. :func:`normalized`
then rescales every sample to the host's speed at the **middle** of the span the pairs cover (its
mean speed over the calibration), not at its end: a calibration of seconds cannot tell a lasting
throttle from a passing slow or fast spell, and the middle is off by at most half the span's
change either way, where the end is off by all of it when the spell passes (docs/design.md §2;
docs/benchmarks.md, runs 11–35: the end's speed did not last in 13 of 15 steadied calibrations).
The live drift (:mod:`trimkit.planning.drift`) follows the host from the first request. A sample
measured before the first repeated probe or after the last is corrected as if measured at that
probe's time: the trend is not extrapolated beyond the span the pairs cover.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from trimkit.planning.costs import PrefillSample

__all__ = ["MIN_PAIRS", "HostTrend", "host_trend", "largest_change", "normalized", "t_critical"]

#: fewer repeated pairs than this say nothing about a trend
MIN_PAIRS = 3
#: Student's t, two-sided 5 %, by degrees of freedom (the standard table; 1.96 beyond it)
_T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
          12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t_critical(dof: int) -> float:
    """The two-sided 5 % critical value of Student's t with ``dof`` degrees of freedom (the
    table's value at the nearest tabulated ``dof`` at or below it: conservative in between)."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    return 1.96 if dof > 30 else _T_975[max(d for d in _T_975 if d <= dof)]


@attrs.frozen
class HostTrend:
    """``log_per_s``: the change of log(prefill seconds) per second of calibration (positive: the
    host slowed down); ``pairs``: the repeated pairs it rests on; ``t_stat``: its t statistic;
    ``first_s``/``last_s``: the span of time the pairs cover (the trend holds only there)."""

    log_per_s: float
    pairs: int
    t_stat: float
    first_s: float
    last_s: float

    @property
    def middle_s(self) -> float:
        """The middle of the span the pairs cover: the time whose speed :func:`normalized` steadies to."""
        return (self.first_s + self.last_s) / 2.0

    def factor(self, at_s: float, to_s: float) -> float:
        """What a sample measured ``at_s`` is multiplied by to stand at the speed of ``to_s``
        (both taken within the pairs' span)."""

        def within(t: float) -> float:
            return max(self.first_s, min(self.last_s, t))

        return math.exp(self.log_per_s * (within(to_s) - within(at_s)))

    def to_dict(self) -> dict[str, object]:
        return {**attrs.asdict(self), "pct_per_10_s": 100.0 * math.expm1(10.0 * self.log_per_s)}


def _check_lengths(samples: Sequence[PrefillSample], times: Sequence[float]) -> None:
    if len(samples) != len(times):
        raise ValueError(f"{len(samples)} samples but {len(times)} times")


def _pairs(samples: Sequence[PrefillSample], times: Sequence[float]) -> list[tuple[float, float, float]]:
    """(earlier time, seconds between, log ratio later / earlier) of consecutive measurements
    of each probe."""
    last: dict[tuple[int, int], tuple[float, float]] = {}
    out = []
    for s, t in zip(samples, times, strict=True):
        key = (s.new_tokens, s.cached_tokens)
        if s.seconds <= 0:
            continue
        if key in last:
            t0, sec0 = last[key]
            if t > t0:
                out.append((t0, t - t0, math.log(s.seconds / sec0)))
        last[key] = (t, s.seconds)
    return out


def host_trend(samples: Sequence[PrefillSample], times: Sequence[float]) -> HostTrend | None:
    """The trend of the host's speed over the calibration that measured ``samples`` at ``times``
    (seconds, one a sample, in any origin), or None when its repeated probes show none."""
    _check_lengths(samples, times)
    pairs = _pairs(samples, times)
    if len(pairs) < MIN_PAIRS:
        return None
    sxx = sum(dt * dt for _, dt, _ in pairs)
    slope = sum(dt * d for _, dt, d in pairs) / sxx
    dof = len(pairs) - 1  # a line through the origin: one parameter
    se = math.sqrt(sum((d - slope * dt) ** 2 for _, dt, d in pairs) / dof / sxx)
    t_stat = math.inf if se == 0 else abs(slope) / se
    if slope == 0 or t_stat < t_critical(dof):
        return None
    return HostTrend(log_per_s=slope, pairs=len(pairs), t_stat=t_stat, first_s=min(t0 for t0, _, _ in pairs),
                     last_s=max(t0 + dt for t0, dt, _ in pairs))


def largest_change(samples: Sequence[PrefillSample], times: Sequence[float], trend: HostTrend) -> float:
    """The largest change of speed a repeated probe measured in ``trend``'s direction: its later
    time over its earlier one (above 1 for a slowdown, below 1 for a speed-up; 1 when none)."""
    _check_lengths(samples, times)
    logs = [d for _, _, d in _pairs(samples, times) if d * trend.log_per_s > 0]
    return math.exp(max(logs, key=abs)) if logs else 1.0


def normalized(samples: Sequence[PrefillSample], times: Sequence[float], trend: HostTrend) -> list[PrefillSample]:
    """``samples``, measured at ``times``, rescaled to the host's speed at the middle of ``trend``'s
    span (:attr:`HostTrend.middle_s`; module docstring). New objects."""
    _check_lengths(samples, times)
    return [attrs.evolve(s, seconds=s.seconds * trend.factor(t, trend.middle_s)) for s, t in zip(samples, times, strict=True)]
