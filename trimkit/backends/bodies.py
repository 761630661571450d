"""The requests trimkit sends to an OpenAI-compatible server, decided without I/O: the body of a
chat request (the caller's parameters, the model, and ``stream_options`` asking for usage) and
of a calibration probe, and what to do when a server refuses ``stream_options``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trimkit.backends.limits import Deadline
from trimkit.errors import ServerError

__all__ = ["ChatCall", "chat_body", "probe_body", "refuses_stream_options"]

_USAGE = {"include_usage": True}


@attrs.frozen
class ChatCall:
    """A chat request decided: the prompt as counted (``sent``), its predicted cached prefix,
    the body, whether the usage-only chunk is trimkit's own (``hide_usage``), and how long its
    first chunk may take."""

    sent: list[int]
    predicted: int
    body: dict[str, Any]
    hide_usage: bool
    deadline: Deadline
    #: headers of this request only (a routing key: :mod:`trimkit.backends.routing`)
    headers: Mapping[str, str] = attrs.field(factory=dict)


def chat_body(messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], model: str | None, *, stream: bool,
              include_usage: bool) -> tuple[dict[str, Any], bool]:
    """``(body, hide_usage)``: the caller's parameters as given, the model if known, and for a
    stream ``stream_options`` asking for usage (unless the caller set it or the server refuses
    it): then the usage-only chunk is trimkit's, not to be handed on."""
    body: dict[str, Any] = {"messages": list(messages), **params, "stream": stream}
    if model:
        body["model"] = model
    hide = stream and "stream_options" not in params and include_usage
    if hide:
        body["stream_options"] = dict(_USAGE)
    elif not stream:
        body.pop("stream_options", None)
    return body, hide


def probe_body(text: str, model: str | None, *, max_tokens: int, include_usage: bool, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A streamed ``/v1/completions`` calibration probe: raw prompt text, greedy."""
    body: dict[str, Any] = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, **(extra or {})}
    if model:
        body["model"] = model
    if include_usage:
        body["stream_options"] = dict(_USAGE)
    return body


def refuses_stream_options(exc: ServerError, body: Mapping[str, Any]) -> bool:
    """Did the server refuse the request for its ``stream_options`` (ask again without)?"""
    return "stream_options" in body and exc.status in (400, 422) and "stream_options" in exc.server_message
