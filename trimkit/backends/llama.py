"""Backend around the user's own ``llama_cpp.Llama`` object (in-process llama.cpp), and what a
llama.cpp context holds and reports, read through llama-cpp-python's low-level API.

Times TTFT at the first streamed chunk carrying content, reads exact prefill/decode timings from
``llama_perf_context`` (:class:`PerfCounts`), and predicts the cached prefix as llama-cpp-python
computes it. It never calls ``Llama.reset()`` between requests: that would throw the cached
prefix away. Every :class:`LlamaBackend` over one ``Llama`` shares its
:class:`~trimkit.planning.queue.EngineLease`; a request holds it from ``send`` until its stream is
finished, closed or garbage-collected, in whichever thread that happens. The context helpers
below (perf counters, KV-only :class:`PrefixSnapshot`, :func:`abort_when`) take no lease: the
caller holds it. The chat template and tokenizer are :mod:`trimkit.backends.llama_format`'s.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import attrs
import llama_cpp
from llama_cpp import Llama, llama_chat_format

from trimkit.backends.base import Backend, Clock, Measurement, TimedStream, first_token_overhead_s, probe_text
from trimkit.backends.llama_format import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    default_model_path,
    handler_formatter,
    llama_prompt_tokenizer,
    model_identity,
)
from trimkit.backends.replies import chunk_content
from trimkit.errors import BackendError, ContextTooSmallError, InvalidInputError
from trimkit.planning.costs import CacheState
from trimkit.planning.profile import ProfileKey, attention_doubling_prior, idle_expert_params
from trimkit.planning.queue import DEFAULT_ENGINE_WAIT_S, engine_lease
from trimkit.planning.summaries import PromptSummarizer
from trimkit.planning.tokens import common_prefix_len, reusable_prefix_len

log = logging.getLogger("trimkit")


# == the context: what it holds and reports ==================================================================

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


# == the backend =============================================================================================

class LlamaBackend(Backend):
    """In-process llama.cpp through llama-cpp-python. Serializes access to the one ``Llama``.

    Every backend over the same ``Llama`` shares its :class:`EngineLease` (``.engine``; ``with
    backend.lock:`` is a section of it). :meth:`send` takes the engine for the stream it
    returns, waiting at most ``engine_wait_s`` (:data:`DEFAULT_ENGINE_WAIT_S`; the wrapper waits
    at most the request's TTFT budget instead); the stream gives it back when finished, closed
    or garbage-collected, from any thread.
    """

    name = "llama_cpp"
    #: seconds a request without a budget, or a probe, waits for the engine before EngineBusyError
    engine_wait_s: float = DEFAULT_ENGINE_WAIT_S

    def __init__(self, llm: Any, *, clock: Clock = time.perf_counter) -> None:
        self.llm = llm
        self.clock = clock
        self.tokenizer = llama_prompt_tokenizer(llm)
        self.engine = engine_lease(llm)
        #: a section of :attr:`engine` with the default bound (``with backend.lock:``)
        self.lock = self.engine
        self.prefix_reuse_works: bool | None = None  # learned from requests that should hit
        self._reuse_misses = 0
        self._probe_tokens: list[int] | None = None
        self.snapshots: dict[tuple[int, ...], PrefixSnapshot] = {}
        self.max_snapshots = 4
        self.attention_prior_tokens = llama_attention_prior(llm)

    # -- facts ------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """The context window trimkit plans with: :func:`effective_n_ctx` (what the ``Llama``
        can really hold, which is less than ``llm.n_ctx()`` when llama.cpp rounded it up)."""
        return effective_n_ctx(self.llm)

    def _window_text(self) -> str:
        n, ctx = self.n_ctx, int(self.llm.n_ctx())
        if ctx == n:
            return f"n_ctx={n}"
        return f"n_ctx={n} (llama.cpp rounded its context up to {ctx}, but this Llama holds only {n} tokens)"

    def hold_engine(self, timeout_s: float | None = None) -> AbstractContextManager[float]:
        """A section of the engine for this thread (``with backend.hold_engine(s) as waited:``),
        waiting at most ``timeout_s`` (default :attr:`engine_wait_s`)."""
        return self.engine.section(self.engine_wait_s if timeout_s is None else timeout_s)

    def engine_identity(self) -> Any:
        """The ``Llama`` itself: every backend over it shares its live state."""
        return self.llm

    def profile_key(self) -> ProfileKey:
        cp = self.llm.context_params
        mp = self.llm.model_params
        return ProfileKey(
            backend=self.name,
            model=model_identity(self.llm.model_path),
            n_ctx=self.n_ctx,
            n_batch=int(self.llm.n_batch),
            n_ubatch=int(getattr(cp, "n_ubatch", 0)),
            n_threads=int(cp.n_threads),
            n_threads_batch=int(cp.n_threads_batch),
            flash_attn=str(getattr(cp, "flash_attn_type", getattr(cp, "flash_attn", ""))),
            n_gpu_layers=int(getattr(mp, "n_gpu_layers", 0)),
            engine_version=f"llama-cpp-python {llama_cpp.__version__}",
            cpu=cpu_name(),
            extra=f"type_k={getattr(cp, 'type_k', '')},type_v={getattr(cp, 'type_v', '')},swa_full={getattr(cp, 'swa_full', '')}",
        )

    def cached_tokens_in_context(self) -> Sequence[int]:
        """The tokens the next request will find in the context."""
        return self.llm.input_ids[: self.llm.n_tokens]

    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """What ``Llama.generate`` will reuse: the longest common prefix, but at least one token is
        always evaluated again (0 if partial KV removal failed on this model before)."""
        if self.prefix_reuse_works is False:
            return 0
        held = self.cached_tokens_in_context()
        return reusable_prefix_len(held, prompt_tokens) if len(held) else 0

    def cache_state(self) -> CacheState:
        """The context's tokens and the stored snapshots (:meth:`best_cache`'s), as data; nothing
        once partial KV removal failed on this model."""
        if self.prefix_reuse_works is False:
            return CacheState()
        snapshots = [(snap.tokens, snap.restore_s) for snap in list(self.snapshots.values())]  # another thread may store one
        return CacheState(prompts=(self.cached_tokens_in_context(),), snapshots=snapshots)

    # -- requests ---------------------------------------------------------------------------
    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
             watch: Any = None) -> TimedStream:
        """Stream a chat completion from the ``Llama``. ``watch``: the driver of a watched prefill
        (:class:`~trimkit.pipeline.WatchedPrefill`): the prompt is then evaluated in steps
        (:meth:`evaluate_to`) at the start of the stream, re-planned if its pace says the first
        token would come too late, and generated from at once (llama-cpp-python samples straight
        from a prompt its context holds whole, evaluating no token twice)."""
        llm = self.llm
        expected_prompt = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        window = self.n_ctx
        if len(expected_prompt) >= window:  # llama-cpp-python needs room for one generated token
            raise ContextTooSmallError(f"prompt of {len(expected_prompt)} tokens does not fit the context window: {self._window_text()}")
        state: dict[str, Any] = {"prompt_len": len(expected_prompt)}
        # the engine is this stream's from now until it is finished, closed or collected
        release, waited = self.engine.hold(self.engine_wait_s)

        def chunks() -> Iterator[Any]:
            state["predicted_cached"] = self.predict_cached_tokens(expected_prompt)
            reset_perf(llm)
            try:
                to_send, tokens = messages, expected_prompt
                if watch is not None:
                    to_send, tokens = watch(self.evaluate_to, self.clock, state["predicted_cached"])
                    state["prompt_len"] = len(tokens)
                stream = llm.create_chat_completion(messages=list(to_send), **self._call(params, len(tokens)))
                yield from stream
            finally:
                state["perf"] = read_perf(llm)

        def finish(ts: TimedStream) -> Measurement:
            return self._measurement(ts, state, state["prompt_len"])

        def on_error(exc: BaseException) -> BaseException | None:
            if isinstance(exc, ValueError) and ("exceed context window" in str(exc) or "could not broadcast" in str(exc)):
                return ContextTooSmallError(f"prompt of {state['prompt_len']} tokens and its answer exceed the context window: {self._window_text()}")
            if isinstance(exc, (ValueError, RuntimeError)) and not isinstance(exc, BackendError):
                return BackendError(f"llama.cpp failed: {type(exc).__name__}: {exc}")
            return None

        return TimedStream(chunks(), started=None, clock=self.clock, content_of=chunk_content, finish=finish, on_error=on_error,
                           release=release, queue_s=waited)

    def _call(self, params: Mapping[str, Any], prompt_len: int) -> dict[str, Any]:
        """The keyword arguments of ``create_chat_completion``: the caller's, streamed; where
        llama.cpp rounded its context up past what the ``Llama`` holds, ``max_tokens`` capped
        where it would cap it with a consistent window."""
        call = dict(params)
        call["stream"] = True
        window = self.n_ctx
        if window < int(self.llm.n_ctx()):
            room = window - prompt_len
            max_tokens = call.get("max_tokens")
            if not isinstance(max_tokens, int) or max_tokens <= 0 or max_tokens > room:
                call["max_tokens"] = room
        return call

    def evaluate_to(self, tokens: Sequence[int], end: int) -> tuple[float, int]:
        """One step of a watched prefill: make the context hold ``tokens[:end]``, keeping what it
        holds of them already and evaluating the rest in one batch. Returns (seconds, where the
        evaluation started). The caller holds the engine."""
        llm = self.llm
        target = list(tokens[:end])
        start = common_prefix_len(llm.input_ids[: llm.n_tokens], target) if self.prefix_reuse_works is not False else 0
        if start >= len(target):
            return 0.0, len(target)
        if start < llm.n_tokens and start > 0 and not llm._ctx.kv_cache_seq_rm(-1, start, -1):
            start = 0  # this context cannot drop part of its KV cache: evaluate from the start
        llm.n_tokens = start  # eval() drops the KV cells from n_tokens on first
        t0 = self.clock()
        llm.eval(target[start:])
        return self.clock() - t0, start

    def _measurement(self, ts: TimedStream, state: Mapping[str, Any], prompt_len: int) -> Measurement:
        perf: PerfCounts | None = state.get("perf")
        finish_reason = None
        if ts.last_chunk is not None:
            try:
                finish_reason = ts.last_chunk["choices"][0].get("finish_reason")
            except (KeyError, IndexError, TypeError):
                pass
        total, client_decode = ts.total_s, ts.client_decode_s
        if perf is None:
            return Measurement(ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=total, prompt_tokens=prompt_len,
                               client_decode_s=client_decode, finish_reason=finish_reason, queue_s=ts.queue_s)
        evaluated = perf.evaluated_tokens
        cached = max(prompt_len - evaluated, 0)
        predicted = state.get("predicted_cached", 0)
        if predicted > 0 and cached == 0 and evaluated >= prompt_len:
            self._reuse_misses += 1
            if self._reuse_misses >= 2 and self.prefix_reuse_works is not False:
                log.warning("trimkit: llama.cpp re-evaluated the whole prompt although %d tokens were cached, twice; "
                            "this model/context cannot drop part of its KV cache (SWA?), assuming no reuse", predicted)
                self.prefix_reuse_works = False
        elif cached > 0:
            self._reuse_misses = 0
            self.prefix_reuse_works = True
        return Measurement(
            ttft_s=ts.ttft_s,
            first_output_s=ts.first_output_s,
            total_s=total,
            prompt_tokens=prompt_len,
            cached_tokens=cached,
            evaluated_tokens=evaluated,
            engine_prefill_s=perf.prefill_s,
            completion_tokens=perf.decode_steps + 1 if (evaluated or perf.decode_steps) else 0,
            engine_decode_s=perf.decode_s,
            client_decode_s=client_decode,
            timing_source="llama_perf",
            finish_reason=finish_reason,
            queue_s=ts.queue_s,
        )

    # -- calibration probes -------------------------------------------------------------------
    def probe_tokens(self, n: int) -> list[int]:
        """``n`` tokens of real text (the packaged corpus, repeated), starting with BOS."""
        if self._probe_tokens is None or len(self._probe_tokens) < n:
            text = probe_text()
            base = self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
            reps = n // max(len(base), 1) + 1
            bos = self.llm.token_bos()
            self._probe_tokens = ([bos] if bos >= 0 else []) + base * reps
        return self._probe_tokens[:n]

    def _check_fits(self, n: int) -> None:
        if n > self.n_ctx:
            raise ContextTooSmallError(f"probe of {n} tokens does not fit the context window: {self._window_text()}")

    def warm_up(self) -> None:
        with self.hold_engine():
            self.llm.reset()
            self.llm.eval(self.probe_tokens(min(64, self.n_ctx // 2)))
            self.llm.reset()

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        self._check_fits(new_tokens + cached_tokens)
        llm = self.llm
        seq = self.probe_tokens(new_tokens + cached_tokens)
        with self.hold_engine():
            if cached_tokens == 0:
                llm.reset()
            else:
                self.prefill(seq[:cached_tokens])
            t0 = self.clock()
            llm.eval(seq[cached_tokens:])
            return self.clock() - t0

    def measure_prefill_within(self, new_tokens: int, cached_tokens: int, should_abort: Callable[[], bool]) -> float | None:
        """:meth:`measure_prefill`, stopped as soon as ``should_abort()`` is true (llama.cpp asks
        it while it computes): None then, and the context is left empty. Calibration passes its
        deadline, so a probe that runs far longer than predicted (the host slowed down while it
        ran) ends at the deadline instead of overrunning it."""
        self._check_fits(new_tokens + cached_tokens)
        with self.hold_engine(), abort_when(self.llm, should_abort) as abort:
            try:
                return self.measure_prefill(new_tokens, cached_tokens)
            except RuntimeError:
                if not abort.fired:
                    raise
                self.llm.reset()  # the next eval drops what the stopped one left
                return None

    def measure_decode(self, n_tokens: int = 32) -> float:
        llm = self.llm
        seq = self.probe_tokens(16 + n_tokens)
        with self.hold_engine():
            llm.reset()
            llm.eval(seq[:16])
            t0 = self.clock()
            for tok in seq[16 : 16 + n_tokens]:
                llm.eval([tok])
            elapsed = self.clock() - t0
            llm.reset()
        return n_tokens / elapsed

    def measure_tokenize_s_per_token(self, chars: int = 4000) -> float | None:
        """Seconds per token llama.cpp's tokenizer takes: the fastest of three runs over
        ``chars`` characters of the probe corpus (~1,000 tokens). Every request tokenizes its
        whole prompt, cached tokens included, before the engine starts: the part of the
        first-token overhead that grows with the conversation. None when nothing was tokenized."""
        text = probe_text()[:chars].encode("utf-8")
        best, n = math.inf, 0
        for _ in range(3):
            t0 = self.clock()
            n = len(self.llm.tokenize(text, add_bos=False, special=True))
            best = min(best, self.clock() - t0)
        return best / n if n and math.isfinite(best) else None

    def measure_first_token_overhead(self) -> float:
        """Median of (client TTFT − engine prefill) over three short real chat requests.

        End-of-sequence is banned for these probes (``logit_bias``) so that a content chunk
        always arrives, whatever the model would have answered."""
        eos = self.llm.token_eos()
        bias = {str(eos): -100.0} if eos >= 0 else None
        text = probe_text()

        def probe(i: int) -> Measurement:
            msgs = [{"role": "user", "content": f"Probe {i}: " + text[i * 97 : i * 97 + 160]}]
            with self.hold_engine():  # cold, and nothing runs between the reset and the probe
                self.llm.reset()
                return self.send(msgs, {"max_tokens": 2, "temperature": 0.0, "logit_bias": bias}).drain()

        return first_token_overhead_s(probe(i) for i in range(3))

    # -- KV-only prefix snapshots -------------------------------------------------------------
    def prefill(self, tokens: Sequence[int]) -> None:
        """Make the context hold exactly ``tokens``: reuse the common prefix already cached,
        evaluate the rest, and drop KV cells past them. Off the critical path (prewarm, probes)."""
        tokens = list(tokens)
        self._check_fits(len(tokens))
        llm = self.llm
        with self.hold_engine():
            lcp = common_prefix_len(llm.input_ids[: llm.n_tokens], tokens)
            llm.n_tokens = lcp
            if lcp < len(tokens):
                llm.eval(tokens[lcp:])  # eval() drops the KV cells from n_tokens on first
            else:
                llm._ctx.kv_cache_seq_rm(-1, len(tokens), -1)

    def save_prefix(self, tokens: Sequence[int]) -> PrefixSnapshot:
        """Prefill ``tokens`` (what is not cached already) and keep their KV state for reuse."""
        tokens = list(tokens)
        self._check_fits(len(tokens))
        with self.hold_engine():
            t0 = self.clock()
            self.prefill(tokens)
            data = save_sequence(self.llm)
            save_s = self.clock() - t0
            snap = PrefixSnapshot(tuple(tokens), data, save_s=save_s)
            restore_s = self.restore_prefix(snap)  # measure once; leaves the same state
            snap = attrs.evolve(snap, restore_s=restore_s)
            self.snapshots[snap.tokens] = snap
            while len(self.snapshots) > self.max_snapshots:
                self.snapshots.pop(next(iter(self.snapshots)))
            return snap

    def restore_prefix(self, snap: PrefixSnapshot) -> float:
        """Load ``snap`` into the context (replacing what is there). Returns seconds taken."""
        with self.hold_engine():
            t0 = self.clock()
            load_prefix(self.llm, snap.tokens, snap.data)
            return self.clock() - t0

    def best_cache(self, prompt_tokens: Sequence[int], cost: Any = None) -> tuple[int, PrefixSnapshot | None]:
        """Cached tokens for ``prompt_tokens`` and the snapshot to restore first (or None).

        A snapshot is chosen only if restoring it and prefilling the rest is predicted faster
        than prefilling after what the context already holds (``cost(new, cached)`` → seconds).
        """
        if self.prefix_reuse_works is False:
            return 0, None
        snaps = list(self.snapshots.values())  # another thread may store one meanwhile
        state = CacheState(prompts=(self.cached_tokens_in_context(),), snapshots=[(s.tokens, s.restore_s) for s in snaps])
        cached, which = state.best(prompt_tokens, cost)
        return cached, None if which is None else snaps[which]


def llama_summarizer(llm: Any, *, n_ctx: int = 4096, max_tokens: int = 200, **llama_kwargs: Any) -> Any:
    """A :class:`~trimkit.planning.summaries.PromptSummarizer` running the same model on a *separate*
    llama.cpp context, so summarizing never evicts the conversation's KV cache.

    The weights are memory-mapped, so the second context shares them with ``llm``; it adds its
    own KV cache (``n_ctx`` tokens). Summaries run off the critical path (after a response, in
    the background, or on ``chat.idle()``).
    """
    lock = threading.Lock()
    holder: dict[str, Any] = {}

    def complete(prompt: str) -> str:
        with lock:
            if "llm" not in holder:
                holder["llm"] = llama_cpp.Llama(
                    model_path=llm.model_path,
                    n_ctx=n_ctx,
                    verbose=False,
                    chat_format=getattr(llm, "chat_format", None),
                    **llama_kwargs,
                )
            side = holder["llm"]
            tokens = side.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
            if len(tokens) > n_ctx - max_tokens - 8:  # keep the newest part of an over-long transcript
                prompt = side.detokenize(tokens[-(n_ctx - max_tokens - 8):]).decode("utf-8", "ignore")
            out = side.create_chat_completion(
                messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.2
            )
            return out["choices"][0]["message"]["content"] or ""

    return PromptSummarizer(complete, max_tokens=max_tokens, name="llama-separate-context")


# -- Gemma 3's chat template as a llama-cpp-python chat handler, and the embedded models opened as ``Llama``. ---

#: The name the Gemma 3 handler is registered under in llama-cpp-python's handler registry.
GEMMA3_CHAT_FORMAT = "gemma-3"

_START = "<start_of_turn>"
_END = "<end_of_turn>\n"
_SYSTEM_ROLES = ("system", "developer")


def _content_text(content: Any, *, trim: bool) -> str:
    """A message's content as text: a string, or the text parts of a list (each trimmed when
    ``trim``), concatenated as Gemma's template does. Anything else contributes nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip() if trim else content
    if isinstance(content, Sequence):
        out = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"].strip() if trim else part["text"])
        return "".join(out)
    return ""


def _call_lines(message: Mapping[str, Any]) -> list[str]:
    """An assistant message's tool calls as ``name(arguments)`` lines."""
    calls: list[Any] = list(message.get("tool_calls") or [])
    if message.get("function_call"):
        calls.append({"function": message["function_call"]})
    lines = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            lines.append(f"{fn.get('name', '')}({fn.get('arguments', '')})")
    return lines


def format_gemma3(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> Any:
    """Render ``messages`` with Gemma 3's chat template (see the module docstring).

    A llama-cpp-python ``ChatFormatter``: returns a ``ChatFormatterResponse`` with the prompt
    (BOS left to the tokenizer: ``added_special=False``) and the stop string ``<end_of_turn>``.
    Other keyword arguments (``tools``, ``functions``, …) are accepted and ignored.
    """
    out: list[str] = []
    pending: list[str] = []  # system/developer text waiting for the next user turn

    def flush_system() -> None:
        if pending:
            out.append(f"{_START}user\n" + "\n\n".join(pending).strip() + _END)
            pending.clear()

    for message in messages or ():
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        content = message.get("content")
        if role in _SYSTEM_ROLES:
            pending.append(_content_text(content, trim=False))
            continue
        if role == "assistant":
            flush_system()
            text = "\n".join([t for t in [_content_text(content, trim=True)] if t] + _call_lines(message))
            out.append(f"{_START}model\n{text}{_END}")
            continue
        # user, and tool/function results (and any unknown role): a user turn
        head = "\n\n".join(pending) + "\n\n" if pending else ""
        pending.clear()
        out.append(f"{_START}user\n{head}{_content_text(content, trim=True)}{_END}")
    flush_system()
    if add_generation_prompt:
        out.append(f"{_START}model\n")
    return llama_chat_format.ChatFormatterResponse(prompt="".join(out), stop=_END.rstrip("\n"), added_special=False)


#: The llama-cpp-python chat completion handler for :func:`format_gemma3` (pass it as
#: ``Llama(chat_handler=...)``). It closes over the formatter as ``chat_formatter``, which is
#: how trimkit finds the template to count tokens exactly as the model sees them.
gemma3_chat_handler = llama_chat_format.chat_formatter_to_chat_completion_handler(format_gemma3)


def _register() -> None:
    registry = llama_chat_format.LlamaChatCompletionHandlerRegistry()
    existing = registry._chat_handlers.get(GEMMA3_CHAT_FORMAT)
    formatter = handler_formatter(existing)
    if existing is None or getattr(formatter, "__module__", None) == __name__:
        # free, or ours from an earlier import of this module (a reload): (re)register
        registry.register_chat_completion_handler(GEMMA3_CHAT_FORMAT, gemma3_chat_handler, overwrite=True)
    else:  # pragma: no cover - a future llama-cpp-python might ship its own "gemma-3"
        log.debug("trimkit: chat format %r is already registered; default_llama() passes its own handler", GEMMA3_CHAT_FORMAT)


_register()


def default_llama(model: str = DEFAULT_MODEL, **llama_kwargs: Any) -> Any:
    """An embedded model as a ``llama_cpp.Llama`` whose chat template keeps system prompts.

    ``model="smollm2"`` (the default) is SmolLM2-135M-Instruct, an instruction-tuned model that
    answers, with the ChatML template its GGUF carries. ``model="gemma"`` is Gemma-3-270M, the
    pretrained base model (a prefill workload; it continues text rather than answering), opened
    with :data:`gemma3_chat_handler` (Gemma 3's own template, see this module). Both get
    ``n_ctx=8192`` and ``verbose=False``; any ``Llama`` keyword passes through and overrides them
    (``model_path``, ``n_ctx``, ``n_threads``, ``chat_format``, ``chat_handler``, …): with
    ``model_path``, ``model`` only chooses the template. Nothing is downloaded: see
    :func:`trimkit.backends.llama_format.default_model_path` for the packages.
    """
    if model not in EMBEDDED_MODELS:
        raise InvalidInputError(f"unknown embedded model {model!r}: one of {', '.join(map(repr, EMBEDDED_MODELS))}")
    kwargs: dict[str, Any] = {"n_ctx": 8192, "verbose": False}
    if model == "gemma" and "chat_format" not in llama_kwargs and "chat_handler" not in llama_kwargs:
        kwargs.update(chat_format=GEMMA3_CHAT_FORMAT, chat_handler=gemma3_chat_handler)
    kwargs.update(llama_kwargs)
    if kwargs.get("model_path") is None:
        kwargs["model_path"] = default_model_path(model)
    return Llama(**kwargs)


#: Python code that registers ``"gemma-3"`` and then runs llama-cpp-python's server.
_SERVER_LAUNCHER = (
    "import runpy, trimkit.backends.llama; "
    "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)"
)


def server_command(*server_args: str, python: str | None = None) -> list[str]:
    """The command line for ``python -m llama_cpp.server SERVER_ARGS…`` with ``"gemma-3"``
    registered first, so ``--chat_format gemma-3`` works (llama_cpp.server itself knows only
    its built-in names). Needs ``llama-cpp-python[server]``."""
    return [python or sys.executable, "-c", _SERVER_LAUNCHER, *server_args]


def _int(value: Any) -> int | None:
    try:
        out = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return out if out > 0 else None


def llama_attention_prior(llm: Any) -> float | None:
    """:func:`attention_doubling_prior` for a ``llama_cpp.Llama``, from the loaded model's own
    counts (llama.cpp's ``llama_model_n_params``, ``_n_layer``, ``_n_head``) and the GGUF's
    ``<arch>.attention.key_length`` (default: the embedding width over the heads). None when
    any of it cannot be read: the fit then has no prior, as for a server."""
    try:
        model = llm.model
        n_params = int(llama_cpp.llama_model_n_params(model))
        n_layer = int(llama_cpp.llama_model_n_layer(model))
        n_head = int(llama_cpp.llama_model_n_head(model))
        n_embd, n_vocab = int(llm.n_embd()), int(llm.n_vocab())
        metadata = getattr(llm, "metadata", None) or {}
    except Exception:  # a stand-in Llama, an engine build without these calls: no prior
        return None
    arch = metadata.get("general.architecture", "")
    head_dim = _int(metadata.get(f"{arch}.attention.key_length")) if arch else None
    if head_dim is None and n_head > 0:
        head_dim = n_embd // n_head
    if head_dim is None:
        return None
    idle = 0.0
    experts, used = _int(metadata.get(f"{arch}.expert_count")), _int(metadata.get(f"{arch}.expert_used_count"))
    if experts and used:  # a mixture of experts: only the used experts' weights cost a token anything
        ff = _int(metadata.get(f"{arch}.expert_feed_forward_length")) or _int(metadata.get(f"{arch}.feed_forward_length"))
        if ff is None:
            return None  # the unused share cannot be told: no prior rather than one far too flat
        idle = idle_expert_params(n_layer=n_layer, n_embd=n_embd, expert_count=experts, expert_used_count=used, expert_ff=ff)
    return attention_doubling_prior(n_params=n_params, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                                    head_dim=head_dim, idle_params=idle)


