"""How long a request may wait, and how it is retried.

The decisions have no I/O in them: :class:`RequestLimits` (a backend's settings: timeouts, the
retry window, backoff) gives each request its :class:`Deadline`, each attempt its :class:`Wait`
and httpx timeouts, and the one set of tenacity arguments that both loops use;
:class:`RetryRun` keeps the books of one retried call. :func:`with_retries` and
:func:`awith_retries` apply them and differ only in how they wait.

Deadlines: a call given ``deadline_s`` bounds every network wait before its first chunk —
connect, the response headers, each read, SSE comments that never make an event — by that
deadline, counted from the call, across retries: past it,
:class:`~trimkit.errors.ServerTimeoutError`. After the first chunk the stream may run as long as
it needs, as long as no silence between two reads exceeds ``min(timeout_s, deadline_s)``.
Without ``deadline_s`` each wait is bounded by ``timeout_s`` only, and ``retry_deadline_s``
bounds the retries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import attrs
import httpx
import tenacity

from trimkit.errors import InvalidInputError, ServerTimeoutError, ServerUnreachableError, TransientServerError, TrimkitError, count

__all__ = ["MIN_WAIT_S", "RETRIED", "Deadline", "Wait", "RequestLimits", "RetryRun", "with_retries", "awith_retries", "run_within"]

log = logging.getLogger("trimkit")

#: no single network wait is set shorter than this
MIN_WAIT_S = 0.05
#: the errors a request is retried on, inside its deadline: transient statuses
#: (:data:`~trimkit.backends.transport.TRANSIENT_STATUSES`) and unreachable servers
RETRIED = (TransientServerError, ServerUnreachableError)


@attrs.frozen
class Deadline:
    """How long a request may take to produce its first chunk (a side request: its answer).

    ``seconds`` always bounds the retries. ``bounded``: it also bounds every wait — a request
    still waiting when it passes raises ServerTimeoutError — and each network read of the
    request waits at most ``seconds`` (and ``timeout_s``)."""

    seconds: float
    bounded: bool = False


@attrs.frozen
class Wait:
    """What one attempt may wait: ``remaining_s`` of its deadline; ``bound_s`` (bounded
    deadlines only) the longest any single read may take."""

    remaining_s: float
    bound_s: float | None = None


def _positive(value: Any, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidInputError(f"{label} must be a number > 0, got {value!r}")
    return float(value)


@attrs.define
class RequestLimits:
    """A backend's timeouts and retry settings; they may be changed on the instance."""

    timeout_s: float = attrs.field(default=300.0, converter=lambda v: _positive(v, "timeout_s"))
    connect_timeout_s: float = attrs.field(default=5.0, converter=lambda v: _positive(v, "connect_timeout_s"))
    retry_deadline_s: float = attrs.field(default=30.0, converter=lambda v: _positive(v, "retry_deadline_s"))
    max_attempts: int = attrs.field(default=10, converter=lambda v: count(v, "max_attempts", minimum=1))
    retry_backoff_s: float = attrs.field(default=0.1, converter=float)
    retry_backoff_max_s: float = attrs.field(default=2.0, converter=float)
    #: the deadline of calls and side requests that give none (None: waits bounded by timeout_s only)
    deadline_s: float | None = None

    def deadline(self, retry_deadline_s: float | None = None, deadline_s: float | None = None, *, unbounded: bool = False) -> Deadline:
        """A request's deadline: ``deadline_s`` (else the instance's), bounding every wait; without
        one (or ``unbounded``: calibration probes, non-streamed answers) the retry window only."""
        if not unbounded:
            bound = deadline_s if deadline_s is not None else self.deadline_s
            if bound is not None:
                return Deadline(float(bound), bounded=True)
        return Deadline(float(self.retry_deadline_s if retry_deadline_s is None else retry_deadline_s))

    def whole_answer_deadline(self, retry_deadline_s: float | None, deadline_s: float | None) -> Deadline:
        """A non-streamed request's deadline: bounded only by a ``deadline_s`` given for it (its
        first byte comes after the whole answer)."""
        return self.deadline(retry_deadline_s, deadline_s, unbounded=deadline_s is None)

    def read_timeout_s(self, wait: Wait | None) -> float:
        """The longest one read may wait: ``timeout_s``, or with a bounded deadline at most the deadline."""
        if wait is None or wait.bound_s is None:
            return self.timeout_s
        return max(min(self.timeout_s, wait.bound_s), MIN_WAIT_S)

    def httpx_timeout(self, wait: Wait | None = None) -> httpx.Timeout:
        """The httpx timeouts of one attempt: connect within what is left of the deadline, each
        other wait :meth:`read_timeout_s`."""
        if wait is None:
            return httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)
        return httpx.Timeout(self.read_timeout_s(wait), connect=max(min(self.connect_timeout_s, wait.remaining_s), MIN_WAIT_S))

    def retry_arguments(self, deadline: Deadline) -> dict[str, Any]:
        """The tenacity arguments of a request (for ``Retrying`` and ``AsyncRetrying`` alike):
        retry transient failures with exponential backoff (at least the server's
        ``Retry-After``), within ``max_attempts`` and the deadline."""
        expo = tenacity.wait_exponential(multiplier=self.retry_backoff_s, min=self.retry_backoff_s, max=self.retry_backoff_max_s)

        def wait(state: tenacity.RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            retry_after = getattr(exc, "retry_after_s", None)
            base = expo(state)
            return max(base, retry_after) if retry_after else base

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.info("trimkit: attempt %d failed (%s); retrying in %.2f s", state.attempt_number, exc, state.upcoming_sleep)

        return dict(
            stop=tenacity.stop_after_attempt(self.max_attempts) | tenacity.stop_before_delay(deadline.seconds),
            wait=wait,
            retry=tenacity.retry_if_exception_type(RETRIED),
            before_sleep=before_sleep,
            reraise=True,
        )


class RetryRun:
    """The books of one retried call: when it started, the last attempt's error, what each
    attempt may wait and what to raise when the deadline passes or the retries give up."""

    def __init__(self, deadline: Deadline, url: str) -> None:
        self.deadline = deadline
        self.url = url
        self.start = time.monotonic()
        self.previous: BaseException | None = None

    def wait(self) -> Wait:
        remaining = self.deadline.seconds - (time.monotonic() - self.start)
        return Wait(remaining, self.deadline.seconds if self.deadline.bounded else None)

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Around one attempt: keep its error (see :meth:`timed_out`)."""
        try:
            yield
        except BaseException as exc:
            self.previous = exc
            raise

    def timed_out(self) -> BaseException:
        """The error for an attempt still waiting when the deadline passed: the previous
        attempt's error status if there was one (the server was answering, with 503s), else
        ServerTimeoutError."""
        if isinstance(self.previous, TransientServerError):
            return self.previous
        return ServerTimeoutError(f"{self.url} did not answer within the request's deadline of {self.deadline.seconds:.2f} s "
                                  "(no first chunk, or no reply to a side request)")

    def gave_up(self, exc: ServerUnreachableError, retrying: tenacity.BaseRetrying) -> ServerUnreachableError:
        attempts = retrying.statistics.get("attempt_number", 1)
        return type(exc)(f"{exc} (gave up after {attempts} attempts in {time.monotonic() - self.start:.1f} s)")


def _keep(value: Any) -> None:
    """What an abandoned attempt returned needs nothing done with it."""


def with_retries(attempt: Callable[[Wait], Any], deadline: Deadline, url: str, limits: RequestLimits,
                 discard: Callable[[Any], None] = _keep) -> Any:
    """Run ``attempt(wait)`` until it succeeds, a non-transient error, or the deadline; with a
    bounded deadline no attempt is waited for past it (ServerTimeoutError), and what an
    abandoned attempt opens later is ``discard``-ed."""
    run = RetryRun(deadline, url)
    retrying = tenacity.Retrying(**limits.retry_arguments(deadline))
    try:
        for try_ in retrying:
            with try_, run.attempt():
                wait = run.wait()
                if not deadline.bounded:
                    return attempt(wait)
                return run_within(lambda wait=wait: attempt(wait), wait.remaining_s, discard, run.timed_out)
    except ServerUnreachableError as exc:
        raise run.gave_up(exc, retrying) from exc
    raise AssertionError("unreachable")  # pragma: no cover


async def awith_retries(attempt: Callable[[Wait], Awaitable[Any]], deadline: Deadline, url: str, limits: RequestLimits) -> Any:
    """:func:`with_retries` for asyncio (an attempt past the deadline is cancelled)."""
    run = RetryRun(deadline, url)
    retrying = tenacity.AsyncRetrying(**limits.retry_arguments(deadline))
    try:
        async for try_ in retrying:
            with try_, run.attempt():
                wait = run.wait()
                if not deadline.bounded:
                    return await attempt(wait)
                try:
                    async with asyncio.timeout(max(wait.remaining_s, 0.0)):
                        return await attempt(wait)
                except TimeoutError as exc:
                    if isinstance(exc, TrimkitError):
                        raise
                    raise run.timed_out() from None
    except ServerUnreachableError as exc:
        raise run.gave_up(exc, retrying) from exc
    raise AssertionError("unreachable")  # pragma: no cover


def run_within(fn: Callable[[], Any], seconds: float, discard: Callable[[Any], None], timed_out: Callable[[], BaseException]) -> Any:
    """``fn()`` in a worker thread, waited for at most ``seconds``; then ``timed_out()`` is raised.

    Why a thread: a blocking socket read cannot be given an overall deadline (httpx bounds each
    read, and a server may trickle bytes forever), and the ``openai`` client's stream cannot be
    interrupted from outside. The abandoned worker ends on its own — each of its network waits
    is bounded too — and whatever it returns after the caller gave up is ``discard``-ed."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, name="trimkit-request", daemon=True).start()
    done, _ = concurrent.futures.wait([future], timeout=max(seconds, 0.0))
    if not done:
        future.add_done_callback(lambda f: _discard_quietly(f, discard))
        raise timed_out()
    return future.result()


def _discard_quietly(future: concurrent.futures.Future[Any], discard: Callable[[Any], None]) -> None:
    if future.exception() is None:
        with contextlib.suppress(Exception):
            discard(future.result())
