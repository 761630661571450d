"""Backends: the seam between trimkit and a model engine.

A :class:`Backend` counts a prompt with the engine's own tokenizer and chat template, predicts
how much of it the engine still holds in its KV cache, sends a request as a
:class:`TimedStream` and turns what it saw into a :class:`Measurement`; calibration probes go
through it too. Two are built in:

- :class:`LlamaBackend` — a ``llama_cpp.Llama`` in this process (:mod:`trimkit.backends.llama`);
- :class:`OpenAIHTTPBackend` — an OpenAI-compatible server (llama.cpp server, Ollama, vLLM,
  SGLang, LM Studio), through the ``openai`` client or plain ``httpx``; :class:`ServerInfo`
  is what it learned about the server (engine, version, context size, tokenizer endpoint);
- :class:`OllamaBackend` — Ollama's native API (``/api/chat``) through an ``ollama.Client`` /
  ``ollama.AsyncClient`` (:mod:`trimkit.backends.ollama`).

``trimkit.wrap()`` picks the backend for the client you pass; build one yourself to set its
options (``OpenAIHTTPBackend(url, model=..., n_ctx=8192)``) and pass it to ``trimkit.wrap`` or
``trimkit.calibrate``. A fake engine for tests is :class:`trimkit.testing.FakeBackend`.
"""

from __future__ import annotations

from typing import Any

from trimkit.backends.base import Backend, Measurement, TimedStream
from trimkit.backends.http import OpenAIHTTPBackend, ServerInfo
from trimkit.backends.ollama import OllamaBackend
from trimkit.planning.costs import CacheState

__all__ = ["Backend", "CacheState", "Measurement", "TimedStream", "LlamaBackend", "OpenAIHTTPBackend", "OllamaBackend", "ServerInfo"]


def __getattr__(name: str) -> Any:
    """``LlamaBackend`` on first use: ``import trimkit`` imports no engine (``trimkit[llama]``)."""
    if name == "LlamaBackend":
        from trimkit.errors import require_extra

        return require_extra("trimkit.backends.llama", "llama", "LlamaBackend (an in-process engine)").LlamaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
