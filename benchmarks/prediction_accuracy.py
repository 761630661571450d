"""How well does trimkit predict TTFT on this host?

Calibrates the embedded model (quick and full, timed), then measures TTFT for held-out chat
prompts it did not calibrate on — lengths spread from 32 to 4096 tokens, built from other text
than the calibration probes — cold and with a cached prefix, and compares each with the
prediction. Prints median and p90 absolute percentage error, calibration wall times and decode
tokens/s, and writes the same figures as JSON.

    python benchmarks/prediction_accuracy.py [--out benchmarks/results/prediction_accuracy.json] [--repeats 2]

Targets (2-core machine): median error ≤ 5 %, p90 ≤ 12 %; quick calibration ≤ 10 s, full ≤ 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from trimkit.planning.costs import quantile as percentile  # noqa: E402


def build_text(tokenizer, target_tokens: int, words: list[str], rng: random.Random) -> list[dict]:
    """A single-user-message chat whose rendered prompt has ~target_tokens tokens."""
    start = rng.randrange(len(words))
    def msgs(n_words: int) -> list[dict]:
        body = " ".join(words[(start + i) % len(words)] for i in range(n_words))
        return [{"role": "user", "content": body}]
    n = max(target_tokens // 2, 1)
    for _ in range(6):
        got = len(tokenizer.prompt_tokens(msgs(n)))
        if abs(got - target_tokens) <= 2:
            break
        n = max(1, int(n * target_tokens / got) + (1 if got < target_tokens else -1))
    return msgs(n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "results" / "prediction_accuracy.json"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=8192)
    args = ap.parse_args()
    os.environ.setdefault("TRIMKIT_CACHE_DIR", tempfile.mkdtemp(prefix="trimkit-bench-"))

    import trimkit
    from trimkit.backends.llama import LlamaBackend
    from trimkit.cli import open_llama
    from trimkit.demo import load_history, load_questions

    llm = open_llama(None, args.n_ctx)
    backend = LlamaBackend(llm)

    t0 = time.perf_counter()
    quick = trimkit.calibrate(backend, quick=True, recalibrate=True, store=False)
    quick_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = trimkit.calibrate(backend, quick=False, recalibrate=True, store=False)
    full_wall = time.perf_counter() - t0
    print(f"calibration wall time: quick {quick_wall:.1f} s (target ≤ 10), full {full_wall:.1f} s (target ≤ 30)")
    print(f"full model: {full.model}  held-out (LOO) median {full.error.median_pct:.1f} % p90 {full.error.p90_pct:.1f} %")

    # held-out text: the demo conversation and questions, not the calibration corpus
    words = " ".join(m["content"] for m in load_history()).split() + " ".join(q["question"] for q in load_questions()).split()
    rng = random.Random(7)
    eos_bias = {str(llm.token_eos()): -100.0}
    params = {"max_tokens": 2, "temperature": 0.0, "logit_bias": eos_bias}
    rows = []

    def measure(messages, kind, prefix=None):
        tokens = backend.tokenizer.prompt_tokens(messages)
        with backend.lock:
            if prefix is None:
                llm.reset()  # benchmark harness: a cold start (trimkit itself never resets)
        if prefix is not None:
            backend.send(prefix, params).drain()  # puts the prefix in the KV cache
        cached = backend.predict_cached_tokens(tokens)
        m = backend.send(messages, params, prompt_tokens=tokens).drain()
        ttft = m.ttft_s if m.ttft_s is not None else m.first_output_s
        row = {
            "kind": kind,
            "prompt_tokens": len(tokens),
            "cached_predicted": cached,
            "cached_measured": m.cached_tokens,
            "evaluated": m.evaluated_tokens,
            "measured_ttft_s": ttft,
            "engine_prefill_s": m.engine_prefill_s,
            "predicted_full_s": full.predict_ttft_s(len(tokens) - cached, cached),
            "predicted_quick_s": quick.predict_ttft_s(len(tokens) - cached, cached),
            "decode_tokens_per_s": m.decode_tokens_per_s,
        }
        for p in ("full", "quick"):
            row[f"ape_{p}_pct"] = abs(row[f"predicted_{p}_s"] - ttft) / ttft * 100
        rows.append(row)
        print(f"  {kind:6} {len(tokens):5d} tok (cached {cached:4d}/{m.cached_tokens:4d})  measured {ttft*1000:8.1f} ms  "
              f"predicted {row['predicted_full_s']*1000:8.1f} ms  error {row['ape_full_pct']:5.1f} %")

    cold_lengths = [32, 48, 90, 150, 240, 380, 600, 900, 1300, 1800, 2500, 3200, 4096]
    print("held-out prompts, cold:")
    for _ in range(args.repeats):
        for n in cold_lengths:
            measure(build_text(backend.tokenizer, n, words, rng), "cold")
    print("held-out prompts, with a cached prefix:")
    history = load_history()
    for _ in range(args.repeats):
        for n_msgs, new_words in ((3, 40), (9, 120), (15, 60), (23, 300), (29, 30)):
            prefix = history[:n_msgs]  # odd length: ends with a user message
            follow = prefix + [{"role": "assistant", "content": "Noted."},
                               {"role": "user", "content": " ".join(words[rng.randrange(len(words) - new_words):][:new_words])}]
            measure(follow, "cached", prefix=prefix)

    def stats(sel, key):
        vals = [r[key] for r in rows if sel(r)]
        return {"n": len(vals), "median_pct": statistics.median(vals), "p90_pct": percentile(vals, 0.9), "max_pct": max(vals)}

    result = {
        "host": {"cpu": full.key.cpu, "python": platform.python_version(), "engine": full.key.engine_version},
        "calibration": {
            "quick_wall_s": quick_wall, "full_wall_s": full_wall,
            "full_model": full.model.to_dict(), "full_heldout_loo": full.error.to_dict(),
            "quick_model": quick.model.to_dict(), "quick_heldout_loo": quick.error.to_dict(),
            "alternatives": full.alternatives,
            "first_token_s": full.first_token_s,
        },
        "decode_tokens_per_s": {"calibrated": full.decode_tokens_per_s,
                                "requests_median": statistics.median([r["decode_tokens_per_s"] for r in rows if r["decode_tokens_per_s"]] or [float("nan")])},
        "error_full_profile": {"all": stats(lambda r: True, "ape_full_pct"), "cold": stats(lambda r: r["kind"] == "cold", "ape_full_pct"),
                               "cached": stats(lambda r: r["kind"] == "cached", "ape_full_pct")},
        "error_quick_profile": {"all": stats(lambda r: True, "ape_quick_pct")},
        "cached_prediction_exact": sum(r["cached_predicted"] == r["cached_measured"] for r in rows if r["kind"] == "cached"),
        "cached_requests": sum(r["kind"] == "cached" for r in rows),
        "targets": {"median_pct": 5, "p90_pct": 12, "quick_wall_s": 10, "full_wall_s": 30},
        "rows": rows,
    }
    e = result["error_full_profile"]["all"]
    q = result["error_quick_profile"]["all"]
    print()
    print(f"TTFT prediction error (full profile), {e['n']} held-out requests: median {e['median_pct']:.1f} % (target ≤ 5), "
          f"p90 {e['p90_pct']:.1f} % (target ≤ 12), max {e['max_pct']:.1f} %")
    for kind in ("cold", "cached"):
        k = result["error_full_profile"][kind]
        print(f"  {kind:6}: median {k['median_pct']:.1f} %  p90 {k['p90_pct']:.1f} %  (n={k['n']})")
    print(f"TTFT prediction error (quick profile): median {q['median_pct']:.1f} %  p90 {q['p90_pct']:.1f} %")
    print(f"cached-prefix prediction exact in {result['cached_prediction_exact']}/{result['cached_requests']} requests")
    print(f"calibration: quick {quick_wall:.1f} s, full {full_wall:.1f} s")
    print(f"decode: {full.decode_tokens_per_s:.1f} tokens/s calibrated, {result['decode_tokens_per_s']['requests_median']:.1f} tokens/s in requests")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
