"""Decode speed vs context (issue 12): measured against the profile's prediction, 0–6k tokens.

Each generated token reads the KV cache of every token before it, so on a small model decode
slows as the context grows. Calibration measures decode steps at an empty context and at the
deepest context it holds cached, and the profile predicts tokens/s at any context
(``Profile.decode_tokens_per_s_at``, docs/design.md §2). This sweep sends real chat requests on
the embedded model (in process, the engine's own ``llama_perf`` timings: what the report shows as
the measured decode speed), one context length after another in ascending order — each prompt
extends the previous one, so the 6k prefill is paid once — ``repeats`` times each (the repeats
hit the cache: only their decode costs), and compares the median measured tokens/s with the
prediction for the same prompt and answer length. End-of-sequence is banned so every answer is
``tokens`` long.

Usage:  python benchmarks/phases_decode.py [--model gemma|smollm2|PATH] [--mode full|quick|micro]
                                           [--contexts 0,1000,2000,3000,4000,6000] [--tokens 32]
                                           [--repeats 3] [--out benchmarks/results/phases_decode.json]

Target: median |error| ≤ 10 %. For benchmarks/phases.py: ``decode_sweep(llm, profile, ...)``
returns the rows, ``summary(rows)`` the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trimkit
from trimkit.backends.base import probe_text
from trimkit.backends.llama import LlamaBackend
from trimkit.cli import open_llama

DEFAULT_CONTEXTS = (0, 1000, 2000, 3000, 4000, 6000)
#: the sweep's target: median |prediction error| across the contexts, percent
TARGET_MEDIAN_ERROR_PCT = 10.0
#: the chat template's own tokens around the content (a rough allowance: the actual prompt length is measured)
TEMPLATE_ALLOWANCE = 16


def _content_tokens(llm: Any, n: int) -> list[int]:
    """At least ``n`` tokens of the packaged corpus (repeated as needed), without BOS."""
    base = llm.tokenize(probe_text().encode("utf-8"), add_bos=False, special=False)
    return (base * (n // max(len(base), 1) + 1))[:n]


def _request(backend: LlamaBackend, content: str, params: dict[str, Any]) -> Any:
    return backend.send([{"role": "user", "content": content}], params).drain()


def decode_sweep(llm: Any, profile: trimkit.Profile, contexts: Sequence[int] = DEFAULT_CONTEXTS, tokens: int = 32,
                 repeats: int = 3) -> list[dict[str, Any]]:
    """Measured vs predicted decode speed at each of ``contexts`` (prompt tokens, ascending).

    ``llm``: a ``llama_cpp.Llama`` whose ``n_ctx`` holds ``max(contexts) + tokens`` plus the chat
    template; ``profile``: its calibration (any mode). One row per context:
    ``{"context_tokens"`` (the prompt tokens actually sent), ``"measured_tokens_per_s"`` (the
    median over ``repeats`` requests of ``tokens`` output tokens), ``"predicted_tokens_per_s"``
    (``profile.decode_tokens_per_s_at(prompt, output_tokens=tokens)``), ``"error_pct"``
    (predicted vs measured, signed), ``"target_tokens"``, ``"repeats_tokens_per_s"``,
    ``"seconds"`` (wall time of the context's requests)}. The context's KV cache is reused from
    one length to the next: the cost is one prefill of the longest prompt plus the decodes."""
    backend = LlamaBackend(llm)
    eos = llm.token_eos()
    params = {"max_tokens": tokens, "temperature": 0.0, "logit_bias": {str(eos): -100.0} if eos >= 0 else None}
    corpus = _content_tokens(llm, max(contexts) + 1)
    rows = []
    for target in sorted(contexts):
        t0 = time.perf_counter()
        n = max(target - TEMPLATE_ALLOWANCE, 4)
        content = llm.detokenize(corpus[:n]).decode("utf-8", errors="ignore")
        measured = [_request(backend, content, params) for _ in range(repeats)]
        speeds = [m.decode_tokens_per_s for m in measured if m.decode_tokens_per_s]
        if not speeds:
            raise RuntimeError(f"no decode speed measured at {target} tokens of context")
        prompt = measured[-1].prompt_tokens or n
        out = measured[-1].completion_tokens or tokens
        meas = statistics.median(speeds)
        pred = profile.decode_tokens_per_s_at(int(prompt), output_tokens=int(out))
        rows.append({
            "target_tokens": target,
            "context_tokens": int(prompt),
            "output_tokens": int(out),
            "measured_tokens_per_s": meas,
            "predicted_tokens_per_s": pred,
            "error_pct": (pred - meas) / meas * 100.0 if pred else None,
            "repeats_tokens_per_s": speeds,
            "seconds": time.perf_counter() - t0,
        })
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and max |error_pct| over the rows, the measured slowdown from the shortest to the
    longest context, and whether the median meets :data:`TARGET_MEDIAN_ERROR_PCT`."""
    errors = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None]
    first, last = rows[0], rows[-1]
    median = statistics.median(errors) if errors else None
    return {
        "median_abs_error_pct": median,
        "max_abs_error_pct": max(errors) if errors else None,
        "measured_slowdown_pct": (1.0 - last["measured_tokens_per_s"] / first["measured_tokens_per_s"]) * 100.0,
        "predicted_slowdown_pct": (1.0 - last["predicted_tokens_per_s"] / first["predicted_tokens_per_s"]) * 100.0
        if first["predicted_tokens_per_s"] and last["predicted_tokens_per_s"] else None,
        "target_median_abs_error_pct": TARGET_MEDIAN_ERROR_PCT,
        "result": "PASS" if median is not None and median <= TARGET_MEDIAN_ERROR_PCT else "FAIL",
    }


def _model_path(name: str) -> str | None:
    if name == "gemma":
        return None
    if name == "smollm2":
        from prediction_accuracy import smollm2_path  # benchmarks/ is on sys.path when run as a script

        path, why = smollm2_path()
        if path is None:
            raise SystemExit(why)
        return path
    return name


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma", help="gemma (embedded), smollm2, or a GGUF path")
    ap.add_argument("--mode", default="full", choices=("micro", "quick", "full"), help="the calibration the prediction comes from")
    ap.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "phases_decode.json"))
    args = ap.parse_args(argv)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    started = time.time()
    t0 = time.perf_counter()
    llm = open_llama(_model_path(args.model), n_ctx=max(8192, max(contexts) + args.tokens + 256))
    profile = trimkit.calibrate(llm, mode=args.mode, recalibrate=True, store=False)
    model = profile.decode_model()
    print(f"calibration ({profile.mode}, {profile.calibration_wall_s:.1f} s): decode points "
          + ", ".join(f"{p.tokens_per_s:.1f} tok/s after {p.context_tokens:.0f} (±{p.spread_pct or 0:.0f} %)" for p in profile.decode_points)
          + (f" → {1 / model.base_s:.1f} tok/s at 0, −{model.per_context_s * 1e6:.2f} µs per token of context" if model else ""))
    rows = decode_sweep(llm, profile, contexts, args.tokens, args.repeats)
    print(f"{'context':>8} {'measured':>9} {'predicted':>10} {'error':>8}   repeats (tok/s)")
    for r in rows:
        print(f"{r['context_tokens']:>8} {r['measured_tokens_per_s']:>9.2f} {r['predicted_tokens_per_s']:>10.2f} {r['error_pct']:>+7.1f}%   "
              + " ".join(f"{s:.1f}" for s in r["repeats_tokens_per_s"]))
    s = summary(rows)
    print(f"median |error| {s['median_abs_error_pct']:.1f} % (target ≤ {TARGET_MEDIAN_ERROR_PCT:.0f} %: {s['result']}), "
          f"max {s['max_abs_error_pct']:.1f} %; slowdown {contexts[0]} → {contexts[-1]} tokens: measured {s['measured_slowdown_pct']:.1f} %, "
          f"predicted {s['predicted_slowdown_pct']:.1f} %")
    result = {
        "benchmark": "phases_decode",
        "started_at": started,
        "wall_s": time.perf_counter() - t0,
        "args": vars(args),
        "host": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "profile": {"mode": profile.mode, "calibration_wall_s": profile.calibration_wall_s, "key": profile.key.to_dict(),
                    "decode_points": [p.to_dict() for p in profile.decode_points],
                    "decode_model": None if model is None else {"base_s": model.base_s, "per_context_s": model.per_context_s,
                                                                "note": model.note, "noise_pct": model.noise_pct}},
        "rows": rows,
        "summary": s,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0 if s["result"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
