"""What each piece of a request is worth (docs/design.md §3), from its lexical relevance to the question (BM25, or a
retriever's scores where every chunk has one), weighed by a :class:`ValueModel`: a chunk ``chunk_weight · r^relevance_power
/ log2(rank + 2)``; a history turn ``history_weight · recency · (1 + relevance) / 2``, recency halving every
``recency_half_life_turns``; a summary ``summary_share`` of the turns it covers; an excerpt ``0.75 · (share of the squared
sentence scores kept) + 0.25 · (share of the length kept)``.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidNumberError, attrs_non_negative, non_negative_finite, positive_finite
from trimkit.messages import Chunk, message_text
from trimkit.planning.tokens import SizedCache

#: kept short: BM25's IDF already discounts frequent words; these would dominate short questions
STOPWORDS = frozenset(
    "a an and are as at be by can could did do does for from had has have how i if in into is it its "
    "me my of on or our she he so than that the their them then there these they this to was we were "
    "what when where which who why will with would you your".split()
)
_WORD = re.compile(r"\w+", re.UNICODE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
#: a truncation stemmer ("settlement", "settled" → "settl"): about as good as Porter's for English
STEM_CHARS = 5


def words(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` without stopwords, cut to :data:`STEM_CHARS` characters (the unit BM25 counts)."""
    return [w[:STEM_CHARS] for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


#: word counts of recent documents, bounded by their characters (20 KB chunks stay flat)
_TERM_COUNTS: SizedCache[str, Counter[str]] = SizedCache(8 << 20, max_entries=1 << 16)


def _term_counts(text: str) -> Counter[str]:
    """Word counts of a document, cached (the same chunks come back); callers must not modify it."""
    return _TERM_COUNTS.get_or_put(text, lambda: Counter(words(text)))


def bm25_scores(query: str, documents: Sequence[str], *, k1: float = 1.5, b: float = 0.75) -> list[float]:
    """Okapi BM25 score of each document against ``query`` (higher is more relevant)."""
    docs = [_term_counts(d) for d in documents]
    if not docs:
        return []
    lengths = [sum(d.values()) for d in docs]
    avg_len = (sum(lengths) / len(docs)) or 1.0
    scores = [0.0] * len(docs)
    for term, idf in text_idf(query, documents).items():
        for i, d in enumerate(docs):
            tf = d.get(term, 0)
            if tf:
                scores[i] += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths[i] / avg_len))
    return scores


def split_sentences(text: str) -> list[str]:
    """``text`` cut into sentences (after ``.``, ``!`` or ``?`` followed by space, and at line breaks)."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def chunk_relevance(chunks: Sequence[Chunk], question: str, order_weight: float = 0.25, lexical_weight: float = 0.5) -> list[float]:
    """Relevance of each chunk in ``[0, 1]``, in the caller's order: half BM25, half its best sentence, fused with the
    caller's scores (``lexical_weight``) or, without them, blended with the retriever's order (``order_weight``)."""
    if not chunks:
        return []
    return list(_relevance(tuple((c.text, c.score) for c in chunks), question, order_weight, lexical_weight))


@functools.lru_cache(maxsize=8)  # a request ranks, then values, the same chunks
def _relevance(chunks: tuple[tuple[str, float | None], ...], question: str, order_weight: float, lexical_weight: float) -> tuple[float, ...]:
    n = len(chunks)
    order = [1.0 - i / n for i in range(n)]
    texts = [t for t, _ in chunks]
    bm25 = bm25_scores(question, texts)
    idf = text_idf(question, texts)
    best_sentence = [max((sentence_score(s, idf) for s in split_sentences(t)), default=0.0) for t in texts]
    top, top_sentence = max(bm25), max(best_sentence)
    lexical = ([0.5 * b / top + 0.5 * (m / top_sentence if top_sentence > 0 else 0.0) for b, m in zip(bm25, best_sentence, strict=True)]
               if top > 0 else None)
    if all(score is not None for _, score in chunks):
        scores = _normalise([float(score) for _, score in chunks])  # type: ignore[arg-type]
        if lexical is None or lexical_weight <= 0:
            return tuple(scores)
        return tuple((1.0 - lexical_weight) * s + lexical_weight * x for s, x in zip(scores, lexical, strict=True))
    if lexical is None:
        return tuple(order)
    return tuple((1.0 - order_weight) * x + order_weight * o for x, o in zip(lexical, order, strict=True))


def text_idf(question: str, documents: Sequence[str]) -> dict[str, float]:
    """IDF over ``documents`` of each content word of ``question`` (words in none are left out)."""
    docs = [_term_counts(d) for d in documents]
    dfs = {t: sum(1 for d in docs if t in d) for t in set(words(question))}
    return {t: math.log(1.0 + (len(docs) - df + 0.5) / (df + 0.5)) for t, df in dfs.items() if df}


def sentence_score(sentence: str, idf: Mapping[str, float]) -> float:
    """How well one sentence matches the question: the IDF of the question words it contains."""
    return sum(idf.get(w, 0.0) for w in set(words(sentence)))


def _normalise(scores: Sequence[float]) -> list[float]:
    lo, hi = min(scores), max(scores)
    if hi - lo <= 1e-12 * max(abs(hi), 1.0):
        return [1.0] * len(scores)
    return [(s - lo) / (hi - lo) for s in scores]


def _ranked(relevance: Sequence[float]) -> list[int]:
    return sorted(range(len(relevance)), key=lambda i: (-relevance[i], i))


def rank_chunks(chunks: Sequence[Chunk], question: str, order_weight: float = 0.25, lexical_weight: float = 0.5) -> tuple[Chunk, ...]:
    """``chunks`` ordered most relevant first (:func:`chunk_relevance`); ties keep the caller's order."""
    return tuple(chunks[i] for i in _ranked(chunk_relevance(chunks, question, order_weight, lexical_weight)))


def _share(instance: Any, attribute: Any, value: Any) -> None:
    if not 0.0 <= non_negative_finite(value, attribute.name) <= 1.0:
        raise InvalidNumberError(f"{attribute.name} must be within [0, 1], got {value!r}")


@attrs.frozen
class ValueModel:
    """How much each kind of content is worth when the budget forces a choice."""

    chunk_weight: float = attrs.field(default=1.0, validator=attrs_non_negative)
    history_weight: float = attrs.field(default=0.25, validator=attrs_non_negative)
    relevance_power: float = attrs.field(default=2.0, validator=lambda i, a, v: positive_finite(v, a.name))
    recency_half_life_turns: float = attrs.field(default=4.0, validator=lambda i, a, v: positive_finite(v, a.name))
    summary_share: float = attrs.field(default=0.5, validator=_share)
    #: weight of the retriever's order against the lexical match when chunks carry no scores
    order_weight: float = attrs.field(default=0.25, validator=_share)
    #: weight of the lexical match fused into the caller's scores (0: the scores alone)
    lexical_weight: float = attrs.field(default=0.5, validator=_share)


def chunk_values(chunks: Sequence[Chunk], question: str, model: ValueModel) -> dict[str, float]:
    """Value of each chunk, by id: ``chunk_weight * r ** relevance_power / log2(rank + 2)``."""
    rel = chunk_relevance(chunks, question, model.order_weight, model.lexical_weight)
    rank = {i: r for r, i in enumerate(_ranked(rel))}
    return {str(c.id): model.chunk_weight * r**model.relevance_power / math.log2(rank[i] + 2) for i, (c, r) in enumerate(zip(chunks, rel, strict=True))}


def turn_values(messages: Sequence[Mapping[str, Any]], turns: Sequence[tuple[int, int]], question: str, model: ValueModel) -> list[float]:
    """Value of each history turn (``[start, end)`` spans, oldest first)."""
    if not turns:
        return []
    texts = ["\n".join(message_text(messages[i]) for i in range(s, e)) for s, e in turns]
    bm25 = bm25_scores(question, texts)
    top = max(bm25)
    rel = [b / top if top > 0 else 0.0 for b in bm25]
    n = len(turns)  # the newest history turn has age 1: recency 1
    return [model.history_weight * math.pow(0.5, (n - j - 1) / model.recency_half_life_turns) * (1.0 + rel[j]) / 2.0 for j in range(n)]


#: chunks with fewer sentences are kept whole or dropped: an excerpt would hardly be shorter
MIN_SENTENCES = 4
#: neighbours kept on each side of a matching sentence
NEIGHBOURS = 1
#: each longer excerpt offered is at least this many times the length of the one before
GROWTH = 1.5


@attrs.frozen
class Excerpt:
    """One way to cut a chunk: the excerpt as a chunk, and the share of the chunk's value it keeps."""

    chunk: Chunk
    value_share: float
    spans: tuple[tuple[int, int], ...]  # 1-based inclusive sentence ranges


def index_runs(indices: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """``[1, 2, 3, 5]`` → ``((1, 3), (5, 5))``: the runs of consecutive indices, as inclusive ranges."""
    runs = (list(run) for _, run in itertools.groupby(enumerate(sorted(indices)), key=lambda pair: pair[1] - pair[0]))
    return tuple((run[0][1], run[-1][1]) for run in runs)


def span_label(spans: Sequence[Sequence[int]]) -> str:
    """``((4, 6), (9, 9))`` → ``"4–6, 9"``: ranges as the report names them."""
    return ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in spans)


#: what stands where sentences were left out
ELLIPSIS = "…"


def _render(sentences: Sequence[str], keep: Sequence[int]) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The kept sentences as text, an ellipsis wherever sentences were left out."""
    spans = tuple((a + 1, b + 1) for a, b in index_runs(keep))  # 1-based sentence numbers
    parts = [" ".join(sentences[a - 1 : b]) for a, b in spans]
    text = f" {ELLIPSIS} ".join(parts)
    if spans[0][0] > 1:
        text = f"{ELLIPSIS} {text}"
    if spans[-1][1] < len(sentences):
        text = f"{text} {ELLIPSIS}"
    return text, spans


def excerpts_of(chunk: Chunk, idf: Mapping[str, float], *, max_excerpts: int = 5) -> list[Excerpt]:
    """Up to ``max_excerpts`` excerpts of ``chunk``, shortest first, each shorter than the chunk."""
    sentences = split_sentences(chunk.text)
    n = len(sentences)
    if n < MIN_SENTENCES or not idf:
        return []
    scores = [sentence_score(s, idf) for s in sentences]
    total_score = sum(x * x for x in scores)
    if total_score <= 0:
        return []
    total_chars = sum(len(s) for s in sentences)
    ranked = [i for i in sorted(range(n), key=lambda i: (-scores[i], i)) if scores[i] > 0]
    keep: set[int] = set()
    out: list[Excerpt] = []
    last_chars = 0
    for i in ranked:
        grown = keep | set(range(max(0, i - NEIGHBOURS), min(n, i + NEIGHBOURS + 1)))
        if grown == keep:
            continue
        if len(grown) >= n - 1:  # nearly the whole chunk: keep it whole instead
            break
        keep = grown
        chars = sum(len(sentences[j]) for j in keep)
        if out and chars < GROWTH * last_chars:
            continue
        last_chars = chars
        text, spans = _render(sentences, sorted(keep))
        share = 0.75 * (sum(scores[j] ** 2 for j in keep) / total_score) + 0.25 * (chars / total_chars)
        metadata = {**chunk.metadata, "excerpt": {"spans": [list(s) for s in spans], "sentences": n}}
        out.append(Excerpt(attrs.evolve(chunk, text=text, metadata=metadata), share, spans))
        if len(out) >= max_excerpts:
            break
    return out
