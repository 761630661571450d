"""One reading of a chat stream, for every backend: the text a chunk carries, and the
``chat.completion`` a finished stream amounts to (chunks as dicts, ``openai`` objects or parsed
replies, from llama-cpp-python or any OpenAI-compatible server)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from trimkit.backends.replies import Reply, parse_chunk

__all__ = ["assemble_chat_completion", "as_chat_completion", "chunk_content", "probe_output"]


def chunk_content(chunk: Any) -> str | None:
    """The generated text a chat or completion chunk carries (dict or ``openai`` object):
    ``""`` for a finish chunk without text, ``None`` for a bare role delta or a usage-only
    chunk. Tool calls and reasoning count as content: they are the first generated tokens.
    A malformed chunk raises :class:`~trimkit.errors.MalformedReplyError`."""
    return parse_chunk(chunk).output


def probe_output(reply: Reply) -> str | None:
    """Completion probes: every chunk with a choice is a generated token, even one whose text
    is an empty piece of a multi-byte character; a text-less finish chunk is not."""
    if not reply.choices:
        return None
    choice = reply.choices[0]
    return "·" if choice.text or not choice.finish_reason else ""


def assemble_chat_completion(chunks: Sequence[Any], stats_chunk: Any = None, *, usage: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Rebuild a non-streaming ``chat.completion`` dict from the chunks of a finished stream
    (dicts, ``openai`` objects or parsed replies): content, tool-call and logprob pieces joined per
    choice, the last finish reason, and ``usage`` if the server reported it (else ``None``).
    ``usage`` stands in where no chunk carries one (llama-cpp-python streams report none).
    A malformed chunk raises :class:`~trimkit.errors.MalformedReplyError`."""
    replies = [parse_chunk(c) for c in chunks]
    first = replies[0] if replies else None
    choices: dict[int, dict[str, Any]] = {}
    for reply in replies:
        for ch in reply.choices:
            acc = choices.setdefault(ch.index, {"index": ch.index, "parts": [], "tools": {}, "finish_reason": None, "role": "assistant", "logprobs": None})
            if ch.role:
                acc["role"] = ch.role
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
            if ch.finish_reason:
                acc["finish_reason"] = ch.finish_reason
    out_choices = []
    for idx in sorted(choices):
        acc = choices[idx]
        message: dict[str, Any] = {"role": acc["role"], "content": "".join(acc["parts"]) if acc["parts"] or not acc["tools"] else None}
        if acc["tools"]:
            message["tool_calls"] = [acc["tools"][k] for k in sorted(acc["tools"])]
        logprobs = {"content": acc["logprobs"]} if acc["logprobs"] is not None else None
        out_choices.append({"index": idx, "message": message, "finish_reason": acc["finish_reason"], "logprobs": logprobs})
    stats = parse_chunk(stats_chunk) if stats_chunk is not None else None
    return {
        "id": first.id if first is not None and first.id is not None else "",
        "object": "chat.completion",
        "created": first.created if first is not None and first.created is not None else int(time.time()),
        "model": first.model if first is not None and first.model is not None else "",
        "system_fingerprint": first.system_fingerprint if first is not None else None,
        "choices": out_choices,
        "usage": dict(stats.usage) if stats is not None and stats.usage is not None else (dict(usage) if usage is not None else None),
    }


def as_chat_completion(response: dict[str, Any]) -> Any:
    """An assembled ``chat.completion`` dict as the ``openai`` client's ``ChatCompletion`` (the
    dict itself without ``openai`` installed)."""
    try:
        from openai.types.chat import ChatCompletion  # optional dependency
    except ImportError:  # pragma: no cover
        return response
    try:
        return ChatCompletion.model_validate(response)
    except Exception:
        return ChatCompletion.model_construct(**response)
