"""What every front-end shares: :class:`FrontEnd`, the pipeline's state under the names users
know (``.profile``, ``.last_report``, ``.idle()``, ...); the reporting streams a wrapped call
returns, which build the report when the engine's stream ends and keep the request's place in an
in-process engine's queue (:mod:`trimkit.planning.queue`) up to date. The send path is written
once for sync and async front-ends (:class:`~trimkit.backends.base.Io`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from trimkit.backends.base import Measurement, TimedStream
from trimkit.errors import TrimkitError
from trimkit.pipeline import Pipeline, Prepared
from trimkit.planning.queue import Ticket
from trimkit.report import Report


def send_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """What goes to the backend: every argument the caller gave but ``stream`` (a backend always
    streams; a non-streamed call is rebuilt from the stream)."""
    return {k: v for k, v in params.items() if k != "stream"}


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A response's ``usage`` from trimkit's counts."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def drain(stream: Any) -> None:
    """Read a stream to its end (its chunks are kept for the completion)."""
    for _ in stream:
        pass


async def adrain(stream: Any) -> None:
    """:func:`drain` for an async stream."""
    async for _ in stream:
        pass


def _delegated(name: str, doc: str, *, settable: bool = False) -> property:
    def get(self: FrontEnd) -> Any:
        return getattr(self.pipeline, name)

    def set_(self: FrontEnd, value: Any) -> None:
        setattr(self.pipeline, name, value)

    return property(get, set_ if settable else None, doc=doc)


class FrontEnd:
    """The pipeline's state and controls, as every wrapper exposes them."""

    pipeline: Pipeline

    backend = _delegated("backend", "The :class:`~trimkit.backends.base.Backend` requests go through.")
    profile = _delegated("profile", "The current profile (calibration refined by live measurements).")
    last_report = _delegated("last_report", "The report of the most recent finished request (any thread).")
    reports = _delegated("reports", "Recent reports, most recent last (bounded by ``max_reports``).")
    safety_margin = _delegated("safety_margin", "The fraction of a budget held back, learned from this engine.")
    engine = _delegated("engine", "What this engine has learned, shared with every wrapper of it.")
    live = _delegated("live", "The live-refined profile state.")
    summarizer = _delegated("summarizer", "What computes summaries of older turns (None: off).")
    summaries = _delegated("summaries", "The summaries made so far.")
    last_prepared = _delegated("last_prepared", "The request most recently sent.")
    ttft_budget_s = _delegated("ttft_budget_s", "The default TTFT budget of a call (None: no budget); validated when set.", settable=True)
    strategies = _delegated("strategies", "What the planner may change (None: the defaults).", settable=True)
    values = _delegated("values", "What each kind of content is worth (None: the defaults).", settable=True)
    on_infeasible = _delegated("on_infeasible", '"best_effort" or "raise".', settable=True)
    on_busy = _delegated("on_busy", '"trim" or "wait": what the wait for the requests ahead does to a plan.', settable=True)
    endpoint_label = _delegated("endpoint_label", "The replica every report names (None: one engine).", settable=True)
    queue = _delegated("queue", "The engine's in-flight queue, shared by its wrappers (None: not an in-process engine).")
    attainment_target = _delegated("attainment_target", "The share of budgeted requests the margin aims to keep in budget.", settable=True)
    persist_every = _delegated("persist_every", "Store the refined profile every N measured requests (0: never).", settable=True)
    max_reports = _delegated("max_reports", "How many recent reports are kept.", settable=True)

    def prepare(self, messages: Any, rag_chunks: Any = None, params: Mapping[str, Any] | None = None, *,
                ttft_budget_s: float | None = None, on_busy: str | None = None, queue_wait_s: float | None = None) -> Prepared:
        """Validate, plan and check a request without sending it (:meth:`Pipeline.prepare`)."""
        return self.pipeline.prepare(messages, rag_chunks, params, ttft_budget_s=ttft_budget_s, on_busy=on_busy,
                                     queue_wait_s=queue_wait_s)

    def idle(self, timeout_s: float | None = None) -> None:
        """Finish pending background summaries now (call when the user is reading).

        With ``background_summaries=False`` this is where summaries are computed."""
        self.pipeline.idle(timeout_s)


class StreamReporter:
    """Shared by the sync and async streams: builds the report when the timed stream ends."""

    def __init__(self, ts: TimedStream, pipeline: Pipeline, prepared: Prepared, params: Mapping[str, Any], *, watch: Any = None) -> None:
        self.timed = ts
        self.pipeline = pipeline
        self._prepared = prepared
        #: the driver of the request's watched prefill (None: not watched); a re-plan changes
        #: what was sent, which the report states
        self.watch = watch
        self.params = params
        #: the report, once the stream is exhausted
        self.report: Report | None = None
        self.chunks: list[Any] = []
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

    @property
    def ticket(self) -> Ticket | None:
        """The request's place in the engine's queue (None off an in-process engine)."""
        return getattr(self.prepared, "ticket", None)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around reading the next chunk: an error that ends the stream gets the report of
        what was sent (if it carries one: :meth:`~trimkit.pipeline.Pipeline.attach_report`) and
        takes the request out of the engine's queue; the first token tells the queue that only
        the decode is left."""
        ticket = self.ticket
        try:
            yield
        except BaseException as exc:
            if ticket is not None:
                ticket.done()
            if isinstance(exc, TrimkitError):
                self.pipeline.attach_report(exc, self.timed, self.prepared, self.params)
            raise
        if ticket is not None and self.timed.first_output_at is not None:
            ticket.first_token()

    def close_ticket(self) -> None:
        """The stream was closed: the request leaves the engine's queue."""
        ticket = self.ticket
        if ticket is not None:
            ticket.done()


class ReportingStream(StreamReporter):
    """The stream a wrapped call returns with ``stream=True``: iterate it exactly like the
    engine's own stream; ``.report`` is set once it is exhausted.

    With an in-process engine the stream holds the engine until it is exhausted, fails, is
    closed (:meth:`close`) or is garbage-collected; any thread may do that — start it in a
    request handler, drain it in a response iterator."""

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with self.reading():
            chunk = next(self.timed)
        self.chunks.append(chunk)
        return chunk

    def close(self) -> None:
        self.timed.close()
        self.close_ticket()


class ReportingOpenAIStream(ReportingStream):
    """What ``create(stream=True)`` returns: iterate it like the client's own stream (it yields
    the client's chunk objects, or dicts for :func:`trimkit.wrap_url`);
    ``.report`` is set once it is exhausted; ``with`` and :meth:`close` work as on ``openai.Stream``."""

    def __enter__(self) -> ReportingOpenAIStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncReportingStream(StreamReporter):
    """What the async ``create(stream=True)`` returns: ``async for`` it like ``openai.AsyncStream``;
    ``.report`` is set once it is exhausted; ``async with`` and ``await close()`` work."""

    def __aiter__(self) -> AsyncReportingStream:
        return self

    async def __anext__(self) -> Any:
        with self.reading():
            chunk = await self.timed.__anext__()  # type: ignore[attr-defined]
        self.chunks.append(chunk)
        return chunk

    async def close(self) -> None:
        await self.timed.aclose()  # type: ignore[attr-defined]
        self.close_ticket()

    async def __aenter__(self) -> AsyncReportingStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
