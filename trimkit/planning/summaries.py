"""Summaries the planner may put in place of the oldest turns, and the cache that holds them.

A :class:`Summary` is a computed text standing in for the first history messages of a
conversation; the planner appends it to the system message under :data:`SUMMARY_HEADING`
(Gemma-style templates forbid extra system messages). A :class:`SummaryCache` keeps summaries by
the exact messages they cover, so the planner only *reads* summaries computed earlier, off the
critical path. Computing them (the summarizers and the background jobs) is
:mod:`trimkit.strategies.summarize`; this module is what the planner needs to use them.

A cached summary stays byte-identical until the next re-summarization, so the prompt prefix
that carries it stays in the engine's KV cache from one turn to the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidInputError
from trimkit.validation import count

__all__ = ["Summary", "SummaryCache", "SUMMARY_HEADING", "summary_note", "messages_key"]

#: How a summary is introduced where the planner places it (end of the first system message).
SUMMARY_HEADING = "Summary of the earlier conversation:"


@attrs.frozen
class Summary:
    """A computed summary of the first ``covered_messages`` history messages.

    ``source_tokens`` is what the covered messages cost, ``summary_tokens`` what the summary
    costs instead, ``seconds`` how long it took to compute (it counts against the TTFT budget
    only when computed inline), ``summarizer`` the name of what made it.
    """

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
        # a field nested too deep (or otherwise not canonical JSON): a key nothing else has, so
        # no summary is ever found for it (rather than a wrong one, or a RecursionError)
        return os.urandom(32)
    return hashlib.sha256(blob).digest()


def messages_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """A stable hash of the exact messages (every field, canonical JSON): the summary cache key."""
    h = hashlib.sha256()
    for m in messages:
        h.update(_message_digest(m))
    return h.hexdigest()


class SummaryCache:
    """Summaries keyed by the exact messages they cover. Thread-safe; keeps the newest ``max_entries``.

    Share one per conversation (or one per wrapper: keys are content hashes, so conversations
    cannot collide). The wrapper fills it off the critical path
    (:func:`~trimkit.strategies.summarize.summary_job`); the planner only reads it.
    """

    def __init__(self, max_entries: int = 64) -> None:
        count(max_entries, "max_entries", minimum=1)
        self._entries: OrderedDict[str, Summary] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, covered_messages: Sequence[Mapping[str, Any]]) -> Summary | None:
        """The summary of exactly these messages, or None."""
        return self._get(messages_key(covered_messages))

    def put(self, covered_messages: Sequence[Mapping[str, Any]], summary: Summary) -> None:
        """Store ``summary`` as the summary of exactly ``covered_messages``."""
        if not isinstance(summary, Summary):
            raise InvalidInputError(f"summary must be a Summary, got {type(summary).__name__}")
        key = messages_key(covered_messages)
        with self._lock:
            self._entries[key] = summary
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def best_prefix(self, turns: Sequence[Sequence[Mapping[str, Any]]]) -> tuple[int, Summary] | None:
        """``(n, summary)`` for the cached summary covering the longest prefix ``turns[:n]``
        (``n >= 1``), or None. ``turns`` are lists of messages, oldest first."""
        found = self.prefixes(turns)
        return found[-1] if found else None

    def prefixes(self, turns: Sequence[Sequence[Mapping[str, Any]]]) -> list[tuple[int, Summary]]:
        """Every cached summary covering a prefix ``turns[:n]``, as ``(n, summary)``, shortest first."""
        with self._lock:
            if not self._entries:
                return []
        h = hashlib.sha256()
        found: list[tuple[int, Summary]] = []
        for n, turn in enumerate(turns, start=1):
            for m in turn:
                h.update(_message_digest(m))
            hit = self._get(h.copy().hexdigest())
            if hit is not None:
                found.append((n, hit))
        return found

    def _get(self, key: str) -> Summary | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit
