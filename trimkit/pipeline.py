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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from trimkit.backends.base import Backend, Measurement, TimedStream
from trimkit.calibration import calibrate
from trimkit.errors import ContextTooSmallError, InfeasibleBudgetError, InvalidInputError
from trimkit.messages import (
    DEFAULT_RAG_CHUNK_TEMPLATE,
    DEFAULT_RAG_TEMPLATE,
    Chunk,
    check_rag_templates,
    coerce_chunks,
    validate_messages,
)
from trimkit.planning.costs import evaluated_tokens
from trimkit.planning.drift import LiveProfile
from trimkit.planning.margin import DEFAULT_TARGET, EngineState, engine_state
from trimkit.planning.planner import Plan
from trimkit.planning.planner import plan as make_plan
from trimkit.planning.summaries import SummaryCache
from trimkit.planning.values import ValueModel
from trimkit.prepared import Prepared, PreviousCut, place_chunks
from trimkit.profile import Profile
from trimkit.profile_store import save_profile
from trimkit.report import Report
from trimkit.summary_worker import SummaryWorker
from trimkit.validation import budget as valid_budget, open_share

__all__ = ["Pipeline", "ModelLabel", "ReportNotes"]

log = logging.getLogger("trimkit")


@attrs.frozen
class _Priced:
    """A prompt as tokens, what the engine has cached of it, and its predicted TTFT."""

    tokens: Sequence[int]
    cached: int
    snapshot: Any
    predicted_s: float


#: ``model_label(params)``: the model as the report names it
ModelLabel = Callable[[Mapping[str, Any]], str]
#: ``report_notes(measurement, params)``: warnings a front-end adds to every report
ReportNotes = Callable[[Measurement, Mapping[str, Any]], Sequence[str]]


class Pipeline:
    """Validate → plan → (the front-end sends) → measure → report, for any backend.

    Keyword arguments are those of :func:`trimkit.wrap` (see there). ``model_label`` and
    ``report_notes`` let a front-end name the model and add warnings in its reports."""

    def __init__(
        self,
        backend: Backend,
        *,
        ttft_budget_s: float | None = None,
        profile: Profile | None = None,
        strategies: Any = None,
        on_infeasible: str = "best_effort",
        summarizer: Any = "extractive",
        background_summaries: bool = True,
        rag_template: str = DEFAULT_RAG_TEMPLATE,
        rag_chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE,
        quick_calibration: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        attainment_target: float = DEFAULT_TARGET,
        values: Any = None,
        model_label: ModelLabel | None = None,
        report_notes: ReportNotes | None = None,
    ) -> None:
        if values is not None and not isinstance(values, ValueModel):
            raise InvalidInputError(f"values must be a trimkit.ValueModel or None, got {type(values).__name__}")
        attainment_target = open_share(attainment_target, "attainment_target")
        if on_infeasible not in ("best_effort", "raise"):
            raise InvalidInputError(f"on_infeasible must be 'best_effort' or 'raise', got {on_infeasible!r}")
        check_rag_templates(rag_template, rag_chunk_template)
        self.backend = backend
        self.ttft_budget_s = ttft_budget_s  # validated by the property
        self.strategies = strategies
        #: what each kind of content is worth when the budget forces a choice (None: the defaults)
        self.values = values
        self.on_infeasible = on_infeasible
        self.rag_template = rag_template
        self.rag_chunk_template = rag_chunk_template
        self.clock = clock
        #: computes summaries of older turns after each response (off the critical path); the
        #: planner may put a ready one in their place. Default: the model-free extractive one.
        self.summary_worker = SummaryWorker(summarizer, background=background_summaries, tokenizer=lambda: self.backend.background_tokenizer)
        if profile is None:
            profile = calibrate(backend, quick=quick_calibration)
        self.attainment_target = attainment_target
        #: what this engine has learned (drift, margin window), shared with every wrapper of it
        self.engine: EngineState = engine_state(backend, profile)
        self.live: LiveProfile = self.engine.live
        self.reports: list[Report] = []  # most recent last; bounded
        self.max_reports = 256
        #: store the live-refined profile every N measured requests (0: never)
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

    @property
    def ttft_budget_s(self) -> float | None:
        """The default TTFT budget of a call (None: no budget); validated when set."""
        return self._ttft_budget_s

    @ttft_budget_s.setter
    def ttft_budget_s(self, value: float | None) -> None:
        self._ttft_budget_s = None if value is None else valid_budget(value)

    @property
    def attainment_target(self) -> float:
        """The share of budgeted requests whose TTFT the safety margin aims to keep inside the budget."""
        return self._attainment_target

    @attainment_target.setter
    def attainment_target(self, value: float) -> None:
        self._attainment_target = open_share(value, "attainment_target")

    @property
    def profile(self) -> Profile:
        """The current profile (calibration refined by live measurements)."""
        return self.live.current

    @property
    def safety_margin(self) -> float:
        """The fraction of a budget to hold back, learned from this engine's measured TTFT: the
        margin that would have kept ``attainment_target`` of recent requests inside their budget
        (:mod:`trimkit.planning.margin`); the profile's own rule while too few requests are known."""
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
    def prepare(
        self,
        messages: Any,
        rag_chunks: Any = None,
        params: Mapping[str, Any] | None = None,
        *,
        ttft_budget_s: float | None = None,
    ) -> Prepared:
        """Validate, plan and check a request without sending it."""
        t0 = self.clock()
        params = params or {}
        validate_messages(messages)
        chunks = coerce_chunks(rag_chunks)
        budget = self.ttft_budget_s if ttft_budget_s is None else valid_budget(ttft_budget_s)
        tools = params.get("tools")
        as_is = place_chunks(messages, chunks, self.rag_template, self.rag_chunk_template) if chunks else messages
        before = self._price(self.backend.tokenizer.prompt_tokens(as_is, tools))
        plan: Plan | None = None
        sent, warnings = before, []
        if budget is None:
            if len(before.tokens) > self.backend.n_ctx:
                raise ContextTooSmallError(
                    f"prompt of {len(before.tokens)} tokens does not fit the context window (n_ctx={self.backend.n_ctx})"
                )
        else:
            plan, sent, warnings = self._plan(messages, chunks, as_is, before, budget, params)
        to_send = plan.messages if plan is not None else as_is
        warnings.extend(self._template_warnings(to_send, tools))
        prepared = Prepared(
            messages=to_send,
            prompt_tokens=tuple(sent.tokens),
            cached_tokens=sent.cached,
            predicted_ttft_s=sent.predicted_s,
            predicted_ttft_before_s=before.predicted_s,
            prompt_tokens_before=len(before.tokens),
            budget_s=budget,
            plan=plan,
            snapshot=sent.snapshot,
            prepare_s=self.clock() - t0,
            warnings=tuple(warnings),
            feasible=None if plan is None or budget is None else bool(plan.feasible) and sent.predicted_s <= budget,
        )
        if plan is None:
            return prepared
        self.previous_cut.remember(messages, plan)
        if not prepared.feasible and self.on_infeasible == "raise":
            report = self.report(prepared, Measurement(ttft_s=None, total_s=0.0), params, sent=False)
            raise InfeasibleBudgetError(
                f"TTFT budget {budget:.3f} s cannot be met: the minimal prompt is predicted at {sent.predicted_s:.3f} s",
                plan=plan,
                report=report,
            )
        return prepared

    def _price(self, tokens: Sequence[int]) -> _Priced:
        """What the engine has cached of ``tokens`` (a stored snapshot, if it keeps them) and
        the TTFT the profile predicts for them (at least one token is evaluated; a snapshot's
        restore time counts)."""
        best_cache = getattr(self.backend, "best_cache", None)
        if best_cache is not None:
            cached, snapshot = best_cache(tokens, self.profile.predict_prefill_s)
        else:
            cached, snapshot = self.backend.predict_cached_tokens(tokens), None
        restore = getattr(snapshot, "restore_s", 0.0) if snapshot is not None else 0.0
        return _Priced(tokens, cached, snapshot, self.profile.predict_ttft_s(evaluated_tokens(len(tokens), cached), cached) + restore)

    def _plan(
        self, messages: Any, chunks: Sequence[Chunk], as_is: Any, before: _Priced, budget: float, params: Mapping[str, Any]
    ) -> tuple[Plan, _Priced, list[str]]:
        """Plan, then check the plan against the exact token count: plan again, tighter, (at
        most twice) while the exact prompt is predicted over the budget less the margin."""
        tools = params.get("tools")
        tok = self.backend.tokenizer

        def probe(candidate: Sequence[Mapping[str, Any]]) -> int:
            return self._price(tok.prompt_tokens(candidate, tools)).cached

        margin = self.safety_margin
        limit = budget * (1.0 - margin)
        strategies = self.previous_cut.strategies_for(messages, self.strategies)
        plan_budget = budget
        warnings: list[str] = []
        for _attempt in range(3):
            plan = make_plan(
                messages,
                ttft_budget_s=plan_budget,
                profile=self.profile,
                tokenizer=tok,
                rag_chunks=chunks,
                strategies=strategies,
                tools=tools,
                cached_tokens=before.cached,
                cache_probe=probe,
                summaries=self.summaries,
                rag_template=self.rag_template,
                rag_chunk_template=self.rag_chunk_template,
                on_infeasible="best_effort",
                clock=self.clock,
                values=self.values,
                safety_margin=margin,
                max_prompt_tokens=self._max_prompt_tokens(params),
            )
            unchanged = plan.passthrough and list(plan.messages) == list(as_is)
            sent = before if unchanged else self._price(tok.prompt_tokens(plan.messages, tools))
            if sent.predicted_s <= limit or not plan.feasible or getattr(plan, "minimal", False):
                break
            # the exact count came out above the planner's estimate: plan again, tighter
            plan_budget = plan_budget * max(min(limit / sent.predicted_s, 0.98), 0.5)
            warnings.append(f"re-planned: exact prompt predicted {sent.predicted_s:.3f} s > {limit:.3f} s")
        return plan, sent, warnings

    def _max_prompt_tokens(self, params: Mapping[str, Any]) -> int:
        """The most prompt tokens the context window takes: ``n_ctx`` less ``max_tokens``."""
        max_tokens = params.get("max_tokens")
        reserve = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 else 0
        return max(int(self.backend.n_ctx) - reserve, 1)

    def _template_warnings(self, messages: Sequence[Mapping[str, Any]], tools: Any) -> list[str]:
        """Say so when the chat template drops a message (the model never sees it)."""
        dropped_messages = getattr(self.backend.tokenizer, "dropped_messages", None)
        if dropped_messages is None:
            return []
        try:
            dropped = dropped_messages(messages, tools)
        except Exception:  # a check for the report must never fail the request
            return []
        if not dropped:
            return []
        roles = ", ".join(f"{i} ({messages[i].get('role')})" for i in dropped)
        return [f"the chat template dropped message(s) {roles}: the model never sees them"]

    # -- send (the front-end's), measure, report --------------------------------------------------
    def sent(self, prepared: Prepared, *, waited_s: float = 0.0) -> Prepared:
        """Record that ``prepared`` went out; ``waited_s``: how long it waited for the engine
        (another request held it), which its report states and its measured TTFT excludes."""
        if waited_s >= 0.001:
            prepared = prepared.with_warning(
                f"waited {waited_s:.3f} s for the engine (another request held it); not counted in the measured TTFT"
            )
        self.last_prepared = prepared
        return prepared

    def report(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any], *, sent: bool = True) -> Report:
        """The report of ``prepared`` with what was measured of it (nothing learned from it)."""
        plan = prepared.plan
        warnings = list(prepared.warnings)
        if plan is not None and not plan.feasible:
            warnings.append("budget infeasible: sent the minimal prompt (system + last user message)")
        if not sent:
            warnings.append("not sent")
        if self._report_notes is not None:
            warnings.extend(self._report_notes(m, params))
        return Report(
            backend=self.backend.name,
            measurement=m,
            prompt_tokens=len(prepared.prompt_tokens),
            predicted_ttft_s=prepared.predicted_ttft_s,
            ttft_budget_s=prepared.budget_s,
            predicted_ttft_before_s=prepared.predicted_ttft_before_s,
            prompt_tokens_before=prepared.prompt_tokens_before,
            cached_tokens_predicted=prepared.cached_tokens,
            actions=tuple(plan.actions) if plan is not None else (),
            feasible=prepared.feasible,
            passthrough=plan.passthrough if plan is not None else True,
            planning_s=getattr(plan, "planning_s", None) if plan is not None else None,
            profile_error_pct=self.profile.error.median_pct,
            warnings=tuple(warnings),
            decode_params={k: v for k, v in params.items() if k not in ("messages",)},
            model=self._model_label(params) if self._model_label is not None else self._model_file_label(),
            # the margin the plan held back (the plan records what it was given)
            safety_margin=getattr(plan, "safety_margin", None) if plan is not None and prepared.budget_s is not None else None,
        )

    def error_report(self, prepared: Prepared, ts: TimedStream, params: Mapping[str, Any]) -> Report:
        """The report of a request whose stream failed: what was sent, the TTFT if it came, and
        ``total_s`` from sending to the failure (0.0 if the stream never started)."""
        total = ts.total_s if ts.started is not None else 0.0
        return self.report(prepared, Measurement(ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=total), params)

    def attach_report(self, exc: BaseException, ts: TimedStream, prepared: Prepared, params: Mapping[str, Any]) -> None:
        """Give an error that carries a report (any BackendError: StreamInterruptedError, a
        ServerError or MalformedReplyError mid-stream, a ServerTimeoutError) the report of what
        was sent, unless it has one."""
        if getattr(exc, "report", "absent") is None:
            exc.report = self.error_report(prepared, ts, params)  # type: ignore[attr-defined]

    def finish(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any]) -> Report:
        """A request finished: its report, and what it teaches (drift, margin, next summary)."""
        report = self.report(prepared, m, params)
        # measured / predicted TTFT of a budgeted request feeds this engine's margin window
        measured = m.ttft_s if m.ttft_s is not None else m.first_output_s
        self.engine.observe_ttft(prepared.predicted_ttft_s, measured, prepared.budget_s)
        if m.engine_prefill_s is not None and m.evaluated_tokens:
            self.live.observe(m.evaluated_tokens, m.cached_tokens or 0, m.engine_prefill_s)
            if self.persist_every and self.live.observations and self.live.observations % self.persist_every == 0:
                self._persist()
        with self._lock:
            self._last_report = report
            self.reports.append(report)
            del self.reports[: -self.max_reports]
        log.info(report.log_line())
        if m.truncated_tokens:
            log.warning("trimkit: the engine evaluated %d fewer prompt tokens than were sent (silent truncation)", m.truncated_tokens)
        self.summary_worker.after_response(prepared.plan)
        return report

    def _model_file_label(self) -> str:
        """The model as a person names it, for the report (the GGUF file name in-process).

        Computed once: the profile key hashes part of the model file."""
        if self._model_name is None:
            model = self.backend.profile_key().model
            self._model_name = model.split(":")[0] if self.backend.name == "llama_cpp" else model
        return self._model_name

    def _persist(self) -> None:
        """Store the refined profile (drift, refits) so the next process starts from it."""
        try:
            save_profile(self.profile)
        except OSError as exc:  # a read-only cache must not break requests
            log.warning("trimkit: could not store the refined profile: %s", exc)
