"""A request on its way through the :class:`~trimkit.pipeline.Pipeline`: the chunks placed into
the prompt (:func:`place_chunks`), the request ready to send (:class:`Prepared`) and the cut the
previous request made in the conversation (:class:`PreviousCut`), which the next plan may keep
to reuse the engine's cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trimkit.messages import DEFAULT_RAG_CHUNK_TEMPLATE, DEFAULT_RAG_TEMPLATE, Chunk, last_user_index, message_text, with_chunks
from trimkit.planning.values import rank_chunks
from trimkit.strategies import default_strategies

__all__ = ["Prepared", "PreviousCut", "place_chunks"]


def place_chunks(
    messages: Sequence[Mapping[str, Any]],
    chunks: Sequence[Chunk],
    template: str = DEFAULT_RAG_TEMPLATE,
    chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE,
) -> list[Mapping[str, Any]]:
    """A new message list with ``chunks`` placed into the last user message (caller's list untouched).

    Chunks go most relevant first — the caller's scores when every chunk has one, else BM25
    against the question — the same order the planner uses, so an untrimmed plan and this
    placement give the same prompt."""
    out = list(messages)
    if not chunks:
        return out
    i = last_user_index(messages)
    out[i] = with_chunks(messages[i], rank_chunks(chunks, message_text(messages[i])), template, chunk_template)
    return out


@attrs.frozen
class Prepared:
    """A request ready to send: the plan, the exact prompt tokens and the cache it will use."""

    messages: Sequence[Mapping[str, Any]]
    prompt_tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    cached_tokens: int
    predicted_ttft_s: float | None
    predicted_ttft_before_s: float | None
    prompt_tokens_before: int
    budget_s: float | None
    plan: Any = None
    snapshot: Any = None
    prepare_s: float = 0.0
    warnings: tuple[str, ...] = ()
    #: the plan fits and the exact prompt's prediction is within the budget (None: no budget)
    feasible: bool | None = None
    #: the wait it was planned with, for the requests ahead of it (predicted; None when nobody
    #: predicts one: a server without a caller's prediction), and how many were ahead
    queue_wait_s: float | None = None
    queue_ahead: int = 0
    #: its place in the engine's queue (:class:`~trimkit.planning.queue.Ticket`; None off an in-process engine)
    ticket: Any = attrs.field(default=None, repr=False, eq=False)
    #: the call's own inputs (messages, chunks, parameters), which a re-plan plans from again
    request: Any = attrs.field(default=None, repr=False, eq=False)
    #: whether its prefill was watched (:mod:`trimkit.planning.watch`), and the re-plans it made
    watched: bool = False
    replans: tuple[Any, ...] = ()

    def with_warning(self, warning: str) -> Prepared:
        """This request with one more warning for its report."""
        return attrs.evolve(self, warnings=(*self.warnings, warning))


class PreviousCut:
    """Where the previous request cut the conversation, if it dropped turns: the role and text
    of the first history message it kept."""

    def __init__(self) -> None:
        self.marker: tuple[Any, str] | None = None

    def strategies_for(self, messages: Sequence[Mapping[str, Any]], strategies: Any) -> Any:
        """``strategies`` when given; else the default chain, plus
        :class:`~trimkit.strategies.keep_cached_cut` when this conversation still has a turn
        starting at the previous cut."""
        if strategies is not None or self.marker is None:
            return strategies
        role, text = self.marker
        for j, m in enumerate(messages):
            if m.get("role") == role and message_text(m) == text and j > 0:
                return default_strategies(keep_cut=j)
        return None

    def remember(self, messages: Sequence[Mapping[str, Any]], plan: Any) -> None:
        """Note where ``plan`` cut ``messages`` (nowhere: it dropped no turn)."""
        removed = set(getattr(plan, "removed_message_indices", ()) or ())
        self.marker = None
        if removed:
            for i in range(max(removed) + 1, len(messages)):
                if i not in removed and messages[i].get("role") not in ("system", "developer"):
                    self.marker = (messages[i].get("role"), message_text(messages[i]))
                    return
