"""Backends: the seam between trimkit and a model engine (:class:`Backend`).

Built in: :class:`LlamaBackend` (a ``llama_cpp.Llama`` in this process), :class:`OpenAIHTTPBackend`
(an OpenAI-compatible server) and :class:`OllamaBackend` (Ollama's native API). ``trimkit.wrap()``
picks one for the client you pass; build one yourself to set its options.
"""

from __future__ import annotations

from typing import Any

from trimkit.backends.base import Backend, Measurement, TimedStream
from trimkit.backends.http import OpenAIHTTPBackend, ServerInfo
from trimkit.backends.ollama import OllamaBackend
from trimkit.planning.costs import CacheState

__all__ = ["Backend", "CacheState", "Measurement", "TimedStream", "LlamaBackend", "OpenAIHTTPBackend", "OllamaBackend", "ServerInfo"]


def __getattr__(name: str) -> Any:
    """``LlamaBackend`` on first use: ``import trimkit`` imports no engine."""
    if name == "LlamaBackend":
        from trimkit.errors import require_extra

        return require_extra("trimkit.backends.llama", "llama", "LlamaBackend (an in-process engine)").LlamaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
