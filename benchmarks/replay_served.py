"""Replay the served profiles of a ``prediction_accuracy.py`` result with today's ``LiveProfile``.

``benchmarks/prediction_accuracy.py`` stores each calibrated profile (samples included) and the
log of every request its served profiles learned from, in order (``served_log``; each held-out
row names its entry). This script feeds that log again to a fresh ``LiveProfile`` of each stored
profile — exactly as the benchmark did — and predicts each held-out prompt before its own entry
is fed, so a change to how profiles learn while serving can be judged on requests measured on a
real host, without running the engines again. Nothing is measured here: the figures are those of
the stored run, predicted anew.

    python benchmarks/replay_served.py benchmarks/results/prediction_accuracy.json [more.json ...]

Prints, per model and profile, the median / p90 absolute % error of the served predictions as
the run recorded them and as replayed now, and the targets the run judged them by; then, over
every group replayed, how many met their targets and the summed medians and p90s, recorded and
replayed (one line to compare two versions of ``LiveProfile`` on the same stored runs). Results
stored before the log was kept (runs 1–10) cannot be replayed.

Per model it also prints the **hindsight fit** (:func:`hindsight`): the cost model and the
first-token overhead fitted, after the run, to every request of its served log (held-out prompts
included), with one speed for the whole run. It is not a prediction (it has seen what it is judged on); it shows how
far a host's changes of speed over the run leave any profile that holds one speed from the
measurements — where its error exceeds the targets, the targets ask for more than one fixed
speed can give on that run, and only following the host (drift) can meet them.

Per profile it also prints the **static profile, its speed set afterwards** (:func:`speed_set_afterwards`):
the static predictions the run recorded, each profile's times one factor (the median ratio
measured / predicted over the held-out rows). What is left is the error of the profile's shape
and of the host's noise; what the factor took away is the host's change of speed between
calibration and the held-out stretch. Where the first is small and the recorded error large,
the calibration's shape was right and its speed was not.

Last, over every file given, the served predictions' **signed error by prompt class**
(:func:`prompt_class`; + is priced long): a shape the profiles as served get wrong shows as a
class whose error leans one way run after run, where the host's noise leans either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trimkit.planning.costs import PrefillSample, error_stats, evaluated_tokens, fit_cost_model  # noqa: E402
from trimkit.planning.drift import LiveProfile  # noqa: E402
from trimkit.profile import Profile  # noqa: E402


def replay(model: dict[str, Any], mode: str) -> list[tuple[float, float]] | None:
    """(predicted, measured) TTFT of each held-out row, served by ``mode``'s profile replayed; None
    when the result lacks what a replay needs."""
    rec = model.get("calibration", {}).get(mode, {})
    log = model.get("served_log")
    if "profile" not in rec or log is None:
        return None
    live = LiveProfile(Profile.from_dict(rec["profile"]))
    rows = [r for r in model["heldout"]["rows"] if "served_log_index" in r]
    by_entry = {r["served_log_index"]: r for r in rows}
    out = []
    for i, m in enumerate(log):
        row = by_entry.get(i)
        if row is not None:
            n, k = row["prompt_tokens"], row["cached_predicted"]
            out.append((live.current.predict_ttft_s(evaluated_tokens(n, k), k), row["measured_ttft_s"]))
        live.observe_first_token(m["ttft_s"], m["engine_prefill_s"], m["prompt_tokens"])
        if m["engine_prefill_s"] is not None and m["evaluated_tokens"]:
            live.observe(m["evaluated_tokens"], m["cached_tokens"] or 0, m["engine_prefill_s"])
    return out


def hindsight(model: dict[str, Any]) -> dict[str, Any] | None:
    """The hindsight fit of one model's run (module docstring), in the shape a profile predicts
    with: the engine's prefill — the cost model of the most thorough stored profile's form and
    attention prior, fitted to llama.cpp's own prefill time of every request in the served log —
    plus the first-token overhead (TTFT less that time), fixed part and per prompt token,
    fitted by least squares over the same requests. Judged on the held-out rows' TTFT. None when
    the result lacks a served log or a stored profile."""
    log = model.get("served_log")
    stored = [model.get("calibration", {}).get(m, {}).get("profile") for m in ("full", "quick", "micro")]
    stored = [p for p in stored if p]
    if not log or not stored:
        return None
    profile = Profile.from_dict(stored[0])
    timed = [m for m in log if m.get("ttft_s") and m.get("engine_prefill_s") and m.get("evaluated_tokens") and m.get("prompt_tokens")]
    if len(timed) < 4:
        return None
    engine = fit_cost_model([PrefillSample(m["evaluated_tokens"], m["cached_tokens"] or 0, m["engine_prefill_s"]) for m in timed],
                            n_batch=profile.model.n_batch, batched=profile.model.per_batch_s > 0,
                            depth_prior_tokens=profile.depth_prior_tokens)
    x = np.array([[1.0, float(m["prompt_tokens"])] for m in timed])
    y = np.array([max(m["ttft_s"] - m["engine_prefill_s"], 0.0) for m in timed])
    fixed, per_token = (max(float(c), 0.0) for c in np.linalg.lstsq(x, y, rcond=None)[0])
    rows = [r for r in model.get("heldout", {}).get("rows", []) if r.get("measured_ttft_s")]

    def predicted(r: dict[str, Any]) -> float:
        cached = r.get("cached_measured") or 0
        new = r.get("evaluated") or evaluated_tokens(r["prompt_tokens"], cached)
        return engine.prefill_s(new, cached) + fixed + per_token * r["prompt_tokens"]

    err = error_stats((predicted(r), r["measured_ttft_s"]) for r in rows)
    return {"requests_fitted": len(timed), "form": engine.name, "first_token_s": fixed, "first_token_per_token_s": per_token,
            **err.to_dict()}


#: the prompt classes of the signed-error summary, in the order printed
PROMPT_CLASSES = ("cold < 128 tokens", "cold 128–1,999", "cold ≥ 2,000", "after a cached prefix")


def prompt_class(row: dict[str, Any]) -> str:
    """The class of a held-out row in the signed-error summary (:data:`PROMPT_CLASSES`)."""
    if row.get("cached_predicted"):
        return PROMPT_CLASSES[3]
    n = row["prompt_tokens"]
    return PROMPT_CLASSES[0] if n < 128 else PROMPT_CLASSES[1] if n < 2000 else PROMPT_CLASSES[2]


def signed_by_class(model: dict[str, Any], pairs: Sequence[tuple[float, float]]) -> dict[str, list[float]]:
    """The signed % errors (+: priced long) of ``pairs`` — :func:`replay`'s, in the order of the
    served log — by :func:`prompt_class` of their held-out rows."""
    rows = sorted((r for r in model["heldout"]["rows"] if "served_log_index" in r), key=lambda r: r["served_log_index"])
    out: dict[str, list[float]] = {}
    for row, (predicted, measured) in zip(rows, pairs, strict=True):
        out.setdefault(prompt_class(row), []).append(100.0 * (predicted - measured) / measured)
    return out


def speed_set_afterwards(model: dict[str, Any], mode: str) -> dict[str, Any] | None:
    """``mode``'s static predictions of the held-out rows as recorded, and times one speed factor
    set afterwards (the median ratio measured / predicted over those rows: in sample, like the
    hindsight fit): ``{"factor", "recorded", "speed_set"}`` (error stats as dicts). None when the
    result has no static predictions for ``mode``."""
    pairs = [(r[f"predicted_{mode}_s"], r["measured_ttft_s"]) for r in model.get("heldout", {}).get("rows", [])
             if r.get(f"predicted_{mode}_s") and r.get("measured_ttft_s")]
    if not pairs:
        return None
    factor = float(np.exp(np.median([np.log(measured / predicted) for predicted, measured in pairs])))
    return {"factor": factor, "recorded": error_stats(pairs).to_dict(),
            "speed_set": error_stats((predicted * factor, measured) for predicted, measured in pairs).to_dict()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="prediction_accuracy JSON files")
    args = ap.parse_args(argv)
    replayed = met = 0
    sums = {"recorded": [0.0, 0.0], "replayed": [0.0, 0.0], "static": [0.0, 0.0], "speed_set": [0.0, 0.0]}
    statics = 0
    by_class: dict[tuple[str, str], list[list[float]]] = {}  # (model, class) → each group's signed errors
    for path in args.results:
        data = json.loads(Path(path).read_text())
        print(f"== {path} ({data.get('started_at')}, commit {data.get('host', {}).get('git_commit')})")
        for name, model in data.get("models", {}).items():
            if "skipped" in model:
                continue
            t = model.get("accuracy_targets", {})
            print(f"{name}: targets median ≤ {t.get('median_pct', float('nan')):.1f} %, p90 ≤ {t.get('p90_pct', float('nan')):.1f} %")
            h = hindsight(model)
            if h is not None:
                print(f"  hindsight fit, one speed for the run ({h['requests_fitted']} requests, in-sample): "
                      f"{h['median_pct']:5.1f} / {h['p90_pct']:5.1f} %")
            for mode in model.get("calibration", {}):
                static = speed_set_afterwards(model, mode)
                if static is not None:
                    statics += 1
                    for key, part in (("static", "recorded"), ("speed_set", "speed_set")):
                        sums[key][0] += static[part]["median_pct"]
                        sums[key][1] += static[part]["p90_pct"]
                    print(f"  {mode:6} static recorded {static['recorded']['median_pct']:5.1f} / {static['recorded']['p90_pct']:5.1f} %   "
                          f"its speed set afterwards (×{static['factor']:.2f}, in-sample) {static['speed_set']['median_pct']:5.1f} / "
                          f"{static['speed_set']['p90_pct']:5.1f} %")
                pairs = replay(model, mode)
                if pairs is None:
                    print(f"  {mode:6} cannot be replayed (no stored profile or served log)")
                    continue
                replayed += 1
                for cls, errs in signed_by_class(model, pairs).items():
                    by_class.setdefault((name, cls), []).append(errs)
                rows = [r for r in model["heldout"]["rows"] if f"predicted_{mode}_served_s" in r]
                was = error_stats((r[f"predicted_{mode}_served_s"], r["measured_ttft_s"]) for r in rows)
                now = error_stats(pairs)
                factor = 2.0 if mode == "micro" else 1.0  # the benchmark judges the provisional profile within 2×
                ok = now.median_pct <= factor * t.get("median_pct", 0) and now.p90_pct <= factor * t.get("p90_pct", 0)
                met += ok
                for key, err in (("recorded", was), ("replayed", now)):
                    sums[key][0] += err.median_pct
                    sums[key][1] += err.p90_pct
                print(f"  {mode:6}+live  recorded {was.median_pct:5.1f} / {was.p90_pct:5.1f} %   replayed {now.median_pct:5.1f} / "
                      f"{now.p90_pct:5.1f} %  (n={now.n})  {'PASS' if ok else 'MISS'}")
    if not replayed:
        print("nothing could be replayed: results stored before the served log was kept", file=sys.stderr)
        return 1
    print(f"all: {replayed} served groups, {met} meet their targets as replayed; summed median / p90: recorded "
          f"{sums['recorded'][0]:.1f} / {sums['recorded'][1]:.1f}, replayed {sums['replayed'][0]:.1f} / {sums['replayed'][1]:.1f}")
    if statics:
        print(f"static profiles: {statics}; summed median / p90: recorded {sums['static'][0]:.1f} / {sums['static'][1]:.1f}, "
              f"their speed set afterwards {sums['speed_set'][0]:.1f} / {sums['speed_set'][1]:.1f}")
    print("served, replayed: signed error by prompt class (+ = priced long; median of all rows, and in how many groups "
          "the group's median leans long)")
    for (name, cls), groups in sorted(by_class.items(), key=lambda kv: (kv[0][0], PROMPT_CLASSES.index(kv[0][1]))):
        rows = [e for g in groups for e in g]
        medians = [statistics.median(g) for g in groups]
        print(f"  {name:8} {cls:21} {statistics.median(rows):+5.1f} %  (n={len(rows)}; leans long in {sum(m > 0 for m in medians)} of "
              f"{len(groups)} groups, group medians {min(medians):+.0f} to {max(medians):+.0f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
