"""The seam between trimkit and a model engine (:class:`Backend`, :class:`TimedStream`,
:class:`Measurement`), and :func:`client_kind`, the one place trimkit asks what client it was handed.

A backend with ``evaluate_to(tokens, end) -> (seconds, start)`` whose :meth:`Backend.send` takes
``watch=`` takes part in the watched prefill (:mod:`trimkit.planning.watch`).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from importlib import resources
from typing import Any, Literal

import attrs

from trimkit.planning.costs import CacheState
from trimkit.planning.profile import ProfileKey
from trimkit.planning.tokens import PromptTokenizer

Clock = Callable[[], float]


class Io:
    """One I/O step of code written once for sync and async callers: ``sync(...)`` or ``await asyn(...)``."""

    def __init__(self, sync: Callable[..., Any], asyn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        self.sync, self.asyn, self.args, self.kwargs = sync, asyn, args, kwargs


#: sync-or-async code: yields its I/O steps, is sent each one's result (or thrown its error)
Steps = Generator[Io, Any, Any]


def run_sync(steps: Steps) -> Any:
    """Run ``steps`` with sync I/O: what it returns (what it raises)."""
    resume, value = steps.send, None
    while True:
        try:
            io = resume(value)
        except StopIteration as done:
            return done.value
        try:
            resume, value = steps.send, io.sync(*io.args, **io.kwargs)
        except BaseException as exc:
            resume, value = steps.throw, exc


async def run_async(steps: Steps) -> Any:
    """:func:`run_sync` with async I/O."""
    resume, value = steps.send, None
    while True:
        try:
            io = resume(value)
        except StopIteration as done:
            return done.value
        try:
            resume, value = steps.send, await io.asyn(*io.args, **io.kwargs)
        except BaseException as exc:
            resume, value = steps.throw, exc


@attrs.frozen
class Measurement:
    """What one request measured (None: the engine did not say). ``ttft_s``: send → first content
    chunk; ``first_output_s``: send → first output of any kind; ``queue_s``: the wait for the engine (not in ``ttft_s``)."""

    ttft_s: float | None
    total_s: float
    first_output_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    evaluated_tokens: int | None = None
    engine_prefill_s: float | None = None
    completion_tokens: int | None = None
    engine_decode_s: float | None = None
    client_decode_s: float | None = None
    timing_source: str = "client"
    finish_reason: str | None = None
    truncated_tokens: int = 0
    server: Mapping[str, Any] = attrs.field(factory=dict)
    queue_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Streaming speed after the first token: engine timings if known, else client-side."""
        n = self.completion_tokens
        if n is None or n < 2:
            return None
        if self.engine_decode_s and self.engine_decode_s > 0:
            # engine decode steps exclude the first token, which belongs to the prefill
            return (n - 1) / self.engine_decode_s if self.timing_source == "llama_perf" else n / self.engine_decode_s
        if self.client_decode_s and self.client_decode_s > 0:
            return (n - 1) / self.client_decode_s
        return None

    @property
    def time_per_output_token_s(self) -> float | None:
        tps = self.decode_tokens_per_s
        return 1.0 / tps if tps else None

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["server"] = dict(self.server)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        d["time_per_output_token_s"] = self.time_per_output_token_s
        return d


def _end_stream(chunks: Any, release: Callable[[], None]) -> None:
    """Stop the engine's iterator, then release; run once by ``weakref.finalize``, in any thread."""
    try:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    finally:
        release()


class TimedStream:
    """A stream of response chunks, timing the first content chunk and the end. Once exhausted,
    ``finish(self)`` builds the :class:`Measurement` for the ``on_done`` callbacks; ``on_error`` may
    translate an exception; ``release`` runs exactly once, in whichever thread ends the stream."""

    def __init__(self, chunks: Iterator[Any], *, started: float | None, clock: Clock, content_of: Callable[[Any], str | None],
                 finish: Callable[[TimedStream], Measurement], on_error: Callable[[BaseException], BaseException | None] | None = None,
                 release: Callable[[], None] | None = None, queue_s: float = 0.0) -> None:
        # content_of: the text of a chunk; "" for a finish chunk; None for a bare role delta
        self._chunks = chunks
        self.started = started
        self.clock = clock
        self._content_of = content_of
        self._finish = finish
        self._on_error = on_error
        self.queue_s = queue_s
        self.first_content_at: float | None = None
        self.first_output_at: float | None = None  # first chunk beyond a bare role delta (content or finish)
        self.last_chunk_at: float | None = None
        self.ended_at: float | None = None
        self.n_chunks = 0
        self.n_content_chunks = 0
        self.last_chunk: Any = None
        self.measurement: Measurement | None = None
        self.on_done: list[Callable[[Measurement], None]] = []
        self._release: Any = None
        if release is not None:
            self._release = weakref.finalize(self, _end_stream, chunks, release)
            self._release.atexit = False  # never call into an engine during interpreter shutdown

    def __iter__(self) -> TimedStream:
        return self

    def __next__(self) -> Any:
        if self.started is None:
            self.started = self.clock()  # lazily-evaluated engines start work on the first next()
        try:
            chunk = next(self._chunks)
        except StopIteration:
            self._complete()
            raise
        except BaseException as exc:
            self.ended_at = self.clock()
            if self._release is not None:
                with contextlib.suppress(ValueError):  # another thread is inside next() on this stream: it ends it
                    self.close()
            translated = self._on_error(exc) if self._on_error else None
            if translated is not None and translated is not exc:
                raise translated from exc
            raise
        now = self.clock()
        self.n_chunks += 1
        self.last_chunk_at = now
        self.last_chunk = chunk
        text = self._content_of(chunk)
        if text is not None and self.first_output_at is None:
            self.first_output_at = now
        if text:
            self.n_content_chunks += 1
            if self.first_content_at is None:
                self.first_content_at = now
        return chunk

    @property
    def first_output_s(self) -> float | None:
        return None if self.first_output_at is None or self.started is None else self.first_output_at - self.started

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_content_at is None or self.started is None else self.first_content_at - self.started

    @property
    def total_s(self) -> float:
        return (self.ended_at or self.clock()) - (self.started or 0.0)

    @property
    def client_decode_s(self) -> float | None:
        if self.first_content_at is None or self.last_chunk_at is None:
            return None
        return self.last_chunk_at - self.first_content_at

    @property
    def released(self) -> bool:
        return self._release is None or not self._release.alive

    def _end(self) -> None:
        if self._release is not None:
            self._release()

    def _complete(self) -> None:
        if self.measurement is not None:
            self._end()
            return
        self.ended_at = self.clock()
        try:
            self.measurement = self._finish(self)
        finally:
            self._end()  # the engine is free before on_done callbacks run
        for cb in self.on_done:
            cb(self.measurement)

    def close(self) -> None:
        """Stop the stream and release what it holds (ValueError while another thread is inside ``next()``)."""
        close = getattr(self._chunks, "close", None)
        if close:
            close()
        self._end()

    def drain(self) -> Measurement:
        for _ in self:
            pass
        assert self.measurement is not None
        return self.measurement


class Backend(abc.ABC):
    """A model engine as trimkit sees it. Subclass to support a new engine."""

    name: str = "backend"
    tokenizer: PromptTokenizer
    clock: Clock = time.perf_counter

    @property
    def background_tokenizer(self) -> PromptTokenizer:
        """What background work counts tokens with: a local one where :attr:`tokenizer` asks a server
        (a llama.cpp-style server interrupts the stream in flight when another request reaches it)."""
        return self.tokenizer

    @property
    @abc.abstractmethod
    def n_ctx(self) -> int: ...

    @abc.abstractmethod
    def profile_key(self) -> ProfileKey:
        """Everything that changes prefill timings for this engine and its settings."""

    def engine_identity(self) -> Any:
        """What names the engine, so every wrapper of it shares one live state
        (:func:`trimkit.planning.speed.engine_state`): an object held weakly or a hashable value; no I/O."""
        return self

    @abc.abstractmethod
    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        """How many leading tokens of ``prompt_tokens`` the engine will reuse from its KV cache."""

    def cache_state(self) -> CacheState | None:
        """What the engine's KV cache holds now, as data for a plan; None: not told."""
        return None

    @abc.abstractmethod
    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None) -> TimedStream:
        """Send a chat request as a :class:`TimedStream` of the engine's own chunks."""

    # -- calibration probes -------------------------------------------------------------
    #: whether a depth probe (``measure_prefill(n, k)``) finds its ``k``-token prefix still cached
    depth_probe_keeps_prefix: bool = True
    #: the model's attention doubling length by its architecture, tokens; None: not told (a server)
    attention_prior_tokens: float | None = None

    def warm_up(self) -> None:  # noqa: B027 - an optional hook: most backends need no warm-up
        """Pay one-off costs before measuring."""

    @abc.abstractmethod
    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to evaluate ``new_tokens`` fresh tokens after ``cached_tokens`` cached ones."""

    @abc.abstractmethod
    def measure_decode(self, n_tokens: int = 32) -> float:
        """Decode speed in tokens/s over ``n_tokens`` single-token steps."""

    @abc.abstractmethod
    def measure_first_token_overhead(self) -> float:
        """Seconds a short real request spends before its first content chunk beyond prefill."""


@functools.cache
def probe_text() -> str:
    """The packaged English corpus that calibration probes are cut from."""
    return resources.files("trimkit").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def first_token_overhead_s(probes: Iterable[Measurement], prefill_s: Callable[[Measurement], float | None] | None = None) -> float:
    """The upper median over probes of (time to first output − ``prefill_s(m)``, default the engine's),
    each at least 0; ``prefill_s`` is called only for a probe that produced output. 0.0 when none counted."""
    gaps = []
    for m in probes:
        first = m.ttft_s if m.ttft_s is not None else m.first_output_s  # the model may stop at once
        if first is None:
            continue
        prefill = m.engine_prefill_s if prefill_s is None else prefill_s(m)
        if prefill is not None:
            gaps.append(max(first - prefill, 0.0))
    return statistics.median_high(gaps) if gaps else 0.0


ClientKind = Literal["backend", "wrapper", "llama", "openai", "ollama"]


def client_kind(target: Any) -> ClientKind | None:
    """What ``target`` is (a wrapper has a Backend at ``.backend``); None: none of these."""
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
    """A ``llama_cpp.Llama``, without importing llama_cpp when it is not loaded."""
    Llama = getattr(sys.modules.get("llama_cpp"), "Llama", None)
    return Llama is not None and isinstance(client, Llama)


def is_openai_client(client: Any) -> bool:
    """Anything with a callable ``.chat.completions.create``."""
    create = getattr(getattr(getattr(client, "chat", None), "completions", None), "create", None)
    return callable(create)


def is_ollama_client(client: Any) -> bool:
    """An ``ollama`` client: a ``chat`` method and the ``httpx`` client it sends through (``._client``)."""
    module = type(client).__module__ or ""
    http = getattr(client, "_client", None)
    httpx = sys.modules.get("httpx")
    return (module.split(".")[0] == "ollama" and callable(getattr(client, "chat", None)) and httpx is not None
            and isinstance(http, (httpx.Client, httpx.AsyncClient)))


def client_is_async(client: Any) -> bool:
    """Whether an OpenAI-style client's ``chat.completions.create`` must be awaited."""
    return inspect.iscoroutinefunction(inspect.unwrap(client.chat.completions.create)) or type(client).__name__.startswith("Async")
