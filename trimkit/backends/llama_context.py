"""What a llama.cpp context holds and reports, read through llama-cpp-python's low-level API.

- :func:`effective_n_ctx`: how many tokens a ``Llama`` can really hold;
- :func:`reset_perf` / :func:`read_perf`: the context's perf counters around one request, as
  :class:`PerfCounts` (prompt tokens evaluated, prefill and decode time);
- :class:`PrefixSnapshot`, :func:`save_sequence`, :func:`load_prefix`: the KV cells of a token
  prefix, copied out and put back without the logits buffer;
- :func:`cpu_name`: the host's CPU, part of every in-process profile key.

:class:`~trimkit.backends.llama.LlamaBackend` builds on these; none of them takes the engine's
lease (:mod:`trimkit.backends.lease`): the caller holds it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import llama_cpp

from trimkit.errors import BackendError


class AbortState:
    """Whether :func:`abort_when`'s predicate stopped the decode."""

    fired: bool = False


#: what llama.cpp logs (at error level) when a decode is stopped and its batch's cells are dropped
ABORT_NOTICE = b"removing memory module entries"
# the AbortState of the abortable decode running on this thread, if any
_RUNNING = threading.local()
_FILTER_LOCK = threading.Lock()
# the installed filter and the callback it forwards to (kept referenced while llama.cpp holds them)
_FILTER: list[Any] = []


def quiet_planned_aborts() -> bool:
    """Install, once per process, a llama.cpp log callback that drops :data:`ABORT_NOTICE` when
    it comes from a decode :func:`abort_when` stopped on the logging thread, and forwards every
    other message to the callback installed before it (``llama_log_get``; none: stderr, as
    llama.cpp would). False when this llama-cpp-python cannot say which callback was installed
    (nothing is changed then). An application that sets its own callback later replaces it."""
    with _FILTER_LOCK:
        if _FILTER:
            return True
        try:
            previous = llama_cpp.llama_log_callback()
            previous_data = ctypes.c_void_p()
            llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(previous_data))
        except (AttributeError, TypeError, ValueError, OSError):
            return False

        def forward(level: int, text: bytes | None, _data: Any) -> None:
            state = getattr(_RUNNING, "state", None)
            if state is not None and state.fired and text and ABORT_NOTICE in text:
                return
            if previous:
                previous(level, text, previous_data)
            elif text:
                os.write(2, text)

        callback = llama_cpp.llama_log_callback(forward)
        llama_cpp.llama_log_set(callback, None)
        _FILTER.extend((callback, previous, previous_data))
        return True


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
    quiet_planned_aborts()
    outer = getattr(_RUNNING, "state", None)
    _RUNNING.state = state
    llama_cpp.llama_set_abort_callback(llm._ctx.ctx, callback, None)
    try:
        yield state
    finally:
        llama_cpp.llama_set_abort_callback(llm._ctx.ctx, llama_cpp.ggml_abort_callback(), None)
        _RUNNING.state = outer
        del callback  # kept alive until llama.cpp no longer holds it


__all__ = [
    "effective_n_ctx",
    "cpu_name",
    "PerfCounts",
    "reset_perf",
    "read_perf",
    "PrefixSnapshot",
    "save_sequence",
    "load_prefix",
]


def effective_n_ctx(llm: Any) -> int:
    """The tokens a ``Llama`` can really hold: the smaller of llama.cpp's context size and
    llama-cpp-python's token buffer.

    llama.cpp rounds the context up to a multiple of 256 (``n_ctx=300`` gives 512), but
    ``Llama.__init__`` sizes ``input_ids`` (the record of evaluated tokens) to the ``n_ctx`` it
    was given, and ``Llama.eval`` writes every evaluated token there: past the requested size it
    fails with numpy's ``could not broadcast``, while ``Llama`` itself checks prompts against the
    rounded ``n_ctx()``."""
    ctx = int(llm.n_ctx())
    ids = getattr(llm, "input_ids", None)
    return min(ctx, len(ids)) if ids is not None else ctx


@functools.cache
def cpu_name() -> str:
    """The CPU model and core count (part of every in-process profile key)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"


# -- perf counters -------------------------------------------------------------------------------
@attrs.frozen
class PerfCounts:
    """One request's llama.cpp perf counters, split as trimkit measures a request.

    ``evaluated_tokens`` prompt tokens took ``prefill_s``; then ``decode_steps`` single-token
    steps took ``decode_s`` (the first output token belongs to the prefill). When a single
    prompt token was evaluated llama.cpp books it as a decode step: it is moved back here."""

    evaluated_tokens: int
    prefill_s: float
    decode_steps: int
    decode_s: float

    @classmethod
    def from_perf(cls, perf: Any) -> PerfCounts:
        """From llama.cpp's ``llama_perf_context_data`` (milliseconds and counts)."""
        t_p = float(perf.t_p_eval_ms) / 1000.0
        t_e = float(perf.t_eval_ms) / 1000.0
        n_e = int(perf.n_eval)
        if t_p > 0:
            return cls(int(perf.n_p_eval), t_p, n_e, t_e)
        step = t_e / n_e if n_e else 0.0
        return cls(1 if n_e > 0 else 0, step, max(n_e - 1, 0), max(t_e - step, 0.0))


def reset_perf(llm: Any) -> None:
    """Zero the context's perf counters before a request.

    Synchronizes first: llama.cpp books queued tokens of an earlier, unsynchronized eval at the
    next synchronize, which must not land in this request's counts."""
    llama_cpp.llama_synchronize(llm._ctx.ctx)
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)


def read_perf(llm: Any) -> PerfCounts:
    """The perf counters since :func:`reset_perf`."""
    return PerfCounts.from_perf(llama_cpp.llama_perf_context(llm._ctx.ctx))


# -- KV-only prefix snapshots ----------------------------------------------------------------------
@attrs.frozen
class PrefixSnapshot:
    """The KV state of a token prefix, and only that.

    ``Llama.save_state()`` would also copy the logits buffer — 512 MiB for Gemma's 262k
    vocabulary — so trimkit copies just the sequence's KV cells (``llama_state_seq_get_data``).
    ``restore_s`` is a measured restore time; it is counted in TTFT predictions that use it.
    """

    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    data: bytes = attrs.field(repr=False, eq=False)
    save_s: float = 0.0
    restore_s: float = 0.0

    @property
    def size_bytes(self) -> int:
        return len(self.data)


def save_sequence(llm: Any) -> bytes:
    """The KV cells of sequence 0 as they are now (what the context holds)."""
    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
    return bytes(buf[:written])


def load_prefix(llm: Any, tokens: Sequence[int], data: bytes) -> None:
    """Replace what the context holds with ``data`` (from :func:`save_sequence` after
    evaluating exactly ``tokens``), and tell llama-cpp-python which tokens it now holds.

    The logits are not part of a snapshot: the next eval re-evaluates at least one token."""
    llm._ctx.kv_cache_clear()
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    if not llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(data), 0):
        llm.n_tokens = 0
        raise BackendError("llama.cpp refused to restore a prefix snapshot")
    n = len(tokens)
    llm.input_ids[:n] = tokens
    llm.n_tokens = n
    llm._requires_eval = True
