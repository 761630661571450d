"""Trimming strategies: small frozen callables the planner runs in order until the prompt fits.

A strategy takes the one :class:`~trimkit.planner.PlanState` and returns a new state
(``state.apply(candidate, action)``) or None for "nothing to do". Each does the *least* it can
to make the prediction fit — the planner stops as soon as it does — and records what it
removed in an :class:`~trimkit.planner.Action`. Compose them with ``+`` or :func:`chain`
(nested chains flatten)::

    strategies = reuse_prefix() + cap_rag_chunks(min_chunks=1) + drop_oldest_turns(keep_last_turns=2)

The default, cheapest and least lossy first (DESIGN.md)::

    reuse_prefix() + cap_rag_chunks() + summarize_history() + drop_oldest_turns()

To write your own, subclass :class:`Strategy` (a frozen attrs class with a ``name``) and
implement ``__call__``; build a state for its tests with ``PlanState.start(...)``. Strategies
work on whole turns (:func:`~trimkit.messages.turn_spans`), so tool calls and their results
stay together; system messages and the last user turn are never candidates.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import attrs

from trimkit._validate import count as _check_count
from trimkit.errors import InvalidInputError
from trimkit.planner import Action, Candidate, PlanState
from trimkit.summarize import ExtractiveSummarizer, Summarizer, Summary, make_summary

__all__ = [
    "Strategy",
    "Chain",
    "chain",
    "reuse_prefix",
    "cap_rag_chunks",
    "summarize_history",
    "drop_oldest_turns",
    "keep_cached_cut",
    "default_strategies",
]

log = logging.getLogger("trimkit")


class Strategy(abc.ABC):
    """One way to make a prompt cheaper. ``__call__(state)`` returns a new state or None."""

    __slots__ = ()
    name: ClassVar[str] = "strategy"

    @abc.abstractmethod
    def __call__(self, state: PlanState) -> PlanState | None:
        """Return ``state.apply(candidate, action)`` for a cheaper candidate, or None."""

    def __add__(self, other: Strategy | Iterable[Strategy]) -> Chain:
        return chain(self, other)

    def __radd__(self, other: Strategy | Iterable[Strategy]) -> Chain:
        return chain(other, self)


def _positive_count(instance: Any, attribute: Any, value: Any) -> None:
    _check_count(value, attribute.name, minimum=1)


@attrs.frozen
class Chain(Strategy):
    """Strategies run in order, each only while the prediction is still over the target."""

    strategies: tuple[Strategy, ...]
    name: ClassVar[str] = "chain"

    def __call__(self, state: PlanState) -> PlanState:
        for strategy in self.strategies:
            if state.fits:
                break
            state = strategy(state) or state
        return state

    def __iter__(self) -> Iterator[Strategy]:
        return iter(self.strategies)

    def __len__(self) -> int:
        return len(self.strategies)


def chain(*strategies: Strategy | Iterable[Strategy]) -> Chain:
    """Compose strategies (or lists / chains of them) into one flat :class:`Chain`."""
    flat: list[Strategy] = []

    def add(item: Any) -> None:
        if isinstance(item, Chain):
            flat.extend(item.strategies)
        elif isinstance(item, Strategy):
            flat.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            for sub in item:
                add(sub)
        else:
            raise InvalidInputError(f"not a strategy: {item!r} (subclass trimkit.strategies.Strategy)")

    for s in strategies:
        add(s)
    return Chain(tuple(flat))


def default_strategies(keep_cut: int | None = None) -> Chain:
    """``reuse_prefix() + cap_rag_chunks() + summarize_history() + drop_oldest_turns()``;
    with ``keep_cut``, :class:`keep_cached_cut` (``first_kept=keep_cut``) runs before dropping."""
    cut = (keep_cached_cut(keep_cut),) if keep_cut is not None else ()
    return chain(reuse_prefix(), cap_rag_chunks(), summarize_history(), *cut, drop_oldest_turns())


def _history(state: PlanState, keep_last_turns: int) -> Sequence[tuple[int, int]]:
    """History turns a strategy may touch: all but the newest ``keep_last_turns`` (the last
    user's turn counts as one and is never included)."""
    turns = state.history_turns
    spare = keep_last_turns - 1
    return turns[: len(turns) - spare] if spare else turns


def _indices(turns: Iterable[tuple[int, int]]) -> frozenset[int]:
    return frozenset(i for s, e in turns for i in range(s, e))


def _span_text(indices: Iterable[int]) -> str:
    """``[1, 2, 3, 5]`` → ``"1–3, 5"``."""
    ordered = sorted(indices)
    runs: list[list[int]] = []
    for i in ordered:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@attrs.frozen
class reuse_prefix(Strategy):
    """Count the KV-cache prefix exactly; removes nothing.

    Use it first: it costs no quality. When the wrapper could not say how many tokens are
    cached (``cached_tokens=0``) but gave a ``cache_probe``, it asks the engine once; if more
    is cached than estimated, the prediction drops — possibly under the budget, and then
    nothing else is trimmed. Otherwise it does nothing (the planner already counts
    ``cached_tokens`` and the cache an edit keeps).
    """

    name: ClassVar[str] = "reuse_prefix"

    def __call__(self, state: PlanState) -> PlanState | None:
        if state.caller_cached_tokens > 0:
            return None
        before = state.prediction
        if state.probe(state.candidate) is None:
            return None
        after = state.estimate(state.candidate)
        if after.cached_tokens <= before.cached_tokens:
            return None
        action = Action(
            strategy=self.name,
            summary=f"{after.cached_tokens:,} of {after.prompt_tokens:,} prompt tokens are already in the KV cache: "
            f"predicted TTFT {before.ttft_s:.3f} s → {after.ttft_s:.3f} s, nothing removed",
            tokens_before=before.prompt_tokens,
            tokens_after=after.prompt_tokens,
            detail={"cached_tokens": after.cached_tokens, "probed": True},
        )
        return state.apply(state.candidate, action)


@attrs.frozen
class cap_rag_chunks(Strategy):
    """Keep the most relevant RAG chunks that fit; drop the rest whole.

    Use it when a request carries ``rag_chunks``: chunks are this turn's most volatile text,
    at the end of the prompt, so dropping them never costs the cached prefix. Chunks are added
    most relevant first while the prediction fits (a less relevant but shorter chunk may still
    fit after a longer one did not); the first ``min_chunks`` are always kept.
    """

    min_chunks: int = attrs.field(default=0, validator=lambda i, a, v: _check_count(v, a.name, minimum=0))
    name: ClassVar[str] = "cap_rag_chunks"

    def __call__(self, state: PlanState) -> PlanState | None:
        c = state.candidate
        ranked = c.kept_chunks
        if len(ranked) <= self.min_chunks:
            return None
        bare = attrs.evolve(c, kept_chunks=())
        bare_tokens = state.estimate(bare).prompt_tokens
        # whatever chunks are placed, the cache can hold at most what precedes the last user message
        with_chunks = attrs.evolve(c, kept_chunks=ranked[:1])
        cached = min(state.estimate(with_chunks).cached_tokens, state.offset_of(bare, state.last_user_index))
        allowance = state.token_allowance(cached, c.extra_s)
        kept = list(ranked[: self.min_chunks])
        for chunk in ranked[self.min_chunks :]:
            if allowance is not None and bare_tokens + state.chunk_tokens([*kept, chunk]) <= allowance:
                kept.append(chunk)
        if len(kept) == len(ranked):
            return None
        new = attrs.evolve(c, kept_chunks=tuple(kept))
        kept_ids = {k.id for k in kept}
        dropped = tuple(str(ch.id) for ch in ranked if ch.id not in kept_ids)
        after = state.estimate(new)
        action = Action(
            strategy=self.name,
            summary=f"kept {len(kept)} of {len(ranked)} chunks (most relevant first); dropped {', '.join(dropped)}",
            removed_chunks=dropped,
            tokens_before=state.prediction.prompt_tokens,
            tokens_after=after.prompt_tokens,
            detail={"kept": [str(k.id) for k in kept], "dropped": list(dropped)},
        )
        return state.apply(new, action)


@attrs.frozen
class summarize_history(Strategy):
    """Replace the oldest turns with a summary appended to the system message.

    Use it to keep the gist of a long conversation instead of losing it. By default it only
    uses a summary already in the plan's ``summaries`` cache (computed off the critical path,
    see :func:`~trimkit.summarize.summary_job`) and does nothing when none is ready. With
    ``inline=True`` it computes one now with ``summarizer`` (default
    :class:`~trimkit.summarize.ExtractiveSummarizer`), covering the fewest oldest turns that
    make room, and the time that takes counts against the budget. The newest
    ``keep_last_turns`` turns (the current one included) are never summarized. It only acts on
    untouched history, so run it before strategies that remove turns.
    """

    summarizer: Summarizer | None = None
    inline: bool = False
    target_tokens: int = attrs.field(default=200, validator=_positive_count)
    keep_last_turns: int = attrs.field(default=1, validator=_positive_count)
    name: ClassVar[str] = "summarize_history"

    def __call__(self, state: PlanState) -> PlanState | None:
        c = state.candidate
        turns = _history(state, self.keep_last_turns)
        if c.summary is not None or c.gone or not turns:
            return None
        turn_messages = [[state.messages[i] for i in range(s, e)] for s, e in turns]
        found = state.summaries.best_prefix(turn_messages) if state.summaries is not None else None
        extra_s = 0.0
        if found is not None:
            n, summary = found
            source = "cached"
        elif self.inline:
            computed = self._compute(state, turns, turn_messages)
            if computed is None:
                return None
            n, summary = computed
            source, extra_s = "inline", summary.seconds
        else:
            return None
        covered = _indices(turns[:n])
        new = attrs.evolve(c, summarized=covered, summary=summary, extra_s=c.extra_s + extra_s)
        if source == "cached":
            state.probe(new)  # a byte-stable summary sent before may still be in the KV cache
        after = state.estimate(new)
        if after.ttft_s >= state.prediction.ttft_s:
            return None  # no gain: the summary costs more (tokens or cache) than the turns it replaces
        action = Action(
            strategy=self.name,
            summary=f"replaced {len(covered)} message(s) in the {n} oldest turn(s) (messages {_span_text(covered)}, "
            f"{summary.source_tokens:,} tokens) with a {summary.summary_tokens:,}-token {source} summary"
            + (f", computed inline in {extra_s:.3f} s" if extra_s else ""),
            summarized_messages=tuple(sorted(covered)),
            tokens_before=state.prediction.prompt_tokens,
            tokens_after=after.prompt_tokens,
            detail={
                "turns": n,
                "source": source,
                "summarizer": summary.summarizer,
                "source_tokens": summary.source_tokens,
                "summary_tokens": summary.summary_tokens,
                "inline_s": extra_s,
            },
        )
        return state.apply(new, action)

    def _compute(
        self, state: PlanState, turns: Sequence[tuple[int, int]], turn_messages: list[list[Any]]
    ) -> tuple[int, Summary] | None:
        # the fewest oldest turns whose replacement by a target-sized summary makes room
        # (a fresh summary changes the start of the prompt, so count nothing as cached)
        allowance = state.token_allowance(0, state.candidate.extra_s)
        tokens = state.prediction.prompt_tokens + self.target_tokens
        n = len(turns)
        for k, (s, e) in enumerate(turns, start=1):
            tokens -= sum(state.message_tokens(i) for i in range(s, e))
            if allowance is not None and tokens <= allowance:
                n = k
                break
        covered = [m for turn in turn_messages[:n] for m in turn]
        try:
            summary = make_summary(
                self.summarizer or ExtractiveSummarizer(),
                covered,
                target_tokens=self.target_tokens,
                count_tokens=state.tokenizer,
                clock=state.clock,
            )
        except Exception as exc:  # a failed summary must not fail the request
            log.warning("inline summary failed (%s: %s); carrying on without it", type(exc).__name__, exc)
            return None
        if not summary.text.strip():
            return None
        if state.summaries is not None:
            state.summaries.put(covered, summary)
        return n, summary


@attrs.frozen
class drop_oldest_turns(Strategy):
    """Drop the fewest oldest turns that make the prompt fit — the last resort.

    Whole turns go (a tool call and its results together); the newest ``keep_last_turns``
    turns, counting the current one, stay. If dropping every other turn is not enough, a
    summary placed earlier is dropped too.
    """

    keep_last_turns: int = attrs.field(default=1, validator=_positive_count)
    name: ClassVar[str] = "drop_oldest_turns"

    def __call__(self, state: PlanState) -> PlanState | None:
        c = state.candidate
        turns = [t for t in _history(state, self.keep_last_turns) if t[0] not in c.gone]
        if not turns and c.summary is None:
            return None

        def dropping(d: int) -> Candidate:
            return attrs.evolve(c, removed=c.removed | _indices(turns[:d]))

        def fits(d: int) -> bool:
            return state.fits_estimate(state.estimate(dropping(d)))

        m = len(turns)
        if m and fits(m):
            lo, hi = 1, m  # the fewest turns that fit: predictions fall as turns go
            while lo < hi:
                mid = (lo + hi) // 2
                if fits(mid):
                    hi = mid
                else:
                    lo = mid + 1
            while lo > 1 and fits(lo - 1):  # a probed cache prefix can make fewer drops fit
                lo -= 1
            new, dropped_summary = dropping(lo), False
        else:
            new, dropped_summary = dropping(m), False
            if c.summary is not None:
                new = attrs.evolve(new, removed=new.removed | c.summarized, summarized=frozenset(), summary=None)
                dropped_summary = True
        removed = new.removed - c.removed
        if not removed:
            return None
        after = state.estimate(new)
        n_turns = sum(1 for s, _ in turns if s in removed)
        parts = [f"the {n_turns} oldest turn(s) (messages {_span_text(removed - c.summarized)})"] if n_turns else []
        if dropped_summary:
            parts.append(f"the summary of messages {_span_text(c.summarized)}")
        text = "dropped " + " and ".join(parts)
        action = Action(
            strategy=self.name,
            summary=f"{text}: {state.prediction.prompt_tokens - after.prompt_tokens:,} tokens",
            removed_messages=tuple(sorted(removed)),
            tokens_before=state.prediction.prompt_tokens,
            tokens_after=after.prompt_tokens,
            detail={"turns": n_turns, "summary_dropped": dropped_summary},
        )
        return state.apply(new, action)


@attrs.frozen
class keep_cached_cut(Strategy):
    """Drop the same oldest turns as the previous request did, when that keeps the KV cache warm.

    After a request that dropped the turns before message ``first_kept``, the engine's cache
    holds a prompt starting there. Dropping any other number of turns now changes the start of
    the prompt and pays the whole prefill again; dropping the same ones — the new turn is
    appended at the end — reuses it, so the prompt keeps *more* history for *less* time.
    The wrapper adds this strategy (before :class:`drop_oldest_turns`) with the index of the
    first history message it kept last time; it probes the engine once and applies only if
    the cached candidate fits.
    """

    first_kept: int = attrs.field(validator=lambda i, a, v: _check_count(v, a.name, minimum=1))
    name: ClassVar[str] = "keep_cached_cut"

    def __call__(self, state: PlanState) -> PlanState | None:
        c = state.candidate
        if c.summary is not None:
            return None
        turns = [t for t in state.history_turns if t[1] <= self.first_kept and t[0] not in c.gone]
        if not turns or not any(s == self.first_kept for s, _ in state.history_turns):
            return None  # no turn starts where the previous cut was: the conversation changed
        new = attrs.evolve(c, removed=c.removed | _indices(turns))
        if state.probe(new) is None:
            return None
        after = state.estimate(new)
        if not state.fits_estimate(after):
            return None
        removed = new.removed - c.removed
        action = Action(
            strategy=self.name,
            summary=f"dropped the {len(turns)} oldest turn(s) (messages {_span_text(removed)}), the same cut as the previous "
            f"request, so {after.cached_tokens:,} cached tokens are reused: "
            f"{state.prediction.prompt_tokens - after.prompt_tokens:,} tokens",
            removed_messages=tuple(sorted(removed)),
            tokens_before=state.prediction.prompt_tokens,
            tokens_after=after.prompt_tokens,
            detail={"turns": len(turns), "cached_tokens": after.cached_tokens},
        )
        return state.apply(new, action)
