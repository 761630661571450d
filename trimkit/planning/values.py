"""What each piece of a request is worth: the *value* side of value per predicted second.

The planner (:mod:`trimkit.planning.engine`) keeps the set of history turns, summaries, retrieved chunks
and chunk excerpts with the most value whose predicted TTFT fits the budget. This module says
what those values are. A :class:`ValueModel` holds the knobs; :func:`chunk_values` and
:func:`turn_values` apply them to one request.

Chunks. Relevance ``r`` in ``[0, 1]`` is the lexical match with the question (BM25 over the
chunk and its best sentence, :func:`~trimkit.planning.relevance.chunk_relevance`), fused with the caller's
scores when every chunk has one (``lexical_weight`` for the lexical side), else blended with
the retriever's order (the order the caller passed; ``order_weight``). A chunk is worth ``chunk_weight * r ** relevance_power /
log2(rank + 2)``: with the default power 2 a chunk half as relevant is worth a quarter as much,
because the answer to a question over retrieved text usually sits in the top few chunks, and a
pile of weak chunks must not outvote the best one; the rank discount (as in DCG) gives
diminishing returns to many similar chunks.

Turns. An earlier turn is worth ``history_weight * recency * (1 + relevance) / 2``, where
``recency`` halves every ``recency_half_life_turns`` turns back and ``relevance`` is the turn's
BM25 match with the question (normalised over the turns). With the defaults the most relevant
chunk outranks any single old turn — the question asked over retrieved text is answered from the
text; set ``history_weight`` higher for chats whose history matters more than their retrieval.

A summary standing in for turns is worth ``summary_share`` of the turns it covers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidNumberError
from trimkit.messages import Chunk, message_text
from trimkit.planning.relevance import bm25_scores, chunk_relevance
from trimkit.validation import non_negative_finite, positive_finite

__all__ = ["ValueModel", "chunk_values", "turn_values"]


def _non_negative(instance: Any, attribute: Any, value: Any) -> None:
    non_negative_finite(value, attribute.name)


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    positive_finite(value, attribute.name)


def _share(instance: Any, attribute: Any, value: Any) -> None:
    if not 0.0 <= non_negative_finite(value, attribute.name) <= 1.0:
        raise InvalidNumberError(f"{attribute.name} must be within [0, 1], got {value!r}")


@attrs.frozen
class ValueModel:
    """How much each kind of content is worth when the budget forces a choice.

    Use it (``plan(..., values=ValueModel(history_weight=1.0))`` or ``wrap(..., values=...)``)
    when the defaults weigh history and retrieval differently from your application.
    """

    chunk_weight: float = attrs.field(default=1.0, validator=_non_negative)
    history_weight: float = attrs.field(default=0.25, validator=_non_negative)
    relevance_power: float = attrs.field(default=2.0, validator=_positive)
    recency_half_life_turns: float = attrs.field(default=4.0, validator=_positive)
    summary_share: float = attrs.field(default=0.5, validator=_share)
    #: weight of the retriever's order against the lexical match when chunks carry no scores
    order_weight: float = attrs.field(default=0.25, validator=_share)
    #: weight of the lexical match fused into the caller's scores (0: the scores alone)
    lexical_weight: float = attrs.field(default=0.5, validator=_share)


def chunk_values(chunks: Sequence[Chunk], question: str, model: ValueModel) -> dict[str, float]:
    """Value of each chunk, by id: ``chunk_weight * r ** relevance_power / log2(rank + 2)``.

    The rank discount (rank 0 is the most relevant, as in DCG) gives diminishing returns: the
    tenth of ten near-identical chunks adds less than the first."""
    rel = chunk_relevance(chunks, question, model.order_weight, model.lexical_weight)
    order = sorted(range(len(chunks)), key=lambda i: (-rel[i], i))
    rank = {i: r for r, i in enumerate(order)}
    return {
        str(c.id): model.chunk_weight * r**model.relevance_power / math.log2(rank[i] + 2)
        for i, (c, r) in enumerate(zip(chunks, rel, strict=True))
    }


def turn_values(
    messages: Sequence[Mapping[str, Any]], turns: Sequence[tuple[int, int]], question: str, model: ValueModel
) -> list[float]:
    """Value of each history turn (``[start, end)`` spans, oldest first)."""
    if not turns:
        return []
    texts = ["\n".join(message_text(messages[i]) for i in range(s, e)) for s, e in turns]
    bm25 = bm25_scores(question, texts)
    top = max(bm25)
    rel = [b / top if top > 0 else 0.0 for b in bm25]
    n = len(turns)
    out = []
    for j in range(n):
        age = n - j  # the newest history turn has age 1
        recency = math.pow(0.5, (age - 1) / model.recency_half_life_turns)
        out.append(model.history_weight * recency * (1.0 + rel[j]) / 2.0)
    return out
