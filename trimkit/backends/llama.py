"""Backend around the user's own ``llama_cpp.Llama`` (in-process llama.cpp), and what a llama.cpp
context holds and reports, read through llama-cpp-python's low-level API; Gemma 3's chat template.

It never calls ``Llama.reset()`` between requests: that would throw the cached prefix away. Every
:class:`LlamaBackend` over one ``Llama`` shares its :class:`~trimkit.planning.queue.EngineLease`;
a request holds it from ``send`` until its stream is finished, closed or garbage-collected.
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
from types import SimpleNamespace
from typing import Any

import attrs
import llama_cpp
from llama_cpp import Llama, llama_chat_format

from trimkit.backends.base import Backend, Clock, Measurement, TimedStream, first_token_overhead_s, probe_text
from trimkit.backends.llama_format import DEFAULT_MODEL, EMBEDDED_MODELS, default_model_path, handler_formatter, llama_prompt_tokenizer, model_identity
from trimkit.backends.replies import chunk_content, parse_chunk
from trimkit.errors import BackendError, ContextTooSmallError, InvalidInputError
from trimkit.messages import tool_call_lines
from trimkit.planning.costs import CacheState
from trimkit.planning.profile import ProfileKey, attention_doubling_prior, idle_expert_params
from trimkit.planning.queue import DEFAULT_ENGINE_WAIT_S, engine_lease
from trimkit.planning.summaries import PromptSummarizer
from trimkit.planning.tokens import common_prefix_len

log = logging.getLogger("trimkit")


#: what llama.cpp logs (at error level) when a decode is stopped and its batch's cells are dropped
ABORT_NOTICE = b"removing memory module entries"
_RUNNING = threading.local()  # the state of the abortable decode running on this thread
_FILTER_LOCK = threading.Lock()
_FILTER: list[Any] = []  # the installed filter and what it forwards to (kept referenced while llama.cpp holds them)


def quiet_planned_aborts() -> bool:
    """Install once a llama.cpp log callback that drops :data:`ABORT_NOTICE` after a planned abort
    on the logging thread and forwards the rest to the previous callback (none: stderr). False when
    this llama-cpp-python cannot say which callback was installed."""
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
def abort_when(llm: Any, should_abort: Callable[[], bool]) -> Iterator[SimpleNamespace]:
    """Within the block llama.cpp stops a decode of ``llm`` once ``should_abort()`` is true (or raises):
    ``Llama.eval`` then raises ``RuntimeError`` and ``.fired`` is set."""
    state = SimpleNamespace(fired=False)

    def check(_data: Any) -> bool:
        try:
            state.fired = state.fired or bool(should_abort())
        except Exception:  # never let an exception cross into C: stop instead
            state.fired = True
        return state.fired

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


def perf_counts(perf: Any) -> tuple[int, float, int, float]:
    """One request's llama.cpp perf counters (``llama_perf_context_data``): (evaluated tokens, prefill s, decode steps,
    decode s); a single evaluated prompt token, booked as a decode step, is moved back."""
    t_p, t_e, n_e = float(perf.t_p_eval_ms) / 1000.0, float(perf.t_eval_ms) / 1000.0, int(perf.n_eval)
    if t_p > 0:
        return int(perf.n_p_eval), t_p, n_e, t_e
    step = t_e / n_e if n_e else 0.0
    return 1 if n_e > 0 else 0, step, max(n_e - 1, 0), max(t_e - step, 0.0)


@attrs.frozen
class PrefixSnapshot:
    """The KV cells of a token prefix only (``Llama.save_state()`` would also copy the logits:
    512 MiB for Gemma's vocabulary). ``restore_s`` is a measured restore time."""

    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    data: bytes = attrs.field(repr=False, eq=False)
    save_s: float = 0.0
    restore_s: float = 0.0

    @property
    def size_bytes(self) -> int:
        return len(self.data)


class LlamaBackend(Backend):
    """In-process llama.cpp through llama-cpp-python. Every backend over one ``Llama`` shares its
    :class:`EngineLease` (``.engine``; ``with backend.lock:`` is a section of it); :meth:`send` waits
    at most ``engine_wait_s`` for it, and the stream gives it back when it ends, from any thread."""

    name = "llama_cpp"
    engine_wait_s: float = DEFAULT_ENGINE_WAIT_S

    def __init__(self, llm: Any, *, clock: Clock = time.perf_counter) -> None:
        self.llm = llm
        self.clock = clock
        self.tokenizer = llama_prompt_tokenizer(llm)
        self.engine = engine_lease(llm, clock)
        self.lock = self.engine
        self.prefix_reuse_works: bool | None = None  # learned from requests that should hit
        self._reuse_misses = 0
        self._probe_tokens: list[int] | None = None
        self.snapshots: dict[tuple[int, ...], PrefixSnapshot] = {}
        self.max_snapshots = 4
        self.attention_prior_tokens = llama_attention_prior(llm)

    @property
    def n_ctx(self) -> int:
        """What the ``Llama`` really holds: llama.cpp rounds ``n_ctx`` up to a multiple of 256, but ``Llama.eval``
        fails past the ``input_ids`` sized to the ``n_ctx`` asked for."""
        ids = getattr(self.llm, "input_ids", None)
        return min(int(self.llm.n_ctx()), len(ids)) if ids is not None else int(self.llm.n_ctx())

    def _window_text(self) -> str:
        n, ctx = self.n_ctx, int(self.llm.n_ctx())
        if ctx == n:
            return f"n_ctx={n}"
        return f"n_ctx={n} (llama.cpp rounded its context up to {ctx}, but this Llama holds only {n} tokens)"

    def hold_engine(self, timeout_s: float | None = None) -> AbstractContextManager[float]:
        """A section of the engine (``with backend.hold_engine(s) as waited:``), default bound :attr:`engine_wait_s`."""
        return self.engine.section(self.engine_wait_s if timeout_s is None else timeout_s)

    def engine_identity(self) -> Any:
        return self.llm

    def profile_key(self) -> ProfileKey:
        cp = self.llm.context_params
        return ProfileKey(
            backend=self.name, model=model_identity(self.llm.model_path), n_ctx=self.n_ctx, n_batch=int(self.llm.n_batch),
            n_ubatch=int(getattr(cp, "n_ubatch", 0)), n_threads=int(cp.n_threads), n_threads_batch=int(cp.n_threads_batch),
            flash_attn=str(getattr(cp, "flash_attn_type", getattr(cp, "flash_attn", ""))), n_gpu_layers=int(getattr(self.llm.model_params, "n_gpu_layers", 0)),
            engine_version=f"llama-cpp-python {llama_cpp.__version__}", cpu=cpu_name(),
            extra=f"type_k={getattr(cp, 'type_k', '')},type_v={getattr(cp, 'type_v', '')},swa_full={getattr(cp, 'swa_full', '')}",
        )

    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """The common prefix ``Llama.generate`` reuses, less the one token it always evaluates again."""
        return self.cache_state(()).cached(prompt_tokens)

    def cache_state(self, snaps: Sequence[PrefixSnapshot] | None = None) -> CacheState:
        """The context's tokens and the stored snapshots; nothing once partial KV removal failed on this model."""
        if self.prefix_reuse_works is False:
            return CacheState()
        snaps = list(self.snapshots.values()) if snaps is None else snaps  # another thread may store one
        return CacheState(prompts=(self.llm.input_ids[: self.llm.n_tokens],), snapshots=[(s.tokens, s.restore_s) for s in snaps])

    # -- requests ---------------------------------------------------------------------------
    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
             watch: Any = None) -> TimedStream:
        """Stream a chat completion. With ``watch`` (:class:`~trimkit.pipeline.WatchedPrefill`) the prompt is
        evaluated in steps (:meth:`evaluate_to`) at the start of the stream, and re-planned if it runs late."""
        llm = self.llm
        expected_prompt = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        if len(expected_prompt) >= self.n_ctx:  # llama-cpp-python needs room for one generated token
            raise ContextTooSmallError(f"prompt of {len(expected_prompt)} tokens does not fit the context window: {self._window_text()}")
        state: dict[str, Any] = {"prompt_len": len(expected_prompt)}
        release, waited = self.engine.hold(self.engine_wait_s)  # the stream's until it ends

        def chunks() -> Iterator[Any]:
            state["predicted_cached"] = self.predict_cached_tokens(expected_prompt)
            # synchronize first: llama.cpp books an earlier eval's queued tokens at the next synchronize
            llama_cpp.llama_synchronize(llm._ctx.ctx)
            llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
            try:
                to_send, tokens = messages, expected_prompt
                if watch is not None:
                    to_send, tokens = watch(self.evaluate_to, self.clock, state["predicted_cached"])
                    state["prompt_len"] = len(tokens)
                yield from llm.create_chat_completion(messages=list(to_send), **self._call(params, len(tokens)))
            finally:
                state["perf"] = perf_counts(llama_cpp.llama_perf_context(llm._ctx.ctx))

        def on_error(exc: BaseException) -> BaseException | None:
            if isinstance(exc, ValueError) and ("exceed context window" in str(exc) or "could not broadcast" in str(exc)):
                return ContextTooSmallError(f"prompt of {state['prompt_len']} tokens and its answer exceed the context window: {self._window_text()}")
            if isinstance(exc, (ValueError, RuntimeError)) and not isinstance(exc, BackendError):
                return BackendError(f"llama.cpp failed: {type(exc).__name__}: {exc}")
            return None

        return TimedStream(chunks(), started=None, clock=self.clock, content_of=chunk_content, finish=lambda ts: self._measurement(ts, state),
                           on_error=on_error, release=release, queue_s=waited)

    def _call(self, params: Mapping[str, Any], prompt_len: int) -> dict[str, Any]:
        """``create_chat_completion``'s arguments, streamed; ``max_tokens`` capped to the room left where
        llama.cpp rounded its context up past what the ``Llama`` holds."""
        call = {**params, "stream": True}
        room = self.n_ctx - prompt_len
        if self.n_ctx < int(self.llm.n_ctx()):
            max_tokens = call.get("max_tokens")
            if not isinstance(max_tokens, int) or max_tokens <= 0 or max_tokens > room:
                call["max_tokens"] = room
        return call

    def evaluate_to(self, tokens: Sequence[int], end: int) -> tuple[float, int]:
        """Make the context hold ``tokens[:end]`` (and what it held beyond it, if that matches), evaluating what it lacks
        in one batch: (seconds, where the evaluation started). The caller holds the engine: a watched prefill's step."""
        llm = self.llm
        target = list(tokens[:end])
        start = common_prefix_len(llm.input_ids[: llm.n_tokens], target) if self.prefix_reuse_works is not False else 0
        if start >= len(target):
            return 0.0, len(target)
        if 0 < start < llm.n_tokens and not llm._ctx.kv_cache_seq_rm(-1, start, -1):
            start = 0  # this context cannot drop part of its KV cache: evaluate from the start
        llm.n_tokens = start  # eval() drops the KV cells from n_tokens on first
        t0 = self.clock()
        llm.eval(target[start:])
        return self.clock() - t0, start

    def _measurement(self, ts: TimedStream, state: Mapping[str, Any]) -> Measurement:
        prompt_len = state["prompt_len"]
        finish_reason = parse_chunk(ts.last_chunk).finish_reason if ts.last_chunk is not None else None  # parsed once already
        common = dict(ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=ts.total_s, prompt_tokens=prompt_len,
                      client_decode_s=ts.client_decode_s, finish_reason=finish_reason, queue_s=ts.queue_s)
        if "perf" not in state:
            return Measurement(**common)
        evaluated, prefill_s, decode_steps, decode_s = state["perf"]
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
        return Measurement(**common, cached_tokens=cached, evaluated_tokens=evaluated, engine_prefill_s=prefill_s,
                           completion_tokens=decode_steps + 1 if (evaluated or decode_steps) else 0, engine_decode_s=decode_s,
                           timing_source="llama_perf")

    # -- calibration probes -------------------------------------------------------------------
    def probe_tokens(self, n: int) -> list[int]:
        """``n`` tokens of the packaged corpus (repeated), starting with BOS."""
        if self._probe_tokens is None or len(self._probe_tokens) < n:
            base = self.llm.tokenize(probe_text().encode("utf-8"), add_bos=False, special=False)
            bos = self.llm.token_bos()
            self._probe_tokens = ([bos] if bos >= 0 else []) + base * (n // max(len(base), 1) + 1)
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
            self.prefill(seq[:cached_tokens])  # none: the context emptied
            t0 = self.clock()
            llm.eval(seq[cached_tokens:])
            return self.clock() - t0

    def measure_prefill_within(self, new_tokens: int, cached_tokens: int, should_abort: Callable[[], bool]) -> float | None:
        """:meth:`measure_prefill`, stopped once ``should_abort()`` is true (None then, the context left empty):
        a probe that runs far past its prediction ends at calibration's deadline."""
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
        """Seconds per token of llama.cpp's tokenizer (fastest of three runs): every request tokenizes
        its whole prompt, cached tokens included, before the engine starts."""
        text = probe_text()[:chars].encode("utf-8")
        best, n = math.inf, 0
        for _ in range(3):
            t0 = self.clock()
            n = len(self.llm.tokenize(text, add_bos=False, special=True))
            best = min(best, self.clock() - t0)
        return best / n if n and math.isfinite(best) else None

    def measure_first_token_overhead(self) -> float:
        """Median of (client TTFT − engine prefill) over three short chat requests, EOS banned so content arrives."""
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
        """Make the context hold exactly ``tokens``, reusing the common prefix cached (prewarm, probes)."""
        self._check_fits(len(tokens))
        with self.hold_engine():
            self.evaluate_to(tokens, len(tokens))
            if self.llm.n_tokens > len(tokens):
                self.llm._ctx.kv_cache_seq_rm(-1, len(tokens), -1)
                self.llm.n_tokens = len(tokens)

    def save_prefix(self, tokens: Sequence[int]) -> PrefixSnapshot:
        """Prefill ``tokens`` and keep the KV cells of sequence 0 for reuse."""
        tokens = list(tokens)
        with self.hold_engine():
            t0 = self.clock()
            self.prefill(tokens)
            ctx = self.llm._ctx.ctx
            size = llama_cpp.llama_state_seq_get_size(ctx, 0)
            buf = (ctypes.c_uint8 * size)()
            written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
            snap = PrefixSnapshot(tuple(tokens), bytes(buf[:written]), save_s=self.clock() - t0)
            snap = attrs.evolve(snap, restore_s=self.restore_prefix(snap))  # measure once; leaves the same state
            self.snapshots[snap.tokens] = snap
            while len(self.snapshots) > self.max_snapshots:
                self.snapshots.pop(next(iter(self.snapshots)))
            return snap

    def restore_prefix(self, snap: PrefixSnapshot) -> float:
        """Load ``snap`` into the context (the next eval re-evaluates at least one token). Returns seconds taken."""
        llm = self.llm
        with self.hold_engine():
            t0 = self.clock()
            llm._ctx.kv_cache_clear()
            buf = (ctypes.c_uint8 * len(snap.data)).from_buffer_copy(snap.data)
            if not llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(snap.data), 0):
                llm.n_tokens = 0
                raise BackendError("llama.cpp refused to restore a prefix snapshot")
            n = len(snap.tokens)
            llm.input_ids[:n] = snap.tokens
            llm.n_tokens = n
            llm._requires_eval = True
            return self.clock() - t0

    def best_cache(self, prompt_tokens: Sequence[int], cost: Any = None) -> tuple[int, PrefixSnapshot | None]:
        """Cached tokens for ``prompt_tokens`` and the snapshot to restore first (if predicted faster, by ``cost``)."""
        snaps = list(self.snapshots.values())
        cached, which = self.cache_state(snaps).best(prompt_tokens, cost)
        return cached, None if which is None else snaps[which]


def llama_summarizer(llm: Any, *, n_ctx: int = 4096, max_tokens: int = 200, **llama_kwargs: Any) -> Any:
    """A :class:`~trimkit.planning.summaries.PromptSummarizer` running the same model on a separate
    llama.cpp context (sharing the memory-mapped weights), so summarizing never evicts the KV cache."""
    lock = threading.Lock()
    side_llama = functools.cache(lambda: llama_cpp.Llama(model_path=llm.model_path, n_ctx=n_ctx, verbose=False,
                                                         chat_format=getattr(llm, "chat_format", None), **llama_kwargs))

    def complete(prompt: str) -> str:
        with lock:
            side: Any = side_llama()
            tokens = side.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
            if len(tokens) > n_ctx - max_tokens - 8:  # keep the newest part of an over-long transcript
                prompt = side.detokenize(tokens[-(n_ctx - max_tokens - 8):]).decode("utf-8", "ignore")
            out = side.create_chat_completion(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.2)
            return out["choices"][0]["message"]["content"] or ""

    return PromptSummarizer(complete, max_tokens=max_tokens, name="llama-separate-context")


# -- Gemma 3's chat template as a llama-cpp-python chat handler ---------------------------------------------

GEMMA3_CHAT_FORMAT = "gemma-3"
_START = "<start_of_turn>"
_END = "<end_of_turn>\n"


def _content_text(content: Any, *, trim: bool) -> str:
    """A message's content as text: a string, or its text parts (each trimmed when ``trim``) concatenated."""
    if isinstance(content, str):
        return content.strip() if trim else content
    if content is None or not isinstance(content, Sequence):
        return ""
    texts = [part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)]
    return "".join(t.strip() if trim else t for t in texts)


def format_gemma3(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> Any:
    """Render ``messages`` with Gemma 3's chat template, as a llama-cpp-python ``ChatFormatter``
    (BOS left to the tokenizer; stop ``<end_of_turn>``); other keyword arguments are ignored."""
    out: list[str] = []
    pending: list[str] = []  # system/developer text waiting for the next user turn

    def flush_system() -> None:
        if pending:
            out.append(f"{_START}user\n" + "\n\n".join(pending).strip() + _END)
            pending.clear()

    for message in messages or ():
        if not isinstance(message, Mapping):
            continue
        role, content = message.get("role"), message.get("content")
        if role in ("system", "developer"):
            pending.append(_content_text(content, trim=False))
        elif role == "assistant":
            flush_system()
            text = "\n".join([t for t in [_content_text(content, trim=True)] if t] + tool_call_lines(message))
            out.append(f"{_START}model\n{text}{_END}")
        else:  # user, and tool/function results (and any unknown role): a user turn
            head = "\n\n".join(pending) + "\n\n" if pending else ""
            pending.clear()
            out.append(f"{_START}user\n{head}{_content_text(content, trim=True)}{_END}")
    flush_system()
    if add_generation_prompt:
        out.append(f"{_START}model\n")
    return llama_chat_format.ChatFormatterResponse(prompt="".join(out), stop=_END.rstrip("\n"), added_special=False)


#: ``Llama(chat_handler=...)`` for :func:`format_gemma3`; it closes over it as ``chat_formatter``, which is how trimkit finds it
gemma3_chat_handler = llama_chat_format.chat_formatter_to_chat_completion_handler(format_gemma3)


_registry = llama_chat_format.LlamaChatCompletionHandlerRegistry()
_existing = _registry._chat_handlers.get(GEMMA3_CHAT_FORMAT)
if _existing is None or getattr(handler_formatter(_existing), "__module__", None) == __name__:  # free, or ours (a reload)
    _registry.register_chat_completion_handler(GEMMA3_CHAT_FORMAT, gemma3_chat_handler, overwrite=True)
else:  # pragma: no cover - a future llama-cpp-python might ship its own "gemma-3"
    log.debug("trimkit: chat format %r is already registered; default_llama() passes its own handler", GEMMA3_CHAT_FORMAT)


def default_llama(model: str = DEFAULT_MODEL, **llama_kwargs: Any) -> Any:
    """An embedded model (``"smollm2"``, ``"gemma"`` with :data:`gemma3_chat_handler`) as a ``llama_cpp.Llama``
    with ``n_ctx=8192, verbose=False``; any ``Llama`` keyword overrides these (with ``model_path``, ``model``
    only chooses the template)."""
    if model not in EMBEDDED_MODELS:
        raise InvalidInputError(f"unknown embedded model {model!r}: one of {', '.join(map(repr, EMBEDDED_MODELS))}")
    kwargs: dict[str, Any] = {"n_ctx": 8192, "verbose": False}
    if model == "gemma" and "chat_format" not in llama_kwargs and "chat_handler" not in llama_kwargs:
        kwargs.update(chat_format=GEMMA3_CHAT_FORMAT, chat_handler=gemma3_chat_handler)
    kwargs.update(llama_kwargs)
    if kwargs.get("model_path") is None:
        kwargs["model_path"] = default_model_path(model)
    return Llama(**kwargs)


def server_command(*server_args: str, python: str | None = None) -> list[str]:
    """The command line for ``python -m llama_cpp.server SERVER_ARGS…`` with ``"gemma-3"`` registered first."""
    launcher = "import runpy, trimkit.backends.llama; runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)"
    return [python or sys.executable, "-c", launcher, *server_args]


def _int(value: Any) -> int | None:
    try:
        out = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return out if out > 0 else None


def llama_attention_prior(llm: Any) -> float | None:
    """:func:`attention_doubling_prior` from the loaded model's counts and GGUF metadata; None when any
    of it cannot be read (the fit then has no prior, as for a server)."""
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
