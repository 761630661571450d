"""``trimkit demo``: the two phases, then a RAG chat kept under a TTFT budget, on the embedded model.

Sized to the host: it aims to end within :data:`TIME_TARGET_S` (``--time-target``) whatever the
host's speed. It reuses the stored profile or calibrates within a share of that time; then each
request may take an equal share of the time left, predicted from the profile (TTFT) and the
measured decode speed: the long prompt takes fewer documents and answers fewer tokens where the
host is slow, and a request predicted not to fit is not run — its prediction is printed.

**Sizing.** How much of ``trimkit demo`` fits this host: the demo's time target, its clock
(:class:`Timeline`), the speeds it plans with (:class:`HostSpeed`) and the sizing of each part
from the profile's predictions (the long prompt, answer lengths, the chat's budget).
"""

from __future__ import annotations

import json
import re
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from trimkit._calibration import FULL_BUDGET_S, QUICK_BUDGET_S, as_backend, calibrate, load_profile
from trimkit._console import ProgressBar, open_llama, profile_lines
from trimkit.messages import Chunk
from trimkit.planning.values import rank_chunks
from trimkit.wrapper import wrap

__all__ = ["run_demo", "load_corpus", "load_history", "load_questions", "demo_questions", "answer_chunk_status", "answer_is_right", "SYSTEM",
    "Timeline", "forecast", "size_long_prompt", "answer_tokens", "turn_budget", "HostSpeed", "TIME_TARGET_S", "CALIBRATION_SHARE", "BUDGET_SHARE",
    "LONG_PROMPT_ANSWER_TOKENS", "SHORT_PROMPT_ANSWER_TOKENS", "TURN_ANSWER_TOKENS", "LONG_PROMPT_DOCS", "SHORT_PROMPT", "decode_s",
    "predicted_total_s"]


# -- sizing: how much of the demo fits this host ---------------------------------------------------------

#: What the whole demo aims to take on any host: loading the model, calibrating (unless a profile
#: is stored) and every request. What it runs is sized to this from the host's measured speed.
TIME_TARGET_S = 150.0
#: The share of the time target a calibration may take when no usable profile is stored.
CALIBRATION_SHARE = 0.2
#: Without ``--budget``, the chat's budget is the predicted TTFT of this share of the untrimmed prompt.
BUDGET_SHARE = 0.45
#: Generated tokens: the long prompt's short answer, the short prompt's long answer (at most; fewer
#: where decode is slow), a chat turn's answer.
LONG_PROMPT_ANSWER_TOKENS = 24
SHORT_PROMPT_ANSWER_TOKENS = 96
TURN_ANSWER_TOKENS = 32
#: The long prompt of part 2 holds up to this many corpus documents (fewer where prefill is slow).
LONG_PROMPT_DOCS = 10


class Timeline:
    """The demo's clock: time spent, time left of the target, each request's share, a line per step.

    A request may take an equal share of the time left among the requests still to come, so time
    one request did not use goes to the next ones and time one overran is taken from them."""

    def __init__(self, target_s: float, clock: Callable[[], float] = time.perf_counter, out: Any = None) -> None:
        self.target_s = target_s
        self.clock = clock
        self.out = out
        self.t0 = clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return max(self.target_s - self.elapsed(), 0.0)

    def share(self, requests_left: int) -> float:
        """The most the next request may take (predicted TTFT + decode)."""
        return self.left() / max(requests_left, 1)

    def step(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", file=self.out or sys.stdout, flush=True)


class HostSpeed:
    """What the demo plans with: the wrapper's (live) profile for TTFT, and the decode speed the
    last request measured — the profile's until one has (a calibration short of time may only
    have estimated it)."""

    def __init__(self, trimmer: Any) -> None:
        self.trimmer = trimmer
        self.measured_tps: float | None = None

    def predict_ttft_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.trimmer.profile.predict_ttft_s(new_tokens, cached_tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.measured_tps or self.trimmer.profile.decode_tokens_per_s

    def learn(self, report: Any) -> None:
        tps = getattr(report, "decode_tokens_per_s", None)
        if tps is not None and tps > 0:
            self.measured_tps = tps


def decode_s(speed: Any, max_tokens: int) -> float:
    tps = speed.decode_tokens_per_s
    return max_tokens / tps if tps > 0 else 0.0


def predicted_total_s(speed: Any, prepared: Any, max_tokens: int) -> float:
    """Predicted TTFT plus the decode of ``max_tokens``."""
    return (prepared.predicted_ttft_s or 0.0) + decode_s(speed, max_tokens)


def answer_tokens(speed: Any, wanted: int, room_s: float) -> int:
    """Tokens an answer may generate: ``wanted``, fewer when their decode would not fit in
    ``room_s`` at the decode speed (at least one: the wait before it is the point)."""
    tps = speed.decode_tokens_per_s
    if tps <= 0:
        return wanted
    return int(min(wanted, max(room_s * tps, 1)))


def _long_prompt(corpus: Sequence[dict[str, Any]], docs: int) -> list[dict[str, Any]]:
    text = "\n\n".join(d["text"] for d in corpus[:docs])
    return [{"role": "user", "content": text + "\n\nIn one sentence: what is this text about?"}]


SHORT_PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


def size_long_prompt(trimmer: Any, speed: Any, corpus: Sequence[dict[str, Any]], bound_s: float, max_tokens: int) -> tuple[Any, int]:
    """The longest prompt of up to :data:`LONG_PROMPT_DOCS` corpus documents whose predicted TTFT
    plus ``max_tokens`` of decode fits ``bound_s`` (one document if none fits): ``(prepared, documents)``."""
    lo, hi = 1, min(LONG_PROMPT_DOCS, len(corpus))
    best = None
    while lo <= hi:  # the prediction grows with the documents: bisect
        mid = (lo + hi) // 2
        prepared = trimmer.prepare(_long_prompt(corpus, mid))
        if predicted_total_s(speed, prepared, max_tokens) <= bound_s:
            best, lo = (prepared, mid), mid + 1
        else:
            hi = mid - 1
    return best or (trimmer.prepare(_long_prompt(corpus, 1)), 1)


def turn_budget(speed: Any, untrimmed: int, minimal_ttft_s: float, bound_s: float, share: float, max_tokens: int) -> tuple[float, str]:
    """The chat's TTFT budget without ``--budget``: the predicted TTFT of ``share`` of the untrimmed
    prompt, capped so a turn (TTFT + ``max_tokens`` of decode) fits ``bound_s``, but never under the
    predicted TTFT of the smallest prompt (system and question alone). ``(budget, how it was derived)``."""
    share_tokens = max(int(untrimmed * share), 1)
    budget = speed.predict_ttft_s(share_tokens, 0)
    derived = (
        f"  budget {budget:.2f} s: the profile's predicted TTFT for {share:.0%} of the untrimmed "
        f"prompt ({share_tokens:,} of {untrimmed:,} tokens, nothing cached) on this host"
    )
    cap = bound_s - decode_s(speed, max_tokens)
    if budget > cap:
        budget = max(cap, minimal_ttft_s)
        derived += (f",\n  capped at {budget:.2f} s so a turn (TTFT + {max_tokens} tokens of decode) fits its "
                    f"{bound_s:.1f} s share of the time left")
    return budget, derived


# -- the demo: its data, its steps, its checks -----------------------------------------------------------

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


#: The documents whose questions the demo asks, in order: the first for the untrimmed request,
#: the others turn after turn under the budget. Chosen as questions the default model
#: (SmolLM2-135M-Instruct, greedy) answers right when it reads the answer's chunk — the demo shows
#: what trimming does, not how often a 135M model reads right: that is benchmarks/rag_answers.py's
#: figure, on a generated set nobody chose (docs/benchmarks.md).
DEMO_DOCS = ("doc-04", "doc-03", "doc-05", "doc-06", "doc-07")


def demo_questions(turns: int) -> list[dict[str, str]]:
    """The demo's questions (:data:`DEMO_DOCS`, then the corpus's others in order) for ``turns``
    budgeted turns after the untrimmed request."""
    every = load_questions()
    chosen = [q for d in DEMO_DOCS for q in every if q["doc_id"] == d]
    return (chosen + [q for q in every if q["doc_id"] not in DEMO_DOCS])[: turns + 1]


# The model sees this (the default model's ChatML template gives it a system turn; Gemma 3's template
# puts it at the head of the first user turn). Phrased as a task, not as "You are …": the 270M base
# model tends to repeat a "You are …" preamble as its answer.
SYSTEM = (
    "Answer the visitor's question about Marrowby in one short sentence, using only the retrieved "
    "context and the conversation. If the context does not hold the answer, say so."
)


def _rule(title: str) -> None:
    print()
    print(f"== {title} " + "=" * max(4, 76 - len(title)), flush=True)


def _normalised(text: str) -> str:
    """Lower case, dashes and quotes made plain, punctuation off, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = text.translate(_PLAIN)
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(text.split())


_PLAIN = str.maketrans({"\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\u2019": "'", "\u2018": "'",
                        "\u201c": '"', "\u201d": '"'})


def answer_is_right(answer: str | None, expected: str) -> bool:
    """True when ``answer`` contains ``expected`` as whole words, both normalised (case, dashes,
    quotes, punctuation and spacing do not count): ``"It was lit in 1863."`` answers ``"1863"``,
    ``"18630"`` does not. An empty or missing answer is wrong."""
    want = _normalised(expected)
    if not answer or not want:
        return False
    return f" {want} " in f" {_normalised(answer)} "


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


def _send(trimmer: Any, prepared: Any, params: dict[str, Any]) -> tuple[str, Any]:
    """Send a planned request, printing the answer as it streams: ``(answer, report)``."""
    stream = trimmer.execute(prepared, params)
    parts: list[str] = []
    print("   answer: ", end="", flush=True)
    for chunk in stream:
        for choice in chunk.get("choices", []):
            text = (choice.get("delta") or {}).get("content")
            if text:
                if not parts:
                    text = text.lstrip()
                parts.append(text)
                print(text.replace("\n", "\n           "), end="", flush=True)
    print(flush=True)
    return "".join(parts), stream.report


def _run(trimmer: Any, speed: HostSpeed, prepared: Any, params: dict[str, Any], tl: Timeline, bound_s: float) -> tuple[str | None, Any, float]:
    """Send ``prepared`` unless it is predicted to take over ``bound_s``; a line says which, with
    the prediction. ``(answer or None, report or None, predicted seconds)``."""
    max_tokens = params["max_tokens"]
    predicted = predicted_total_s(speed, prepared, max_tokens)
    what = (
        f"{len(prepared.prompt_tokens):,} prompt tokens" + (f" ({prepared.cached_tokens:,} cached)" if prepared.cached_tokens else "")
        + f": predicted TTFT {prepared.predicted_ttft_s or 0.0:.1f} s + up to {max_tokens} tokens of decode = {predicted:.1f} s"
    )
    if predicted > bound_s:
        tl.step(f"not run — {what}, over the {bound_s:.1f} s this request may take (its share of the {tl.left():.0f} s left)")
        return None, None, predicted
    tl.step(f"running — {what}")
    answer, report = _send(trimmer, prepared, params)
    speed.learn(report)
    return answer, report, predicted


def _calibrated(target: Any, quick: bool, tl: Timeline, clock: Callable[[], float]) -> tuple[Any, str]:
    """The stored profile (quick or full) if there is one, else a calibration bounded to
    :data:`CALIBRATION_SHARE` of the time target (and to the mode's own bound)."""
    stored = load_profile(as_backend(target).profile_key())
    if stored is not None and not stored.provisional:
        return stored, f"reused the profile stored on {time.strftime('%Y-%m-%d %H:%M', time.localtime(stored.created_at))}"
    mode = "quick" if quick else "full"
    budget = min(QUICK_BUDGET_S if quick else FULL_BUDGET_S, CALIBRATION_SHARE * tl.target_s)
    tl.step(f"calibrating ({mode}, at most {budget:.0f} s: a first short probe measures this host's speed, the "
            "other probes are sized to the time left; stored for next time)")
    bar = ProgressBar("calibrating", enabled=True)

    def progress(done: int, total: int, label: str) -> None:
        if bar.bar is not None and bar.bar.total != total:  # the schedule is resized as it learns the speed
            bar.bar.total = total
        bar(done, total, label)

    t0 = clock()
    try:
        profile = calibrate(target, mode=mode, time_budget_s=budget, progress=progress, clock=clock)
    finally:
        bar.close()
    return profile, f"measured now in {clock() - t0:.1f} s"


def forecast(
    plain: Any, speed: Any, corpus: Sequence[dict[str, Any]], rag: Any, minimal_ttft_s: float, left_s: float, turns: int,
    budget_s: float | None, budget_share: float,
) -> tuple[float, int]:
    """What the demo's requests are predicted to take in all on this host, sized and shared out
    as :func:`run_demo` will: ``(seconds, requests predicted to run)``."""
    n, total, ran = 3 + turns, 0.0, 0

    def take(predicted: float, bound: float) -> None:
        nonlocal n, total, ran, left_s
        n -= 1
        if predicted <= bound:
            total, ran, left_s = total + predicted, ran + 1, left_s - predicted

    bound = left_s / n
    max_tokens = answer_tokens(speed, LONG_PROMPT_ANSWER_TOKENS, bound / 2)
    long_prep, _ = size_long_prompt(plain, speed, corpus, bound, max_tokens)
    take(predicted_total_s(speed, long_prep, max_tokens), bound)
    bound = left_s / n
    short_prep = plain.prepare(SHORT_PROMPT)
    max_tokens = answer_tokens(speed, SHORT_PROMPT_ANSWER_TOKENS, bound - (short_prep.predicted_ttft_s or 0.0))
    take(predicted_total_s(speed, short_prep, max_tokens), bound)
    bound = left_s / n
    take(predicted_total_s(speed, rag, answer_tokens(speed, TURN_ANSWER_TOKENS, bound / 2)), bound)
    bound = left_s / n
    max_tokens = answer_tokens(speed, TURN_ANSWER_TOKENS, bound / 2)
    if budget_s is None:
        budget_s, _ = turn_budget(speed, len(rag.prompt_tokens), minimal_ttft_s, bound, budget_share, max_tokens)
    for _ in range(turns):
        bound = left_s / n
        take(min(budget_s, rag.predicted_ttft_s or 0.0) + decode_s(speed, max_tokens), bound)
    return total, ran


def run_demo(
    *,
    model: str | None = None,
    budget_s: float | None = None,
    budget_share: float = BUDGET_SHARE,
    turns: int = 3,
    n_ctx: int = 8192,
    quick: bool = False,
    json_path: str | None = None,
    time_target_s: float = TIME_TARGET_S,
    llm: Any = None,
    clock: Callable[[], float] = time.perf_counter,
    report_log: Any = None,
) -> int:
    """Run the demo in about ``time_target_s`` at most, on any host: a stored profile or a
    calibration bounded in time, then requests sized from the profile's predictions to the time
    left (one predicted not to fit is not run: its prediction is printed). ``budget_s`` None: the
    chat's budget is the predicted TTFT of ``budget_share`` of the untrimmed prompt on this host
    (so it trims on any machine), capped so each turn fits.

    ``llm``: an opened ``llama_cpp.Llama`` or a trimkit backend to use instead of opening
    ``model`` (tests pass a :class:`~trimkit.testing.FakeBackend` and its ``clock``); ``report_log``:
    every request's report as a JSON line there too (``trimkit report FILE`` draws it)."""
    tl = Timeline(time_target_s, clock)
    try:  # a line per step, also when stdout is a pipe (make demo | tee)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    requests = 3 + turns
    print(
        f"trimkit demo: sized to finish within about {time_target_s:.0f} s on this host — load the model, calibrate\n"
        f"(at most {CALIBRATION_SHARE * time_target_s:.0f} s; none if a profile is stored), then up to {requests} requests, "
        "each sized from the profile\nto its share of the time left. A request predicted not to fit is not run; its "
        "prediction is printed.",
        flush=True,
    )
    reports: list[dict[str, Any]] = []
    if llm is None:
        tl.step(f"loading the model ({model or 'the embedded SmolLM2-135M-Instruct'}, n_ctx {n_ctx:,})")
        llm = open_llama(model, n_ctx)
    _rule("1. Calibration: what prefill costs on this machine")
    profile, how = _calibrated(llm, quick, tl, clock)
    print("\n".join(profile_lines(profile)))
    print(f"  ({how})")

    corpus = load_corpus()
    plain = wrap(llm, profile=profile, report_log=report_log)  # no budget: measure and report only
    speed = HostSpeed(plain)
    history = load_history()
    questions = demo_questions(turns)
    chunk_texts = [Chunk(text=d["text"], id=d["id"]) for d in corpus]

    def retrieved(question: str) -> list[Any]:
        # a retriever would hand over its top 12; we use the library's own BM25 for that here
        return list(rank_chunks(chunk_texts, question)[:12])

    q0 = questions[0]["question"]
    rag_msgs = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": q0}]
    rag = plain.prepare(rag_msgs, retrieved(q0))
    minimal_ttft_s = plain.prepare([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q0}]).predicted_ttft_s or 0.0
    est, fit = forecast(plain, speed, corpus, rag, minimal_ttft_s, tl.left(), turns, budget_s, budget_share)
    tl.step(
        f"estimate: {fit} of {requests} requests fit, predicted {est:.0f} s in all → about {tl.elapsed() + est:.0f} s for the "
        f"demo (target {time_target_s:.0f} s; on this host TTFT {profile.predict_ttft_s(1000, 0):.2f} s for 1,000 prompt "
        f"tokens, decode {profile.decode_tokens_per_s:.1f} tokens/s)"
    )

    _rule("2. The two phases: a long prompt and a short one, no budget")
    bound = tl.share(requests)
    max_tokens = answer_tokens(speed, LONG_PROMPT_ANSWER_TOKENS, bound / 2)
    prepared, docs = size_long_prompt(plain, speed, corpus, bound, max_tokens)
    print(f"\n-- long prompt ({docs} document{'s' if docs > 1 else ''}), short answer")
    _answer, rep, predicted = _run(plain, speed, prepared, {"max_tokens": max_tokens, "temperature": 0.7}, tl, bound)
    requests -= 1
    _record(reports, "two phases", "long prompt, short answer", rep, predicted, bound)

    bound = tl.share(requests)
    prepared = plain.prepare(SHORT_PROMPT)
    max_tokens = answer_tokens(speed, SHORT_PROMPT_ANSWER_TOKENS, bound - (prepared.predicted_ttft_s or 0.0))
    print(f"\n-- short prompt, long answer (up to {max_tokens} tokens)")
    _answer, rep, predicted = _run(plain, speed, prepared, {"max_tokens": max_tokens, "temperature": 0.7}, tl, bound)
    requests -= 1
    _record(reports, "two phases", "short prompt, long answer", rep, predicted, bound)
    print(
        "\n  The long prompt waits before its first token (prefill grows with the prompt); the short one\n"
        "  starts at once. Its stream is faster too (each generated token reads the KV cache of the\n"
        "  prompt: compare the two decode lines), but the wait is what grows most. trimkit aims at the wait."
    )

    _rule(f"3. A RAG chat: {len(history)} earlier messages + 12 retrieved chunks")
    print("\n-- untrimmed")
    bound = tl.share(requests)
    rag = plain.prepare(rag_msgs, retrieved(q0))  # again: what is cached now is not what was cached then
    params = {"max_tokens": answer_tokens(speed, TURN_ANSWER_TOKENS, bound / 2), "temperature": 0.2}
    _answer, rep, predicted = _run(plain, speed, rag, params, tl, bound)
    requests -= 1
    _record(reports, "rag chat", "untrimmed", rep, predicted, bound)

    # the budget: given, or what this host needs to prefill a share of the untrimmed prompt
    q1 = questions[1]["question"] if len(questions) > 1 else q0
    first = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": q1}]
    untrimmed = len(plain.prepare(first, retrieved(q1)).prompt_tokens)
    bound = tl.share(requests)
    params = {"max_tokens": answer_tokens(speed, TURN_ANSWER_TOKENS, bound / 2), "temperature": 0.2}
    if budget_s is None:
        budget_s, derived = turn_budget(speed, untrimmed, minimal_ttft_s, bound, budget_share, params["max_tokens"])
    else:
        derived = f"  budget {budget_s:g} s (--budget); the untrimmed prompt is {untrimmed:,} tokens, " \
                  f"predicted {plain.profile.predict_ttft_s(untrimmed, 0):.2f} s with nothing cached"

    _rule(f"4. The same chat under a TTFT budget of {budget_s:.2f} s, turn after turn")
    print(derived)
    chat = wrap(llm, ttft_budget_s=budget_s, profile=plain.profile, report_log=report_log)
    convo = [{"role": "system", "content": SYSTEM}, *history]
    kept_answer = right = 0
    turn_params = {**params, "temperature": 0.0}  # greedy: the same prompt gets the same answer
    for turn, q in enumerate(questions[1 : turns + 1], start=1):
        convo.append({"role": "user", "content": q["question"]})
        chunks = retrieved(q["question"])
        prepared = chat.prepare(convo, chunks, turn_params)
        status = answer_chunk_status(prepared.plan, chunks, q["doc_id"])
        kept_answer += status.startswith("kept")
        plan = prepared.plan
        kept_n = len(plan.kept_chunks) if plan is not None else len(chunks)
        print(f"\n-- turn {turn}: {q['question']}")
        print(f"   answer chunk {q['doc_id']}: {status} ({kept_n} of {len(chunks)} chunks kept)")
        bound = tl.share(requests)
        answer, rep, predicted = _run(chat, speed, prepared, turn_params, tl, bound)
        requests -= 1
        is_right = answer_is_right(answer, q["answer"])
        _record(reports, "budget", f"turn {turn}", rep, predicted, bound,
                answer_chunk={"id": q["doc_id"], "status": status}, answer=answer, expected=q["answer"], right=is_right)
        if rep is None:
            convo.pop()
            continue
        right += is_right
        print(f"   expected {q['answer']!r}: {'right' if is_right else 'WRONG'}")
        convo.append({"role": "assistant", "content": answer or ""})
        chat.idle()
    met = [r["report"]["budget_met"] for r in reports if r["part"] == "budget" and r["report"] is not None]
    print(
        f"\n  budget met on {sum(bool(m) for m in met)} of {len(met)} turns run; answered right on {right} of {len(met)}; the "
        f"answer's chunk was kept on {kept_answer} of {turns} turns; decode parameters were never touched (a faster stream is the shorter "
        "context's side effect, stated as such in the reports)."
    )
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(reports, fh, indent=1)
        print(f"  reports written to {json_path}")
    tl.step(f"done in {tl.elapsed():.0f} s (target {time_target_s:.0f} s; the requests were predicted at {est:.0f} s)")
    return 0


def _record(reports: list[dict[str, Any]], part: str, label: str, rep: Any, predicted: float, bound: float, **extra: Any) -> None:
    """Print a run request's report and keep it for ``--json``; a request not run is kept with
    its prediction and the share of time it would have exceeded."""
    if rep is not None:
        print(rep)
    entry: dict[str, Any] = {"part": part, "label": label, "report": rep.to_dict() if rep is not None else None}
    if rep is None:
        entry["not_run"] = {"predicted_s": predicted, "bound_s": bound}
    entry.update(extra)
    reports.append(entry)
