"""Chat messages and RAG chunks: validation, turns, and where chunks go in the prompt.

trimkit takes OpenAI-style message dicts exactly as ``llama_cpp.Llama.create_chat_completion``
does, and never mutates them. Validation happens here, before anything is planned or sent.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidChunkError, InvalidInputError, InvalidMessageError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
SYSTEM_ROLES = frozenset({"system", "developer"})

#: How retrieved chunks are placed into the last user message. Chunks come before the question
#: (docs/design.md, §3 "The prompt layout": stable → volatile, the question last). Override with ``rag_template=``:
#: a format string with ``{chunks}`` and ``{question}``; each chunk is rendered with
#: ``rag_chunk_template`` (fields ``{id}``, ``{text}``, ``{n}``) and joined by a blank line.
DEFAULT_RAG_TEMPLATE = "Use the following retrieved context to answer.\n\n{chunks}\n\nQuestion: {question}"
DEFAULT_RAG_CHUNK_TEMPLATE = "[{id}] {text}"


def _score_to_float(value: Any) -> Any:
    """Retrievers return numpy scores (FAISS: float32): keep them as plain floats. Anything that
    is not a real number is left for :func:`_check_score` to refuse."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except (OverflowError, ValueError, TypeError):  # 10**400: left for _check_score to refuse
            return value
    return value


def _check_score(instance: Any, attribute: Any, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidChunkError(f"chunk score must be a finite number or None, got {type(value).__name__}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        shown = repr(value) if isinstance(value, float) else f"an int of {value.bit_length()} bits"
        raise InvalidChunkError(f"chunk score must be a finite number or None, got {shown}")


def _check_id(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidChunkError(f"chunk id must be a str or None, got {type(value).__name__}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (``"\\ud800"``: valid JSON, but no UTF-8 can carry it
    to a tokenizer or a server), or None."""
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def _check_text(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise InvalidChunkError(f"chunk text must be a str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidChunkError("chunk text is empty")
    if (at := lone_surrogate(value)) is not None:
        raise InvalidChunkError(f"chunk text holds a lone surrogate at character {at} (not encodable as UTF-8)")


@attrs.frozen
class Chunk:
    """One retrieved passage for RAG.

    ``score`` is the caller's relevance (higher is more relevant); without it trimkit scores
    chunks against the question itself (BM25). ``id`` names the chunk in reports and, as
    ``{id}``, in the prompt; chunks passed without one are named ``chunk-<index>`` in reports and
    shown by their 1-based place in ``rag_chunks`` (``[3] …``), as a person numbers sources, so
    the model never reads an id trimkit made up (``label``: what the prompt shows, None: ``id``).
    """

    text: str = attrs.field(validator=_check_text)
    score: float | None = attrs.field(default=None, converter=_score_to_float, validator=_check_score)
    id: str | None = attrs.field(default=None, validator=_check_id)
    metadata: Mapping[str, Any] = attrs.field(factory=dict, eq=False, hash=False)
    label: str | None = attrs.field(default=None, eq=False, hash=False, repr=False, kw_only=True)

    @property
    def shown_id(self) -> str | None:
        """What the prompt shows for ``{id}``: :attr:`label`, else :attr:`id`."""
        return self.id if self.label is None else self.label


def validate_params(params: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidInputError` for call parameters no engine can take: ``tools`` that
    are not a list of JSON objects (``tools=[object()]``), a number that is NaN or infinite
    (``max_tokens=nan``, ``temperature=inf``). Nothing is changed."""
    if not isinstance(params, Mapping):
        raise InvalidInputError(f"params must be a mapping, got {type(params).__name__}")
    for name, value in params.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInputError(f"{name} must be a finite number, got {value!r}")
    tools = params.get("tools")
    if tools is None:
        return
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidInputError(f"tools must be a list of dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidInputError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
        try:
            json.dumps(tool, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidInputError(f"tools[{i}] is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
        text = json.dumps(tool, ensure_ascii=False)
        if lone_surrogate(text) is not None:
            raise InvalidInputError(f"tools[{i}] holds a lone surrogate (not encodable as UTF-8)")


def coerce_chunks(chunks: Any) -> tuple[Chunk, ...]:
    """Validate ``rag_chunks`` (strings, :class:`Chunk`, or dicts with ``text``) into Chunks with ids."""
    if chunks is None:
        return ()
    if isinstance(chunks, (str, bytes, Mapping)) or not isinstance(chunks, Sequence):
        raise InvalidChunkError(f"rag_chunks must be a list of str or Chunk, got {type(chunks).__name__}")
    out: list[Chunk] = []
    seen: set[str] = set()
    for i, c in enumerate(chunks):
        if isinstance(c, Chunk):
            chunk = c if c.id is not None else attrs.evolve(c, id=f"chunk-{i}", label=c.label or str(i + 1))
        elif isinstance(c, str):
            try:
                chunk = Chunk(text=c, id=f"chunk-{i}", label=str(i + 1))
            except InvalidChunkError as exc:
                raise InvalidChunkError(f"rag_chunks[{i}]: {exc}") from None
        elif isinstance(c, Mapping):
            if "text" not in c:
                raise InvalidChunkError(f"rag_chunks[{i}] has no 'text'")
            try:
                cid = c.get("id")
                chunk = Chunk(text=c["text"], score=c.get("score"), id=f"chunk-{i}" if cid is None else str(cid),
                              label=str(i + 1) if cid is None else None)
            except InvalidChunkError as exc:
                raise InvalidChunkError(f"rag_chunks[{i}]: {exc}") from None
        else:
            raise InvalidChunkError(f"rag_chunks[{i}] must be str, Chunk or dict, got {type(c).__name__}")
        assert chunk.id is not None
        if chunk.id in seen:
            # "a#2" may itself be taken (ids "a#2", "a", "a"): extend until the id is unique
            unique = f"{chunk.id}#{i}"
            while unique in seen:
                unique += f"#{i}"
            chunk = attrs.evolve(chunk, id=unique)
        seen.add(chunk.id)  # type: ignore[arg-type]
        out.append(chunk)
    return tuple(out)


def message_text(message: Mapping[str, Any]) -> str:
    """The text a message contributes to the prompt (content, text parts, tool calls)."""
    content = message.get("content")
    if type(content) is str and "tool_calls" not in message and "function_call" not in message:
        return content  # the common case, and the very same object: its hash stays cached
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
    calls = [call.get("function", {}) if isinstance(call, Mapping) else {} for call in message.get("tool_calls") or ()]
    if message.get("function_call"):
        calls.append(message["function_call"])
    parts += [f"{fn.get('name', '')}({fn.get('arguments', '')})" for fn in calls]
    return "\n".join(parts)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, Mapping))


def _check_function(fn: Any, where: str) -> None:
    """A tool call's ``function`` (or a legacy ``function_call``): a dict with a str ``name`` and
    a str ``arguments`` (JSON text) when there is one."""
    if not isinstance(fn, Mapping):
        raise InvalidMessageError(f"{where} must be a dict with 'name' and 'arguments', got {type(fn).__name__}")
    if not isinstance(fn.get("name"), str):
        raise InvalidMessageError(f"{where}.name must be a str, got {type(fn.get('name')).__name__}")
    if "arguments" in fn and not isinstance(fn["arguments"], str):
        raise InvalidMessageError(f"{where}.arguments must be a str (JSON text), got {type(fn['arguments']).__name__}")


def _check_tool_fields(m: Mapping[str, Any], where: str) -> None:
    """``tool_calls``, ``function_call``, ``name`` and ``tool_call_id``, where present and not None."""
    for key in ("name", "tool_call_id"):
        value = m.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidMessageError(f"{where}.{key} must be a str, got {type(value).__name__}")
    tool_calls = m.get("tool_calls")
    if tool_calls is not None:
        if not _is_list(tool_calls):
            raise InvalidMessageError(f"{where}.tool_calls must be a list of dicts, got {type(tool_calls).__name__}")
        for j, call in enumerate(tool_calls):
            here = f"{where}.tool_calls[{j}]"
            if not isinstance(call, Mapping):
                raise InvalidMessageError(f"{here} must be a dict, got {type(call).__name__}")
            for key in ("id", "type"):
                if call.get(key) is not None and not isinstance(call[key], str):
                    raise InvalidMessageError(f"{here}.{key} must be a str, got {type(call[key]).__name__}")
            if "function" not in call:
                raise InvalidMessageError(f"{here} has no 'function'")
            _check_function(call["function"], f"{here}.function")
    if m.get("function_call") is not None:
        _check_function(m["function_call"], f"{where}.function_call")


def validate_messages(messages: Any) -> None:
    """Raise :class:`InvalidMessageError` unless ``messages`` is a usable chat message list.

    Rules: a non-empty list of dicts; each has a known ``role``; ``content`` is a str or a list
    of parts (dicts with a str ``type``; a ``"text"`` part has a str ``text``), and may be None
    only for an assistant message carrying ``tool_calls`` or ``function_call``; ``tool_calls``
    is a list of dicts whose ``function`` is a dict with a str ``name`` and str ``arguments``,
    ``function_call`` likewise; ``name`` and ``tool_call_id`` are str; there is at least one
    user message. Nothing is changed.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidMessageError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise InvalidMessageError("messages is empty: at least one user message is needed")
    has_user = False
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidMessageError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role is None:
            raise InvalidMessageError(f"messages[{i}] has no 'role'")
        if not isinstance(role, str) or role not in ROLES:  # a list role would make `in` raise TypeError
            raise InvalidMessageError(f"messages[{i}] has unknown role {role!r} (expected one of {sorted(ROLES)})")
        if "content" not in m:
            raise InvalidMessageError(f"messages[{i}] ({role}) has no 'content'")
        _check_tool_fields(m, f"messages[{i}]")
        content = m["content"]
        if content is None:
            if not (role == "assistant" and (m.get("tool_calls") or m.get("function_call"))):
                raise InvalidMessageError(f"messages[{i}] ({role}) has content None")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or "type" not in part:
                    raise InvalidMessageError(f"messages[{i}].content[{j}] must be a dict with a 'type'")
                if not isinstance(part["type"], str):
                    raise InvalidMessageError(f"messages[{i}].content[{j}].type must be a str, got {type(part['type']).__name__}")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise InvalidMessageError(f"messages[{i}].content[{j}] is a text part without a str 'text'")
                if isinstance(part.get("text"), str) and (at := lone_surrogate(part["text"])) is not None:
                    raise InvalidMessageError(f"messages[{i}].content[{j}].text holds a lone surrogate at character {at} (not encodable as UTF-8)")
        elif isinstance(content, str):
            if (at := lone_surrogate(content)) is not None:
                raise InvalidMessageError(f"messages[{i}] ({role}) content holds a lone surrogate at character {at} (not encodable as UTF-8)")
        else:
            raise InvalidMessageError(
                f"messages[{i}] ({role}) content must be str, list of parts or None, got {type(content).__name__}"
            )
        if role == "user":
            has_user = True
    if not has_user:
        raise InvalidMessageError("messages has no user message")


def last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    raise InvalidMessageError("messages has no user message")


def turn_spans(messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """Split the non-system history into turns: ``[start, end)`` index spans.

    A turn starts at a user message and runs to the next user message, so an assistant reply
    with ``tool_calls`` and the ``tool`` results that answer it always share a turn — dropping
    or summarizing whole turns never orphans a tool result. Messages before the first user
    message (other than system ones) form a turn of their own.
    """
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in SYSTEM_ROLES:
            if start is not None:
                spans.append((start, i))
                start = None
            continue
        if role == "user" and start is not None:
            spans.append((start, i))
            start = i
        elif start is None:
            start = i
    if start is not None:
        spans.append((start, len(messages)))
    return spans


def render_rag_question(
    question: str,
    chunks: Sequence[Chunk],
    template: str = DEFAULT_RAG_TEMPLATE,
    chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE,
) -> str:
    """The last user message's new content with ``chunks`` placed before the question."""
    if not chunks:
        return question
    body = "\n\n".join(chunk_template.format(id=c.shown_id, text=c.text, n=n + 1) for n, c in enumerate(chunks))
    return template.format(chunks=body, question=question)


def in_prompt_order(chunks: Sequence[Chunk]) -> tuple[Chunk, ...]:
    """``chunks`` ranked most relevant first, in the order the prompt shows them: the most
    relevant one last, next to the question, and the rest most relevant first before it.

    A small model answers from the text nearest the question; ranked first to last, that text is
    the last chunk kept, which after a cut is a near distractor worded like the question. With the
    top chunk moved next to the question, the chunks a watched prefill has not evaluated yet are
    still the least relevant ones and the top one, so cutting them mid-prefill keeps the top one by
    its value (docs/design.md §3; the trial in docs/benchmarks.md)."""
    chunks = tuple(chunks)
    return (*chunks[1:], chunks[0]) if len(chunks) > 1 else chunks


def with_chunks(message: Mapping[str, Any], chunks: Sequence[Chunk], template: str, chunk_template: str) -> dict[str, Any]:
    """A copy of ``message`` (the last user message) with ``chunks`` placed before its question.

    String content is rewritten through ``template``; for a list of parts the first text part
    is, or a text part is appended. ``message`` itself is not modified."""
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
    """A copy of ``message`` with ``text`` appended to its content: to the string, or as a new
    text part after a list of parts. ``message`` itself is not modified."""
    new = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        new["content"] = [*content, {"type": "text", "text": text}]
    else:
        new["content"] = (content or "") + text
    return new


def _template_fields(template: str) -> set[str]:
    """The field names a format string uses (``{chunks!r:>5}`` and ``{chunks[0]}`` use ``chunks``)."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            names.add(field.split(".", 1)[0].split("[", 1)[0])
    return names


def check_rag_templates(template: Any, chunk_template: Any) -> None:
    """Raise :class:`~trimkit.errors.InvalidInputError` unless both RAG templates format cleanly
    and use the fields that carry text: ``{chunks}`` and ``{question}`` in ``rag_template``,
    ``{text}`` in ``rag_chunk_template`` (without them the chunks, or the question, would be
    dropped without a word while the report said nothing was removed)."""
    for value, label in ((template, "rag_template"), (chunk_template, "rag_chunk_template")):
        if not isinstance(value, str):
            raise InvalidInputError(f"{label} must be a str, got {type(value).__name__}")
    try:
        template.format(chunks="", question="")
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise InvalidInputError(f"rag_template must be a str using only {{chunks}} and {{question}}: {exc!r}") from None
    try:
        chunk_template.format(id="", text="", n=1)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise InvalidInputError(f"rag_chunk_template must be a str using only {{id}}, {{text}}, {{n}}: {exc!r}") from None
    for value, label, needed in ((template, "rag_template", ("chunks", "question")), (chunk_template, "rag_chunk_template", ("text",))):
        missing = [name for name in needed if name not in _template_fields(value)]
        if missing:
            lost = " and ".join("the question" if n == "question" else "the chunks' text" for n in missing)
            shown = value if len(value) <= 60 else value[:57] + "..."
            raise InvalidInputError(
                f"{label} {shown!r} has no {' or '.join('{' + n + '}' for n in missing)} field: {lost} would not be sent"
            )
