"""Idle work on a llama.cpp context that must never delay a request: an abortable decode, and the
context copied and put back around it.

- :func:`abort_when`: llama.cpp asks a Python predicate while it computes and stops the decode
  when it says so (``llama_set_abort_callback``; ``llama_decode`` returns 2 and llama-cpp-python
  raises ``RuntimeError``). Installed for one block only: a Python call per graph node would slow
  every request.
- :func:`context_kept`: copies what the context holds (its tokens and the KV cells of sequence
  0), lets the block use the context, and puts the copy back however the block ends; meanwhile
  :func:`tokens_kept` answers with the tokens that will be put back, so a request planned during
  the block finds the cache it was planned for.

:meth:`~trimkit.backends.llama.LlamaBackend.idle_probe` builds on these; the caller holds the
engine's lease.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import llama_cpp

from trimkit.backends.llama_context import load_prefix

__all__ = ["AbortState", "abort_when", "context_kept", "tokens_kept"]

# the tokens each Llama will hold again once the idle work running on it ends
_KEPT: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()


class AbortState:
    """Whether :func:`abort_when`'s predicate stopped the decode."""

    fired: bool = False


@contextmanager
def abort_when(llm: Any, should_abort: Callable[[], bool]) -> Iterator[AbortState]:
    """Within the block llama.cpp stops a decode of ``llm`` as soon as ``should_abort()`` is true
    (``llama_decode`` returns 2, so ``Llama.eval`` raises ``RuntimeError``; ``.fired`` tells it
    from another failure). A predicate that raises counts as true."""
    state = AbortState()

    def check(_data: Any) -> bool:
        try:
            stop = bool(should_abort())
        except Exception:  # never let an exception cross into C: stop instead
            stop = True
        if stop:
            state.fired = True
        return stop

    callback = llama_cpp.ggml_abort_callback(check)
    llama_cpp.llama_set_abort_callback(llm._ctx.ctx, callback, None)
    try:
        yield state
    finally:
        llama_cpp.llama_set_abort_callback(llm._ctx.ctx, llama_cpp.ggml_abort_callback(), None)
        del callback  # kept alive until llama.cpp no longer holds it


def _copy_kv(llm: Any) -> bytes:
    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
    return ctypes.string_at(buf, written)


@contextmanager
def context_kept(llm: Any) -> Iterator[None]:
    """Use ``llm``'s context for the block and put back what it held: its tokens and KV cells
    (an empty context is reset: the next eval drops every stale cell first)."""
    n = int(llm.n_tokens)
    tokens = tuple(int(t) for t in llm.input_ids[:n])
    data = _copy_kv(llm) if n else b""
    _KEPT[llm] = tokens
    try:
        yield
    finally:
        try:
            if tokens:
                load_prefix(llm, tokens, data)
            else:
                llm.reset()
        finally:
            _KEPT.pop(llm, None)


def tokens_kept(llm: Any) -> tuple[int, ...] | None:
    """The tokens ``llm``'s context will hold again when the idle work on it ends (None: none runs)."""
    return _KEPT.get(llm)
