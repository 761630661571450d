"""Summaries of older turns, computed off the critical path.

After each response the :class:`~trimkit.pipeline.Pipeline` hands the request's plan to a
:class:`SummaryWorker`; it asks :func:`~trimkit.planning.summaries.next_summary_job` what to
summarize next and runs that job in a background thread (one at a time), or on
:meth:`SummaryWorker.idle` when background work is turned off. The planner may put a ready
summary in place of the turns it covers on a later request (:class:`SummaryCache`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from trimkit.errors import InvalidInputError
from trimkit.planning.summaries import ExtractiveSummarizer, SummaryCache, next_summary_job

__all__ = ["SummaryWorker", "as_summarizer"]

log = logging.getLogger("trimkit")


def as_summarizer(summarizer: Any) -> Any:
    """``summarizer`` as the wrappers take it: a Summarizer, ``"extractive"`` (the model-free
    :class:`~trimkit.planning.summaries.ExtractiveSummarizer`) or None (summaries off)."""
    if isinstance(summarizer, str) and summarizer == "extractive":
        return ExtractiveSummarizer()
    if summarizer is not None and not callable(getattr(summarizer, "summarize", None)):
        raise InvalidInputError(f"summarizer must be a Summarizer, 'extractive' or None, got {type(summarizer).__name__}")
    return summarizer


class SummaryWorker:
    """Computes the next summary after each response, in a daemon thread or on :meth:`idle`."""

    def __init__(self, summarizer: Any, *, background: bool, tokenizer: Callable[[], Any]) -> None:
        #: computes the summaries (None: summaries are off)
        self.summarizer = as_summarizer(summarizer)
        #: run jobs in a background thread (False: on :meth:`idle`)
        self.background = background
        #: the summaries made so far; the planner reads ready ones from here
        self.cache = SummaryCache()
        #: the token counter summaries are capped with, looked up when a job starts
        self._tokenizer = tokenizer
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._last_plan: Any = None

    def after_response(self, plan: Any) -> None:
        """Schedule the summary a finished request's plan calls for (if any) in the background."""
        self._last_plan = plan
        if not self.background:
            return
        job = self._job(plan)
        if job is None:
            return
        t = threading.Thread(target=self._run, args=(job,), name="trimkit-summary", daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            if self._threads:  # one at a time; the next response schedules the next one
                return
            self._threads.append(t)
        t.start()

    def idle(self, timeout_s: float | None = None) -> None:
        """Finish pending background summaries now; without background work, compute the one
        the last response's plan calls for."""
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout_s)
        if not self.background:
            job = self._job(self._last_plan)
            if job is not None:
                self._run(job)

    def _job(self, plan: Any) -> Callable[[], Any] | None:
        if self.summarizer is None or plan is None:
            return None
        return next_summary_job(plan, self.summarizer, self.cache, count_tokens=self._tokenizer())

    @staticmethod
    def _run(job: Callable[[], Any]) -> None:
        try:
            job()
        except Exception:  # a failed background summary must never break the chat
            log.exception("trimkit: background summary failed")
