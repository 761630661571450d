"""The events of a chat stream: ``httpx-sse`` reads the ``text/event-stream`` protocol, and this
module adds what llama.cpp-style servers need on top of it.

- each event's data is JSON (:func:`~trimkit.backends.fields.load_json`), or
  :class:`~trimkit.errors.MalformedReplyError`; ``data: [DONE]`` ends the stream
  (:attr:`EventReader.done`); events without data (comments, ``retry:``) are skipped;
- an ``error`` event, or a JSON ``{"error": ...}`` event without ``choices``, raises
  :class:`~trimkit.errors.ServerError` with the server's message;
- no event may run longer than ``max_event_bytes`` without the blank line that ends it (a line
  that never ends, endless ``data:`` lines): MalformedReplyError, raised after the events
  before it, and nothing past the cap is buffered;
- a stream that ends in the middle of an event (its JSON cut short) raises
  :class:`~trimkit.errors.StreamInterruptedError`; a complete last event without its closing
  blank line is read.

The content type is the caller's to check (:func:`~trimkit.backends.replies.body_kind`): servers
send ``text/event-stream``, ``text/plain`` or none. :class:`EventReader` holds every decision and
does no I/O; :func:`iter_events` and :func:`aiter_events` only move bytes and events through it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

from trimkit.backends.fields import MAX_EVENT_BYTES, excerpt, load_json
from trimkit.backends.replies import error_message
from trimkit.errors import MalformedReplyError, ServerError, StreamInterruptedError

__all__ = ["EventReader", "iter_events", "aiter_events"]

_LINE_ENDS = re.compile(rb"[\r\n]+")  # a run of line ends; two or more in a run end an event
_ONE_LINE_END = (b"\r", b"\n", b"\r\n")
_END_OF_STREAM = b"\n\n"  # ends a last event that came without its blank line
_EVENT_STREAM = {"content-type": "text/event-stream"}


class EventReader:
    """The decisions about one event stream, without I/O: :meth:`feed` the bytes as they arrive
    (it passes them on, or stops at the size cap), :meth:`end` when the body ends, and
    :meth:`values` each event httpx-sse parsed from them."""

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self.max_event_bytes = MAX_EVENT_BYTES if max_event_bytes is None else max_event_bytes
        self.done = False  #: the server sent ``data: [DONE]``
        self._pending = 0  # bytes since the blank line that ended the last event
        self._tail = b""  # the last bytes fed: a run of line ends may continue in the next read
        self._ended = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The bytes to hand to the parser; an event over the cap is cut off where it starts
        and MalformedReplyError raised after the bytes before it (their events are still read)."""
        kept, error = self._cut(data)
        yield kept
        if error is not None:
            raise error

    def _cut(self, data: bytes) -> tuple[bytes, MalformedReplyError | None]:
        tail, buf = self._tail, self._tail + data
        event_start = None  # in ``data``: where the event being read began
        for run in _LINE_ENDS.finditer(buf):
            if run.group() not in _ONE_LINE_END:
                event_start = max(run.end() - len(tail), 0)
                self._pending = len(buf) - run.end()
        if event_start is None:
            self._pending += len(data)
        self._tail = buf[-3:]
        if self._pending <= self.max_event_bytes:
            return data, None
        kept = data[: event_start or 0]
        if (tail + kept).endswith(b"\r"):  # the parser holds a last \r until it sees what follows
            kept += b"\n"
        return kept, MalformedReplyError(f"the server sent a stream event longer than {self.max_event_bytes} bytes",
                                         server_message=excerpt(data[event_start or 0 :][:500]))

    def end(self) -> bytes:
        """The bytes that end the stream: they complete a last event sent without its blank line."""
        self._ended = True
        return _END_OF_STREAM

    def values(self, event: ServerSentEvent) -> tuple[Any, ...]:
        """The JSON value an event carries (none for ``[DONE]`` or an event without data)."""
        data = event.data
        if not data or self.done:
            return ()
        if data.strip() == "[DONE]":
            self.done = True
            return ()
        if self._ended:  # the stream closed in the middle of this event: cut short, not garbled
            try:
                json.loads(data)
            except json.JSONDecodeError:
                raise StreamInterruptedError(f"the stream ended in the middle of an event: {data[:200]!r}") from None
            except (ValueError, RecursionError):
                pass  # load_json says what is wrong with it
        value = load_json(data, what="stream event")
        if event.event == "error" or (isinstance(value, Mapping) and value.get("error") is not None and value.get("choices") is None):
            message = error_message(value)
            raise ServerError(f"the server reported an error mid-stream: {message}", status=200, server_message=message)
        return (value,)


def iter_events(byte_chunks: Iterable[bytes], reader: EventReader | None = None) -> Iterator[Any]:
    """The JSON events of an event stream's bytes, in order, until ``[DONE]`` or the end."""
    reader = reader or EventReader()

    def body() -> Iterator[bytes]:
        for data in byte_chunks:
            yield from reader.feed(data)
        yield reader.end()

    stream = httpx.Response(200, headers=_EVENT_STREAM, content=body())
    with contextlib.closing(EventSource(stream).iter_sse()) as events:
        for event in events:
            yield from reader.values(event)
            if reader.done:
                return


async def aiter_events(byte_chunks: AsyncIterable[bytes], reader: EventReader | None = None) -> AsyncIterator[Any]:
    """:func:`iter_events` over an async byte stream."""
    reader = reader or EventReader()

    async def body() -> AsyncIterator[bytes]:
        async for data in byte_chunks:
            for passed in reader.feed(data):
                yield passed
        yield reader.end()

    stream = httpx.Response(200, headers=_EVENT_STREAM, content=body())
    async with contextlib.aclosing(EventSource(stream).aiter_sse()) as events:
        async for event in events:
            for value in reader.values(event):
                yield value
            if reader.done:
                return
