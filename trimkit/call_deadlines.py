"""How long a wrapped call to a served model may wait, from its TTFT budget: how long it is
retried before its first chunk, and its deadline. (How a backend applies them, per request and
per attempt, is :mod:`trimkit.backends.limits`.)

Once the first token is later than twice the budget the answer has failed its purpose, and
retrying longer only hides an outage from the caller; but a tight budget (0.3 s) must not turn a
dropped keep-alive connection or a server's brief 503 into an error, so a few seconds of retries
are always allowed (:func:`retry_deadline_for`). Retries never happen after the first chunk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["CallDeadlines", "retry_deadline_for", "MIN_RETRY_DEADLINE_S", "RETRY_DEADLINE_BUDGETS"]

#: the retry deadline never drops below this, however tight the budget (see :func:`retry_deadline_for`)
MIN_RETRY_DEADLINE_S = 5.0
#: with a budget, a request is retried for at most this many budgets
RETRY_DEADLINE_BUDGETS = 2.0


def retry_deadline_for(ttft_budget_s: float | None, default_s: float) -> float:
    """How long a request that has not produced its first chunk is retried (connection refused,
    timeouts, 429/502/503/504): ``max(2 × budget, 5 s)`` with a budget, else ``default_s``.

    With a budget this is also the call's *deadline*: every wait before the first chunk ends by
    then (a server that accepts and never answers gives ``ServerTimeoutError`` after it, not
    after the backend's ``timeout_s``).
    """
    if ttft_budget_s is None:
        return default_s
    return max(RETRY_DEADLINE_BUDGETS * ttft_budget_s, MIN_RETRY_DEADLINE_S)


@attrs.frozen
class CallDeadlines:
    """The deadlines of one wrapper's calls. ``unbudgeted_s``: the retry deadline of a call
    without a budget (the backend's own); ``fixed_s``: a retry deadline the user fixed for every
    call (None: derived from each call's budget)."""

    unbudgeted_s: float
    fixed_s: float | None = None

    def retry_s(self, ttft_budget_s: float | None) -> float:
        """The retry deadline of a request with this budget (see :func:`retry_deadline_for`)."""
        return self.fixed_s if self.fixed_s is not None else retry_deadline_for(ttft_budget_s, self.unbudgeted_s)

    def first_chunk_s(self, ttft_budget_s: float | None) -> float | None:
        """The deadline bounding every wait before a request's first chunk: the retry deadline
        when the request has a budget; None without one (each wait then has the backend's
        ``timeout_s``)."""
        return self.retry_s(ttft_budget_s) if ttft_budget_s is not None else None

    def whole_answer_s(self, ttft_budget_s: float | None, params: Mapping[str, Any], decode_tokens_per_s: Any) -> float | None:
        """The deadline of a request that cannot be streamed (``n > 1``), whose first byte comes
        after the whole answer: the first-chunk deadline plus twice the time its
        ``n × max_tokens`` take to decode at ``decode_tokens_per_s``. None (each wait bounded by
        ``timeout_s`` only) without a budget, without ``max_tokens`` or without a decode speed."""
        base = self.first_chunk_s(ttft_budget_s)
        max_tokens = params.get("max_completion_tokens") or params.get("max_tokens")
        n = params.get("n") or 1
        speed = decode_tokens_per_s
        if base is None or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (max_tokens, n)):
            return None
        assert isinstance(max_tokens, int)  # checked above; for the type checker
        if not isinstance(speed, (int, float)) or not math.isfinite(speed) or speed <= 0:
            return None
        return base + 2.0 * n * max_tokens / speed
