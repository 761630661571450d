"""Summaries of older conversation turns, and the cache that keeps them off the critical path."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from trimkit.errors import InvalidInputError, count
from trimkit.messages import message_text, turn_spans
from trimkit.planning.tokens import SizedCache
from trimkit.planning.values import split_sentences, words

log = logging.getLogger("trimkit")
__all__ = ["Summary", "SummaryCache", "SUMMARY_HEADING", "summary_note", "messages_key", "Summarizer", "ExtractiveSummarizer", "PromptSummarizer",
           "DEFAULT_SUMMARY_PROMPT", "make_summary", "approx_tokens", "cap_to_tokens", "summary_job", "next_summary_job"]
#: How a summary is introduced where the planner places it (end of the first system message).
SUMMARY_HEADING = "Summary of the earlier conversation:"


@attrs.frozen
class Summary:
    """A computed summary of the first ``covered_messages`` history messages."""

    text: str
    covered_messages: int
    source_tokens: int
    summary_tokens: int
    seconds: float
    summarizer: str

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def summary_note(summary: Summary) -> str:
    """The summary as the prompt carries it: :data:`SUMMARY_HEADING`, a line break, the text."""
    return f"{SUMMARY_HEADING}\n{summary.text}"


def _message_digest(message: Mapping[str, Any]) -> bytes:
    try:
        blob = json.dumps(message, sort_keys=True, ensure_ascii=False, default=repr, separators=(",", ":")).encode()
    except (RecursionError, ValueError, TypeError, UnicodeEncodeError):
        # not canonical JSON (nested too deep): a key nothing else has, so no (wrong) summary is ever found for it
        return os.urandom(32)
    return hashlib.sha256(blob).digest()


def messages_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """A stable hash of the exact messages (every field, canonical JSON): the summary cache key."""
    h = hashlib.sha256()
    for m in messages:
        h.update(_message_digest(m))
    return h.hexdigest()


class SummaryCache:
    """Summaries keyed by the exact messages they cover. Thread-safe; keeps the newest ``max_entries``."""

    def __init__(self, max_entries: int = 64) -> None:
        count(max_entries, "max_entries", minimum=1)
        self._entries: SizedCache[str, Summary] = SizedCache(4 * max_entries + 4, max_entries=max_entries, size_of=lambda _key: 1)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, covered_messages: Sequence[Mapping[str, Any]]) -> Summary | None:
        return self._entries.get(messages_key(covered_messages))

    def put(self, covered_messages: Sequence[Mapping[str, Any]], summary: Summary) -> None:
        if not isinstance(summary, Summary):
            raise InvalidInputError(f"summary must be a Summary, got {type(summary).__name__}")
        self._entries.put(messages_key(covered_messages), summary)

    def best_prefix(self, turns: Sequence[Sequence[Mapping[str, Any]]]) -> tuple[int, Summary] | None:
        """``(n, summary)`` of the cached summary covering the longest prefix ``turns[:n]``, or None."""
        return next(reversed(self.prefixes(turns)), None)

    def prefixes(self, turns: Sequence[Sequence[Mapping[str, Any]]]) -> list[tuple[int, Summary]]:
        """Every cached summary covering a prefix ``turns[:n]``, as ``(n, summary)``, shortest first."""
        if not len(self._entries):
            return []
        h = hashlib.sha256()
        found: list[tuple[int, Summary]] = []
        for n, turn in enumerate(turns, start=1):
            for m in turn:
                h.update(_message_digest(m))
            hit = self._entries.get(h.copy().hexdigest())
            if hit is not None:
                found.append((n, hit))
        return found


#: The prompt :class:`PromptSummarizer` sends. Fields: ``{transcript}`` and ``{max_tokens}``.
DEFAULT_SUMMARY_PROMPT = (
    "Summarize the conversation below in at most {max_tokens} tokens. Keep facts, names, numbers, "
    "decisions and open questions. Write plain sentences, no preamble.\n\n{transcript}\n\nSummary:"
)
TokenCounter = Callable[[str], int]


def approx_tokens(text: str) -> int:
    """A tokenizer-free estimate (~4 characters a token). Pass a real counter when you have one."""
    return math.ceil(len(text) / 4) if text else 0


def _counter(count_tokens: Any) -> TokenCounter:
    """Accept a ``PromptTokenizer`` (uses its cached ``count``), a callable, or None."""
    if count_tokens is None:
        return approx_tokens
    if hasattr(count_tokens, "count") and callable(count_tokens.count):
        return count_tokens.count
    if callable(count_tokens):
        return count_tokens
    raise InvalidInputError(f"count_tokens must be a PromptTokenizer or a callable, got {type(count_tokens).__name__}")


@runtime_checkable
class Summarizer(Protocol):
    """Turns a list of chat messages into a summary text of about ``target_tokens`` tokens."""

    name: str

    def summarize(self, messages: Sequence[Mapping[str, Any]], *, target_tokens: int, count_tokens: TokenCounter) -> str: ...


_ROLE_LABEL = {"user": "User", "assistant": "Assistant", "tool": "Tool", "function": "Tool", "system": "Note", "developer": "Note"}


def _label(message: Mapping[str, Any]) -> str:
    return _ROLE_LABEL.get(str(message.get("role")), "Note")


def _longest(parts: Sequence[str], fits: Callable[[list[str]], bool]) -> list[str]:
    """The longest leading run of ``parts`` that ``fits`` (tried one more part at a time)."""
    return next((list(parts[:k]) for k in range(len(parts)) if not fits(list(parts[: k + 1]))), list(parts))


def cap_to_tokens(text: str, max_tokens: int, count_tokens: TokenCounter) -> str:
    """``text`` cut to at most ``max_tokens`` tokens at a sentence boundary (else a word one, with an ellipsis)."""
    if count_tokens(text) <= max_tokens:
        return text
    kept = _longest(split_sentences(text), lambda ps: count_tokens(" ".join(ps)) <= max_tokens)
    if kept:
        return " ".join(kept)
    out = _longest(text.split(), lambda ps: count_tokens(" ".join(ps) + " …") <= max_tokens)
    return (" ".join(out) + " …") if out else ""


@attrs.frozen
class ExtractiveSummarizer:
    """Model-free summarizer: keeps the most salient sentences of the covered turns."""

    lead_bonus: float = 2.0
    user_bonus: float = 1.5
    name: str = "extractive"

    def summarize(self, messages: Sequence[Mapping[str, Any]], *, target_tokens: int, count_tokens: TokenCounter = approx_tokens) -> str:
        split = [(_label(m), split_sentences(message_text(m))) for m in messages]
        freq = Counter(w for _, sentences in split for s in sentences for w in set(words(s)))
        candidates: list[tuple[float, int, int, str]] = []  # (score, message index, position, sentence)
        for mi, (label, sentences) in enumerate(split):
            for pos, s in enumerate(sentences):
                ws = set(words(s))
                score = sum(freq[w] for w in ws) / math.sqrt(1 + len(ws))
                score *= self.lead_bonus if pos == 0 else 1.0
                score *= self.user_bonus if label == "User" else 1.0
                candidates.append((score, mi, pos, s))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen: list[tuple[int, int, str]] = []
        used = 0
        for _, mi, pos, s in candidates:
            cost = count_tokens(s) + 1
            if used + cost + 3 > target_tokens:  # +3: the "- User:" label of a new line
                continue
            chosen.append((mi, pos, s))
            used += cost
        text = self._render(chosen, split)
        while chosen and count_tokens(text) > target_tokens:  # labels/joins cost more than estimated
            chosen.pop()  # the lowest-scoring sentence kept so far
            text = self._render(chosen, split)
        return text

    @staticmethod
    def _render(chosen: list[tuple[int, int, str]], split: list[tuple[str, list[str]]]) -> str:
        by_message = itertools.groupby(sorted(chosen), key=lambda c: c[0])  # in message order, each in sentence order
        return "\n".join(f"- {split[mi][0]}: {' '.join(s for _, _, s in group)}" for mi, group in by_message)


def _check_template(instance: Any, attribute: Any, value: Any) -> None:
    try:
        value.format(transcript="", max_tokens=1)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise InvalidInputError(f"summary prompt template must use only {{transcript}} and {{max_tokens}}: {exc!r}") from None


@attrs.frozen
class PromptSummarizer:
    """Summarizer that asks a model: ``complete(prompt) -> text``."""

    complete: Callable[[str], str]
    max_tokens: int = attrs.field(default=256, validator=lambda i, a, v: count(v, a.name, minimum=1))
    template: str = attrs.field(default=DEFAULT_SUMMARY_PROMPT, validator=_check_template)
    name: str = "prompt"

    def build_prompt(self, messages: Sequence[Mapping[str, Any]], target_tokens: int) -> str:
        transcript = "\n".join(f"{_label(m)}: {message_text(m)}" for m in messages if message_text(m))
        return self.template.format(transcript=transcript, max_tokens=min(target_tokens, self.max_tokens))

    def summarize(self, messages: Sequence[Mapping[str, Any]], *, target_tokens: int, count_tokens: TokenCounter = approx_tokens) -> str:
        text = self.complete(self.build_prompt(messages, target_tokens))
        if not isinstance(text, str):
            raise TypeError(f"complete() must return str, got {type(text).__name__}")
        return cap_to_tokens(text.strip(), min(target_tokens, self.max_tokens), count_tokens)


def make_summary(summarizer: Summarizer, messages: Sequence[Mapping[str, Any]], *, target_tokens: int, count_tokens: Any = None,
                 covered_messages: int | None = None, source_tokens: int | None = None, clock: Callable[[], float] = time.perf_counter) -> Summary:
    """Run ``summarizer`` on ``messages`` and wrap the text, its size and its timing in a :class:`Summary`."""
    counter = _counter(count_tokens)
    started = clock()
    text = summarizer.summarize(messages, target_tokens=target_tokens, count_tokens=counter)
    seconds = max(clock() - started, 0.0)
    return Summary(text=text, covered_messages=len(messages) if covered_messages is None else covered_messages,
                   source_tokens=sum(counter(message_text(m)) for m in messages) if source_tokens is None else source_tokens,
                   summary_tokens=counter(text), seconds=seconds, summarizer=getattr(summarizer, "name", type(summarizer).__name__))


#: what a summary reads of a message whose other fields cannot be copied (nested too deep)
_SUMMARY_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call")


def _snapshot(messages: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Deep copies of ``messages``; one nested too deep to copy keeps only what a summary reads."""
    out: list[Mapping[str, Any]] = []
    for m in messages:
        try:
            out.append(copy.deepcopy(m))
        except RecursionError:
            out.append({k: copy.deepcopy(m[k]) for k in _SUMMARY_FIELDS if k in m})
    return out


def summary_job(messages: Sequence[Mapping[str, Any]], summarizer: Summarizer, cache: SummaryCache, *, plan: Any = None, count_tokens: Any = None,
                target_tokens: int = 200, keep_recent_turns: int = 2, resummarize_after_turns: int = 2, min_pressure: float = 0.6,
                clock: Callable[[], float] = time.perf_counter) -> Callable[[], Summary | None] | None:
    """What to summarize next, off the critical path: a zero-argument job, or None if nothing is due (history too short,
    already covered, fewer than ``resummarize_after_turns`` new turns, or the plan below ``min_pressure`` of its budget)."""
    count(keep_recent_turns, "keep_recent_turns", minimum=0)
    count(resummarize_after_turns, "resummarize_after_turns", minimum=1)
    count(target_tokens, "target_tokens", minimum=1)
    if plan is not None and plan.predicted_ttft_before_s < min_pressure * plan.budget_s:
        return None
    turns = [[messages[i] for i in range(s, e)] for s, e in turn_spans(messages)]
    upto = len(turns) - keep_recent_turns
    if upto < 1:
        return None
    hit = cache.best_prefix(turns[:upto])
    done = hit[0] if hit else 0
    if done >= upto or (hit is not None and upto - done < resummarize_after_turns):
        return None
    covered = _snapshot([m for t in turns[:upto] for m in t])
    source: list[Mapping[str, Any]] = _snapshot([m for t in turns[done:upto] for m in t])
    if hit is not None:
        source.insert(0, {"role": "system", "content": summary_note(hit[1])})
    counter = _counter(count_tokens)

    def job() -> Summary | None:
        try:
            summary = make_summary(summarizer, source, target_tokens=target_tokens, count_tokens=counter, covered_messages=len(covered),
                                   source_tokens=sum(counter(message_text(m)) for m in covered), clock=clock)
        except Exception as exc:  # a background job must not take the caller down
            log.warning("summary job failed (%s: %s); the planner will carry on without it", type(exc).__name__, exc)
            return None
        if not summary.text.strip():
            return None
        cache.put(covered, summary)
        log.debug("summarized %d messages (%d → %d tokens) in %.3f s", len(covered), summary.source_tokens, summary.summary_tokens, summary.seconds)
        return summary

    return job


def next_summary_job(plan: Any, summarizer: Summarizer, cache: SummaryCache, **options: Any) -> Callable[[], Summary | None] | None:
    """:func:`summary_job` for the request a :class:`~trimkit.planning.planner.Plan` was made for."""
    if plan is None or not getattr(plan, "request_messages", None):
        return None
    return summary_job(plan.request_messages, summarizer, cache, plan=plan, **options)
