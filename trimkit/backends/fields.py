"""Reading the JSON a server sent, at the boundary: bounded decoding (:func:`load_json`) and the
typed field readers every reply parser uses (:func:`opt_str`, :func:`opt_int`, …). A value the
protocol does not allow raises :class:`~trimkit.errors.MalformedReplyError` naming its field
(``choices[0].delta``); ``null`` reads as "not said". Pure functions, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NoReturn

from trimkit.backends.server_timings import as_mapping
from trimkit.errors import MalformedReplyError

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_REPLY_BYTES",
    "MAX_EVENT_BYTES",
    "as_object",
    "check_depth",
    "describe",
    "excerpt",
    "fail",
    "join_path",
    "load_json",
    "opt_int",
    "opt_list",
    "opt_mapping",
    "opt_str",
]

#: JSON nested deeper than this (objects and arrays) is refused; real replies are < 10 deep
MAX_JSON_DEPTH = 64
#: the largest whole reply body read, in bytes (a non-streamed answer, a tokenize reply, …)
MAX_REPLY_BYTES = 64 * 1024 * 1024
#: the largest single server-sent event, in bytes
MAX_EVENT_BYTES = 8 * 1024 * 1024


# -- what was wrong ---------------------------------------------------------------------------------------
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


# -- field readers ------------------------------------------------------------------------------------
def opt_str(obj: Mapping[str, Any], key: str, what: str, path: str) -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    fail(what, join_path(path, key), "a string", value)


def opt_int(obj: Mapping[str, Any], key: str, what: str, path: str, hi: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= hi:
        return value
    fail(what, join_path(path, key), f"an integer 0..{hi}", value)


def opt_mapping(obj: Mapping[str, Any], key: str, what: str, path: str) -> Mapping[str, Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, Mapping):
        return value
    fail(what, join_path(path, key), "an object", value)


def opt_list(obj: Mapping[str, Any], key: str, what: str, path: str) -> list[Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, list):
        return value
    fail(what, join_path(path, key), "an array", value)


def as_object(obj: Any, what: str) -> Mapping[str, Any]:
    """A reply as a mapping: dicts as they are, the ``openai`` client's objects dumped."""
    data = as_mapping(obj)
    if data is None:
        fail(what, "", "a JSON object", obj)
    return check_depth(data, what)
