"""Backend around the user's own ``llama_cpp.Llama`` object (in-process llama.cpp).

Times TTFT at the first streamed chunk carrying content, reads exact prefill/decode timings
from ``llama_cpp.llama_perf_context``, and predicts the cached prefix as llama-cpp-python
computes it (longest common token prefix with what is in the context). It never calls
``Llama.reset()`` between requests — that would throw the cached prefix away.

One ``Llama`` is one engine: every :class:`LlamaBackend` over it shares one
:class:`EngineLease`, and a request holds it from ``send`` until its stream is finished, closed
or garbage-collected — in whichever thread that happens.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

from trimkit.backends.base import Backend, Clock, Measurement, TimedStream
from trimkit.errors import BackendError, ContextTooSmallError, EngineBusyError
from trimkit.profile import ProfileKey
from trimkit.tokens import PromptTokenizer, chatml_render, common_prefix_len

__all__ = [
    "LlamaBackend",
    "EngineLease",
    "DEFAULT_ENGINE_WAIT_S",
    "effective_n_ctx",
    "chat_format_renderer",
    "PrefixSnapshot",
    "llama_prompt_tokenizer",
    "cpu_name",
    "chunk_content",
]

log = logging.getLogger("trimkit")

#: how long a request without a TTFT budget (and each calibration or prefill step) waits for the
#: engine while another request or an unfinished stream holds it, before EngineBusyError
DEFAULT_ENGINE_WAIT_S = 120.0


class EngineLease:
    """Who may use one ``Llama`` now: one request at a time.

    Two kinds of holder. A *section* (``with lease.section(timeout_s):``) is a block of ordinary
    code in one thread — prefill, a probe, restoring a snapshot; re-entrant for that thread,
    never held across a ``yield``. A *stream hold* (:meth:`hold`) belongs to a response stream,
    not to a thread: it is released (once) by whoever finishes, closes or garbage-collects the
    stream, from any thread. A thread inside a section may take a stream hold at once (the
    wrapper restores a snapshot and starts the stream as one step); the hold outlives the section.

    Waiting is bounded: past ``timeout_s`` a waiter gets :class:`~trimkit.errors.EngineBusyError`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._thread: int | None = None  # the thread whose section holds the engine
        self._depth = 0  # nesting depth of that section
        self._streams = 0  # open stream holds
        self._waiters = 0  # threads waiting now
        self._local = threading.local()  # ``with lease:`` sections entered by each thread

    @property
    def busy(self) -> bool:
        """True while a section or a stream holds the engine."""
        with self._cond:
            return self._depth > 0 or self._streams > 0

    @property
    def waiters(self) -> int:
        """Threads waiting for the engine now."""
        with self._cond:
            return self._waiters

    def _wait(self, timeout_s: float, what: str) -> float:
        """Wait (under ``_cond``) until this thread may use the engine; seconds waited."""
        me = threading.get_ident()

        def free() -> bool:
            return (self._depth == 0 and self._streams == 0) or (self._depth > 0 and self._thread == me)

        if free():
            return 0.0
        t0 = time.perf_counter()
        self._waiters += 1
        try:
            ok = self._cond.wait_for(free, timeout=max(float(timeout_s), 0.0))
        finally:
            self._waiters -= 1
        waited = time.perf_counter() - t0
        if not ok:
            holder = "an unfinished stream" if self._streams else "another thread"
            raise EngineBusyError(
                f"the llama.cpp engine stayed busy ({holder} holds it) for {waited:.3f} s, this {what}'s wait bound; "
                "finish or close() streams you do not read to the end",
                waited_s=waited,
            )
        return waited

    @contextmanager
    def section(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S) -> Iterator[float]:
        """Hold the engine for a block of code in this thread; yields the seconds waited."""
        with self._cond:
            waited = self._wait(timeout_s, "call")
            self._thread = threading.get_ident()
            self._depth += 1
        try:
            yield waited
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._thread = None
                    self._cond.notify_all()

    def hold(self, timeout_s: float = DEFAULT_ENGINE_WAIT_S) -> tuple[Any, float]:
        """Take the engine for a stream: ``(release, seconds waited)``; ``release()`` may be
        called from any thread, and only its first call counts."""
        with self._cond:
            waited = self._wait(timeout_s, "request")
            self._streams += 1
        done = threading.Lock()

        def release() -> None:
            if not done.acquire(blocking=False):
                return
            with self._cond:
                self._streams -= 1
                self._cond.notify_all()

        return release, waited

    def __enter__(self) -> float:  # ``with backend.lock:`` — a section with the default bound
        cm = self.section()
        waited = cm.__enter__()
        self._entered().append(cm)
        return waited

    def __exit__(self, *exc: Any) -> None:
        self._entered().pop().__exit__(*exc)

    def _entered(self) -> list[Any]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack


_ENGINES: weakref.WeakKeyDictionary[Any, EngineLease] = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def _engine_lease(llm: Any) -> EngineLease:
    """The one lease of ``llm``, shared by every backend over it."""
    with _ENGINES_LOCK:
        try:
            lease = _ENGINES.get(llm)
            if lease is None:
                lease = _ENGINES[llm] = EngineLease()
            return lease
        except TypeError:  # not weak-referenceable: this backend's own
            return EngineLease()


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
    """The CPU model (part of every profile key)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"


class _LlamaTextTokenizer:
    exact = True

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.name = "llama.cpp:" + os.path.basename(getattr(llm, "model_path", "model"))

    def encode(self, text: str) -> list[int]:
        # a message segment: no BOS, special tokens parsed as the template's prompt will be
        return self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def _handler_formatter(handler: Any) -> Any:
    """The ChatFormatter a llama-cpp-python chat handler closes over, or None."""
    code = getattr(handler, "__code__", None)
    if code is None or getattr(handler, "__closure__", None) is None:
        return None
    cell = dict(zip(code.co_freevars, handler.__closure__)).get("chat_formatter")
    return cell.cell_contents if cell is not None else None


def chat_format_renderer(chat_format: str) -> Any:
    """``render(messages, tools=None) -> str`` for a llama-cpp-python chat format name
    ("gemma", "chatml", "llama-3", …) or a Jinja chat template string.

    Use it to count tokens exactly for a server whose template you know but which has no
    template endpoint (llama-cpp-python's server started with ``--chat_format``)."""
    from llama_cpp import llama_chat_format

    from trimkit.errors import InvalidInputError

    if "{%" in chat_format or "{{" in chat_format:
        formatter: Any = llama_chat_format.Jinja2ChatFormatter(template=chat_format, eos_token="", bos_token="")
    else:
        try:
            handler = llama_chat_format.LlamaChatCompletionHandlerRegistry().get_chat_completion_handler_by_name(chat_format)
        except Exception:
            raise InvalidInputError(f"unknown chat_format {chat_format!r} (a llama-cpp-python format name or a Jinja template)") from None
        formatter = _handler_formatter(handler)
        if formatter is None:
            raise InvalidInputError(f"chat_format {chat_format!r} has no plain template trimkit can render")

    def render(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
        return formatter(messages=list(messages), tools=tools).prompt

    return render


def _find_formatter(llm: Any) -> Any:
    """The ChatFormatter behind the Llama's chat handler, or None for custom handlers."""
    from llama_cpp import llama_chat_format

    handler = getattr(llm, "chat_handler", None)
    if handler is None:
        fmt = getattr(llm, "chat_format", None)
        handler = getattr(llm, "_chat_handlers", {}).get(fmt)
        if handler is None and fmt is not None:
            try:
                handler = llama_chat_format.LlamaChatCompletionHandlerRegistry().get_chat_completion_handler_by_name(fmt)
            except Exception:
                handler = None
    return _handler_formatter(handler)


def llama_prompt_tokenizer(llm: Any) -> PromptTokenizer:
    """A :class:`PromptTokenizer` that renders and tokenizes exactly as ``llm.create_chat_completion``."""
    text_tok = _LlamaTextTokenizer(llm)
    formatter = _find_formatter(llm)
    if formatter is None:
        log.warning("trimkit: unknown chat handler on this Llama; estimating template overhead with ChatML")
        return PromptTokenizer(
            text_tok,
            chatml_render,
            encode_prompt=lambda text: llm.tokenize(text.encode("utf-8"), add_bos=True, special=True),
            name=text_tok.name + "+chatml(estimate)",
        )
    added_special = {"value": False}

    def render(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
        result = formatter(messages=list(messages), tools=tools)
        added_special["value"] = bool(result.added_special)
        return result.prompt

    def encode_prompt(text: str) -> list[int]:
        return llm.tokenize(text.encode("utf-8"), add_bos=not added_special["value"], special=True)

    render([{"role": "user", "content": "x"}])  # learn whether the template adds BOS itself
    return PromptTokenizer(text_tok, render, encode_prompt=encode_prompt, name=text_tok.name + f"+{getattr(llm, 'chat_format', None) or 'handler'}")


def chunk_content(chunk: Any) -> str | None:
    """The content text a chat stream chunk carries (None for a bare role delta)."""
    try:
        choice = chunk["choices"][0]
    except (KeyError, IndexError, TypeError):
        return None
    delta = choice.get("delta") or {}
    text = delta.get("content")
    if text:
        return text
    if delta.get("tool_calls") or delta.get("function_call"):
        return "<tool_call>"
    if choice.get("text"):
        return choice["text"]
    return "" if choice.get("finish_reason") else None


@functools.cache
def _probe_text() -> str:
    from importlib import resources

    return resources.files("trimkit").joinpath("data/corpus.txt").read_text(encoding="utf-8")


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
        self.engine = _engine_lease(llm)
        #: a section of :attr:`engine` with the default bound (``with backend.lock:``)
        self.lock = self.engine
        self.prefix_reuse_works: bool | None = None  # learned from requests that should hit
        self._reuse_misses = 0
        self._probe_tokens: list[int] | None = None
        self.snapshots: dict[tuple[int, ...], PrefixSnapshot] = {}
        self.max_snapshots = 4

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

    def hold_engine(self, timeout_s: float | None = None) -> Any:
        """A section of the engine for this thread (``with backend.hold_engine(s) as waited:``),
        waiting at most ``timeout_s`` (default :attr:`engine_wait_s`)."""
        return self.engine.section(self.engine_wait_s if timeout_s is None else timeout_s)

    def engine_identity(self) -> Any:
        """The ``Llama`` itself: every backend over it shares its live state."""
        return self.llm

    def profile_key(self) -> ProfileKey:
        import llama_cpp

        from trimkit.model import model_identity

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
        return self.llm.input_ids[: self.llm.n_tokens]

    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """What ``Llama.generate`` will reuse: the longest common prefix, but at least one token is
        always evaluated again (0 if partial KV removal failed on this model before)."""
        if self.prefix_reuse_works is False or self.llm.n_tokens == 0 or not prompt_tokens:
            return 0
        lcp = common_prefix_len(self.cached_tokens_in_context(), prompt_tokens)
        return min(lcp, len(prompt_tokens) - 1)

    # -- requests ---------------------------------------------------------------------------
    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None) -> TimedStream:
        import llama_cpp

        llm = self.llm
        expected_prompt = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        window = self.n_ctx
        if len(expected_prompt) >= window:  # llama-cpp-python needs room for one generated token
            raise ContextTooSmallError(f"prompt of {len(expected_prompt)} tokens does not fit the context window: {self._window_text()}")
        call = dict(params)
        call["stream"] = True
        if window < int(llm.n_ctx()):
            # Llama caps generation at its rounded n_ctx(), past the tokens it can hold: cap it
            # where it would cap it with a consistent window
            room = window - len(expected_prompt)
            max_tokens = call.get("max_tokens")
            if not isinstance(max_tokens, int) or max_tokens <= 0 or max_tokens > room:
                call["max_tokens"] = room
        state: dict[str, Any] = {}
        # the engine is this stream's from now until it is finished, closed or collected
        release, waited = self.engine.hold(self.engine_wait_s)

        def chunks() -> Iterator[Any]:
            state["predicted_cached"] = self.predict_cached_tokens(expected_prompt)
            # flush the accounting of any earlier, unsynchronized eval (llama.cpp books
            # queued tokens at the next synchronize) before zeroing the counters
            llama_cpp.llama_synchronize(llm._ctx.ctx)
            llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
            try:
                stream = llm.create_chat_completion(messages=list(messages), **call)
                yield from stream
            finally:
                state["perf"] = llama_cpp.llama_perf_context(llm._ctx.ctx)

        def finish(ts: TimedStream) -> Measurement:
            return self._measurement(ts, state, len(expected_prompt))

        def on_error(exc: BaseException) -> BaseException | None:
            if isinstance(exc, ValueError) and ("exceed context window" in str(exc) or "could not broadcast" in str(exc)):
                return ContextTooSmallError(f"prompt of {len(expected_prompt)} tokens and its answer exceed the context window: {self._window_text()}")
            if isinstance(exc, (ValueError, RuntimeError)) and not isinstance(exc, BackendError):
                return BackendError(f"llama.cpp failed: {type(exc).__name__}: {exc}")
            return None

        return TimedStream(chunks(), started=None, clock=self.clock, content_of=chunk_content, finish=finish, on_error=on_error,
                           release=release, queue_s=waited)

    def _measurement(self, ts: TimedStream, state: Mapping[str, Any], prompt_len: int) -> Measurement:
        perf = state.get("perf")
        finish_reason = None
        if ts.last_chunk is not None:
            try:
                finish_reason = ts.last_chunk["choices"][0].get("finish_reason")
            except (KeyError, IndexError, TypeError):
                pass
        total = (ts.ended_at or self.clock()) - (ts.started or 0.0)
        client_decode = None
        if ts.first_content_at is not None and ts.last_chunk_at is not None:
            client_decode = ts.last_chunk_at - ts.first_content_at
        if perf is None:
            return Measurement(ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=total, prompt_tokens=prompt_len,
                               client_decode_s=client_decode, finish_reason=finish_reason, queue_s=ts.queue_s)
        t_p = float(perf.t_p_eval_ms) / 1000.0
        t_e = float(perf.t_eval_ms) / 1000.0
        n_e = int(perf.n_eval)
        if t_p > 0:
            evaluated = int(perf.n_p_eval)
            prefill_s = t_p
            decode_steps, decode_s = n_e, t_e
        else:  # a single prompt token was evaluated: llama.cpp counts it as a decode step
            evaluated = 1 if n_e > 0 else 0
            step = t_e / n_e if n_e else 0.0
            prefill_s = step
            decode_steps, decode_s = max(n_e - 1, 0), max(t_e - step, 0.0)
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
            engine_prefill_s=prefill_s,
            completion_tokens=decode_steps + 1 if (evaluated or decode_steps) else 0,
            engine_decode_s=decode_s,
            client_decode_s=client_decode,
            timing_source="llama_perf",
            finish_reason=finish_reason,
            queue_s=ts.queue_s,
        )

    # -- calibration probes -------------------------------------------------------------------
    def probe_tokens(self, n: int) -> list[int]:
        """``n`` tokens of real text (the packaged corpus, repeated), starting with BOS."""
        if self._probe_tokens is None or len(self._probe_tokens) < n:
            text = _probe_text()
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

    def measure_first_token_overhead(self) -> float:
        """Median of (client TTFT − engine prefill) over three short real chat requests.

        End-of-sequence is banned for these probes (``logit_bias``) so that a content chunk
        always arrives, whatever the model would have answered."""
        eos = self.llm.token_eos()
        bias = {str(eos): -100.0} if eos >= 0 else None
        gaps = []
        text = _probe_text()
        for i in range(3):
            msgs = [{"role": "user", "content": f"Probe {i}: " + text[i * 97 : i * 97 + 160]}]
            with self.hold_engine():  # cold, and nothing runs between the reset and the probe
                self.llm.reset()
                m = self.send(msgs, {"max_tokens": 2, "temperature": 0.0, "logit_bias": bias}).drain()
            first = m.ttft_s if m.ttft_s is not None else m.first_output_s
            if first is not None and m.engine_prefill_s is not None:
                gaps.append(max(first - m.engine_prefill_s, 0.0))
        gaps.sort()
        return gaps[len(gaps) // 2] if gaps else 0.0

    # -- KV-only prefix snapshots -------------------------------------------------------------
    def prefill(self, tokens: Sequence[int]) -> None:
        """Make the context hold exactly ``tokens``: reuse the common prefix already cached,
        evaluate the rest, and drop KV cells past them. Off the critical path (prewarm, probes)."""
        tokens = list(tokens)
        self._check_fits(len(tokens))
        llm = self.llm
        with self.hold_engine():
            lcp = common_prefix_len(self.cached_tokens_in_context(), tokens)
            llm.n_tokens = lcp
            if lcp < len(tokens):
                llm.eval(tokens[lcp:])  # eval() drops the KV cells from n_tokens on first
            else:
                llm._ctx.kv_cache_seq_rm(-1, len(tokens), -1)

    def save_prefix(self, tokens: Sequence[int]) -> PrefixSnapshot:
        """Prefill ``tokens`` (what is not cached already) and keep their KV state for reuse."""
        import llama_cpp

        tokens = list(tokens)
        self._check_fits(len(tokens))
        llm = self.llm
        with self.hold_engine():
            t0 = self.clock()
            self.prefill(tokens)
            ctx = llm._ctx.ctx
            size = llama_cpp.llama_state_seq_get_size(ctx, 0)
            buf = (ctypes.c_uint8 * size)()
            written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
            data = bytes(buf[:written])
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
        import llama_cpp

        llm = self.llm
        with self.hold_engine():
            t0 = self.clock()
            llm._ctx.kv_cache_clear()
            buf = (ctypes.c_uint8 * len(snap.data)).from_buffer_copy(snap.data)
            ok = llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(snap.data), 0)
            if not ok:
                llm.n_tokens = 0
                raise BackendError("llama.cpp refused to restore a prefix snapshot")
            n = len(snap.tokens)
            llm.input_ids[:n] = snap.tokens
            llm.n_tokens = n
            llm._requires_eval = True  # logits are not part of the snapshot: re-evaluate ≥ 1 token
            return self.clock() - t0

    def best_cache(self, prompt_tokens: Sequence[int], cost: Any = None) -> tuple[int, PrefixSnapshot | None]:
        """Cached tokens for ``prompt_tokens`` and the snapshot to restore first (or None).

        A snapshot is chosen only if restoring it and prefilling the rest is predicted faster
        than prefilling after what the context already holds (``cost(new, cached)`` → seconds).
        """
        current = self.predict_cached_tokens(prompt_tokens)
        best: tuple[int, PrefixSnapshot | None] = (current, None)
        if not self.snapshots or self.prefix_reuse_works is False:
            return best
        n = len(prompt_tokens)

        def t(cached: int, extra: float) -> float:
            return extra + (cost(n - cached, cached) if cost else (n - cached) * 1e-3)

        best_t = t(current, 0.0)
        for snap in list(self.snapshots.values()):  # another thread may store one meanwhile
            k = min(common_prefix_len(snap.tokens, prompt_tokens), n - 1)
            if k > current and t(k, snap.restore_s) < best_t:
                best, best_t = (k, snap), t(k, snap.restore_s)
        return best


def llama_summarizer(llm: Any, *, n_ctx: int = 4096, max_tokens: int = 200, **llama_kwargs: Any) -> Any:
    """A :class:`~trimkit.summarize.PromptSummarizer` running the same model on a *separate*
    llama.cpp context, so summarizing never evicts the conversation's KV cache.

    The weights are memory-mapped, so the second context shares them with ``llm``; it adds its
    own KV cache (``n_ctx`` tokens). Summaries run off the critical path (after a response, in
    the background, or on ``chat.idle()``).
    """
    from llama_cpp import Llama

    from trimkit.summarize import PromptSummarizer

    lock = threading.Lock()
    holder: dict[str, Any] = {}

    def complete(prompt: str) -> str:
        with lock:
            if "llm" not in holder:
                holder["llm"] = Llama(
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
