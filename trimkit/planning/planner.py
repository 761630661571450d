"""The planner: decide what to prefill so the predicted TTFT fits the budget."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InfeasibleBudgetError
from trimkit.messages import DEFAULT_RAG_CHUNK_TEMPLATE, DEFAULT_RAG_TEMPLATE, Chunk, in_prompt_order
from trimkit.planning.costs import CacheState
from trimkit.planning.solver import Action, Candidate, PlanState, solve
from trimkit.planning.strategies import chain, default_strategies
from trimkit.planning.summaries import Summary, SummaryCache
from trimkit.planning.values import ValueModel

log = logging.getLogger("trimkit")


@attrs.frozen
class Plan:
    """What to send, and why. ``messages`` is the list to send: the caller's very list object when nothing changes and there
    are no chunks."""

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
    #: :func:`~trimkit.planning.summaries.next_summary_job` summarizes after the response
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
        out = {k: v for k, v in attrs.asdict(self, recurse=False).items() if k not in ("messages", "request_messages")}
        out.update(target_s=self.target_s, message_count=len(self.messages), actions=[a.to_dict() for a in self.actions],
                   kept_chunks=[c.id for c in self.kept_chunks], excerpted_chunks=list(self.excerpted_chunks),
                   dropped_chunks=[c.id for c in self.dropped_chunks], removed_message_indices=list(self.removed_message_indices),
                   summarized_message_indices=list(self.summarized_message_indices), summary=self.summary and self.summary.to_dict())
        return out

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


def _finish(state: PlanState, *, exact_tokens: int, before: tuple[int, float], minimal: bool, feasible: bool, started: float) -> Plan:
    ctx = state.ctx
    c = state.candidate
    cached = ctx.cached_for(ctx.layout(c), exact_tokens)  # at most exact_tokens - 1
    kept_ids = {ch.id for ch in c.kept_chunks}
    passthrough = not c.gone and c.summary is None and c.kept_chunks == ctx.chunks
    return Plan(messages=ctx.build_messages(c), passthrough=passthrough, feasible=feasible, minimal=minimal, budget_s=ctx.budget_s,
                safety_margin=ctx.safety_margin, predicted_ttft_before_s=before[1], predicted_ttft_s=ctx.predict(exact_tokens, cached, c.extra_s),
                prompt_tokens_before=before[0], prompt_tokens=exact_tokens, cached_tokens=cached, new_tokens=exact_tokens - cached,
                actions=state.actions, kept_chunks=in_prompt_order(c.kept_chunks), dropped_chunks=tuple(ch for ch in ctx.chunks if ch.id not in kept_ids),
                removed_message_indices=tuple(sorted(c.removed)), summarized_message_indices=tuple(sorted(c.summarized)), summary=c.summary,
                inline_s=c.extra_s, planning_s=max(ctx.clock() - started, 0.0), tokenizer=str(getattr(ctx.tokenizer, "name", "")),
                request_messages=ctx.messages)


def _minimal_state(state: PlanState, c: Candidate, reason: str) -> PlanState:
    """``c`` (the minimal prompt: system messages and the last user turn) as a state, with the action that made it."""
    if not c.removed and not state.ctx.chunks:
        return PlanState(state.ctx, c)  # the request is already minimal: nothing to report
    action = Action("minimal", f"{reason}: kept only system messages and the last user turn ({len(c.removed)} message(s) and "
                    f"{len(state.ctx.chunks)} chunk(s) removed)", removed_messages=tuple(sorted(c.removed)),
                    removed_chunks=tuple(str(ch.id) for ch in state.ctx.chunks), tokens_before=state.prediction.prompt_tokens,
                    tokens_after=state.estimate(c).prompt_tokens)
    return PlanState(state.ctx, c, (action,))


def plan(messages: Sequence[Mapping[str, Any]], *, ttft_budget_s: float, profile: Any, tokenizer: Any, rag_chunks: Any = (), strategies: Any = None,
         tools: Any = None, cached_tokens: int = 0, cache: CacheState | None = None, summaries: SummaryCache | None = None,
         rag_template: str = DEFAULT_RAG_TEMPLATE, rag_chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE, on_infeasible: str = "best_effort",
         clock: Callable[[], float] = time.perf_counter, values: Any = None, safety_margin: float | None = None,
         max_prompt_tokens: int | None = None) -> Plan:
    """Decide what to send so the predicted TTFT fits ``ttft_budget_s`` less the safety margin."""
    pipeline = chain(default_strategies() if strategies is None else strategies)  # checks the strategies
    started = clock()
    state0 = PlanState.start(messages, ttft_budget_s=ttft_budget_s, profile=profile, tokenizer=tokenizer, rag_chunks=rag_chunks, tools=tools,
                             cached_tokens=cached_tokens, cache=cache, summaries=summaries, rag_template=rag_template,
                             rag_chunk_template=rag_chunk_template, clock=clock, safety_margin=safety_margin,
                             max_prompt_tokens=max_prompt_tokens, on_infeasible=on_infeasible, values=values)  # checks every argument
    values = ValueModel() if values is None else values
    ctx = state0.ctx
    tokens_before = ctx.exact_tokens(state0.candidate)
    before = (tokens_before, ctx.predict(tokens_before, state0.prediction.cached_tokens, 0.0))
    if ctx.fits(tokens_before, before[1]):
        return _finish(state0, exact_tokens=tokens_before, before=before, minimal=False, feasible=True, started=started)

    for _attempt in range(3):
        state = solve(PlanState(ctx, state0.candidate), pipeline.strategies, values)
        c = state.candidate
        if c == state0.candidate and not state.fits:
            break  # nothing the strategies allow fits
        if (c.gone or c.summary is not None) and ctx.cache is not None:
            ctx.probe(c)  # history was edited: learn the real cached prefix of what will be sent
        exact = ctx.exact_tokens(c)
        predicted = ctx.predict(exact, ctx.cached_for(ctx.layout(c), exact), c.extra_s)
        if ctx.fits(exact, predicted):
            return _finish(state, exact_tokens=exact, before=before, minimal=False, feasible=True, started=started)
        # estimates were optimistic by a few tokens (template boundaries), or the cache lookup found
        # less of the prompt cached than estimated: plan again, stricter and better informed
        ctx.correction += max(exact - state.prediction.prompt_tokens, 1)
    ctx.correction = 0

    smallest = Candidate(removed=frozenset(i for s, e in ctx.history_turns for i in range(s, e)))  # no history, summary or chunks
    exact = ctx.exact_tokens(smallest)
    feasible = ctx.fits(exact, ctx.predict(exact, ctx.cached_for(ctx.layout(smallest), exact), 0.0))
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
