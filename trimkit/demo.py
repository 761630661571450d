"""``trimkit demo``: the two phases, then a RAG chat kept under a TTFT budget, on the embedded model."""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import Any

__all__ = ["run_demo", "load_corpus", "load_history", "load_questions"]


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


SYSTEM = (
    "You are the Marrowby visitor assistant. Answer briefly and only from the retrieved context "
    "and the conversation. If the context does not hold the answer, say so."
)


def _rule(title: str) -> None:
    print()
    print(f"== {title} " + "=" * max(4, 76 - len(title)))


def run_demo(*, model: str | None = None, budget_s: float = 1.0, turns: int = 3, n_ctx: int = 8192, quick: bool = False, json_path: str | None = None) -> int:
    import trimkit
    from trimkit.cli import _Bar, open_llama, profile_lines
    from trimkit.relevance import rank_chunks

    reports: list[dict[str, Any]] = []
    llm = open_llama(model, n_ctx)
    _rule("1. Calibration: what prefill costs on this machine")
    t0 = time.perf_counter()
    bar = _Bar("calibrating", enabled=True)
    try:
        profile = trimkit.calibrate(llm, quick=quick, progress=bar)
    finally:
        bar.close()
    took = time.perf_counter() - t0
    print("\n".join(profile_lines(profile)))
    print(f"  ({'measured now' if took > 1.0 else 'reused the stored profile'}; took {took:.1f} s)")

    corpus = load_corpus()
    plain = trimkit.wrap(llm, profile=profile)  # no budget: measure and report only

    _rule("2. The two phases: a long prompt and a short one, no budget")
    long_text = "\n\n".join(d["text"] for d in corpus[:10])
    long_msgs = [{"role": "user", "content": long_text + "\n\nIn one sentence: what is this text about?"}]
    short_msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    for label, msgs, max_tokens in (("long prompt, short answer", long_msgs, 24), ("short prompt, long answer", short_msgs, 96)):
        plain.create_chat_completion(messages=msgs, max_tokens=max_tokens, temperature=0.7)
        rep = plain.last_report
        print(f"\n-- {label}")
        print(rep)
        reports.append({"part": "two phases", "label": label, "report": rep.to_dict()})
    print(
        "\n  The long prompt waits before its first token (prefill grows with the prompt); the short one\n"
        "  starts at once and then streams at the same decode speed. Trimming helps only the wait."
    )

    history = load_history()
    questions = [q for q in load_questions()][:turns + 1]
    chunk_texts = [trimkit.Chunk(text=d["text"], id=d["id"]) for d in corpus]

    def retrieved(question: str) -> list[Any]:
        # a retriever would hand over its top 12; we use the library's own BM25 for that here
        return list(rank_chunks(chunk_texts, question)[:12])

    _rule(f"3. A RAG chat: {len(history)} earlier messages + 12 retrieved chunks")
    q0 = questions[0]["question"]
    msgs = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": q0}]
    plain.create_chat_completion(messages=msgs, rag_chunks=retrieved(q0), max_tokens=32, temperature=0.2)
    rep = plain.last_report
    print("\n-- untrimmed")
    print(rep)
    reports.append({"part": "rag chat", "label": "untrimmed", "report": rep.to_dict()})

    _rule(f"4. The same chat under a TTFT budget of {budget_s:g} s, turn after turn")
    chat = trimkit.wrap(llm, ttft_budget_s=budget_s, profile=plain.profile)
    convo = [{"role": "system", "content": SYSTEM}, *history]
    for turn, q in enumerate(questions[1 : turns + 1], start=1):
        convo.append({"role": "user", "content": q["question"]})
        out = chat.create_chat_completion(messages=convo, rag_chunks=retrieved(q["question"]), max_tokens=32, temperature=0.2)
        answer = out["choices"][0]["message"]["content"] or ""
        rep = chat.last_report
        print(f"\n-- turn {turn}: {q['question']}")
        print(f"   answer: {answer.strip()[:160]!r}")
        print(rep)
        reports.append({"part": "budget", "label": f"turn {turn}", "report": rep.to_dict()})
        convo.append({"role": "assistant", "content": answer})
        chat.idle()
    met = [r["report"]["budget_met"] for r in reports if r["part"] == "budget"]
    print(f"\n  budget met on {sum(bool(m) for m in met)} of {len(met)} turns; decode was never touched.")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(reports, fh, indent=1)
        print(f"  reports written to {json_path}")
    return 0
