"""What every front-end shares: :class:`FrontEnd` (the pipeline's state under the names users know) and the reporting streams a wrapped call returns, which
build the report when the engine's stream ends and keep the request's place in an in-process engine's queue up to date.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from trimkit.backends.base import Io, Measurement, Steps, TimedStream
from trimkit.errors import TrimkitError
from trimkit.pipeline import Pipeline, Prepared
from trimkit.report import Report


def send_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Every argument but ``stream``: a backend always streams (a non-streamed call is rebuilt from the stream)."""
    return {k: v for k, v in params.items() if k != "stream"}


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def drain(stream: Any) -> None:
    """Read a stream to its end (its chunks are kept for the completion)."""
    for _ in stream:
        pass


async def adrain(stream: Any) -> None:
    async for _ in stream:
        pass


#: the pipeline's state and methods every wrapper shows under the same names (``prepare``: validate,
#: plan and check a request without sending it); setting one of ``SETTABLE`` sets (and validates) the pipeline's
SHARED = frozenset({"backend", "profile", "last_report", "reports", "safety_margin", "engine", "live", "summarizer", "summaries",
                    "last_prepared", "queue", "prepare", "idle"})
SETTABLE = frozenset({"ttft_budget_s", "strategies", "values", "on_infeasible", "on_busy", "endpoint_label", "attainment_target",
                      "persist_every", "max_reports"})


class FrontEnd:
    """The pipeline's state and controls, as every wrapper exposes them; any other attribute is
    the wrapped client's own (``_drop_in`` names the attribute that holds it)."""

    pipeline: Pipeline
    _drop_in = "client"

    def __getattr__(self, name: str) -> Any:
        pipeline = self.__dict__.get("pipeline")
        if pipeline is not None and (name in SHARED or name in SETTABLE):
            return getattr(pipeline, name)
        client = self.__dict__.get(self._drop_in)
        if client is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(client, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SETTABLE:
            setattr(self.pipeline, name, value)
        else:
            object.__setattr__(self, name, value)


class Closing:
    """``with`` for what ``close()`` closes."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()  # type: ignore[attr-defined]


class AsyncClosing:
    """``async with`` for what ``await close()`` closes."""

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()  # type: ignore[attr-defined]


class StreamReporter:
    """Shared by the sync and async streams: builds the report when the timed stream ends. ``watch``: the driver of the request's watched prefill (a re-plan
    changes what was sent); ``at_end(report)``: called when the stream is exhausted (it may raise); ``listener``: told of each chunk (``chunk(stream)``) and
    of the end (``ended(stream, exc)``, None when closed)."""

    _read: Callable[[], Any]  # the next chunk of the engine's stream (the async streams': awaitable)

    def __init__(self, ts: TimedStream, pipeline: Pipeline, prepared: Prepared, params: Mapping[str, Any], *, watch: Any = None) -> None:
        self.timed = ts
        self.pipeline = pipeline
        self._prepared = prepared
        self.watch = watch
        self.params = params
        #: the report, once the stream is exhausted
        self.report: Report | None = None
        self.chunks: list[Any] = []
        self.at_end: Callable[[Report | None], None] | None = None
        self.listener: Any = None
        #: chunks read ahead of the caller (:meth:`read_ahead`), replayed first
        self.head: list[Any] = []
        # a weak link back, so that a stream dropped unfinished is freed (and frees the engine
        # it holds) as soon as its last reference goes, not at the next cyclic collection
        ref = weakref.ref(self)

        def done(m: Measurement) -> None:
            rs = ref()
            if rs is not None:
                queued = getattr(rs.timed, "queue_s", 0.0) or 0.0
                if queued != m.queue_s:  # the wait the front-end measured, whatever the backend copied
                    m = attrs.evolve(m, queue_s=queued)
                rs.report = rs.pipeline.finish(rs.prepared, m, rs.params)

        ts.on_done.append(done)

    @property
    def prepared(self) -> Prepared:
        """The request as sent: the plan's, or the re-plan its watched prefill made."""
        return self.watch.prepared if self.watch is not None else self._prepared

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around reading the next chunk: an error that ends the stream gets the report of what was sent; the first token tells the engine's queue that only
        the decode is left (the engine's hold takes the request out of it when the stream ends)."""
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, TrimkitError):
                self.pipeline.attach_report(exc, self.timed, self.prepared, self.params)
            if self.listener is not None:
                self.listener.ended(self, exc)
            if isinstance(exc, (StopIteration, StopAsyncIteration)) and self.at_end is not None:
                self.at_end(self.report)
            raise
        ticket = getattr(self.prepared, "ticket", None)
        if ticket is not None and self.timed.first_output_at is not None:
            ticket.first_token()
        if self.listener is not None:
            self.listener.chunk(self)

    def closed(self) -> None:
        if self.listener is not None:
            self.listener.ended(self, None)

    def read_ahead(self) -> Steps:
        """Read up to the first token, sync or async, holding the chunks back for the caller (a fleet's attempt fails over before it); the stream."""
        try:
            while self.timed.first_output_at is None:
                self.head.append((yield Io(self._read, self._read)))
        except (StopIteration, StopAsyncIteration):
            pass
        return self


class ReportingStream(Closing, StreamReporter):
    """The stream a wrapped call returns with ``stream=True``: iterate it like the engine's or client's own; ``.report`` is set once it is exhausted;
    ``with`` and :meth:`close` work. With an in-process engine it holds the engine until it is exhausted, fails, is closed or is garbage-collected, from any
    thread."""

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.head.pop(0) if self.head else self._read()

    def _read(self) -> Any:
        with self.reading():
            chunk = next(self.timed)
        self.chunks.append(chunk)
        return chunk

    def close(self) -> None:
        self.timed.close()
        self.closed()


class AsyncReportingStream(AsyncClosing, StreamReporter):
    """What an async ``create(stream=True)`` returns: ``async for`` it; ``.report`` is set once it is exhausted; ``async with`` and ``await close()`` work."""

    def __aiter__(self) -> AsyncReportingStream:
        return self

    async def __anext__(self) -> Any:
        return self.head.pop(0) if self.head else await self._read()

    async def _read(self) -> Any:
        with self.reading():
            chunk = await self.timed.__anext__()  # type: ignore[attr-defined]
        self.chunks.append(chunk)
        return chunk

    async def close(self) -> None:
        await self.timed.aclose()  # type: ignore[attr-defined]
        self.closed()
