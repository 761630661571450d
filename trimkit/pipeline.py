"""The request pipeline, written once: validate → plan → send → measure → report.

:class:`Pipeline` holds what a wrapped model has learned and decides every request; it sends
nothing itself. :meth:`Pipeline.prepare` turns a call's arguments into a :class:`Prepared`
request (validated messages, chunks and budget; the plan; the exact prompt tokens and the
predicted TTFT); :meth:`Pipeline.finish` turns the :class:`~trimkit.backends.base.Measurement`
of a sent request into a :class:`~trimkit.report.Report` and learns from it (drift, the safety
margin, the next summary); :meth:`Pipeline.error_report` reports a request that failed while it
streamed. The front-ends hold a Pipeline and differ only where they read and write:
:mod:`trimkit.wrapper` (in-process engines) and :mod:`trimkit.openai_wrapper` (servers, sync
and async). Planning asks the backend for token counts and cache state (a server backend may
ask the server), which is the only I/O on this path.

A report attached to an error says what was sent and what was measured before the failure: its
``measurement.total_s`` is the time from sending to the failure (0.0 if the request never
started), for every front-end alike.

**Others ahead.** On an in-process engine (one request at a time) a request enters the engine's
in-flight queue when it is prepared (:mod:`trimkit.planning.queue`); its predicted TTFT is the
predicted wait for the requests ahead plus its own, and ``on_busy`` says what the wait does to
the plan. A caller that predicts the wait itself (a fleet router) passes ``queue_wait_s``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
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


def _checked(name: str, check: Callable[[Any], Any], doc: str) -> property:
    """A property whose value is validated (and normalised) by ``check`` when it is set."""
    attr = "_" + name
    return property(lambda self: getattr(self, attr), lambda self, value: setattr(self, attr, check(value)), doc=doc)


def _label(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidInputError(f"endpoint_label must be a str or None, got {type(value).__name__}")
    return value


def calibration_mode(calibration: str | None) -> str:
    """The calibration mode ``wrap()`` asks for when it has no profile (:data:`CALIBRATION_MODES`):
    ``calibration``, else "micro" (about 3 s, provisional)."""
    if calibration is None:
        return "micro"
    if calibration not in CALIBRATION_MODES:
        raise InvalidInputError(f"calibration must be one of {', '.join(map(repr, CALIBRATION_MODES))}, got {calibration!r}")
    return calibration


#: ``model_label(params)``: the model as the report names it
ModelLabel = Callable[[Mapping[str, Any]], str]
#: ``report_notes(measurement, params)``: warnings a front-end adds to every report
ReportNotes = Callable[[Measurement, Mapping[str, Any]], Sequence[str]]


class Pipeline:
    """Validate → plan → (the front-end sends) → measure → report, for any backend.

    Keyword arguments are those of :func:`trimkit.wrap` (see there). ``model_label`` and
    ``report_notes`` let a front-end name the model and add warnings in its reports;
    ``endpoint_label`` names the replica in every report (``report.endpoint``)."""

    def __init__(
        self, backend: Backend, *, ttft_budget_s: float | None = None, profile: Profile | None = None, strategies: Any = None,
        on_infeasible: str = "best_effort", on_busy: str = "trim", summarizer: Any = "extractive", background_summaries: bool = True,
        rag_template: str = DEFAULT_RAG_TEMPLATE, rag_chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE, calibration: str | None = None,
        watch_prefill: bool = True, clock: Callable[[], float] = time.perf_counter,
        attainment_target: float = DEFAULT_TARGET, values: Any = None, model_label: ModelLabel | None = None,
        report_notes: ReportNotes | None = None, endpoint_label: str | None = None, tokens_per_s_target: float | None = None,
        neutralize_control_tokens: str = "chunks", report_log: Any = None,
    ) -> None:
        if values is not None and not isinstance(values, ValueModel):
            raise InvalidInputError(f"values must be a trimkit.ValueModel or None, got {type(values).__name__}")
        attainment_target = open_share(attainment_target, "attainment_target")
        if on_infeasible not in ("best_effort", "raise"):
            raise InvalidInputError(f"on_infeasible must be 'best_effort' or 'raise', got {on_infeasible!r}")
        check_rag_templates(rag_template, rag_chunk_template)
        #: where each finished request's report goes besides the process-wide observers (:mod:`trimkit.report`)
        self._sinks = report_sinks(report_log)
        #: what may not become control tokens of the chat template: retrieved text ("chunks"),
        #: message content too ("all"), nothing ("off") (:mod:`trimkit.planning.tokens`)
        self.neutralize_control_tokens = check_control_mode(neutralize_control_tokens)
        self.backend = backend
        self.ttft_budget_s = ttft_budget_s  # validated by the property
        self.strategies = strategies
        #: what each kind of content is worth when the budget forces a choice (None: the defaults)
        self.values = values
        self.on_infeasible = on_infeasible
        self.on_busy = on_busy  # validated by the property
        self.endpoint_label = endpoint_label  # validated by the property
        self.tokens_per_s_target = tokens_per_s_target  # validated by the property
        self.rag_template = rag_template
        self.rag_chunk_template = rag_chunk_template
        self.clock = clock
        #: computes summaries of older turns after each response (off the critical path); the
        #: planner may put a ready one in their place. Default: the model-free extractive one.
        self.summary_worker = SummaryWorker(summarizer, background=background_summaries, tokenizer=lambda: self.backend.background_tokenizer)
        mode = calibration_mode(calibration)
        if profile is None:  # the stored one (any mode satisfies "micro"), else measured now
            profile = calibrate(backend, mode=mode)
        self.attainment_target = attainment_target
        #: what this engine has learned (drift, margin window), shared with every wrapper of it
        self.engine: EngineState = engine_state(backend, profile)
        self.live: LiveProfile = self.engine.live
        #: the engine's in-flight queue, shared with every wrapper of it (None: not a one-at-a-time engine)
        self.queue: EngineQueue | None = self.engine.queue if isinstance(getattr(backend, "engine", None), EngineLease) else None
        #: watch the prefill of every budgeted request and re-plan at its measured pace, where the
        #: backend can (in process: :meth:`~trimkit.backends.base.Backend.evaluate_to`)
        self.watch_prefill = bool(watch_prefill)
        self.reports: list[Report] = []  # most recent last; bounded
        self.max_reports = 256
        #: store the live-refined profile every N measured requests (0: never; at most 4 while provisional)
        self.persist_every = 16
        #: the request most recently sent (benchmarks read its ``prepare_s``)
        self.last_prepared: Prepared | None = None
        self._model_label = model_label
        self._report_notes = report_notes
        self._lock = threading.Lock()
        self._last_report: Report | None = None
        self._model_name: str | None = None
        #: where the previous request cut the conversation (the next plan may keep that cut)
        self.previous_cut = PreviousCut()

    # -- state ----------------------------------------------------------------------------------

    ttft_budget_s = _checked("ttft_budget_s", lambda v: None if v is None else valid_budget(v),
                             "The default TTFT budget of a call (None: no budget); validated when set.")
    on_busy = _checked("on_busy", check_on_busy, '''"trim" or "wait": what the predicted wait for the requests
        ahead does to a plan (:func:`~trimkit.planning.queue.busy_decision`); validated when set.''')
    endpoint_label = _checked("endpoint_label", _label, "The replica every report names (``report.endpoint``; None: one engine).")
    tokens_per_s_target = _checked("tokens_per_s_target", valid_tokens_per_s_target, "The stream's standard in every report's verdict.")
    attainment_target = _checked("attainment_target", lambda v: open_share(v, "attainment_target"),
                                 "The share of budgeted requests whose TTFT the safety margin aims to keep inside the budget.")

    @property
    def profile(self) -> Profile:
        """The current profile (calibration refined by live measurements)."""
        return self.live.current

    @property
    def safety_margin(self) -> float:
        """The fraction of a budget an open-loop request holds back: what would have absorbed
        ``attainment_target`` of this engine's recent measured ÷ predicted prefills
        (:mod:`trimkit.planning.speed`); a watched request holds back only its share after the
        watch's last step."""
        return self.engine.safety_margin(self.attainment_target)

    @property
    def last_report(self) -> Report | None:
        """The report of the most recent finished request (any thread)."""
        with self._lock:
            return self._last_report

    @property
    def summarizer(self) -> Any:
        return self.summary_worker.summarizer

    @property
    def summaries(self) -> SummaryCache:
        return self.summary_worker.cache

    def idle(self, timeout_s: float | None = None) -> None:
        """Finish pending background summaries now (call when the user is reading).

        With ``background_summaries=False`` this is where summaries are computed."""
        self.summary_worker.idle(timeout_s)

    # -- validate and plan ----------------------------------------------------------------------
    def prepare(self, messages: Any, rag_chunks: Any = None, params: Mapping[str, Any] | None = None, *, ttft_budget_s: float | None = None,
                on_busy: str | None = None, queue_wait_s: float | None = None, untrimmed: Sequence[int] | None = None) -> Prepared:
        """Validate, plan and check a request without sending it. ``on_busy``: this call's
        (default :attr:`on_busy`); ``queue_wait_s``: a wait the caller predicts (a fleet router,
        for one endpoint), planned with instead of the engine queue's; ``untrimmed``: the
        request's prompt counted already (:meth:`untrimmed_tokens`: a fleet router's count, by
        the same tokenizer), not counted again.

        On an in-process engine the request enters the engine's queue here and leaves it when
        its stream ends — or when the returned request is dropped unsent."""
        t0 = self.clock()
        params = params or {}
        validate_messages(messages)
        validate_params(params)
        chunks = coerce_chunks(rag_chunks)
        messages, chunks, guarded = self._neutralized(messages, chunks)
        budget = self.ttft_budget_s if ttft_budget_s is None else valid_budget(ttft_budget_s)
        busy = self.on_busy if on_busy is None else check_on_busy(on_busy)
        given = queue_wait(queue_wait_s)
        # in line now, before counting: a request planned at the same time counts this one ahead
        ticket = self.queue.enter() if self.queue is not None else None
        try:
            prepared = self._prepare(messages, chunks, params, budget, busy, given, ticket, t0, untrimmed)
        except BaseException:
            if ticket is not None:
                ticket.done()
            raise
        if ticket is not None:
            ticket.planned()
        for note in guarded:
            prepared = prepared.with_warning(note)
        return prepared

    def untrimmed_tokens(self, messages: Any, chunks: Sequence[Chunk], params: Mapping[str, Any]) -> list[int]:
        """The request's prompt as given (retrieved text neutralised and placed as
        :meth:`prepare` places it), counted: what a router prices a request by before it is planned."""
        messages, chunks, _ = self._neutralized(messages, chunks)
        return self.backend.tokenizer.prompt_tokens(self._as_is(messages, chunks), params.get("tools"))

    def _as_is(self, messages: Any, chunks: Sequence[Chunk]) -> Any:
        """The messages with the retrieved chunks placed, untrimmed."""
        return place_chunks(messages, chunks, self.rag_template, self.rag_chunk_template) if chunks else messages

    def _neutralized(self, messages: Any, chunks: Sequence[Chunk]) -> tuple[Any, Sequence[Chunk], list[str]]:
        """Retrieved text (and, with ``"all"``, message content) whose control-token texts are
        broken so they tokenize as plain text; the report's warnings."""
        mode = self.neutralize_control_tokens
        if mode == "off" or (not chunks and mode != "all"):
            return messages, chunks, []
        controls = getattr(self.backend.tokenizer, "control_texts", None) or KNOWN_CONTROLS
        notes = []
        chunks, note = neutralize_chunks(chunks, controls)
        if note:
            notes.append(note)
        if mode == "all":
            messages, note = neutralize_messages(messages, controls)
            if note:
                notes.append(note)
        return messages, chunks, notes

    def _prepare(self, messages: Any, chunks: Sequence[Chunk], params: Mapping[str, Any], budget: float | None, on_busy: str,
                 given_wait: float | None, ticket: Ticket | None, t0: float, untrimmed: Sequence[int] | None = None) -> Prepared:
        tools = params.get("tools")
        as_is = self._as_is(messages, chunks)
        # queued behind others, the request finds the context the last of them leaves
        after = self.queue.context_after(ticket) if self.queue is not None else None
        priced = functools.partial(self._price, after=after)
        before = priced(list(untrimmed) if untrimmed is not None else self.backend.tokenizer.prompt_tokens(as_is, tools))
        self._estimate(ticket, before, params)
        wait, ahead = (given_wait, 0) if given_wait is not None or self.queue is None else self.queue.predict(ticket)
        margin = 0.0 if budget is None else self.engine.request_margin(self.attainment_target, budget, len(before.tokens), before.cached,
                                                                       watched=self.watches())
        busy = busy_decision(on_busy, budget, wait, margin, ahead, refuse=self.on_infeasible == "raise")
        plan: Plan | None = None
        sent, warnings, w = before, [], wait or 0.0
        if budget is None and len(before.tokens) > self.backend.n_ctx:
            raise ContextTooSmallError(f"prompt of {len(before.tokens)} tokens does not fit the context window (n_ctx={self.backend.n_ctx})")
        if busy.plan_budget_s is not None:
            plan, sent, warnings = self._plan(messages, chunks, as_is, before, busy.plan_budget_s, params, busy.margin, priced,
                                              self._cache_state(after))
            self._estimate(ticket, sent, params)
        to_send = plan.messages if plan is not None else as_is
        warnings.extend(busy.warnings(budget, sent.predicted_s))
        warnings.extend(self.engine.slowdown_warnings())
        warnings.extend(template_warnings(self.backend.tokenizer, to_send, tools))
        prepared = Prepared(
            messages=to_send, prompt_tokens=tuple(sent.tokens), cached_tokens=sent.cached, snapshot=sent.snapshot,
            # what the caller will feel: the wait for the requests ahead, then the prompt's TTFT
            predicted_ttft_s=sent.predicted_s + w, predicted_ttft_before_s=before.predicted_s + w,
            prompt_tokens_before=len(before.tokens), budget_s=budget, plan=plan, prepare_s=self.clock() - t0, warnings=tuple(warnings),
            feasible=False if busy.refuse else None if plan is None else bool(plan.feasible) and sent.predicted_s + w <= budget,
            queue_wait_s=wait, queue_ahead=ahead, ticket=ticket, request=(messages, tuple(chunks), dict(params)),
        )
        if busy.refuse:
            report = self.report(prepared, Measurement(ttft_s=None, total_s=0.0), params, sent=False, error=QueueBudgetError)
            raise QueueBudgetError(busy.refusal(budget), wait_s=w, ahead=ahead, report=report)
        if plan is None or budget is None:
            return prepared
        self.previous_cut.remember(messages, plan)
        # the prompt's own part: with on_busy="wait" a wait that breaks the budget is not the prompt's fault
        ttft = sent.predicted_s + busy.counted_wait_s
        if not (plan.feasible and ttft <= budget) and self.on_infeasible == "raise":
            report = self.report(prepared, Measurement(ttft_s=None, total_s=0.0), params, sent=False, error=InfeasibleBudgetError)
            raise InfeasibleBudgetError(f"TTFT budget {budget:.3f} s cannot be met: the minimal prompt is predicted at {ttft:.3f} s",
                                        plan=plan, report=report)
        return prepared

    def _price(self, tokens: Sequence[int], after: Sequence[int] | None = None) -> _Priced:
        """What the engine has cached of ``tokens`` (a stored snapshot, if it keeps them) and
        the TTFT the profile predicts for them (at least one token is evaluated; a snapshot's
        restore time counts). ``after``: the prompt the context will hold when this request's
        turn comes (requests are ahead), which bounds what it reuses of the context."""
        best_cache = getattr(self.backend, "best_cache", None)
        if best_cache is not None:
            cached, snapshot = best_cache(tokens, self.profile.predict_prefill_s)
        else:
            cached, snapshot = self.backend.predict_cached_tokens(tokens), None
        if after is not None and snapshot is None:
            cached = min(cached, reusable_prefix_len(after, tokens))
        restore = getattr(snapshot, "restore_s", 0.0) if snapshot is not None else 0.0
        return _Priced(tokens, cached, snapshot, self.profile.predict_ttft_s(evaluated_tokens(len(tokens), cached), cached) + restore)

    def _cache_state(self, after: Sequence[int] | None = None, *, snapshots: bool = True) -> CacheState | None:
        """What the engine's cache holds, read here for the plan (planning asks the engine
        nothing), as :meth:`_price` counts it: ``after`` bounds the context's part; without
        ``snapshots``, the context alone (as a re-plan prices)."""
        state = self.backend.cache_state()
        if state is None or (after is None and snapshots):
            return state
        return attrs.evolve(state, after=after, snapshots=state.snapshots if snapshots else ())

    def _plan(self, messages: Any, chunks: Sequence[Chunk], as_is: Any, before: _Priced, budget: float, params: Mapping[str, Any],
              margin: float, priced: Callable[[Sequence[int]], _Priced], cache: CacheState | None,
              profile: Profile | None = None) -> tuple[Plan, _Priced, list[str]]:
        """Plan to ``budget`` (less the wait the prompt makes room for) with ``margin`` and
        ``profile`` (default: the current one), against what the engine's ``cache`` holds, and
        price the exact prompt it sends. The planner checks its own estimates against the exact
        token count; in process the watched prefill corrects what the prediction still gets
        wrong, with the measured pace."""
        tools = params.get("tools")
        tok = self.backend.tokenizer
        plan = make_plan(
            messages, ttft_budget_s=budget, profile=profile or self.profile, tokenizer=tok, rag_chunks=chunks,
            strategies=self.previous_cut.strategies_for(messages, self.strategies), tools=tools, cached_tokens=before.cached,
            cache=cache, summaries=self.summaries, rag_template=self.rag_template, rag_chunk_template=self.rag_chunk_template,
            on_infeasible="best_effort", clock=self.clock, values=self.values, safety_margin=margin,
            max_prompt_tokens=self._max_prompt_tokens(params),
        )
        unchanged = plan.passthrough and list(plan.messages) == list(as_is)
        sent = before if unchanged else priced(tok.prompt_tokens(plan.messages, tools))
        return plan, sent, []

    # -- the watched prefill ----------------------------------------------------------------------
    def watches(self) -> bool:
        """Whether budgeted requests on this backend are watched while they prefill: it can
        evaluate in steps (``evaluate_to``) and its ``send`` takes the ``watch`` driver (a
        subclass that overrides ``send`` without it is planned once, before sending)."""
        return self.watch_prefill and getattr(self.backend, "evaluate_to", None) is not None and _takes_watch(self.backend)

    def watched(self, prepared: Prepared, *, waited_s: float = 0.0) -> WatchedPrefill | None:
        """The driver of ``prepared``'s watched prefill (None: not watched — no budget, or a
        backend that cannot evaluate in steps)."""
        if prepared.budget_s is None or prepared.plan is None or not self.watches():
            return None
        return WatchedPrefill(self, prepared, waited_s=waited_s)

    def replan(self, prepared: Prepared, watch: PrefillWatch, spent_s: float, *, grow: bool = False) -> Prepared | None:
        """``prepared`` planned again ``spent_s`` into it (the wait for the engine included), for
        the time left at the measured pace (:meth:`PrefillWatch.paced_profile`), against what the
        engine's context holds now — the evaluated prefix. First the plan's chunks are cut from
        the end (:func:`~trimkit.planning.watch.cut_chunks`), which keeps that prefix: to the
        target with its margin, else to the budget itself. Only when no such cut fits the budget
        is the whole request planned again (history turns may go, and the cache after them), and
        that start-over is taken only when it is predicted within the budget: one that misses it
        too would send the question without the context it was asked in, to save a part of a
        budget already lost, so the cut that keeps the prefix and drops every chunk not yet
        evaluated goes instead. With ``grow`` (the request runs ahead of its plan) the chunks the plan dropped may
        be put back after its own, where nothing is evaluated yet. None when nothing would change:
        the request as planned fits after all (or nothing more fits), or it carries no record of
        its inputs."""
        if prepared.request is None or prepared.budget_s is None or prepared.plan is None:
            return None
        messages, chunks, params = prepared.request
        tools = params.get("tools")
        tok = self.backend.tokenizer
        profile = watch.paced_profile()
        left = max(prepared.budget_s - spent_s, 1e-6)
        margin = self.engine.safety_margin(self.attainment_target, share=tail_share(profile, len(prepared.prompt_tokens) - watch.position))
        target = left * (1.0 - margin)

        def price(candidate: Sequence[Mapping[str, Any]]) -> tuple[Sequence[int], int, float]:
            tokens = tok.prompt_tokens(candidate, tools)
            cached = self.backend.predict_cached_tokens(tokens)
            return tokens, cached, profile.predict_ttft_s(evaluated_tokens(len(tokens), cached), cached)

        old = prepared.plan
        original = messages[last_user_index(messages)]
        extra = tuple(old.dropped_chunks) if grow else ()
        question = message_text(original)
        worth = chunk_values((*old.kept_chunks, *extra), question, self.values or ValueModel())

        def cut_to(target_s: float, *, least: bool = False) -> Cut | None:
            return cut_chunks(old, original, price, target_s, self.rag_template, self.rag_chunk_template, position=watch.position,
                              value=lambda c: worth.get(str(c.id), 0.0), extra=extra, least=least)

        cut, how = cut_to(target), ""
        if cut is None and not grow:
            cut, how = cut_to(left), " (within the budget, not its margin: starting over would forfeit the evaluated prefix)"
        full = None
        if cut is None and not grow:  # nothing that keeps the prefix fits: the whole request again, at the measured pace
            as_is = self._as_is(messages, chunks)

            def priced(tokens: Sequence[int]) -> _Priced:
                cached = self.backend.predict_cached_tokens(tokens)
                return _Priced(tokens, cached, None, profile.predict_ttft_s(evaluated_tokens(len(tokens), cached), cached))

            before = priced(tok.prompt_tokens(as_is, tools))
            full = self._plan(messages, chunks, as_is, before, left, params, margin, priced, self._cache_state(snapshots=False),
                              profile=profile)
            if full[1].predicted_s > left:  # starting over misses the budget too: keep the prefix, cut the most
                least = cut_to(left, least=True)
                if least is not None:
                    cut, how, full = least, " (nothing fits the budget; starting over would miss it too)", None
        old_ids = [str(c.id) for c in old.kept_chunks]
        new_ids = [str(c.id) for c in cut.chunks] if cut is not None else []
        gone_ids = [i for i in old_ids if i not in new_ids]
        back_ids = [i for i in new_ids if i not in old_ids]
        if cut is not None and not gone_ids and not back_ids or grow and (cut is None or not back_ids):
            return None  # it fits as planned (or, growing, nothing more fits)
        if cut is not None:
            gone = tuple(c for c in old.kept_chunks if str(c.id) in gone_ids)
            said = []
            if gone_ids:
                said.append(f"dropped {', '.join(gone_ids)} (not evaluated yet; the least value per character)")
            if back_ids:
                said.append(f"put back {', '.join(back_ids)}, dropped by the plan, before the question")
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
            plan, sent, _ = full
            tokens, predicted = sent.tokens, sent.predicted_s
            kept_now = {str(c.id) for c in plan.kept_chunks}
            dropped = [str(c.id) for c in old.kept_chunks if str(c.id) not in kept_now]
            dropped += [f"message {i}" for i in sorted(set(plan.removed_message_indices) - set(old.removed_message_indices))]
            self.previous_cut.remember(messages, plan)
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

    def _estimate(self, ticket: Ticket | None, priced: _Priced, params: Mapping[str, Any]) -> None:
        """Tell the engine's queue the request's predicted work (for the requests behind it)."""
        if ticket is not None and self.queue is not None:
            room = self.backend.n_ctx - len(priced.tokens)
            ticket.estimate(priced.predicted_s, self.queue.decode_s(params, self.profile.decode_tokens_per_s, room), priced.tokens)

    def _max_prompt_tokens(self, params: Mapping[str, Any]) -> int:
        """The most prompt tokens the context window takes: ``n_ctx`` less ``max_tokens`` (or ``max_completion_tokens``)."""
        return max(int(self.backend.n_ctx) - (answer_cap(params) or 0), 1)

    # -- send (the front-end's), measure, report --------------------------------------------------
    def sent(self, prepared: Prepared, *, waited_s: float = 0.0) -> Prepared:
        """Record that ``prepared`` went out; ``waited_s``: how long it waited for the engine
        (others held it), which its report states and counts in the TTFT the caller felt
        (``report.measured_ttft_s``), not in the engine's (``measurement.ttft_s``)."""
        if waited_s >= 0.001:
            prepared = prepared.with_warning(
                f"waited {waited_s:.3f} s for the engine (requests ahead held it, or an idle probe was stopping); "
                "counted in the measured TTFT, not in measurement.ttft_s"
            )
        self.last_prepared = prepared
        return prepared

    def report(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any], *, sent: bool = True,
               error: type[BaseException] | None = None) -> Report:
        """The report of ``prepared`` with what was measured of it (nothing learned from it) — the
        one place every request's report is completed, so the report log and the installed
        exporters (:mod:`trimkit.report`) see it here. ``error``: what the request ended with."""
        notes = self._report_notes(m, params) if self._report_notes is not None else ()
        model = self._model_label(params) if self._model_label is not None else self._model_file_label()
        report = Report.of_request(prepared, m, params, backend=self.backend.name, model=model, profile=self.profile, notes=notes, sent=sent,
                                   endpoint=self.endpoint_label, tokens_per_s_target=self.tokens_per_s_target)
        report_completed(report, error_type=None if error is None else f"{error.__module__}.{error.__qualname__}",
                         prepare_s=prepared.prepare_s or 0.0, sinks=self._sinks)
        return report

    def error_report(self, prepared: Prepared, ts: TimedStream, params: Mapping[str, Any],
                     error: type[BaseException] | None = None) -> Report:
        """The report of a request whose stream failed (with ``error``): what was sent, the TTFT
        if it came, and ``total_s`` from sending to the failure (0.0 if the stream never started)."""
        total = ts.total_s if ts.started is not None else 0.0
        self._leave(prepared)
        m = Measurement(ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=total, queue_s=getattr(ts, "queue_s", 0.0))
        return self.report(prepared, m, params, error=error)

    def attach_report(self, exc: BaseException, ts: TimedStream, prepared: Prepared, params: Mapping[str, Any]) -> None:
        """Give an error that carries a report (any BackendError: StreamInterruptedError, a
        ServerError or MalformedReplyError mid-stream, a ServerTimeoutError) the report of what
        was sent, unless it has one."""
        if getattr(exc, "report", "absent") is None:
            exc.report = self.error_report(prepared, ts, params, type(exc))  # type: ignore[attr-defined]

    def finish(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any]) -> Report:
        """A request finished: its report, and what it teaches (drift, margin, next summary)."""
        report = self.report(prepared, m, params)
        outcome = None
        if prepared.watched and prepared.budget_s is not None and report.measured_ttft_s is not None and prepared.predicted_ttft_s:
            outcome = (report.measured_ttft_s, prepared.predicted_ttft_s)
        refined = self.engine.learn(_whole_request(m, prepared), persist_every=self.persist_every,
                                    answer_capped=answer_cap(params) is not None, watched=prepared.watched, outcome=outcome)
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
        self.summary_worker.after_response(prepared.plan)
        self._leave(prepared)
        return report

    def _leave(self, prepared: Prepared) -> None:
        """The request is done with the engine: out of its queue."""
        ticket = getattr(prepared, "ticket", None)
        if ticket is not None:
            ticket.done()

    def _model_file_label(self) -> str:
        """The model as a person names it, for the report (the GGUF file name in-process).

        Computed once: the profile key hashes part of the model file."""
        if self._model_name is None:
            model = self.backend.profile_key().model
            self._model_name = model.split(":")[0] if self.backend.name == "llama_cpp" else model
        return self._model_name


def _n_batch(profile: Profile) -> int:
    return max(int(profile.model.n_batch or 512), 1)


@functools.lru_cache(maxsize=64)
def _send_takes_watch(send: Any) -> bool:
    try:
        params = inspect.signature(send).parameters
    except (TypeError, ValueError):
        return False
    return "watch" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _takes_watch(backend: Any) -> bool:
    """Whether ``backend.send`` accepts ``watch=`` (read once per class)."""
    return _send_takes_watch(type(backend).send)


def _whole_request(m: Measurement, prepared: Prepared) -> Measurement:
    """What the refit may learn of a request's whole prefill: all of it, unless a re-plan left
    evaluated tokens out of the prompt sent (then its counts describe no one prompt). A model
    load the server reported (``server["load_s"]``: Ollama's ``load_duration``) is no part of
    the first-token overhead: the TTFT learned is without it."""
    load = m.server.get("load_s")
    if isinstance(load, float) and load > 0 and m.ttft_s is not None:
        m = attrs.evolve(m, ttft_s=max(m.ttft_s - load, 0.0))
    if prepared.replans and m.evaluated_tokens is not None and m.prompt_tokens is not None and m.evaluated_tokens > m.prompt_tokens:
        return attrs.evolve(m, evaluated_tokens=None)
    return m


class WatchedPrefill:
    """Runs the watched prefill of one prepared request (:mod:`trimkit.planning.watch`) on the
    engine that holds it: call it with the backend's ``evaluate(tokens, end) -> (seconds,
    start)`` and its clock, and it returns the messages and prompt tokens to generate from — the
    plan's, or a re-plan's — with all of the prompt evaluated. :attr:`prepared` is the request as
    finally sent (its report reads it). ``waited_s``: how long the request already waited for
    the engine (it counts against the budget)."""

    def __init__(self, pipeline: Pipeline, prepared: Prepared, *, waited_s: float = 0.0) -> None:
        self.pipeline = pipeline
        self.prepared = prepared
        self.waited_s = waited_s

    def __call__(self, evaluate: Callable[[Sequence[int], int], tuple[float, int]], clock: Callable[[], float],
                 held: int) -> tuple[Sequence[Mapping[str, Any]], Sequence[int]]:
        """``held``: how much of the prompt the engine's context holds now."""
        t0 = clock()
        p = self.prepared
        pipeline = self.pipeline
        profile = pipeline.profile
        budget = p.budget_s - self.waited_s if p.budget_s is not None else math.inf
        # the target the plan filled to: a watch held to a stricter one (a margin sized for the
        # planned prompt's tail, larger than the plan's, sized for the untrimmed prompt's) re-planned
        # requests running on pace and cut what the plan had kept
        margin = p.plan.safety_margin if p.plan is not None else \
            pipeline.engine.safety_margin(pipeline.attainment_target, share=tail_share(profile, len(p.prompt_tokens) - held))
        watch = PrefillWatch(p.prompt_tokens, held, profile, budget, margin=margin, n_batch=_n_batch(profile))
        if not watch.watched:
            return p.messages, p.prompt_tokens
        self.prepared = attrs.evolve(p, watched=True)
        grown = False
        while (end := watch.next_end()) is not None:
            seconds, start = evaluate(watch.tokens, end)
            watch.record(end, seconds, start)
            over = watch.over_budget(clock() - t0)
            if over or (not grown and watch.ahead(clock() - t0) and self.prepared.plan is not None and self.prepared.plan.dropped_chunks):
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
            pipeline.last_prepared = self.prepared  # the request as sent is the re-plan's
        return self.prepared.messages, self.prepared.prompt_tokens


# -- Summaries of older turns, computed off the critical path. -------------------------------------------

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


# -- A request on its way through the :class:`~trimkit.pipeline.Pipeline`: the chunks placed into --------

def place_chunks(
    messages: Sequence[Mapping[str, Any]],
    chunks: Sequence[Chunk],
    template: str = DEFAULT_RAG_TEMPLATE,
    chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE,
) -> list[Mapping[str, Any]]:
    """A new message list with ``chunks`` placed into the last user message (caller's list untouched).

    Chunks are ranked by the caller's scores when every chunk has one, else by BM25 against the
    question, and placed as the planner places them (the most relevant one last, next to the
    question: :func:`~trimkit.messages.in_prompt_order`), so an untrimmed plan and this placement
    give the same prompt."""
    out = list(messages)
    if not chunks:
        return out
    i = last_user_index(messages)
    out[i] = with_chunks(messages[i], in_prompt_order(rank_chunks(chunks, message_text(messages[i]))), template, chunk_template)
    return out


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
    #: the wait it was planned with, for the requests ahead of it (predicted; None when nobody
    #: predicts one: a server without a caller's prediction), and how many were ahead
    queue_wait_s: float | None = None
    queue_ahead: int = 0
    #: its place in the engine's queue (:class:`~trimkit.planning.queue.Ticket`; None off an in-process engine)
    ticket: Any = attrs.field(default=None, repr=False, eq=False)
    #: the call's own inputs (messages, chunks, parameters), which a re-plan plans from again
    request: Any = attrs.field(default=None, repr=False, eq=False)
    #: whether its prefill was watched (:mod:`trimkit.planning.watch`), and the re-plans it made
    watched: bool = False
    replans: tuple[Any, ...] = ()

    def with_warning(self, warning: str) -> Prepared:
        """This request with one more warning for its report."""
        return attrs.evolve(self, warnings=(*self.warnings, warning))


class PreviousCut:
    """Where the previous request cut the conversation, if it dropped turns: the role and text
    of the first history message it kept."""

    def __init__(self) -> None:
        self.marker: tuple[Any, str] | None = None

    def strategies_for(self, messages: Sequence[Mapping[str, Any]], strategies: Any) -> Any:
        """``strategies`` when given; else the default chain, plus
        :class:`~trimkit.strategies.keep_cached_cut` when this conversation still has a turn
        starting at the previous cut."""
        if strategies is not None or self.marker is None:
            return strategies
        role, text = self.marker
        for j, m in enumerate(messages):
            if m.get("role") == role and message_text(m) == text and j > 0:
                return default_strategies(keep_cut=j)
        return None

    def remember(self, messages: Sequence[Mapping[str, Any]], plan: Any) -> None:
        """Note where ``plan`` cut ``messages`` (nowhere: it dropped no turn)."""
        removed = set(getattr(plan, "removed_message_indices", ()) or ())
        self.marker = None
        if removed:
            for i in range(max(removed) + 1, len(messages)):
                if i not in removed and messages[i].get("role") not in ("system", "developer"):
                    self.marker = (messages[i].get("role"), message_text(messages[i]))
                    return
