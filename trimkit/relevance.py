"""Lexical relevance: how well each RAG chunk matches the question, with BM25.

Use :func:`rank_chunks` to put retrieved chunks in the order :func:`~trimkit.strategies.cap_rag_chunks`
keeps them (most relevant first). When the caller's retriever already scored every chunk
(``Chunk.score``), those scores win; BM25 is the model-free fallback, cheap enough to run on
every request (a few microseconds per chunk). It is lexical only: it rewards shared words, not
shared meaning, so pass your retriever's scores when you have them.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Sequence

from trimkit.messages import Chunk

__all__ = ["STOPWORDS", "words", "bm25_scores", "rank_chunks"]

#: Very common English words that carry no topic. Kept short on purpose: BM25's IDF already
#: discounts frequent words; this list only removes the ones that dominate short questions.
STOPWORDS = frozenset(
    "a an and are as at be by can could did do does for from had has have how i if in into is it its "
    "me my of on or our she he so than that the their them then there these they this to was we were "
    "what when where which who why will with would you your".split()
)

_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` without stopwords (the unit BM25 counts)."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


@functools.lru_cache(maxsize=4096)
def _term_counts(text: str) -> Counter[str]:
    """Word counts of a document, cached: the same chunks come back request after request.
    Callers must not modify the returned Counter."""
    return Counter(words(text))


def bm25_scores(query: str, documents: Sequence[str], *, k1: float = 1.5, b: float = 0.75) -> list[float]:
    """Okapi BM25 score of each document against ``query`` (higher is more relevant).

    IDF is the non-negative Lucene form ``log(1 + (N - df + 0.5) / (df + 0.5))``, so a word that
    appears in every document still counts a little instead of going negative.
    """
    docs = [_term_counts(d) for d in documents]
    if not docs:
        return []
    lengths = [sum(d.values()) for d in docs]
    avg_len = (sum(lengths) / len(docs)) or 1.0
    n_docs = len(docs)
    scores = [0.0] * n_docs
    for term in set(words(query)):
        df = sum(1 for d in docs if term in d)
        if df == 0:
            continue
        idf = math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))
        for i, d in enumerate(docs):
            tf = d.get(term, 0)
            if tf:
                scores[i] += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths[i] / avg_len))
    return scores


def rank_chunks(chunks: Sequence[Chunk], question: str) -> tuple[Chunk, ...]:
    """``chunks`` ordered most relevant first; ties keep the caller's order.

    If every chunk carries a caller ``score``, those scores are used; otherwise every chunk is
    scored with BM25 against ``question`` (mixing two score scales would be meaningless).
    """
    if not chunks:
        return ()
    if all(c.score is not None for c in chunks):
        scores = [float(c.score) for c in chunks]  # type: ignore[arg-type]
    else:
        scores = bm25_scores(question, [c.text for c in chunks])
    order = sorted(range(len(chunks)), key=lambda i: (-scores[i], i))
    return tuple(chunks[i] for i in order)
