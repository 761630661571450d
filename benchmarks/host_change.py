"""When the host changes speed while trimkit serves: how many requests until it follows?

A laptop starts a build, a browser tab spins, a neighbour on a shared host wakes up: the speed
that calibration measured stops holding, for a while or for good. trimkit's profile as served
learns from every request (``LiveProfile``: docs/design.md §2); this benchmark measures how
fast that is, with the budget binding, on the real model:

1. **Calibration** (``--mode``, default quick; recalibrated in an empty cache folder).
   ``--load-during-calibration``: the competing load starts ``--load-at`` (0.4) of the way into the
   mode's time budget and
   stays — a throttle that lasts, the case calibration's steadying (to the middle of a trend it
   measures, docs/design.md §2) prices short; the JSON records the trend and what the end of it
   would have priced instead.
2. **Phases of RAG chats** through one wrapper (``trimkit.wrap(llm, profile=...)``): by default
   calm → loaded → calm, ``--conversations`` chats of ``--turns`` turns each per phase, the
   demo's history and corpus, 4–12 retrieved chunks, per-call budgets cycling through
   ``--budgets``. A phase "loaded" runs ``--load-procs`` competing busy processes (pure Python
   spin loops, started before its first request and stopped after its last).
3. Per phase: llama.cpp's prefill ms/token on a 1,024-token reference prompt at its start (not
   fed to the profile), the requests within budget, and the absolute % error of the served
   prediction against the static one (the calibrated profile, as it left calibration) per
   request — the first requests after a step say how long the profile lags the host.

No targets: the figures say how the served profile follows a step of the host's speed, and
what a step costs in budget misses before it does. Meant for an otherwise idle host.

    python benchmarks/host_change.py [--model PATH] [--load-procs 1] [--load-during-calibration]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import write_results  # noqa: E402 - the sibling module of benchmarks/

SPIN = "while True:\n    pass\n"
#: the reference prompt whose prefill ms/token each phase reports
REFERENCE_TOKENS = 1024
#: a served prediction within this of the measured TTFT counts as "following" the host
FOLLOWING_PCT = 10.0
#: what the report's warning says when the engine runs far slower than calibrated (trimkit.planning.slowdown)
SLOWDOWN_NOTICE = "slower than when it was calibrated"


class Load:
    """``n`` competing busy processes between :meth:`start` and :meth:`stop` (none for ``n == 0``)."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def start(self) -> None:
        if not self.procs:
            self.procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(self.n)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def ape(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured * 100.0


def requests_until_following(rows: list[dict[str, Any]]) -> int | None:
    """How many requests of a phase ran before the served prediction came within
    ``FOLLOWING_PCT`` on two requests in a row (0: from the first; None: never)."""
    for i in range(len(rows) - 1):
        if rows[i]["ape_served_pct"] <= FOLLOWING_PCT and rows[i + 1]["ape_served_pct"] <= FOLLOWING_PCT:
            return i
    return None


def reference_ms_per_token(backend: Any, llm: Any) -> float:
    """llama.cpp's prefill ms/token for a cold ``REFERENCE_TOKENS`` prompt (not learned from)."""
    with backend.lock:
        llm.reset()
    return backend.measure_prefill(REFERENCE_TOKENS, 0) / REFERENCE_TOKENS * 1000.0


def phase_summary(name: str, rows: list[dict[str, Any]], ref_ms: float, load_procs: int) -> dict[str, Any]:
    feasible = [r for r in rows if r["feasible"]]
    served = [r["ape_served_pct"] for r in rows]
    static = [r["ape_static_pct"] for r in rows]
    return {
        "phase": name, "load_procs": load_procs, "requests": len(rows), "reference_ms_per_token": ref_ms,
        "within_budget": sum(1 for r in feasible if r["met"]), "feasible": len(feasible),
        "over_budget_first_3": sum(1 for r in rows[:3] if r["feasible"] and not r["met"]),
        "served_ape_median_pct": statistics.median(served), "static_ape_median_pct": statistics.median(static),
        "served_ape_first_3_pct": served[:3], "static_ape_first_3_pct": static[:3],
        "requests_until_following": requests_until_following(rows),
        "drift_end": rows[-1]["drift"], "slowdown_noted": sum(1 for r in rows if r["slowdown_noted"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded model)")
    ap.add_argument("--mode", default="quick", choices=("micro", "quick", "full"))
    ap.add_argument("--load-procs", type=int, default=1)
    ap.add_argument("--load-during-calibration", action="store_true")
    ap.add_argument("--load-at", type=float, default=0.4, help="with --load-during-calibration: when the load starts, "
                    "as a share of the mode's time budget (default 0.4)")
    ap.add_argument("--phases", default=None, help="comma-separated calm/loaded (default calm,loaded,calm; "
                    "with --load-during-calibration loaded,calm)")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--budgets", default="0.7,1.0,1.5,2.5")
    ap.add_argument("--n-threads-batch", type=int, default=None, help="llama.cpp's prefill threads (default: llama-cpp-python's)")
    ap.add_argument("--n-threads", type=int, default=None, help="llama.cpp's decode threads (default: llama-cpp-python's)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    phases = (args.phases or ("loaded,calm" if args.load_during_calibration else "calm,loaded,calm")).split(",")
    if any(p not in ("calm", "loaded") for p in phases):
        ap.error(f"--phases: calm or loaded, got {phases}")
    if args.load_procs < 0:
        ap.error("--load-procs: 0 or more")
    budgets = [float(b) for b in args.budgets.split(",")]
    out = args.out or str(HERE / "results" / ("host_change_throttled_calibration.json" if args.load_during_calibration else "host_change.json"))
    os.environ["TRIMKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="trimkit-host-change-")

    import trimkit
    from trimkit.backends.llama import LlamaBackend
    from trimkit.calibration_schedule import get_mode
    from trimkit.console import open_llama
    from trimkit.demo import SYSTEM, load_corpus, load_history, load_questions
    from trimkit.planning.costs import evaluated_tokens

    threads = {k: v for k, v in (("n_threads", args.n_threads), ("n_threads_batch", args.n_threads_batch)) if v is not None}
    llm = open_llama(args.model, 8192, **threads)
    backend = LlamaBackend(llm)
    load = Load(args.load_procs)
    started_at: list[float] = []

    def start_load() -> None:
        load.start()
        started_at.append(time.perf_counter())

    # calibration sizes its schedule as it goes (its progress total changes): the load starts at
    # a share of the mode's time budget instead
    timer = threading.Timer(args.load_at * get_mode(args.mode).budget_s, start_load) if args.load_during_calibration else None
    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            cal_warnings.append(record.getMessage())

    cal_warnings: list[str] = []
    kept = Kept(logging.WARNING)
    logging.getLogger("trimkit").addHandler(kept)
    t0 = time.perf_counter()
    if timer is not None:
        timer.start()
    try:
        profile = trimkit.calibrate(backend, mode=args.mode, recalibrate=True)
    except BaseException:
        if timer is not None:
            timer.cancel()
        load.stop()
        raise
    if timer is not None:
        timer.cancel()
        timer.join()
    logging.getLogger("trimkit").removeHandler(kept)
    cal_s = time.perf_counter() - t0
    trend = profile.alternatives.get("host_trend")
    when = f" (load started at {started_at[0] - t0:.1f} s)" if started_at else ""
    seen = "none measured" if trend is None else f"{trend['pct_per_10_s']:+.1f} % per 10 s over {trend['pairs']} pairs"
    print(f"{args.mode} calibration {cal_s:.1f} s{when}: {profile.model}; host trend {seen}")
    end_factor = 1.0
    if trend is not None:
        from trimkit.host_trend import HostTrend

        ht = HostTrend(**{k: trend[k] for k in ("log_per_s", "pairs", "t_stat", "first_s", "last_s")})
        end_factor = ht.factor(ht.middle_s, ht.last_s)  # what steadying to the end would have multiplied by

    corpus, history, questions = load_corpus(), load_history(), load_questions()
    by_id = {d["id"]: d for d in corpus}
    rng = random.Random(args.seed)
    eos = llm.token_eos()
    params = {"max_tokens": 8, "temperature": 0.0, "logit_bias": {str(eos): -100.0} if eos >= 0 else None}
    chat = trimkit.wrap(llm, profile=profile, backend=backend)
    rows: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    qi = conv_no = 0
    try:
        for pi, phase in enumerate(phases):
            n_load = args.load_procs if phase == "loaded" else 0
            if n_load:
                load.start()
                time.sleep(1.0)  # the competing processes are running
            else:
                load.stop()
            ref = reference_ms_per_token(backend, llm)
            print(f"phase {pi + 1} ({phase}, {n_load} competing processes): reference prefill {ref:.2f} ms/token")
            phase_rows: list[dict[str, Any]] = []
            for _ in range(args.conversations):
                n_hist = rng.choice([0, 6, 12, 20])
                n_chunks = rng.choice([4, 8, 12])
                convo = [{"role": "system", "content": SYSTEM}, *history[:n_hist]]
                with backend.lock:
                    llm.reset()  # a new conversation starts cold (harness only; trimkit never resets)
                for turn in range(args.turns):
                    budget = budgets[(conv_no + turn) % len(budgets)]
                    q = questions[qi % len(questions)]
                    qi += 1
                    answer = by_id[q["doc_id"]]
                    others = [d for d in corpus if d["id"] != q["doc_id"]]
                    chunks = [trimkit.Chunk(text=answer["text"], id=answer["id"]),
                              *(trimkit.Chunk(text=d["text"], id=d["id"]) for d in rng.sample(others, n_chunks - 1))]
                    rng.shuffle(chunks)
                    convo.append({"role": "user", "content": q["question"]})
                    drift_before = chat.pipeline.profile.drift
                    res = chat.create_chat_completion(messages=convo, rag_chunks=chunks, ttft_budget_s=budget, **params)
                    r = chat.last_report
                    cached = r.cached_tokens_predicted if r.cached_tokens_predicted is not None else (r.cached_tokens or 0)
                    static = profile.predict_ttft_s(evaluated_tokens(r.prompt_tokens, cached), cached)
                    row = {
                        "phase": pi + 1, "kind": phase, "load_procs": n_load, "conversation": conv_no, "turn": turn,
                        "budget_s": budget, "prompt_tokens_before": r.prompt_tokens_before, "prompt_tokens": r.prompt_tokens,
                        "cached_tokens": r.cached_tokens, "cached_predicted": cached, "feasible": r.feasible, "trimmed": r.trimmed,
                        "met": r.budget_met, "predicted_ttft_s": r.predicted_ttft_s, "measured_ttft_s": r.measured_ttft_s,
                        "static_ttft_s": static, "end_steadied_ttft_s": static * end_factor, "drift": drift_before,
                        "safety_margin": r.safety_margin, "ape_served_pct": ape(r.predicted_ttft_s, r.measured_ttft_s),
                        "ape_static_pct": ape(static, r.measured_ttft_s), "ape_end_pct": ape(static * end_factor, r.measured_ttft_s),
                        "slowdown_noted": any(SLOWDOWN_NOTICE in w for w in r.warnings), "warnings": list(r.warnings),
                    }
                    phase_rows.append(row)
                    print(f"  {len(phase_rows):3d} budget {budget:3.1f} s  {r.prompt_tokens_before:5d}→{r.prompt_tokens:5d} tok "
                          f"(cached {r.cached_tokens or 0:4d})  predicted {r.predicted_ttft_s:6.3f} s  measured {r.measured_ttft_s:6.3f} s "
                          f"{'met ' if r.budget_met else 'MISS'}  error {row['ape_served_pct']:5.1f} % (static {row['ape_static_pct']:5.1f} %) "
                          f"drift {drift_before:.2f}{'  [slowdown noted]' if row['slowdown_noted'] else ''}")
                    convo.append({"role": "assistant", "content": res["choices"][0]["message"]["content"] or "..."})
                conv_no += 1
            rows += phase_rows
            summaries.append(phase_summary(phase, phase_rows, ref, n_load))
    finally:
        load.stop()

    base = next((s["reference_ms_per_token"] for s in summaries if s["load_procs"] == 0), summaries[0]["reference_ms_per_token"])
    print()
    print(f"{'phase':<12} {'ref ms/tok':>10} {'×calm':>6} {'in budget':>10} {'misses 1-3':>10} {'served med':>10} {'static med':>10} "
          f"{'served 1st 3':>20} {'until ≤10 %':>11} {'drift end':>9} {'noted':>5}")
    for i, s in enumerate(summaries):
        firsts = "/".join(f"{v:.0f}" for v in s["served_ape_first_3_pct"])
        until = "never" if s["requests_until_following"] is None else str(s["requests_until_following"])
        print(f"{i + 1} {s['phase']:<10} {s['reference_ms_per_token']:10.2f} {s['reference_ms_per_token'] / base:6.2f} "
              f"{s['within_budget']:>4}/{s['feasible']:<5} {s['over_budget_first_3']:>10} {s['served_ape_median_pct']:9.1f}% "
              f"{s['static_ape_median_pct']:9.1f}% {firsts:>20} {until:>11} {s['drift_end']:9.2f} {s['slowdown_noted']:>5}")
    if trend is not None:
        first = [r for r in rows if r["phase"] == 1][:3]
        middle = ", ".join(f"{r['ape_static_pct']:.0f}" for r in first)
        end = ", ".join(f"{r['ape_end_pct']:.0f}" for r in first)
        print(f"calibration steadied to the middle of its trend; to its end the static profile would have priced "
              f"×{end_factor:.2f}: first 3 requests' error {middle} % (middle) vs {end} % (end)")
    from prediction_accuracy import host_facts  # the sibling script of benchmarks/

    write_results(out, {
        "benchmark": "host_change", "args": vars(args), "model": args.model or "embedded", "host": host_facts(),
        "calibration": {"mode": args.mode, "wall_s": cal_s, "load_started_s": started_at[0] - t0 if started_at else None,
                        "model": profile.model.to_dict(), "host_trend": trend, "end_factor": end_factor, "warnings": cal_warnings},
        "following_pct": FOLLOWING_PCT, "phases": summaries, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
