"""Planning: what a request costs, what each part of it is worth, and the plan that fits the budget.

:mod:`~trimkit.planning.planner` (``plan``, ``Plan``) drives :mod:`~trimkit.planning.solver` with the
:mod:`~trimkit.planning.strategies`; :mod:`~trimkit.planning.costs`, :mod:`~trimkit.planning.values`,
:mod:`~trimkit.planning.summaries`, :mod:`~trimkit.planning.watch` and :mod:`~trimkit.planning.speed` price, value and watch.
Nothing is re-exported here: the public names are in :mod:`trimkit` and :mod:`trimkit.strategies`.
"""
