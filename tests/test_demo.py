"""``trimkit demo`` respects the host: what it runs is sized from the measured speed to its time target.

On a fake engine whose clock runs at this project's host speed, 10× and 50× slower: the demo ends
within its target, says what it does step by step, and prints the prediction of a request it does
not run. (``make demo`` on the real model is timed by hand: see the README.)
"""

from __future__ import annotations

import json

import attrs
import pytest

from trimkit.cli import Timeline, answer_tokens, run_demo, turn_budget
from trimkit.planning.costs import CostModel
from trimkit.testing import FakeBackend, FakeClock

#: a fake engine about as fast as a 2-core x86 host running the embedded 270M model
HOST = CostModel(overhead_s=0.02, per_token_s=0.003, depth_s=7.5e-7)
HOST_DECODE_TPS = 20.0
TARGET_S = 150.0


def slow_engine(factor: float) -> FakeBackend:
    cost = CostModel(overhead_s=HOST.overhead_s * factor, per_token_s=HOST.per_token_s * factor, depth_s=HOST.depth_s * factor)
    return FakeBackend(cost, clock=FakeClock(), n_ctx=8192, decode_tokens_per_s=HOST_DECODE_TPS / factor,
                       reply=" ".join(["word"] * 200))


def demo(engine: FakeBackend, **kwargs):
    start = engine.clock()
    rc = run_demo(llm=engine, clock=engine.clock, time_target_s=TARGET_S, **kwargs)
    return rc, engine.clock() - start


@pytest.mark.parametrize("factor", [1, 10, 50])
def test_the_demo_ends_within_its_time_target_on_any_host(isolated_cache, capsys, tmp_path, factor):
    engine = slow_engine(factor)
    rc, took = demo(engine, json_path=str(tmp_path / "demo.json"))
    out = capsys.readouterr().out
    assert rc == 0
    # the last request may overrun its prediction by the profile's error: a little slack
    assert took <= TARGET_S * 1.1, (factor, took)
    for part in ("== 1. Calibration", "== 2. The two phases", "== 3. A RAG chat", "== 4. The same chat"):
        assert part in out
    assert "calibrating (full, at most 30 s" in out
    assert "estimate:" in out and "done in" in out
    reports = json.loads((tmp_path / "demo.json").read_text())
    assert len(reports) == 6 and [r["part"] for r in reports].count("budget") == 3
    not_run = [r for r in reports if r["report"] is None]
    assert all(r["not_run"]["predicted_s"] > r["not_run"]["bound_s"] for r in not_run)
    assert out.count("not run — ") == len(not_run)
    sent = [sum(len(str(m.get("content", ""))) for m in msgs) for msgs, _ in engine.calls]
    if factor == 1:
        # at the host's own speed everything runs, the untrimmed RAG chat included
        assert not not_run and len(engine.calls) == 6
    if factor == 50:
        # 50× slower: the long requests are not run, their predictions are printed instead
        assert not_run and "predicted TTFT" in out
        assert len(engine.calls) < 6
    assert all(n > 0 for n in sent)


def test_a_stored_profile_is_reused_and_leaves_more_time_for_requests(isolated_cache, capsys):
    engine = slow_engine(1)
    demo(engine)
    capsys.readouterr()
    engine.calls.clear()
    rc, took = demo(engine)
    out = capsys.readouterr().out
    assert rc == 0 and "reused the profile stored" in out and "calibrating (" not in out
    assert took <= TARGET_S * 1.1


def test_each_request_gets_its_share_of_the_time_left():
    clock = FakeClock()
    tl = Timeline(120.0, clock)
    assert tl.share(4) == pytest.approx(30.0)
    clock.advance(60.0)
    assert tl.left() == pytest.approx(60.0) and tl.share(3) == pytest.approx(20.0)
    clock.advance(100.0)
    assert tl.left() == 0.0 and tl.share(2) == 0.0


def test_answers_are_capped_by_decode_speed():
    from types import SimpleNamespace

    fast, slow = SimpleNamespace(decode_tokens_per_s=50.0), SimpleNamespace(decode_tokens_per_s=0.5)
    assert answer_tokens(fast, 32, 10.0) == 32
    assert answer_tokens(slow, 32, 10.0) == 5
    assert answer_tokens(slow, 32, 1.0) == 1  # at least one token: the wait before it is the point
    assert answer_tokens(SimpleNamespace(decode_tokens_per_s=2.0), 32, 10.0) == 20


def test_the_chat_budget_is_capped_to_a_turns_share():
    from types import SimpleNamespace

    profile = SimpleNamespace(decode_tokens_per_s=10.0, predict_ttft_s=lambda n, k=0: n * 0.01)
    budget, how = turn_budget(profile, 5000, 0.5, 100.0, 0.45, 32)
    assert budget == pytest.approx(22.5) and "capped" not in how
    budget, how = turn_budget(profile, 5000, 0.5, 10.0, 0.45, 32)
    assert budget == pytest.approx(10.0 - 3.2) and "capped" in how
    budget, _ = turn_budget(profile, 5000, 0.5, 2.0, 0.45, 32)
    assert budget == 0.5  # never under the smallest prompt's TTFT


def test_demo_time_target_option():
    from trimkit.cli import TIME_TARGET_S, build_parser

    assert build_parser().parse_args(["demo"]).time_target == TIME_TARGET_S
    assert build_parser().parse_args(["demo", "--time-target", "60"]).time_target == 60.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--time-target", "0"])


def test_the_demo_plans_decode_with_the_speed_a_request_measured(isolated_cache):
    """The demo sizes answers with the decode speed the last request measured, even a two-token answer's (its wrapper's
    live profile learns from longer answers only): a profile whose decode speed was only estimated cannot keep them short."""
    from trimkit import calibrate
    from trimkit.cli import measured_speed

    profile = attrs.evolve(calibrate(FakeBackend(clock=FakeClock()), mode="micro", store=False), decode_tokens_per_s=0.5)
    assert measured_speed(profile, None) is profile and answer_tokens(profile, 32, 1.0) == 1
    assert measured_speed(profile, 20.0).decode_tokens_per_s == 20.0 and answer_tokens(measured_speed(profile, 20.0), 32, 1.0) == 20
    assert measured_speed(profile, 20.0).predict_ttft_s(100) == profile.predict_ttft_s(100)
