"""Idle probes joined at the calibration's speed, or raw: paired zero-wait runs on the real model.

Each pair runs the prediction benchmark's zero-wait path (``prediction_accuracy.zero_wait``:
``trimkit.wrap`` with no stored profile, idle probes on, then ``--zero-wait-requests`` requests
with a pause between them) twice with the same request sequence: once as trimkit runs (an idle
probe's time divided by ``LiveProfile.speed_factor`` before it joins the calibration's samples),
once with the probe joining raw (``speed_factor`` patched to 1, the behaviour before). The order
alternates from pair to pair, so a host that drifts over the run favours neither. Prints and
writes the error of requests after the split (median / p90 APE) per run::

    .venv/bin/python benchmarks/idle_probes_paired.py --model gemma --pairs 4
    .venv/bin/python benchmarks/idle_probes_paired.py --model smollm2 --pairs 3

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
    ap.add_argument("--out", default=None, help="JSON output (default benchmarks/results/idle_probes_paired_<model>.json)")
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
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
            for normalized in ((True, False) if k % 2 == 0 else (False, True)):
                raw = mock.patch.object(LiveProfile, "speed_factor", lambda self, n, c=0: 1.0)
                with contextlib.nullcontext() if normalized else raw:
                    z = pa.zero_wait(name, path, bench, caches, words, "on", args.seed + k)
                runs.append({"pair": k, "normalized": normalized, "late": z["late"], "early": z["early"],
                             "idle": z["idle"], "requests_s": z["requests_s"], "rows": z["rows"]})
                print(f"pair {k} {'normalized' if normalized else 'raw':10}: requests {bench.zero_wait_split + 1}–{bench.zero_wait_requests} "
                      f"median {z['late']['median_pct']:.1f} % p90 {z['late']['p90_pct']:.1f} %; idle probes measured {z['idle'].get('probed')}",
                      flush=True)
    finally:
        caches.close()
    summary = {}
    for normalized in (True, False):
        mine = [r for r in runs if r["normalized"] == normalized]
        summary["normalized" if normalized else "raw"] = {
            "summed_median_pct": sum(r["late"]["median_pct"] for r in mine), "summed_p90_pct": sum(r["late"]["p90_pct"] for r in mine),
            "mean_median_pct": statistics.mean(r["late"]["median_pct"] for r in mine)}
    better = sum(a["late"]["median_pct"] < b["late"]["median_pct"] for a, b in _pairs(runs))
    print(f"normalized: summed median {summary['normalized']['summed_median_pct']:.1f}, p90 {summary['normalized']['summed_p90_pct']:.1f}; "
          f"raw: {summary['raw']['summed_median_pct']:.1f}, {summary['raw']['summed_p90_pct']:.1f}; "
          f"normalized lower median in {better} of {args.pairs} pairs")
    out = Path(args.out) if args.out else HERE / "results" / f"idle_probes_paired_{name}.json"
    out.write_text(json.dumps({"benchmark": "idle_probes_paired", "model": name, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "host": pa.host_facts(), "pairs": args.pairs, "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {out}")
    return 0


def _pairs(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(normalized, raw) per pair."""
    by = {(r["pair"], r["normalized"]): r for r in runs}
    return [(by[(k, True)], by[(k, False)]) for k in sorted({r["pair"] for r in runs})]


if __name__ == "__main__":
    raise SystemExit(main())
