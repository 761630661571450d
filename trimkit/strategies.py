"""Trimming strategies: small frozen objects that say what the planner may change (the public namespace of
:mod:`trimkit.planning.strategies`, with what a strategy receives and returns).

Compose them with ``+`` or :func:`chain`; the default is ``reuse_prefix() + cap_rag_chunks() + summarize_history() +
drop_oldest_turns()``. To write one, subclass :class:`Strategy` and implement ``propose(state)`` (docs/budgets.md, "Your own strategy").
"""

from __future__ import annotations

from trimkit.planning.solver import Action, Lead, PlanState, Proposal
from trimkit.planning.strategies import (
    MAX_SUMMARIES,
    Chain,
    Strategy,
    cap_rag_chunks,
    chain,
    default_strategies,
    drop_oldest_turns,
    keep_cached_cut,
    reuse_prefix,
    summarize_history,
)

__all__ = ["Strategy", "Chain", "chain", "reuse_prefix", "cap_rag_chunks", "summarize_history", "drop_oldest_turns", "keep_cached_cut",
           "default_strategies", "MAX_SUMMARIES", "PlanState", "Proposal", "Lead", "Action"]
