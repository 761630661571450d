"""LangChain documents as trimkit chunks, and retrieved context found again inside a prompt.

Two ways bring retrieved documents to trimkit in a LangChain pipeline:

- **Passed with the call**: ``model.invoke(messages, rag_chunks=[Document, ...])``.
  :func:`as_chunks` turns each ``Document`` into a :class:`~trimkit.messages.Chunk`: its
  ``page_content`` is the text, its id is ``Document.id`` (else the metadata's ``id``,
  ``doc_id``, ``chunk_id`` or ``document_id``), its score the metadata's ``score``,
  ``relevance_score``, ``similarity_score`` or ``similarity`` — the keys retrievers and
  rerankers put there (higher = more relevant; a distance is not a score and is not read).
  trimkit's own ``Chunk``, plain strings and ``{"text", "id", "score"}`` dicts pass as they are.
- **Through the prompt's context variable**: ``{"context": retriever | trimkit_context(), ...}
  | prompt | model``. :func:`trimkit_context` formats the documents as trimkit formats chunks
  (``"[id] text"`` blocks, blank lines between) and remembers which documents made that text.
  When a prompt reaches a trimkit step (:class:`~trimkit.integrations.langchain.TrimmedChatModel`
  or :func:`~trimkit.integrations.langchain.trimkit_trimmer`), :func:`find_context` looks for a
  remembered text in its last user message: the documents become chunks again, the message keeps
  the text around them, and the chunks kept go back where the context was (most relevant first).
  A context formatted any other way (your own ``format_docs``) is plain text to trimkit: it is
  sent as it is, never cut.

The documents and messages passed in are read, never changed.
"""

from __future__ import annotations

import collections
import numbers
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidChunkError
from trimkit.messages import DEFAULT_RAG_CHUNK_TEMPLATE, Chunk, check_rag_templates, coerce_chunks, last_user_index, render_rag_question

__all__ = [
    "SCORE_KEYS",
    "ID_KEYS",
    "ContextMatch",
    "as_chunks",
    "document_chunk",
    "render_context",
    "trimkit_context",
    "find_context",
]

#: metadata keys read as a document's relevance score, in this order (higher = more relevant)
SCORE_KEYS = ("score", "relevance_score", "similarity_score", "similarity")
#: metadata keys read as a document's id when ``Document.id`` is empty, in this order
ID_KEYS = ("id", "doc_id", "chunk_id", "document_id")
#: how many formatted contexts are remembered (the most recent); a context is found again only
#: while it is remembered — a prompt is formatted and sent within the same chain call
MAX_REMEMBERED = 256

_BODY_ONLY = "{chunks}{question}"  # renders the chunks alone (the question is empty)


def _is_document(value: Any) -> bool:
    """A LangChain ``Document`` (or anything shaped like one: ``page_content`` and ``metadata``)."""
    return isinstance(getattr(value, "page_content", None), str) and isinstance(getattr(value, "metadata", None), Mapping)


def document_chunk(doc: Any, index: int = 0) -> Chunk:
    """One LangChain ``Document`` as a :class:`~trimkit.messages.Chunk` (id and score as the
    module docstring says). Raises :class:`~trimkit.errors.InvalidChunkError` for an empty text
    or a score that is not a finite number."""
    meta: Mapping[str, Any] = doc.metadata
    doc_id = getattr(doc, "id", None)
    if doc_id in (None, ""):
        doc_id = next((meta[k] for k in ID_KEYS if meta.get(k) not in (None, "")), None)
    score = next((meta[k] for k in SCORE_KEYS if meta.get(k) is not None), None)
    if score is not None and (isinstance(score, bool) or not isinstance(score, numbers.Real)):
        raise InvalidChunkError(f"rag_chunks[{index}]: metadata score {score!r} is not a number")
    try:
        return Chunk(text=doc.page_content, score=score, id=None if doc_id is None else str(doc_id))
    except InvalidChunkError as exc:
        raise InvalidChunkError(f"rag_chunks[{index}]: {exc}") from None


def as_chunks(documents: Any) -> tuple[Chunk, ...]:
    """``rag_chunks`` as trimkit takes them: Documents converted, the rest (``Chunk``, ``str``,
    dicts with ``text``) as given; then validated, with ids made unique
    (:func:`~trimkit.messages.coerce_chunks`). None → no chunks."""
    if documents is None:
        return ()
    if isinstance(documents, (str, bytes, Mapping)) or _is_document(documents) or not isinstance(documents, Sequence):
        raise InvalidChunkError(f"rag_chunks must be a list of Documents (or str / trimkit.Chunk), got {type(documents).__name__}")
    return coerce_chunks([document_chunk(d, i) if _is_document(d) else d for i, d in enumerate(documents)])


def render_context(chunks: Sequence[Chunk], chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE) -> str:
    """The chunks as trimkit places them in a prompt: each through ``chunk_template``, blank lines between."""
    return render_rag_question("", chunks, _BODY_ONLY, chunk_template)


@attrs.frozen
class ContextMatch:
    """A remembered context found in a request's last user message.

    ``messages`` is the request with that message's context taken out (a new list and a new
    message; the rest are the caller's objects); ``rag_template`` puts the chunks back where the
    context was, and renders the text around it alone when no chunk is kept."""

    messages: list[Mapping[str, Any]]
    chunks: tuple[Chunk, ...]
    rag_template: str
    rag_chunk_template: str


class _Contexts:
    """The recently formatted contexts: text → (chunks, chunk template), most recent last."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.items: collections.OrderedDict[str, tuple[tuple[Chunk, ...], str]] = collections.OrderedDict()

    def remember(self, text: str, chunks: tuple[Chunk, ...], chunk_template: str) -> None:
        with self.lock:
            self.items[text] = (chunks, chunk_template)
            self.items.move_to_end(text)
            while len(self.items) > self.size:
                self.items.popitem(last=False)

    def find(self, content: str) -> tuple[str, tuple[Chunk, ...], str] | None:
        with self.lock:
            entries = list(self.items.items())
        for text, (chunks, chunk_template) in reversed(entries):  # the longest match would be safer, the newest is the usual
            if text in content:
                return text, chunks, chunk_template
        return None


_CONTEXTS = _Contexts(MAX_REMEMBERED)


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def format_documents(documents: Any, chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE) -> str:
    """Documents (a list, or one) as the context text of a prompt, remembered for
    :func:`find_context`. No documents → ``""`` (nothing remembered)."""
    docs = [documents] if _is_document(documents) else documents
    chunks = as_chunks(docs)
    if not chunks:
        return ""
    text = render_context(chunks, chunk_template)
    _CONTEXTS.remember(text, chunks, chunk_template)
    return text


def trimkit_context(chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE) -> Any:
    """An LCEL step formatting retrieved documents for a prompt's context variable so that a
    trimkit step later in the chain finds them again and can drop or cut them — use it where a
    chain has ``format_docs``::

        chain = {"context": retriever | trimkit_context(), "question": RunnablePassthrough()} | prompt | model

    ``chunk_template`` formats each document (``{id}``, ``{text}``, ``{n}``); it must be the
    trimkit step's ``rag_chunk_template`` (both default to ``"[{id}] {text}"``)."""
    from langchain_core.runnables import RunnableLambda

    check_rag_templates("{chunks}{question}", chunk_template)
    return RunnableLambda(lambda docs: format_documents(docs, chunk_template), name="trimkit_context")


def find_context(messages: Sequence[Mapping[str, Any]]) -> ContextMatch | None:
    """The remembered context in the last user message of ``messages`` (string content), or None.

    The message keeps the text before and after the context; the returned ``rag_template``
    renders ``before + chunks + after`` when chunks are kept and ``before + after`` (the
    question trimkit ranks the chunks against) when none is."""
    i = last_user_index(messages)
    content = messages[i].get("content")
    if not isinstance(content, str):
        return None
    found = _CONTEXTS.find(content)
    if found is None:
        return None
    text, chunks, chunk_template = found
    before, after = content.split(text, 1)
    template = _escape(before) + "{chunks}" + _escape(after) + "{question:.0}"
    out = list(messages)
    out[i] = {**messages[i], "content": before + after}
    return ContextMatch(messages=out, chunks=chunks, rag_template=template, rag_chunk_template=chunk_template)
