"""Excerpts: the sentences of a retrieved chunk that best match the question, with their neighbours.

When a whole chunk does not fit the budget, the planner may keep an excerpt of it instead. An
excerpt keeps, in the chunk's own order, the sentences that share the most (IDF-weighted)
words with the question, each with one neighbour on either side. The model reads it as a person
would read a quotation with gaps: an ellipsis (``…``) stands where sentences were left out —
before the first kept span, between spans and after the last — and nothing else is added, so
there is no bookkeeping text for the model to copy into its answer. The
:class:`~trimkit.messages.Chunk` keeps its id; its ``metadata["excerpt"]`` holds the kept
sentence spans for reports (``spans`` 1-based inclusive, ``sentences`` in the whole chunk).

An excerpt is worth a share of its chunk's value: ``0.75 * (share of the chunk's squared
question-match scores it keeps) + 0.25 * (share of the chunk's length it keeps)``. Squaring puts
the weight on the best-matching sentences, where an answer most likely is. A chunk whose sentences do
not match the question at all gets no excerpt (leading sentences would be as good a guess as
any, and no better than dropping it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from trimkit.messages import Chunk
from trimkit.planning.values import question_idf as text_idf
from trimkit.planning.values import sentence_score, split_sentences

__all__ = ["Excerpt", "question_idf", "excerpts_of", "index_runs", "span_label", "MIN_SENTENCES"]

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
    sentences: int


def question_idf(question: str, chunks: Sequence[Chunk]) -> dict[str, float]:
    """IDF over ``chunks`` of each content word of ``question`` (words in no chunk are left out)."""
    return text_idf(question, [c.text for c in chunks])


def index_runs(indices: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """``[1, 2, 3, 5]`` → ``((1, 3), (5, 5))``: the runs of consecutive indices, as inclusive ranges."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return tuple((a, b) for a, b in runs)


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
    """Up to ``max_excerpts`` excerpts of ``chunk``, shortest first, each shorter than the chunk.

    The first keeps the best-matching sentence and its neighbours; the next ones add the next
    best-matching sentences (with theirs), each at least :data:`GROWTH` times longer than the
    one before, so the sizes span from one passage to nearly the whole chunk. ``idf`` comes
    from :func:`question_idf`.
    """
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
        score_share = sum(scores[j] ** 2 for j in keep) / total_score
        length_share = sum(len(sentences[j]) for j in keep) / total_chars
        metadata = {**chunk.metadata, "excerpt": {"spans": [list(s) for s in spans], "sentences": n}}
        excerpt = attrs.evolve(chunk, text=text, metadata=metadata)
        out.append(Excerpt(excerpt, 0.75 * score_share + 0.25 * length_share, spans, n))
        if len(out) >= max_excerpts:
            break
    return out
