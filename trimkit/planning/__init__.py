"""Planning: what a request costs, what each part of it is worth, and the plan that fits the budget.

:mod:`~trimkit.planning.planner` (``plan``, ``Plan``) drives :mod:`~trimkit.planning.solver` with the
:mod:`~trimkit.planning.strategies`; :mod:`~trimkit.planning.costs`, :mod:`~trimkit.planning.values`,
:mod:`~trimkit.planning.summaries`, :mod:`~trimkit.planning.watch` and :mod:`~trimkit.planning.speed` price, value and watch.
``plan`` is not re-exported here: importing the planner would import the strategies while they import this package.
"""

from __future__ import annotations

from trimkit.planning.costs import CostModel
from trimkit.planning.solver import Action, Lead, PlanState, Proposal
from trimkit.planning.values import ValueModel

__all__ = ["Action", "CostModel", "Lead", "PlanState", "Proposal", "ValueModel"]
