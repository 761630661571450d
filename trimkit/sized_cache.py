"""A least-recently-used cache bounded by the size of what it holds, not by its number of
entries: the text-keyed caches of a long-running service (token counts, BM25 term counts) stay
flat however long the texts are (20 KB retrieved chunks filled an entry-bounded cache of 8,192
to hundreds of MB). Thread-safe; no trimkit imports."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["SizedCache", "text_size"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def text_size(key: object) -> int:
    """The characters of a key: a string's length, a tuple's strings' lengths summed (plus a
    little for each entry's own overhead)."""
    if isinstance(key, str):
        return len(key) + 64
    if isinstance(key, tuple):
        return sum(text_size(k) for k in key)
    return 64


class SizedCache(Generic[K, V]):
    """At most ``max_size`` (the sum of ``size_of(key)`` over the entries; characters for text
    keys) and at most ``max_entries`` entries; the least recently used go first. An entry larger
    than a quarter of ``max_size`` is not kept at all (it would push out everything else)."""

    def __init__(self, max_size: int, *, max_entries: int | None = None, size_of: Callable[[K], int] = text_size) -> None:
        self.max_size = int(max_size)
        self.max_entries = max_entries
        self._size_of = size_of
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def size(self) -> int:
        """What the entries hold now (in ``size_of`` units)."""
        with self._lock:
            return self._size

    def get(self, key: K) -> V | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key: K, value: V) -> None:
        size = self._size_of(key)
        if size > self.max_size // 4:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._entries[key] = (value, size)
            self._size += size
            while self._entries and (self._size > self.max_size or (self.max_entries is not None and len(self._entries) > self.max_entries)):
                _, (_, dropped) = self._entries.popitem(last=False)
                self._size -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._size = 0
