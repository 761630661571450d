"""Trimming strategies: small frozen objects that say what the planner may change.

A strategy looks at the one :class:`~trimkit.planning.solver.PlanState` and returns a
:class:`~trimkit.planning.solver.Proposal` from ``propose(state)``: history turns that may be
dropped, chunks that may be dropped or cut to excerpts, a summary or an earlier cut that may
stand in for the oldest turns. The engine (:mod:`trimkit.planning.solver`) then keeps the most
*value* whose predicted TTFT fits — the order of strategies does not decide what goes. Whatever
no strategy offers stays. Compose them with ``+`` or :func:`chain` (nested chains flatten)::

    strategies = reuse_prefix() + cap_rag_chunks(min_chunks=1) + drop_oldest_turns(keep_last_turns=2)

The default::

    reuse_prefix() + cap_rag_chunks() + summarize_history() + drop_oldest_turns()

To write your own, subclass :class:`Strategy` (a frozen attrs class with a ``name``) and
implement ``propose`` returning a :class:`Proposal` (or None); build a state for its tests with
``PlanState.start(...)``. Both are importable from here. A strategy
that instead overrides ``__call__(state)`` to return ``state.apply(candidate, action)`` edits
the prompt itself; the engine applies such edits, in order, before it chooses. Calling any
strategy, ``strategy(state)``, plans with that strategy alone.

The public namespace of :mod:`trimkit.planning.strategies` (the protocol, :class:`Chain`, the
built-in strategies); summarizers and the summary jobs are in :mod:`trimkit.planning.summaries`.
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
    "MAX_SUMMARIES",
    # what a strategy receives and returns (defined in trimkit.planning.solver)
    "PlanState",
    "Proposal",
    "Lead",
    "Action",
]
