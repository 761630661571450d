"""The request pipeline, written once: validate → plan → send → measure → report.

:class:`Pipeline` decides every request and sends nothing: :meth:`Pipeline.prepare` makes a :class:`Prepared` request, :meth:`Pipeline.finish` turns its
measurement into a report and learns from it. A report attached to an error has ``measurement.total_s`` from sending to the failure. On an in-process engine
a request enters the engine's queue when it is prepared.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from trimkit._calibration import calibrate, save_profile
from trimkit.backends.base import Backend, Measurement, TimedStream
from trimkit.errors import ContextTooSmallError, InfeasibleBudgetError, InvalidInputError, QueueBudgetError, open_share
from trimkit.errors import budget as valid_budget
from trimkit.messages import (
    DEFAULT_RAG_CHUNK_TEMPLATE,
    DEFAULT_RAG_TEMPLATE,
    Chunk,
    check_rag_templates,
    coerce_chunks,
    in_prompt_order,
    last_user_index,
    message_text,
    validate_messages,
    validate_params,
    with_chunks,
)
from trimkit.planning.costs import CacheState, evaluated_tokens
from trimkit.planning.planner import Plan
from trimkit.planning.planner import plan as make_plan
from trimkit.planning.profile import CALIBRATION_MODES, Profile
from trimkit.planning.queue import EngineLease, EngineQueue, Ticket, answer_cap, busy_decision, check_on_busy, queue_wait
from trimkit.planning.solver import Action
from trimkit.planning.speed import DEFAULT_TARGET, EngineState, LiveProfile, engine_state, tail_share
from trimkit.planning.summaries import ExtractiveSummarizer, SummaryCache, next_summary_job
from trimkit.planning.tokens import KNOWN as KNOWN_CONTROLS
from trimkit.planning.tokens import check_mode as check_control_mode
from trimkit.planning.tokens import neutralize_chunks, neutralize_messages, reusable_prefix_len
from trimkit.planning.values import ValueModel, chunk_values, rank_chunks
from trimkit.planning.watch import Cut, PrefillWatch, Replan, cut_chunks
from trimkit.report import Report, template_warnings, valid_tokens_per_s_target
from trimkit.report import completed as report_completed
from trimkit.report import report_log as report_sinks
from trimkit.strategies import default_strategies

log = logging.getLogger("trimkit")


@attrs.frozen
class _Priced:
    """A prompt as tokens, what the engine has cached of it, and its predicted TTFT."""

    tokens: Sequence[int]
    cached: int
    snapshot: Any
    predicted_s: float


def _checked(name: str, check: Callable[[Any], Any]) -> property:
    """A property validated (and normalised) by ``check`` when it is set."""
    attr = "_" + name
    return property(lambda self: getattr(self, attr), lambda self, value: setattr(self, attr, check(value)))


def _label(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidInputError(f"endpoint_label must be a str or None, got {type(value).__name__}")
    return value


def _summarizer(summarizer: Any) -> Any:
    if isinstance(summarizer, str) and summarizer == "extractive":
        return ExtractiveSummarizer()
    if summarizer is not None and not callable(getattr(summarizer, "summarize", None)):
        raise InvalidInputError(f"summarizer must be a Summarizer, 'extractive' or None, got {type(summarizer).__name__}")
    return summarizer


class Pipeline:
    """Validate → plan → (the front-end sends) → measure → report, for any backend. Keyword arguments are :func:`trimkit.wrap`'s; ``model_label(params)``
    and ``report_notes(m, params)`` let a front-end name the model and add warnings to its reports."""

    def __init__(
        self, backend: Backend, *, ttft_budget_s: float | None = None, profile: Profile | None = None, strategies: Any = None,
        on_infeasible: str = "best_effort", on_busy: str = "trim", summarizer: Any = "extractive", background_summaries: bool = True,
        rag_template: str = DEFAULT_RAG_TEMPLATE, rag_chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE, calibration: str | None = None,
        watch_prefill: bool = True, clock: Callable[[], float] = time.perf_counter,
        attainment_target: float = DEFAULT_TARGET, values: Any = None, model_label: Callable[..., str] | None = None,
        report_notes: Callable[..., Sequence[str]] | None = None, endpoint_label: str | None = None, tokens_per_s_target: float | None = None,
        neutralize_control_tokens: str = "chunks", report_log: Any = None,
    ) -> None:
        if values is not None and not isinstance(values, ValueModel):
            raise InvalidInputError(f"values must be a trimkit.ValueModel or None, got {type(values).__name__}")
        if on_infeasible not in ("best_effort", "raise"):
            raise InvalidInputError(f"on_infeasible must be 'best_effort' or 'raise', got {on_infeasible!r}")
        if calibration is not None and calibration not in CALIBRATION_MODES:
            raise InvalidInputError(f"calibration must be one of {', '.join(map(repr, CALIBRATION_MODES))}, got {calibration!r}")
        check_rag_templates(rag_template, rag_chunk_template)
        self.attainment_target = attainment_target
        self._sinks = report_sinks(report_log)
        self.neutralize_control_tokens = check_control_mode(neutralize_control_tokens)
        self.backend = backend
        self.ttft_budget_s = ttft_budget_s
        self.strategies = strategies
        self.values = values
        self.on_infeasible = on_infeasible
        self.on_busy = on_busy
        self.endpoint_label = endpoint_label
        self.tokens_per_s_target = tokens_per_s_target
        self.rag_template = rag_template
        self.rag_chunk_template = rag_chunk_template
        self.clock = clock
        self.summarizer = _summarizer(summarizer)
        self.summaries = SummaryCache()
        self.background_summaries = background_summaries
        self._summary_threads: list[threading.Thread] = []
        self._last_plan: Any = None
        if profile is None:  # the stored one (any mode satisfies "micro"), else measured now
            profile = calibrate(backend, mode=calibration or "micro")
        #: what this engine has learned (drift, margin window), shared with every wrapper of it
        self.engine: EngineState = engine_state(backend, profile)
        self.live: LiveProfile = self.engine.live
        #: the engine's in-flight queue, shared with every wrapper of it (None: not a one-at-a-time engine)
        lease = getattr(backend, "engine", None)
        self.queue: EngineQueue | None = lease.queue if isinstance(lease, EngineLease) else None
        self.watch_prefill = bool(watch_prefill)
        self.reports: list[Report] = []  # most recent last; bounded
        self.max_reports = 256
        #: store the live-refined profile every N measured requests (0: never; at most 4 while provisional)
        self.persist_every = 16
        self.last_prepared: Prepared | None = None
        self._model_label = model_label
        self._report_notes = report_notes
        self._lock = threading.Lock()
        self._last_report: Report | None = None
        #: where the previous request cut the conversation, if it dropped turns: the role and text of the first history
        #: message it kept (the next plan may keep that cut)
        self._cut: tuple[Any, str] | None = None

    ttft_budget_s = _checked("ttft_budget_s", lambda v: None if v is None else valid_budget(v))
    on_busy = _checked("on_busy", check_on_busy)
    endpoint_label = _checked("endpoint_label", _label)
    tokens_per_s_target = _checked("tokens_per_s_target", valid_tokens_per_s_target)
    attainment_target = _checked("attainment_target", lambda v: open_share(v, "attainment_target"))

    @property
    def profile(self) -> Profile:
        return self.live.current

    @property
    def safety_margin(self) -> float:
        """The fraction of a budget an open-loop request holds back (:mod:`trimkit.planning.speed`)."""
        return self.engine.safety_margin(self.attainment_target)

    @functools.cached_property
    def _model_name(self) -> str:
        """The model a report names by default: the GGUF file name in process (the profile key hashes part of the file)."""
        model = self.backend.profile_key().model
        return model.split(":")[0] if self.backend.name == "llama_cpp" else model

    @property
    def last_report(self) -> Report | None:
        with self._lock:
            return self._last_report

    # -- summaries of older turns, off the critical path ----------------------------------------
    def idle(self, timeout_s: float | None = None) -> None:
        """Finish pending background summaries now; with ``background_summaries=False``, compute the one the last response's plan calls for."""
        with self._lock:
            threads = list(self._summary_threads)
        for t in threads:
            t.join(timeout_s)
        if not self.background_summaries:
            self._summarize(self._last_plan, background=False)

    def _summarize(self, plan: Any, *, background: bool) -> None:
        if self.summarizer is None or plan is None:
            return
        job = next_summary_job(plan, self.summarizer, self.summaries, count_tokens=self.backend.background_tokenizer)
        if job is None:
            return
        if not background:
            _run_summary(job)
            return
        t = threading.Thread(target=_run_summary, args=(job,), name="trimkit-summary", daemon=True)
        with self._lock:
            self._summary_threads = [x for x in self._summary_threads if x.is_alive()]
            if self._summary_threads:  # one at a time; the next response schedules the next one
                return
            self._summary_threads.append(t)
        t.start()

    # -- validate and plan ----------------------------------------------------------------------
    def request(self, messages: Any, rag_chunks: Any = None, params: Mapping[str, Any] | None = None) -> Request:
        """A call's input validated, its retrieved text neutralised and placed (not counted yet:
        :meth:`count`). What :meth:`prepare` plans, and a fleet routes on."""
        params = params or {}
        validate_messages(messages)
        validate_params(params)
        chunks = coerce_chunks(rag_chunks)
        mode = self.neutralize_control_tokens
        notes: list[str] = []
        if mode != "off" and (chunks or mode == "all"):  # control-token texts broken so they tokenize as plain text
            controls = getattr(self.backend.tokenizer, "control_texts", None) or KNOWN_CONTROLS
            chunks, note = neutralize_chunks(chunks, controls)
            notes += [note] if note else []
            if mode == "all":
                messages, note = neutralize_messages(messages, controls)
                notes += [note] if note else []
        as_is = place_chunks(messages, chunks, self.rag_template, self.rag_chunk_template) if chunks else messages
        return Request(messages, tuple(chunks), dict(params), as_is, tuple(notes))

    def count(self, request: Request) -> Request:
        """``request`` with its prompt as given counted by this engine's tokenizer (once per tokenizer)."""
        tok = self.backend.tokenizer
        if request.tokens is not None and request.counted_by == tok.name:
            return request
        return attrs.evolve(request, tokens=tuple(tok.prompt_tokens(request.as_is, request.params.get("tools"))), counted_by=tok.name)

    def prepare(self, messages: Any, rag_chunks: Any = None, params: Mapping[str, Any] | None = None, *, ttft_budget_s: float | None = None,
                on_busy: str | None = None, queue_wait_s: float | None = None, send_now: bool = False) -> Prepared:
        """Validate, plan and check a request without sending it (``messages``: or a :class:`Request` made by :meth:`request`). ``queue_wait_s``: a wait the
        caller predicts (a fleet router), planned with instead of the engine queue's. ``send_now``: the caller sends it at once, and it keeps its place in
        the engine's queue until then (its ticket is the caller's to end if it does not)."""
        t0 = self.clock()
        request = messages if isinstance(messages, Request) else self.request(messages, rag_chunks, params)
        budget = self.ttft_budget_s if ttft_budget_s is None else valid_budget(ttft_budget_s)
        busy = self.on_busy if on_busy is None else check_on_busy(on_busy)
        given_wait = queue_wait(queue_wait_s)
        # in line while it is planned (a request planned at the same time counts it ahead), out until it is sent (send_now: kept)
        ticket = self.queue.enter() if self.queue is not None else None
        try:
            prepared = self._prepare(request, budget, busy, given_wait, ticket, t0)
        except BaseException:
            if ticket is not None:
                ticket.done()
            raise
        if ticket is not None and not send_now:
            ticket.done()
        return prepared

    def _prepare(self, request: Request, budget: float | None, on_busy: str, given_wait: float | None, ticket: Ticket | None, t0: float) -> Prepared:
        request = self.count(request)
        messages, params, as_is = request.messages, request.params, request.as_is
        tools = params.get("tools")
        # queued behind others, the request finds the context the last of them leaves
        after = self.queue.context_after(ticket) if self.queue is not None else None
        priced = functools.partial(self.price, after=after)
        before = priced(list(request.tokens or ()))
        self._estimate(ticket, before, params)
        wait, ahead = (given_wait, 0) if given_wait is not None or self.queue is None else self.queue.predict(ticket)
        margin = 0.0 if budget is None else self.engine.request_margin(self.attainment_target, budget, len(before.tokens), before.cached,
                                                                       watched=self.watches())
        busy = busy_decision(on_busy, budget, wait, margin, ahead, refuse=self.on_infeasible == "raise")
        plan: Plan | None = None
        sent, w = before, wait or 0.0
        if budget is None and len(before.tokens) > self.backend.n_ctx:
            raise ContextTooSmallError(f"prompt of {len(before.tokens)} tokens does not fit the context window (n_ctx={self.backend.n_ctx})")
        if busy.plan_budget_s is not None:
            plan, sent = self._plan(request, before, busy.plan_budget_s, busy.margin, priced, self._cache_state(after))
            self._estimate(ticket, sent, params)
        to_send = plan.messages if plan is not None else as_is
        warnings = [*busy.warnings(budget, sent.predicted_s), *self.engine.slowdown_warnings(), *template_warnings(self.backend.tokenizer, to_send, tools),
                    *request.warnings]
        prepared = Prepared(
            messages=to_send, prompt_tokens=tuple(sent.tokens), cached_tokens=sent.cached, snapshot=sent.snapshot,
            # what the caller will feel: the wait for the requests ahead, then the prompt's TTFT
            predicted_ttft_s=sent.predicted_s + w, predicted_ttft_before_s=before.predicted_s + w,
            prompt_tokens_before=len(before.tokens), budget_s=budget, plan=plan, prepare_s=self.clock() - t0, warnings=tuple(warnings),
            feasible=False if busy.refuse else None if plan is None else bool(plan.feasible) and sent.predicted_s + w <= budget,
            queue_wait_s=wait, queue_ahead=ahead, ticket=ticket, request=request,
        )
        if busy.refuse:
            report = self.report(prepared, Measurement(ttft_s=None, total_s=0.0), params, sent=False, error=QueueBudgetError)
            raise QueueBudgetError(busy.refusal(budget), wait_s=w, ahead=ahead, report=report)
        if plan is None or budget is None:
            return prepared
        self._remember_cut(messages, plan)
        # the prompt's own part: with on_busy="wait" a wait that breaks the budget is not the prompt's fault
        ttft = sent.predicted_s + busy.counted_wait_s
        if not (plan.feasible and ttft <= budget) and self.on_infeasible == "raise":
            report = self.report(prepared, Measurement(ttft_s=None, total_s=0.0), params, sent=False, error=InfeasibleBudgetError)
            raise InfeasibleBudgetError(f"TTFT budget {budget:.3f} s cannot be met: the minimal prompt is predicted at {ttft:.3f} s",
                                        plan=plan, report=report)
        return prepared

    def price(self, tokens: Sequence[int], after: Sequence[int] | None = None, profile: Profile | None = None) -> _Priced:
        """What the engine has cached of ``tokens`` (a stored snapshot too) and their predicted
        TTFT (a fleet's router prices with it); ``after``: the prompt the context will hold when this request's turn comes;
        ``profile``: a watched prefill's paced one (the context alone: no snapshot mid-prefill)."""
        best_cache = getattr(self.backend, "best_cache", None) if profile is None else None
        profile = profile or self.profile
        if best_cache is not None:
            cached, snapshot = best_cache(tokens, profile.predict_prefill_s)
        else:
            cached, snapshot = self.backend.predict_cached_tokens(tokens), None
        if after is not None and snapshot is None:
            cached = min(cached, reusable_prefix_len(after, tokens))
        restore = getattr(snapshot, "restore_s", 0.0) if snapshot is not None else 0.0
        return _Priced(tokens, cached, snapshot, profile.predict_ttft_s(evaluated_tokens(len(tokens), cached), cached) + restore)

    def _cache_state(self, after: Sequence[int] | None = None, *, snapshots: bool = True) -> CacheState | None:
        """The engine's cache as :meth:`price` counts it (without ``snapshots``: the context alone)."""
        state = self.backend.cache_state()
        if state is None or (after is None and snapshots):
            return state
        return attrs.evolve(state, after=after, snapshots=state.snapshots if snapshots else ())

    def _plan(self, request: Request, before: _Priced, budget: float, margin: float, priced: Callable[[Sequence[int]], _Priced],
              cache: CacheState | None, profile: Profile | None = None) -> tuple[Plan, _Priced]:
        """Plan to ``budget`` with ``margin`` and ``profile`` (default: the current one), and price the prompt it sends."""
        messages, chunks, params = request.messages, request.chunks, request.params
        tools = params.get("tools")
        tok = self.backend.tokenizer
        plan = make_plan(
            messages, ttft_budget_s=budget, profile=profile or self.profile, tokenizer=tok, rag_chunks=chunks,
            strategies=self._strategies_for(messages), tools=tools, cached_tokens=before.cached,
            cache=cache, summaries=self.summaries, rag_template=self.rag_template, rag_chunk_template=self.rag_chunk_template,
            on_infeasible="best_effort", clock=self.clock, values=self.values, safety_margin=margin,
            max_prompt_tokens=max(int(self.backend.n_ctx) - (answer_cap(params) or 0), 1),
        )
        unchanged = plan.passthrough and list(plan.messages) == list(request.as_is)
        return plan, before if unchanged else priced(tok.prompt_tokens(plan.messages, tools))

    def _strategies_for(self, messages: Sequence[Mapping[str, Any]]) -> Any:
        """The strategies given; else the default chain with :class:`~trimkit.strategies.keep_cached_cut`
        when this conversation still has a turn starting at the previous cut."""
        if self.strategies is not None or self._cut is None:
            return self.strategies
        role, text = self._cut
        for j, m in enumerate(messages):
            if m.get("role") == role and message_text(m) == text and j > 0:
                return default_strategies(keep_cut=j)
        return None

    def _remember_cut(self, messages: Sequence[Mapping[str, Any]], plan: Any) -> None:
        removed = set(getattr(plan, "removed_message_indices", ()) or ())
        self._cut = None
        if removed:
            for i in range(max(removed) + 1, len(messages)):
                if i not in removed and messages[i].get("role") not in ("system", "developer"):
                    self._cut = (messages[i].get("role"), message_text(messages[i]))
                    return

    def _estimate(self, ticket: Ticket | None, priced: _Priced, params: Mapping[str, Any]) -> None:
        """Tell the engine's queue the request's predicted work (for the requests behind it)."""
        if ticket is not None and self.queue is not None:
            room = self.backend.n_ctx - len(priced.tokens)
            ticket.estimate(priced.predicted_s, self.queue.decode_s(params, self.profile.decode_tokens_per_s, room), priced.tokens)

    # -- the watched prefill ----------------------------------------------------------------------
    def watches(self) -> bool:
        """Whether budgeted requests are watched while they prefill: the backend evaluates in steps (``evaluate_to``) and its ``send`` takes ``watch=``."""
        return self.watch_prefill and getattr(self.backend, "evaluate_to", None) is not None and _takes_watch(type(self.backend).send)

    def watched(self, prepared: Prepared, *, waited_s: float = 0.0) -> WatchedPrefill | None:
        """The driver of ``prepared``'s watched prefill (None: not watched)."""
        if prepared.budget_s is None or prepared.plan is None or not self.watches():
            return None
        return WatchedPrefill(self, prepared, waited_s=waited_s)

    def replan(self, prepared: Prepared, watch: PrefillWatch, spent_s: float, *, grow: bool = False) -> Prepared | None:
        """``prepared`` planned again ``spent_s`` into it at the measured pace. First the plan's chunks not evaluated yet are cut (the evaluated prefix
        kept), to the margin's target, else to the budget; only when no such cut fits is the whole request planned again, and only if that is predicted
        within the budget. ``grow``: put back chunks the plan dropped. None when nothing would change."""
        request = prepared.request
        assert request is not None and prepared.budget_s is not None and prepared.plan is not None  # what the watch runs on
        messages, params = request.messages, request.params
        tools = params.get("tools")
        tok = self.backend.tokenizer
        profile = watch.paced_profile()
        left = max(prepared.budget_s - spent_s, 1e-6)
        margin = self.engine.safety_margin(self.attainment_target, share=tail_share(profile, len(prepared.prompt_tokens) - watch.position))
        paced = functools.partial(self.price, profile=profile)

        def price(candidate: Sequence[Mapping[str, Any]]) -> tuple[Sequence[int], int, float]:
            p = paced(tok.prompt_tokens(candidate, tools))
            return p.tokens, p.cached, p.predicted_s

        old = prepared.plan
        original = messages[last_user_index(messages)]
        extra = tuple(old.dropped_chunks) if grow else ()
        worth = chunk_values((*old.kept_chunks, *extra), message_text(original), self.values or ValueModel())

        def cut_to(target_s: float, *, least: bool = False) -> Cut | None:
            return cut_chunks(old, original, price, target_s, self.rag_template, self.rag_chunk_template, position=watch.position,
                              value=lambda c: worth.get(str(c.id), 0.0), extra=extra, least=least)

        cut, how, full = cut_to(left * (1.0 - margin)), "", None
        if cut is None and not grow:
            cut, how = cut_to(left), " (within the budget, not its margin: starting over would forfeit the evaluated prefix)"
        if cut is None and not grow:  # nothing that keeps the prefix fits: the whole request again, at the measured pace
            full = self._plan(request, paced(tok.prompt_tokens(request.as_is, tools)), left, margin, paced,
                              self._cache_state(snapshots=False), profile=profile)
            least = cut_to(left, least=True) if full[1].predicted_s > left else None
            if least is not None:  # starting over misses the budget too: keep the prefix, cut the most
                cut, how, full = least, " (nothing fits the budget; starting over would miss it too)", None
        old_ids = [str(c.id) for c in old.kept_chunks]
        new_ids = [str(c.id) for c in cut.chunks] if cut is not None else []
        gone_ids = [i for i in old_ids if i not in new_ids]
        back_ids = [i for i in new_ids if i not in old_ids]
        if cut is not None and not gone_ids and not back_ids or grow and (cut is None or not back_ids):
            return None  # it fits as planned (or, growing, nothing more fits)
        if cut is not None:
            gone = tuple(c for c in old.kept_chunks if str(c.id) in gone_ids)
            said = [f"dropped {', '.join(gone_ids)} (not evaluated yet; the least value per character)"] if gone_ids else []
            said += [f"put back {', '.join(back_ids)}, dropped by the plan, before the question"] if back_ids else []
            action = Action(strategy="watch", summary=f"re-planned at the measured pace ({watch.pace:.2f}× predicted): "
                            + "; ".join(said) + " — the evaluated prefix kept" + how,
                            removed_chunks=tuple(gone_ids), tokens_before=len(prepared.prompt_tokens), tokens_after=len(cut.tokens))
            plan = attrs.evolve(old, messages=list(cut.messages), kept_chunks=tuple(cut.chunks),
                                dropped_chunks=(*(c for c in old.dropped_chunks if str(c.id) not in back_ids), *gone),
                                actions=(*old.actions, action), passthrough=False, prompt_tokens=len(cut.tokens), cached_tokens=cut.cached,
                                new_tokens=len(cut.tokens) - cut.cached, predicted_ttft_s=spent_s + cut.predicted_s, feasible=True)
            tokens, predicted = cut.tokens, cut.predicted_s
            dropped = gone_ids + [f"+{i}" for i in back_ids]
        else:  # the whole request planned again
            assert full is not None
            plan, sent = full
            tokens, predicted = sent.tokens, sent.predicted_s
            kept_now = {str(c.id) for c in plan.kept_chunks}
            dropped = [str(c.id) for c in old.kept_chunks if str(c.id) not in kept_now]
            dropped += [f"message {i}" for i in sorted(set(plan.removed_message_indices) - set(old.removed_message_indices))]
            self._remember_cut(messages, plan)
        record = Replan(
            evaluated_tokens=watch.position, prompt_tokens=len(prepared.prompt_tokens), elapsed_s=spent_s, pace=watch.pace,
            projected_ttft_s=watch.projected_ttft_s(spent_s),
            predicted_ttft_before_s=prepared.predicted_ttft_s or 0.0, predicted_ttft_after_s=spent_s + predicted,
            prompt_tokens_after=len(tokens), dropped=tuple(dropped),
        )
        log.info("trimkit: %s", record.summary())
        # the cache it had when it was sent stays its prediction (the evaluated prefix is this request's own work)
        return attrs.evolve(
            prepared, messages=plan.messages, prompt_tokens=tuple(tokens), snapshot=None, plan=plan,
            predicted_ttft_s=spent_s + predicted, replans=(*prepared.replans, record),
            feasible=bool(plan.feasible) and spent_s + predicted <= prepared.budget_s,
        )

    # -- send (the front-end's), measure, report --------------------------------------------------
    def sent(self, prepared: Prepared, *, waited_s: float = 0.0, watch: WatchedPrefill | None = None) -> Prepared:
        """Record that ``prepared`` went out after waiting ``waited_s`` for the engine (counted in ``report.measured_ttft_s``, not in
        ``measurement.ttft_s``); its ``watch`` (if watched) goes on from it."""
        if waited_s >= 0.001:
            prepared = prepared.with_warning(
                f"waited {waited_s:.3f} s for the engine (requests ahead held it, or an idle probe was stopping); "
                "counted in the measured TTFT, not in measurement.ttft_s"
            )
        self.last_prepared = prepared
        if watch is not None:
            watch.prepared = prepared
        return prepared

    def report(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any], *, sent: bool = True,
               error: type[BaseException] | None = None) -> Report:
        """The report of ``prepared`` (nothing learned): the one place every report is completed."""
        notes = self._report_notes(m, params) if self._report_notes is not None else ()
        model = self._model_label(params) if self._model_label is not None else self._model_name
        report = Report.of_request(prepared, m, params, backend=self.backend.name, model=model, profile=self.profile, notes=notes, sent=sent,
                                   endpoint=self.endpoint_label, tokens_per_s_target=self.tokens_per_s_target)
        report_completed(report, error_type=None if error is None else f"{error.__module__}.{error.__qualname__}",
                         prepare_s=prepared.prepare_s or 0.0, sinks=self._sinks)
        return report

    def attach_report(self, exc: BaseException, ts: TimedStream, prepared: Prepared, params: Mapping[str, Any]) -> None:
        """Give an error that carries a report (a BackendError) the report of what was sent, unless it has one:
        ``total_s`` from sending to the failure (0.0 if the stream never started)."""
        if getattr(exc, "report", "absent") is None:
            total = ts.total_s if ts.started is not None else 0.0
            m = Measurement(ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=total, queue_s=getattr(ts, "queue_s", 0.0))
            exc.report = self.report(prepared, m, params, error=type(exc))  # type: ignore[attr-defined]

    def finish(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any]) -> Report:
        """A request finished: its report, and what it teaches (drift, margin, next summary)."""
        report = self.report(prepared, m, params)
        outcome = None
        if prepared.watched and prepared.budget_s is not None and report.measured_ttft_s is not None and prepared.predicted_ttft_s:
            outcome = (report.measured_ttft_s, prepared.predicted_ttft_s)
        if self.queue is not None:
            self.queue.observe(params, m)
        refined = self.engine.learn(_whole_request(m, prepared), persist_every=self.persist_every, watched=prepared.watched, outcome=outcome)
        if refined is not None:
            try:
                save_profile(refined)
            except OSError as exc:  # a read-only cache must not break requests
                log.warning("trimkit: could not store the refined profile: %s", exc)
        with self._lock:
            self._last_report = report
            self.reports.append(report)
            del self.reports[: -self.max_reports]
        log.info(report.log_line())
        if m.truncated_tokens:
            log.warning("trimkit: the engine evaluated %d fewer prompt tokens than were sent (silent truncation)", m.truncated_tokens)
        self._last_plan = prepared.plan
        if self.background_summaries:
            self._summarize(prepared.plan, background=True)
        return report


def _run_summary(job: Callable[[], Any]) -> None:
    try:
        job()
    except Exception:  # a failed background summary must never break the chat
        log.exception("trimkit: background summary failed")


@functools.lru_cache(maxsize=64)
def _takes_watch(send: Any) -> bool:
    """Whether a backend class's ``send`` accepts ``watch=``."""
    try:
        params = inspect.signature(send).parameters
    except (TypeError, ValueError):
        return False
    return "watch" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _whole_request(m: Measurement, prepared: Prepared) -> Measurement:
    """What the refit may learn of a request's prefill: not a re-plan's evaluated count (it
    describes no one prompt), nor a model load the server reported (``server["load_s"]``)."""
    load = m.server.get("load_s")
    if isinstance(load, float) and load > 0 and m.ttft_s is not None:
        m = attrs.evolve(m, ttft_s=max(m.ttft_s - load, 0.0))
    if prepared.replans and m.evaluated_tokens is not None and m.prompt_tokens is not None and m.evaluated_tokens > m.prompt_tokens:
        return attrs.evolve(m, evaluated_tokens=None)
    return m


class WatchedPrefill:
    """Runs the watched prefill (:mod:`trimkit.planning.watch`) of one prepared request: called with the backend's ``evaluate(tokens, end) -> (seconds,
    start)``, its clock and what its context holds, it returns the messages and prompt tokens to generate from (the plan's or a re-plan's). :attr:`prepared`
    is the request as finally sent; ``waited_s`` counts against the budget."""

    def __init__(self, pipeline: Pipeline, prepared: Prepared, *, waited_s: float = 0.0) -> None:
        self.pipeline = pipeline
        self.prepared = prepared
        self.waited_s = waited_s

    def __call__(self, evaluate: Callable[[Sequence[int], int], tuple[float, int]], clock: Callable[[], float],
                 held: int) -> tuple[Sequence[Mapping[str, Any]], Sequence[int]]:
        t0 = clock()
        p, pipeline = self.prepared, self.pipeline
        profile = pipeline.profile
        assert p.budget_s is not None and p.plan is not None  # what Pipeline.watched() watches
        # to the target the plan filled to: a stricter one (a margin sized for the planned prompt's
        # tail) re-planned requests running on pace and cut what the plan had kept
        watch = PrefillWatch(p.prompt_tokens, held, profile, p.budget_s - self.waited_s, margin=p.plan.safety_margin,
                             n_batch=max(int(profile.model.n_batch or 512), 1))
        if not watch.watched:
            return p.messages, p.prompt_tokens
        self.prepared = attrs.evolve(p, watched=True)
        grown = False
        while (end := watch.next_end()) is not None:
            seconds, start = evaluate(watch.tokens, end)
            watch.record(end, seconds, start)
            over = watch.over_budget(clock() - t0)
            if over or (not grown and watch.ahead(clock() - t0) and self.prepared.plan.dropped_chunks):
                grown = grown or not over  # one try at putting content back a request
                replanned = pipeline.replan(self.prepared, watch, clock() - t0 + self.waited_s, grow=not over)
                if replanned is None:  # it fits as planned after all (or nothing to plan from)
                    if over:
                        watch.replans += 1  # one try spent
                    continue
                self.prepared = replanned
                watch = watch.continue_with(replanned.prompt_tokens, held=pipeline.backend.predict_cached_tokens(replanned.prompt_tokens))
        new, cached, so_far = watch.prefill_so_far
        if so_far > 0 and new > 0:  # the whole evaluation as one prefill: the speed estimate's sample
            pipeline.engine.live.observe_step(new, cached, so_far)
        if self.prepared.replans:
            pipeline.last_prepared = self.prepared
        return self.prepared.messages, self.prepared.prompt_tokens


def place_chunks(messages: Sequence[Mapping[str, Any]], chunks: Sequence[Chunk], template: str = DEFAULT_RAG_TEMPLATE,
                 chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE) -> list[Mapping[str, Any]]:
    """A new message list with ``chunks`` placed into the last user message as the planner places them (ranked by score or BM25, the most relevant last), so
    an untrimmed plan and this placement give the same prompt."""
    out = list(messages)
    if not chunks:
        return out
    i = last_user_index(messages)
    out[i] = with_chunks(messages[i], in_prompt_order(rank_chunks(chunks, message_text(messages[i]))), template, chunk_template)
    return out


@attrs.frozen
class Request:
    """A call's input, validated and neutralised once (:meth:`Pipeline.request`): what every plan of it starts from (a re-plan, a fleet's endpoint);
    ``tokens``: its prompt as given, counted by ``counted_by`` (a tokenizer's name)."""

    messages: Any
    chunks: tuple[Chunk, ...]
    params: Mapping[str, Any]
    as_is: Any = attrs.field(repr=False)
    warnings: tuple[str, ...] = ()
    tokens: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    counted_by: str | None = None


@attrs.frozen
class Prepared:
    """A request ready to send: the plan, the exact prompt tokens and the cache it will use."""

    messages: Sequence[Mapping[str, Any]]
    prompt_tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    cached_tokens: int
    predicted_ttft_s: float | None
    predicted_ttft_before_s: float | None
    prompt_tokens_before: int
    budget_s: float | None
    plan: Any = None
    snapshot: Any = None
    prepare_s: float = 0.0
    warnings: tuple[str, ...] = ()
    #: the plan fits and the exact prompt's prediction is within the budget (None: no budget)
    feasible: bool | None = None
    #: the predicted wait for the requests ahead (None: nobody predicts one), and how many were ahead
    queue_wait_s: float | None = None
    queue_ahead: int = 0
    ticket: Any = attrs.field(default=None, repr=False, eq=False)
    #: the call's own input (a :class:`Request`), which a re-plan plans from again
    request: Request | None = attrs.field(default=None, repr=False, eq=False)
    watched: bool = False
    replans: tuple[Any, ...] = ()

    def with_warning(self, warning: str) -> Prepared:
        return attrs.evolve(self, warnings=(*self.warnings, warning))

