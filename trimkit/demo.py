"""``trimkit demo``: the two phases, then a RAG chat kept under a TTFT budget, on the embedded model."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any

from trimkit.calibration import calibrate
from trimkit.console import ProgressBar, open_llama, profile_lines
from trimkit.messages import Chunk
from trimkit.planning.relevance import rank_chunks
from trimkit.wrapper import wrap

__all__ = ["run_demo", "load_corpus", "load_history", "load_questions", "answer_chunk_status"]


def _data_lines(name: str) -> list[dict[str, Any]]:
    text = resources.files("trimkit").joinpath(f"data/{name}").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_corpus() -> list[dict[str, Any]]:
    """The demo corpus: 40 short documents about the fictional town of Marrowby."""
    return _data_lines("corpus.jsonl")


def load_history() -> list[dict[str, str]]:
    """A 30-message demo conversation (user/assistant alternating)."""
    return _data_lines("history.jsonl")


def load_questions() -> list[dict[str, str]]:
    """One question per corpus document, with its answer and document id."""
    return _data_lines("questions.jsonl")


# The model sees this (Gemma 3's template puts it at the head of the first user turn). Phrased as
# a task, not as "You are …": the 270M model tends to repeat a "You are …" preamble as its answer.
SYSTEM = (
    "Answer the visitor's question about Marrowby in one short sentence, using only the retrieved "
    "context and the conversation. If the context does not hold the answer, say so."
)


def _rule(title: str) -> None:
    print()
    print(f"== {title} " + "=" * max(4, 76 - len(title)))


#: The demo runs no request the profile predicts to take longer than this (TTFT + decode) on
#: this host; it prints the prediction instead.
MAX_REQUEST_S = 20.0
#: Without ``--budget``, the chat's budget is the predicted TTFT of this share of the untrimmed prompt.
BUDGET_SHARE = 0.45


def answer_chunk_status(plan: Any, chunks: Sequence[Any], doc_id: str) -> str:
    """What a plan did with the chunk that holds the answer: ``"kept whole"``, ``"kept as an
    excerpt"``, ``"dropped"`` or ``"not retrieved"`` (it was not among ``chunks``).

    Reads only ``plan.kept_chunks`` and ``plan.dropped_chunks``; a kept excerpt is a chunk with
    the original id and shorter text. ``plan`` None means nothing was planned: all kept."""
    original = {c.id: c.text for c in chunks}
    if doc_id not in original:
        return "not retrieved"
    if plan is None:
        return "kept whole"
    for c in plan.kept_chunks:
        if c.id == doc_id:
            return "kept whole" if c.text == original[doc_id] else "kept as an excerpt"
    return "dropped"


def _predicted_total_s(trimmer: Any, prepared: Any, max_tokens: int) -> float:
    """Predicted TTFT plus the decode of ``max_tokens`` at the profile's decode speed."""
    tps = trimmer.profile.decode_tokens_per_s
    return (prepared.predicted_ttft_s or 0.0) + (max_tokens / tps if tps > 0 else 0.0)


def _run(trimmer: Any, messages: list[dict[str, Any]], chunks: Any, params: dict[str, Any]) -> tuple[Any, str | None, Any]:
    """Plan, then send unless the profile predicts the request would take over MAX_REQUEST_S.

    Returns (prepared, answer or None when not sent, report or None)."""
    prepared = trimmer.prepare(messages, chunks, params)
    if _predicted_total_s(trimmer, prepared, params.get("max_tokens", 0)) > MAX_REQUEST_S:
        return prepared, None, None
    stream = trimmer.execute(prepared, params)
    parts = []
    for chunk in stream:
        for choice in chunk.get("choices", []):
            text = (choice.get("delta") or {}).get("content")
            if text:
                parts.append(text)
    return prepared, "".join(parts), stream.report


def _skipped(trimmer: Any, prepared: Any, max_tokens: int) -> str:
    return (
        f"   not run: the profile predicts {_predicted_total_s(trimmer, prepared, max_tokens):.1f} s on this host "
        f"(TTFT {prepared.predicted_ttft_s:.1f} s for {len(prepared.prompt_tokens):,} prompt tokens, then "
        f"{max_tokens} tokens of decode) — over the demo's {MAX_REQUEST_S:g} s limit"
    )


def run_demo(
    *,
    model: str | None = None,
    budget_s: float | None = None,
    budget_share: float = BUDGET_SHARE,
    turns: int = 3,
    n_ctx: int = 8192,
    quick: bool = False,
    json_path: str | None = None,
) -> int:
    """Run the demo. ``budget_s`` None: the chat's budget is the predicted TTFT of
    ``budget_share`` of the untrimmed prompt on this host (so it trims on any machine)."""
    reports: list[dict[str, Any]] = []
    llm = open_llama(model, n_ctx)
    _rule("1. Calibration: what prefill costs on this machine")
    t0 = time.perf_counter()
    bar = ProgressBar("calibrating", enabled=True)
    try:
        profile = calibrate(llm, quick=quick, progress=bar)
    finally:
        bar.close()
    took = time.perf_counter() - t0
    print("\n".join(profile_lines(profile)))
    print(f"  ({'measured now' if took > 1.0 else 'reused the stored profile'}; took {took:.1f} s)")

    corpus = load_corpus()
    plain = wrap(llm, profile=profile)  # no budget: measure and report only

    _rule("2. The two phases: a long prompt and a short one, no budget")
    long_text = "\n\n".join(d["text"] for d in corpus[:10])
    long_msgs = [{"role": "user", "content": long_text + "\n\nIn one sentence: what is this text about?"}]
    short_msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    for label, msgs, max_tokens in (("long prompt, short answer", long_msgs, 24), ("short prompt, long answer", short_msgs, 96)):
        prepared, answer, rep = _run(plain, msgs, None, {"max_tokens": max_tokens, "temperature": 0.7})
        print(f"\n-- {label}")
        if rep is None:
            print(_skipped(plain, prepared, max_tokens))
            continue
        print(rep)
        reports.append({"part": "two phases", "label": label, "report": rep.to_dict()})
    print(
        "\n  The long prompt waits before its first token (prefill grows with the prompt); the short one\n"
        "  starts at once and then streams at the same decode speed. Trimming helps only the wait."
    )

    history = load_history()
    questions = [q for q in load_questions()][:turns + 1]
    chunk_texts = [Chunk(text=d["text"], id=d["id"]) for d in corpus]

    def retrieved(question: str) -> list[Any]:
        # a retriever would hand over its top 12; we use the library's own BM25 for that here
        return list(rank_chunks(chunk_texts, question)[:12])

    _rule(f"3. A RAG chat: {len(history)} earlier messages + 12 retrieved chunks")
    q0 = questions[0]["question"]
    msgs = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": q0}]
    prepared, answer, rep = _run(plain, msgs, retrieved(q0), {"max_tokens": 32, "temperature": 0.2})
    print("\n-- untrimmed")
    if rep is None:
        print(_skipped(plain, prepared, 32))
    else:
        print(rep)
        reports.append({"part": "rag chat", "label": "untrimmed", "report": rep.to_dict()})

    # the budget: given, or what this host needs to prefill a share of the untrimmed prompt
    q1 = questions[1]["question"] if len(questions) > 1 else q0
    first = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": q1}]
    untrimmed = len(plain.prepare(first, retrieved(q1)).prompt_tokens)
    if budget_s is None:
        share_tokens = max(int(untrimmed * budget_share), 1)
        budget_s = profile.predict_ttft_s(share_tokens, 0)
        derived = (
            f"  budget {budget_s:.2f} s: the profile's predicted TTFT for {budget_share:.0%} of the untrimmed "
            f"prompt ({share_tokens:,} of {untrimmed:,} tokens, nothing cached) on this host"
        )
        # on a slow host that share alone would take too long to show: cap it so each turn runs
        decode_s = 32 / profile.decode_tokens_per_s if profile.decode_tokens_per_s > 0 else 0.0
        cap_s = max(MAX_REQUEST_S - decode_s, 0.5)
        if budget_s > cap_s:
            derived += f",\n  capped at {cap_s:.2f} s so each turn (TTFT + 32 tokens of decode) stays within the demo's {MAX_REQUEST_S:g} s limit"
            budget_s = cap_s
    else:
        derived = f"  budget {budget_s:g} s (--budget); the untrimmed prompt is {untrimmed:,} tokens, " \
                  f"predicted {profile.predict_ttft_s(untrimmed, 0):.2f} s with nothing cached"

    _rule(f"4. The same chat under a TTFT budget of {budget_s:.2f} s, turn after turn")
    print(derived)
    chat = wrap(llm, ttft_budget_s=budget_s, profile=plain.profile)
    convo = [{"role": "system", "content": SYSTEM}, *history]
    kept_answer = 0
    for turn, q in enumerate(questions[1 : turns + 1], start=1):
        convo.append({"role": "user", "content": q["question"]})
        chunks = retrieved(q["question"])
        prepared, answer, rep = _run(chat, convo, chunks, {"max_tokens": 32, "temperature": 0.2})
        status = answer_chunk_status(prepared.plan, chunks, q["doc_id"])
        kept_answer += status.startswith("kept")
        plan = prepared.plan
        kept_n = len(plan.kept_chunks) if plan is not None else len(chunks)
        print(f"\n-- turn {turn}: {q['question']}")
        print(f"   answer chunk {q['doc_id']}: {status} ({kept_n} of {len(chunks)} chunks kept); expected answer: {q['answer']!r}")
        if rep is None:
            print(_skipped(chat, prepared, 32))
            convo.pop()
            continue
        print(f"   answer: {(answer or '').strip()[:160]!r}")
        print(rep)
        reports.append({
            "part": "budget", "label": f"turn {turn}", "report": rep.to_dict(),
            "answer_chunk": {"id": q["doc_id"], "status": status}, "answer": answer,
        })
        convo.append({"role": "assistant", "content": answer or ""})
        chat.idle()
    met = [r["report"]["budget_met"] for r in reports if r["part"] == "budget"]
    print(
        f"\n  budget met on {sum(bool(m) for m in met)} of {len(met)} turns run; the answer's chunk was kept on "
        f"{kept_answer} of {turns} turns; decode was never touched."
    )
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(reports, fh, indent=1)
        print(f"  reports written to {json_path}")
    return 0
