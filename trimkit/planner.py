"""The planner: decide what to prefill so the predicted TTFT fits the budget.

:func:`plan` is the one engine behind the wrapper and the CLI. It predicts the TTFT of the
prompt as it stands (counting only the tokens the engine must evaluate — a prefix already in
the KV cache is nearly free); if that fits the budget less the profile's safety margin, the
request passes through untouched. Otherwise the strategies (:mod:`trimkit.strategies`) say what
may change and the engine (:mod:`trimkit.engine`) keeps the most value whose predicted TTFT
fits, saying in :class:`Action` values what it removed, summarized or excerpted and why. If
even the minimal prompt (system messages and the last user turn) cannot fit, the plan is
infeasible.

Strategies see one :class:`PlanState`. A candidate prompt is described by a :class:`Candidate`
(which messages are dropped or summarized, which chunks are kept); :meth:`PlanState.estimate`
predicts its TTFT from per-message token counts computed once per request, so trying
candidates never re-tokenizes the conversation. The chosen candidate is counted exactly once
at the end.

Prompt layout (stable → volatile, docs/budgets.md): system (+ summary of old turns appended to it,
since Gemma-style templates forbid extra system messages) → recent turns → the last user
message, whose content becomes ``rag_template`` with the kept chunks, most relevant first,
before the question.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs

from trimkit import _validate
from trimkit.errors import InfeasibleBudgetError, InvalidInputError
from trimkit.messages import (
    DEFAULT_RAG_CHUNK_TEMPLATE,
    DEFAULT_RAG_TEMPLATE,
    SYSTEM_ROLES,
    Chunk,
    check_rag_templates,
    coerce_chunks,
    last_user_index,
    message_text,
    turn_spans,
    validate_messages,
    with_chunks,
)
from trimkit.relevance import rank_chunks
from trimkit.summarize import SUMMARY_HEADING, Summary, SummaryCache

__all__ = ["plan", "Plan", "Action", "PlanState", "Candidate", "Estimate", "CacheProbe"]

log = logging.getLogger("trimkit")

CacheProbe = Callable[[list[dict[str, Any]]], int]

#: Probes of the engine's cache a single plan may make (the wrapper tokenizes for each).
MAX_PROBES = 2


# --------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------
@attrs.frozen
class Action:
    """One thing a strategy did, for the report. Indices refer to the caller's message list;
    chunks are named by id. Token counts are the prompt's (estimated) size before and after."""

    strategy: str
    summary: str
    removed_messages: tuple[int, ...] = ()
    summarized_messages: tuple[int, ...] = ()
    removed_chunks: tuple[str, ...] = ()
    tokens_before: int = 0
    tokens_after: int = 0
    detail: Mapping[str, Any] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "summary": self.summary,
            "removed_messages": list(self.removed_messages),
            "summarized_messages": list(self.summarized_messages),
            "removed_chunks": list(self.removed_chunks),
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
            "detail": dict(self.detail),
        }

    def __str__(self) -> str:
        return f"{self.strategy}: {self.summary}"


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


Layout = tuple[tuple[Hashable, int], ...]


class _Context:
    """Everything fixed for one request, computed once: inputs, per-message token counts, turns,
    and what is known about the engine's KV cache (the caller's ``cached_tokens`` and probes)."""

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
        #: every chunk of the request, most relevant first (:func:`~trimkit.relevance.rank_chunks`)
        self.chunks = rank_chunks(chunks, message_text(messages[self.last_user])) if chunks else ()
        #: the chunks in the caller's (the retriever's) order, which relevance weighs
        self.given_chunks = chunks
        self._chunk_costs: dict[tuple[str | None, int, str], int] = {}
        self.chunk_overhead = self.chunk_separator = 0
        if chunks:
            self.chunk_overhead = tokenizer.count(rag_template.format(chunks="", question=""))
            self.chunk_separator = tokenizer.count("\n\n")
        self._system_overhead: int | None = None
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
        return max(0, min(cached, total - 1))  # llama.cpp always evaluates at least one token

    def estimate(self, c: Candidate) -> Estimate:
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
        cached = max(0, min(self.knowledge[0][1], shared, total - 1))
        return Estimate(total, cached, self.profile.predict_ttft_s(total - cached, cached) + c.extra_s)

    def estimate_by_layout(self, c: Candidate) -> Estimate:
        """:meth:`estimate` the general way, through the candidate's layout."""
        layout = self.layout(c)
        total = sum(n for _, n in layout) + self.correction
        cached = self.cached_for(layout, total)
        return Estimate(total, cached, self.profile.predict_ttft_s(total - cached, cached) + c.extra_s)

    # -- concrete prompts --------------------------------------------------------------------
    def build(self, c: Candidate) -> list[dict[str, Any]]:
        """The message list for a candidate. The caller's list itself when nothing changes."""
        if not c.kept_chunks and not c.gone and c.summary is None:
            return self.messages  # type: ignore[return-value]
        out: list[Any] = []
        if c.summary is not None and not self.leading_system:
            out.append({"role": "system", "content": _summary_block(c.summary).lstrip()})
        for i, m in enumerate(self.messages):
            if i in c.gone:
                continue
            if i == 0 and c.summary is not None and self.leading_system:
                m = _with_summary(m, c.summary)
            elif i == self.last_user and c.kept_chunks:
                m = with_chunks(m, c.kept_chunks, self.rag_template, self.rag_chunk_template)
            out.append(m)
        return out

    def exact_tokens(self, c: Candidate) -> int:
        """The candidate's prompt counted through the template (cached per message)."""
        if not c.kept_chunks and not c.gone and c.summary is None:
            return self.prefix_tokens[-1] + self.tail  # the caller's request, counted at the start
        return self.tokenizer.segment_counts(self.build(c), self.tools).total  # type: ignore[no-any-return]

    def probe(self, c: Candidate) -> int | None:
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


def _summary_block(summary: Summary) -> str:
    return f"\n\n{SUMMARY_HEADING}\n{summary.text}"


def _with_summary(message: Mapping[str, Any], summary: Summary) -> dict[str, Any]:
    new = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        new["content"] = [*content, {"type": "text", "text": _summary_block(summary)}]
    else:
        new["content"] = (content or "") + _summary_block(summary)
    return new


# --------------------------------------------------------------------------------------------
# the state strategies receive
# --------------------------------------------------------------------------------------------
@attrs.frozen
class PlanState:
    """What every strategy receives: the request, the current candidate and its prediction.

    A strategy reads ``state.candidate`` and ``state.prediction`` (or calls :meth:`estimate` on
    candidates of its own), and returns ``state.apply(new_candidate, action)`` — or None to
    leave things as they are. Build one for a test with :meth:`start`.
    """

    ctx: _Context = attrs.field(repr=False)
    candidate: Candidate
    actions: tuple[Action, ...] = ()
    prediction: Estimate = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "prediction", self.ctx.estimate(self.candidate))

    @classmethod
    def start(
        cls,
        messages: Sequence[Mapping[str, Any]],
        *,
        ttft_budget_s: float,
        profile: Any,
        tokenizer: Any,
        rag_chunks: Any = (),
        tools: Any = None,
        cached_tokens: int = 0,
        cache_probe: CacheProbe | None = None,
        summaries: SummaryCache | None = None,
        rag_template: str = DEFAULT_RAG_TEMPLATE,
        rag_chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE,
        clock: Callable[[], float] = time.perf_counter,
        safety_margin: float | None = None,
        max_prompt_tokens: int | None = None,
    ) -> PlanState:
        """The initial state: the whole request, every chunk kept (most relevant first).

        Validates like :func:`plan`; use it to test a strategy on its own.
        """
        chunks, profile = _validate_inputs(
            messages, ttft_budget_s, rag_chunks, cached_tokens, rag_template, rag_chunk_template, profile, tokenizer
        )
        if safety_margin is not None:
            _validate.fraction(safety_margin, "safety_margin")
        if max_prompt_tokens is not None:
            _validate.count(max_prompt_tokens, "max_prompt_tokens", minimum=1)
        ctx = _Context(
            messages,
            ttft_budget_s=float(ttft_budget_s),
            profile=profile,
            tokenizer=tokenizer,
            chunks=chunks,
            tools=tools,
            cached_tokens=cached_tokens,
            cache_probe=cache_probe,
            summaries=summaries,
            rag_template=rag_template,
            rag_chunk_template=rag_chunk_template,
            clock=clock,
            safety_margin=safety_margin,
            max_prompt_tokens=max_prompt_tokens,
        )
        return cls(ctx, Candidate(kept_chunks=ctx.chunks))

    # -- reading -----------------------------------------------------------------------------
    @property
    def messages(self) -> Sequence[Mapping[str, Any]]:
        """The caller's messages (read only)."""
        return self.ctx.messages

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """All chunks of the request, most relevant first."""
        return self.ctx.chunks

    @property
    def history_turns(self) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` spans of the turns that may be summarized or dropped, oldest first."""
        return self.ctx.history_turns

    @property
    def budget_s(self) -> float:
        return self.ctx.budget_s

    @property
    def target_s(self) -> float:
        """The budget less the safety margin: what a prediction must fit."""
        return self.ctx.target_s

    @property
    def profile(self) -> Any:
        return self.ctx.profile

    @property
    def tokenizer(self) -> Any:
        return self.ctx.tokenizer

    @property
    def summaries(self) -> SummaryCache | None:
        return self.ctx.summaries

    @property
    def clock(self) -> Callable[[], float]:
        return self.ctx.clock

    @property
    def fits(self) -> bool:
        return self.fits_estimate(self.prediction)

    @property
    def last_user_index(self) -> int:
        """Index of the last user message in the caller's list (chunks go there)."""
        return self.ctx.last_user

    @property
    def caller_cached_tokens(self) -> int:
        """The ``cached_tokens`` the caller passed (for ``messages`` as given)."""
        return self.ctx.knowledge[0][1]

    def message_tokens(self, index: int) -> int:
        """Tokens of the caller's message ``index`` as rendered (its template wrapper included)."""
        return self.ctx.base[index]

    # -- predicting --------------------------------------------------------------------------
    def estimate(self, candidate: Candidate) -> Estimate:
        """Predicted size, cached prefix and TTFT of ``candidate`` (no tokenization of unchanged text)."""
        return self.ctx.estimate(candidate)

    def fits_estimate(self, estimate: Estimate) -> bool:
        """The estimate is within the target (and, when known, the context window)."""
        limit = self.ctx.max_prompt_tokens
        return estimate.ttft_s <= self.ctx.target_s and (limit is None or estimate.prompt_tokens <= limit)

    def token_allowance(self, cached_tokens: int, extra_s: float = 0.0) -> int | None:
        """The most prompt tokens that fit the target when ``cached_tokens`` of them are cached,
        or None if not even one new token fits."""
        profile = self.ctx.profile
        new = profile.max_new_tokens(self.ctx.target_s - extra_s, cached_tokens)
        # the inverse is found by bisection on seconds; agree exactly with the forward prediction
        for _ in range(2):
            if profile.predict_ttft_s(new + 1, cached_tokens) + extra_s <= self.ctx.target_s:
                new += 1
        return cached_tokens + new if new > 0 else None

    def offset_of(self, candidate: Candidate, index: int) -> int:
        """Tokens before the caller's message ``index`` in ``candidate``'s prompt."""
        offset = 0
        for key, n in self.ctx.layout(candidate):
            if key == index or (isinstance(key, tuple) and key[0] == "chunks" and index == self.ctx.last_user):
                break
            offset += n
        return offset

    def chunk_tokens(self, chunks: Sequence[Chunk]) -> int:
        """Tokens ``chunks`` add to the last user message (template text and separators included)."""
        return self.ctx.chunk_tokens(chunks)

    def probe(self, candidate: Candidate) -> int | None:
        """Ask the engine how many tokens of ``candidate`` it has cached (at most twice per
        plan, memoised; None when there is no probe or the allowance is spent)."""
        return self.ctx.probe(candidate)

    def build_messages(self, candidate: Candidate) -> list[dict[str, Any]]:
        """The concrete message list for ``candidate`` (new dicts only where something changed)."""
        return self.ctx.build(candidate)

    # -- changing ----------------------------------------------------------------------------
    def apply(self, candidate: Candidate, action: Action | None) -> PlanState:
        """A new state with ``candidate`` as the current prompt and ``action`` recorded."""
        actions = self.actions if action is None else (*self.actions, action)
        return PlanState(self.ctx, candidate, actions)


def _validate_inputs(
    messages: Any,
    ttft_budget_s: Any,
    rag_chunks: Any,
    cached_tokens: Any,
    rag_template: Any,
    rag_chunk_template: Any,
    profile: Any,
    tokenizer: Any,
) -> tuple[tuple[Chunk, ...], Any]:
    """Check every argument before any work; return the coerced chunks and the profile to use
    (a LiveProfile's current one)."""
    validate_messages(messages)
    _validate.budget(ttft_budget_s)
    chunks = coerce_chunks(rag_chunks)
    _validate.count(cached_tokens, "cached_tokens")
    check_rag_templates(rag_template, rag_chunk_template)
    current = getattr(profile, "current", None)  # a LiveProfile follows the machine
    if current is not None and hasattr(current, "predict_ttft_s"):
        profile = current
    for attr in ("predict_ttft_s", "max_new_tokens", "safety_margin"):
        if not hasattr(profile, attr):
            raise InvalidInputError(f"profile must be a Profile (no {attr!r}), got {type(profile).__name__}")
    for attr in ("segment_counts", "count"):
        if not hasattr(tokenizer, attr):
            raise InvalidInputError(f"tokenizer must be a PromptTokenizer (no {attr!r}), got {type(tokenizer).__name__}")
    return chunks, profile


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------
@attrs.frozen
class Plan:
    """What to send, and why. ``messages`` is the list to send: the caller's very list object
    when nothing changes and there are no chunks.

    ``passthrough`` is True when nothing was trimmed (with ``rag_chunks``, every chunk is placed
    into a copy of the last user message). ``kept_chunks`` are placed in this order; an excerpt
    keeps its chunk's id and carries ``metadata["excerpt"]`` (see :attr:`excerpted_chunks`). ``feasible`` is True when ``predicted_ttft_s`` fits
    the budget less the safety margin; ``minimal`` when the minimal prompt (system messages and
    the last user turn) was used. Every removed or summarized message and every dropped chunk
    is named by some :class:`Action`.
    """

    messages: list[dict[str, Any]] = attrs.field(repr=False, eq=False)
    passthrough: bool
    feasible: bool
    minimal: bool
    budget_s: float
    safety_margin: float
    predicted_ttft_before_s: float
    predicted_ttft_s: float
    prompt_tokens_before: int
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    actions: tuple[Action, ...] = ()
    kept_chunks: tuple[Chunk, ...] = ()
    dropped_chunks: tuple[Chunk, ...] = ()
    removed_message_indices: tuple[int, ...] = ()
    summarized_message_indices: tuple[int, ...] = ()
    summary: Summary | None = None
    inline_s: float = 0.0
    planning_s: float = 0.0
    tokenizer: str = ""
    #: the caller's messages as given (not a copy; never modified) — what
    #: :func:`~trimkit.summarize.next_summary_job` summarizes after the response
    request_messages: Sequence[Mapping[str, Any]] = attrs.field(default=(), repr=False, eq=False)

    @property
    def target_s(self) -> float:
        """The budget less the safety margin: what the prediction had to fit."""
        return self.budget_s * (1.0 - self.safety_margin)

    @property
    def excerpted_chunks(self) -> tuple[str, ...]:
        """Ids of the chunks kept as excerpts rather than whole."""
        return tuple(str(c.id) for c in self.kept_chunks if "excerpt" in c.metadata)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (without the messages themselves; chunks by id)."""
        return {
            "passthrough": self.passthrough,
            "feasible": self.feasible,
            "minimal": self.minimal,
            "budget_s": self.budget_s,
            "safety_margin": self.safety_margin,
            "target_s": self.target_s,
            "predicted_ttft_before_s": self.predicted_ttft_before_s,
            "predicted_ttft_s": self.predicted_ttft_s,
            "prompt_tokens_before": self.prompt_tokens_before,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "message_count": len(self.messages),
            "actions": [a.to_dict() for a in self.actions],
            "kept_chunks": [c.id for c in self.kept_chunks],
            "excerpted_chunks": list(self.excerpted_chunks),
            "dropped_chunks": [c.id for c in self.dropped_chunks],
            "removed_message_indices": list(self.removed_message_indices),
            "summarized_message_indices": list(self.summarized_message_indices),
            "summary": self.summary.to_dict() if self.summary is not None else None,
            "inline_s": self.inline_s,
            "planning_s": self.planning_s,
            "tokenizer": self.tokenizer,
        }

    def __str__(self) -> str:
        if not self.feasible:
            verdict = "INFEASIBLE (minimal prompt, best achievable)"
        elif self.passthrough:
            verdict = "passthrough"
        else:
            verdict = "minimal prompt" if self.minimal else "trimmed"
        lines = [
            f"Plan: {verdict} — predicted TTFT {self.predicted_ttft_before_s:.3f} s → {self.predicted_ttft_s:.3f} s "
            f"(budget {self.budget_s:.3f} s, target {self.target_s:.3f} s after a {self.safety_margin:.0%} margin)",
            f"  prompt {self.prompt_tokens_before:,} → {self.prompt_tokens:,} tokens "
            f"({self.cached_tokens:,} predicted cached, {self.new_tokens:,} to evaluate)",
        ]
        if self.inline_s:
            lines.append(f"  inline work on the critical path: {self.inline_s:.3f} s")
        lines.extend(f"  - {a}" for a in self.actions)
        return "\n".join(lines)


def _default_strategies() -> Any:
    from trimkit.strategies import default_strategies

    return default_strategies()


def _predict(ctx: _Context, tokens: int, cached: int, extra_s: float) -> float:
    cached = max(0, min(cached, tokens - 1))
    return float(ctx.profile.predict_ttft_s(tokens - cached, cached) + extra_s)


def _finish(
    state: PlanState, *, exact_tokens: int, before: tuple[int, float], minimal: bool, feasible: bool, started: float
) -> Plan:
    ctx = state.ctx
    c = state.candidate
    cached = ctx.cached_for(ctx.layout(c), exact_tokens)  # at most exact_tokens - 1
    kept_ids = {ch.id for ch in c.kept_chunks}
    passthrough = not c.gone and c.summary is None and c.kept_chunks == ctx.chunks
    return Plan(
        messages=ctx.build(c),
        passthrough=passthrough,
        feasible=feasible,
        minimal=minimal,
        budget_s=ctx.budget_s,
        safety_margin=ctx.safety_margin,
        predicted_ttft_before_s=before[1],
        predicted_ttft_s=_predict(ctx, exact_tokens, cached, c.extra_s),
        prompt_tokens_before=before[0],
        prompt_tokens=exact_tokens,
        cached_tokens=cached,
        new_tokens=exact_tokens - cached,
        actions=state.actions,
        kept_chunks=c.kept_chunks,
        dropped_chunks=tuple(ch for ch in ctx.chunks if ch.id not in kept_ids),
        removed_message_indices=tuple(sorted(c.removed)),
        summarized_message_indices=tuple(sorted(c.summarized)),
        summary=c.summary,
        inline_s=c.extra_s,
        planning_s=max(ctx.clock() - started, 0.0),
        tokenizer=str(getattr(ctx.tokenizer, "name", "")),
        request_messages=ctx.messages,
    )


def _minimal(state: PlanState) -> Candidate:
    """System messages and the last user turn; no history, summary or chunks."""
    return Candidate(removed=frozenset(i for s, e in state.ctx.history_turns for i in range(s, e)))


def _minimal_state(state: PlanState, c: Candidate, reason: str) -> PlanState:
    if not c.removed and not state.ctx.chunks:
        return PlanState(state.ctx, c)  # the request is already minimal: nothing to report
    action = Action(
        strategy="minimal",
        summary=f"{reason}: kept only system messages and the last user turn "
        f"({len(c.removed)} message(s) and {len(state.ctx.chunks)} chunk(s) removed)",
        removed_messages=tuple(sorted(c.removed)),
        removed_chunks=tuple(str(ch.id) for ch in state.ctx.chunks),
        tokens_before=state.prediction.prompt_tokens,
        tokens_after=state.estimate(c).prompt_tokens,
    )
    return PlanState(state.ctx, c, (action,))


def plan(
    messages: Sequence[Mapping[str, Any]],
    *,
    ttft_budget_s: float,
    profile: Any,
    tokenizer: Any,
    rag_chunks: Any = (),
    strategies: Any = None,
    tools: Any = None,
    cached_tokens: int = 0,
    cache_probe: CacheProbe | None = None,
    summaries: SummaryCache | None = None,
    rag_template: str = DEFAULT_RAG_TEMPLATE,
    rag_chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE,
    on_infeasible: str = "best_effort",
    clock: Callable[[], float] = time.perf_counter,
    values: Any = None,
    safety_margin: float | None = None,
    max_prompt_tokens: int | None = None,
) -> Plan:
    """Decide what to send so the predicted TTFT fits ``ttft_budget_s`` less the safety margin.

    Use it before every request (the wrapper does); it is pure and cheap — it never mutates
    ``messages`` or ``rag_chunks`` and tokenizes only text it has not seen. Under budget the
    request passes through as it is. Over budget, the engine (:mod:`trimkit.engine`) keeps the
    history turns, summary, chunks and chunk excerpts with the most *value* (:mod:`trimkit.values`:
    relevance to the question, recency) whose predicted TTFT fits; the strategies say what may
    change.

    - ``cached_tokens``: how many leading tokens of ``messages`` as given (without chunks) the
      engine already holds in its KV cache. A candidate that edits message ``i`` keeps at most
      the tokens before ``i`` cached.
    - ``cache_probe(messages) -> int``: optional exact cached count for a concrete list; called
      at most twice per plan (memoised): by ``reuse_prefix`` when ``cached_tokens`` is 0, for a
      prompt carrying a cached summary or the previous cut, and for a final prompt whose history
      was edited.
    - ``rag_chunks`` go into the last user message, most relevant first (caller scores if every
      chunk has one, else BM25 blended with the retriever's order); each is kept whole, kept as
      an excerpt (the sentences matching the question, marked as such) or dropped.
    - ``summaries``: precomputed summaries (:func:`~trimkit.summarize.summary_job`) that may
      stand in for the oldest turns.
    - ``strategies``: a strategy, a chain or a list; default
      ``reuse_prefix() + cap_rag_chunks() + summarize_history() + drop_oldest_turns()``. If
      nothing they allow fits, the minimal prompt (system messages and the last user turn) is
      used when it fits.
    - ``values``: a :class:`~trimkit.values.ValueModel` (default: the most relevant chunk
      outranks old history).
    - ``safety_margin``: the share of the budget held back (default: the profile's).
    - ``max_prompt_tokens``: the most prompt tokens the context window takes (``n_ctx`` less
      ``max_tokens``); the plan keeps the prompt within it too.
    - ``on_infeasible``: ``"best_effort"`` returns the minimal plan with ``feasible=False``;
      ``"raise"`` raises :class:`~trimkit.errors.InfeasibleBudgetError` carrying it.
    """
    if on_infeasible not in ("best_effort", "raise"):
        raise InvalidInputError(f"on_infeasible must be 'best_effort' or 'raise', got {on_infeasible!r}")
    if cache_probe is not None and not callable(cache_probe):
        raise InvalidInputError("cache_probe must be callable or None")
    if summaries is not None and not isinstance(summaries, SummaryCache):
        raise InvalidInputError(f"summaries must be a SummaryCache or None, got {type(summaries).__name__}")
    from trimkit.engine import solve
    from trimkit.strategies import chain
    from trimkit.values import ValueModel

    if values is None:
        values = ValueModel()
    elif not isinstance(values, ValueModel):
        raise InvalidInputError(f"values must be a trimkit.values.ValueModel or None, got {type(values).__name__}")
    pipeline = chain(_default_strategies() if strategies is None else strategies)
    started = clock()
    state0 = PlanState.start(  # validates the rest before any work
        messages,
        ttft_budget_s=ttft_budget_s,
        profile=profile,
        tokenizer=tokenizer,
        rag_chunks=rag_chunks,
        tools=tools,
        cached_tokens=cached_tokens,
        cache_probe=cache_probe,
        summaries=summaries,
        rag_template=rag_template,
        rag_chunk_template=rag_chunk_template,
        clock=clock,
        safety_margin=safety_margin,
        max_prompt_tokens=max_prompt_tokens,
    )
    ctx = state0.ctx
    tokens_before = ctx.exact_tokens(state0.candidate)
    before = (tokens_before, _predict(ctx, tokens_before, state0.prediction.cached_tokens, 0.0))
    if _fits(ctx, tokens_before, before[1]):
        return _finish(state0, exact_tokens=tokens_before, before=before, minimal=False, feasible=True, started=started)

    for _attempt in range(3):
        state = solve(PlanState(ctx, state0.candidate), pipeline.strategies, values)
        c = state.candidate
        if c == state0.candidate and not state.fits:
            break  # nothing the strategies allow fits
        if (c.gone or c.summary is not None) and ctx.cache_probe is not None:
            ctx.probe(c)  # history was edited: learn the real cached prefix of what will be sent
        exact = ctx.exact_tokens(c)
        predicted = _predict(ctx, exact, ctx.cached_for(ctx.layout(c), exact), c.extra_s)
        if _fits(ctx, exact, predicted):
            return _finish(state, exact_tokens=exact, before=before, minimal=False, feasible=True, started=started)
        if not state.fits:
            break
        # estimates were optimistic by a few tokens (template boundaries): plan again, stricter
        ctx.correction += max(exact - state.prediction.prompt_tokens, 1)
    ctx.correction = 0

    smallest = _minimal(state0)
    exact = ctx.exact_tokens(smallest)
    feasible = _fits(ctx, exact, _predict(ctx, exact, ctx.cached_for(ctx.layout(smallest), exact), 0.0))
    reason = "the strategies could not meet the budget" if feasible else "budget infeasible"
    minimal = _minimal_state(state0, smallest, reason)
    result = _finish(minimal, exact_tokens=exact, before=before, minimal=True, feasible=feasible, started=started)
    if feasible:
        log.warning("trimkit: strategies could not meet the %.3f s budget; sent the minimal prompt", ctx.budget_s)
        return result
    over_ctx = ctx.max_prompt_tokens is not None and exact > ctx.max_prompt_tokens
    message = (
        f"TTFT budget {ctx.budget_s:.3f} s cannot be met: even the minimal prompt (system messages and the last "
        f"user turn, {exact} tokens) is predicted at {result.predicted_ttft_s:.3f} s, over the "
        f"{ctx.target_s:.3f} s target ({ctx.safety_margin:.0%} safety margin)"
        + (f", and over the context window's {ctx.max_prompt_tokens} prompt tokens" if over_ctx else "")
    )
    if on_infeasible == "raise":
        raise InfeasibleBudgetError(message, plan=result)
    log.warning("trimkit: %s; sending it anyway (best effort)", message)
    return result


def _fits(ctx: _Context, tokens: int, predicted_s: float) -> bool:
    return predicted_s <= ctx.target_s and (ctx.max_prompt_tokens is None or tokens <= ctx.max_prompt_tokens)
