"""What OpenTelemetry costs per request: trimkit.otel on (the real SDK, an in-memory span exporter
with a simple processor — every span exported as the request ends — and an in-memory metric
reader) against off, on one wrapped ``Llama`` (the embedded model), a short prompt.

``N`` pairs interleaved in one run, the order within each pair random, after warm-up calls; each
request decodes 4 tokens (EOS banned, so both arms decode as many). The same wrapper serves both
arms: "on" differs only by the installed observer. It prints and writes the medians, their
ratio, the median per-pair difference (target: ≤ 2 % or ≤ 1 ms, whichever is larger) and the
observer's own time per request, timed around the observer itself (the spans, the metrics).

    python benchmarks/observability.py [--pairs 60] [--out PATH]

About a minute on the project's 2-core machine for N = 60.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import write_results  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

import trimkit  # noqa: E402
import trimkit.otel  # noqa: E402
from trimkit.report import add_observer, remove_observer  # noqa: E402

PROMPT = [{"role": "user", "content": "Name a colour."}]
RATIO_TARGET = 1.02
MS_TARGET = 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "results" / "observability.json"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    llm = trimkit.default_llama("gemma", n_ctx=2048, verbose=False)
    chat = trimkit.wrap(llm, ttft_budget_s=5.0)
    params = {"max_tokens": 4, "temperature": 0.0, "logit_bias": {llm.token_eos(): -1e9}}

    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    inst = trimkit.otel.instrument(tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader]))
    remove_observer(inst)
    observer_s: list[float] = []

    def timed(c: object) -> None:
        t0 = time.perf_counter()
        inst(c)  # type: ignore[arg-type]
        observer_s.append(time.perf_counter() - t0)

    def one(on: bool) -> float:
        if on:
            add_observer(timed)
        t0 = time.perf_counter()
        try:
            chat.create_chat_completion(messages=PROMPT, **params)
        finally:
            remove_observer(timed)
        return time.perf_counter() - t0

    for on in (False, True, False, True):  # warm-up
        one(on)
    observer_s.clear()
    spans.clear()
    times: dict[bool, list[float]] = {False: [], True: []}
    diffs: list[float] = []
    for _ in range(args.pairs):
        order = [False, True]
        rng.shuffle(order)
        got = {on: one(on) for on in order}
        for on, s in got.items():
            times[on].append(s)
        diffs.append(got[True] - got[False])
    off_s, on_s = statistics.median(times[False]), statistics.median(times[True])
    diff_ms = statistics.median(diffs) * 1000
    ratio = on_s / off_s
    obs_ms = statistics.median(observer_s) * 1000
    allowed_ms = max(MS_TARGET, (RATIO_TARGET - 1) * off_s * 1000)
    result = {
        "benchmark": "observability", "pairs": args.pairs, "seed": args.seed, "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": os.getloadavg()[0], "prompt_tokens": chat.last_report.prompt_tokens, "decode_tokens": 4,
        "off_median_s": off_s, "on_median_s": on_s, "ratio": ratio, "median_pair_difference_ms": diff_ms,
        "observer_median_ms": obs_ms, "observer_p90_ms": statistics.quantiles(observer_s, n=10)[-1] * 1000,
        "spans_exported": len(spans.get_finished_spans()), "target": f"≤ {RATIO_TARGET - 1:.0%} or ≤ {MS_TARGET:g} ms",
        "met": diff_ms <= allowed_ms, "met_by_observer_time": obs_ms <= allowed_ms,
        "otel_sdk": __import__("importlib.metadata").metadata.version("opentelemetry-sdk"),
    }
    print(f"{args.pairs} pairs, a {result['prompt_tokens']}-token prompt, 4 tokens decoded (load average {result['load_avg_1m_at_end']:.1f})")
    print(f"  off: median {off_s * 1000:.1f} ms   on: median {on_s * 1000:.1f} ms   ratio {ratio:.3f}")
    print(f"  median per-pair difference {diff_ms:+.2f} ms; the observer itself: median {obs_ms:.3f} ms, "
          f"p90 {result['observer_p90_ms']:.3f} ms ({result['spans_exported']} spans exported)")
    print(f"  target {result['target']}: {'met' if result['met'] else 'MISSED'} (pair difference), "
          f"{'met' if result['met_by_observer_time'] else 'MISSED'} (observer time)")
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
