"""Reading a chat stream once it is open: every event parsed once, what it says recorded, the
usage chunk trimkit asked for itself hidden, a stream that ends badly refused; and the timing
around it (:class:`~trimkit.backends.base.TimedStream`, :class:`AsyncTimedStream`).

:class:`StreamState` holds every decision about the events and does no I/O; :func:`read_chunks`
and :func:`aread_chunks` only move events through it.
"""

from __future__ import annotations

import asyncio
import functools
import operator
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import attrs
import httpx

from trimkit.backends.base import Clock, Measurement, TimedStream
from trimkit.backends.faults import empty_stream_error, is_transport_failure, undecodable
from trimkit.backends.limits import Deadline
from trimkit.backends.replies import Reply, parse_chunk, parse_completion
from trimkit.backends.transport import END, Opened
from trimkit.errors import ServerTimeoutError, StreamInterruptedError, TrimkitError

__all__ = ["StreamState", "read_chunks", "aread_chunks", "timed_stream", "AsyncTimedStream"]

_SKIP = object()  # an event not handed to the caller


@attrs.define
class StreamState:
    """What one stream has said so far."""

    url: str
    hide_usage_chunk: bool = False  # trimkit added stream_options: the usage-only chunk is its own
    stats_reply: Reply | None = None  # the last reply that carried usage / timings
    finish_reason: str | None = None
    chunks: list[Reply] | None = None  # filled when the response is to be assembled
    last: Reply | None = None  # the reply of the chunk just yielded (read by the TimedStream)
    n_seen: int = 0
    #: the request's deadline: a bounded one holds until the first output (content, a tool call,
    #: a finish), whatever arrives before it — role deltas, ``content: null`` chunks, keep-alives
    deadline: Deadline | None = None
    started: float | None = None  # time.monotonic() when the request went out
    has_output: bool = False
    served_model: str | None = None  # the model the server says answered (its chunks' ``model``)
    #: the response once an async stream has it open (what :func:`aread_chunks` closes; and what
    #: :meth:`AsyncTimedStream.aclose` closes under a step another task is inside)
    opened: Opened | None = attrs.field(default=None, repr=False)

    def start(self) -> None:
        self.started = time.monotonic()

    def begin(self, opened: Opened) -> None:
        if opened.first is END:
            raise empty_stream_error()

    def _check_deadline(self) -> None:
        d = self.deadline
        if d is None or not d.bounded or self.started is None:
            return
        if time.monotonic() - self.started > d.seconds:
            raise ServerTimeoutError(f"{self.url} sent {self.n_seen} chunks but no content within the request's deadline of "
                                     f"{d.seconds:.2f} s")

    def take(self, item: Any, opened: Opened) -> Any:
        """Parse an event (a chunk, or the whole completion of a server that ignored
        ``stream=true``) and record what it says; the chunk to hand on, or ``_SKIP``."""
        self.n_seen += 1
        reply = parse_completion(item) if opened.whole else parse_chunk(item)
        if self.served_model is None and reply.model:
            self.served_model = reply.model
        if not self.has_output:
            if reply.output is not None:
                self.has_output = True
            elif not reply.usage_only:
                self._check_deadline()
        self.last = reply
        if self.chunks is not None:
            self.chunks.append(reply)
        if reply.has_stats:
            self.stats_reply = reply
        if reply.finish_reason:
            self.finish_reason = reply.finish_reason
        return _SKIP if self.hide_usage_chunk and reply.usage_only else reply.raw

    def end(self, opened: Opened) -> None:
        if self.finish_reason is not None:
            return
        if not opened.done():
            raise StreamInterruptedError(f"the stream from {self.url} ended after {self.n_seen} chunks without a finish reason or [DONE]")
        if not self.has_output:  # [DONE] before anything was generated: the same outcome as through an openai client
            raise StreamInterruptedError(f"the stream from {self.url} ended ([DONE]) after {self.n_seen} chunks without content "
                                         "or a finish reason")


def read_chunks(open_: Callable[[], Opened], state: StreamState) -> Iterator[Any]:
    """The chunks of a stream, opened on the first ``next()`` (when the TTFT clock starts)."""
    state.start()
    opened = open_()
    try:
        state.begin(opened)
        if (chunk := state.take(opened.first, opened)) is not _SKIP:
            yield chunk
        if opened.rest is not None:
            for item in opened.rest:
                if (chunk := state.take(item, opened)) is not _SKIP:
                    yield chunk
        state.end(opened)
    finally:
        opened.close()


async def aread_chunks(open_: Callable[[], Awaitable[Opened]], state: StreamState) -> AsyncIterator[Any]:
    """:func:`read_chunks` for asyncio. This generator is the whole stream: it opens the request
    and closes its response itself (``finally``), so closing it (``aclose()``, or asyncio when it
    is dropped unfinished or its loop shuts down) closes the response there and then — never
    through another async generator of trimkit's, which asyncio would close on its own, in any
    order, even while this one is still closing it (issue 34, item 9)."""
    opened = None
    state.start()
    try:
        opened = await open_()
        state.opened = opened
        state.begin(opened)
        if (chunk := state.take(opened.first, opened)) is not _SKIP:
            yield chunk
        if opened.rest is not None:
            async for item in opened.rest:
                if (chunk := state.take(item, opened)) is not _SKIP:
                    yield chunk
        state.end(opened)
    finally:
        if opened is not None:
            await opened.close()


def _stream_error(url: str, stream_of: Callable[[], TimedStream | None]) -> Callable[[BaseException], BaseException | None]:
    """A stream's failure after it was opened as a trimkit error (None: left as it is).
    ``stream_of()`` is the stream (held weakly: see :func:`timed_stream`)."""

    def on_error(exc: BaseException) -> BaseException | None:
        if isinstance(exc, TrimkitError):
            return None
        if isinstance(exc, httpx.DecodingError):  # a body its Content-Encoding does not decode
            return undecodable(exc, f"the stream from {url}")
        if not is_transport_failure(exc):
            return None
        ts = stream_of()
        n = ts.n_chunks if ts is not None else 0
        return StreamInterruptedError(f"the stream from {url} broke after {n} chunks: {type(exc).__name__}: {exc}")

    return on_error


def timed_stream(chunks: Any, state: StreamState, clock: Clock, measure: Callable[[StreamState, TimedStream], Measurement], *,
                 output_of: Callable[[Reply], str | None] = operator.attrgetter("output"), cls: type[TimedStream] = TimedStream) -> Any:
    """The :class:`TimedStream` (``cls``) over ``chunks``: each chunk's output is read from the
    reply :class:`StreamState` parsed; at the end ``measure(state, stream)`` is the measurement.

    Nothing the stream holds refers back to it (its error handler holds it weakly): a stream
    dropped unfinished is freed — its generator closed, its connection given back to the pool —
    at once, on the thread that dropped it, never later by the cyclic garbage collector on
    whatever thread it happens to run (inside httpcore's pool, holding the pool's lock, a
    ``close()`` that needs that lock deadlocked every later request)."""
    ref: weakref.ref[TimedStream] | None = None

    def content_of(chunk: Any) -> str | None:
        reply = state.last
        if reply is None or reply.raw is not chunk:  # (never: each chunk is yielded right after it is parsed)
            reply = parse_chunk(chunk)
        return output_of(reply)

    extra: dict[str, Any] = {"abort": functools.partial(_close_opened, state)} if issubclass(cls, AsyncTimedStream) else {}
    ts = cls(chunks, started=None, clock=clock, content_of=content_of, finish=lambda ts: measure(state, ts),
             on_error=_stream_error(state.url, lambda: ref() if ref is not None else None), **extra)
    ref = weakref.ref(ts)
    return ts


async def _close_opened(state: StreamState) -> None:
    """Close the response an async stream has open (closing it twice is harmless)."""
    opened = state.opened
    if opened is not None:
        await opened.close()


def _raising(exc: BaseException) -> Iterator[Any]:
    raise exc
    yield  # pragma: no cover


class AsyncTimedStream(TimedStream):
    """:class:`TimedStream` over an async iterator: ``async for`` it; the timing, ``finish`` and
    ``on_done`` behave exactly as in the sync stream.

    :meth:`aclose` works from any task, also while another task is inside ``__anext__`` — a
    reader just cancelled (``task.cancel()``, ``asyncio.wait_for``) that has not unwound yet, or
    one still reading: ``abort()`` (given by the backend) then closes the response under that
    step, and the step ends the stream (``StopAsyncIteration``; a cancelled reader gets its
    ``CancelledError``). Closing an async generator another task is running raises
    ``RuntimeError: aclose(): asynchronous generator is already running`` instead — or, where
    the close was a task of its own, logs "Task exception was never retrieved" (issue 34, item 9)."""

    def __init__(self, chunks: AsyncIterator[Any], *, abort: Callable[[], Awaitable[None]] | None = None, **kwargs: Any) -> None:
        super().__init__(iter(()), **kwargs)
        self._achunks = chunks
        self._abort = abort
        self._closed = False

    def __aiter__(self) -> AsyncTimedStream:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        if self.started is None:
            self.started = self.clock()  # the request goes out on the first step
        try:
            self._chunks = iter((await self._achunks.__anext__(),))
        except StopAsyncIteration:
            self._chunks = iter(())
        except BaseException as exc:
            if self._closed:  # aclose() ended the request under this step (a cancelled reader keeps its CancelledError)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise StopAsyncIteration from None
            self._chunks = _raising(exc)
        if self._closed:  # aclose() came from another task during this step: the stream ends here
            await self._close_chunks()
            raise StopAsyncIteration
        try:  # the sync step records, completes or translates exactly as for a sync stream
            return TimedStream.__next__(self)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Stop the stream; its response is closed before this returns (unless it is not open
        yet: a step another task is inside then ends the stream when its wait ends)."""
        self._closed = True
        if getattr(self._achunks, "ag_running", False):  # another task is inside __anext__
            if self._abort is not None:
                await self._abort()
            return
        await self._close_chunks()

    async def _close_chunks(self) -> None:
        aclose = getattr(self._achunks, "aclose", None)
        if aclose is not None:
            await aclose()

    async def adrain(self) -> Measurement:
        async for _ in self:
            pass
        assert self.measurement is not None
        return self.measurement
