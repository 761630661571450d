"""What an OpenAI-compatible server sent, parsed at the boundary (docs/servers.md §6): bounded JSON,
chunks and completions (:class:`Reply`), the server's own numbers (:class:`ServerStats`), error
bodies, ``Retry-After``, and the ``chat.completion`` a finished stream amounts to. No I/O.

Every parser: a value the protocol does not allow raises MalformedReplyError with ``.field``; a 200
error object raises ServerError; ``null`` means "not said"; the caller gets the server's object (``Reply.raw``).
"""

from __future__ import annotations

import datetime
import email.utils
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import attrs

from trimkit.backends.base import Measurement
from trimkit.errors import MalformedReplyError, ServerError

log = logging.getLogger("trimkit")

#: JSON nested deeper than this (objects and arrays) is refused; real replies are < 10 deep
MAX_JSON_DEPTH = 64
#: the largest whole reply body read, in bytes
MAX_REPLY_BYTES = 64 * 1024 * 1024
#: the largest single server-sent event, in bytes
MAX_EVENT_BYTES = 8 * 1024 * 1024


# == fields: bounded JSON and typed readers ==================================================================

def describe(value: Any) -> str:
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
        data = describe(data)
    return data[:n_chars]


def fail(what: str, field: str, expected: str, value: Any) -> NoReturn:
    where = f"{what}: {field}" if field else what
    raise MalformedReplyError(f"the server sent a malformed {where}: expected {expected}, got {describe(value)}",
                              field=field, server_message=excerpt(value if isinstance(value, (str, bytes)) else describe(value)))


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


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


def load_json(data: bytes | str, *, what: str, status: int | None = 200) -> Any:
    """A reply body or event's data: JSON of at most MAX_REPLY_BYTES, MAX_JSON_DEPTH deep, else MalformedReplyError."""
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


def _opt(kind: type | tuple[type, ...], expected: str) -> Callable[[Mapping[str, Any], str, str, str], Any]:
    def read(obj: Mapping[str, Any], key: str, what: str, path: str) -> Any:
        value = obj.get(key)
        if value is None or isinstance(value, kind):
            return value
        fail(what, join_path(path, key), expected, value)

    return read


#: ``obj[key]`` when it is absent/null or of the type, else MalformedReplyError naming ``path.key``
opt_str = _opt(str, "a string")
opt_mapping = _opt(Mapping, "an object")
opt_list = _opt(list, "an array")


def opt_int(obj: Mapping[str, Any], key: str, what: str, path: str, hi: int) -> int | None:
    value = obj.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= hi):
        return value
    fail(what, join_path(path, key), f"an integer 0..{hi}", value)


def as_mapping(obj: Any) -> Mapping[str, Any] | None:
    """A response or chunk as a mapping: dicts as they are, pydantic objects (the ``openai``
    client's, extra fields such as ``timings`` kept) through ``model_dump()``."""
    if isinstance(obj, Mapping) or obj is None:
        return obj
    dump = getattr(obj, "model_dump", None)
    if not callable(dump):
        return None
    try:
        try:  # an object built from a malformed reply must not warn while it is dumped
            data = dump(warnings=False)
        except TypeError:
            data = dump()
    except Exception:
        return None
    return data if isinstance(data, Mapping) else None


def as_object(obj: Any, what: str) -> Mapping[str, Any]:
    data = as_mapping(obj)
    if data is None:
        fail(what, "", "a JSON object", obj)
    if _too_deep(data, MAX_JSON_DEPTH):
        raise MalformedReplyError(f"the server sent a {what} nested more than {MAX_JSON_DEPTH} levels deep", server_message=what)
    return data


# == the server's numbers ====================================================================================

SOURCE_LLAMA_SERVER = "llama.cpp server timings"
SOURCE_OLLAMA = "ollama"
SOURCE_USAGE = "usage"
SOURCE_CLIENT = "client"

#: the largest token count a server may report (usage, timings, counters)
MAX_TOKEN_COUNT = 2**31 - 1
#: the longest time a server may report for one request, in seconds (about 11.6 days)
MAX_SERVER_SECONDS = 1e6

_OLLAMA_KEYS = ("prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration")


@attrs.frozen
class ServerStats:
    """What the server said about one request (None: not said). ``prompt_tokens`` is the whole prompt
    (``evaluated_tokens`` prefilled + ``cached_tokens`` reused); ``raw`` its numbers, flattened."""

    source: str = SOURCE_CLIENT
    prompt_tokens: int | None = None
    evaluated_tokens: int | None = None
    cached_tokens: int | None = None
    prefill_s: float | None = None
    completion_tokens: int | None = None
    decode_s: float | None = None
    raw: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def reported(self) -> bool:
        return self.source != SOURCE_CLIENT


def has_server_stats(chunk: Any) -> bool:
    """Does this response or chunk carry usage, timings or Ollama counters?"""
    data = as_mapping(chunk) or {}
    return any(data.get(key) is not None for key in ("usage", "timings", "prompt_eval_count", "eval_count"))


def _invalid(field: str, expected: str, value: Any, strict: bool) -> Any:
    """None for an invalid number the server reported, or (``strict``) MalformedReplyError."""
    if strict:
        raise MalformedReplyError(f"the server's {field} is not {expected}: {describe(value)}", field=field, server_message=describe(value))
    return None


def _count(value: Any, field: str = "", strict: bool = False) -> int | None:
    """A token count (an integer or integral float, 0..MAX_TOKEN_COUNT); None when absent, or invalid and not ``strict``."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_COUNT:  # (not NaN, not inf)
        return int(value)
    return _invalid(field, f"a token count (0..{MAX_TOKEN_COUNT})", value, strict)


def _seconds(value: Any, per_second: float, field: str = "", strict: bool = False) -> float | None:
    """A duration in units of ``1/per_second`` s, finite, 0..MAX_SERVER_SECONDS; else as :func:`_count`."""
    if value is None:
        return None
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            seconds = float(value) / per_second
        except OverflowError:  # an int too large for a float
            seconds = math.inf
        if math.isfinite(seconds) and 0 <= seconds <= MAX_SERVER_SECONDS:
            return seconds
    return _invalid(field, f"a duration (finite, 0..{MAX_SERVER_SECONDS:g} s)", value, strict)


def _mapping(value: Any, field: str, strict: bool) -> Mapping[str, Any] | None:
    if value is None or isinstance(value, Mapping):
        return value
    return _invalid(field, "an object", value, strict)


def _flatten(data: Mapping[str, Any], prefix: str = "", depth: int = 3) -> dict[str, Any]:
    """Scalars of ``data`` keyed by their dotted path, ``depth`` levels down."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if depth > 1:
                out.update(_flatten(value, name + ".", depth - 1))
        elif isinstance(value, (str, bool)) or value is None:
            out[name] = value if not isinstance(value, str) or len(value) <= 200 else value[:200]
        elif isinstance(value, int):
            out[name] = value if abs(value) <= 2**53 else float("inf") if value > 0 else float("-inf")
        elif isinstance(value, float):
            out[name] = value
    return out


def parse_server_stats(payload: Any, *, strict: bool = False) -> ServerStats:
    """The server's own numbers in a body or chunk (dict or ``openai`` object): llama.cpp ``timings``
    first, then Ollama's counters, then ``usage``, else ``source="client"``. ``strict``: a present but
    invalid field raises MalformedReplyError instead of being dropped."""
    data = as_mapping(payload)
    if not data:
        return ServerStats()
    usage = _mapping(data.get("usage"), "usage", strict)
    u_prompt = u_completion = u_cached = None
    if usage:
        details = _mapping(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details", strict)
        u_cached = _count(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens", strict) if details else None
        u_prompt = _count(usage.get("prompt_tokens"), "usage.prompt_tokens", strict)
        u_completion = _count(usage.get("completion_tokens"), "usage.completion_tokens", strict)
    timings = _mapping(data.get("timings"), "timings", strict)
    if timings is not None and ("prompt_n" in timings or "prompt_ms" in timings):
        evaluated = _count(timings.get("prompt_n"), "timings.prompt_n", strict)
        cached = _count(timings.get("cache_n"), "timings.cache_n", strict)
        cached = u_cached if cached is None else cached
        prompt = u_prompt
        if prompt is None and evaluated is not None and cached is not None:
            prompt = min(evaluated + cached, MAX_TOKEN_COUNT)
        completion = _count(timings.get("predicted_n"), "timings.predicted_n", strict)
        return ServerStats(SOURCE_LLAMA_SERVER, prompt, evaluated, cached, _seconds(timings.get("prompt_ms"), 1e3, "timings.prompt_ms", strict),
                           completion if completion is not None else u_completion,
                           _seconds(timings.get("predicted_ms"), 1e3, "timings.predicted_ms", strict),
                           _flatten({"timings": timings, **({"usage": usage} if usage else {})}))
    if any(key in data for key in _OLLAMA_KEYS):
        count = _count(data.get("prompt_eval_count"), "prompt_eval_count", strict)
        cached = _count(data.get("prompt_eval_cached_count"), "prompt_eval_cached_count", strict)
        # without the cached count (older Ollama, or Go's omitempty hiding a zero) the count is what was
        # evaluated: taking it for the whole prompt would mistake a cache hit for truncation
        prompt, evaluated = (count, max(count - cached, 0)) if cached is not None and count is not None else (None, count)
        keys = (*_OLLAMA_KEYS, "prompt_eval_cached_count", "total_duration", "load_duration")
        return ServerStats(SOURCE_OLLAMA, prompt, evaluated, cached, _seconds(data.get("prompt_eval_duration"), 1e9, "prompt_eval_duration", strict),
                           _count(data.get("eval_count"), "eval_count", strict), _seconds(data.get("eval_duration"), 1e9, "eval_duration", strict),
                           _flatten({key: data[key] for key in keys if key in data}, depth=1))
    if usage and (u_prompt is not None or u_completion is not None):
        evaluated = max(u_prompt - u_cached, 0) if u_prompt is not None and u_cached is not None else None
        return ServerStats(SOURCE_USAGE, u_prompt, evaluated, u_cached, completion_tokens=u_completion, raw=_flatten({"usage": usage}))
    return ServerStats()


def detect_truncation(sent_tokens: int | None, stats: ServerStats, *, predicted_cached: int = 0, tolerance_tokens: int = 0,
                      context_tokens: int | None = None) -> int:
    """Prompt tokens the server silently dropped (``sent_tokens`` minus what it took in, beyond
    ``tolerance_tokens``), logged; 0 if it did not say. With only an evaluated count, the predicted
    cached tokens are added. A prompt counted over ``context_tokens`` (the window trimkit set) of which
    the server took in no more than the window was cut, whatever the tolerance."""
    if sent_tokens is None:
        return 0
    seen = stats.prompt_tokens
    if seen is None and stats.evaluated_tokens is not None:
        seen = stats.evaluated_tokens + (stats.cached_tokens if stats.cached_tokens is not None else predicted_cached)
    if seen is None:
        return 0
    missing = sent_tokens - seen
    over_window = context_tokens is not None and sent_tokens > context_tokens >= seen
    if missing <= tolerance_tokens and not over_window:
        return 0
    log.warning("trimkit: the server took in %d prompt tokens but trimkit sent %d: %d tokens were silently truncated (the prompt is "
                "longer than the server's context window?)", seen, sent_tokens, missing)
    return missing


def build_measurement(stats: ServerStats, *, ttft_s: float | None, total_s: float, first_output_s: float | None = None,
                      client_decode_s: float | None = None, sent_tokens: int | None = None, finish_reason: str | None = None,
                      truncated_tokens: int = 0, extra: Mapping[str, Any] | None = None) -> Measurement:
    """A Measurement of the client TTFT and the server's numbers; ``server`` holds its raw numbers and,
    when both times are known, ``network_overhead_s`` = client TTFT − server prefill."""
    server: dict[str, Any] = {**stats.raw, "cached_tokens_reported": stats.cached_tokens is not None}
    if sent_tokens is not None:
        server["sent_prompt_tokens"] = sent_tokens
    if ttft_s is not None and stats.prefill_s is not None:
        server["network_overhead_s"] = ttft_s - stats.prefill_s
    server.update(extra or {})
    return Measurement(ttft_s=ttft_s, total_s=total_s, first_output_s=first_output_s,
                       prompt_tokens=stats.prompt_tokens if stats.prompt_tokens is not None else sent_tokens, cached_tokens=stats.cached_tokens,
                       evaluated_tokens=stats.evaluated_tokens, engine_prefill_s=stats.prefill_s, completion_tokens=stats.completion_tokens,
                       engine_decode_s=stats.decode_s, client_decode_s=client_decode_s, timing_source=stats.source, finish_reason=finish_reason,
                       truncated_tokens=truncated_tokens, server=server)


# == chat replies ============================================================================================

#: the most choices (``n``) and tool calls one reply may index
_MAX_INDEX = 1 << 16


def body_kind(content_type: str | None) -> str | None:
    """``"sse"`` (also a missing or ``text/plain`` type: some servers send that), ``"json"``, or None."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in ("", "text/event-stream", "text/plain"):
        return "sse"
    if kind == "application/json" or kind.endswith("+json"):
        return "json"
    return None


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
    """One choice of a chunk or completion (chat ``delta`` / ``message``, or the completions API's ``text``)."""

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
        """The generated text: ``""`` for a finish without text, None for a bare role delta. Tool
        calls and reasoning count: they are the first generated tokens."""
        if self.content or self.reasoning:
            return self.content or self.reasoning
        if self.tool_calls or self.function_call:
            return "<tool_call>"
        if self.text:
            return self.text
        return "" if self.finish_reason else None


@attrs.frozen
class Reply:
    """A stream chunk or a whole completion, validated; ``raw`` is what the server (or client) gave."""

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
        return self.choices[0].output if self.choices else None

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def usage_only(self) -> bool:
        """No choices, only ``usage``: the chunk ``stream_options.include_usage`` adds."""
        return not self.choices and self.usage is not None


def _tool_calls(holder: Mapping[str, Any], what: str, path: str) -> tuple[ToolCallPart, ...]:
    out = []
    for i, call in enumerate(opt_list(holder, "tool_calls", what, path) or ()):
        where = join_path(join_path(path, "tool_calls"), i)
        if not isinstance(call, Mapping):
            fail(what, where, "an object", call)
        fn = opt_mapping(call, "function", what, where) or {}
        fn_path = join_path(where, "function")
        out.append(ToolCallPart(opt_int(call, "index", what, where, _MAX_INDEX), opt_str(call, "id", what, where), opt_str(call, "type", what, where),
                                opt_str(fn, "name", what, fn_path), opt_str(fn, "arguments", what, fn_path)))
    return tuple(out)


def _choice(raw: Any, position: int, what: str, holder_keys: tuple[str, ...]) -> Choice:
    path = f"choices[{position}]"
    if not isinstance(raw, Mapping):
        fail(what, path, "an object", raw)
    index = opt_int(raw, "index", what, path, _MAX_INDEX)
    found = [(join_path(path, key), value) for key in holder_keys if (value := opt_mapping(raw, key, what, path)) is not None]
    holder_path, holder = found[0] if found else (path, {})
    function_call = opt_mapping(holder, "function_call", what, holder_path)
    for key in ("name", "arguments") if function_call is not None else ():
        opt_str(function_call, key, what, join_path(holder_path, "function_call"))
    reasoning = opt_str(holder, "reasoning_content", what, holder_path)
    reasoning_alt = opt_str(holder, "reasoning", what, holder_path)
    logprobs = opt_mapping(raw, "logprobs", what, path)
    lp_content = opt_list(logprobs, "content", what, join_path(path, "logprobs")) if logprobs is not None else None
    return Choice(index=index if index is not None else position, role=opt_str(holder, "role", what, holder_path),
                  content=opt_str(holder, "content", what, holder_path), reasoning=reasoning or reasoning_alt, text=opt_str(raw, "text", what, path),
                  tool_calls=_tool_calls(holder, what, holder_path), function_call=bool(function_call),
                  finish_reason=opt_str(raw, "finish_reason", what, path), logprobs=tuple(lp_content) if lp_content is not None else None)


def _reply(obj: Any, what: str, *, whole: bool) -> Reply:
    if isinstance(obj, Reply):
        return obj
    data = as_object(obj, what)
    if data.get("error") is not None and data.get("choices") is None:
        message = error_message(data)
        raise ServerError(f"the server answered with an error instead of a {what}: {message}", status=200, server_message=message)
    raw_choices = opt_list(data, "choices", what, "")
    if raw_choices is None and whole:
        fail(what, "choices", "an array", data.get("choices"))
    keys = ("message", "delta") if whole else ("delta", "message")
    choices = tuple(_choice(c, i, what, keys) for i, c in enumerate(raw_choices or ()))
    stats = parse_server_stats(data, strict=True)
    created = data.get("created")
    if created is not None:
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created < 2**40:  # NaN fails too
            fail(what, "created", "a Unix time", created)
        created = int(created)
    return Reply(obj, choices, stats, has_server_stats(data), opt_mapping(data, "usage", what, ""), opt_str(data, "id", what, ""),
                 opt_str(data, "model", what, ""), created, opt_str(data, "system_fingerprint", what, ""))


def parse_chunk(obj: Any) -> Reply:
    """A stream chunk (dict or client object); ``choices`` may be absent (usage-only); ``{"error"}`` raises ServerError."""
    return _reply(obj, "stream chunk", whole=False)


def parse_completion(obj: Any) -> Reply:
    """A whole answer (``chat.completion`` or ``text_completion``): ``choices`` must be an array;
    a 200 body ``{"error": {...}}`` raises ServerError."""
    return _reply(obj, "completion", whole=True)


def error_message(body: Any) -> str:
    """The human message in an error body (``{"error": {"message"}}``, ``{"error": "..."}``,
    ``{"detail"}``, ``{"message"}`` or the text), at most 1000 characters whatever the body."""
    if isinstance(body, (str, bytes, bytearray)):
        try:
            body = load_json(bytes(body) if isinstance(body, bytearray) else body, what="error body")
        except MalformedReplyError:
            return excerpt(body, 1000).strip()
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            return _short(err.get("message") or err)
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
    """A ``Retry-After`` header (seconds, or an HTTP date) in seconds clamped to 0..3600; None for garbage."""
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
    return min(max(seconds, 0.0), 3600.0) if math.isfinite(seconds) else None


# == the completion a stream amounts to ======================================================================

def chunk_content(chunk: Any) -> str | None:
    """The generated text a chunk carries (:attr:`Choice.output`; None for a role delta or a usage-only
    chunk). A malformed chunk raises MalformedReplyError."""
    return parse_chunk(chunk).output


def probe_output(reply: Reply) -> str | None:
    """Completion probes: every chunk with a choice is a generated token (even an empty piece of a
    multi-byte character); a text-less finish chunk is not."""
    if not reply.choices:
        return None
    choice = reply.choices[0]
    return "·" if choice.text or not choice.finish_reason else ""


def assemble_chat_completion(chunks: Sequence[Any], stats_chunk: Any = None, *, usage: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``chat.completion`` dict a finished stream's chunks amount to: pieces joined per choice,
    the last finish reason, ``usage`` if reported (else the ``usage`` given, else None)."""
    replies = [parse_chunk(c) for c in chunks]
    first = replies[0] if replies else Reply(None)
    choices: dict[int, dict[str, Any]] = {}
    for reply in replies:
        for ch in reply.choices:
            acc = choices.setdefault(ch.index, {"parts": [], "tools": {}, "finish_reason": None, "role": "assistant", "logprobs": None})
            acc["role"] = ch.role or acc["role"]
            if ch.content:
                acc["parts"].append(ch.content)
            for call in ch.tool_calls:
                key = call.index if call.index is not None else len(acc["tools"])
                slot = acc["tools"].setdefault(key, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = call.id or slot["id"]
                # OpenAI sends a call's name once; llama-cpp-python repeats the whole name in every chunk
                if call.name and call.name != slot["function"]["name"]:
                    slot["function"]["name"] += call.name
                slot["function"]["arguments"] += call.arguments or ""
            if ch.logprobs:
                acc["logprobs"] = (acc["logprobs"] or []) + list(ch.logprobs)
            acc["finish_reason"] = ch.finish_reason or acc["finish_reason"]
    out_choices = []
    for idx in sorted(choices):
        acc = choices[idx]
        message: dict[str, Any] = {"role": acc["role"], "content": "".join(acc["parts"]) if acc["parts"] or not acc["tools"] else None}
        if acc["tools"]:
            message["tool_calls"] = [acc["tools"][k] for k in sorted(acc["tools"])]
        logprobs = {"content": acc["logprobs"]} if acc["logprobs"] is not None else None
        out_choices.append({"index": idx, "message": message, "finish_reason": acc["finish_reason"], "logprobs": logprobs})
    stats = parse_chunk(stats_chunk) if stats_chunk is not None else None
    reported = stats.usage if stats is not None and stats.usage is not None else usage
    return {"id": first.id or "", "object": "chat.completion", "created": first.created if first.created is not None else int(time.time()),
            "model": first.model or "", "system_fingerprint": first.system_fingerprint, "choices": out_choices,
            "usage": dict(reported) if reported is not None else None}


def as_chat_completion(response: dict[str, Any]) -> Any:
    """An assembled ``chat.completion`` dict as the ``openai`` client's ``ChatCompletion`` (the dict without ``openai``)."""
    try:
        from openai.types.chat import ChatCompletion  # optional dependency
    except ImportError:  # pragma: no cover
        return response
    try:
        return ChatCompletion.model_validate(response)
    except Exception:
        return ChatCompletion.model_construct(**response)
