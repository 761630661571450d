"""Chat messages (OpenAI-style dicts, never mutated) and RAG chunks: validation before anything is
planned or sent, turns, and where chunks go in the prompt."""

from __future__ import annotations

import json
import math
import numbers
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidChunkError, InvalidInputError, InvalidMessageError, finite

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
SYSTEM_ROLES = frozenset({"system", "developer"})

#: how chunks (each rendered with ``rag_chunk_template``: ``{id}``, ``{text}``, ``{n}``) go before the question
DEFAULT_RAG_TEMPLATE = "Use the following retrieved context to answer.\n\n{chunks}\n\nQuestion: {question}"
DEFAULT_RAG_CHUNK_TEMPLATE = "[{id}] {text}"


def _score(value: Any) -> float | None:
    """A retriever's score (FAISS: numpy float32) as a finite float, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidChunkError(f"chunk score must be a finite number or None, got {type(value).__name__}")
    return finite(value if isinstance(value, int) else float(value), "chunk score", error=InvalidChunkError)


def _check_id(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidChunkError(f"chunk id must be a str or None, got {type(value).__name__}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_utf8(text: Any, where: str, error: type[Exception] = InvalidMessageError) -> None:
    """Raise ``error`` if ``text`` holds a lone surrogate (valid JSON, but not encodable as UTF-8)."""
    if isinstance(text, str) and (m := _SURROGATE.search(text)) is not None:
        raise error(f"{where} holds a lone surrogate at character {m.start()} (not encodable as UTF-8)")


def _check_text(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise InvalidChunkError(f"chunk text must be a str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidChunkError("chunk text is empty")
    _check_utf8(value, "chunk text", InvalidChunkError)


@attrs.frozen
class Chunk:
    """One retrieved passage for RAG: ``score`` is the caller's relevance (None: BM25 against the
    question); ``label`` is what the prompt shows as ``{id}`` (None: ``id``)."""

    text: str = attrs.field(validator=_check_text)
    score: float | None = attrs.field(default=None, converter=_score)
    id: str | None = attrs.field(default=None, validator=_check_id)
    metadata: Mapping[str, Any] = attrs.field(factory=dict, eq=False, hash=False)
    label: str | None = attrs.field(default=None, eq=False, hash=False, repr=False, kw_only=True)

    @property
    def shown_id(self) -> str | None:
        return self.id if self.label is None else self.label


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, Mapping))


def validate_params(params: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidInputError` for call parameters no engine can take: ``tools`` that are not
    a list of JSON objects, a number that is NaN or infinite."""
    if not isinstance(params, Mapping):
        raise InvalidInputError(f"params must be a mapping, got {type(params).__name__}")
    for name, value in params.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInputError(f"{name} must be a finite number, got {value!r}")
    tools = params.get("tools")
    if tools is None:
        return
    if not _is_list(tools):
        raise InvalidInputError(f"tools must be a list of dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidInputError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
        try:
            text = json.dumps(tool, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidInputError(f"tools[{i}] is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
        _check_utf8(text, f"tools[{i}]", InvalidInputError)


def coerce_chunks(chunks: Any) -> tuple[Chunk, ...]:
    """Validate ``rag_chunks`` (strings, :class:`Chunk`, or dicts with ``text``) into Chunks with ids."""
    if chunks is None:
        return ()
    if not _is_list(chunks):
        raise InvalidChunkError(f"rag_chunks must be a list of str or Chunk, got {type(chunks).__name__}")
    out: list[Chunk] = []
    seen: set[str] = set()
    for i, c in enumerate(chunks):
        if isinstance(c, (str, Mapping)):
            c = {"text": c} if isinstance(c, str) else c
            if "text" not in c:
                raise InvalidChunkError(f"rag_chunks[{i}] has no 'text'")
            try:
                c = Chunk(text=c["text"], score=c.get("score"), id=None if c.get("id") is None else str(c["id"]))
            except InvalidChunkError as exc:
                raise InvalidChunkError(f"rag_chunks[{i}]: {exc}") from None
        elif not isinstance(c, Chunk):
            raise InvalidChunkError(f"rag_chunks[{i}] must be str, Chunk or dict, got {type(c).__name__}")
        # a chunk without an id is "chunk-i", shown as its position; a taken id gets "#i" until it is unique
        cid, label = (c.id, c.label) if c.id is not None else (f"chunk-{i}", c.label or str(i + 1))
        while cid in seen:
            cid += f"#{i}"
        seen.add(cid)
        out.append(c if (cid, label) == (c.id, c.label) else attrs.evolve(c, id=cid, label=label))
    return tuple(out)


def tool_call_lines(message: Mapping[str, Any]) -> list[str]:
    """A message's tool calls (and legacy ``function_call``) as ``name(arguments)`` lines."""
    calls = [call.get("function") if isinstance(call, Mapping) else None for call in message.get("tool_calls") or ()]
    if message.get("function_call"):
        calls.append(message["function_call"])
    return [f"{fn.get('name', '')}({fn.get('arguments', '')})" for fn in calls if isinstance(fn, Mapping)]


def message_text(message: Mapping[str, Any]) -> str:
    """The text a message contributes to the prompt (content, text parts, tool calls)."""
    content = message.get("content")
    if type(content) is str and "tool_calls" not in message and "function_call" not in message:
        return content  # the common case, and the very same object: its hash stays cached
    if isinstance(content, list):
        parts = [part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)]
    else:
        parts = [content] if isinstance(content, str) else []
    return "\n".join(parts + tool_call_lines(message))


def _check_str(value: Any, where: str, *, optional: bool = False) -> None:
    if not isinstance(value, str) and not (optional and value is None):
        raise InvalidMessageError(f"{where} must be a str, got {type(value).__name__}")


def _check_function(fn: Any, where: str) -> None:
    if not isinstance(fn, Mapping):
        raise InvalidMessageError(f"{where} must be a dict with 'name' and 'arguments', got {type(fn).__name__}")
    _check_str(fn.get("name"), f"{where}.name")
    _check_str(fn.get("arguments", ""), f"{where}.arguments")  # JSON text


def _check_fields(m: Mapping[str, Any], where: str) -> None:
    """The tool fields and content parts of a message with a known role and a ``content``."""
    for key in ("name", "tool_call_id"):
        _check_str(m.get(key), f"{where}.{key}", optional=True)
    tool_calls = m.get("tool_calls")
    if tool_calls is not None and not _is_list(tool_calls):
        raise InvalidMessageError(f"{where}.tool_calls must be a list of dicts, got {type(tool_calls).__name__}")
    for j, call in enumerate(tool_calls or ()):
        here = f"{where}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise InvalidMessageError(f"{here} must be a dict, got {type(call).__name__}")
        for key in ("id", "type"):
            _check_str(call.get(key), f"{here}.{key}", optional=True)
        if "function" not in call:
            raise InvalidMessageError(f"{here} has no 'function'")
        _check_function(call["function"], f"{here}.function")
    if m.get("function_call") is not None:
        _check_function(m["function_call"], f"{where}.function_call")
    content, role = m["content"], m["role"]
    if content is None and not (role == "assistant" and (m.get("tool_calls") or m.get("function_call"))):
        raise InvalidMessageError(f"{where} ({role}) has content None")
    if content is not None and not isinstance(content, (str, list)):
        raise InvalidMessageError(f"{where} ({role}) content must be str, list of parts or None, got {type(content).__name__}")
    _check_utf8(content, f"{where} ({role}) content")
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if not isinstance(part, Mapping) or "type" not in part:
            raise InvalidMessageError(f"{where}.content[{j}] must be a dict with a 'type'")
        _check_str(part["type"], f"{where}.content[{j}].type")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise InvalidMessageError(f"{where}.content[{j}] is a text part without a str 'text'")
        _check_utf8(part.get("text"), f"{where}.content[{j}].text")


def validate_messages(messages: Any) -> None:
    """Raise :class:`InvalidMessageError` unless ``messages`` is a non-empty list of well-formed messages with a
    user message; content may be None only on an assistant message with tool calls."""
    if not _is_list(messages):
        raise InvalidMessageError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise InvalidMessageError("messages is empty: at least one user message is needed")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidMessageError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list role would make `in` raise TypeError
            what = "no 'role'" if role is None else f"unknown role {role!r} (expected one of {sorted(ROLES)})"
            raise InvalidMessageError(f"messages[{i}] has {what}")
        if "content" not in m:
            raise InvalidMessageError(f"messages[{i}] ({role}) has no 'content'")
        _check_fields(m, f"messages[{i}]")
    last_user_index(messages)


def last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    raise InvalidMessageError("messages has no user message")


def turn_spans(messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """The non-system history as turns, ``[start, end)`` spans from a user message to the next, so
    dropping a turn never orphans a tool result; messages before the first user message form their own."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for i, m in enumerate(messages):
        role = m.get("role")
        if start is not None and (role == "user" or role in SYSTEM_ROLES):
            spans.append((start, i))
            start = None
        if start is None and role not in SYSTEM_ROLES:
            start = i
    if start is not None:
        spans.append((start, len(messages)))
    return spans


def render_rag_question(question: str, chunks: Sequence[Chunk], template: str = DEFAULT_RAG_TEMPLATE,
                        chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE) -> str:
    """The last user message's new content with ``chunks`` placed before the question."""
    if not chunks:
        return question
    body = "\n\n".join(chunk_template.format(id=c.shown_id, text=c.text, n=n + 1) for n, c in enumerate(chunks))
    return template.format(chunks=body, question=question)


def in_prompt_order(chunks: Sequence[Chunk]) -> tuple[Chunk, ...]:
    """``chunks`` (ranked) in prompt order: the top one last, next to the question, which a small model
    answers from; the rest most relevant first (docs/design.md §3; the trial in docs/benchmarks.md)."""
    chunks = tuple(chunks)
    return (*chunks[1:], chunks[0]) if len(chunks) > 1 else chunks


def with_chunks(message: Mapping[str, Any], chunks: Sequence[Chunk], template: str, chunk_template: str) -> dict[str, Any]:
    """A copy of ``message`` with ``chunks`` placed before its question (in its first text part, or a new one)."""
    new = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        for p in parts:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                p["text"] = render_rag_question(p["text"], chunks, template, chunk_template)
                break
        else:
            parts.append({"type": "text", "text": render_rag_question("", chunks, template, chunk_template)})
        new["content"] = parts
    else:
        new["content"] = render_rag_question(content or "", chunks, template, chunk_template)
    return new


def append_text(message: Mapping[str, Any], text: str) -> dict[str, Any]:
    """A copy of ``message`` with ``text`` appended to its content (as a new part after a list of parts)."""
    new = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        new["content"] = [*content, {"type": "text", "text": text}]
    else:
        new["content"] = (content or "") + text
    return new


def _template_fields(template: str) -> set[str]:
    """The field names a format string uses (``{chunks!r:>5}`` and ``{chunks[0]}`` use ``chunks``)."""
    return {field.split(".", 1)[0].split("[", 1)[0] for _, field, _, _ in string.Formatter().parse(template) if field is not None}


def check_rag_templates(template: Any, chunk_template: Any) -> None:
    """Raise :class:`InvalidInputError` unless both RAG templates format cleanly and use the fields that
    carry text (``{chunks}``, ``{question}``; ``{text}``): else text would be dropped without a word."""
    specs = ((template, "rag_template", {"chunks": "", "question": ""}, ("chunks", "question")),
             (chunk_template, "rag_chunk_template", {"id": "", "text": "", "n": 1}, ("text",)))
    for value, label, fields, needed in specs:
        if not isinstance(value, str):
            raise InvalidInputError(f"{label} must be a str, got {type(value).__name__}")
        try:
            value.format(**fields)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise InvalidInputError(f"{label} must be a str using only {', '.join('{' + f + '}' for f in fields)}: {exc!r}") from None
        missing = [name for name in needed if name not in _template_fields(value)]
        if missing:
            lost = " and ".join("the question" if n == "question" else "the chunks' text" for n in missing)
            shown = value if len(value) <= 60 else value[:57] + "..."
            raise InvalidInputError(f"{label} {shown!r} has no {' or '.join('{' + n + '}' for n in missing)} field: {lost} would not be sent")
