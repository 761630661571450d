"""One request as the planner sees it: its fixed inputs, candidate prompts, and their predicted cost.

A candidate prompt is a :class:`Candidate`: edits of the caller's request (which messages are
dropped or summarized, which chunks are kept). :class:`RequestContext` holds everything fixed
for the request, computed once: the inputs, per-message token counts, the turns, and what is
known about the engine's KV cache (the caller's ``cached_tokens`` and any probes). Its
:meth:`~RequestContext.estimate` predicts a candidate's size and TTFT from those counts, so
trying candidates never re-tokenizes the conversation; :meth:`~RequestContext.build` makes the
concrete message list, counted exactly once at the end.

Prompt layout (stable → volatile, docs/design.md §3): system (+ summary of old turns appended to
it) → recent turns → the last user message, whose content becomes ``rag_template`` with the
kept chunks, most relevant first, before the question.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs

from trimkit.messages import SYSTEM_ROLES, Chunk, append_text, last_user_index, message_text, turn_spans, with_chunks
from trimkit.planning.costs import reusable_cached_tokens
from trimkit.planning.summaries import Summary, SummaryCache, summary_note
from trimkit.planning.values import rank_chunks

__all__ = ["Candidate", "Estimate", "RequestContext", "Layout", "CacheProbe", "MAX_PROBES"]

log = logging.getLogger("trimkit")

CacheProbe = Callable[[list[dict[str, Any]]], int]

#: Probes of the engine's cache a single plan may make (the wrapper tokenizes for each).
MAX_PROBES = 2

#: A prompt as (segment key, tokens) pairs in prompt order; equal keys mean equal text.
Layout = tuple[tuple[Hashable, int], ...]


@attrs.frozen
class Candidate:
    """A candidate prompt, as edits of the caller's request.

    ``kept_chunks`` are placed in this order; ``removed``/``summarized`` are indices into the
    caller's messages; ``summary`` replaces the summarized ones; ``extra_s`` is inline work
    (e.g. a summary computed now) that delays the first token and so counts against the budget.
    """

    kept_chunks: tuple[Chunk, ...] = ()
    removed: frozenset[int] = frozenset()
    summarized: frozenset[int] = frozenset()
    summary: Summary | None = None
    extra_s: float = 0.0

    gone: frozenset[int] = attrs.field(init=False, eq=False, repr=False)
    """Indices not sent verbatim (removed or summarized)."""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "gone", self.removed | self.summarized)

    @property
    def unchanged(self) -> bool:
        """No message is dropped or summarized and no chunk placed: the caller's request as given."""
        return not self.kept_chunks and not self.gone and self.summary is None


@attrs.frozen
class Estimate:
    """Predicted size and TTFT of a candidate. ``cached_tokens`` is the prefix predicted to be in
    the KV cache; ``ttft_s`` includes the candidate's inline work."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _summary_block(summary: Summary) -> str:
    """The summary as appended to the first system message."""
    return f"\n\n{summary_note(summary)}"


class RequestContext:
    """Everything fixed for one request, computed once: inputs, per-message token counts, turns,
    and what is known about the engine's KV cache (the caller's ``cached_tokens`` and probes).

    Built by :meth:`~trimkit.planning.state.PlanState.start` from validated inputs; strategies
    reach it through the state."""

    def __init__(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_budget_s: float,
        profile: Any,
        tokenizer: Any,
        chunks: tuple[Chunk, ...],
        tools: Any,
        cached_tokens: int,
        cache_probe: CacheProbe | None,
        summaries: SummaryCache | None,
        rag_template: str,
        rag_chunk_template: str,
        clock: Callable[[], float],
        safety_margin: float | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.messages = messages
        self.tools = tools
        self.budget_s = ttft_budget_s
        self.profile = profile
        self.safety_margin = float(profile.safety_margin if safety_margin is None else safety_margin)
        self.target_s = ttft_budget_s * (1.0 - self.safety_margin)
        #: the most prompt tokens the context window takes (n_ctx less max_tokens), if known
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = tokenizer
        self.summaries = summaries
        self.cache_probe = cache_probe
        self.rag_template = rag_template
        self.rag_chunk_template = rag_chunk_template
        self.clock = clock
        self.last_user = last_user_index(messages)
        self.leading_system = messages[0].get("role") in SYSTEM_ROLES
        segments = tokenizer.segment_counts(messages, tools)
        self.base = segments.counts
        self.tail = segments.tail
        spans = turn_spans(messages)
        protected_from = next(s for s, e in spans if s <= self.last_user < e)
        #: turns that may be summarized or dropped, oldest first (never the last user's turn)
        self.history_turns: tuple[tuple[int, int], ...] = tuple((s, e) for s, e in spans if e <= protected_from)
        #: every chunk of the request, most relevant first (:func:`~trimkit.planning.values.rank_chunks`)
        self.chunks = rank_chunks(chunks, message_text(messages[self.last_user])) if chunks else ()
        #: the chunks in the caller's (the retriever's) order, which relevance weighs
        self.given_chunks = chunks
        self._chunk_costs: dict[tuple[str | None, int, str], int] = {}
        self.chunk_overhead = self.chunk_separator = 0
        if chunks:
            self.chunk_overhead = tokenizer.count(rag_template.format(chunks="", question=""))
            self.chunk_separator = tokenizer.count("\n\n")
        self._system_overhead: int | None = None
        #: tokens added to every estimate after a plan's estimates proved optimistic
        self.correction = 0
        self.prefix_tokens = [0]  # prefix_tokens[i]: tokens before the caller's message i
        for n in self.base:
            self.prefix_tokens.append(self.prefix_tokens[-1] + n)
        self.caller_layout: Layout = tuple((i, n) for i, n in enumerate(self.base)) + (("tail", self.tail),)
        self.knowledge: list[tuple[Layout, int]] = [(self.caller_layout, cached_tokens)]
        self.probed: dict[tuple[Hashable, ...], int] = {}
        self.probes_used = 0

    # -- token costs of edited messages (additive estimates; the final prompt is counted exactly)
    def chunk_tokens(self, chunks: Sequence[Chunk]) -> int:
        """Tokens ``chunks`` add to the last user message (template text and separators included)."""
        if not chunks:
            return 0
        total = self.chunk_overhead + self.chunk_separator * (len(chunks) - 1)
        for n, c in enumerate(chunks, start=1):
            key = (c.id, n, c.text)  # text too: a chunk cut at a sentence boundary keeps its id
            cost = self._chunk_costs.get(key)
            if cost is None:
                cost = self.tokenizer.count(self.rag_chunk_template.format(id=c.id, text=c.text, n=n))
                self._chunk_costs[key] = cost
            total += cost
        return total

    def summary_tokens(self, summary: Summary) -> int:
        """Tokens the summary adds (a system message of its own when the request has none)."""
        tokens = self.tokenizer.count(_summary_block(summary))
        if not self.leading_system:
            if self._system_overhead is None:
                probe = [{"role": "system", "content": ""}]
                self._system_overhead = self.tokenizer.segment_counts(probe).counts[0]
            tokens += self._system_overhead
        return tokens

    def layout(self, c: Candidate) -> Layout:
        """The candidate as (segment key, tokens) pairs in prompt order; equal keys mean equal text."""
        segs: list[tuple[Hashable, int]] = []
        gone = c.gone
        summary_tokens = self.summary_tokens(c.summary) if c.summary is not None else 0
        if c.summary is not None and not self.leading_system:
            segs.append((("summary", c.summary.text), summary_tokens))
        for i, n in enumerate(self.base):
            if i in gone:
                continue
            if i == 0 and c.summary is not None and self.leading_system:
                segs.append((("summary", c.summary.text), n + summary_tokens))
            elif i == self.last_user and c.kept_chunks:
                segs.append((("chunks", tuple(ch.id for ch in c.kept_chunks)), n + self.chunk_tokens(c.kept_chunks)))
            else:
                segs.append((i, n))
        segs.append(("tail", self.tail))
        return tuple(segs)

    # -- predictions --------------------------------------------------------------------------
    def cached_for(self, layout: Layout, total: int) -> int:
        """Predicted cached prefix: exact if this very prompt was probed; else, over everything
        known, the cached tokens of the longest prefix shared with a prompt whose count is known."""
        keys = tuple(k for k, _ in layout)
        if keys in self.probed:
            cached = self.probed[keys]
        else:
            cached = 0
            for known_layout, known_cached in self.knowledge:
                shared = 0
                for (k1, n1), (k2, _) in zip(layout, known_layout, strict=False):
                    if k1 != k2:
                        break
                    shared += n1
                cached = max(cached, min(known_cached, shared))
        return reusable_cached_tokens(total, cached)

    def predict(self, tokens: int, cached: int, extra_s: float = 0.0) -> float:
        """Predicted TTFT of a ``tokens`` prompt with ``cached`` of them in the KV cache, plus
        ``extra_s`` of inline work."""
        cached = reusable_cached_tokens(tokens, cached)
        return float(self.profile.predict_ttft_s(tokens - cached, cached) + extra_s)

    def fits(self, tokens: int, predicted_s: float) -> bool:
        """A ``tokens`` prompt predicted at ``predicted_s`` is within the target (and, when
        known, the context window)."""
        return predicted_s <= self.target_s and (self.max_prompt_tokens is None or tokens <= self.max_prompt_tokens)

    def estimate(self, c: Candidate) -> Estimate:
        """Predicted size, cached prefix and TTFT of ``c`` (no tokenization of unchanged text)."""
        if len(self.knowledge) > 1:  # probes are known: compare whole layouts
            return self.estimate_by_layout(c)
        # only the caller's cached_tokens is known: the prompt is shared up to the first edit
        n = len(self.base)
        total = self.prefix_tokens[n] + self.tail + self.correction
        first_edit = n + 1
        if c.summary is not None:
            total += self.summary_tokens(c.summary)
            first_edit = 0
        if c.kept_chunks:
            total += self.chunk_tokens(c.kept_chunks)
            first_edit = min(first_edit, self.last_user)
        gone = c.gone
        if gone:
            total -= sum(self.base[i] for i in gone)
            first_edit = min(first_edit, min(gone))
        shared = self.prefix_tokens[first_edit] if first_edit <= n else self.prefix_tokens[n] + self.tail
        cached = reusable_cached_tokens(total, min(self.knowledge[0][1], shared))
        return Estimate(total, cached, self.predict(total, cached, c.extra_s))

    def estimate_by_layout(self, c: Candidate) -> Estimate:
        """:meth:`estimate` the general way, through the candidate's layout."""
        layout = self.layout(c)
        total = sum(n for _, n in layout) + self.correction
        cached = self.cached_for(layout, total)
        return Estimate(total, cached, self.predict(total, cached, c.extra_s))

    # -- concrete prompts ---------------------------------------------------------------------
    def build(self, c: Candidate) -> list[dict[str, Any]]:
        """The message list for a candidate. The caller's list itself when nothing changes."""
        if c.unchanged:
            return self.messages  # type: ignore[return-value]
        out: list[Any] = []
        if c.summary is not None and not self.leading_system:
            out.append({"role": "system", "content": summary_note(c.summary)})
        for i, m in enumerate(self.messages):
            if i in c.gone:
                continue
            if i == 0 and c.summary is not None and self.leading_system:
                m = append_text(m, _summary_block(c.summary))
            elif i == self.last_user and c.kept_chunks:
                m = with_chunks(m, c.kept_chunks, self.rag_template, self.rag_chunk_template)
            out.append(m)
        return out

    def exact_tokens(self, c: Candidate) -> int:
        """The candidate's prompt counted through the template (cached per message)."""
        if c.unchanged:
            return self.prefix_tokens[-1] + self.tail  # the caller's request, counted at the start
        return self.tokenizer.segment_counts(self.build(c), self.tools).total

    def probe(self, c: Candidate) -> int | None:
        """Ask the engine how many tokens of ``c`` it has cached: at most :data:`MAX_PROBES`
        times per request, memoised; None when there is no probe, the allowance is spent or
        the probe failed (it is an optimisation and never fails a request)."""
        if self.cache_probe is None:
            return None
        keys = tuple(k for k, _ in self.layout(c))
        if keys in self.probed:
            return self.probed[keys]
        if self.probes_used >= MAX_PROBES:
            return None
        self.probes_used += 1
        try:
            cached = self.cache_probe(self.build(c))
        except Exception as exc:  # the probe is an optimisation; never fail a request for it
            log.warning("cache_probe failed (%s: %s); estimating the cached prefix instead", type(exc).__name__, exc)
            return None
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            log.warning("cache_probe returned %r, not a token count >= 0; ignored", cached)
            return None
        self.probed[keys] = cached
        self.knowledge.append((self.layout(c), cached))
        return cached
