"""Reading a server's own numbers out of its responses: pure functions, no I/O.

OpenAI-compatible engines report what they did in different shapes. :func:`parse_server_stats`
turns a response body or the last stream chunk into one :class:`ServerStats` record:

- **llama.cpp server** adds ``timings``: ``prompt_n`` (evaluated), ``cache_n`` (reused),
  ``prompt_ms``, ``predicted_n``, ``predicted_ms``;
- **Ollama** native responses carry ``prompt_eval_count``, ``prompt_eval_cached_count`` (newer
  versions, omitted when zero), ``prompt_eval_duration`` and ``eval_duration`` in nanoseconds;
- **vLLM, SGLang, recent llama.cpp, llama-cpp-python** give ``usage.prompt_tokens``,
  ``usage.completion_tokens`` and, where enabled, ``usage.prompt_tokens_details.cached_tokens``.

Every number is range-checked where it is read (:func:`_count`, :func:`_seconds`): token counts
are integers in ``0..MAX_TOKEN_COUNT``, times finite and at most ``MAX_SERVER_SECONDS``. With
``strict=True`` (what the HTTP backend uses) a number that is present but not valid raises
:class:`~trimkit.errors.MalformedReplyError` naming its field (``usage.prompt_tokens``); by
default it is dropped, as if the server had not said. ``null`` always means "not said".

:func:`build_measurement` fills a :class:`~trimkit.backends.base.Measurement` from the record
and the client-side timing; :func:`detect_truncation` compares the tokens trimkit sent with the
tokens the server says it took in, and warns loudly when the server dropped some.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import attrs

from trimkit.backends.base import Measurement
from trimkit.errors import MalformedReplyError

__all__ = [
    "ServerStats",
    "SOURCE_LLAMA_SERVER",
    "SOURCE_OLLAMA",
    "SOURCE_USAGE",
    "SOURCE_CLIENT",
    "as_mapping",
    "field_of",
    "has_server_stats",
    "parse_server_stats",
    "detect_truncation",
    "build_measurement",
    "MAX_TOKEN_COUNT",
    "MAX_SERVER_SECONDS",
]

log = logging.getLogger("trimkit")

SOURCE_LLAMA_SERVER = "llama.cpp server timings"
SOURCE_OLLAMA = "ollama"
SOURCE_USAGE = "usage"
SOURCE_CLIENT = "client"

#: the largest token count a server may report (usage, timings, counters): 2**31 - 1
MAX_TOKEN_COUNT = 2**31 - 1
#: the longest time a server may report for one request, in seconds (about 11.6 days)
MAX_SERVER_SECONDS = 1e6

_OLLAMA_KEYS = ("prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration")


@attrs.frozen
class ServerStats:
    """What the server said about one request. ``None`` means it did not say.

    ``prompt_tokens`` is the whole prompt as the server took it in (evaluated + reused);
    ``evaluated_tokens`` the part it had to prefill; ``cached_tokens`` the part it reused.
    ``raw`` keeps the server's own numbers, flattened (``"timings.prompt_ms"``).
    """

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


def as_mapping(obj: Any) -> Mapping[str, Any] | None:
    """A response or chunk as a mapping: dicts as they are, pydantic objects (the ``openai``
    client's, whose extra fields such as ``timings`` are kept) through ``model_dump()``."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        try:
            try:  # an object built from a malformed reply must not warn while it is dumped
                data = dump(warnings=False)
            except TypeError:
                data = dump()
        except Exception:
            return None
        return data if isinstance(data, Mapping) else None
    return None


def field_of(obj: Any, name: str) -> Any:
    """``obj[name]`` for mappings, else the attribute (or pydantic extra field); None if absent."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None)
        if isinstance(extra, Mapping):
            value = extra.get(name)
    return value


def has_server_stats(chunk: Any) -> bool:
    """Cheap per-chunk test: does this response/chunk carry usage, timings or Ollama counters?"""
    return any(field_of(chunk, key) is not None for key in ("usage", "timings", "prompt_eval_count", "eval_count"))


def _describe(value: Any) -> str:
    text = repr(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__
    if isinstance(value, int) and not isinstance(value, bool) and len(text) > 40:
        return f"a {len(text)}-digit number"
    return text if len(text) <= 60 else text[:57] + "..."


def _invalid(field: str, expected: str, value: Any) -> MalformedReplyError:
    return MalformedReplyError(f"the server's {field} is not {expected}: {_describe(value)}", field=field, server_message=_describe(value))


def _count(value: Any, field: str = "", strict: bool = False) -> int | None:
    """A token count the server reported: an integer (or integral-valued float) in
    ``0..MAX_TOKEN_COUNT``; None when absent (or invalid and not ``strict``)."""
    if value is None:
        return None
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        if isinstance(value, int) and 0 <= value <= MAX_TOKEN_COUNT:
            return value
        if isinstance(value, float) and math.isfinite(value) and 0 <= value <= MAX_TOKEN_COUNT:
            return int(value)
    if strict:
        raise _invalid(field, f"a token count (0..{MAX_TOKEN_COUNT})", value)
    return None


def _seconds(value: Any, per_second: float, field: str = "", strict: bool = False) -> float | None:
    """A duration the server reported in units of ``1/per_second`` s: finite, >= 0 and at most
    ``MAX_SERVER_SECONDS``; None when absent (or invalid and not ``strict``)."""
    if value is None:
        return None
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            seconds = float(value) / per_second
        except OverflowError:  # an int too large for a float
            seconds = math.inf
        if math.isfinite(seconds) and 0 <= seconds <= MAX_SERVER_SECONDS:
            return seconds
    if strict:
        raise _invalid(field, f"a duration (finite, 0..{MAX_SERVER_SECONDS:g} s)", value)
    return None


def _mapping(value: Any, field: str, strict: bool) -> Mapping[str, Any] | None:
    if value is None or isinstance(value, Mapping):
        return value
    if strict:
        raise _invalid(field, "an object", value)
    return None


def _flatten(data: Mapping[str, Any], prefix: str = "", depth: int = 3) -> dict[str, Any]:
    """Scalars of ``data`` keyed by their dotted path, ``depth`` levels down (no deeper: the
    shapes read here are at most three levels deep)."""
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


def _usage_numbers(usage: Mapping[str, Any] | None, strict: bool = False) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, cached_tokens) from an OpenAI ``usage`` block."""
    if not usage:
        return None, None, None
    details = _mapping(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details", strict)
    cached = _count(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens", strict) if details else None
    return (_count(usage.get("prompt_tokens"), "usage.prompt_tokens", strict),
            _count(usage.get("completion_tokens"), "usage.completion_tokens", strict), cached)


def parse_server_stats(payload: Any, *, strict: bool = False) -> ServerStats:
    """The server's own numbers in a response body or stream chunk (dict or ``openai`` object).

    Precedence: llama.cpp ``timings`` (they carry times), then Ollama's counters, then
    ``usage`` (counts only), else an empty record with ``source="client"``. ``strict``: a
    field that is present but not a valid number (or object) raises
    :class:`~trimkit.errors.MalformedReplyError` instead of being dropped.
    """
    data = as_mapping(payload)
    if not data:
        return ServerStats()
    usage = _mapping(data.get("usage"), "usage", strict)
    u_prompt, u_completion, u_cached = _usage_numbers(usage, strict)
    timings = _mapping(data.get("timings"), "timings", strict)
    if timings is not None and ("prompt_n" in timings or "prompt_ms" in timings):
        evaluated = _count(timings.get("prompt_n"), "timings.prompt_n", strict)
        cached = _count(timings.get("cache_n"), "timings.cache_n", strict)
        if cached is None:
            cached = u_cached
        prompt = u_prompt
        if prompt is None and evaluated is not None and cached is not None:
            prompt = min(evaluated + cached, MAX_TOKEN_COUNT)
        completion = _count(timings.get("predicted_n"), "timings.predicted_n", strict)
        raw = _flatten({"timings": timings, **({"usage": usage} if usage else {})})
        return ServerStats(
            source=SOURCE_LLAMA_SERVER,
            prompt_tokens=prompt,
            evaluated_tokens=evaluated,
            cached_tokens=cached,
            prefill_s=_seconds(timings.get("prompt_ms"), 1e3, "timings.prompt_ms", strict),
            completion_tokens=completion if completion is not None else u_completion,
            decode_s=_seconds(timings.get("predicted_ms"), 1e3, "timings.predicted_ms", strict),
            raw=raw,
        )
    if any(key in data for key in _OLLAMA_KEYS):
        count = _count(data.get("prompt_eval_count"), "prompt_eval_count", strict)
        cached = _count(data.get("prompt_eval_cached_count"), "prompt_eval_cached_count", strict)
        if cached is not None and count is not None:
            prompt, evaluated = count, max(count - cached, 0)
        else:
            # Without the cached count (older Ollama, or Go's omitempty hiding a zero) the
            # count is what was evaluated; treating it as the whole prompt would mistake a
            # cache hit for truncation.
            prompt, evaluated = None, count
        keys = (*_OLLAMA_KEYS, "prompt_eval_cached_count", "total_duration", "load_duration")
        return ServerStats(
            source=SOURCE_OLLAMA,
            prompt_tokens=prompt,
            evaluated_tokens=evaluated,
            cached_tokens=cached,
            prefill_s=_seconds(data.get("prompt_eval_duration"), 1e9, "prompt_eval_duration", strict),
            completion_tokens=_count(data.get("eval_count"), "eval_count", strict),
            decode_s=_seconds(data.get("eval_duration"), 1e9, "eval_duration", strict),
            raw=_flatten({key: data[key] for key in keys if key in data}, depth=1),
        )
    if usage and (u_prompt is not None or u_completion is not None):
        return ServerStats(
            source=SOURCE_USAGE,
            prompt_tokens=u_prompt,
            evaluated_tokens=max(u_prompt - u_cached, 0) if u_prompt is not None and u_cached is not None else None,
            cached_tokens=u_cached,
            completion_tokens=u_completion,
            raw=_flatten({"usage": usage}),
        )
    return ServerStats()


def detect_truncation(
    sent_tokens: int | None,
    stats: ServerStats,
    *,
    predicted_cached: int = 0,
    tolerance_tokens: int = 0,
    context_tokens: int | None = None,
) -> int:
    """Prompt tokens the server silently dropped: ``sent_tokens`` (trimkit's count) minus what
    the server says it took in, when that exceeds ``tolerance_tokens`` (use 0 only when the
    count is exact). Logs a WARNING on ``trimkit`` when tokens are missing; returns 0 if the
    server did not say.

    When the server gives only the evaluated count (Ollama without a cached count), the tokens
    trimkit predicted to be cached are added to it. ``context_tokens``: the context window the
    request ran in (Ollama's ``num_ctx``, which trimkit set); a prompt counted over it of which
    the server took in no more than the window was cut, whatever the tolerance (an estimated
    count's tolerance would hide a cut of a prompt just over the window).
    """
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
    log.warning(
        "trimkit: the server took in %d prompt tokens but trimkit sent %d: %d tokens were silently "
        "truncated (the prompt is longer than the server's context window?)", seen, sent_tokens, missing,
    )
    return missing


def build_measurement(
    stats: ServerStats,
    *,
    ttft_s: float | None,
    total_s: float,
    first_output_s: float | None = None,
    client_decode_s: float | None = None,
    sent_tokens: int | None = None,
    finish_reason: str | None = None,
    truncated_tokens: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> Measurement:
    """A :class:`Measurement` showing the client TTFT and, where reported, the server's prefill.

    ``server`` holds the server's raw numbers, ``cached_tokens_reported`` and, when both times
    are known, ``network_overhead_s`` = client TTFT − server prefill time.
    """
    server: dict[str, Any] = dict(stats.raw)
    server["cached_tokens_reported"] = stats.cached_tokens is not None
    if sent_tokens is not None:
        server["sent_prompt_tokens"] = sent_tokens
    if ttft_s is not None and stats.prefill_s is not None:
        server["network_overhead_s"] = ttft_s - stats.prefill_s
    if extra:
        server.update(extra)
    return Measurement(
        ttft_s=ttft_s,
        total_s=total_s,
        first_output_s=first_output_s,
        prompt_tokens=stats.prompt_tokens if stats.prompt_tokens is not None else sent_tokens,
        cached_tokens=stats.cached_tokens,
        evaluated_tokens=stats.evaluated_tokens,
        engine_prefill_s=stats.prefill_s,
        completion_tokens=stats.completion_tokens,
        engine_decode_s=stats.decode_s,
        client_decode_s=client_decode_s,
        timing_source=stats.source,
        finish_reason=finish_reason,
        truncated_tokens=truncated_tokens,
        server=server,
    )
