"""What kind of client the caller handed over: the one place trimkit asks.

``wrap()``, calibration and the HTTP backend all dispatch through these checks, so a
client-like object is judged the same way everywhere.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Literal

from trimkit.backends.base import Backend

__all__ = ["ClientKind", "client_kind", "is_llama", "is_openai_client", "is_ollama_client", "client_is_async"]

#: what :func:`client_kind` says a target is
ClientKind = Literal["backend", "wrapper", "llama", "openai", "ollama"]


def client_kind(target: Any) -> ClientKind | None:
    """What ``target`` is: a trimkit Backend, a trimkit wrapper (a Backend at ``.backend``), a
    ``llama_cpp.Llama``, an OpenAI-style client, an ``ollama`` client; None: none of these. The one dispatch that
    ``wrap()`` and calibration both use."""
    if isinstance(target, Backend):
        return "backend"
    if isinstance(getattr(target, "backend", None), Backend):
        return "wrapper"
    if is_llama(target):
        return "llama"
    if is_openai_client(target):
        return "openai"
    if is_ollama_client(target):
        return "ollama"
    return None


def is_llama(client: Any) -> bool:
    """A ``llama_cpp.Llama`` (or subclass), without importing llama_cpp when it is not loaded."""
    llama_cpp = sys.modules.get("llama_cpp")
    Llama = getattr(llama_cpp, "Llama", None) if llama_cpp is not None else None
    return Llama is not None and isinstance(client, Llama)


def is_openai_client(client: Any) -> bool:
    """An ``openai.OpenAI``-style client: anything with a callable ``.chat.completions.create``."""
    create = getattr(getattr(getattr(client, "chat", None), "completions", None), "create", None)
    return callable(create)


def is_ollama_client(client: Any) -> bool:
    """An ``ollama.Client`` / ``ollama.AsyncClient`` (or subclass): a ``chat`` method and the
    ``httpx`` client it sends through (``._client``), from the ``ollama`` package."""
    module = type(client).__module__ or ""
    http = getattr(client, "_client", None)
    httpx = sys.modules.get("httpx")
    return (module.split(".")[0] == "ollama" and callable(getattr(client, "chat", None)) and httpx is not None
            and isinstance(http, (httpx.Client, httpx.AsyncClient)))


def client_is_async(client: Any) -> bool:
    """Whether an OpenAI-style client's ``chat.completions.create`` must be awaited."""
    create = client.chat.completions.create
    if inspect.iscoroutinefunction(inspect.unwrap(create)):
        return True
    return type(client).__name__.startswith("Async")
