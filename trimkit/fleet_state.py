"""What a fleet knows of each endpoint, without I/O, beyond the requests in flight there (an
:class:`~trimkit.planning.queue.EngineQueue` per endpoint): how long a new request waits on a
server that runs several requests at once (:func:`slot_wait_s`), which prompts its prefix cache is
predicted to hold (:class:`HeldPrompts`), and whether it is in rotation (:class:`Health`).
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Sequence

import attrs

from trimkit.tokens import reusable_prefix_len

__all__ = ["slot_wait_s", "HeldPrompts", "Health"]


def slot_wait_s(remaining_s: Sequence[float], slots: int) -> float:
    """How long a new request waits on a server that runs ``slots`` requests at once, first come
    first served, behind requests with ``remaining_s`` of predicted work each (in the order they
    came): with one slot, their sum; with more, until a slot frees once they have all started."""
    slots = max(int(slots), 1)
    free = [0.0] * slots  # when each slot is free
    for work in remaining_s:
        heapq.heapreplace(free, free[0] + max(work, 0.0))
    return free[0]


class HeldPrompts:
    """The prompts an endpoint's prefix cache is predicted to hold: the last ``capacity`` sent
    to it (one per slot on llama.cpp; llama-cpp-python's server holds the last one). Recorded
    when a request is sent — a request queued behind others finds the cache as the last one
    ahead of it left it — and forgotten if it failed before the server took it."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(int(capacity), 1)
        self._prompts: deque[tuple[int, tuple[int, ...]]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._prompts)

    def hold(self, key: int, tokens: Sequence[int]) -> None:
        """``tokens`` were sent (``key``: the request; holding it again replaces its prompt)."""
        with self._lock:
            kept = [(k, t) for k, t in self._prompts if k != key]
            kept.append((key, tuple(tokens)))
            self._prompts = deque(kept[-self.capacity :])

    def forget(self, key: int) -> None:
        with self._lock:
            self._prompts = deque((k, t) for k, t in self._prompts if k != key)

    def cached(self, tokens: Sequence[int]) -> int:
        """The longest prefix of ``tokens`` a held prompt shares (leaving one token to evaluate)."""
        with self._lock:
            prompts = [t for _, t in self._prompts]
        return max((reusable_prefix_len(p, tokens) for p in prompts), default=0)


@attrs.define
class Health:
    """Whether an endpoint is in rotation. A failure takes it out (``down``) until ``retry_at``;
    a probe then puts it back (``up``) or doubles the wait (``probe_failed``), up to ``max_s``."""

    after_s: float = 1.0
    max_s: float = 30.0
    down_since: float | None = None
    retry_at: float = 0.0
    backoff_s: float = 0.0
    failures: int = 0
    last_error: str | None = None
    probing: bool = False

    @property
    def is_up(self) -> bool:
        return self.down_since is None

    def down(self, now: float, error: str) -> None:
        if self.down_since is None:
            self.down_since = now
            self.backoff_s = self.after_s
        self.failures += 1
        self.last_error = error
        self.retry_at = now + self.backoff_s

    def probe_due(self, now: float) -> bool:
        return self.down_since is not None and not self.probing and now >= self.retry_at

    def probe_failed(self, now: float, error: str) -> None:
        self.backoff_s = min(max(self.backoff_s * 2.0, self.after_s), self.max_s)
        self.last_error = error
        self.retry_at = now + self.backoff_s

    def up(self) -> None:
        self.down_since = None
        self.backoff_s = 0.0
        self.retry_at = 0.0

