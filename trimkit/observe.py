"""What each finished request tells the tools outside: the one hook every front-end shares.

:meth:`trimkit.pipeline.Pipeline.report` calls :func:`completed` once for every report it makes
— a finished request, one that failed while it streamed, one refused before it was sent — so
the in-process wrapper, the OpenAI wrappers (sync and async) and every endpoint of a fleet are
covered by this one call. It hands a :class:`Completed` to

- the wrapper's own sinks: a report log (``wrap(..., report_log=...)``: :class:`ReportLog`);
- the observers installed process-wide: OpenTelemetry (:func:`trimkit.otel.instrument`) and
  Prometheus (:func:`trimkit.metrics.enable`), which import their libraries themselves —
  ``import trimkit`` imports neither.

An observer that fails is logged (its error type only) and never fails the request. Nothing
here carries the prompt's text: :func:`figures` are numbers, :func:`loggable` drops the decode
parameters that are not plain numbers or flags (``tools``, ``stop``, ``grammar`` may hold text).
See docs/observability.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

import attrs

from trimkit.errors import InvalidInputError

if TYPE_CHECKING:
    from trimkit.report import Report

__all__ = ["Completed", "Figures", "ReportLog", "TTFT_BUCKETS_S", "add_observer", "completed", "figures", "loggable",
           "remove_observer", "report_log"]

log = logging.getLogger("trimkit")

#: the TTFT histogram's bucket boundaries, seconds: 10 ms to 60 s, about 2–2.5× apart (Prometheus
#: and OpenTelemetry alike)
TTFT_BUCKETS_S: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
#: measured TTFT ÷ budget (1.0: the whole budget used)
BUDGET_USE_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
#: |predicted − measured| ÷ measured TTFT (its direction, "over" or "under", is a label)
PREDICTION_ERROR_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
#: decode speed, tokens/s
DECODE_SPEED_BUCKETS: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


@attrs.frozen
class Completed:
    """One request's end, as an observer receives it: its report, the error type it ended with
    (None: it succeeded), the time spent preparing it (validate and plan) and the wall-clock
    time it ended (``time.time_ns()``), from which the spans' times are laid out."""

    report: Report
    error_type: str | None = None
    prepare_s: float = 0.0
    ended_ns: int = attrs.field(factory=time.time_ns)


@attrs.frozen
class Figures:
    """The numbers of one request that every exporter records (None: not known)."""

    outcome: str  # "passthrough", "trimmed", "infeasible", "refused" or "error"
    model: str  # the model asked for (the report's ``model`` without its `` @ url``)
    server_address: str | None  # the server's host, from that url (None in process)
    server_port: int | None
    ttft_s: float | None
    predicted_ttft_s: float | None
    budget_s: float | None
    budget_met: bool | None
    budget_use: float | None
    prediction_error: float | None  # |predicted − measured| ÷ measured
    prediction_direction: str  # "over" (predicted above measured), "under" or "exact"; "" when unknown
    input_tokens: int
    input_tokens_before: int | None
    tokens_removed: int
    cached_tokens: int | None
    output_tokens: int | None
    decode_tokens_per_s: float | None
    replans: int
    removed_messages: tuple[int, ...]
    summarized_messages: tuple[int, ...]
    removed_chunks: tuple[str, ...]


def figures(c: Completed) -> Figures:
    """What the exporters record of a finished request (counts and ids, never text)."""
    r = c.report
    removed_messages = sorted({i for a in r.actions for i in getattr(a, "removed_messages", ())})
    summarized = sorted({i for a in r.actions for i in getattr(a, "summarized_messages", ())})
    chunks = [str(x) for a in r.actions for x in getattr(a, "removed_chunks", ())]
    chunks += [str(x) for p in r.replans for x in p.dropped if not str(x).startswith(("+", "message "))]
    if c.error_type is not None:
        outcome = "refused" if "not sent" in r.warnings else "error"
    elif r.feasible is False:
        outcome = "infeasible"
    else:
        outcome = "passthrough" if r.passthrough else "trimmed"
    before = r.prompt_tokens_before
    ttft, budget = r.measured_ttft_s, r.ttft_budget_s
    model, _, url = (r.model or "").partition(" @ ")
    where = urlsplit(url) if url else None
    try:
        port = where.port if where is not None else None
    except ValueError:
        port = None
    return Figures(
        outcome=outcome, model=model, server_address=where.hostname if where is not None else None,
        server_port=port or ({"http": 80, "https": 443}.get(where.scheme) if where is not None and where.hostname else None),
        ttft_s=ttft, predicted_ttft_s=r.predicted_ttft_s, budget_s=budget, budget_met=r.budget_met,
        budget_use=None if ttft is None or not budget else ttft / budget,
        prediction_error=None if r.ttft_error_pct is None else abs(r.ttft_error_pct) / 100.0,
        prediction_direction="" if r.ttft_error_pct is None else "over" if r.ttft_error_pct > 0 else "under" if r.ttft_error_pct < 0 else "exact",
        input_tokens=r.prompt_tokens, input_tokens_before=before, tokens_removed=max((before or 0) - r.prompt_tokens, 0),
        cached_tokens=r.cached_tokens,
        output_tokens=r.completion_tokens, decode_tokens_per_s=r.decode_tokens_per_s, replans=len(r.replans),
        removed_messages=tuple(removed_messages), summarized_messages=tuple(summarized), removed_chunks=tuple(dict.fromkeys(chunks)),
    )


def loggable(report: Report) -> dict[str, Any]:
    """``report.to_dict()`` without the decode parameters that may carry text (only numbers,
    flags and None are kept; the others are named, their values left out)."""
    d = report.to_dict()
    params = d.get("decode_params") or {}
    d["decode_params"] = {k: v for k, v in params.items() if v is None or isinstance(v, (bool, int, float))}
    left_out = sorted(k for k in params if k not in d["decode_params"])
    if left_out:
        d["decode_params_not_logged"] = left_out
    return d


Observer = Callable[[Completed], None]
_observers: list[Observer] = []
_lock = threading.Lock()


def add_observer(observer: Observer) -> None:
    """Call ``observer(completed)`` at the end of every request, in every wrapper of this process."""
    with _lock:
        if observer not in _observers:
            _observers.append(observer)


def remove_observer(observer: Observer) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def completed(report: Report, *, error_type: str | None = None, prepare_s: float = 0.0, sinks: tuple[Observer, ...] = ()) -> None:
    """A request's report is complete: tell the wrapper's ``sinks`` and every installed observer."""
    everyone = (*sinks, *_observers)
    if not everyone:
        return
    c = Completed(report, error_type, prepare_s)
    for observer in everyone:
        try:
            observer(c)
        except Exception as exc:  # an exporter must never fail the request (its message may quote data)
            log.warning("trimkit: an observer failed (%s); the request is unaffected", type(exc).__name__)


class ReportLog:
    """One JSON line per finished request (:func:`loggable`: the report's ``to_dict()``, nothing
    of the prompt's text), appended to a path or written to a file-like object. Safe to share
    between threads and wrappers (a fleet's endpoints share one); ``trimkit report FILE``
    draws it."""

    _path_locks: dict[str, threading.Lock] = {}

    def __init__(self, target: str | os.PathLike[str] | IO[str]) -> None:
        if isinstance(target, (str, os.PathLike)):
            self.path: str | None = os.fspath(target)
            self.stream: IO[str] | None = None
            key = os.path.abspath(self.path)
            self._lock = ReportLog._path_locks.setdefault(key, threading.Lock())
        elif callable(getattr(target, "write", None)):
            self.path, self.stream = None, target
            key = f"stream:{id(target)}"
            self._lock = ReportLog._path_locks.setdefault(key, threading.Lock())
        else:
            raise InvalidInputError(f"report_log must be a path or a file-like object with .write, got {type(target).__name__}")

    def __call__(self, c: Completed) -> None:
        d = loggable(c.report)
        d["error_type"] = c.error_type
        d["ended_at"] = c.ended_ns / 1e9
        line = json.dumps(d) + "\n"
        with self._lock:
            if self.stream is not None:
                self.stream.write(line)
                flush = getattr(self.stream, "flush", None)
                if flush is not None:
                    flush()
            else:
                with open(self.path, "a", encoding="utf-8") as f:  # type: ignore[arg-type]
                    f.write(line)


def report_log(target: Any) -> tuple[Observer, ...]:
    """The sinks of ``wrap(..., report_log=target)``: none for None, a :class:`ReportLog` otherwise
    (checked now, before any request)."""
    if target is None:
        return ()
    return (target if isinstance(target, ReportLog) else ReportLog(target),)
