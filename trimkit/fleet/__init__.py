"""A fleet of OpenAI-compatible endpoints behind one TTFT budget: routing and failover from the client.

::

    chat = trimkit.wrap_url(["http://10.0.0.1:8080/v1", "http://10.0.0.2:8080/v1"], model="m", ttft_budget_s=1.0)
    out = chat.chat.completions.create(messages=messages, rag_chunks=chunks, max_tokens=128)
    print(chat.last_report.endpoint, chat.endpoints)

``trimkit.wrap_url([...])`` (URLs, plain dicts back) and ``trimkit.wrap([client, ...])`` (``openai``
clients, all sync or all async) give a :class:`FleetFrontEnd` (:class:`AsyncFleetFrontEnd`) with the
``.chat.completions.create`` of one endpoint's wrapper, ``last_report``, ``reports`` and
``.endpoints`` (:class:`~trimkit.fleet.FleetEndpoint`: in flight, up or down, profile, load).

- **Each endpoint is a wrapper of its own** (:class:`~trimkit.openai_wrapper.TrimmedOpenAI`): its
  backend, pipeline and profile — a ``profile=`` given (one for all, or one per endpoint), else
  the one of an identical replica already reached (same engine, version, models and context:
  identical replicas share one profile, so calibration noise cannot make one look faster; each
  endpoint's live refinement still learns its own speed), else the stored one or a
  micro-calibration, one endpoint after the other at construction
  (``parallel_calibration=True`` for servers on separate machines: on one host they would disturb
  each other's measurements). An endpoint down at construction joins when a probe reaches it.
- **Routing** (:class:`trimkit.fleet._frontend.FleetCall`): each request goes to the endpoint with the lowest
  predicted TTFT for it — the wait behind the requests ahead of it there plus the prefill of what
  that endpoint does not hold — so a conversation stays on the replica that holds its prefix
  unless that replica is busy enough to lose. The endpoint's pipeline plans against the budget less
  that wait. ``report.endpoint`` names the replica; the report shows the wait predicted and the
  cached tokens. The wait counts what this client sent (predicted TTFT + ``max_tokens`` / decode
  speed each) and, where the server says its load (:mod:`trimkit.backends.server`), other
  clients' requests.
- **Failover**: an endpoint that refuses, times out or fails before a request's first token is taken
  out of rotation and probed again later (``GET /v1/models`` after ``probe_after_s``, doubling to
  ``probe_max_s``); the request is re-planned on the next-best endpoint with what is left of its
  budget. A stream that breaks after its first token raises
  :class:`~trimkit.errors.StreamInterruptedError` with its report, as on one endpoint. All down:
  :class:`~trimkit.fleet.FleetUnavailableError` listing what was tried. A fleet retries one
  endpoint briefly (``max_attempts=2`` unless given) and moves on.

Replicas must serve one model with one tokenizer (a prompt is counted once, for routing, by the
endpoint with fewest requests in flight, and planned from that count). llama-cpp-python's server
(``python -m llama_cpp.server``) exposes no load, cuts the stream in flight short when a second request arrives unless started with
``--interrupt_requests false``, and answers a tokenize request only once its model is free; count
locally and exactly instead (no request at all)::

    from trimkit.backends.llama import llama_prompt_tokenizer
    tokenizer = llama_prompt_tokenizer(trimkit.default_llama(vocab_only=True, n_ctx=512))  # the served GGUF
    chat = trimkit.wrap_url(urls, tokenizer=tokenizer, n_ctx=4096, ttft_budget_s=1.0)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from trimkit.backends.base import client_is_async, is_openai_client
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.server import RoutingOptions, ServerLoadReader
from trimkit.backends.transport import normalize_base_url
from trimkit.errors import FleetOverloadedError, FleetUnavailableError, InvalidInputError, positive_finite
from trimkit.fleet._endpoint import FleetEndpoint, Health
from trimkit.fleet._frontend import AsyncFleetFrontEnd, AsyncFleetStream, FleetBase, FleetFrontEnd, FleetStream
from trimkit.openai_wrapper import AsyncTrimmedOpenAI, OpenAIFrontEnd, TrimmedOpenAI, split_backend_kwargs
from trimkit.openai_wrapper import wrap_url as wrap_one_url
from trimkit.planning.profile import Profile
from trimkit.report import valid_tokens_per_s_target

__all__ = ["wrap_fleet", "wrap_url", "FleetFrontEnd", "AsyncFleetFrontEnd", "FleetStream", "AsyncFleetStream", "FleetEndpoint",
           "FleetUnavailableError", "FleetOverloadedError", "FLEET_BACKEND_DEFAULTS"]

#: backend settings a fleet uses unless given: retry one endpoint briefly, then fail over
FLEET_BACKEND_DEFAULTS: Mapping[str, Any] = {"max_attempts": 2, "retry_backoff_s": 0.05, "retry_backoff_max_s": 0.2}


def _kind(targets: Any) -> str:
    """``"url"``, ``"sync"`` or ``"async"``: what the fleet is made of (InvalidInputError for
    anything else: not a list, empty, mixed, a client that is not OpenAI-shaped)."""
    if not isinstance(targets, (list, tuple)):
        raise InvalidInputError(f"a fleet is a list of URLs or of openai clients, got {type(targets).__name__}")
    if not targets:
        raise InvalidInputError("a fleet needs at least one endpoint: got an empty list")
    kinds = set()
    for t in targets:
        if isinstance(t, str):
            kinds.add("url")
        elif is_openai_client(t):
            kinds.add("async" if client_is_async(t) else "sync")
        else:
            raise InvalidInputError(f"a fleet endpoint must be a URL or an openai-style client, got {type(t).__name__}")
    if len(kinds) > 1:
        raise InvalidInputError(f"a fleet's endpoints must be all URLs, all sync clients or all async clients; got {sorted(kinds)}")
    return kinds.pop()


def _base_url(target: Any) -> str:
    base = target if isinstance(target, str) else getattr(target, "base_url", None)
    if base is None:
        raise InvalidInputError(f"{type(target).__name__} has no base_url")
    return normalize_base_url(str(base))[0]


def _profiles(profile: Any, n: int) -> list[Profile | None]:
    if profile is None or isinstance(profile, Profile):
        return [profile] * n
    if isinstance(profile, (list, tuple)) and len(profile) == n and all(p is None or isinstance(p, Profile) for p in profile):
        return list(profile)
    raise InvalidInputError(f"profile must be a Profile (for every endpoint) or a list of {n} (one per endpoint), got {type(profile).__name__}")


class _TwinProfiles:
    """One profile for identical replicas: the first replica of an engine, version, model list
    and context size to be reached loads or calibrates its profile, and every later one starts
    from it (calibration noise alone must not make one twin look faster: each endpoint's live
    refinement still learns its own speed from its own requests). A replica reached while its
    twin calibrates waits for that profile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.profiles: dict[Any, Profile] = {}
        self.busy: dict[Any, threading.Lock] = {}

    @staticmethod
    def identity(backend: OpenAIHTTPBackend) -> Any:
        info = backend.server_info()
        return (info.engine, info.engine_version, info.model_ids, backend.n_ctx, backend.model or "")

    def build(self, backend: OpenAIHTTPBackend, make: Any) -> OpenAIFrontEnd:
        """``make(profile)`` with the twin's profile (None: the first of its kind: its own)."""
        twin = self.identity(backend)
        with self.lock:
            turn = self.busy.setdefault(twin, threading.Lock())
        with turn:
            shared = self.profiles.get(twin)
            front = make(shared)
            if shared is None:
                self.profiles[twin] = front.profile
            return front


def _build_front(cls: type[OpenAIFrontEnd], client: Any, backend: OpenAIHTTPBackend, label: str, profile: Profile | None,
                 kwargs: Mapping[str, Any], twins: _TwinProfiles | None = None) -> OpenAIFrontEnd:
    """One endpoint's wrapper over its backend (its pipeline; its profile given, an identical
    replica's, stored, or calibrated now)."""

    def make(shared: Profile | None) -> OpenAIFrontEnd:
        front = cls(client, backend=backend, endpoint_label=label, profile=shared, **kwargs)
        front.bound_side_requests()
        front.pipeline.watch_prefill = False  # the fleet sends in one piece: planned with the whole prediction's margin
        return front

    if profile is not None or twins is None:
        return make(profile)
    return twins.build(backend, make)


def wrap_fleet(targets: Sequence[Any], ttft_budget_s: float | None = None, *, model: str | None = None, api_key: str | None = None,
               asynchronous: bool | None = None, profile: Profile | Sequence[Profile] | None = None, retry_deadline_s: float | None = None,
               slots: int | None = None, held_prompts: int | None = None, parallel_calibration: bool = False, read_load: bool = True,
               probe_after_s: float = 1.0, probe_max_s: float = 30.0, probe_timeout_s: float = 2.0, **kwargs: Any) -> FleetBase:
    """A fleet of OpenAI-compatible endpoints (see the module): ``targets`` are base URLs (the
    requests go out through ``httpx``, answers are dicts; ``asynchronous=True`` for the async
    front-end) or ``openai`` clients (all sync, or all async: :class:`AsyncFleetFrontEnd`).

    ``profile``: one for every endpoint, a list with one per endpoint, or None (each endpoint's
    stored profile, else a micro-calibration). ``parallel_calibration``: reach the endpoints in
    parallel threads (servers on separate machines). ``slots`` / ``held_prompts``: how many
    requests each server runs at once and how many recent prompts its cache holds (None: from
    the server, see :class:`~trimkit.fleet.FleetEndpoint`). ``read_load``: read the
    servers' own load (``/slots``, ``/metrics``, ``/get_load``). ``probe_after_s``,
    ``probe_max_s``, ``probe_timeout_s``: when an endpoint out of rotation is probed again, the
    longest backoff, and how long a probe waits. Backend settings (``n_ctx``, ``chat_format``,
    ``tokenizer``, ``http_client``, timeouts, ``max_attempts``: 2 by default,
    :data:`FLEET_BACKEND_DEFAULTS`) apply to every endpoint; the rest (``strategies``,
    ``on_infeasible``, ``on_busy``, ``tokens_per_s_target``, ...) goes to every endpoint's pipeline.

    Bad input (not a list, empty, mixed kinds, the same endpoint twice, a malformed URL) raises
    :class:`~trimkit.errors.InvalidInputError` before anything is sent; no endpoint reachable:
    :class:`~trimkit.fleet.FleetUnavailableError`.
    """
    kind = _kind(targets)
    if kind != "url" and asynchronous is not None and asynchronous != (kind == "async"):
        raise InvalidInputError(f"asynchronous={asynchronous} does not match the {kind} clients given")
    if kind != "url" and api_key is not None:
        raise InvalidInputError("api_key is the clients' own: set it on them")
    urls = [_base_url(t) for t in targets]
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise InvalidInputError(f"the same endpoint is listed more than once: {twice}")
    if "backend" in kwargs:
        raise InvalidInputError("a fleet makes one backend per endpoint: pass URLs or clients, not backend=")
    for value, name in ((probe_after_s, "probe_after_s"), (probe_max_s, "probe_max_s"), (probe_timeout_s, "probe_timeout_s")):
        positive_finite(value, name)
    valid_tokens_per_s_target(kwargs.get("tokens_per_s_target"))  # checked now: an endpoint's pipeline may be built later
    RoutingOptions.of(kwargs.get("auto_routing_key", False), kwargs.get("routing_headers"))  # the same
    profiles = _profiles(profile, len(targets))
    backend_kwargs = {**FLEET_BACKEND_DEFAULTS, **split_backend_kwargs(kwargs)}
    is_async = kind == "async" or (kind == "url" and bool(asynchronous))
    cls = AsyncTrimmedOpenAI if is_async else TrimmedOpenAI
    kwargs.update(ttft_budget_s=ttft_budget_s, retry_deadline_s=retry_deadline_s)
    endpoints: list[FleetEndpoint] = []
    twins = _TwinProfiles()
    try:
        for target, base, prof in zip(targets, urls, profiles):
            if kind == "url":
                backend, client = OpenAIHTTPBackend(base, model=model, api_key=api_key, **backend_kwargs), None
            else:
                backend, client = OpenAIHTTPBackend.from_openai_client(target, model=model, **backend_kwargs), target
            load = ServerLoadReader(backend.transport.http, backend.root_url, backend.transport.headers) if read_load else None
            build = functools.partial(_build_front, cls, client, backend, backend.base_url, prof, kwargs, twins)
            endpoints.append(FleetEndpoint(backend.base_url, backend, build, health=Health(probe_after_s, probe_max_s), slots=slots,
                                           held_prompts=held_prompts, load=load, probe_timeout_s=probe_timeout_s))
        fleet = (AsyncFleetFrontEnd if is_async else FleetFrontEnd)(endpoints, ttft_budget_s=ttft_budget_s, retry_deadline_s=retry_deadline_s,
                                                                    unbudgeted_deadline_s=endpoints[0].backend.retry_deadline_s)
        fleet.start(parallel=parallel_calibration)
    except BaseException:
        for ep in endpoints:
            ep.backend.close()
        raise
    if not any(ep.is_up for ep in endpoints):
        for ep in endpoints:
            ep.backend.close()
        attempts = [(ep.label, ep.last_error or "unreachable") for ep in endpoints]
        raise FleetUnavailableError("no endpoint of the fleet could be reached: " + "; ".join(f"{a}: {b}" for a, b in attempts), attempts=attempts)
    return fleet


def wrap_url(base_url: str | Sequence[str], *, model: str | None = None, ttft_budget_s: float | None = None, api_key: str | None = None,
             asynchronous: bool = False, **kwargs: Any) -> Any:
    """``trimkit.wrap_url``: one URL gives :func:`trimkit.openai_wrapper.wrap_url`'s wrapper; a
    list of URLs a fleet (:func:`wrap_fleet`) with the same ``.chat.completions.create``."""
    if isinstance(base_url, (list, tuple)):
        return wrap_fleet(base_url, ttft_budget_s, model=model, api_key=api_key, asynchronous=asynchronous, **kwargs)
    return wrap_one_url(base_url, model=model, ttft_budget_s=ttft_budget_s, api_key=api_key, asynchronous=asynchronous, **kwargs)
