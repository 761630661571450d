"""What a server says about itself, parsed at the boundary: ``/v1/models``, llama.cpp's
``/props``, ``/version``, ``/openapi.json``, the tokenize endpoints and ``/apply-template``.
Pure functions, no I/O; the rules are those of :mod:`trimkit.backends.fields`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from trimkit.backends.fields import excerpt, fail, join_path, opt_list, opt_mapping, opt_str
from trimkit.backends.routing import RouterInfo
from trimkit.errors import MalformedReplyError

__all__ = [
    "MAX_CONTEXT_TOKENS",
    "MAX_TOKEN_ID",
    "ModelEntry",
    "ModelList",
    "parse_models",
    "parse_props",
    "parse_props_switches",
    "parse_version",
    "parse_openapi_version",
    "is_tokenize_reply",
    "parse_tokens",
    "parse_template",
    "parse_workers",
]

#: the largest context size a server may report, in tokens
MAX_CONTEXT_TOKENS = 1 << 26
#: the largest token id a tokenize endpoint may return
MAX_TOKEN_ID = 2**31 - 1
#: a server's version or build string is kept to this many characters (it goes into profile keys)
_MAX_VERSION_CHARS = 200


# -- sizes and versions ---------------------------------------------------------------------------------
def _context_size(value: Any, what: str, field: str) -> int | None:
    """A context size: None or 0 mean "not said"; else an integer 1..MAX_CONTEXT_TOKENS."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_CONTEXT_TOKENS:
        return value
    fail(what, field, f"a context size (1..{MAX_CONTEXT_TOKENS})", value)


def _version_text(value: Any, what: str, field: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value[:_MAX_VERSION_CHARS]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return excerpt(repr(value), _MAX_VERSION_CHARS)
    fail(what, field, "a version string", value)


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
        fail(what, "", "an object", body)
    data = opt_list(body, "data", what, "")
    entries = []
    for i, entry in enumerate(data or ()):
        path = f"data[{i}]"
        if not isinstance(entry, Mapping):
            fail(what, path, "an object", entry)
        meta = opt_mapping(entry, "meta", what, path) or {}
        n_ctx = _context_size(entry.get("max_model_len"), what, join_path(path, "max_model_len"))
        meta_ctx = _context_size(meta.get("n_ctx"), what, join_path(join_path(path, "meta"), "n_ctx"))
        entries.append(ModelEntry(
            id=opt_str(entry, "id", what, path),
            owned_by=opt_str(entry, "owned_by", what, path) or "",
            n_ctx=n_ctx if n_ctx is not None else meta_ctx,
        ))
    return ModelList(tuple(entries))


def parse_props(body: Any) -> tuple[int | None, str]:
    """``(n_ctx, build_info)`` from llama.cpp's ``/props``; ``(None, "")`` when the body is not
    an object (another engine's endpoint)."""
    what = "/props reply"
    if not isinstance(body, Mapping):
        return None, ""
    settings = opt_mapping(body, "default_generation_settings", what, "") or {}
    n_ctx = _context_size(settings.get("n_ctx"), what, "default_generation_settings.n_ctx")
    if n_ctx is None:
        n_ctx = _context_size(body.get("n_ctx"), what, "n_ctx")
    return n_ctx, _version_text(body.get("build_info"), what, "build_info")


def parse_props_switches(body: Any) -> dict[str, bool]:
    """The switches llama.cpp's ``/props`` reports, those it says: ``is_sleeping`` (it unloaded
    the model after ``--sleep-idle-seconds``; the next request pays a load), ``endpoint_metrics``
    (``--metrics``), ``endpoint_slots``. Empty when the body is not an object."""
    if not isinstance(body, Mapping):
        return {}
    out: dict[str, bool] = {}
    for key in ("is_sleeping", "endpoint_metrics", "endpoint_slots"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, bool):
            fail("/props reply", key, "a boolean", value)
        out[key] = value
    return out


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
    info = opt_mapping(body, "info", what, "")
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
        fail(what, "", "an object with tokens", body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        fail(what, "tokens", "an array of token ids", tokens)
    if len(tokens) > max_tokens:
        raise MalformedReplyError(f"the server sent a malformed {what}: {len(tokens)} tokens for a text that can have at most {max_tokens}",
                                  field="tokens", server_message=f"{len(tokens)} tokens")
    for i, token in enumerate(tokens):
        if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
            fail(what, f"tokens[{i}]", f"a token id (an integer 0..{MAX_TOKEN_ID})", token)
    return list(tokens)


def parse_template(body: Any) -> str:
    """``/apply-template``'s rendered ``prompt``."""
    what = "/apply-template reply"
    if not isinstance(body, Mapping):
        fail(what, "", "an object", body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        fail(what, "prompt", "a string", prompt)
    return prompt


#: the largest worker count or load a router may report
_MAX_WORKERS = 1 << 20


def _load(value: Any) -> int | None:
    """A worker's ``load`` (its requests in flight); None when absent, not an integer, or
    negative (vllm-router and sglang-router say -1 where their policy keeps no count)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_WORKERS:
        return value
    return None


def parse_workers(body: Any) -> RouterInfo | None:
    """A router's ``GET /workers`` (vllm-router 0.1.17, sglang-router 0.3.2:
    ``{"workers": [{"url": ..., "is_healthy": ..., "load": ...}, ...], "total": N, ...}``), or
    None when the body is not that (no router: the server has no such endpoint, or another
    one). Only the count, health and load are read; the workers' URLs are not kept (they may
    carry credentials and are the router's business). sglang-router's entries carry an ``id``
    (and ``disable_health_check``), vllm-router's do not."""
    if not isinstance(body, Mapping):
        return None
    workers = body.get("workers")
    if not isinstance(workers, list) or not workers or len(workers) > _MAX_WORKERS:
        return None
    if not all(isinstance(w, Mapping) and isinstance(w.get("url"), str) for w in workers):
        return None
    health = [w.get("is_healthy") for w in workers]
    healthy = sum(1 for h in health if h is True) if all(isinstance(h, bool) for h in health) else None
    sglang = any("id" in w or "disable_health_check" in w for w in workers)
    return RouterInfo(kind="sglang-router" if sglang else "vllm-router", workers=len(workers), healthy=healthy,
                      loads=tuple(_load(w.get("load")) for w in workers))
