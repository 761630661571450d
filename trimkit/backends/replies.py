"""What an OpenAI-compatible server sent, parsed at the boundary: validated values, or one typed
error naming what was wrong. Pure functions, no I/O.

Every reply the HTTP backend reads goes through exactly one parser before any other code looks
at it, so past these modules the code trusts its types:

=============================  ==============================================  ===========================
reply                          parser                                          gives
=============================  ==============================================  ===========================
any JSON body or SSE event     :func:`~trimkit.backends.fields.load_json`      a JSON value nested at most
                                                                               ``MAX_JSON_DEPTH`` deep
a stream chunk                 :func:`parse_chunk`                             :class:`Reply`
a whole (non-streamed) answer  :func:`parse_completion`                        :class:`Reply`
its ``usage`` / ``timings``    (inside both)                                   :class:`~trimkit.backends.server_timings.ServerStats`
``/v1/models``                 :func:`~trimkit.backends.server_facts.parse_models`  :class:`~trimkit.backends.server_facts.ModelList`
``/props``, ``/version``, …    :func:`~trimkit.backends.server_facts.parse_props`, …  numbers and strings
``/tokenize``                  :func:`~trimkit.backends.server_facts.parse_tokens`  ``list[int]``
``/apply-template``            :func:`~trimkit.backends.server_facts.parse_template`  ``str``
a ``text/event-stream``        :func:`~trimkit.backends.sse.iter_events`       JSON events (bounded, in order)
an error status's body         :func:`error_message`                           ``str``
``Retry-After``                :func:`retry_after_s`                           ``float | None``
=============================  ==============================================  ===========================

The rules, the same everywhere:

- anything that is not what the protocol allows raises
  :class:`~trimkit.errors.MalformedReplyError` with ``.field`` set to where
  (``choices[0].delta``, ``usage.prompt_tokens``, ``tokens[3]``); a 200 body that is an error
  object (``{"error": {...}}``) raises :class:`~trimkit.errors.ServerError` with the server's message;
- ``null`` means "not said", like a missing field;
- only the fields trimkit reads are checked; every other field passes through untouched, and the
  caller receives the server's object itself (``Reply.raw``), never a copy trimkit changed;
- numbers are range-checked: token counts and ids ``0..2**31-1``, context sizes up to
  ``MAX_CONTEXT_TOKENS``, times finite (see :mod:`trimkit.backends.server_timings`);
- sizes are capped: a body at ``MAX_REPLY_BYTES``, one stream event at ``MAX_EVENT_BYTES``
  (:mod:`trimkit.backends.fields`).
"""

from __future__ import annotations

import datetime
import email.utils
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from trimkit.backends.fields import (
    as_object,
    describe,
    excerpt,
    fail,
    join_path,
    load_json,
    opt_int,
    opt_list,
    opt_mapping,
    opt_str,
)
from trimkit.backends.server_timings import ServerStats, parse_server_stats
from trimkit.errors import MalformedReplyError, ServerError

__all__ = [
    "Choice",
    "ToolCallPart",
    "Reply",
    "parse_chunk",
    "parse_completion",
    "error_message",
    "retry_after_s",
    "body_kind",
]

#: the most choices (``n``) and tool calls one reply may index
_MAX_INDEX = 1 << 16


def body_kind(content_type: str | None) -> str | None:
    """``"sse"``, ``"json"`` or None (anything else: HTML, XML, …) for a response's content type.
    A missing or ``text/plain`` content type is read as a stream (some servers send that)."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in ("", "text/event-stream", "text/plain"):
        return "sse"
    if kind == "application/json" or kind.endswith("+json"):
        return "json"
    return None


# -- chunks and completions ------------------------------------------------------------------------------
@attrs.frozen
class ToolCallPart:
    """One tool call (or a piece of one, in a stream)."""

    index: int | None = None
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None


@attrs.frozen
class Choice:
    """One choice of a chunk or a completion, as trimkit reads it (chat ``delta`` / ``message``,
    or the completions API's ``text``)."""

    index: int = 0
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    text: str | None = None
    tool_calls: tuple[ToolCallPart, ...] = ()
    function_call: bool = False
    finish_reason: str | None = None
    logprobs: tuple[Any, ...] | None = None  # ``logprobs.content`` entries, passed through

    @property
    def output(self) -> str | None:
        """The generated text this choice carries: ``""`` for a finish without text, None for a
        bare role delta. Tool calls and reasoning count: they are the first generated tokens."""
        if self.content:
            return self.content
        if self.reasoning:
            return self.reasoning
        if self.tool_calls or self.function_call:
            return "<tool_call>"
        if self.text:
            return self.text
        return "" if self.finish_reason else None


@attrs.frozen
class Reply:
    """A stream chunk or a whole completion, validated. ``raw`` is what the server (or the
    ``openai`` client) gave, unchanged: that is what the caller receives."""

    raw: Any = attrs.field(eq=False, repr=False)
    choices: tuple[Choice, ...] = ()
    stats: ServerStats = ServerStats()
    has_stats: bool = False
    usage: Mapping[str, Any] | None = None
    id: str | None = None
    model: str | None = None
    created: int | None = None
    system_fingerprint: str | None = None

    @property
    def output(self) -> str | None:
        """:attr:`Choice.output` of the first choice (None without choices)."""
        return self.choices[0].output if self.choices else None

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def usage_only(self) -> bool:
        """No choices, only ``usage``: the chunk ``stream_options.include_usage`` adds."""
        return not self.choices and self.usage is not None


def _tool_calls(holder: Mapping[str, Any], what: str, path: str) -> tuple[ToolCallPart, ...]:
    calls = opt_list(holder, "tool_calls", what, path)
    out = []
    for i, call in enumerate(calls or ()):
        where = join_path(join_path(path, "tool_calls"), i)
        if not isinstance(call, Mapping):
            fail(what, where, "an object", call)
        fn = opt_mapping(call, "function", what, where) or {}
        fn_path = join_path(where, "function")
        out.append(ToolCallPart(
            index=opt_int(call, "index", what, where, _MAX_INDEX),
            id=opt_str(call, "id", what, where),
            type=opt_str(call, "type", what, where),
            name=opt_str(fn, "name", what, fn_path),
            arguments=opt_str(fn, "arguments", what, fn_path),
        ))
    return tuple(out)


def _choice(raw: Any, position: int, what: str, holder_keys: tuple[str, ...]) -> Choice:
    path = f"choices[{position}]"
    if not isinstance(raw, Mapping):
        fail(what, path, "an object", raw)
    index = opt_int(raw, "index", what, path, _MAX_INDEX)
    holder: Mapping[str, Any] | None = None
    holder_path = path
    for key in holder_keys:
        found = opt_mapping(raw, key, what, path)
        if found is not None and holder is None:
            holder, holder_path = found, join_path(path, key)
    holder = holder or {}
    function_call = opt_mapping(holder, "function_call", what, holder_path)
    if function_call is not None:
        opt_str(function_call, "name", what, join_path(holder_path, "function_call"))
        opt_str(function_call, "arguments", what, join_path(holder_path, "function_call"))
    reasoning = opt_str(holder, "reasoning_content", what, holder_path)
    reasoning_alt = opt_str(holder, "reasoning", what, holder_path)
    logprobs = opt_mapping(raw, "logprobs", what, path)
    lp_content = opt_list(logprobs, "content", what, join_path(path, "logprobs")) if logprobs is not None else None
    return Choice(
        index=index if index is not None else position,
        role=opt_str(holder, "role", what, holder_path),
        content=opt_str(holder, "content", what, holder_path),
        reasoning=reasoning or reasoning_alt,
        text=opt_str(raw, "text", what, path),
        tool_calls=_tool_calls(holder, what, holder_path),
        function_call=bool(function_call),
        finish_reason=opt_str(raw, "finish_reason", what, path),
        logprobs=tuple(lp_content) if lp_content is not None else None,
    )


def _reply(obj: Any, what: str, *, whole: bool) -> Reply:
    data = as_object(obj, what)
    if "error" in data and data.get("error") is not None and data.get("choices") is None:
        message = error_message(data)
        raise ServerError(f"the server answered with an error instead of a {what}: {message}", status=200, server_message=message)
    raw_choices = opt_list(data, "choices", what, "")
    if raw_choices is None and whole:
        fail(what, "choices", "an array", data.get("choices"))
    keys = ("message", "delta") if whole else ("delta", "message")
    choices = tuple(_choice(c, i, what, keys) for i, c in enumerate(raw_choices or ()))
    stats = parse_server_stats(data, strict=True)
    has_stats = any(data.get(key) is not None for key in ("usage", "timings", "prompt_eval_count", "eval_count"))
    created = data.get("created")
    if created is not None:
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created < 2**40:  # NaN fails too
            fail(what, "created", "a Unix time", created)
        created = int(created)
    return Reply(
        raw=obj,
        choices=choices,
        stats=stats,
        has_stats=has_stats,
        usage=opt_mapping(data, "usage", what, ""),
        id=opt_str(data, "id", what, ""),
        model=opt_str(data, "model", what, ""),
        created=created,
        system_fingerprint=opt_str(data, "system_fingerprint", what, ""),
    )


def parse_chunk(obj: Any) -> Reply:
    """A stream chunk (dict or the ``openai`` client's chunk object). ``choices`` may be absent
    (a usage-only chunk); an ``{"error": ...}`` object raises ServerError."""
    if isinstance(obj, Reply):
        return obj
    return _reply(obj, "stream chunk", whole=False)


def parse_completion(obj: Any) -> Reply:
    """A whole answer (``chat.completion`` or ``text_completion``, dict or client object):
    ``choices`` must be an array. A 200 body ``{"error": {...}}`` raises ServerError with the
    server's message rather than passing for an answer with no choices."""
    if isinstance(obj, Reply):
        return obj
    return _reply(obj, "completion", whole=True)


# -- error statuses -----------------------------------------------------------------------------------
def error_message(body: Any) -> str:
    """The human message in an error body: ``{"error": {"message"}}``, ``{"error": "..."}``,
    ``{"detail": ...}``, ``{"message": ...}`` or the text itself; at most 1000 characters,
    whatever the body (bytes, text, nested JSON, garbage)."""
    if isinstance(body, (str, bytes, bytearray)):
        try:
            body = load_json(bytes(body) if isinstance(body, bytearray) else body, what="error body")
        except MalformedReplyError:
            return excerpt(body, 1000).strip()
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            message = err.get("message")
            return _short(message if message else err)
        if err:
            return _short(err)
        for key in ("detail", "message"):
            if body.get(key):
                return _short(body[key])
    return _short(body)


def _short(value: Any) -> str:
    if isinstance(value, str):
        return value[:1000]
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        text = describe(value)
    return text[:1000]


def retry_after_s(value: Any) -> float | None:
    """A ``Retry-After`` header in seconds, clamped to 0..3600: a number of seconds, or an HTTP
    date (the seconds from now until then); None for anything else (NaN, infinity, garbage:
    the backoff applies)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        try:
            when = email.utils.parsedate_to_datetime(str(value))
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:  # "-0000": UTC, as HTTP dates are
            when = when.replace(tzinfo=datetime.UTC)
        seconds = (when - datetime.datetime.now(datetime.UTC)).total_seconds()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), 3600.0)
