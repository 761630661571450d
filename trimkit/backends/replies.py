"""What an OpenAI-compatible server sent, parsed at the boundary: validated values, or one typed
error naming what was wrong. Pure functions, no I/O.

Every reply the HTTP backend reads goes through exactly one parser here before any other code
looks at it, so past this module the code trusts its types:

=============================  ==========================  ======================================
reply                          parser                      gives
=============================  ==========================  ======================================
any JSON body or SSE event     :func:`load_json`           a JSON value nested at most
                                                           :data:`MAX_JSON_DEPTH` deep
a stream chunk                 :func:`parse_chunk`         :class:`Reply`
a whole (non-streamed) answer  :func:`parse_completion`    :class:`Reply`
its ``usage`` / ``timings``    (inside both)               :class:`~trimkit.backends.server_timings.ServerStats`
``/v1/models``                 :func:`parse_models`        :class:`ModelList`
``/props``, ``/version``, …    :func:`parse_props`, …      numbers and strings
``/tokenize``                  :func:`parse_tokens`        ``list[int]``
``/apply-template``            :func:`parse_template`      ``str``
a ``text/event-stream``        :class:`SSEDecoder`         JSON events (bounded, in order)
an error status's body         :func:`error_message`       ``str``
``Retry-After``                :func:`retry_after_s`       ``float | None``
=============================  ==========================  ======================================

The rules, the same everywhere:

- anything that is not what the protocol allows raises
  :class:`~trimkit.errors.MalformedReplyError` with ``.field`` set to where
  (``choices[0].delta``, ``usage.prompt_tokens``, ``tokens[3]``); a 200 body that is an error
  object (``{"error": {...}}``) raises :class:`~trimkit.errors.ServerError` with the server's message;
- ``null`` means "not said", like a missing field;
- only the fields trimkit reads are checked; every other field passes through untouched, and the
  caller receives the server's object itself (``Reply.raw``), never a copy trimkit changed;
- numbers are range-checked: token counts and ids ``0..2**31-1``, context sizes up to
  :data:`MAX_CONTEXT_TOKENS`, times finite (see :mod:`trimkit.backends.server_timings`);
- sizes are capped: a body at :data:`MAX_REPLY_BYTES`, one stream event at :data:`MAX_EVENT_BYTES`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, NoReturn

import attrs

from trimkit.backends.server_timings import ServerStats, as_mapping, parse_server_stats
from trimkit.errors import MalformedReplyError, ServerError, StreamInterruptedError, TrimkitError

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_REPLY_BYTES",
    "MAX_EVENT_BYTES",
    "MAX_CONTEXT_TOKENS",
    "MAX_TOKEN_ID",
    "Choice",
    "ToolCallPart",
    "Reply",
    "ModelEntry",
    "ModelList",
    "load_json",
    "parse_chunk",
    "parse_completion",
    "parse_models",
    "parse_props",
    "parse_version",
    "parse_openapi_version",
    "is_tokenize_reply",
    "parse_tokens",
    "parse_template",
    "error_message",
    "retry_after_s",
    "body_kind",
    "excerpt",
    "SSEDecoder",
]

#: JSON nested deeper than this (objects and arrays) is refused; real replies are < 10 deep
MAX_JSON_DEPTH = 64
#: the largest whole reply body read, in bytes (a non-streamed answer, a tokenize reply, …)
MAX_REPLY_BYTES = 64 * 1024 * 1024
#: the largest single server-sent event (or line of one), in bytes
MAX_EVENT_BYTES = 8 * 1024 * 1024
#: the largest context size a server may report, in tokens
MAX_CONTEXT_TOKENS = 1 << 26
#: the largest token id a tokenize endpoint may return
MAX_TOKEN_ID = 2**31 - 1
#: the most choices (``n``) and tool calls one reply may index
_MAX_INDEX = 1 << 16
#: a server's version or build string is kept to this many characters (it goes into profile keys)
_MAX_VERSION_CHARS = 200


# -- errors ---------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if len(text) <= 40 else f"a {len(text)}-digit number"
    if isinstance(value, str):
        return f"a string {value[:40]!r}" + ("…" if len(value) > 40 else "")
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)}"
    return type(value).__name__


def excerpt(data: Any, n_chars: int = 500) -> str:
    """The start of what the server sent, as text (for ``server_message``)."""
    if isinstance(data, (bytes, bytearray)):
        data = bytes(data[: n_chars * 4]).decode("utf-8", "replace")
    elif not isinstance(data, str):
        data = _describe(data)
    return data[:n_chars]


def _fail(what: str, field: str, expected: str, value: Any) -> NoReturn:
    where = f"{what}: {field}" if field else what
    raise MalformedReplyError(f"the server sent a malformed {where}: expected {expected}, got {_describe(value)}",
                              field=field, server_message=excerpt(value if isinstance(value, (str, bytes)) else _describe(value)))


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


# -- JSON -------------------------------------------------------------------------------------------
def _too_deep(value: Any, limit: int) -> bool:
    """Is ``value`` nested more than ``limit`` containers deep? Iterative: no recursion to overflow."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (Mapping, list, tuple)))
    return False


def check_depth(value: Any, what: str) -> Any:
    """``value`` itself, if it is nested at most :data:`MAX_JSON_DEPTH` deep."""
    if _too_deep(value, MAX_JSON_DEPTH):
        raise MalformedReplyError(f"the server sent a {what} nested more than {MAX_JSON_DEPTH} levels deep", server_message=what)
    return value


def load_json(data: bytes | str, *, what: str, status: int | None = 200) -> Any:
    """Decode a reply body or an SSE event's data: JSON of at most :data:`MAX_REPLY_BYTES`,
    nested at most :data:`MAX_JSON_DEPTH` deep. Raises MalformedReplyError for anything else
    (not JSON, not UTF-8, too big, too deep — including deep enough to overflow the decoder)."""
    if len(data) > MAX_REPLY_BYTES:
        raise MalformedReplyError(f"the server sent a {what} of {len(data)} bytes, over the {MAX_REPLY_BYTES}-byte cap",
                                  status=status, server_message=excerpt(data))
    try:
        value = json.loads(data)
    except RecursionError:
        raise MalformedReplyError(f"the server sent a {what} nested too deep to decode (more than {MAX_JSON_DEPTH} levels)",
                                  status=status, server_message=excerpt(data)) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int over Python's digit limit
        raise MalformedReplyError(f"the server sent a {what} that is not JSON ({exc}): {excerpt(data, 200)!r}",
                                  status=status, server_message=excerpt(data)) from None
    if _too_deep(value, MAX_JSON_DEPTH):
        raise MalformedReplyError(f"the server sent a {what} nested more than {MAX_JSON_DEPTH} levels deep",
                                  status=status, server_message=excerpt(data))
    return value


def body_kind(content_type: str | None) -> str | None:
    """``"sse"``, ``"json"`` or None (anything else: HTML, XML, …) for a response's content type.
    A missing or ``text/plain`` content type is read as a stream (some servers send that)."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in ("", "text/event-stream", "text/plain"):
        return "sse"
    if kind == "application/json" or kind.endswith("+json"):
        return "json"
    return None


# -- field readers ------------------------------------------------------------------------------------
def _opt_str(obj: Mapping[str, Any], key: str, what: str, path: str) -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    _fail(what, _join(path, key), "a string", value)


def _opt_int(obj: Mapping[str, Any], key: str, what: str, path: str, hi: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= hi:
        return value
    _fail(what, _join(path, key), f"an integer 0..{hi}", value)


def _opt_mapping(obj: Mapping[str, Any], key: str, what: str, path: str) -> Mapping[str, Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, Mapping):
        return value
    _fail(what, _join(path, key), "an object", value)


def _opt_list(obj: Mapping[str, Any], key: str, what: str, path: str) -> list[Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, list):
        return value
    _fail(what, _join(path, key), "an array", value)


def _object(obj: Any, what: str) -> Mapping[str, Any]:
    """A reply as a mapping: dicts as they are, the ``openai`` client's objects dumped."""
    data = as_mapping(obj)
    if data is None:
        _fail(what, "", "a JSON object", obj)
    return check_depth(data, what)


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
    calls = _opt_list(holder, "tool_calls", what, path)
    out = []
    for i, call in enumerate(calls or ()):
        where = _join(_join(path, "tool_calls"), i)
        if not isinstance(call, Mapping):
            _fail(what, where, "an object", call)
        fn = _opt_mapping(call, "function", what, where) or {}
        fn_path = _join(where, "function")
        out.append(ToolCallPart(
            index=_opt_int(call, "index", what, where, _MAX_INDEX),
            id=_opt_str(call, "id", what, where),
            type=_opt_str(call, "type", what, where),
            name=_opt_str(fn, "name", what, fn_path),
            arguments=_opt_str(fn, "arguments", what, fn_path),
        ))
    return tuple(out)


def _choice(raw: Any, position: int, what: str, holder_keys: tuple[str, ...]) -> Choice:
    path = f"choices[{position}]"
    if not isinstance(raw, Mapping):
        _fail(what, path, "an object", raw)
    index = _opt_int(raw, "index", what, path, _MAX_INDEX)
    holder: Mapping[str, Any] | None = None
    holder_path = path
    for key in holder_keys:
        found = _opt_mapping(raw, key, what, path)
        if found is not None and holder is None:
            holder, holder_path = found, _join(path, key)
    holder = holder or {}
    function_call = _opt_mapping(holder, "function_call", what, holder_path)
    if function_call is not None:
        _opt_str(function_call, "name", what, _join(holder_path, "function_call"))
        _opt_str(function_call, "arguments", what, _join(holder_path, "function_call"))
    reasoning = _opt_str(holder, "reasoning_content", what, holder_path)
    reasoning_alt = _opt_str(holder, "reasoning", what, holder_path)
    logprobs = _opt_mapping(raw, "logprobs", what, path)
    lp_content = _opt_list(logprobs, "content", what, _join(path, "logprobs")) if logprobs is not None else None
    return Choice(
        index=index if index is not None else position,
        role=_opt_str(holder, "role", what, holder_path),
        content=_opt_str(holder, "content", what, holder_path),
        reasoning=reasoning or reasoning_alt,
        text=_opt_str(raw, "text", what, path),
        tool_calls=_tool_calls(holder, what, holder_path),
        function_call=bool(function_call),
        finish_reason=_opt_str(raw, "finish_reason", what, path),
        logprobs=tuple(lp_content) if lp_content is not None else None,
    )


def _reply(obj: Any, what: str, *, whole: bool) -> Reply:
    data = _object(obj, what)
    if "error" in data and data.get("error") is not None and data.get("choices") is None:
        message = error_message(data)
        raise ServerError(f"the server answered with an error instead of a {what}: {message}", status=200, server_message=message)
    raw_choices = _opt_list(data, "choices", what, "")
    if raw_choices is None and whole:
        _fail(what, "choices", "an array", data.get("choices"))
    keys = ("message", "delta") if whole else ("delta", "message")
    choices = tuple(_choice(c, i, what, keys) for i, c in enumerate(raw_choices or ()))
    stats = parse_server_stats(data, strict=True)
    has_stats = any(data.get(key) is not None for key in ("usage", "timings", "prompt_eval_count", "eval_count"))
    created = data.get("created")
    if created is not None:
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created < 2**40:  # NaN fails too
            _fail(what, "created", "a Unix time", created)
        created = int(created)
    return Reply(
        raw=obj,
        choices=choices,
        stats=stats,
        has_stats=has_stats,
        usage=_opt_mapping(data, "usage", what, ""),
        id=_opt_str(data, "id", what, ""),
        model=_opt_str(data, "model", what, ""),
        created=created,
        system_fingerprint=_opt_str(data, "system_fingerprint", what, ""),
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


# -- server facts ---------------------------------------------------------------------------------
def _context_size(value: Any, what: str, field: str) -> int | None:
    """A context size: None or 0 mean "not said"; else an integer 1..MAX_CONTEXT_TOKENS."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_CONTEXT_TOKENS:
        return value
    _fail(what, field, f"a context size (1..{MAX_CONTEXT_TOKENS})", value)


def _version_text(value: Any, what: str, field: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value[:_MAX_VERSION_CHARS]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return excerpt(repr(value), _MAX_VERSION_CHARS)
    _fail(what, field, "a version string", value)


@attrs.frozen
class ModelEntry:
    """One entry of ``/v1/models``."""

    id: str | None = None
    owned_by: str = ""
    n_ctx: int | None = None  # vLLM's max_model_len, llama.cpp's meta.n_ctx


@attrs.frozen
class ModelList:
    """``/v1/models``: the models the server lists (none when it has no such endpoint)."""

    entries: tuple[ModelEntry, ...] = ()

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(e.id for e in self.entries if e.id)

    @property
    def owned_by(self) -> str:
        return self.entries[0].owned_by.lower() if self.entries else ""

    @property
    def n_ctx(self) -> int | None:
        return self.entries[0].n_ctx if self.entries else None


def parse_models(body: Any) -> ModelList:
    """``/v1/models`` (None: the endpoint is missing). ``data`` must be an array of objects
    (``null``: no models); ``id`` / ``owned_by`` strings, context sizes in range."""
    what = "/v1/models reply"
    if body is None:
        return ModelList()
    if not isinstance(body, Mapping):
        _fail(what, "", "an object", body)
    data = _opt_list(body, "data", what, "")
    entries = []
    for i, entry in enumerate(data or ()):
        path = f"data[{i}]"
        if not isinstance(entry, Mapping):
            _fail(what, path, "an object", entry)
        meta = _opt_mapping(entry, "meta", what, path) or {}
        n_ctx = _context_size(entry.get("max_model_len"), what, _join(path, "max_model_len"))
        meta_ctx = _context_size(meta.get("n_ctx"), what, _join(_join(path, "meta"), "n_ctx"))
        entries.append(ModelEntry(
            id=_opt_str(entry, "id", what, path),
            owned_by=_opt_str(entry, "owned_by", what, path) or "",
            n_ctx=n_ctx if n_ctx is not None else meta_ctx,
        ))
    return ModelList(tuple(entries))


def parse_props(body: Any) -> tuple[int | None, str]:
    """``(n_ctx, build_info)`` from llama.cpp's ``/props``; ``(None, "")`` when the body is not
    an object (another engine's endpoint)."""
    what = "/props reply"
    if not isinstance(body, Mapping):
        return None, ""
    settings = _opt_mapping(body, "default_generation_settings", what, "") or {}
    n_ctx = _context_size(settings.get("n_ctx"), what, "default_generation_settings.n_ctx")
    if n_ctx is None:
        n_ctx = _context_size(body.get("n_ctx"), what, "n_ctx")
    return n_ctx, _version_text(body.get("build_info"), what, "build_info")


def parse_version(body: Any) -> str:
    """``/version`` (vLLM): its ``version``, or "" when the body is not an object."""
    if not isinstance(body, Mapping):
        return ""
    return _version_text(body.get("version"), "/version reply", "version")


def parse_openapi_version(body: Any) -> str:
    """``"<title> <version>"`` from ``/openapi.json`` (llama-cpp-python), or ""."""
    what = "/openapi.json reply"
    if not isinstance(body, Mapping):
        return ""
    info = _opt_mapping(body, "info", what, "")
    if not info:
        return ""
    version = _version_text(info.get("version"), what, "info.version")
    title = _version_text(info.get("title"), what, "info.title") or "server"
    return f"{title} {version}"[:_MAX_VERSION_CHARS] if version else ""


def is_tokenize_reply(body: Any) -> bool:
    """Does this body claim to be a tokenize endpoint's reply (an object with ``tokens``)?"""
    return isinstance(body, Mapping) and body.get("tokens") is not None


def parse_tokens(body: Any, *, what: str, max_tokens: int) -> list[int]:
    """A tokenize reply's ``tokens``: at most ``max_tokens`` integer ids ``0..MAX_TOKEN_ID``.
    (A tokenizer cannot give more tokens than the text has bytes, plus a few special ones:
    the caller passes that bound.)"""
    if not isinstance(body, Mapping):
        _fail(what, "", "an object with tokens", body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        _fail(what, "tokens", "an array of token ids", tokens)
    if len(tokens) > max_tokens:
        raise MalformedReplyError(f"the server sent a malformed {what}: {len(tokens)} tokens for a text that can have at most {max_tokens}",
                                  field="tokens", server_message=f"{len(tokens)} tokens")
    for i, token in enumerate(tokens):
        if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
            _fail(what, f"tokens[{i}]", f"a token id (an integer 0..{MAX_TOKEN_ID})", token)
    return list(tokens)


def parse_template(body: Any) -> str:
    """``/apply-template``'s rendered ``prompt``."""
    what = "/apply-template reply"
    if not isinstance(body, Mapping):
        _fail(what, "", "an object", body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        _fail(what, "prompt", "a string", prompt)
    return prompt


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
        text = _describe(value)
    return text[:1000]


def retry_after_s(value: Any) -> float | None:
    """A ``Retry-After`` header in seconds: a finite number 0..3600; None for anything else
    (an HTTP date — rare from model servers —, NaN, infinity: the backoff applies)."""
    try:
        seconds = float(value) if value is not None else None
    except (TypeError, ValueError, OverflowError):
        return None
    if seconds is None or not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), 3600.0)


# -- server-sent events -----------------------------------------------------------------------------
_NO_EVENT = object()  # a line that completes no event (JSON ``null`` is an event, and a malformed one)
_LINE_END = re.compile(rb"[\r\n]")


class SSEDecoder:
    """Turns the bytes of a ``text/event-stream`` into decoded JSON events (sans-I/O).

    :meth:`feed_bytes` takes bytes as they arrive and returns the events they complete;
    :meth:`finish` the one left pending when the stream ends. (:meth:`feed` takes one decoded
    line.) ``data: [DONE]`` sets :attr:`done`. Comments (``: ping``) are skipped; an ``error``
    event, or a data object with ``error`` and no ``choices``, raises
    :class:`~trimkit.errors.ServerError` with the server's message. Event data that is not JSON
    (or nested too deep), and a line or event longer than ``max_event_bytes``, raise
    :class:`~trimkit.errors.MalformedReplyError`.
    """

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self.max_event_bytes = MAX_EVENT_BYTES if max_event_bytes is None else max_event_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer already searched for a line end
        self._data: list[str] = []
        self._data_chars = 0
        self._event = ""
        self._error: BaseException | None = None  # raised on the next call, after the events before it
        self.done = False

    def feed_bytes(self, data: bytes) -> list[Any]:
        """The events these bytes complete, in order (none once :attr:`done`). An error (a
        malformed event, an error event) is raised after the events before it were returned:
        on the next call."""
        self._raise_pending()
        if self.done:
            return []
        buf = self._buffer
        buf += data
        events: list[Any] = []
        start = 0
        while not self.done:
            found = _LINE_END.search(buf, max(start, self._scanned))
            if found is None:
                break
            end = found.start()
            step = 1
            if buf[end] == 13:  # \r: a line end alone or as \r\n, which may be split across reads
                if end + 1 == len(buf):
                    self._scanned = end
                    break
                if buf[end + 1] == 10:
                    step = 2
            line = bytes(buf[start:end]).decode("utf-8", "replace")
            start = end + step
            try:
                event = self._line(line)
            except TrimkitError as exc:
                if not events:
                    raise
                self._error = exc
                break
            if event is not _NO_EVENT:
                events.append(event)
        del buf[:start]
        self._scanned = max(self._scanned - start, len(buf) - 1 if buf and buf[-1] == 13 else len(buf), 0)
        if len(buf) > self.max_event_bytes:
            raise MalformedReplyError(f"the server sent a stream line longer than {self.max_event_bytes} bytes",
                                      server_message=excerpt(bytes(buf[:500])))
        return events

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self.done = True
            raise error

    def finish(self) -> list[Any]:
        """The events left when the stream ends: a last line without a line end, and an event
        without its closing blank line."""
        self._raise_pending()
        events: list[Any] = []
        if self._buffer and not self.done:
            event = self._line(bytes(self._buffer).decode("utf-8", "replace").rstrip("\r"))
            self._buffer.clear()
            self._scanned = 0
            if event is not _NO_EVENT:
                events.append(event)
        if not self.done and self._data:
            payload = "\n".join(self._data)
            if payload.strip() != "[DONE]" and len(payload) <= MAX_REPLY_BYTES:
                try:
                    json.loads(payload)
                except json.JSONDecodeError:  # the connection closed in the middle of an event: cut, not garbled
                    raise StreamInterruptedError(f"the stream ended in the middle of an event: {payload[:200]!r}") from None
                except (ValueError, RecursionError):
                    pass  # _dispatch says what is wrong with it
            event = self._dispatch()
            if event is not _NO_EVENT:
                events.append(event)
        return events

    def feed(self, line: str) -> Any:
        """One line, without its line end: the event's JSON when a blank line ends one, else None."""
        event = self._line(line)
        return None if event is _NO_EVENT else event

    def _line(self, line: str) -> Any:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return _NO_EVENT
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_chars += len(value) + 1
            if self._data_chars > self.max_event_bytes:
                raise MalformedReplyError(f"the server sent a stream event longer than {self.max_event_bytes} bytes",
                                          server_message=excerpt(self._data[0] if self._data else value))
            self._data.append(value)
        elif name == "event":
            self._event = value[:100]
        return _NO_EVENT

    def flush(self) -> Any:
        """The event left pending when the stream ends without a final blank line."""
        event = self._dispatch()
        return None if event is _NO_EVENT else event

    def _dispatch(self) -> Any:
        event, self._event = self._event, ""
        if not self._data:
            return _NO_EVENT
        payload = "\n".join(self._data)
        self._data = []
        self._data_chars = 0
        if payload.strip() == "[DONE]":
            self.done = True
            return _NO_EVENT
        obj = load_json(payload, what="stream event")
        if event == "error" or (isinstance(obj, Mapping) and obj.get("error") is not None and obj.get("choices") is None):
            message = error_message(obj)
            raise ServerError(f"the server reported an error mid-stream: {message}", status=200, server_message=message)
        return obj
