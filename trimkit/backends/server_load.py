"""What a server says about its load: how many requests it runs now and how many wait.

A fleet (:mod:`trimkit.fleet`) adds the requests it cannot see — other clients' — to the queue
it predicts for each endpoint. Servers say so in different places, each optional:

- **llama.cpp** ``llama-server``: ``GET /slots`` (one entry per slot, ``is_processing``, or
  ``state`` in older builds; on by default in recent builds, ``--slots`` in some, off with
  ``--no-slots``) gives the slots busy and how many there are; ``GET /metrics`` (with
  ``--metrics``) gives ``llamacpp:requests_processing`` and ``llamacpp:requests_deferred``.
  Both are answered by the server's main loop, so they may wait for a prefill batch to finish.
- **vLLM**: ``GET /metrics``, ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``.
- **SGLang**: ``GET /metrics`` (with ``--enable-metrics``), ``sglang:num_running_reqs`` and
  ``sglang:num_queue_reqs``; ``GET /get_load`` (per data-parallel rank: ``num_reqs``,
  ``num_waiting_reqs``) or ``/v1/loads`` in newer builds.
- **TGI**: ``GET /metrics``, ``tgi_batch_current_size`` and ``tgi_queue_size``.
- **llama-cpp-python** (``python -m llama_cpp.server``) exposes none of these (404): a fleet of
  them counts only the requests this client sent.

The parsers are pure (:func:`parse_prometheus`, :func:`load_from_metrics`,
:func:`load_from_slots`, :func:`load_from_sglang`). :class:`ServerLoadReader` asks a server
with a short timeout, remembers which endpoints it does not have (re-checked rarely, never on
every request), and can refresh in the background so that a request never waits for it
(:meth:`ServerLoadReader.latest`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import httpx

from trimkit.backends.fields import load_json
from trimkit.backends.transport import read_capped
from trimkit.errors import MalformedReplyError

__all__ = [
    "ServerLoad",
    "LOAD_METRICS",
    "parse_prometheus",
    "load_from_metrics",
    "load_from_slots",
    "load_from_sglang",
    "ServerLoadReader",
    "LOAD_ENDPOINTS",
]

log = logging.getLogger("trimkit")

#: (running, waiting) metric names, per engine, in the Prometheus text of ``/metrics``
LOAD_METRICS = (
    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ("tgi_batch_current_size", "tgi_queue_size"),
)
#: the largest load body read (vLLM's /metrics with histograms is ~100 KB)
MAX_LOAD_BYTES = 4 * 1024 * 1024
#: a count above this is not a request count
_MAX_COUNT = 1_000_000


@attrs.frozen
class ServerLoad:
    """What a server said about its load (None: it did not say). Counts cover every client."""

    running: int | None = None  # requests being processed now
    waiting: int | None = None  # requests queued, not started
    slots: int | None = None  # requests the server runs at once (llama.cpp /slots)
    source: str = ""  # the endpoint(s) that said so
    at: float = 0.0  # when it was read (the reader's clock)

    @property
    def requests(self) -> int:
        """Running and waiting requests together (0 for what was not said)."""
        return (self.running or 0) + (self.waiting or 0)

    def merged(self, other: ServerLoad) -> ServerLoad:
        """This reading, with what it did not say taken from ``other``."""
        return ServerLoad(
            running=self.running if self.running is not None else other.running,
            waiting=self.waiting if self.waiting is not None else other.waiting,
            slots=self.slots if self.slots is not None else other.slots,
            source="+".join(s for s in (self.source, other.source) if s),
            at=max(self.at, other.at),
        )


def _count(value: Any) -> int | None:
    """A request count, or None for anything that is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value) if 0 <= value <= _MAX_COUNT else None


def _metric_line(line: str) -> tuple[str, float] | None:
    """``name{labels} value [timestamp]`` → (name, value); None for comments and lines that are not samples."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    brace = line.find("{")
    space = len(line) if " " not in line else line.index(" ")
    if 0 <= brace < space:
        name, i, quoted = line[:brace], brace + 1, False
        while i < len(line) and (quoted or line[i] != "}"):  # label values may hold braces and spaces
            if line[i] == "\\":
                i += 1
            elif line[i] == '"':
                quoted = not quoted
            i += 1
        rest = line[i + 1 :]
    else:
        name, rest = line[:space], line[space:]
    fields = rest.split()
    if not name or not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return name, value


def parse_prometheus(text: str, names: Iterable[str]) -> dict[str, float]:
    """The samples named ``names`` in Prometheus text, each summed over its label sets (vLLM
    labels by model and engine); a name absent from the text is absent from the result."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        sample = _metric_line(line)
        if sample is not None and sample[0] in wanted and math.isfinite(sample[1]):
            out[sample[0]] = out.get(sample[0], 0.0) + sample[1]
    return out


def load_from_metrics(text: str) -> ServerLoad | None:
    """The load in a ``/metrics`` body (llama.cpp, vLLM, SGLang, TGI); None if it has none."""
    names = [n for pair in LOAD_METRICS for n in pair]
    values = parse_prometheus(text, names)
    for running, waiting in LOAD_METRICS:
        if running in values or waiting in values:
            return ServerLoad(running=_count(values.get(running)), waiting=_count(values.get(waiting)), source="/metrics")
    return None


def load_from_slots(body: Any) -> ServerLoad | None:
    """The load in llama.cpp's ``/slots`` reply: one object per slot, busy when
    ``is_processing`` is true (or, in older builds, ``state`` is not 0); None for another shape."""
    if not isinstance(body, list) or not body:
        return None
    busy = 0
    for slot in body:
        if not isinstance(slot, Mapping):
            return None
        processing = slot.get("is_processing")
        if processing is None:
            processing = slot.get("state")
        if not isinstance(processing, (bool, int)):
            return None
        busy += bool(processing)
    return ServerLoad(running=busy, slots=len(body), source="/slots")


def load_from_sglang(body: Any) -> ServerLoad | None:
    """The load in SGLang's ``/get_load`` reply (per rank ``num_reqs``, which counts the waiting
    ones too, and ``num_waiting_reqs``) or ``/v1/loads`` (``{"loads": [{"num_running_reqs",
    "num_waiting_reqs"}, ...]}``); None for another shape."""
    ranks = body.get("loads") if isinstance(body, Mapping) else body
    if not isinstance(ranks, list) or not ranks:
        return None
    running = waiting = 0
    for rank in ranks:
        if not isinstance(rank, Mapping):
            return None
        wait = _count(rank.get("num_waiting_reqs"))
        if wait is None:
            return None
        run = _count(rank.get("num_running_reqs"))
        if run is None:
            total = _count(rank.get("num_reqs"))
            if total is None:
                return None
            run = max(total - wait, 0)
        running, waiting = running + run, waiting + wait
    return ServerLoad(running=running, waiting=waiting, source="/get_load")


def _from_json(parse: Callable[[Any], ServerLoad | None]) -> Callable[[bytes], ServerLoad | None]:
    def read(body: bytes) -> ServerLoad | None:
        return parse(load_json(body, what="load reply"))

    return read


def _from_text(body: bytes) -> ServerLoad | None:
    return load_from_metrics(body.decode("utf-8", "replace"))


#: where a server may say its load, in the order asked, and how each answer is read
LOAD_ENDPOINTS: tuple[tuple[str, Callable[[bytes], ServerLoad | None]], ...] = (
    ("/slots", _from_json(load_from_slots)),
    ("/metrics", _from_text),
    ("/get_load", _from_json(load_from_sglang)),
)
_MISSING = (404, 405, 501)


class ServerLoadReader:
    """Reads a server's load from the endpoints it has (:data:`LOAD_ENDPOINTS`).

    ``http`` is the client to ask with (the backend's, so its transport and headers apply) and
    ``root_url`` the server root. Each ask waits at most ``timeout_s``. An endpoint the server
    does not have (404/405/501, or a body without load in it) is not asked again for
    ``recheck_s``; one that failed (unreachable, timed out, an error status) for ``retry_s``.
    A reading older than ``stale_s`` is not used.
    """

    def __init__(self, http: httpx.Client, root_url: str, headers: Mapping[str, str] | None = None, *, timeout_s: float = 0.5,
                 max_age_s: float = 0.5, stale_s: float = 5.0, recheck_s: float = 600.0, retry_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.http = http
        self.root_url = root_url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout_s, self.max_age_s, self.stale_s = timeout_s, max_age_s, stale_s
        self.recheck_s, self.retry_s = recheck_s, retry_s
        self.clock = clock
        #: endpoint path → when it may be asked again (absent or failing until then)
        self.skip_until: dict[str, float] = {}
        #: the endpoints that answered with a load
        self.present: set[str] = set()
        self.last: ServerLoad | None = None
        self._lock = threading.Lock()
        self._refreshing = False

    @property
    def absent(self) -> set[str]:
        """The endpoints not asked now (the server lacks them, or they failed recently)."""
        now = self.clock()
        return {path for path, until in self.skip_until.items() if until > now}

    def read(self) -> ServerLoad | None:
        """Ask the server now (each endpoint it may have, once); None when none says anything."""
        reading: ServerLoad | None = None
        for path, parse in LOAD_ENDPOINTS:
            if self.skip_until.get(path, 0.0) > self.clock():
                continue
            load = self._ask(path, parse)
            if load is not None:
                reading = load if reading is None else reading.merged(load)
        if reading is not None:
            reading = attrs.evolve(reading, at=self.clock())
        with self._lock:
            self.last = reading if reading is not None else self.last
        return reading

    def latest(self) -> ServerLoad | None:
        """The last reading if it is recent, without waiting: one older than ``max_age_s`` is
        refreshed in a background thread (at most one at a time) for the next call."""
        now = self.clock()
        with self._lock:
            last = self.last
            due = (last is None or now - last.at >= self.max_age_s) and not self._refreshing
            nothing_to_ask = all(self.skip_until.get(path, 0.0) > now for path, _ in LOAD_ENDPOINTS)
            if due and not nothing_to_ask:
                self._refreshing = True
        if due and not nothing_to_ask:
            threading.Thread(target=self._refresh, name="trimkit-load", daemon=True).start()
        return last if last is not None and now - last.at < self.stale_s else None

    def _refresh(self) -> None:
        try:
            self.read()
        except Exception:  # a load reading must never fail anything
            log.debug("trimkit: reading the load of %s failed", self.root_url, exc_info=True)
        finally:
            with self._lock:
                self._refreshing = False

    def _ask(self, path: str, parse: Callable[[bytes], ServerLoad | None]) -> ServerLoad | None:
        url = self.root_url + path
        try:
            with self.http.stream("GET", url, headers=self.headers, timeout=httpx.Timeout(self.timeout_s)) as resp:
                status = resp.status_code
                body = read_capped(resp.iter_bytes(), MAX_LOAD_BYTES, f"reply from {url}") if status < 400 else b""
        except (httpx.HTTPError, MalformedReplyError) as exc:
            self.skip_until[path] = self.clock() + self.retry_s
            log.debug("trimkit: %s gave no load: %s", url, exc)
            return None
        if status in _MISSING or status >= 400:
            self.skip_until[path] = self.clock() + (self.recheck_s if status in _MISSING else self.retry_s)
            return None
        try:
            load = parse(body)
        except MalformedReplyError:
            load = None
        if load is None:  # not the shape this server's endpoint would have: another engine's path
            self.skip_until[path] = self.clock() + self.recheck_s
            self.present.discard(path)
            return None
        self.present.add(path)
        self.skip_until.pop(path, None)
        return load
