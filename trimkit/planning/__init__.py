"""Planning: what a request costs, what each part of it is worth, and the plan that fits the budget.

Read it in this order:

- :mod:`~trimkit.planning.planner` — :func:`~trimkit.planning.planner.plan` and the
  :class:`~trimkit.planning.planner.Plan` it returns (also ``trimkit.plan``);
- :mod:`~trimkit.planning.solver` — one request's fixed inputs and candidate prompts, what a
  strategy receives and returns (:class:`PlanState`, :class:`Proposal`, :class:`Lead`,
  :class:`Action`), and the value-per-second choice (its knapsack);
- :mod:`~trimkit.planning.strategies` — the built-in strategies (public as :mod:`trimkit.strategies`);
- :mod:`~trimkit.planning.costs` — the prefill cost model (:class:`CostModel`);
- :mod:`~trimkit.planning.values` — relevance, excerpts, and what each piece is worth (:class:`ValueModel`);
- :mod:`~trimkit.planning.summaries` — summarizers and the summaries the planner may use;
- :mod:`~trimkit.planning.watch` — the watched prefill (the closed loop);
- :mod:`~trimkit.planning.speed` — what one engine learns as it
  runs (the safety margin, the profile's drift).

Dependencies go one way: the strategies build on the solver; only the planner imports the
strategies (for the defaults). This package does not re-export ``plan`` and ``Plan``: importing
the planner here would import the strategies while they import this package.
"""

from __future__ import annotations

from trimkit.planning.costs import CostModel
from trimkit.planning.solver import Action, Lead, PlanState, Proposal
from trimkit.planning.values import ValueModel

__all__ = ["Action", "CostModel", "Lead", "PlanState", "Proposal", "ValueModel"]
