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
from collections.abc import Sequence
from typing import Any

import attrs
import llama_cpp

from trimkit.errors import BackendError

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
