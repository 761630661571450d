"""What a strategy receives and what it returns.

Every strategy (:mod:`trimkit.strategies`) sees one :class:`PlanState`: the request (through its
:class:`~trimkit.planning.request.RequestContext`), the current :class:`~trimkit.planning.request.Candidate`
and its prediction. It returns a :class:`Proposal` — what the engine
(:mod:`trimkit.planning.engine`) may change: turns and chunks that may go, chunks that may be cut
to excerpts, other starts of the prompt (:class:`Lead`) — and may note what it did as an
:class:`Action`, which the plan's report lists. Build a state for a strategy's tests with
:meth:`PlanState.start`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidInputError
from trimkit.messages import (
    DEFAULT_RAG_CHUNK_TEMPLATE,
    DEFAULT_RAG_TEMPLATE,
    Chunk,
    check_rag_templates,
    coerce_chunks,
    validate_messages,
)
from trimkit.planning.request import CacheProbe, Candidate, Estimate, RequestContext
from trimkit.planning.summaries import Summary, SummaryCache
from trimkit.validation import budget, count, fraction

__all__ = ["Action", "Lead", "Proposal", "PlanState", "check_inputs"]


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
class Lead:
    """A different start of the prompt: the ``covers`` oldest history turns replaced by
    ``summary`` (summarized) or, with no summary, dropped (e.g. the previous request's cut)."""

    covers: int
    summary: Summary | None
    strategy: str
    source: str = ""
    extra_s: float = 0.0


@attrs.frozen
class Proposal:
    """What one strategy allows: turns (positions in ``state.history_turns``) that may be
    dropped, chunk ids that may be dropped and cut to excerpts, alternative starts of the
    prompt, and notes (actions that removed nothing, e.g. a probed cache) for the report."""

    droppable_turns: frozenset[int] = frozenset()
    droppable_chunks: frozenset[str] = frozenset()
    excerpt_chunks: frozenset[str] = frozenset()
    leads: tuple[Lead, ...] = ()
    notes: tuple[Action, ...] = ()


@attrs.frozen
class PlanState:
    """What every strategy receives: the request, the current candidate and its prediction.

    A strategy reads ``state.candidate`` and ``state.prediction`` (or calls :meth:`estimate` on
    candidates of its own), and returns ``state.apply(new_candidate, action)`` — or None to
    leave things as they are. Build one for a test with :meth:`start`.
    """

    ctx: RequestContext = attrs.field(repr=False)
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

        Validates like :func:`~trimkit.planning.planner.plan`; use it to test a strategy on its own.
        """
        chunks, profile = check_inputs(
            messages, ttft_budget_s, rag_chunks, cached_tokens, rag_template, rag_chunk_template, profile, tokenizer
        )
        if safety_margin is not None:
            fraction(safety_margin, "safety_margin")
        if max_prompt_tokens is not None:
            count(max_prompt_tokens, "max_prompt_tokens", minimum=1)
        ctx = RequestContext(
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
        return self.ctx.fits(estimate.prompt_tokens, estimate.ttft_s)

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


def check_inputs(
    messages: Any,
    ttft_budget_s: Any,
    rag_chunks: Any,
    cached_tokens: Any,
    rag_template: Any,
    rag_chunk_template: Any,
    profile: Any,
    tokenizer: Any,
) -> tuple[tuple[Chunk, ...], Any]:
    """Check every argument of a plan before any work; return the coerced chunks and the profile
    to use (a LiveProfile's current one)."""
    validate_messages(messages)
    budget(ttft_budget_s)
    chunks = coerce_chunks(rag_chunks)
    count(cached_tokens, "cached_tokens")
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
