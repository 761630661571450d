"""Planning: what a request costs, what each part of it is worth, and the plan that fits the budget.

Read it in this order:

- :mod:`~trimkit.planning.planner` — :func:`~trimkit.planning.planner.plan` and the
  :class:`~trimkit.planning.planner.Plan` it returns (also ``trimkit.plan``);
- :mod:`~trimkit.planning.state` — what a strategy receives and returns (:class:`PlanState`,
  :class:`Proposal`, :class:`Lead`, :class:`Action`);
- :mod:`~trimkit.planning.request` — one request's fixed inputs, candidate prompts and their
  estimates;
- :mod:`~trimkit.planning.engine` — the value-per-second choice (and its knapsack);
- :mod:`~trimkit.planning.costs` — the prefill cost model (:class:`CostModel`);
- :mod:`~trimkit.planning.values`, :mod:`~trimkit.planning.values`,
  :mod:`~trimkit.planning.values` — what each piece is worth (:class:`ValueModel`);
- :mod:`~trimkit.planning.summaries` — the summaries the planner may use;
- :mod:`~trimkit.planning.margin`, :mod:`~trimkit.planning.drift` — what one engine learns as it
  runs (the safety margin, the profile's drift).

Dependencies go one way: the strategies (:mod:`trimkit.strategies`) build on ``state`` and
``engine``; only the planner imports the strategies (for the defaults). That is why this package
does not re-export ``plan`` and ``Plan``: importing the planner here would import the strategies
while they import this package.
"""

from __future__ import annotations

from trimkit.planning.costs import CostModel
from trimkit.planning.state import Action, Lead, PlanState, Proposal
from trimkit.planning.values import ValueModel

__all__ = ["Action", "CostModel", "Lead", "PlanState", "Proposal", "ValueModel"]
