"""Idle probes joined at the calibration's speed, or raw (or idle probes on, or off): paired zero-wait runs on the real model.

Each pair runs the prediction benchmark's zero-wait path (``prediction_accuracy.zero_wait``:
``trimkit.wrap`` with no stored profile, idle probes on, then ``--zero-wait-requests`` requests
with a pause between them) twice with the same request sequence: once as trimkit runs (an idle
probe's time divided by ``LiveProfile.speed_factor`` before it joins the calibration's samples),
once with the probe joining raw (``speed_factor`` patched to 1, the behaviour before). The order
alternates from pair to pair, so a host that drifts over the run favours neither. Prints and
writes the error of requests after the split (median / p90 APE) per run::

    .venv/bin/python benchmarks/idle_probes_paired.py --model gemma --pairs 4
    .venv/bin/python benchmarks/idle_probes_paired.py --model smollm2 --pairs 3

``--compare idle`` pairs idle probes on (as trimkit runs) with idle probes off instead, on the
same request sequences: the prediction benchmark runs the two minutes apart, on different
stretches of a shared host, so its own on / off figures are no comparison.

Each run takes about 1.5 (Gemma) to 2.5 minutes (SmolLM2) on the 2-core host. Nothing else should
run meanwhile. The comparison is the pairs', not any one run's: one run's error moves by more
than the difference on a noisy host (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import prediction_accuracy as pa  # noqa: E402 - the sibling script of benchmarks/

from trimkit.planning.drift import LiveProfile  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("gemma", "smollm2"), default="gemma")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7000, help="pair k uses seed + k for its request sequence")
    ap.add_argument("--compare", choices=("speed", "idle"), default="speed",
                    help="speed: idle probes at the calibration's speed vs raw; idle: idle probes on vs off")
    ap.add_argument("--out", default=None, help="JSON output (default benchmarks/results/idle_probes_paired_<model>.json; "
                                                "with --compare idle, idle_probes_on_off_<model>.json)")
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    arms = ARMS[args.compare]  # (the arm trimkit runs, the other)
    bench = pa.parse_args([])  # the prediction benchmark's zero-wait settings
    (name, path, why), = pa.model_paths([args.model])
    if why:
        print(f"{name}: skipped — {why}")
        return 1
    caches = pa.CacheDirs()
    os.environ["TRIMKIT_CACHE_DIR"] = str(caches.root / "elsewhere")
    words = pa.heldout_words()
    runs: list[dict[str, Any]] = []
    try:
        for k in range(args.pairs):
            for first in ((True, False) if k % 2 == 0 else (False, True)):
                arm = arms[0] if first else arms[1]
                raw = mock.patch.object(LiveProfile, "speed_factor", lambda self, n, c=0: 1.0)
                with raw if arm == "raw" else contextlib.nullcontext():
                    z = pa.zero_wait(name, path, bench, caches, words, "off" if arm == "off" else "on", args.seed + k)
                runs.append({"pair": k, "arm": arm, "first": first, "late": z["late"], "early": z["early"],
                             "idle": z["idle"], "requests_s": z["requests_s"], "rows": z["rows"]})
                print(f"pair {k} {arm:10}: requests {bench.zero_wait_split + 1}–{bench.zero_wait_requests} "
                      f"median {z['late']['median_pct']:.1f} % p90 {z['late']['p90_pct']:.1f} %; idle probes measured {z['idle'].get('probed')}",
                      flush=True)
    finally:
        caches.close()
    summary = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        summary[arm] = {"summed_median_pct": sum(r["late"]["median_pct"] for r in mine), "summed_p90_pct": sum(r["late"]["p90_pct"] for r in mine),
                        "mean_median_pct": statistics.mean(r["late"]["median_pct"] for r in mine)}
    better = sum(a["late"]["median_pct"] < b["late"]["median_pct"] for a, b in _pairs(runs))
    print(f"{arms[0]}: summed median {summary[arms[0]]['summed_median_pct']:.1f}, p90 {summary[arms[0]]['summed_p90_pct']:.1f}; "
          f"{arms[1]}: {summary[arms[1]]['summed_median_pct']:.1f}, {summary[arms[1]]['summed_p90_pct']:.1f}; "
          f"{arms[0]} lower median in {better} of {args.pairs} pairs")
    stem = "idle_probes_paired" if args.compare == "speed" else "idle_probes_on_off"
    out = Path(args.out) if args.out else HERE / "results" / f"{stem}_{name}.json"
    out.write_text(json.dumps({"benchmark": stem, "compare": args.compare, "model": name, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "host": pa.host_facts(), "pairs": args.pairs, "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {out}")
    return 0


#: the two arms of each comparison: the one trimkit runs first, then the other
ARMS = {"speed": ("normalized", "raw"), "idle": ("on", "off")}


def _pairs(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(the arm trimkit runs, the other) per pair."""
    by = {(r["pair"], r["first"]): r for r in runs}
    return [(by[(k, True)], by[(k, False)]) for k in sorted({r["pair"] for r in runs})]


if __name__ == "__main__":
    raise SystemExit(main())
