"""``benchmarks/replay_served.py`` replays a prediction benchmark's served profiles (no model runs)."""

from __future__ import annotations

import json

import pytest

from tests._bench import load_benchmark
from tests._core_helpers import TRUE_MODEL, make_profile

replay_served = load_benchmark("replay_served")

LENGTHS = (64, 900, 2000, 300, 1500, 128, 2500, 700)


def _result(*, with_log: bool = True) -> dict:
    """A result as the benchmark writes it: the host ran 1.5× slower than calibrated, and the
    first-token overhead was 20 ms; every other request is a held-out row."""
    profile = make_profile()
    log, rows = [], []
    for i, n in enumerate(LENGTHS):
        prefill = 1.5 * TRUE_MODEL.prefill_s(n)
        log.append({"ttft_s": prefill + 0.02, "engine_prefill_s": prefill, "prompt_tokens": n, "evaluated_tokens": n, "cached_tokens": 0})
        if i % 2:
            rows.append({"prompt_tokens": n, "cached_predicted": 0, "measured_ttft_s": prefill + 0.02,
                         "predicted_full_served_s": 1.0, **({"served_log_index": i} if with_log else {})})
    calibration = {"full": {"profile": profile.to_dict()} if with_log else {}}
    model = {"calibration": calibration, "heldout": {"rows": rows}, "accuracy_targets": {"median_pct": 5.0, "p90_pct": 12.0}}
    if with_log:
        model["served_log"] = log
    return {"started_at": "test", "host": {}, "models": {"fake": model}}


def test_a_replay_predicts_each_row_before_its_own_request_is_learned():
    pairs = replay_served.replay(_result()["models"]["fake"], "full")
    assert len(pairs) == len(LENGTHS) // 2
    # the first held-out row comes after one slower request: drift has not followed yet (one
    # ratio of five), so it is predicted short; the last ones are predicted right
    first, last = pairs[0], pairs[-1]
    assert first[0] < 0.8 * first[1]
    assert last[0] == pytest.approx(last[1], rel=0.02)


def test_the_script_prints_recorded_and_replayed_errors(tmp_path, capsys):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(_result()))
    assert replay_served.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "full  +live  recorded" in out and "replayed" in out
    assert "all: 1 served groups, 0 meet their targets" in out  # the first row is predicted 20 %+ short


def test_a_result_without_the_served_log_cannot_be_replayed(tmp_path, capsys):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_result(with_log=False)))
    assert replay_served.main([str(path)]) == 1
    assert "cannot be replayed" in capsys.readouterr().out


def _with_speeds(speeds: list[float]) -> dict:
    """A result whose request ``i`` ran ``speeds[i]`` × the true model's prefill, after a 20 ms
    first-token overhead; every other request a held-out row."""
    result = _result()
    model = result["models"]["fake"]
    rows = []
    for i, (entry, speed) in enumerate(zip(model["served_log"], speeds, strict=True)):
        n = entry["prompt_tokens"]
        entry["engine_prefill_s"] = speed * TRUE_MODEL.prefill_s(n)
        entry["ttft_s"] = entry["engine_prefill_s"] + 0.02
        if i % 2:
            rows.append({"prompt_tokens": n, "evaluated": n, "cached_predicted": 0, "cached_measured": 0, "measured_ttft_s": entry["ttft_s"],
                         "predicted_full_served_s": 1.0, "served_log_index": i})
    model["heldout"]["rows"] = rows
    return model


def test_the_hindsight_fit_meets_a_host_of_one_speed_and_shows_how_far_a_change_of_speed_leaves_it():
    steady = replay_served.hindsight(_with_speeds([1.5] * len(LENGTHS)))
    assert steady is not None and steady["requests_fitted"] == len(LENGTHS)
    assert steady["median_pct"] < 1.0 and steady["first_token_s"] == pytest.approx(0.02, abs=0.005)
    # the same requests, the host 1.6× slower for the second half: one speed cannot fit both
    stepped = replay_served.hindsight(_with_speeds([1.0] * 4 + [1.6] * 4))
    assert stepped["median_pct"] > 10.0


def test_no_hindsight_fit_without_a_served_log():
    assert replay_served.hindsight(_result(with_log=False)["models"]["fake"]) is None


def test_the_script_prints_the_hindsight_fit(tmp_path, capsys):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({**_result(), "models": {"fake": _with_speeds([1.5] * len(LENGTHS))}}))
    assert replay_served.main([str(path)]) == 0
    assert "hindsight fit, one speed for the run" in capsys.readouterr().out


def test_a_static_profile_whose_only_error_is_the_host_s_speed_is_exact_with_its_speed_set_afterwards(tmp_path, capsys):
    model = _with_speeds([1.5] * len(LENGTHS))
    for row in model["heldout"]["rows"]:
        row["predicted_full_s"] = row["measured_ttft_s"] / 1.5  # the right shape, calibrated 1.5x faster
    model["heldout"]["rows"][0]["predicted_full_s"] *= 1.2  # and one prompt's shape 20 % off
    static = replay_served.speed_set_afterwards(model, "full")
    assert static["factor"] == pytest.approx(1.5)
    assert static["recorded"]["median_pct"] == pytest.approx(100 / 3, rel=1e-6)
    assert static["speed_set"]["median_pct"] == pytest.approx(0.0, abs=1e-9)
    assert static["speed_set"]["max_pct"] == pytest.approx(20.0, rel=1e-6)
    assert replay_served.speed_set_afterwards(model, "quick") is None  # no static predictions of it
    path = tmp_path / "result.json"
    path.write_text(json.dumps({**_result(), "models": {"fake": model}}))
    assert replay_served.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "full   static recorded  33.3 /" in out and "its speed set afterwards (×1.50, in-sample)   0.0 /" in out
    assert "static profiles: 1; summed median / p90: recorded 33.3 /" in out


def test_the_signed_error_summary_classes_each_row_and_keeps_the_sign():
    assert [replay_served.prompt_class({"prompt_tokens": n, "cached_predicted": k}) for n, k in
            ((127, 0), (128, 0), (1999, 0), (2000, 0), (300, 200))] == [
        "cold < 128 tokens", "cold 128–1,999", "cold 128–1,999", "cold ≥ 2,000", "after a cached prefix"]
    model = _with_speeds([1.5] * len(LENGTHS))  # held-out rows: 900, 300, 128, 700 tokens, in log order
    model["heldout"]["rows"][3]["cached_predicted"] = 500  # the last one a follow-up turn
    model["heldout"]["rows"].reverse()  # stored out of order: the log's order still pairs them
    pairs = [(2.0, 1.0), (0.5, 1.0), (1.1, 1.0), (0.9, 1.0)]
    by_class = replay_served.signed_by_class(model, pairs)
    assert by_class == {"cold 128–1,999": [100.0, -50.0, pytest.approx(10.0)], "after a cached prefix": [pytest.approx(-10.0)]}


def test_the_script_prints_the_signed_error_by_prompt_class(tmp_path, capsys):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(_result()))
    assert replay_served.main([str(path)]) == 0
    out = capsys.readouterr().out
    # the host ran 1.5x slower than calibrated: the first rows are priced short, none long
    assert "served, replayed: signed error by prompt class" in out
    assert "fake     cold 128–1,999" in out and "leans long in 0 of 1 groups" in out


def test_the_paired_idle_probe_script_pairs_its_runs_and_checks_its_arguments():
    """benchmarks/idle_probes_paired.py (no model run here): pairs are matched by index whatever
    the order they ran in, and a count of pairs below 1 is refused before anything runs."""
    script = load_benchmark("idle_probes_paired")
    runs = [{"pair": 1, "first": False}, {"pair": 0, "first": True}, {"pair": 0, "first": False}, {"pair": 1, "first": True}]
    pairs = script._pairs(runs)
    assert [(a["pair"], a["first"], b["pair"], b["first"]) for a, b in pairs] == [(0, True, 0, False), (1, True, 1, False)]
    for bad in (["--pairs", "0"], ["--compare", "decode"]):
        with pytest.raises(SystemExit) as exc:
            script.main(bad)
        assert exc.value.code == 2
    assert script.ARMS["idle"] == ("on", "off") and script.ARMS["speed"] == ("normalized", "raw")


def test_the_local_speed_bounds_follow_a_step_the_one_speed_fit_cannot():
    stepped = _with_speeds([1.0] * 4 + [1.6] * 4)
    assert replay_served.hindsight(stepped)["median_pct"] > 10.0
    # the shape is fitted with the step taken out: with the speed of the request before each
    # held-out row, every row is exact; with two, the row after one fast and one slow is not
    assert replay_served.local_speed(stepped, 1)["max_pct"] < 1.0
    causal = replay_served.local_speed(stepped, 2)
    assert causal["median_pct"] < 1.0 and causal["max_pct"] > 10.0
    # the step comes right at a held-out row (3): only a look ahead gets that row right (the
    # last row, with nothing after it, is left out)
    late = _with_speeds([1.0] * 3 + [1.6] * 5)
    late["heldout"]["rows"].pop()
    assert replay_served.local_speed(late, 1)["max_pct"] > 30.0
    assert replay_served.local_speed(late, 0, 1)["max_pct"] < 1.0
    assert replay_served.local_speed(_result(with_log=False)["models"]["fake"], 2) is None


def test_the_script_counts_which_bounds_meet_the_targets(tmp_path, capsys):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({**_result(), "models": {"fake": _with_speeds([1.0] * 4 + [1.6] * 4)}}))
    assert replay_served.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "requests before each (causal)" in out
    counts = out.split("per model and run (1), meeting the targets:")[1].split("\n")[0]
    assert "one speed in hindsight 0 (summed median" in counts
    assert "(causal) 0 (summed median" in counts and "(foresight) 0 (summed median" in counts
