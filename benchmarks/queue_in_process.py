"""In-process queue check (issue 11, item 1): N threads on ONE wrapped Llama.

Each thread holds a conversation (system prompt, growing history, 2-5 retrieved chunks per turn
from the demo corpus) and sends its turns back to back (a short seeded think time between
them), all threads starting together. No TTFT budget: this measures prediction, not trimming.

For every request: the TTFT the caller felt (report.measured_ttft_s = measurement.queue_s, the
wait for the engine, + measurement.ttft_s) against
  - with the queue term:    report.predicted_ttft_s (the predicted wait + the prompt's TTFT)
  - without the queue term: report.predicted_ttft_s - report.queue_wait_predicted_s
APE = |predicted - measured| / measured; the median over all requests and over the queued ones
(measured wait >= 1 ms).

Usage:  python benchmarks/queue_in_process.py [--threads 4] [--turns 5] [--max-tokens 32] [--json FILE]

Target: median APE with the queue term <= 15 %. Measured figures: docs/scaling.md.
For benchmarks/fleet.py: ``queue_prediction_check(llm, profile, threads=4, turns=5)`` returns the
dict printed below.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from typing import Any

import trimkit
from trimkit.cli import load_corpus, load_questions

SYSTEM = "You answer questions about the town of Marrowby. Answer in full sentences, with detail."


def _ape(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas * 100.0


def queue_prediction_check(llm: Any, profile: Any, *, threads: int = 4, turns: int = 5, max_tokens: int = 32,
                           seed: int = 0, think_s: float = 0.3, join_s: float = 900.0) -> dict[str, Any]:
    """Run ``threads`` conversations of ``turns`` turns at once on one wrapped ``llm``; the
    prediction error of the felt TTFT with and without the queue term (see the module docstring)."""
    chat = trimkit.wrap(llm, profile=profile, summarizer=None)
    corpus = load_corpus()
    questions = load_questions()
    start = threading.Barrier(threads, timeout=join_s)
    rows: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def conversation(t: int) -> None:
        rng = random.Random(seed * 1000 + t)
        history: list[dict[str, str]] = []
        try:
            start.wait()
            for k in range(turns):
                q = questions[(t * turns + k) % len(questions)]
                chunks = [trimkit.Chunk(text=d["text"], id=d["id"]) for d in rng.sample(corpus, rng.randint(2, 5))]
                messages = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": q["question"]}]
                out = chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=max_tokens, temperature=0.0)
                answer = out["choices"][0]["message"]["content"] or ""
                history += [{"role": "user", "content": q["question"]}, {"role": "assistant", "content": answer}]
                time.sleep(rng.uniform(0.0, think_s))
        except BaseException as exc:  # noqa: BLE001
            with lock:
                errors.append(exc)

    t0 = time.perf_counter()
    workers = [threading.Thread(target=conversation, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(join_s)
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    for r in chat.reports:
        meas = r.measured_ttft_s
        if meas is None or meas <= 0:
            continue
        wait = r.queue_wait_predicted_s or 0.0
        rows.append({
            "measured_ttft_s": meas,
            "engine_ttft_s": r.engine_ttft_s,
            "queue_wait_s": r.queue_wait_s,
            "queue_wait_predicted_s": wait,
            "queue_ahead": r.queue_ahead,
            "predicted_ttft_s": r.predicted_ttft_s,
            "predicted_without_queue_s": r.predicted_ttft_s - wait,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "cached_tokens_predicted": r.cached_tokens_predicted,
            "completion_tokens": r.completion_tokens,
        })

    def summary(sel: list[dict[str, Any]]) -> dict[str, Any]:
        if not sel:
            return {"n": 0}
        with_q = [_ape(x["predicted_ttft_s"], x["measured_ttft_s"]) for x in sel]
        without_q = [_ape(x["predicted_without_queue_s"], x["measured_ttft_s"]) for x in sel]
        waits = [x["queue_wait_s"] for x in sel]
        wait_err = [abs(x["queue_wait_predicted_s"] - x["queue_wait_s"]) / x["measured_ttft_s"] * 100 for x in sel]
        return {
            "n": len(sel),
            "median_ape_with_queue_pct": statistics.median(with_q),
            "median_ape_without_queue_pct": statistics.median(without_q),
            "p90_ape_with_queue_pct": sorted(with_q)[int(0.9 * (len(with_q) - 1))],
            "median_measured_wait_s": statistics.median(waits),
            "median_wait_error_pct_of_ttft": statistics.median(wait_err),
        }

    queued = [x for x in rows if x["queue_wait_s"] >= 0.001]
    return {
        "threads": threads,
        "turns": turns,
        "max_tokens": max_tokens,
        "wall_s": wall,
        "decode_tokens_per_s_profile": chat.profile.decode_tokens_per_s,
        "all": summary(rows),
        "queued": summary(queued),
        "requests": rows,
        "lost": threads * turns - len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    llm = trimkit.default_llama("gemma", n_ctx=args.n_ctx)
    profile = trimkit.calibrate(llm, mode="quick", store=False)
    out = queue_prediction_check(llm, profile, threads=args.threads, turns=args.turns, max_tokens=args.max_tokens, seed=args.seed)
    short = {k: v for k, v in out.items() if k != "requests"}
    print(json.dumps(short, indent=2))
    for x in out["requests"]:
        print(f"  ahead={x['queue_ahead']} wait pred {x['queue_wait_predicted_s']:.3f} meas {x['queue_wait_s']:.3f} | "
              f"felt pred {x['predicted_ttft_s']:.3f} meas {x['measured_ttft_s']:.3f} (engine {x['engine_ttft_s']:.3f}) | "
              f"prompt {x['prompt_tokens']} cached {x['cached_tokens']}/{x['cached_tokens_predicted']} out {x['completion_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
