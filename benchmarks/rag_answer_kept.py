"""Does the retrieved chunk holding the answer survive trimming — and is the budget still met?

Issue 7: on a slow host with an untuned workload trimkit met the budget every time but kept the
chunk that held the answer in only 1 of 9 requests. This benchmark measures, on a generated
records-assistant RAG set (``benchmarks/rag_qa.py``: 4–30 earlier turns with tool turns, 8–16
chunks of ~40–400 tokens, distractors worded like the question, the answer sentence in the
middle of its chunk, caller scores from a noisy retriever or none), how often the answer
sentence is in the messages actually sent, for four arms on the same requests in the same run:

- ``trimkit``: ``trimkit.wrap(llm, ttft_budget_s=budget, profile=profile)``, a real request;
- ``keep_first_k``: the caller's first k chunks (retriever order), the largest k whose predicted
  TTFT fits the same target (budget less the trimkit plan's safety margin), history untouched —
  dropping the oldest turns only if even k = 0 does not fit;
- ``drop_oldest_only``: every chunk kept; the oldest whole turns (tool call and result together)
  dropped until it fits;
- ``previous_chain``: the previous fixed-order planner (commit 3018083), run in a subprocess that
  imports that version of trimkit (model opened with ``chat_format="gemma"``, as that version
  did, and the current profile via ``Profile.from_dict``); it returns the messages its plan
  would send, and the main process sends them.

Budgets are shares (default 0.25, 0.4, 0.6, 0.8) of each request's predicted untrimmed TTFT
(calibrated profile, cold cache). Every prompt is sent cold (the harness resets the KV cache
before each send) with ``max_tokens=2``; the three baseline prompts go through an un-budgeted
``trimkit.wrap(llm, profile=profile)`` so every arm's TTFT is measured the same way. Jobs and,
within a job, arms run in a random order so drift hits all arms alike.

    python benchmarks/rag_answer_kept.py [--quick] [--seed 7] [--model PATH] [--out PATH]

Targets (trimkit arm): answer kept ≥ 98 % of the requests where system + question + answer
chunk fit the target by prediction; measured TTFT ≤ budget in ≥ 97 %; median measured budget
use ≥ 0.8; planning ≤ 1 % of the predicted TTFT. The full run (24 requests × 2 shares = 48 jobs,
192 sends) takes about 12–14 minutes on the project's 2-core machine when it is idle; ``--quick``
(4 requests × shares 0.25 and 0.6) about 2–3, plus a calibration if none is stored. It prints
its predicted duration first; on a busy host it takes far longer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import rag_qa  # noqa: E402
from _results import write_results  # noqa: E402 - the sibling module of benchmarks/

PREVIOUS_COMMIT = "3018083"
ARMS = ("trimkit", "keep_first_k", "drop_oldest_only", "previous_chain")
TARGETS = {"answer_kept": 0.98, "attainment": 0.97, "median_use": 0.8, "planning_share": 0.01}
_MARK = "@@rak "  # prefix of the worker's protocol lines (llama.cpp may print to stdout too)


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank, lower), NaN for no values."""
    v = sorted(x for x in values if x is not None and not math.isnan(x))
    if not v:
        return float("nan")
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def median(values: Sequence[float]) -> float:
    v = [x for x in values if x is not None and not math.isnan(x)]
    return statistics.median(v) if v else float("nan")


def share_text(k: int, n: int) -> str:
    return f"{k}/{n} = {k / n * 100:.1f} %" if n else "0/0 (n/a)"


def open_model(path: str | None, chat_format: str | None, n_ctx: int) -> Any:
    """The model: ``--model PATH``, else ``trimkit.default_llama`` when it exists, else the
    embedded GGUF with ``chat_format="gemma"`` (it carries no chat template of its own)."""
    from llama_cpp import Llama

    import trimkit

    if path is None and hasattr(trimkit, "default_llama"):
        try:
            return trimkit.default_llama("gemma", n_ctx=n_ctx)
        except TypeError:
            return trimkit.default_llama("gemma")
    if path is None:
        return Llama(model_path=trimkit.default_model_path("gemma"), n_ctx=n_ctx, verbose=False, chat_format=chat_format or "gemma")
    return Llama(model_path=str(trimkit.backends.llama_format.check_model_path(path)), n_ctx=n_ctx, verbose=False, chat_format=chat_format)


# --------------------------------------------------------------------------------------------
# the previous planner, in a subprocess that imports trimkit as of PREVIOUS_COMMIT
# --------------------------------------------------------------------------------------------
def _worker(tree: str, model_path: str, chat_format: str, n_ctx: int) -> int:
    """``--previous-chain-worker``: plan each job (one JSON line on stdin) with the old trimkit."""
    sys.path.insert(0, tree)
    for name in [m for m in sys.modules if m == "trimkit" or m.startswith("trimkit.")]:
        del sys.modules[name]
    import attrs

    import trimkit
    from trimkit.costmodel import CostModel, ErrorStats, PrefillSample  # the old tree's modules (commit 3018083)
    from trimkit.profile import Profile  # the old tree's modules too

    where = Path(trimkit.__file__).resolve()
    if Path(tree).resolve() not in where.parents:
        print(_MARK + json.dumps({"error": f"imported trimkit from {where}, not from the old tree {tree}"}), flush=True)
        return 1
    from llama_cpp import Llama

    llm = Llama(model_path=model_path, n_ctx=n_ctx, verbose=False, chat_format=chat_format or None)
    backend = trimkit.LlamaBackend(llm)
    adapted: list[str] = []

    def fields(cls: Any, data: dict[str, Any], label: str) -> dict[str, Any]:
        names = {f.name for f in attrs.fields(cls)}
        extra = sorted(set(data) - names)
        if extra and label not in adapted:
            adapted.append(label)
        return {k: v for k, v in data.items() if k in names}

    def load(data: dict[str, Any]) -> Any:
        try:
            return Profile.from_dict(data)
        except Exception:  # a newer profile with fields the old classes do not know: keep the known ones
            d = dict(data)
            if d.get("schema") != 1:
                d["schema"] = 1
                if "schema" not in adapted:
                    adapted.append("schema")
            d["model"] = fields(CostModel, d["model"], "model")
            d["error"] = fields(ErrorStats, d["error"], "error")
            d["samples"] = [fields(PrefillSample, s, "samples") for s in d["samples"]]
            return Profile.from_dict(d)

    print(_MARK + json.dumps({"ready": True, "trimkit": str(where), "version": getattr(trimkit, "__version__", "?")}), flush=True)
    profile = None
    for line in sys.stdin:
        job = json.loads(line)
        try:
            if job.get("profile") is not None:
                profile = load(job["profile"])
            chat = trimkit.wrap(llm, ttft_budget_s=job["budget_s"], profile=profile, backend=backend)
            with backend.lock:
                llm.reset()  # cold, as the main process sends it
            p = chat.prepare(job["messages"], job["chunks"], {"max_tokens": job["max_tokens"]})
            plan = p.plan
            out = {
                "messages": list(plan.messages),
                "kept_chunks": [c.id for c in plan.kept_chunks],
                "dropped_chunks": [c.id for c in plan.dropped_chunks],
                "predicted_ttft_s": p.predicted_ttft_s,
                "planning_s": plan.planning_s,
                "prepare_s": p.prepare_s,
                "feasible": p.feasible,
                "prompt_tokens": len(p.prompt_tokens),
                "drift": profile.drift,
                "safety_margin": plan.safety_margin,
                "actions": [a.strategy for a in plan.actions],
                "profile_adapted": list(adapted),
            }
        except Exception as exc:  # report, do not die: the main process records it per job
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(_MARK + json.dumps(out, default=str), flush=True)
    return 0


class PreviousChain:
    """The old planner behind a pipe. ``error`` says why it is unavailable (None when it works)."""

    def __init__(self, model_path: str, chat_format: str | None, n_ctx: int, commit: str) -> None:
        self.error: str | None = None
        self.info: dict[str, Any] = {"commit": commit}
        self.proc: subprocess.Popen[str] | None = None
        self._sent_profile: Any = None
        self.tmp = tempfile.mkdtemp(prefix="trimkit-prev-")
        self.cache = tempfile.mkdtemp(prefix="trimkit-prev-cache-")
        try:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "trimkit"], capture_output=True, check=True).stdout
            with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
                tar.extractall(self.tmp, filter="data")
            resolved = subprocess.run(["git", "-C", str(REPO), "rev-parse", commit], capture_output=True, text=True, check=True).stdout.strip()
            self.info["commit_full"] = resolved
        except (OSError, subprocess.CalledProcessError, tarfile.TarError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            self.error = f"could not extract trimkit at {commit}: {exc} {err.decode(errors='replace').strip()}"
            return
        env = dict(os.environ, TRIMKIT_CACHE_DIR=self.cache)
        self._stderr_path = Path(self.cache) / "worker-stderr.txt"  # a file: a full pipe would block the worker
        self._stderr = self._stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--previous-chain-worker", self.tmp, model_path, chat_format or "", str(n_ctx)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1, env=env,
        )
        first = self._read()
        if first is None or not first.get("ready"):
            self.error = (first or {}).get("error") or f"the worker did not start: {self._stderr_tail()}"
            self.close()
            return
        self.info.update({k: v for k, v in first.items() if k != "ready"})

    def _stderr_tail(self) -> str:
        try:
            self._stderr.flush()
            return self._stderr_path.read_text(errors="replace")[-800:]
        except (AttributeError, OSError):
            return ""

    def _read(self) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK):])
        return None

    def plan(self, messages: Any, chunks: Any, budget_s: float, profile_dict: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        if self.error is not None or self.proc is None:
            return {"error": self.error}
        job = {"messages": messages, "chunks": chunks, "budget_s": budget_s, "max_tokens": max_tokens,
               "profile": profile_dict if profile_dict != self._sent_profile else None}
        self._sent_profile = profile_dict
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            self.error = f"worker pipe failed: {exc}"
            return {"error": self.error}
        out = self._read()
        if out is None:
            self.error = f"the worker stopped: {self._stderr_tail()}"
            return {"error": self.error}
        return out

    def close(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
            self.proc = None
        if getattr(self, "_stderr", None) is not None:
            self._stderr.close()
        for d in (self.tmp, self.cache):
            shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# baseline prompts
# --------------------------------------------------------------------------------------------
class Prompts:
    """Builds and predicts the prompts of one request the way a caller without trimkit would:
    chunks rendered with trimkit's default RAG templates, in the order given."""

    def __init__(self, req: dict[str, Any], tokenizer: Any, predict: Callable[[int], float]) -> None:
        import trimkit

        self.req = req
        self.tok = tokenizer
        self.predict_n = predict
        self.template = trimkit.messages.DEFAULT_RAG_TEMPLATE
        self.chunk_template = trimkit.messages.DEFAULT_RAG_CHUNK_TEMPLATE
        msgs = req["messages"]
        self.system, self.question = msgs[0], msgs[-1]
        self.turns: list[list[dict[str, Any]]] = []
        for m in msgs[1:-1]:
            if m["role"] == "user" or not self.turns:
                self.turns.append([])
            self.turns[-1].append(m)
        # the ids trimkit gives: the caller's, or chunk-<index> for plain strings
        self.ids = [c["id"] if c["id"] is not None else f"chunk-{i}" for i, c in enumerate(req["chunks"])]
        self._memo: dict[tuple[tuple[int, ...], int], tuple[list[dict[str, Any]], int]] = {}

    def build(self, chunk_idx: Sequence[int], drop_turns: int) -> tuple[list[dict[str, Any]], int]:
        key = (tuple(chunk_idx), drop_turns)
        if key not in self._memo:
            q = self.question["content"]
            if chunk_idx:
                body = "\n\n".join(
                    self.chunk_template.format(id=self.ids[i], text=self.req["chunks"][i]["text"], n=n + 1) for n, i in enumerate(chunk_idx)
                )
                q = self.template.format(chunks=body, question=q)
            msgs = [self.system, *[m for t in self.turns[drop_turns:] for m in t], {"role": "user", "content": q}]
            self._memo[key] = (msgs, len(self.tok.prompt_tokens(msgs)))
        return self._memo[key]

    def predicted(self, chunk_idx: Sequence[int], drop_turns: int) -> float:
        return self.predict_n(self.build(chunk_idx, drop_turns)[1])

    @staticmethod
    def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
        """The largest x in [lo, hi] with fits(x), fits monotone (true up to some x); None if none."""
        from trimkit.planning.costs import largest_fitting

        return largest_fitting(fits, lo, hi) if fits(lo) else None

    def keep_first_k(self, target: float) -> dict[str, Any]:
        n = len(self.req["chunks"])
        k = self._largest(0, n, lambda k: self.predicted(range(k), 0) <= target)
        drop = 0
        if k is None:
            k = 0
            d = self._largest(0, len(self.turns), lambda d: self.predicted((), len(self.turns) - d) <= target)
            drop = len(self.turns) - d if d is not None else len(self.turns)
        msgs, tokens = self.build(range(k), drop)
        return {"messages": msgs, "kept": k, "dropped_turns": drop, "tokens": tokens}

    def drop_oldest_only(self, target: float) -> dict[str, Any]:
        n, t = len(self.req["chunks"]), len(self.turns)
        kept_turns = self._largest(0, t, lambda d: self.predicted(range(n), t - d) <= target)
        drop = t - kept_turns if kept_turns is not None else t
        msgs, tokens = self.build(range(n), drop)
        return {"messages": msgs, "kept": n, "dropped_turns": drop, "tokens": tokens}


# --------------------------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    elig = [r for r in rows if r["eligible"]]
    measured = [r for r in rows if r["measured_ttft_s"] is not None]
    met = sum(1 for r in rows if r["met"])
    feas = [r for r in rows if r["predicted_fits_budget"]]
    use = [r["measured_ttft_s"] / r["budget_s"] for r in measured]
    out: dict[str, Any] = {
        "sends": len(rows),
        "eligible": len(elig),
        "answer_kept_eligible": sum(1 for r in elig if r["answer_kept"]),
        "answer_kept_eligible_share": (sum(1 for r in elig if r["answer_kept"]) / len(elig)) if elig else None,
        "answer_kept_all": sum(1 for r in rows if r["answer_kept"]),
        "within_budget": met,
        "attainment": met / len(rows) if rows else None,
        "predicted_within_budget": len(feas),
        "within_budget_of_predicted_feasible": sum(1 for r in feas if r["met"]),
        "median_use": median(use),
        "use_p10": pct(use, 0.1),
        "use_p90": pct(use, 0.9),
        "max_use": max(use) if use else None,
        "median_kept_chunks": median([r["kept_chunks"] for r in rows]),
        "median_dropped_turns": median([r["dropped_turns"] for r in rows if r["dropped_turns"] is not None]),
        "median_prompt_tokens": median([r["prompt_tokens"] for r in rows if r["prompt_tokens"]]),
    }
    plan_s = [r["planning_s"] for r in rows if r.get("planning_s") is not None]
    if plan_s:
        ratio = [r["planning_s"] / r["predicted_ttft_s"] for r in rows if r.get("planning_s") is not None and r.get("predicted_ttft_s")]
        prep = [r["prepare_s"] for r in rows if r.get("prepare_s") is not None]
        with_prep = [r for r in measured if r.get("prepare_s") is not None]
        out["planning"] = {
            "planning_ms_median": median(plan_s) * 1000, "planning_ms_max": max(plan_s) * 1000,
            "share_of_predicted_median": median(ratio), "share_of_predicted_max": max(ratio) if ratio else None,
            "prepare_ms_median": median(prep) * 1000 if prep else None, "prepare_ms_max": max(prep) * 1000 if prep else None,
            "within_budget_counting_prepare": sum(1 for r in with_prep if r["measured_ttft_s"] + r["prepare_s"] <= r["budget_s"]),
        }
    return out


def print_summary(label: str, s: dict[str, Any], *, targets: bool) -> None:
    def tgt(ok: bool | None, text: str) -> str:
        if not targets or ok is None:
            return ""
        return f"   target {text}: {'met' if ok else 'MISSED'}"

    ak = s["answer_kept_eligible_share"]
    print(f"  {label:<17s} answer kept {share_text(s['answer_kept_eligible'], s['eligible'])} of eligible"
          f" ({s['answer_kept_all']}/{s['sends']} of all){tgt(None if ak is None else ak >= TARGETS['answer_kept'], '≥ 98 %')}")
    att = s["attainment"]
    print(f"  {'':<17s} measured TTFT ≤ budget {share_text(s['within_budget'], s['sends'])}"
          f" (predicted to fit: {s['within_budget_of_predicted_feasible']}/{s['predicted_within_budget']})"
          f"{tgt(None if att is None else att >= TARGETS['attainment'], '≥ 97 %')}")
    mu = s["median_use"]
    print(f"  {'':<17s} measured budget use median {mu:.2f} (p10 {s['use_p10']:.2f}, p90 {s['use_p90']:.2f}, max {s['max_use'] or float('nan'):.2f})"
          f"{tgt(None if math.isnan(mu) else mu >= TARGETS['median_use'], '≥ 0.8')}   "
          f"kept chunks median {s['median_kept_chunks']:.0f}, dropped turns median {s['median_dropped_turns']:.0f}")
    p = s.get("planning")
    if p:
        print(f"  {'':<17s} planning {p['planning_ms_median']:.1f} ms median, {p['planning_ms_max']:.1f} ms max = "
              f"{p['share_of_predicted_median'] * 100:.2f} % / {p['share_of_predicted_max'] * 100:.2f} % of the predicted TTFT"
              f"{tgt(p['share_of_predicted_max'] <= TARGETS['planning_share'], '≤ 1 %')}; whole prepare {p['prepare_ms_median']:.1f} ms median, "
              f"{p['prepare_ms_max']:.1f} ms max (not inside the measured TTFT; within budget counting it: "
              f"{p['within_budget_counting_prepare']}/{s['sends']})")


# --------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 requests, shares 0.25 and 0.6 (development)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--requests", type=int, default=None, help="requests in the set (default 24; --quick 4)")
    ap.add_argument("--shares", default=None, help="budget shares of the predicted untrimmed TTFT (default 0.25,0.4,0.6,0.8; --quick 0.25,0.6)")
    ap.add_argument("--shares-per-request", type=int, default=None,
                    help="how many of the shares each request runs at, spread tight to loose (default 2; --quick: all)")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--chat-format", default=None, help="llama-cpp-python chat_format (default: gemma for the embedded model, else the GGUF's template)")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--max-prompt-tokens", type=int, default=3500, help="cap on a generated request's estimated untrimmed size")
    ap.add_argument("--recalibrate", action="store_true", help="measure a fresh full profile instead of reusing the stored one")
    ap.add_argument("--previous-commit", default=PREVIOUS_COMMIT)
    ap.add_argument("--previous-chat-format", default=None,
                    help="chat_format the previous version counts tokens with (default: gemma for the embedded model, as that version used)")
    ap.add_argument("--no-previous", action="store_true", help="skip the previous_chain arm")
    ap.add_argument("--out", default=None, help="JSON results (default benchmarks/results/rag_answer_kept.json; --quick: rag_answer_kept_quick.json)")
    ap.add_argument("--previous-chain-worker", nargs=4, metavar=("TREE", "MODEL", "CHAT_FORMAT", "N_CTX"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.previous_chain_worker:
        tree, model_path, chat_format, n_ctx = args.previous_chain_worker
        return _worker(tree, model_path, chat_format, int(n_ctx))

    n_requests = args.requests or (4 if args.quick else 24)
    shares = [float(x) for x in (args.shares or ("0.25,0.6" if args.quick else "0.25,0.4,0.6,0.8")).split(",")]
    per_request = args.shares_per_request or (len(shares) if args.quick else 2)
    per_request = max(1, min(per_request, len(shares)))
    out_path = Path(args.out or HERE / "results" / ("rag_answer_kept_quick.json" if args.quick else "rag_answer_kept.json"))
    rng = random.Random(args.seed)
    t_run = time.perf_counter()

    import trimkit

    llm = open_model(args.model, args.chat_format, args.n_ctx)
    backend = trimkit.backends.LlamaBackend(llm)
    tok = backend.tokenizer
    eos = llm.token_eos()
    params = {"max_tokens": args.max_tokens, "temperature": 0.0, **({"logit_bias": {str(eos): -100.0}} if eos >= 0 else {})}
    model_path = str(getattr(llm, "model_path", args.model or ""))
    chat_format = getattr(llm, "chat_format", None) or args.chat_format

    t0 = time.perf_counter()
    profile = trimkit.calibrate(llm, recalibrate=args.recalibrate)
    calib_s = time.perf_counter() - t0
    print(f"profile: {os.path.basename(model_path)}, {profile.mode} calibration "
          f"({'measured now' if calib_s > 2 else 'stored'}, {calib_s:.1f} s), held-out median {profile.error.median_pct:.1f} %, "
          f"p90 {profile.error.p90_pct:.1f} %, decode {profile.decode_tokens_per_s:.1f} tokens/s")

    def host_speed(label: str) -> dict[str, Any]:
        times = [backend.measure_prefill(1024, 0) for _ in range(2)]
        s = statistics.median(times)
        out = {"when": label, "cold_1024_prefill_s": times, "ms_per_token": s / 1024 * 1000,
               "predicted_s": profile.predict_prefill_s(1024, 0), "load_average": list(os.getloadavg())}
        print(f"host ({label}): cold 1,024-token prefill {s * 1000:.0f} ms = {out['ms_per_token']:.2f} ms/token "
              f"(profile predicts {out['predicted_s'] * 1000:.0f} ms); load average {out['load_average'][0]:.2f}")
        return out

    host = {"cpu_count": os.cpu_count(), "decode_tokens_per_s_profile": profile.decode_tokens_per_s, "speed": [host_speed("start")]}

    # -- the set and its budgets -------------------------------------------------------------------
    requests = rag_qa.generate(args.seed, n_requests, max_prompt_tokens=args.max_prompt_tokens)
    base_chat = trimkit.wrap(llm, profile=profile, backend=backend)  # no budget: sends what it is given
    jobs = []
    req_info = {}
    for i, req in enumerate(requests):
        chunks = rag_qa.rag_chunks(req, trimkit.Chunk)
        with backend.lock:
            llm.reset()
        p = base_chat.prepare(req["messages"], chunks, params)
        untrimmed = profile.predict_ttft_s(p.prompt_tokens_before, 0)
        req_info[req["id"]] = {
            "chunk_mode": req["chunk_mode"], "order": req["order"], "n_turns": req["n_turns"], "n_chunks": len(req["chunks"]),
            "answer_index": req["answer_index"], "answer_score_rank": req["answer_score_rank"], "attribute": req["attribute"],
            "chunk_tokens": [tok.count(c["text"]) for c in req["chunks"]],
            "history_tokens": len(tok.prompt_tokens(req["messages"])),
            "untrimmed_tokens": p.prompt_tokens_before, "untrimmed_predicted_s": untrimmed,
        }
        # what drop_oldest_only sends at the tightest: every chunk, no history (for the time estimate)
        all_chunks_s = Prompts(req, tok, lambda n: profile.predict_ttft_s(n, 0)).predicted(range(len(req["chunks"])), req["n_turns"])
        for j in range(per_request):
            share = shares[(i + j * len(shares) // per_request) % len(shares)]
            budget = share * untrimmed
            est_s = 3 * budget * (1 - profile.safety_margin) + max(budget * (1 - profile.safety_margin), all_chunks_s)
            jobs.append({"req": req, "chunks": chunks, "share": share, "budget_s": budget, "est_s": est_s})
    ct = [n for r in req_info.values() for n in r["chunk_tokens"]]
    ut = [r["untrimmed_tokens"] for r in req_info.values()]
    print(f"set: {len(requests)} requests (seed {args.seed}): {sum(1 for r in requests if r['chunk_mode'] == 'scored')} scored, "
          f"{sum(1 for r in requests if r['chunk_mode'] == 'unscored')} unscored Chunks, {sum(1 for r in requests if r['chunk_mode'] == 'plain')} plain strings; "
          f"turns {min(r['n_turns'] for r in requests)}–{max(r['n_turns'] for r in requests)}; chunks {min(len(r['chunks']) for r in requests)}–"
          f"{max(len(r['chunks']) for r in requests)} of {min(ct)}–{max(ct)} tokens (median {median(ct):.0f}); untrimmed prompts "
          f"{min(ut)}–{max(ut)} tokens (median {median(ut):.0f})")
    est = sum(j["est_s"] for j in jobs) + 0.6 * len(jobs)
    print(f"jobs: {len(jobs)} (request × share), shares {shares}, {per_request} per request; 4 arms → {len(jobs) * len(ARMS)} sends, "
          f"about {est / 60:.1f} min predicted")

    # -- the previous planner -------------------------------------------------------------------
    prev: PreviousChain | None = None
    prev_error = "skipped (--no-previous)" if args.no_previous else None
    if not args.no_previous:
        t0 = time.perf_counter()
        # that version opened the embedded model with chat_format="gemma" (it had no Gemma 3 template)
        prev_format = args.previous_chat_format or ("gemma" if args.model is None else chat_format)
        prev = PreviousChain(model_path, prev_format, args.n_ctx, args.previous_commit)
        prev.info["chat_format"] = prev_format
        prev_error = prev.error
        print(f"previous_chain: {'unavailable — ' + prev.error if prev.error else 'trimkit ' + args.previous_commit + ' in a subprocess'} "
              f"({time.perf_counter() - t0:.1f} s)")
    arms = [a for a in ARMS if a != "previous_chain" or prev_error is None]

    def send(msgs: list[dict[str, Any]]) -> Any:
        with backend.lock:
            llm.reset()  # every arm starts cold (harness only; trimkit itself never resets)
        base_chat.create_chat_completion(messages=msgs, **params)
        return base_chat.last_report

    # -- the measured run --------------------------------------------------------------------------
    rows: list[dict[str, Any]] = []
    order = list(range(len(jobs)))
    rng.shuffle(order)
    try:
        for n_job, ji in enumerate(order):
            job = jobs[ji]
            req, budget = job["req"], job["budget_s"]
            # the target every arm fits: the budget less the margin of trimkit's own plan for this request
            dry = trimkit.wrap(llm, ttft_budget_s=budget, profile=profile, backend=backend)
            with backend.lock:
                llm.reset()
            dry_p = dry.prepare(req["messages"], job["chunks"], params)
            margin = float(dry_p.plan.safety_margin)
            target = budget * (1.0 - margin)
            live = dry.profile  # the calibrated profile as refined by this run's measurements so far

            prompts = Prompts(req, tok, lambda n, live=live: live.predict_ttft_s(n, 0))
            eligible_pred = prompts.predicted([req["answer_index"]], len(prompts.turns))
            eligible = eligible_pred <= target
            plans: dict[str, dict[str, Any]] = {
                "keep_first_k": prompts.keep_first_k(target),
                "drop_oldest_only": prompts.drop_oldest_only(target),
            }
            if "previous_chain" in arms:
                assert prev is not None
                old = prev.plan(req["messages"], rag_qa.rag_chunks(req), budget, live.to_dict(), args.max_tokens)
                if "error" in old:
                    old = {**old, "messages": None}
                plans["previous_chain"] = old

            arm_order = list(arms)
            rng.shuffle(arm_order)
            line = []
            for pos, arm in enumerate(arm_order):
                row: dict[str, Any] = {"job": ji, "request": req["id"], "share": job["share"], "budget_s": budget, "target_s": target,
                                       "safety_margin": margin, "arm": arm, "position": pos, "eligible": eligible,
                                       "eligible_predicted_s": eligible_pred, "chunk_mode": req["chunk_mode"], "order": req["order"]}
                if arm == "trimkit":
                    chat = trimkit.wrap(llm, ttft_budget_s=budget, profile=profile, backend=backend)
                    with backend.lock:
                        llm.reset()
                    chat.create_chat_completion(messages=req["messages"], rag_chunks=job["chunks"], **params)
                    report = chat.last_report
                    prepared = getattr(chat, "last_prepared", None)
                    if prepared is None:  # the same plan again, from the same (cold) state
                        with backend.lock:
                            llm.reset()
                        prepared = chat.prepare(req["messages"], job["chunks"], params)
                    chat.idle()  # background summaries finish before the next measurement
                    plan = prepared.plan
                    sent = list(prepared.messages)
                    row.update({
                        "predicted_ttft_s": prepared.predicted_ttft_s, "planning_s": plan.planning_s, "prepare_s": prepared.prepare_s,
                        "plan_safety_margin": plan.safety_margin, "kept_chunks": len(plan.kept_chunks),
                        "kept_chunk_ids": [c.id for c in plan.kept_chunks], "actions": [a.strategy for a in plan.actions],
                        "feasible": prepared.feasible, "warnings": list(report.warnings),
                    })
                else:
                    p = plans[arm]
                    if p.get("messages") is None:
                        row.update({"error": p.get("error"), "measured_ttft_s": None, "met": False, "answer_kept": False,
                                    "predicted_fits_budget": False, "kept_chunks": None, "dropped_turns": None, "prompt_tokens": None})
                        rows.append(row)
                        line.append(f"{arm} ERROR")
                        continue
                    sent = p["messages"]
                    report = send(sent)
                    row["predicted_ttft_s"] = report.predicted_ttft_s
                    if arm == "previous_chain":
                        row.update({"kept_chunks": len(p["kept_chunks"]), "kept_chunk_ids": p["kept_chunks"], "actions": p["actions"],
                                    "own_predicted_ttft_s": p["predicted_ttft_s"], "own_safety_margin": p["safety_margin"],
                                    "own_planning_s": p["planning_s"], "own_prompt_tokens": p.get("prompt_tokens"), "feasible": p["feasible"],
                                    "profile_adapted": p.get("profile_adapted")})
                    else:
                        row["kept_chunks"] = p["kept"]
                kept_ids = set(row.get("kept_chunk_ids") or [])
                n_sent_turns = sum(1 for m in sent[1:-1] if m.get("role") == "user")
                measured = report.measured_ttft_s
                common = live.predict_ttft_s(len(tok.prompt_tokens(sent)), 0)
                row.update({
                    "measured_ttft_s": measured, "met": measured is not None and measured <= budget,
                    "prompt_tokens": report.prompt_tokens, "common_predicted_ttft_s": common,
                    "predicted_fits_budget": common <= budget,
                    "answer_kept": rag_qa.answer_in(sent, req),
                    "dropped_turns": len(prompts.turns) - n_sent_turns,
                    "evaluated_tokens": report.evaluated_tokens,
                })
                if arm == "trimkit" and kept_ids:
                    row["answer_chunk_kept"] = prompts.ids[req["answer_index"]] in kept_ids
                rows.append(row)
                line.append(f"{arm} {measured if measured is not None else float('nan'):5.2f}s{'' if row['met'] else '!'}"
                            f"{' A' if row['answer_kept'] else ' -'}{row['kept_chunks']:>3}")
            print(f"[{n_job + 1:3d}/{len(jobs)}] {req['id']} {req['chunk_mode']:8s} {req['order']:8s} share {job['share']:.2f} "
                  f"budget {budget:5.2f}s target {target:5.2f}s {'elig' if eligible else 'inel'} | " + " | ".join(line), flush=True)

    finally:
        if prev is not None:
            prev.close()
    host["speed"].append(host_speed("end"))
    host["load_average_end"] = list(os.getloadavg())

    # -- figures ---------------------------------------------------------------------------------
    by_arm = {a: summarize([r for r in rows if r["arm"] == a]) for a in arms}
    by_share = {str(s): {a: summarize([r for r in rows if r["arm"] == a and r["share"] == s]) for a in arms} for s in shares}
    by_mode = {m: {a: summarize([r for r in rows if r["arm"] == a and r["chunk_mode"] == m]) for a in arms} for m in ("scored", "unscored", "plain")}
    n_elig_jobs = sum(1 for r in rows if r["arm"] == arms[0] and r["eligible"])
    wall = time.perf_counter() - t_run

    print()
    print(f"{len(jobs)} jobs ({len(requests)} requests × {per_request} of the shares {shares}); eligible (system + question + answer "
          f"chunk predicted within the target): {n_elig_jobs}/{len(jobs)}")
    print("all shares:")
    for a in arms:
        print_summary(a, by_arm[a], targets=a == "trimkit")
    for s in shares:
        n = sum(1 for r in rows if r["arm"] == arms[0] and r["share"] == s)
        print(f"share {s} ({n} jobs):")
        for a in arms:
            print_summary(a, by_share[str(s)][a], targets=False)
    print("answer kept (eligible) by chunk form:")
    for m, sub in by_mode.items():
        print(f"  {m:<9s} " + "   ".join(f"{a} {share_text(sub[a]['answer_kept_eligible'], sub[a]['eligible'])}" for a in arms))
    prev_rows = [r for r in rows if r["arm"] == "previous_chain" and r.get("own_prompt_tokens") and r.get("prompt_tokens")]
    prev_ratio = median([r["prompt_tokens"] / r["own_prompt_tokens"] for r in prev_rows]) if prev_rows else None
    if prev_ratio is not None and prev is not None:
        print(f"previous_chain counted tokens with chat_format={prev.info.get('chat_format')!r}; sent with {chat_format!r} its prompts "
              f"are {prev_ratio:.2f}× (median) what it counted")
    if prev_error:
        print(f"previous_chain: not run — {prev_error}")
    sp = host["speed"]
    print(f"host: {os.cpu_count()} CPUs, {sp[0]['ms_per_token']:.2f} → {sp[-1]['ms_per_token']:.2f} ms/token cold 1,024-token prefill "
          f"(start → end), decode {profile.decode_tokens_per_s:.1f} tokens/s (profile), load average {sp[0]['load_average'][0]:.2f} → "
          f"{sp[-1]['load_average'][0]:.2f}; run took {wall / 60:.1f} min")

    t = by_arm.get("trimkit", {})
    misses = []
    if t:
        if (t["answer_kept_eligible_share"] or 0) < TARGETS["answer_kept"]:
            misses.append("answer kept")
        if (t["attainment"] or 0) < TARGETS["attainment"]:
            misses.append("attainment")
        if not t["median_use"] >= TARGETS["median_use"]:
            misses.append("median use")
        if t.get("planning") and t["planning"]["share_of_predicted_max"] > TARGETS["planning_share"]:
            misses.append("planning share (max)")
    print(f"trimkit targets missed: {', '.join(misses)}" if misses else "trimkit: every target met")

    result = {
        "benchmark": "rag_answer_kept",
        "quick": args.quick,
        "seed": args.seed,
        "model": os.path.basename(model_path),
        "chat_format": chat_format,
        "n_ctx": args.n_ctx,
        "max_tokens": args.max_tokens,
        "trimkit_version": getattr(trimkit, "__version__", "?"),
        "profile": {"quick": (profile.mode != "full"), "heldout": profile.error.to_dict(), "decode_tokens_per_s": profile.decode_tokens_per_s,
                    "first_token_s": profile.first_token_s, "calibration_s_this_run": calib_s},
        "host": host,
        "wall_s": wall,
        "set": {"requests": len(requests), "shares": shares, "shares_per_request": per_request, "jobs": len(jobs),
                "eligible_jobs": n_elig_jobs, "chunk_tokens": {"min": min(ct), "median": median(ct), "max": max(ct)},
                "untrimmed_tokens": {"min": min(ut), "median": median(ut), "max": max(ut)},
                "eligible_definition": "system + question + the answer chunk alone, cold, predicted ≤ budget × (1 − the trimkit plan's safety margin)"},
        "arms": list(arms),
        "previous_chain": {"available": prev_error is None, "error": prev_error, "sent_over_counted_tokens_median": prev_ratio,
                           **(prev.info if prev is not None else {})},
        "targets": {"answer_kept_eligible": "≥ 98 %", "attainment": "≥ 97 %", "median_measured_use": "≥ 0.8",
                    "planning_share_of_predicted_ttft": "≤ 1 %"},
        "trimkit_targets_missed": misses,
        "summary": by_arm,
        "by_share": by_share,
        "by_chunk_mode": by_mode,
        "requests": req_info,
        "rows": rows,
    }
    write_results(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
