"""The text caches of a long-running service stay flat with long texts (issue 34, item 7): token
counts (:class:`~trimkit.planning.tokens.PromptTokenizer`) and BM25 term counts are bounded by the
characters they hold, not only by their number of entries. Measured with ``tracemalloc`` after
thousands of distinct 20 KB texts: what the caches keep stays under their bound (the old
entry-bounded caches kept every text — tens of MB here, hundreds in a service)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from trimkit.planning.tokens import PromptTokenizer, SizedCache, chatml_render
from trimkit.planning.values import bm25_scores

TEXT_CHARS = 20_000
N_TEXTS = 1_000  # 20 M characters: more than twice any cache's bound (8 M characters)
#: what a test's caches may keep: the token counts' two caches of 8 M characters each (the old
#: ones kept 40 MB here: every text, and every message's text again with its template); the term
#: counts' one (the old one kept every text: 20 MB)
TOKEN_BOUND_BYTES = 24 << 20
TERM_BOUND_BYTES = 12 << 20


class _Words:
    """A tokenizer that counts words (the test is about what is kept, not about counting)."""

    name = "words"
    exact = True

    def encode(self, text: str) -> list[int]:
        return [0] * len(text.split())


def _texts():
    for i in range(N_TEXTS):
        yield f"document {i} " + ("lorem ipsum dolor sit amet " * (TEXT_CHARS // 27))


def _retained(fn) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fn()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.slow  # seconds: retries against dead ports, or thousands of inputs
def test_token_counts_of_thousands_of_long_texts_stay_within_the_bound():
    tok = PromptTokenizer(_Words(), chatml_render)

    def run() -> None:
        for text in _texts():
            assert tok.count(text) > 0
            tok.segment_counts([{"role": "user", "content": text}])

    assert _retained(run) < TOKEN_BOUND_BYTES
    assert tok.count("document 3 lorem") == 3  # still a cache that answers


@pytest.mark.slow  # seconds: retries against dead ports, or thousands of inputs
def test_bm25_term_counts_of_thousands_of_long_documents_stay_within_the_bound():
    def run() -> None:
        batch: list[str] = []
        for text in _texts():
            batch.append(text)
            if len(batch) == 50:
                assert len(bm25_scores("lorem document", batch)) == 50
                batch = []

    assert _retained(run) < TERM_BOUND_BYTES


def test_a_sized_cache_evicts_the_least_recently_used_by_size():
    cache: SizedCache[str, int] = SizedCache(1000, size_of=len)
    for i in range(10):
        cache.put(f"{i:03d}" * 50, i)  # 150 characters each
    assert cache.size <= 1000 and len(cache) == 6
    assert cache.get("000" * 50) is None and cache.get("009" * 50) == 9
    cache.put("x" * 400, -1)  # over a quarter of the bound: not kept
    assert cache.get("x" * 400) is None
