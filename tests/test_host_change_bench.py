"""The pure parts of ``benchmarks/host_change.py`` (no model runs): how a phase is summed up."""

from __future__ import annotations

from tests._bench import load_benchmark

host_change = load_benchmark("host_change")


def _row(served: float, static: float, *, met: bool = True, feasible: bool = True, drift: float = 1.0) -> dict:
    return {"ape_served_pct": served, "ape_static_pct": static, "met": met, "feasible": feasible, "drift": drift,
            "slowdown_noted": drift >= 2.0}


def test_following_counts_the_requests_before_two_close_predictions_in_a_row():
    rows = [_row(70, 70), _row(8, 70), _row(40, 70), _row(9, 70), _row(3, 70), _row(50, 70)]
    assert host_change.requests_until_following(rows) == 3
    assert host_change.requests_until_following([_row(5, 5), _row(5, 5)]) == 0
    assert host_change.requests_until_following([_row(5, 5), _row(50, 5), _row(5, 5)]) is None


def test_a_phase_summary_counts_misses_among_the_feasible_only():
    rows = [_row(70, 70, met=False, drift=1.0), _row(60, 70, met=False, feasible=False, drift=3.0), _row(5, 70, drift=3.0),
            _row(4, 70, met=False, drift=3.0)]
    s = host_change.phase_summary("loaded", rows, ref_ms=5.0, load_procs=1)
    assert (s["within_budget"], s["feasible"], s["over_budget_first_3"]) == (1, 3, 1)
    assert s["served_ape_first_3_pct"] == [70, 60, 5] and s["requests_until_following"] == 2
    assert s["slowdown_noted"] == 3 and s["drift_end"] == 3.0
