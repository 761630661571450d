"""TTFT budgets across two server replicas and several callers: routers compared on one workload.

Starts two ``python -m llama_cpp.server`` replicas of the embedded Gemma-3-270M on loopback
(``--n_threads 1`` each, trimkit's ``gemma-3`` chat format, ``--logits_all false``,
``--interrupt_requests false``; always stopped at the end, also on Ctrl-C or SIGTERM),
calibrates trimkit against each (``--calibration``, default full; stored per endpoint in a
temporary store, and given to every arm), sends one unmeasured workload-sized request to each,
then sends the same workload through four arms, one after the other:

- ``round_robin`` and ``least_in_flight``: client-side baselines. One single-endpoint trimkit
  wrapper (``trimkit.wrap_url(url)``) per replica; the benchmark picks the replica of each
  request itself (in turn; or the one with the fewest requests of this client in flight, ties
  in turn) and the wrapper trims that request to its budget. So every arm trims with trimkit
  and the arms differ only in routing;
- ``trimkit``: ``trimkit.wrap_url([url1, url2], ...)``, trimkit's fleet router (each request to
  the replica with the lowest predicted TTFT: queue wait plus prefill of what it has not cached);
- ``trimkit_kill``: the same router; replica 2 is SIGKILLed once half the requests have been
  answered, and the rest must fail over to replica 1.

**Workload** (fixed by ``--seed``, the same for every arm): ``--conversations`` concurrent
conversations (threads) of ``--turns`` turns over the demo data (``trimkit.cli``): the shared
system prompt, a different slice of the demo conversation per conversation, then per turn one
demo question with ``--chunks`` retrieved documents (the answer's and random others, placed by
trimkit into the question). Each answered turn is appended to the history (the question without
the chunks, and a short answer), so every prompt extends the previous one and the server's prefix
cache matters. Between turns a conversation pauses ("think time"), drawn so that the nominal load
of the replicas is ``--load``. Every request gets its own TTFT budget: ``--share`` of the
predicted cold TTFT of its untrimmed prompt (the calibrated profile of replica 1), but at least
``--floor`` × the predicted TTFT of its minimal prompt (system + question). Answers are
``max_tokens=8`` with end-of-turn banned, so every request decodes the same. Prompts are counted
exactly in this process (the same GGUF's tokenizer, trimkit's ``gemma-3`` template), for every
arm alike; ``--server-tokenizer`` counts through the servers' ``/extras/tokenize`` instead, which
llama-cpp-python answers only when its model is free, so counting waits behind a busy replica.

**Figures per arm**: budget attainment — *felt* (create() call → first content chunk: what the
caller waits, planning included) is held to the target, the report's (send → first token) is
printed beside it; p50/p95 of both; the share of prompt tokens served from the server's cache,
*server-reported*: llama-cpp-python's server puts no cached-token count in its responses, so the
benchmark reads its log (``Llama.generate: N prefix-match hit``) per arm and divides by the
prompt tokens sent (trimkit's prediction beside it); requests lost (no answer after at most one
retry of a ``StreamInterruptedError``, which trimkit raises for a stream cut mid-answer; the
retries are counted); errors by type.

**In process** (after the servers are stopped): 4 threads on one ``Llama``
(``trimkit.wrap(llm, profile=...)``, no budget) start together and send ``--inproc-requests``
requests each; the median absolute % error of the predicted *felt* TTFT (wait for the engine +
TTFT) with the queue term (``report.predicted_ttft_s``, which includes
``report.queue_wait_predicted_s``) and without it (the same minus the predicted wait).

    python benchmarks/fleet.py [--out benchmarks/results/fleet.json] [--seed 11] [--share 0.5] [--load 0.6]
    python benchmarks/fleet.py --smoke   # 2 conversations x 2 turns, micro calibration (in process quick): does it run

Targets: attainment (felt) >= 95 % for trimkit's router and ahead of both baselines; cached share
>= 1.5x round-robin's; 0 requests lost in every arm (the kill arm included); in-process median
error with the queue term <= 15 %. The run prints its expected duration first; run it on an
otherwise idle machine (a second process on 2 cores changes every timing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests._server import ServerProcess, start_server, stop_server, wait_ready  # noqa: E402  (the tests' launcher)

CHAT_FORMAT = "gemma-3"
BASELINES = ("round_robin", "least_in_flight")
ARMS = (*BASELINES, "trimkit", "trimkit_kill")
#: Gemma's <eos> and <end_of_turn> banned: every answer streams exactly max_tokens tokens
PARAMS: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0, "logit_bias": {"1": -100.0, "106": -100.0}}
TARGETS = {"attainment": 0.95, "cached_vs_round_robin": 1.5, "lost": 0, "inprocess_median_ape_pct": 15.0}
PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


# -- small helpers ----------------------------------------------------------------------------------
def pct(values: Sequence[float | None], q: float) -> float:
    """The q-quantile (nearest rank), NaN for no values."""
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return float("nan")
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def share(k: int, n: int) -> float:
    return k / n if n else float("nan")


def ms(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value * 1000:.0f} ms"


def content_of(chunk: Any) -> str | None:
    """The text of a streamed chunk (a dict from ``wrap_url``, a chunk object from openai or llama_cpp)."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else getattr(chunk, "choices", None)
    if not choices:
        return None
    choice = choices[0]
    delta = choice.get("delta") if isinstance(choice, dict) else getattr(choice, "delta", None)
    if delta is None:
        return None
    return delta.get("content") if isinstance(delta, dict) else getattr(delta, "content", None)


# -- the replicas ---------------------------------------------------------------------------------------
#: beyond the test launcher's own (loopback, the model, n_ctx, trimkit's chat format, --logits_all false)
def server_args(threads: int, prompt_cache_mib: int = 0) -> list[str]:
    """``prompt_cache_mib`` > 0: llama-cpp-python's RAM prompt cache of that size (``--cache``),
    which keeps the KV state of several earlier prompts, not just the last one."""
    cache = ["--cache", "true", "--cache_type", "ram", "--cache_size", str(prompt_cache_mib << 20)] if prompt_cache_mib > 0 else []
    return ["--n_threads", str(threads), "--n_threads_batch", str(threads),
            # its default cuts the stream in flight short whenever another request arrives
            "--interrupt_requests", "false", "--verbose", "true", *cache]


def held_prompts_bound(llm: Any, n_ctx: int, prompt_cache_mib: int) -> int:
    """How many prompts a RAM prompt cache of ``prompt_cache_mib`` holds at least: its size over
    the KV state of a full context, from the GGUF's own metadata (layers × KV heads × (key +
    value length) × 2 bytes per token, f16 cache) — no figure of this host or model assumed."""
    meta = llm.metadata
    arch = meta["general.architecture"]
    layers = int(meta[f"{arch}.block_count"])
    q_heads = int(meta[f"{arch}.attention.head_count"])
    heads = int(meta.get(f"{arch}.attention.head_count_kv") or q_heads)
    key = int(meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // q_heads)
    value = int(meta.get(f"{arch}.attention.value_length") or key)
    state_bytes = layers * heads * (key + value) * 2 * n_ctx
    return max((prompt_cache_mib << 20) // state_bytes, 1)


@attrs.define
class Replica:
    """One ``llama_cpp.server`` process (started by the tests' launcher, :mod:`tests._server`);
    its verbose log is kept in a file and read per arm."""

    index: int
    server: ServerProcess
    killed_at: float | None = None
    start_kwargs: dict[str, Any] = attrs.field(factory=dict)

    def restart(self) -> None:
        """Stop the server and start it again on the same port, empty (its RAM prompt cache too)."""
        stop_server(self.server)
        self.server = start_server(self.port, **self.start_kwargs)
        wait_ready(self.server, timeout_s=120.0)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.server.proc

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def name(self) -> str:
        return f"replica{self.index + 1}"

    def log_offset(self) -> int:
        return self.server.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.server.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")


@contextlib.contextmanager
def running_replicas(n: int, model_path: str, n_ctx: int, threads: int, prompt_cache_mib: int = 0) -> Iterator[list[Replica]]:
    """``n`` started and ready replicas; every one stopped on exit, whatever happens (and, on
    Linux, each dies with this process)."""
    replicas: list[Replica] = []
    try:
        for i in range(n):
            start_kwargs = {"model_path": model_path, "n_ctx": n_ctx, "chat_format": CHAT_FORMAT, "extra_args": server_args(threads, prompt_cache_mib)}
            replicas.append(Replica(i, start_server(**start_kwargs), start_kwargs=start_kwargs))
        for r in replicas:
            wait_ready(r.server, timeout_s=120.0)
        yield replicas
    except Exception:  # what the servers said before the failure (not on Ctrl-C)
        for r in replicas:
            print(f"--- {r.name} log (last 3,000 characters):\n{r.server.log_tail(3000)}", file=sys.stderr)
        raise
    finally:
        for r in replicas:
            with contextlib.suppress(Exception):
                stop_server(r.server)


def plain_chat(replica: Replica, messages: Sequence[dict[str, str]]) -> None:
    """One chat request straight to the server (not through trimkit, not measured)."""
    if replica.proc.poll() is not None:
        return
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(replica.base_url + "/chat/completions", json={"messages": [dict(m) for m in messages], "max_tokens": 1}, timeout=300.0)


def flush_cache(replica: Replica, tag: str) -> None:
    """Leave an unrelated one-line prompt in the server's KV cache, so every arm starts cold."""
    plain_chat(replica, [{"role": "user", "content": f"Say one word. ({tag})"}])


def warm_up(replicas: Sequence[Replica], messages: Sequence[dict[str, str]]) -> None:
    """One workload-sized chat request on every replica at once, before the first arm: whatever a
    server does once (first long prompt, first chat template) is not charged to the first arm."""
    threads = [threading.Thread(target=plain_chat, args=(r, messages), daemon=True) for r in replicas]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def server_cache_counts(log_text: str) -> dict[str, int]:
    """What the server's verbose log says it did: prompt evaluations, prefix hits and the tokens
    they reused."""
    hits = [int(m.group(1)) for m in PREFIX_HIT.finditer(log_text)]
    return {"evaluations": len(PROMPT_EVAL.findall(log_text)), "prefix_hits": len(hits), "cached_tokens": sum(hits)}


# -- the workload --------------------------------------------------------------------------------------
@attrs.frozen
class Turn:
    """One request of one conversation, the same in every arm."""

    conv: int
    turn: int
    messages: tuple[dict[str, str], ...]
    chunks: tuple[Any, ...]
    answer_doc: str
    think_s: float = 0.0  # pause before sending it (before turn 0: the conversation's start offset)
    budget_s: float = 0.0
    untrimmed_tokens: int = 0
    predicted_untrimmed_s: float = 0.0
    predicted_minimal_s: float = 0.0


def build_conversations(n_conv: int, n_turns: int, history_pairs: int, n_chunks: int, rng: random.Random) -> list[list[Turn]]:
    """Conversations over the demo data: each starts from its own slice of the demo conversation."""
    import trimkit
    from trimkit.cli import SYSTEM, load_corpus, load_history, load_questions

    corpus, history, questions = load_corpus(), load_history(), load_questions()
    docs = {d["id"]: d for d in corpus}
    order = rng.sample(range(len(questions)), len(questions))
    pairs = len(history) // 2
    out = []
    for c in range(n_conv):
        start = (c * 2) % max(1, pairs - history_pairs + 1)
        past: list[dict[str, str]] = list(history[2 * start : 2 * (start + history_pairs)])
        turns = []
        for t in range(n_turns):
            q = questions[order[(c * n_turns + t) % len(order)]]
            others = rng.sample([d for d in corpus if d["id"] != q["doc_id"]], n_chunks - 1)
            picked = [docs[q["doc_id"]], *others]
            rng.shuffle(picked)
            chunks = tuple(trimkit.Chunk(text=d["text"], id=d["id"]) for d in picked)
            messages = ({"role": "system", "content": SYSTEM}, *past, {"role": "user", "content": q["question"]})
            turns.append(Turn(c, t, messages, chunks, q["doc_id"]))
            doc = docs[q["doc_id"]]
            past += [{"role": "user", "content": q["question"]},
                     {"role": "assistant", "content": f"{q['answer']} (from \"{doc['title']}\")."}]
        out.append(turns)
    return out


def price_workload(convs: list[list[Turn]], tokenizer: Any, profile: Any, *, share_: float, floor: float, load: float,
                   n_replicas: int, rng: random.Random) -> list[list[Turn]]:
    """Budgets from the calibrated profile, and think times that make the nominal load ``load``."""
    from trimkit.pipeline import place_chunks

    priced = []
    for turns in convs:
        out = []
        for t in turns:
            n = len(tokenizer.prompt_tokens(place_chunks(t.messages, t.chunks)))
            n_min = len(tokenizer.prompt_tokens([t.messages[0], t.messages[-1]]))
            untrimmed, minimal = profile.predict_ttft_s(n, 0), profile.predict_ttft_s(n_min, 0)
            out.append(attrs.evolve(t, untrimmed_tokens=n, predicted_untrimmed_s=untrimmed, predicted_minimal_s=minimal,
                                    budget_s=max(share_ * untrimmed, floor * minimal)))
        priced.append(out)
    # a conversation's cycle is think + service; each replica serves n_conv / n_replicas of them:
    # load = (n_conv / n_replicas) * service / (think + service), with service ~ the mean budget
    service = statistics.mean(t.budget_s for turns in priced for t in turns)
    think = max(0.0, service * (len(priced) / (n_replicas * load) - 1.0))
    return [[attrs.evolve(t, think_s=think * (rng.uniform(0.0, 1.0) if t.turn == 0 else rng.uniform(0.5, 1.5))) for t in turns]
            for turns in priced]


# -- routers ---------------------------------------------------------------------------------------------
class PinnedRouter:
    """A client-side baseline: one single-endpoint trimkit wrapper per replica, and a rule that
    picks the replica of each request (``round_robin``; ``least_in_flight`` of this client, ties
    in turn)."""

    def __init__(self, policy: str, fronts: Sequence[Any]) -> None:
        self.policy = policy
        self.fronts = list(fronts)
        self.in_flight = [0] * len(self.fronts)
        self._next = 0
        self._lock = threading.Lock()

    def pick(self) -> int:
        with self._lock:
            n = len(self.fronts)
            if self.policy == "round_robin":
                i = self._next % n
            else:
                fewest = min(self.in_flight)
                i = next(j % n for j in range(self._next, self._next + n) if self.in_flight[j % n] == fewest)
            self._next = i + 1
            self.in_flight[i] += 1
            return i

    def done(self, i: int) -> None:
        with self._lock:
            self.in_flight[i] -= 1

    def close(self) -> None:
        for f in self.fronts:
            f.close()


def endpoint_index(label: Any, replicas: Sequence[Replica]) -> int | None:
    """The replica a report's ``endpoint`` names (None when it names none)."""
    if label is None:
        return None
    for r in replicas:
        if f":{r.port}" in str(label):
            return r.index
    return None


# -- one arm ------------------------------------------------------------------------------------------------
@attrs.define
class ArmRun:
    """Sends the whole workload through one router, a thread per conversation."""

    name: str
    convs: list[list[Turn]]
    replicas: list[Replica]
    pinned: PinnedRouter | None = None
    fleet: Any = None
    kill_after: int | None = None  # SIGKILL the last replica once this many requests are answered
    rows: list[dict[str, Any]] = attrs.field(factory=list)
    kill: dict[str, Any] | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _answered: int = 0

    def run(self) -> float:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self.conversation, args=(turns,), daemon=True, name=f"{self.name}-c{turns[0].conv}")
                   for turns in self.convs]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t0

    def conversation(self, turns: list[Turn]) -> None:
        for t in turns:
            time.sleep(t.think_s)
            row = self.request(t)
            with self._lock:
                self.rows.append(row)
                if row["answered"]:
                    self._answered += 1
                    if self.kill_after is not None and self.kill is None and self._answered >= self.kill_after:
                        self.kill_replica()
            print(f"  {self.name:15} c{t.conv} t{t.turn}  {row['endpoint_name'] or '?':8}  budget {t.budget_s:6.2f} s  "
                  f"felt {row['felt_ttft_s'] if row['felt_ttft_s'] is not None else float('nan'):6.2f} s  "
                  f"{row['prompt_tokens_before'] or 0:5d} → {row['prompt_tokens'] or 0:5d} tok  "
                  f"cached pred {row['cached_predicted'] or 0:5d}  "
                  f"{'met ' if row['felt_met'] else 'MISS'}{'  ' + row['error'] if row['error'] else ''}", flush=True)

    def kill_replica(self) -> None:
        victim = self.replicas[-1]
        endpoints = getattr(self.fleet, "endpoints", ())
        in_flight = list(self.pinned.in_flight) if self.pinned else [getattr(ep, "in_flight", None) for ep in endpoints]
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.killed_at = time.perf_counter()
        self.kill = {"replica": victim.name, "after_answered": self._answered, "in_flight_per_replica": in_flight}
        print(f"  ** SIGKILL {victim.name} (pid {victim.proc.pid}) after {self._answered} answered requests; "
              f"in flight per replica {in_flight}", flush=True)

    def request(self, t: Turn) -> dict[str, Any]:
        from trimkit.errors import StreamInterruptedError, TrimkitError

        row: dict[str, Any] = {"arm": self.name, "conv": t.conv, "turn": t.turn, "budget_s": t.budget_s,
                               "untrimmed_tokens": t.untrimmed_tokens, "predicted_untrimmed_s": t.predicted_untrimmed_s,
                               "answered": False, "attempts": 0, "errors": [], "error": None, "endpoint": None, "endpoint_name": None,
                               "prompt_tokens": None, "prompt_tokens_before": None, "cached_predicted": None, "felt_ttft_s": None,
                               "felt_met": False}
        for attempt in range(2):  # an app retries a stream cut mid-answer once; anything else is final
            row["attempts"] = attempt + 1
            i = self.pinned.pick() if self.pinned else None
            front = self.pinned.fronts[i] if self.pinned and i is not None else self.fleet
            t0 = time.perf_counter()
            first = None
            try:
                stream = front.chat.completions.create(messages=list(t.messages), rag_chunks=list(t.chunks),
                                                       ttft_budget_s=t.budget_s, stream=True, **PARAMS)
                with contextlib.closing(stream):
                    for chunk in stream:
                        if first is None and content_of(chunk):
                            first = time.perf_counter()
                report = stream.report
                row.update(self.report_fields(report, i))
                row["felt_ttft_s"] = None if first is None else first - t0
                row["answered"] = first is not None
                row["felt_met"] = first is not None and row["felt_ttft_s"] <= t.budget_s
                row["error"] = None if first is not None else "no content"
                return row
            except StreamInterruptedError as exc:
                row["errors"].append(type(exc).__name__)
                row.update(self.report_fields(getattr(exc, "report", None), i))
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            except TrimkitError as exc:
                row["errors"].append(type(exc).__name__)
                row.update(self.report_fields(getattr(exc, "report", None), i))
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                break
            except Exception as exc:  # untyped: a bug to report, never a silent drop
                row["errors"].append("untyped " + type(exc).__name__)
                row["error"] = f"untyped {type(exc).__name__}: {exc}"[:200]
                break
            finally:
                if self.pinned and i is not None:
                    self.pinned.done(i)
        row.update(felt_ttft_s=None, felt_met=False)
        return row

    def report_fields(self, report: Any, pinned_index: int | None) -> dict[str, Any]:
        if report is None:
            idx = pinned_index
            return {"endpoint": idx, "endpoint_name": None if idx is None else self.replicas[idx].name}
        idx = pinned_index if pinned_index is not None else endpoint_index(getattr(report, "endpoint", None), self.replicas)
        m = report.measurement
        return {
            "endpoint": idx,
            "endpoint_name": None if idx is None else self.replicas[idx].name,
            "endpoint_label": getattr(report, "endpoint", None),
            "measured_ttft_s": report.measured_ttft_s,
            "predicted_ttft_s": report.predicted_ttft_s,
            "queue_wait_predicted_s": getattr(report, "queue_wait_predicted_s", None),
            "queue_s": m.queue_s,
            "budget_met": report.budget_met,
            "feasible": report.feasible,
            "prompt_tokens": report.prompt_tokens,
            "prompt_tokens_before": report.prompt_tokens_before,
            "cached_predicted": report.cached_tokens_predicted,
            "cached_reported": m.cached_tokens,
            "actions": [getattr(a, "strategy", str(a)) for a in report.actions],
            "planning_s": report.planning_s,
            "warnings": list(report.warnings),
        }


def summarize_arm(run: ArmRun, wall_s: float, log_counts: Sequence[dict[str, int]]) -> dict[str, Any]:
    rows = run.rows
    total = sum(len(turns) for turns in run.convs)  # a conversation thread that died leaves its turns unsent: lost
    answered = [r for r in rows if r["answered"]]
    felt = [r["felt_ttft_s"] for r in answered]
    measured = [r.get("measured_ttft_s") for r in answered]
    prompt = sum(r.get("prompt_tokens") or 0 for r in answered)
    cached_server = sum(c["cached_tokens"] for c in log_counts)
    errors: dict[str, int] = {}
    for r in rows:
        for e in r["errors"]:
            errors[e] = errors.get(e, 0) + 1
    per_endpoint = {rep.name: sum(1 for r in answered if r.get("endpoint") == rep.index) for rep in run.replicas}
    return {
        "requests": total,
        "answered": len(answered),
        "lost": total - len(answered),
        "retried_after_stream_cut": sum(1 for r in rows if r["attempts"] > 1),
        "errors": errors,
        "attainment_felt": share(sum(1 for r in rows if r["felt_met"]), total),
        "attainment_report": share(sum(1 for r in rows if r.get("budget_met")), total),
        "feasible": sum(1 for r in rows if r.get("feasible")),
        "felt_ttft_p50_s": pct(felt, 0.5), "felt_ttft_p95_s": pct(felt, 0.95),
        "ttft_p50_s": pct(measured, 0.5), "ttft_p95_s": pct(measured, 0.95),
        "median_felt_over_budget": pct([r["felt_ttft_s"] / r["budget_s"] for r in answered], 0.5),
        "prompt_tokens_sent": prompt,
        "cached_share_server": share(cached_server, prompt),
        "cached_share_predicted": share(sum(r.get("cached_predicted") or 0 for r in answered), prompt),
        "server_log": {rep.name: c for rep, c in zip(run.replicas, log_counts)},
        "per_endpoint": per_endpoint,
        "planning_p50_s": pct([r.get("planning_s") for r in answered], 0.5),
        "wall_s": wall_s,
        "kill": run.kill,
    }


def run_arm(name: str, convs: list[list[Turn]], replicas: list[Replica], wrapper_kwargs: dict[str, Any],
            profiles: Sequence[Any], fleet_kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import trimkit

    urls = [r.base_url for r in replicas]
    for r in replicas:
        if fleet_kwargs and fleet_kwargs.get("held_prompts"):  # a RAM prompt cache would serve this arm what the last one sent
            r.restart()
        flush_cache(r, name)
    pinned, fleet = None, None
    if name in BASELINES:
        pinned = PinnedRouter(name, [trimkit.wrap_url(u, profile=p, **wrapper_kwargs) for u, p in zip(urls, profiles)])
    else:
        fleet = trimkit.wrap_url(urls, profile=list(profiles), **wrapper_kwargs, **(fleet_kwargs or {}))  # one profile per endpoint
    total = sum(len(c) for c in convs)
    run = ArmRun(name, convs, replicas, pinned=pinned, fleet=fleet, kill_after=(total + 1) // 2 if name == "trimkit_kill" else None)
    offsets = [r.log_offset() for r in replicas]
    print(f"== {name}: {total} requests", flush=True)
    try:
        wall = run.run()
    finally:
        (pinned or fleet).close()
    time.sleep(0.5)  # the servers' last log lines
    counts = [server_cache_counts(r.log_since(off)) for r, off in zip(replicas, offsets)]
    summary = summarize_arm(run, wall, counts)
    return summary, sorted(run.rows, key=lambda r: (r["conv"], r["turn"]))


# -- in process ---------------------------------------------------------------------------------------------
def felt_prediction(report: Any) -> tuple[float | None, float | None, float | None]:
    """(predicted felt TTFT with the queue term, without it, measured felt TTFT) of an in-process
    report: both of the report's TTFTs are the caller's (the wait for the engine included); the
    prediction without the queue term is the same less the predicted wait."""
    if report.predicted_ttft_s is None or report.measured_ttft_s is None:
        return None, None, None
    with_queue = report.predicted_ttft_s
    return with_queue, with_queue - (report.queue_wait_predicted_s or 0.0), report.measured_ttft_s


def run_inprocess(args: argparse.Namespace, convs: list[list[Turn]]) -> dict[str, Any]:
    import trimkit
    from trimkit.backends.llama import LlamaBackend

    llm = trimkit.default_llama("gemma", n_ctx=args.n_ctx)
    t0 = time.perf_counter()
    mode = "quick" if args.smoke else args.calibration  # even --smoke: a micro profile extrapolates too far
    profile = trimkit.calibrate(LlamaBackend(llm), mode=mode, recalibrate=True, store=False)
    calib_s = time.perf_counter() - t0
    chat = trimkit.wrap(llm, profile=profile)
    flat = [t for turns in convs for t in turns]
    rng = random.Random(args.seed + 1)
    n_threads, per_thread = 4, args.inproc_requests
    jobs = [[rng.choice(flat) for _ in range(per_thread)] for _ in range(n_threads)]
    barrier = threading.Barrier(n_threads)
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    print(f"== in process: {n_threads} threads x {per_thread} requests on one Llama ({mode} calibration {calib_s:.1f} s, "
          f"{profile.model})", flush=True)

    def worker(j: int) -> None:
        barrier.wait()
        for t in jobs[j]:
            t_call = time.perf_counter()
            row: dict[str, Any] = {"thread": j, "conv": t.conv, "turn": t.turn}
            try:
                stream = chat.create_chat_completion(messages=list(t.messages), rag_chunks=list(t.chunks[:2]), stream=True, **PARAMS)
                first = None
                for chunk in stream:
                    if first is None and content_of(chunk):
                        first = time.perf_counter()
                r = stream.report
                with_q, without_q, felt = felt_prediction(r)
                row.update(prompt_tokens=r.prompt_tokens, predicted_with_queue_s=with_q, predicted_without_queue_s=without_q,
                           queue_wait_predicted_s=getattr(r, "queue_wait_predicted_s", None), queue_s=r.measurement.queue_s,
                           ttft_s=r.measurement.ttft_s, felt_ttft_s=felt,
                           call_to_first_token_s=None if first is None else first - t_call,
                           ape_with_queue_pct=None if felt is None else abs(with_q - felt) / felt * 100,
                           ape_without_queue_pct=None if felt is None else abs(without_q - felt) / felt * 100)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            with lock:
                rows.append(row)
            print(f"  thread {j}  {row.get('prompt_tokens', 0):5d} tok  waited {row.get('queue_s') or 0:5.2f} s "
                  f"(predicted {row.get('queue_wait_predicted_s') or 0:5.2f})  felt {row.get('felt_ttft_s') or float('nan'):5.2f} s  "
                  f"predicted {row.get('predicted_with_queue_s') or float('nan'):5.2f} / without queue "
                  f"{row.get('predicted_without_queue_s') or float('nan'):5.2f}{'  ' + row['error'] if 'error' in row else ''}", flush=True)

    threads = [threading.Thread(target=worker, args=(j,), daemon=True) for j in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ok = [r for r in rows if r.get("felt_ttft_s")]
    return {
        "threads": n_threads, "requests": len(rows), "errors": [r["error"] for r in rows if "error" in r],
        "calibration": mode, "calibration_s": calib_s, "profile": profile.model.to_dict(),
        "median_ape_with_queue_pct": pct([r["ape_with_queue_pct"] for r in ok], 0.5),
        "median_ape_without_queue_pct": pct([r["ape_without_queue_pct"] for r in ok], 0.5),
        "p90_ape_with_queue_pct": pct([r["ape_with_queue_pct"] for r in ok], 0.9),
        "queue_term_reported": any(r.get("queue_wait_predicted_s") is not None for r in rows),
        "rows": rows,
    }


# -- the run ------------------------------------------------------------------------------------------------
def verdicts(arms: dict[str, dict[str, Any]], inproc: dict[str, Any] | None) -> list[tuple[str, bool, str]]:
    tk = arms.get("trimkit")
    out = []
    if tk is not None:
        out.append(("attainment >= 95 % (trimkit router, felt)", tk["attainment_felt"] >= TARGETS["attainment"],
                    f"{tk['attainment_felt'] * 100:.1f} %"))
        if all(b in arms for b in BASELINES):
            ahead = all(tk["attainment_felt"] > arms[b]["attainment_felt"] for b in BASELINES)
            out.append(("attainment ahead of both baselines", ahead,
                        f"trimkit {tk['attainment_felt'] * 100:.1f} % vs "
                        + ", ".join(f"{b} {arms[b]['attainment_felt'] * 100:.1f} %" for b in BASELINES)))
        rr = arms.get("round_robin")
        if rr is not None:
            ratio = tk["cached_share_server"] / rr["cached_share_server"] if rr["cached_share_server"] > 0 else float("inf")
            out.append(("cached share >= 1.5x round-robin's (server-reported)", ratio >= TARGETS["cached_vs_round_robin"],
                        f"{tk['cached_share_server'] * 100:.1f} % vs {rr['cached_share_server'] * 100:.1f} % ({ratio:.2f}x)"))
    lost = {k: v["lost"] for k, v in arms.items()}
    out.append(("0 requests lost (every arm)", all(v == 0 for v in lost.values()), ", ".join(f"{k} {v}" for k, v in lost.items())))
    if inproc is not None:
        e = inproc["median_ape_with_queue_pct"]
        out.append(("in-process median error with the queue term <= 15 %", e <= TARGETS["inprocess_median_ape_pct"],
                    f"{e:.1f} % (without the queue term {inproc['median_ape_without_queue_pct']:.1f} %)"))
    return out


def print_summary(result: dict[str, Any]) -> None:
    print()
    print(f"== summary{' (SMOKE: tiny workload, micro calibration; not a result)' if result['smoke'] else ''}")
    w = result["workload"]
    print(f"workload: {w['conversations']} conversations x {w['turns']} turns, budgets {w['budget_min_s']:.2f}-{w['budget_max_s']:.2f} s "
          f"(median {w['budget_median_s']:.2f}), think time mean {w['think_mean_s']:.1f} s, nominal load {w['load']}")
    print(f"{'arm':16} {'attain felt':>11} {'(report)':>9} {'felt p50':>9} {'p95':>8} {'TTFT p50':>9} {'p95':>8} "
          f"{'cached srv':>10} {'(pred)':>7} {'lost':>5} {'per replica':>14} {'wall':>7}")
    for name, a in result["arms"].items():
        per = "/".join(str(v) for v in a["per_endpoint"].values())
        print(f"{name:16} {a['attainment_felt'] * 100:10.1f}% {a['attainment_report'] * 100:8.1f}% {ms(a['felt_ttft_p50_s']):>9} "
              f"{ms(a['felt_ttft_p95_s']):>8} {ms(a['ttft_p50_s']):>9} {ms(a['ttft_p95_s']):>8} {a['cached_share_server'] * 100:9.1f}% "
              f"{a['cached_share_predicted'] * 100:6.1f}% {a['lost']:5d} {per:>14} {a['wall_s']:6.0f}s"
              + (f"  errors {a['errors']}" if a["errors"] else ""))
    if result.get("inprocess"):
        ip = result["inprocess"]
        print(f"in process, {ip['threads']} threads on one Llama, {ip['requests']} requests: felt-TTFT error median "
              f"{ip['median_ape_with_queue_pct']:.1f} % with the queue term, {ip['median_ape_without_queue_pct']:.1f} % without")
    for label, ok, detail in result["verdicts"]:
        print(f"  {'PASS' if ok else 'MISS'}  {label}: {detail}")


def json_safe(value: Any) -> Any:
    """NaN and infinities as null: the JSON stays valid."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON results (default benchmarks/results/fleet.json; with --smoke a temporary file)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--history-pairs", type=int, default=3, help="earlier user/assistant pairs each conversation starts with")
    ap.add_argument("--chunks", type=int, default=4, help="retrieved documents per turn")
    ap.add_argument("--share", type=float, default=0.5, help="budget = this share of the untrimmed prompt's predicted cold TTFT")
    ap.add_argument("--floor", type=float, default=3.0, help="... but at least this many times the minimal prompt's")
    ap.add_argument("--load", type=float, default=0.6, help="nominal load of the replicas (sets the think time)")
    ap.add_argument("--inproc-requests", type=int, default=4, help="requests per thread in the in-process case")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--calibration", choices=("micro", "quick", "full"), default="full",
                    help="calibration of each replica and of the in-process model (default full, <= 30 s each: the "
                    "workload's prompts are 1-2k tokens, beyond what a quick one probes on a slow host)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, run in this order (the kill arm last): {','.join(ARMS)}")
    ap.add_argument("--no-inprocess", action="store_true", help="skip the in-process case")
    ap.add_argument("--prompt-cache-mib", type=int, default=0,
                    help="give every replica llama-cpp-python's RAM prompt cache of this size (--cache), which holds "
                    "several conversations' prefixes instead of the last prompt only; trimkit's router is told how many "
                    "prompts it holds at least (held_prompts, from the GGUF's KV size)")
    ap.add_argument("--server-tokenizer", action="store_true",
                    help="count prompts through the servers' /extras/tokenize (answered only when the server's model is free) "
                    "instead of the same GGUF's tokenizer in this process")
    ap.add_argument("--smoke", action="store_true", help="2 conversations x 2 turns, micro calibration: a check that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.inproc_requests = 2, 2, 1
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        ap.error(f"unknown arms: {sorted(unknown)}")
    arms = sorted(dict.fromkeys(arms), key=lambda a: a == "trimkit_kill")  # in the order given; the kill arm (it loses a replica) last
    out_path = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="trimkit-bench-")) / "fleet.smoke.json" if args.smoke else HERE / "results" / "fleet.json")
    os.environ.setdefault("TRIMKIT_CACHE_DIR", tempfile.mkdtemp(prefix="trimkit-bench-cache-"))  # profiles stored per endpoint here

    def terminate(signum: int, frame: Any) -> None:  # SIGTERM: unwind like Ctrl-C, so the servers are stopped
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)

    import trimkit
    from trimkit.backends.http import OpenAIHTTPBackend
    from trimkit.backends.llama import llama_prompt_tokenizer

    rng = random.Random(args.seed)
    convs = build_conversations(args.conversations, args.turns, args.history_pairs, args.chunks, rng)
    mode = "micro" if args.smoke else args.calibration
    wrapper_kwargs: dict[str, Any] = {"chat_format": CHAT_FORMAT, "n_ctx": args.n_ctx}
    if not args.server_tokenizer:  # exact counts without asking a server that may be busy (every arm alike)
        wrapper_kwargs["tokenizer"] = llama_prompt_tokenizer(trimkit.default_llama("gemma", vocab_only=True))
    result: dict[str, Any] = {"smoke": args.smoke, "arms": {}, "rows": {}, "inprocess": None}
    t_start = time.perf_counter()
    fleet_kwargs: dict[str, Any] = {}
    if args.prompt_cache_mib > 0:  # every arm's servers keep several prompts; trimkit's router is told how many
        fleet_kwargs["held_prompts"] = held_prompts_bound(trimkit.default_llama("gemma", vocab_only=True), args.n_ctx, args.prompt_cache_mib)
    with running_replicas(2, trimkit.default_model_path("gemma"), args.n_ctx, threads=1, prompt_cache_mib=args.prompt_cache_mib) as replicas:
        profiles, calibration = [], {}
        for r in replicas:
            with OpenAIHTTPBackend(r.base_url, **wrapper_kwargs) as backend:
                t0 = time.perf_counter()
                p = trimkit.calibrate(backend, mode=mode, recalibrate=True)  # stored for this endpoint: the fleet reads it
                calibration[r.name] = {"mode": mode, "wall_s": time.perf_counter() - t0, "model": p.model.to_dict(),
                                       "first_token_s": p.first_token_s, "heldout": p.error.to_dict()}
                if not profiles:
                    tokenizer = backend.tokenizer
                    tokenizer_name, exact = tokenizer.name, backend.prompt_count_exact
                    convs = price_workload(convs, tokenizer, p, share_=args.share, floor=args.floor, load=args.load,
                                           n_replicas=len(replicas), rng=rng)
            profiles.append(p)
            print(f"{r.name}: {mode} calibration {calibration[r.name]['wall_s']:.1f} s, {p.model}", flush=True)
        budgets = [t.budget_s for turns in convs for t in turns]
        thinks = [t.think_s for turns in convs for t in turns if t.turn > 0]
        per_arm = max(sum(t.think_s + t.budget_s for t in turns) for turns in convs)
        print(f"workload: {len(budgets)} requests per arm, budgets {min(budgets):.2f}-{max(budgets):.2f} s; "
              f"expect about {per_arm * len(arms) / 60:.1f} min for the {len(arms)} arms (one conversation's think + budgets: "
              f"{per_arm:.0f} s), plus the in-process case", flush=True)
        result["servers"] = {"command": ["python -m llama_cpp.server --host 127.0.0.1 --chat_format", CHAT_FORMAT,
                                         "--logits_all false --n_ctx", str(args.n_ctx), *server_args(1, args.prompt_cache_mib)], "replicas": len(replicas),
                             "prompt_cache_mib": args.prompt_cache_mib, "held_prompts": fleet_kwargs.get("held_prompts"),
                             "tokenizer": tokenizer_name, "prompt_count_exact": exact}
        result["calibration"] = calibration
        result["workload"] = {"conversations": args.conversations, "turns": args.turns, "history_pairs": args.history_pairs,
                              "chunks": args.chunks, "share": args.share, "floor": args.floor, "load": args.load, "seed": args.seed,
                              "params": PARAMS, "budget_min_s": min(budgets), "budget_max_s": max(budgets),
                              "budget_median_s": statistics.median(budgets),
                              "think_mean_s": statistics.mean(thinks) if thinks else 0.0,
                              "untrimmed_tokens_median": statistics.median(t.untrimmed_tokens for c in convs for t in c)}
        from trimkit.pipeline import place_chunks

        first = convs[0][0]
        warm_up(replicas, place_chunks(first.messages, first.chunks))
        for name in arms:
            summary, rows = run_arm(name, convs, replicas, wrapper_kwargs, profiles, fleet_kwargs)
            result["arms"][name] = summary
            result["rows"][name] = rows
    if not args.no_inprocess:
        result["inprocess"] = run_inprocess(args, convs)
    result["wall_s"] = time.perf_counter() - t_start
    result["host"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                      "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None}
    result["targets"] = TARGETS
    result["verdicts"] = verdicts(result["arms"], result["inprocess"])
    print_summary(result)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(json_safe(result), indent=1, default=str))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
