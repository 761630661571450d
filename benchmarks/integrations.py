"""The RAG QA set of "Keep the answer" through LangChain, LlamaIndex and trimkit directly: the same
answers kept, the same budgets met, and what each framework's trimkit layer costs per request.

Every path runs on ONE ``llama_cpp.Llama`` (the embedded model, ``n_ctx`` 8192) with the same
calibrated profile, and sends the same requests (``benchmarks/rag_qa.py``: a records-assistant chat
with tool turns, 8–16 retrieved chunks, the answer sentence in one of them) under the same budgets
(shares of each request's predicted untrimmed TTFT, cold):

- ``direct``: ``trimkit.wrap(llm).create_chat_completion(messages=..., rag_chunks=[Chunk | str, ...])``;
- ``langchain``: ``TrimmedChatModel(ChatLlamaCpp over that Llama).invoke(messages, rag_chunks=[Document, ...])``
  — the history as LangChain messages (tool calls and tool results included), the chunks as
  ``Document`` (id, and ``metadata["score"]`` where the set has scores);
- ``llamaindex…``: the paths ``benchmarks/integrations_llamaindex.py`` offers (``ARMS``,
  ``run_llamaindex_arm``: the interface agreed in the project's issue 13 notes).

Every send is cold (the KV cache is emptied right before it) with ``max_tokens=2``; jobs, and paths
within a job, run in a random order so that drift hits them alike. Per path it prints the share of
sends whose messages held the answer sentence, how many met their budget (measured TTFT), the
measured budget use, how often the chunks it sent were those the direct path sent for the same
job (the sends follow one another, and each measured request moves the engine's drift and learned
margin, so this differs for reasons of state as well), and — for LangChain — whether the two paths
plan the same from the SAME engine state (both prepared, cold, nothing sent in between); and the time per request
outside the model, split into trimkit's planning (``prepare``: validation, planning, exact count),
the integration layer's own code (``layer``: converting the framework's documents and messages,
finding a context, attaching and emitting the report; target ≤ 5 ms) and the framework's own
(the rest of the wall time outside the model: LangChain's callbacks and message conversion).

    python benchmarks/integrations.py [--quick] [--seed 7] [--requests 10] [--out PATH]
    python benchmarks/integrations.py --overhead 60 [--out PATH]

``--overhead N`` measures only what the wrapper adds per call over the raw model: ``ChatLlamaCpp``
and ``TrimmedChatModel`` around it, on one ``Llama``, a short prompt (``OVERHEAD_PROMPT``, 4
tokens decoded, EOS banned so both decode as many), ``N`` pairs interleaved in one run (the
order within each pair random), after warm-up calls. It prints and writes the medians, their
ratio, the median per-pair difference (target: ratio ≤ ``OVERHEAD_RATIO_TARGET`` or difference ≤
``OVERHEAD_MS_TARGET`` ms, whichever is larger) and what the difference is made of (trimkit's
planning, the integration layer). About 1 minute on the project's 2-core machine for N = 60.

About 5–7 minutes on the project's idle 2-core machine (``--quick``: about 2); it prints its
predicted duration first.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rag_qa  # noqa: E402
from _results import write_results  # noqa: E402 - the sibling module of benchmarks/
from rag_answer_kept import median, open_model, pct, share_text  # noqa: E402

LAYER_TARGET_MS = 5.0
#: what every path's trimkit wrapper is given besides the profile: nothing runs in the
#: background between or during the measured requests (a one-shot cold request never uses a summary)
OPTIONS = {"summarizer": None}
FRAMEWORKS = ("langchain-core", "langchain-community", "llama-index-core", "llama-index-llms-llama-cpp")


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def kept_ids(messages: list[dict[str, Any]], ids: list[str]) -> list[str]:
    """The chunks the last user message holds (placed as ``[id] text`` by trimkit's chunk template)."""
    last = next((m for m in reversed(messages) if m.get("role") == "user"), {})
    text = rag_qa.message_texts([last])
    return [i for i in ids if f"[{i}] " in text]


# --------------------------------------------------------------------------------------------
# the paths: each sends one request and returns the agreed dict
# --------------------------------------------------------------------------------------------
class Direct:
    def __init__(self, llm: Any, backend: Any, profile: Any) -> None:
        import trimkit

        self.chat = trimkit.wrap(llm, profile=profile, backend=backend, **OPTIONS)

    def send(self, req: dict[str, Any], budget_s: float, params: dict[str, Any], reset: Callable[[], None]) -> dict[str, Any]:
        import trimkit

        chunks = rag_qa.rag_chunks(req, trimkit.Chunk)
        reset()
        t0 = time.perf_counter()
        out = self.chat.create_chat_completion(messages=req["messages"], rag_chunks=chunks, ttft_budget_s=budget_s, **params)
        wall = time.perf_counter() - t0
        prepared = self.chat.last_prepared
        return {"report": self.chat.last_report, "messages_sent": list(prepared.messages), "wall_s": wall, "layer_s": 0.0,
                "prepare_s": prepared.prepare_s, "text": out["choices"][0]["message"]["content"]}


class LangChain:
    """``TrimmedChatModel`` over a ``ChatLlamaCpp`` holding the shared Llama (``model_construct``:
    a ``ChatLlamaCpp(model_path=...)`` would load a second copy of the model)."""

    def __init__(self, llm: Any, profile: Any, params: dict[str, Any]) -> None:
        from langchain_community.chat_models import ChatLlamaCpp

        from trimkit.integrations.langchain import TrimmedChatModel

        inner = ChatLlamaCpp.model_construct(client=llm, model_path=str(getattr(llm, "model_path", "")), max_tokens=params["max_tokens"],
                                             temperature=params["temperature"], verbose=False)
        self.model = TrimmedChatModel(inner, profile=profile, **OPTIONS)

    @staticmethod
    def inputs(req: dict[str, Any]) -> tuple[list[Any], list[Any]]:
        """What a LangChain app holds before it calls the model: its messages and its retriever's documents."""
        from langchain_core.documents import Document
        from langchain_core.messages import convert_to_messages

        docs = []
        for c in req["chunks"]:
            if req["chunk_mode"] == "plain":
                docs.append(Document(page_content=c["text"]))
            else:
                docs.append(Document(page_content=c["text"], id=c["id"], metadata={} if c["score"] is None else {"score": c["score"]}))
        return convert_to_messages(req["messages"]), docs

    def send(self, req: dict[str, Any], budget_s: float, params: dict[str, Any], reset: Callable[[], None]) -> dict[str, Any]:
        messages, docs = self.inputs(req)
        extra = {k: v for k, v in params.items() if k not in ("max_tokens", "temperature")}
        reset()
        t0 = time.perf_counter()
        out = self.model.invoke(messages, rag_chunks=docs, ttft_budget_s=budget_s, **extra)
        wall = time.perf_counter() - t0
        prepared = self.model.trimkit.last_prepared
        return {"report": self.model.last_report, "messages_sent": list(prepared.messages), "wall_s": wall,
                "layer_s": self.model.last_layer_s, "prepare_s": prepared.prepare_s, "text": out.content}

    def prepare(self, req: dict[str, Any], budget_s: float, params: dict[str, Any]) -> Any:
        """The request planned as this path plans it, without sending it: the messages as
        ``ChatLlamaCpp`` converts them (its own converter), the documents as the integration does."""
        from trimkit.integrations.langchain import as_chunks

        messages, docs = self.inputs(req)
        dicts = self.model.inner._create_message_dicts(messages)  # ChatLlamaCpp's conversion, as its _stream does
        return self.model.trimkit.prepare(dicts, as_chunks(docs), {**params, "stream": True}, ttft_budget_s=budget_s)


def same_plan(direct: Direct, lc: LangChain, req: dict[str, Any], budget_s: float, params: dict[str, Any],
              reset: Callable[[], None]) -> dict[str, Any]:
    """Plan the request on the direct path and on the LangChain path from the same engine state
    (nothing measured in between, cold both times): do they keep the same chunks and turns?"""
    import trimkit

    reset()
    d = direct.chat.prepare(req["messages"], rag_qa.rag_chunks(req, trimkit.Chunk), params, ttft_budget_s=budget_s)
    reset()
    lp = lc.prepare(req, budget_s, params)
    dk, lk = [c.id for c in d.plan.kept_chunks], [c.id for c in lp.plan.kept_chunks]
    return {"same_chunks": dk == lk, "same_removed_turns": d.plan.removed_message_indices == lp.plan.removed_message_indices,
            "direct_tokens": len(d.prompt_tokens), "langchain_tokens": len(lp.prompt_tokens), "direct_kept": dk, "langchain_kept": lk}


def llamaindex_paths() -> tuple[dict[str, Callable[..., dict[str, Any]]], str | None]:
    """The LlamaIndex paths offered by ``integrations_llamaindex.py`` (name → send), or why none."""
    try:
        from integrations_llamaindex import ARMS, run_llamaindex_arm
    except Exception as exc:  # the file or the framework missing: the other paths still run
        return {}, f"{type(exc).__name__}: {exc}"
    return {arm: functools.partial(run_llamaindex_arm, arm) for arm in ARMS}, None


def llamaindex_plans(llm: Any, profile: Any, req: dict[str, Any], budget_s: float, params: dict[str, Any],
                     reset: Callable[[], None]) -> dict[str, list[str]]:
    """Each LlamaIndex path's plan of the request from the same cold engine state, sending nothing:
    the chunks it keeps (compared with the direct path's plan) — and, as ``same_plan`` does for the
    direct and LangChain paths, its token counts warmed before it sends, so every path's
    ``prepare`` is timed alike."""
    try:
        from integrations_llamaindex import ARMS, prepare_llamaindex_arm
    except Exception:  # reported once by llamaindex_paths
        return {}
    out = {}
    for arm in ARMS:
        reset()
        prepared = prepare_llamaindex_arm(arm, llm, req, budget_s=budget_s, profile=profile, params=params, options=dict(OPTIONS))
        out[arm] = [c.id for c in prepared.plan.kept_chunks]
    return out


# --------------------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    use = [r["measured_ttft_s"] / r["budget_s"] for r in ok if r["measured_ttft_s"] is not None]
    ms = {k: [r[k] * 1000 for r in ok if r.get(k) is not None] for k in ("prepare_s", "layer_s", "framework_s", "outside_model_s")}
    same = [r for r in ok if r.get("same_chunks_as_direct") is not None]
    return {
        "sends": len(rows), "errors": len(rows) - len(ok),
        "answer_kept": sum(1 for r in ok if r["answer_kept"]), "answer_kept_share": sum(1 for r in ok if r["answer_kept"]) / len(ok) if ok else None,
        "within_budget": sum(1 for r in ok if r["met"]), "attainment": sum(1 for r in ok if r["met"]) / len(ok) if ok else None,
        "median_use": median(use), "use_p10": pct(use, 0.1), "use_p90": pct(use, 0.9),
        "same_chunks_as_direct": sum(1 for r in same if r["same_chunks_as_direct"]), "compared_with_direct": len(same),
        **{f"{k[:-2]}_ms_median": median(v) for k, v in ms.items()},
        **{f"{k[:-2]}_ms_p90": pct(v, 0.9) for k, v in ms.items()},
        "layer_ms_max": max(ms["layer_s"]) if ms["layer_s"] else None,
    }


OVERHEAD_PROMPT = "Say hi."
OVERHEAD_RATIO_TARGET = 1.02
OVERHEAD_MS_TARGET = 3.0


def overhead(n_pairs: int, seed: int, out_path: Path) -> int:
    """``--overhead``: raw ``ChatLlamaCpp.invoke`` against ``TrimmedChatModel.invoke``, interleaved."""
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_core.messages import HumanMessage

    import trimkit
    from trimkit.integrations.langchain import TrimmedChatModel

    rng = random.Random(seed)
    llm = open_model(None, None, 4096)
    profile = trimkit.calibrate(llm)
    eos = llm.token_eos()
    bias = {"logit_bias": {str(eos): -100.0}} if eos >= 0 else {}
    raw = ChatLlamaCpp.model_construct(client=llm, model_path=str(getattr(llm, "model_path", "")), max_tokens=4, temperature=0.0,
                                       verbose=False)
    wrapped = TrimmedChatModel(raw, profile=profile, ttft_budget_s=10.0, **OPTIONS)
    messages = [HumanMessage(OVERHEAD_PROMPT)]
    arms = {"raw": raw, "wrapped": wrapped}
    times: dict[str, list[float]] = {"raw": [], "wrapped": []}
    prepare_s: list[float] = []
    layer_s: list[float] = []

    def call(name: str) -> float:
        t0 = time.perf_counter()
        arms[name].invoke(messages, **bias)
        return time.perf_counter() - t0

    for _ in range(5):  # warm-up: the prompt's tokens counted and cached, both paths' code loaded
        call("raw"), call("wrapped")
    diffs = []
    for _ in range(n_pairs):
        order = ["raw", "wrapped"]
        rng.shuffle(order)
        pair = {name: call(name) for name in order}
        for name, t in pair.items():
            times[name].append(t)
        diffs.append(pair["wrapped"] - pair["raw"])
        prepare_s.append(wrapped.trimkit.last_prepared.prepare_s)
        layer_s.append(wrapped.last_layer_s or 0.0)
    raw_ms, wrapped_ms = statistics.median(times["raw"]) * 1e3, statistics.median(times["wrapped"]) * 1e3
    result = {
        "pairs": n_pairs, "prompt": OVERHEAD_PROMPT, "max_tokens": 4,
        "raw_median_ms": raw_ms, "wrapped_median_ms": wrapped_ms, "ratio_of_medians": wrapped_ms / raw_ms,
        "median_pair_difference_ms": statistics.median(diffs) * 1e3,
        "trimkit_prepare_median_ms": statistics.median(prepare_s) * 1e3, "integration_layer_median_ms": statistics.median(layer_s) * 1e3,
        "target": f"ratio <= {OVERHEAD_RATIO_TARGET} or difference <= {OVERHEAD_MS_TARGET} ms",
        "load_average": list(os.getloadavg()), "versions": {d: version(d) for d in FRAMEWORKS},
    }
    met = result["ratio_of_medians"] <= OVERHEAD_RATIO_TARGET or result["median_pair_difference_ms"] <= OVERHEAD_MS_TARGET
    result["target_met"] = met
    print(f"raw {raw_ms:.1f} ms, wrapped {wrapped_ms:.1f} ms per call (median of {n_pairs}, interleaved): ratio "
          f"{result['ratio_of_medians']:.3f}, +{result['median_pair_difference_ms']:.2f} ms per pair (median); of which trimkit's "
          f"planning {result['trimkit_prepare_median_ms']:.2f} ms, the integration layer {result['integration_layer_median_ms']:.2f} ms; "
          f"target {'met' if met else 'MISSED'} ({result['target']})")
    write_results(out_path, result)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 requests (development)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--requests", type=int, default=None, help="requests in the set (default 10; --quick 4)")
    ap.add_argument("--shares", default="0.3,0.6", help="budget shares of the predicted untrimmed TTFT, each request runs at each")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--max-prompt-tokens", type=int, default=3000)
    ap.add_argument("--out", default=None, help="JSON results (default benchmarks/results/integrations.json; --quick: integrations_quick.json)")
    ap.add_argument("--overhead", type=int, default=None, metavar="N",
                    help="only the wrapper's overhead per call over the raw model: N interleaved pairs (default out: integrations_overhead.json)")
    args = ap.parse_args()
    if args.overhead is not None:
        return overhead(args.overhead, args.seed, Path(args.out or HERE / "results" / "integrations_overhead.json"))
    n_requests = args.requests or (4 if args.quick else 10)
    shares = [float(x) for x in args.shares.split(",")]
    out_path = Path(args.out or HERE / "results" / ("integrations_quick.json" if args.quick else "integrations.json"))
    rng = random.Random(args.seed)
    t_run = time.perf_counter()

    import trimkit

    llm = open_model(None, None, 8192)
    backend = trimkit.backends.LlamaBackend(llm)
    eos = llm.token_eos()
    params = {"max_tokens": args.max_tokens, "temperature": 0.0, **({"logit_bias": {str(eos): -100.0}} if eos >= 0 else {})}
    t0 = time.perf_counter()
    profile = trimkit.calibrate(llm)
    print(f"profile: {profile.mode} ({'measured now' if time.perf_counter() - t0 > 2 else 'stored'}), held-out median "
          f"{profile.error.median_pct:.1f} %, p90 {profile.error.p90_pct:.1f} %")
    speed = {"cold_1024_prefill_s": backend.measure_prefill(1024, 0), "predicted_s": profile.predict_prefill_s(1024, 0),
             "load_average_start": list(os.getloadavg())}
    print(f"host: cold 1,024-token prefill {speed['cold_1024_prefill_s']:.2f} s (the profile predicts {speed['predicted_s']:.2f} s); "
          f"load average {speed['load_average_start'][0]:.2f}")

    def reset() -> None:
        with backend.lock:
            llm.reset()  # cold, every path alike (the harness's doing: trimkit never resets)

    direct = Direct(llm, backend, profile)
    paths: dict[str, Callable[..., dict[str, Any]]] = {"direct": direct.send}
    errors: dict[str, str] = {}
    lc: LangChain | None = None
    try:
        lc = LangChain(llm, profile, params)
        paths["langchain"] = lc.send
    except Exception as exc:
        errors["langchain"] = f"{type(exc).__name__}: {exc}"
    li, li_error = llamaindex_paths()
    if li_error:
        errors["llamaindex"] = li_error
    for arm, run in li.items():
        paths[arm] = lambda req, budget_s, params, reset, run=run: run(llm, req, budget_s=budget_s, profile=profile, params=params,
                                                                     reset=reset, options=dict(OPTIONS))
    for name, why in errors.items():
        print(f"{name}: not run — {why}")

    requests = rag_qa.generate(args.seed, n_requests, max_prompt_tokens=args.max_prompt_tokens)
    base = trimkit.wrap(llm, profile=profile, backend=backend, **OPTIONS)
    jobs = []
    for req in requests:
        reset()
        untrimmed = profile.predict_ttft_s(base.prepare(req["messages"], rag_qa.rag_chunks(req, trimkit.Chunk), params).prompt_tokens_before, 0)
        jobs.extend({"req": req, "share": s, "budget_s": s * untrimmed, "untrimmed_s": untrimmed} for s in shares)
    est = sum(j["budget_s"] * 0.8 + 0.5 for j in jobs) * len(paths)
    print(f"{len(requests)} requests × shares {shares} = {len(jobs)} jobs × {len(paths)} paths ({', '.join(paths)}) = "
          f"{len(jobs) * len(paths)} sends, about {est / 60:.1f} min predicted")

    rows: list[dict[str, Any]] = []
    agreement: list[dict[str, Any]] = []
    order = list(range(len(jobs)))
    rng.shuffle(order)
    for n, ji in enumerate(order):
        job = jobs[ji]
        req = job["req"]
        ids = [c["id"] if c["id"] is not None else f"chunk-{i}" for i, c in enumerate(req["chunks"])]
        if lc is not None:
            agreement.append({"job": ji, "request": req["id"], "share": job["share"], **same_plan(direct, lc, req, job["budget_s"], params, reset)})
            for arm, kept in llamaindex_plans(llm, profile, req, job["budget_s"], params, reset).items():
                agreement[-1][f"{arm}_kept"] = kept
                agreement[-1][f"{arm}_same_chunks"] = kept == agreement[-1]["direct_kept"]
        names = list(paths)
        rng.shuffle(names)
        line, by_path = [], {}
        for name in names:
            row: dict[str, Any] = {"job": ji, "request": req["id"], "chunk_mode": req["chunk_mode"], "share": job["share"],
                                   "budget_s": job["budget_s"], "path": name}
            try:
                r = paths[name](req, job["budget_s"], params, reset)
            except Exception as exc:
                row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=4))
                rows.append(row)
                line.append(f"{name} ERROR")
                continue
            rep, m = r["report"], r["report"].measurement
            model_s = (m.queue_s or 0.0) + m.total_s
            kept = kept_ids(r["messages_sent"], ids)
            by_path[name] = kept
            row.update({
                "measured_ttft_s": rep.measured_ttft_s, "predicted_ttft_s": rep.predicted_ttft_s, "safety_margin": rep.safety_margin,
                "met": rep.measured_ttft_s is not None and rep.measured_ttft_s <= job["budget_s"],
                "answer_kept": rag_qa.answer_in(r["messages_sent"], req), "kept_chunks": kept, "prompt_tokens": rep.prompt_tokens,
                "wall_s": r["wall_s"], "prepare_s": r["prepare_s"], "layer_s": r["layer_s"], "model_s": model_s,
                "outside_model_s": r["wall_s"] - model_s, "framework_s": r["wall_s"] - model_s - r["prepare_s"] - (r["layer_s"] or 0.0),
                "planning_s": rep.planning_s,
            })
            rows.append(row)
            line.append(f"{name} {rep.measured_ttft_s or float('nan'):5.2f}s{'' if row['met'] else '!'}{' A' if row['answer_kept'] else ' -'}")
        for row in rows[-len(names):]:
            if "error" not in row and "direct" in by_path and row["path"] != "direct":
                row["same_chunks_as_direct"] = row["kept_chunks"] == by_path["direct"]
        print(f"[{n + 1:3d}/{len(jobs)}] {req['id']} {req['chunk_mode']:8s} share {job['share']:.2f} budget {job['budget_s']:5.2f}s | "
              + " | ".join(line), flush=True)

    summary = {p: summarize([r for r in rows if r["path"] == p]) for p in paths}
    wall = time.perf_counter() - t_run
    print()
    direct = summary["direct"]
    for p, s in summary.items():
        print(f"{p:<22s} answer kept {share_text(s['answer_kept'], s['sends'] - s['errors'])}   within budget "
              f"{share_text(s['within_budget'], s['sends'] - s['errors'])}   budget use median {s['median_use']:.2f} "
              f"(p10 {s['use_p10']:.2f}, p90 {s['use_p90']:.2f})" + (f"   errors {s['errors']}" if s["errors"] else ""))
        same = f"same chunks as direct {share_text(s['same_chunks_as_direct'], s['compared_with_direct'])}   " if p != "direct" else ""
        added = s["outside_model_ms_median"] - direct["outside_model_ms_median"] if p != "direct" else 0.0
        print(f"{'':<22s} {same}prepare {s['prepare_ms_median']:.1f} ms · layer {s['layer_ms_median']:.2f} ms (p90 "
              f"{s['layer_ms_p90']:.2f}, max {s['layer_ms_max'] or 0:.2f}) · framework {s['framework_ms_median']:.1f} ms · outside the model "
              f"{s['outside_model_ms_median']:.1f} ms" + (f" ({added:+.1f} ms vs direct)" if p != "direct" else ""))
    if agreement:
        print(f"langchain vs direct, planned from the same engine state: same chunks kept "
              f"{share_text(sum(a['same_chunks'] for a in agreement), len(agreement))}, same turns dropped "
              f"{share_text(sum(a['same_removed_turns'] for a in agreement), len(agreement))}, prompt tokens langchain − direct: median "
              f"{median([a['langchain_tokens'] - a['direct_tokens'] for a in agreement]):+.0f}")
        for arm in [k[: -len("_same_chunks")] for k in agreement[0] if k.endswith("_same_chunks")]:
            print(f"{arm} vs direct, planned from the same engine state: same chunks kept "
                  f"{share_text(sum(a[f'{arm}_same_chunks'] for a in agreement), len(agreement))}")
    layer_missed = [p for p, s in summary.items() if p != "direct" and (s["layer_ms_p90"] or 0.0) > LAYER_TARGET_MS]
    print(f"integration layer ≤ {LAYER_TARGET_MS:.0f} ms per request (p90): {'MISSED by ' + ', '.join(layer_missed) if layer_missed else 'met'}")
    print(f"run took {wall / 60:.1f} min; load average {os.getloadavg()[0]:.2f}")

    result = {
        "benchmark": "integrations", "quick": args.quick, "seed": args.seed, "requests": len(requests), "shares": shares,
        "max_tokens": args.max_tokens, "paths": list(paths), "not_run": errors, "options": OPTIONS,
        "versions": {"trimkit": trimkit.__version__, **{d: version(d) for d in FRAMEWORKS}},
        "profile": {"mode": profile.mode, "heldout": profile.error.to_dict()}, "host": speed, "wall_s": wall, "cpu_count": os.cpu_count(),
        "load_average_end": list(os.getloadavg()), "layer_target_ms": LAYER_TARGET_MS, "layer_target_missed": layer_missed,
        "untrimmed_s": {"median": statistics.median(j["untrimmed_s"] for j in jobs)}, "summary": summary, "same_state_plans": agreement, "rows": rows,
    }
    write_results(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
