"""The drop-in wrapper: ``trimkit.wrap(llm, ttft_budget_s=...)``.

One engine, :class:`Trimmer`, sits behind every front-end: it validates the request, finds what
the engine already has cached, plans (``trimkit.planner.plan``), checks the plan against the
exact token count, sends, measures, feeds the measured prefill back into the profile, and builds
the :class:`~trimkit.report.Report`. :class:`TrimmedLlama` gives it the chat API of
``llama_cpp.Llama``; the OpenAI-client front-end lives in :mod:`trimkit.openai_wrapper`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from trimkit import _validate
from trimkit.backends.base import Backend, Measurement
from trimkit.calibration import calibrate
from trimkit.errors import ContextTooSmallError, InfeasibleBudgetError, InvalidInputError, TrimkitError
from trimkit.messages import (
    DEFAULT_RAG_CHUNK_TEMPLATE,
    DEFAULT_RAG_TEMPLATE,
    Chunk,
    coerce_chunks,
    check_rag_templates,
    last_user_index,
    message_text,
    validate_messages,
    with_chunks,
)
from trimkit.margin import DEFAULT_TARGET, EngineState, engine_state
from trimkit.profile import LiveProfile, Profile
from trimkit.report import Report

__all__ = ["Trimmer", "TrimmedLlama", "ReportingStream", "Prepared", "wrap", "place_chunks"]

log = logging.getLogger("trimkit")


def place_chunks(
    messages: Sequence[Mapping[str, Any]],
    chunks: Sequence[Chunk],
    template: str = DEFAULT_RAG_TEMPLATE,
    chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE,
) -> list[Mapping[str, Any]]:
    """A new message list with ``chunks`` placed into the last user message (caller's list untouched).

    Chunks go most relevant first — the caller's scores when every chunk has one, else BM25
    against the question — the same order the planner uses, so an untrimmed plan and this
    placement give the same prompt."""
    from trimkit.relevance import rank_chunks

    out = list(messages)
    if not chunks:
        return out
    i = last_user_index(messages)
    out[i] = with_chunks(messages[i], rank_chunks(chunks, message_text(messages[i])), template, chunk_template)
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


class Trimmer:
    """The engine behind :func:`wrap`: plan → send → measure → report, for any backend."""

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
    ) -> None:
        from trimkit.values import ValueModel

        if values is not None and not isinstance(values, ValueModel):
            raise InvalidInputError(f"values must be a trimkit.ValueModel or None, got {type(values).__name__}")
        if ttft_budget_s is not None:
            _validate.budget(ttft_budget_s)
        if isinstance(attainment_target, bool) or not isinstance(attainment_target, (int, float)) or not 0 < attainment_target < 1:
            raise InvalidInputError(f"attainment_target must be a number strictly between 0 and 1, got {attainment_target!r}")
        if on_infeasible not in ("best_effort", "raise"):
            raise InvalidInputError(f"on_infeasible must be 'best_effort' or 'raise', got {on_infeasible!r}")
        check_rag_templates(rag_template, rag_chunk_template)
        self.backend = backend
        self.ttft_budget_s = ttft_budget_s
        self.strategies = strategies
        #: what each kind of content is worth when the budget forces a choice (None: the defaults)
        self.values = values
        self.on_infeasible = on_infeasible
        self.rag_template = rag_template
        self.rag_chunk_template = rag_chunk_template
        self.clock = clock
        if profile is None:
            profile = calibrate(backend, quick=quick_calibration)
        #: the share of budgeted requests whose TTFT the safety margin aims to keep inside the budget
        self.attainment_target = float(attainment_target)
        #: what this engine has learned (drift, margin window), shared with every wrapper of it
        self.engine: EngineState = engine_state(backend, profile)
        self.live: LiveProfile = self.engine.live
        from trimkit.summarize import SummaryCache

        self.summaries = SummaryCache()
        if isinstance(summarizer, str) and summarizer == "extractive":
            from trimkit.summarize import ExtractiveSummarizer

            summarizer = ExtractiveSummarizer()
        elif summarizer is not None and not callable(getattr(summarizer, "summarize", None)):
            raise InvalidInputError(f"summarizer must be a Summarizer, 'extractive' or None, got {type(summarizer).__name__}")
        #: computes summaries of older turns after each response (off the critical path); the
        #: planner may put a ready one in their place. Default: the model-free extractive one.
        self.summarizer = summarizer
        self.background_summaries = background_summaries
        self._summary_threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._last_report: Report | None = None
        self.reports: list[Report] = []  # most recent last; bounded
        self.max_reports = 256
        #: store the live-refined profile every N measured requests (0: never)
        self.persist_every = 16
        self._last_prepared: Prepared | None = None
        self._model_name: str | None = None
        #: (role, text) of the first history message the previous request kept, if it dropped turns
        self._cut_marker: tuple[Any, str] | None = None

    # -- state ----------------------------------------------------------------------------------
    @property
    def profile(self) -> Profile:
        """The current profile (calibration refined by live measurements)."""
        return self.live.current

    @property
    def safety_margin(self) -> float:
        """The fraction of a budget to hold back, learned from this engine's measured TTFT: the
        margin that would have kept ``attainment_target`` of recent requests inside their budget
        (:mod:`trimkit.margin`); the profile's own rule while too few requests are known."""
        return self.engine.safety_margin(self.attainment_target)

    @property
    def last_report(self) -> Report | None:
        """The report of the most recent finished request (any thread)."""
        with self._lock:
            return self._last_report

    # -- planning -------------------------------------------------------------------------------
    def _cache_for(self, tokens: Sequence[int]) -> tuple[int, Any]:
        best_cache = getattr(self.backend, "best_cache", None)
        if best_cache is not None:
            return best_cache(tokens, self.profile.predict_prefill_s)
        return self.backend.predict_cached_tokens(tokens), None

    def _predict(self, n_tokens: int, cached: int, snapshot: Any) -> float:
        restore = getattr(snapshot, "restore_s", 0.0) if snapshot is not None else 0.0
        return self.profile.predict_ttft_s(max(n_tokens - cached, 1), cached) + restore

    def prepare(
        self,
        messages: Any,
        rag_chunks: Any = None,
        params: Mapping[str, Any] | None = None,
        *,
        ttft_budget_s: float | None = None,
    ) -> Prepared:
        """Validate, plan and check a request without sending it."""
        from trimkit.planner import plan as make_plan

        t0 = self.clock()
        params = params or {}
        validate_messages(messages)
        chunks = coerce_chunks(rag_chunks)
        budget = self.ttft_budget_s if ttft_budget_s is None else _validate.budget(ttft_budget_s)
        tools = params.get("tools")
        tok = self.backend.tokenizer
        as_is = place_chunks(messages, chunks, self.rag_template, self.rag_chunk_template) if chunks else messages
        tokens_before = tok.prompt_tokens(as_is, tools)
        cached_before, snap_before = self._cache_for(tokens_before)
        predicted_before = self._predict(len(tokens_before), cached_before, snap_before)
        if budget is None:
            if len(tokens_before) > self.backend.n_ctx:
                raise ContextTooSmallError(
                    f"prompt of {len(tokens_before)} tokens does not fit the context window (n_ctx={self.backend.n_ctx})"
                )
            return Prepared(
                messages=as_is,
                prompt_tokens=tuple(tokens_before),
                cached_tokens=cached_before,
                predicted_ttft_s=predicted_before,
                predicted_ttft_before_s=predicted_before,
                prompt_tokens_before=len(tokens_before),
                budget_s=None,
                snapshot=snap_before,
                prepare_s=self.clock() - t0,
                warnings=tuple(self._template_warnings(as_is, tools)),
            )

        def probe(candidate: Sequence[Mapping[str, Any]]) -> int:
            return self._cache_for(tok.prompt_tokens(candidate, tools))[0]

        plan_budget = budget
        margin = self._safety_margin()
        limit = budget * (1.0 - margin)
        strategies = self._strategies_for(messages)
        warnings: list[str] = []
        plan = tokens = cached = snap = predicted = None
        for _attempt in range(3):
            plan = make_plan(
                messages,
                ttft_budget_s=plan_budget,
                profile=self.profile,
                tokenizer=tok,
                rag_chunks=chunks,
                strategies=strategies,
                tools=tools,
                cached_tokens=cached_before,
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
            if plan.passthrough and list(plan.messages) == list(as_is):
                tokens, cached, snap = tokens_before, cached_before, snap_before
            else:
                tokens = tok.prompt_tokens(plan.messages, tools)
                cached, snap = self._cache_for(tokens)
            predicted = self._predict(len(tokens), cached, snap)
            if predicted <= limit or not plan.feasible or getattr(plan, "minimal", False):
                break
            # the exact count came out above the planner's estimate: plan again, tighter
            plan_budget = plan_budget * max(min(limit / predicted, 0.98), 0.5)
            warnings.append(f"re-planned: exact prompt predicted {predicted:.3f} s > {limit:.3f} s")
        assert plan is not None and tokens is not None and cached is not None and predicted is not None
        warnings.extend(self._template_warnings(plan.messages, tools))
        feasible = bool(plan.feasible) and predicted <= budget
        prepared = Prepared(
            messages=plan.messages,
            prompt_tokens=tuple(tokens),
            cached_tokens=cached,
            predicted_ttft_s=predicted,
            predicted_ttft_before_s=predicted_before,
            prompt_tokens_before=len(tokens_before),
            budget_s=budget,
            plan=plan,
            snapshot=snap,
            prepare_s=self.clock() - t0,
            warnings=tuple(warnings),
            feasible=feasible,
        )
        self._remember_cut(messages, plan)
        if not prepared.feasible and self.on_infeasible == "raise":
            report = self._report(prepared, Measurement(ttft_s=None, total_s=0.0), params, sent=False)
            raise InfeasibleBudgetError(
                f"TTFT budget {budget:.3f} s cannot be met: the minimal prompt is predicted at {predicted:.3f} s",
                plan=plan,
                report=report,
            )
        return prepared

    def _safety_margin(self) -> float:
        """The share of the budget held back: learned from this host when the engine tracks it."""
        margin = getattr(self, "safety_margin", None)
        return float(margin) if isinstance(margin, (int, float)) else float(self.profile.safety_margin)

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

    def _strategies_for(self, messages: Sequence[Mapping[str, Any]]) -> Any:
        """The default chain, plus :class:`~trimkit.strategies.keep_cached_cut` when the previous
        request dropped turns and this conversation still has a turn starting at that cut."""
        if self.strategies is not None or self._cut_marker is None:
            return self.strategies
        from trimkit.strategies import default_strategies

        role, text = self._cut_marker
        for j, m in enumerate(messages):
            if m.get("role") == role and message_text(m) == text and j > 0:
                return default_strategies(keep_cut=j)
        return None

    def _remember_cut(self, messages: Sequence[Mapping[str, Any]], plan: Any) -> None:
        removed = set(getattr(plan, "removed_message_indices", ()) or ())
        if not removed:
            self._cut_marker = None
            return
        for i in range(max(removed) + 1, len(messages)):
            if i not in removed and messages[i].get("role") not in ("system", "developer"):
                self._cut_marker = (messages[i].get("role"), message_text(messages[i]))
                return
        self._cut_marker = None

    def _model_label(self, params: Mapping[str, Any]) -> str:
        """The model as a person names it, for the report (the GGUF file name in-process).

        Computed once: the profile key hashes part of the model file."""
        if self._model_name is None:
            model = self.backend.profile_key().model
            self._model_name = model.split(":")[0] if self.backend.name == "llama_cpp" else model
        return self._model_name

    def _persist(self) -> None:
        """Store the refined profile (drift, refits) so the next process starts from it."""
        from trimkit.profile import save_profile

        try:
            save_profile(self.profile)
        except OSError as exc:  # a read-only cache must not break requests
            log.warning("trimkit: could not store the refined profile: %s", exc)

    # -- sending --------------------------------------------------------------------------------
    def execute(self, prepared: Prepared, params: Mapping[str, Any]) -> ReportingStream:
        """Send a prepared request; returns a stream of the engine's chunks that reports when done.

        An in-process engine is taken here, for the stream (restoring a snapshot and starting
        the stream are one step); the stream gives it back when it is finished, closed or
        garbage-collected, from any thread. While another request holds it this waits at most
        the request's TTFT budget (without one, the backend's ``engine_wait_s``), then raises
        :class:`~trimkit.errors.EngineBusyError`. The wait is reported (``measurement.queue_s``
        and a warning), never counted in the measured TTFT."""
        hold_engine = getattr(self.backend, "hold_engine", None)
        section = hold_engine(prepared.budget_s) if hold_engine is not None else contextlib.nullcontext(0.0)
        with section as waited:
            if prepared.snapshot is not None:
                restore = getattr(self.backend, "restore_prefix")
                restore(prepared.snapshot)
            send_params = {k: v for k, v in params.items() if k != "stream"}
            ts = self.backend.send(prepared.messages, send_params, prompt_tokens=prepared.prompt_tokens)
        if waited:
            ts.queue_s = getattr(ts, "queue_s", 0.0) + waited
            if waited >= 0.001:
                note = f"waited {waited:.3f} s for the engine (another request held it); not counted in the measured TTFT"
                prepared = attrs.evolve(prepared, warnings=(*prepared.warnings, note))
        self._last_prepared = prepared
        return ReportingStream(ts, self, prepared, params)

    def _report(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any], *, sent: bool = True) -> Report:
        plan = prepared.plan
        warnings = list(prepared.warnings)
        if plan is not None and not plan.feasible:
            warnings.append("budget infeasible: sent the minimal prompt (system + last user message)")
        if not sent:
            warnings.append("not sent")
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
            model=self._model_label(params),
            # the margin the plan held back (the plan records what it was given)
            safety_margin=getattr(plan, "safety_margin", None) if plan is not None and prepared.budget_s is not None else None,
        )

    def _finished(self, prepared: Prepared, m: Measurement, params: Mapping[str, Any]) -> Report:
        report = self._report(prepared, m, params)
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
        self._after_response(prepared)
        return report

    # -- summaries off the critical path ----------------------------------------------------------
    def _after_response(self, prepared: Prepared) -> None:
        if self.summarizer is None or not self.background_summaries:
            return
        job = self._summary_job(prepared)
        if job is None:
            return
        t = threading.Thread(target=self._run_job, args=(job,), name="trimkit-summary", daemon=True)
        with self._lock:
            self._summary_threads = [x for x in self._summary_threads if x.is_alive()]
            if self._summary_threads:  # one at a time; the next response schedules the next one
                return
            self._summary_threads.append(t)
        t.start()

    def _summary_job(self, prepared: Prepared) -> Callable[[], Any] | None:
        from trimkit.summarize import next_summary_job

        if prepared.plan is None:
            return None
        return next_summary_job(prepared.plan, self.summarizer, self.summaries, count_tokens=self.backend.tokenizer)

    def _run_job(self, job: Callable[[], Any]) -> None:
        try:
            job()
        except Exception:  # a failed background summary must never break the chat
            log.exception("trimkit: background summary failed")

    def idle(self, timeout_s: float | None = None) -> None:
        """Finish pending background summaries now (call when the user is reading).

        With ``background_summaries=False`` this is where summaries are computed."""
        with self._lock:
            threads = list(self._summary_threads)
        for t in threads:
            t.join(timeout_s)
        if not self.background_summaries and self.summarizer is not None and self._last_prepared is not None:
            job = self._summary_job(self._last_prepared)
            if job is not None:
                self._run_job(job)


class _Reporting:
    """Shared by the sync and async streams: builds the report when the timed stream ends."""

    def __init__(self, ts: Any, trimmer: Trimmer, prepared: Prepared, params: Mapping[str, Any]) -> None:
        self._ts = ts
        self._trimmer = trimmer
        self.prepared = prepared
        self._params = params
        self.report: Report | None = None
        self.chunks: list[Any] = []
        # a weak link back, so that a stream dropped unfinished is freed (and frees the engine
        # it holds) as soon as its last reference goes, not at the next cyclic collection
        ref = weakref.ref(self)

        def done(m: Measurement) -> None:
            rs = ref()
            if rs is not None:
                rs._done(m)

        ts.on_done.append(done)

    def _done(self, m: Measurement) -> None:
        self.report = self._trimmer._finished(self.prepared, m, self._params)


class ReportingStream(_Reporting):
    """The stream a wrapped call returns with ``stream=True``: iterate it exactly like the
    engine's own stream; ``.report`` is set once it is exhausted.

    With an in-process engine the stream holds the engine until it is exhausted, fails, is
    closed (:meth:`close`) or is garbage-collected; any thread may do that — start it in a
    request handler, drain it in a response iterator."""

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            chunk = next(self._ts)
        except StopIteration:
            raise
        except TrimkitError as exc:
            if getattr(exc, "report", "absent") is None:
                m = Measurement(ttft_s=self._ts.ttft_s, first_output_s=self._ts.first_output_s, total_s=0.0)
                exc.report = self._trimmer._report(self.prepared, m, self._params)  # type: ignore[attr-defined]
            raise
        self.chunks.append(chunk)
        return chunk

    def close(self) -> None:
        self._ts.close()


def _assemble_completion(stream: ReportingStream, prompt_len: int) -> dict[str, Any]:
    """A non-streamed ``create_chat_completion`` response built from the stream's chunks."""
    chunks = stream.chunks
    first = chunks[0] if chunks else {}
    content: list[str] = []
    tool_calls: dict[int, dict[str, Any]] = {}
    logprobs: list[Any] = []
    finish_reason = None
    for ch in chunks:
        for choice in ch.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            for tc in delta.get("tool_calls") or []:
                slot = tool_calls.setdefault(tc.get("index", 0), {"id": tc.get("id"), "type": "function", "function": {"name": "", "arguments": ""}})
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
                if tc.get("id"):
                    slot["id"] = tc["id"]
            lp = choice.get("logprobs")
            if lp and lp.get("content"):
                logprobs.extend(lp["content"])
            if choice.get("finish_reason"):
                finish_reason = choice["finish_reason"]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = [tool_calls[k] for k in sorted(tool_calls)]
    report = stream.report
    completion_tokens = report.completion_tokens if report and report.completion_tokens is not None else len(content)
    return {
        "id": first.get("id", "chatcmpl-trimkit"),
        "object": "chat.completion",
        "created": first.get("created", int(time.time())),
        "model": first.get("model", ""),
        "choices": [{"index": 0, "message": message, "logprobs": {"content": logprobs} if logprobs else None, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens, "total_tokens": prompt_len + completion_tokens},
    }


class TrimmedLlama(Trimmer):
    """A ``llama_cpp.Llama`` whose chat calls keep TTFT inside a budget.

    ``create_chat_completion`` takes the same arguments as the original plus ``rag_chunks=``
    and a per-call ``ttft_budget_s=``; every other argument passes through unchanged, and it
    returns what llama-cpp-python returns (a dict, or an iterator of chunks with
    ``stream=True`` — that iterator also has ``.report``). Any other attribute is the wrapped
    ``Llama``'s own.
    """

    def __init__(self, llm: Any, **kwargs: Any) -> None:
        from trimkit.backends.llama import LlamaBackend

        self.llm = llm
        backend: LlamaBackend = kwargs.pop("backend", None) or LlamaBackend(llm)
        super().__init__(backend, **kwargs)
        self.backend: LlamaBackend = backend

    def __getattr__(self, name: str) -> Any:  # drop-in: everything else is the Llama's
        if name in ("llm", "backend"):
            raise AttributeError(name)
        return getattr(self.llm, name)

    def create_chat_completion(self, messages: Any = None, **kwargs: Any) -> Any:
        """Like ``Llama.create_chat_completion``, inside the TTFT budget. See the class docstring."""
        rag_chunks = kwargs.pop("rag_chunks", None)
        budget = kwargs.pop("ttft_budget_s", None)
        stream = bool(kwargs.get("stream", False))
        prepared = self.prepare(messages, rag_chunks, kwargs, ttft_budget_s=budget)
        rs = self.execute(prepared, kwargs)
        if stream:
            return rs
        for _ in rs:
            pass
        return _assemble_completion(rs, len(prepared.prompt_tokens))

    def prewarm(self, messages: Any, *, keep: bool = True) -> Any:
        """Prefill a known, stable prefix (system prompt, pinned documents) off the critical path.

        The rendered ``messages`` (without the generation prompt's last tokens) are evaluated
        into the KV cache; with ``keep`` their KV state (not the logits) is also stored, so a
        later conversation that starts with the same prefix restores it instead of prefilling
        it again — the restore time is counted in predictions. Returns the snapshot (or None).
        """
        validate_messages(messages)
        tokens = self.backend.tokenizer.prompt_tokens(messages)
        prefix = tokens[: max(len(tokens) - 1, 1)]
        if keep:
            return self.backend.save_prefix(prefix)
        self.backend.prefill(prefix)
        return None


def wrap(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> Any:
    """Wrap the client you already use so that each chat request meets a TTFT budget.

    ``client`` is a ``llama_cpp.Llama`` (returns a :class:`TrimmedLlama`, a drop-in for its
    chat API) or an OpenAI-style client with ``.chat.completions.create`` (returns a drop-in
    for that). ``kwargs``:

    - ``strategies``: what the planner may change (default: reuse the cached prefix, drop or
      excerpt chunks, use a ready summary, drop old turns; the previous request's cut too);
    - ``values``: a :class:`~trimkit.values.ValueModel` weighing chunks against history;
    - ``on_infeasible``: ``"best_effort"`` (send the minimal prompt, say so) or ``"raise"``;
    - ``profile``: else the stored one for this model and settings, or a quick calibration now;
    - ``summarizer``: computes summaries of older turns *after* each response, in a background
      thread (``background_summaries=False``: on :meth:`Trimmer.idle`); the planner may put a
      ready one in their place on a later turn. Default ``"extractive"``
      (:class:`~trimkit.summarize.ExtractiveSummarizer`, model-free, milliseconds);
      ``None`` turns summaries off;
    - ``attainment_target``: the share of budgeted requests the learned safety margin aims to
      keep inside the budget (default 0.97);
    - ``rag_template``, ``rag_chunk_template``, ``clock``.
    """
    try:
        from llama_cpp import Llama
    except ImportError:  # pragma: no cover
        Llama = None  # type: ignore[assignment]
    if Llama is not None and isinstance(client, Llama):
        return TrimmedLlama(client, ttft_budget_s=ttft_budget_s, **kwargs)
    if isinstance(client, Backend):
        return Trimmer(client, ttft_budget_s=ttft_budget_s, **kwargs)
    chat = getattr(client, "chat", None)
    if chat is not None and hasattr(getattr(chat, "completions", None), "create"):
        from trimkit.openai_wrapper import wrap_openai

        return wrap_openai(client, ttft_budget_s=ttft_budget_s, **kwargs)
    raise InvalidInputError(
        f"cannot wrap {type(client).__name__}: pass a llama_cpp.Llama or an OpenAI-style client (with .chat.completions.create)"
    )

