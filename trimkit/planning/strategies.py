"""The strategy protocol, how strategies combine, and the built-in strategies."""

from __future__ import annotations

import abc
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import attrs

from trimkit.errors import InvalidInputError, count
from trimkit.planning.solver import Action, Lead, PlanState, Proposal, solve
from trimkit.planning.summaries import ExtractiveSummarizer, Summarizer, make_summary
from trimkit.planning.values import ValueModel

log = logging.getLogger("trimkit")


class Strategy(abc.ABC):  # noqa: B024 - a strategy implements propose() or __call__()
    """One way to make a prompt cheaper: ``propose(state)`` says what the engine may change."""

    __slots__ = ()
    name: ClassVar[str] = "strategy"
    #: a strategy that overrides ``__call__`` only edits the prompt itself, applied in order before the engine chooses
    edits_prompt: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.edits_prompt = cls.__call__ is not Strategy.__call__ and cls.propose is Strategy.propose

    def propose(self, state: PlanState) -> Proposal | None:
        """What this strategy allows the engine to change in ``state`` (None: nothing)."""
        return None

    def __call__(self, state: PlanState) -> PlanState | None:
        """Plan ``state`` with this strategy alone: the state the engine reaches, or None when nothing changes."""
        strategies = list(self) if isinstance(self, Chain) else [self]
        out = solve(state, strategies, ValueModel())
        return None if out.candidate == state.candidate and out.actions == state.actions else out

    def __add__(self, other: Strategy | Iterable[Strategy]) -> Chain:
        return chain(self, other)

    def __radd__(self, other: Strategy | Iterable[Strategy]) -> Chain:
        return chain(other, self)


@attrs.frozen
class Chain(Strategy):
    """Strategies planned together: the engine combines what each allows."""

    strategies: tuple[Strategy, ...]
    name: ClassVar[str] = "chain"

    def __iter__(self) -> Iterator[Strategy]:
        return iter(self.strategies)

    def __len__(self) -> int:
        return len(self.strategies)


def chain(*strategies: Strategy | Iterable[Strategy]) -> Chain:
    """Compose strategies (or lists / chains of them) into one flat :class:`Chain`."""
    flat: list[Strategy] = []
    for item in strategies:
        if isinstance(item, Chain):
            flat.extend(item.strategies)
        elif isinstance(item, Strategy):
            flat.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            flat.extend(chain(*item).strategies)
        else:
            raise InvalidInputError(f"not a strategy: {item!r} (subclass trimkit.strategies.Strategy)")
    return Chain(tuple(flat))


def _positive_count(instance: Any, attribute: Any, value: Any) -> None:
    count(value, attribute.name, minimum=1)


def _history(state: PlanState, keep_last_turns: int) -> Sequence[tuple[int, int]]:
    """History turns a strategy may touch: all but the newest ``keep_last_turns`` (the last user's counts as one)."""
    return state.history_turns[: len(state.history_turns) - (keep_last_turns - 1)]


def _indices(turns: Iterable[tuple[int, int]]) -> frozenset[int]:
    return frozenset(i for s, e in turns for i in range(s, e))


@attrs.frozen
class reuse_prefix(Strategy):
    """Count the KV-cache prefix exactly; removes nothing."""

    name: ClassVar[str] = "reuse_prefix"

    def propose(self, state: PlanState) -> Proposal | None:
        before = state.prediction
        if state.caller_cached_tokens > 0 or state.probe(state.candidate) is None:
            return None
        after = state.estimate(state.candidate)
        if after.cached_tokens <= before.cached_tokens:
            return None
        note = Action(self.name, f"{after.cached_tokens:,} of {after.prompt_tokens:,} prompt tokens are already in the KV cache: "
                      f"predicted TTFT {before.ttft_s:.3f} s → {after.ttft_s:.3f} s, nothing removed", tokens_before=before.prompt_tokens,
                      tokens_after=after.prompt_tokens, detail={"cached_tokens": after.cached_tokens, "probed": True})
        return Proposal(notes=(note,))


@attrs.frozen
class cap_rag_chunks(Strategy):
    """Let the engine drop retrieved chunks, or cut them to excerpts, by value per predicted second."""

    min_chunks: int = attrs.field(default=0, validator=lambda i, a, v: count(v, a.name, minimum=0))
    excerpts: bool = True
    name: ClassVar[str] = "cap_rag_chunks"

    def propose(self, state: PlanState) -> Proposal | None:
        ranked = [str(c.id) for c in state.chunks]
        kept = {str(c.id) for c in state.candidate.kept_chunks}
        droppable = frozenset(cid for cid in ranked[self.min_chunks :] if cid in kept)
        return Proposal(droppable_chunks=droppable, excerpt_chunks=droppable if self.excerpts else frozenset()) if droppable else None


#: cached summaries (the longest prefixes) offered to the engine per request
MAX_SUMMARIES = 3


@attrs.frozen
class summarize_history(Strategy):
    """Offer a summary of the oldest turns, appended to the system message, in their place."""

    summarizer: Summarizer | None = None
    inline: bool = False
    target_tokens: int = attrs.field(default=200, validator=_positive_count)
    keep_last_turns: int = attrs.field(default=1, validator=_positive_count)
    name: ClassVar[str] = "summarize_history"

    def propose(self, state: PlanState) -> Proposal | None:
        c = state.candidate
        turns = _history(state, self.keep_last_turns)
        if c.summary is not None or c.gone or not turns:
            return None
        turn_messages = [[state.messages[i] for i in range(s, e)] for s, e in turns]
        found = state.summaries.prefixes(turn_messages)[-MAX_SUMMARIES:] if state.summaries is not None else []
        if found:
            state.probe(attrs.evolve(c, summarized=_indices(turns[: found[-1][0]]), summary=found[-1][1]))  # a summary sent before may be cached
            return Proposal(leads=tuple(Lead(n, summary, self.name, "cached") for n, summary in found))
        lead = self._compute(state, turns, turn_messages) if self.inline else None
        return Proposal(leads=(lead,)) if lead is not None else None

    def _compute(self, state: PlanState, turns: Sequence[tuple[int, int]], turn_messages: list[list[Any]]) -> Lead | None:
        # the fewest oldest turns whose summary makes room (a fresh summary changes the prompt's start: nothing cached)
        allowance = state.token_allowance(0, state.candidate.extra_s)
        tokens = state.prediction.prompt_tokens + self.target_tokens
        dropped = itertools.accumulate(sum(state.message_tokens(i) for i in range(s, e)) for s, e in turns)
        n = next((k for k, d in enumerate(dropped, start=1) if allowance is not None and tokens - d <= allowance), len(turns))
        covered = [m for turn in turn_messages[:n] for m in turn]
        try:
            summary = make_summary(self.summarizer or ExtractiveSummarizer(), covered, target_tokens=self.target_tokens,
                                   count_tokens=state.tokenizer, clock=state.clock)
        except Exception as exc:  # a failed summary must not fail the request
            log.warning("inline summary failed (%s: %s); carrying on without it", type(exc).__name__, exc)
            return None
        if not summary.text.strip():
            return None
        if state.summaries is not None:
            state.summaries.put(covered, summary)
        return Lead(n, summary, self.name, "inline", summary.seconds)


@attrs.frozen
class drop_oldest_turns(Strategy):
    """Let the engine drop whole history turns — old ones are worth least, so they go first."""

    keep_last_turns: int = attrs.field(default=1, validator=_positive_count)
    name: ClassVar[str] = "drop_oldest_turns"

    def propose(self, state: PlanState) -> Proposal | None:
        gone = state.candidate.gone
        turns = _history(state, self.keep_last_turns)
        droppable = frozenset(j for j, (s, _) in enumerate(turns) if s not in gone)
        return Proposal(droppable_turns=droppable) if droppable else None


@attrs.frozen
class keep_cached_cut(Strategy):
    """Offer the previous request's cut: drop the same oldest turns, so the KV cache stays warm."""

    first_kept: int = attrs.field(validator=lambda i, a, v: count(v, a.name, minimum=1))
    name: ClassVar[str] = "keep_cached_cut"

    def propose(self, state: PlanState) -> Proposal | None:
        c = state.candidate
        turns = state.history_turns
        if c.summary is not None or not any(s == self.first_kept for s, _ in turns):
            return None  # a summary leads, or no turn starts where the previous cut was (the conversation changed)
        n = sum(1 for _, e in turns if e <= self.first_kept)
        if n == 0 or any(s in c.gone for s, _ in turns[:n]) or state.probe(attrs.evolve(c, removed=c.removed | _indices(turns[:n]))) is None:
            return None
        return Proposal(leads=(Lead(n, None, self.name, "previous cut"),))


def default_strategies(keep_cut: int | None = None) -> Chain:
    """``reuse_prefix() + cap_rag_chunks() + summarize_history() + drop_oldest_turns()``;
    with ``keep_cut``, :class:`keep_cached_cut` (``first_kept=keep_cut``) too."""
    cut = (keep_cached_cut(keep_cut),) if keep_cut is not None else ()
    return chain(reuse_prefix(), cap_rag_chunks(), summarize_history(), *cut, drop_oldest_turns())
