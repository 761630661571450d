"""Routing keys, and the routers that read them (docs/scaling.md §3).

The routers of vLLM and SGLang fleets keep a conversation on one worker when each request
carries a key: ``vllm-router`` reads ``x-session-id`` with its ``consistent_hash`` and
``sticky_least_loaded`` policies, ``sglang-router`` reads ``x-smg-routing-key`` with its
``manual`` policy. trimkit sends both (:data:`ROUTING_HEADERS`) when a call carries a key —
given per call (``create(..., routing_key="user-42")``) or derived per conversation
(:func:`conversation_key`: a digest of the conversation's first messages, never the text).

:class:`RouterInfo` is what trimkit learned of a router in front of the workers (its
``GET /workers``, parsed by :func:`~trimkit.backends.server.parse_workers`), and says
what trimkit's probes could and could not see through it. No I/O.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidInputError

__all__ = [
    "ROUTING_HEADERS",
    "MAX_ROUTING_KEY_CHARS",
    "NOT_GIVEN",
    "RouterInfo",
    "RoutingOptions",
    "check_routing_key",
    "check_routing_headers",
    "conversation_key",
    "current_key",
    "key_of",
    "planning_for",
    "routing_headers",
]

#: the headers a routing key is sent in: vllm-router's (``consistent_hash``, ``sticky_least_loaded``)
#: and sglang-router's (``manual``)
ROUTING_HEADERS = ("x-session-id", "x-smg-routing-key")
#: the longest routing key trimkit sends
MAX_ROUTING_KEY_CHARS = 256
#: a key is visible ASCII (spaces inside allowed): what an HTTP header value carries unchanged
_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
#: a header name (RFC 9110 token characters)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: what a key derived from a conversation starts with
_KEY_PREFIX = "tk-"


def check_routing_key(key: Any) -> str:
    """A routing key as given, or :class:`~trimkit.errors.InvalidInputError` (before anything
    is sent): a str of 1..:data:`MAX_ROUTING_KEY_CHARS` visible ASCII characters (spaces only
    inside) — what a header carries unchanged. The error never repeats the key."""
    if not isinstance(key, str):
        raise InvalidInputError(f"routing_key must be a str, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_ROUTING_KEY_CHARS:
        raise InvalidInputError(f"routing_key must have 1..{MAX_ROUTING_KEY_CHARS} characters, got {len(key)}")
    if not _KEY.fullmatch(key):
        raise InvalidInputError("routing_key must be visible ASCII (spaces only inside, no control characters): it is sent as an HTTP header")
    return key


def check_routing_headers(names: Any) -> tuple[str, ...]:
    """The header names a routing key goes in: a non-empty sequence of header names."""
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise InvalidInputError(f"routing_headers must be a non-empty list of header names, got {names!r:.80}")
    out = []
    for name in names:
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise InvalidInputError(f"routing_headers: {name!r:.80} is not an HTTP header name")
        out.append(name.lower())
    return tuple(dict.fromkeys(out))


def _first_messages(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The leading system / developer messages and the first message after them."""
    head: list[Any] = []
    for m in messages:
        head.append([m.get("role"), m.get("content")])
        if m.get("role") not in ("system", "developer"):
            break
    return head


def conversation_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """A stable routing key for the conversation ``messages`` belong to: ``tk-`` and 32 hex
    digits of the SHA-256 of its first messages (the leading system messages and the first
    message after them), which later turns do not change. A digest, never the text: it goes to
    the router in a header. Conversations that open alike (same system prompt, same first
    question) share a key, and so a worker — where their common prefix is cached."""
    canonical = json.dumps(_first_messages(messages), sort_keys=True, ensure_ascii=False, default=repr, separators=(",", ":"))
    return _KEY_PREFIX + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def routing_headers(key: str | None, names: Sequence[str] = ROUTING_HEADERS) -> dict[str, str]:
    """The headers that carry ``key`` (none without one)."""
    return {} if key is None else {name: key for name in names}


def key_of(headers: Mapping[str, str] | None) -> str | None:
    """The routing key a request's own headers carry (:func:`routing_headers` put it in each)."""
    return next(iter(headers.values()), None) if headers else None


#: the routing key of the call being planned in this context (a front-end sets it around
#: planning, :func:`planning_for`): behind a router, the backend predicts the cache against the
#: last prompt sent with that key — the worker the router keeps the conversation on
current_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("trimkit_routing_key", default=None)


@contextlib.contextmanager
def planning_for(key: str | None) -> Iterator[None]:
    """Plan a call with routing key ``key`` (:data:`current_key`) inside the block."""
    token = current_key.set(key)
    try:
        yield
    finally:
        current_key.reset(token)


@attrs.frozen
class RouterInfo:
    """A router in front of the workers, recognised by its ``GET /workers``.

    ``kind``: ``"vllm-router"`` or ``"sglang-router"`` (the SGLang Model Gateway), told apart by
    the fields of its worker entries (sglang-router's carry an ``id``); ``workers`` how many it
    routes to (``healthy`` of them healthy, when it says); ``loads`` each worker's ``load`` as
    the router reported it when probed (its in-flight count; -1 or None: not tracked by the
    router's policy); ``models_own``: ``/v1/models`` was the router's own answer (sglang-router
    lists model ``unknown`` owned by ``local``), not a worker's; ``seen`` / ``unseen``: what
    trimkit's probes reached through it, and what not."""

    kind: str
    workers: int
    healthy: int | None = None
    loads: tuple[int | None, ...] = ()
    models_own: bool = False
    seen: tuple[str, ...] = ()
    unseen: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for logs and reports (no URL, no key)."""
        healthy = f", {self.healthy} healthy" if self.healthy is not None else ""
        seen = ", ".join(self.seen) if self.seen else "nothing"
        text = (f"behind {self.kind} ({self.workers} worker{'s' if self.workers != 1 else ''}{healthy}): trimkit's probes saw {seen}; "
                f"they could not see {'; '.join(self.unseen) or 'more'}")
        if self.kind == "sglang-router":
            text += ("; sglang-router forwards max_tokens as max_completion_tokens (an engine that ignores it runs on: trimkit warns "
                     "when an answer runs past max_tokens) and only x-smg-routing-key of the routing headers")
        return text


#: a per-call ``routing_key`` not given (``None`` given means: no key for this call)
NOT_GIVEN: Any = object()


@attrs.frozen
class RoutingOptions:
    """A wrapper's routing-key settings: ``auto`` derives a key per conversation
    (:func:`conversation_key`) for calls that give none; ``headers`` are the header names a key
    is sent in (:data:`ROUTING_HEADERS`)."""

    auto: bool = False
    headers: tuple[str, ...] = ROUTING_HEADERS

    @classmethod
    def of(cls, auto_routing_key: Any = False, routing_headers: Any = None) -> RoutingOptions:
        """Validated (:class:`~trimkit.errors.InvalidInputError` at once)."""
        if not isinstance(auto_routing_key, bool):
            raise InvalidInputError(f"auto_routing_key must be True or False, got {type(auto_routing_key).__name__}")
        names = ROUTING_HEADERS if routing_headers is None else check_routing_headers(routing_headers)
        return cls(auto=auto_routing_key, headers=names)

    def key(self, given: Any, messages: Sequence[Mapping[str, Any]]) -> str | None:
        """The key of a call: the one it gave (validated; ``None``: none for this call), else
        with ``auto`` the conversation's (``messages`` must be valid messages by then)."""
        if given is not NOT_GIVEN:
            return None if given is None else check_routing_key(given)
        return conversation_key(messages) if self.auto else None

    def headers_for(self, given: Any, messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        """The headers of a call (none without a key)."""
        return routing_headers(self.key(given, messages), self.headers)
