"""The knapsack the planning engine solves: the most value within a token room, at most one
variant per item (a chunk whole or one of its excerpts; a turn kept or not).

Dynamic programming over a capacity grid of :data:`RESOLUTION` steps, vectorised with numpy: a
few milliseconds for a request with dozens of chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["knapsack", "RESOLUTION"]

#: capacity resolution of the knapsack: item sizes are rounded up to room / RESOLUTION tokens
RESOLUTION = 512


def knapsack(groups: Sequence[Sequence[tuple[int, float]]], room: int) -> tuple[float, list[int]]:
    """Pick at most one ``(tokens, value)`` variant per group, most total value within ``room``
    tokens. Returns the value and the chosen variant index per group (-1: none).

    Sizes are rounded *up* to ``room / RESOLUTION`` tokens, so a selection never exceeds ``room``.
    """
    chosen = [-1] * len(groups)
    if room <= 0 or not groups:
        return 0.0, chosen
    quantum = max(1, -(-room // RESOLUTION))
    cap = room // quantum
    dp = np.zeros(cap + 1)
    choices = np.full((len(groups), cap + 1), -1, dtype=np.int16)
    sizes = [[-(-w // quantum) for w, _ in variants] for variants in groups]
    for g, variants in enumerate(groups):
        best = dp.copy()
        arg = choices[g]
        for vi, (_, value) in enumerate(variants):
            wq = sizes[g][vi]
            if wq > cap or value <= 0:
                continue
            cand = dp[: cap + 1 - wq] + value
            seg = best[wq:]
            better = cand > seg + 1e-12
            seg[better] = cand[better]
            arg[wq:][better] = vi
        dp = best
    c = cap
    for g in range(len(groups) - 1, -1, -1):
        vi = int(choices[g][c])
        if vi >= 0:
            chosen[g] = vi
            c -= sizes[g][vi]
    return float(dp[cap]), chosen
