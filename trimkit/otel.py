"""OpenTelemetry traces and metrics of every wrapped request (``pip install 'trimkit[otel]'``).

One line of set-up, after your own OpenTelemetry set-up (or none: the global API's providers,
whatever you installed, are used; trimkit never installs a global provider)::

    import trimkit.otel
    trimkit.otel.instrument()          # or instrument(tracer_provider=tp, meter_provider=mp)

Each request becomes a span ``chat {model}`` with children ``trimkit.plan``, ``trimkit.replan``
(one per re-plan) and ``trimkit.send``, written when its report is complete, with the times it
measured. Names follow the OpenTelemetry GenAI semantic conventions (:data:`SEMCONV_VERSION`); the
spans, attributes and metrics are listed in docs/observability.md. No prompt or answer text is
ever set: removed content is given as counts and ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from trimkit.report import (
    BUDGET_USE_BUCKETS,
    DECODE_SPEED_BUCKETS,
    PREDICTION_ERROR_BUCKETS,
    TTFT_BUCKETS_S,
    Completed,
    Figures,
    add_observer,
    figures,
    remove_observer,
)

__all__ = ["Instrumentation", "instrument", "SEMCONV_VERSION", "GENAI_DURATION_BUCKETS_S", "GENAI_TOKEN_BUCKETS"]

#: the GenAI semantic conventions the names follow
SEMCONV_VERSION = "1.41.1"
#: the buckets the conventions give for ``gen_ai.client.operation.duration`` and ``…time_to_first_chunk``
GENAI_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
#: the buckets the conventions give for ``gen_ai.client.token.usage``
GENAI_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)

_SCOPE = "trimkit"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trimkit")
    except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "0"


def _put(attributes: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        attributes[name] = value


class Instrumentation:
    """The observer :func:`instrument` installs; :meth:`uninstrument` removes it."""

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        version = _version()
        self.tracer = trace.get_tracer(_SCOPE, version, tracer_provider=tracer_provider, schema_url=None)
        meter = metrics.get_meter(_SCOPE, version, meter_provider=meter_provider)
        hist = meter.create_histogram
        self.duration = hist("gen_ai.client.operation.duration", unit="s", description="GenAI operation duration.",
                             explicit_bucket_boundaries_advisory=GENAI_DURATION_BUCKETS_S)
        self.token_usage = hist("gen_ai.client.token.usage", unit="{token}", description="Number of input and output tokens used.",
                                explicit_bucket_boundaries_advisory=GENAI_TOKEN_BUCKETS)
        self.first_chunk = hist("gen_ai.client.operation.time_to_first_chunk", unit="s",
                                description="Time to receive the first chunk of a streamed response.",
                                explicit_bucket_boundaries_advisory=GENAI_DURATION_BUCKETS_S)
        self.ttft = hist("trimkit.ttft", unit="s", description="Measured time to first token (the wait for the engine included).",
                         explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S)
        self.budget_use = hist("trimkit.budget.use", unit="1", description="Measured TTFT divided by the TTFT budget.",
                               explicit_bucket_boundaries_advisory=BUDGET_USE_BUCKETS)
        self.prediction_error = hist("trimkit.prediction.error", unit="1", description="|predicted - measured| / measured TTFT; trimkit.prediction.direction: over or under.",
                                     explicit_bucket_boundaries_advisory=PREDICTION_ERROR_BUCKETS)
        self.decode_speed = hist("trimkit.decode.speed", unit="{token}/s", description="Measured decode speed (left untouched).",
                                 explicit_bucket_boundaries_advisory=DECODE_SPEED_BUCKETS)
        self.attainment = meter.create_counter("trimkit.budget.attainment", unit="{request}",
                                               description="Budgeted requests, by whether the measured TTFT met the budget.")
        self.tokens_removed = meter.create_counter("trimkit.tokens.removed", unit="{token}",
                                                   description="Prompt tokens the plan removed (before minus sent).")
        self.replans = meter.create_counter("trimkit.replans", unit="{replan}", description="Re-plans of watched prefills.")
        self.requests = meter.create_counter("trimkit.requests", unit="{request}", description="Requests, by outcome.")

    def uninstrument(self) -> None:
        """Stop exporting (the providers stay as they are)."""
        remove_observer(self)

    def __call__(self, c: Completed) -> None:
        f = figures(c)
        base = _base_attributes(c, f)
        self._spans(c, f, base)
        self._metrics(c, f, base)

    # -- traces ---------------------------------------------------------------------------------
    def _spans(self, c: Completed, f: Figures, base: Mapping[str, Any]) -> None:
        r, m = c.report, c.report.measurement
        end = c.ended_ns
        send_ns = int(((m.total_s or 0.0) + (m.queue_s or 0.0)) * 1e9)
        send_start = end - send_ns
        plan_start = send_start - int(max(c.prepare_s, 0.0) * 1e9)
        kind = SpanKind.INTERNAL if r.backend == "llama_cpp" else SpanKind.CLIENT
        root = self.tracer.start_span(f"chat {f.model}" if f.model else "chat", kind=kind, start_time=plan_start,
                                      attributes={**base, **_request_attributes(c, f)})
        if c.error_type is not None:
            root.set_status(Status(StatusCode.ERROR))
        ctx = trace.set_span_in_context(root)
        plan = self.tracer.start_span("trimkit.plan", context=ctx, start_time=plan_start, attributes=_plan_attributes(r, f))
        plan.end(end_time=send_start)
        if "not sent" not in r.warnings:
            send = self.tracer.start_span("trimkit.send", context=ctx, start_time=send_start, attributes=_send_attributes(r, f))
            send_ctx = trace.set_span_in_context(send)
            for i, p in enumerate(r.replans, 1):
                at = min(send_start + int(p.elapsed_s * 1e9), end)
                span = self.tracer.start_span("trimkit.replan", context=send_ctx, start_time=at, attributes={
                    "trimkit.replan.index": i, "trimkit.replan.evaluated_tokens": p.evaluated_tokens,
                    "trimkit.replan.prompt_tokens_before": p.prompt_tokens, "trimkit.replan.prompt_tokens_after": p.prompt_tokens_after,
                    "trimkit.replan.pace": p.pace, "trimkit.replan.elapsed_s": p.elapsed_s,
                    "trimkit.replan.projected_ttft_s": p.projected_ttft_s,
                    "trimkit.replan.predicted_ttft_before_s": p.predicted_ttft_before_s,
                    "trimkit.replan.predicted_ttft_after_s": p.predicted_ttft_after_s,
                    "trimkit.replan.removed_chunk_ids": [d for d in p.dropped if not d.startswith(("+", "message "))],
                    "trimkit.replan.restored_chunk_ids": [d[1:] for d in p.dropped if d.startswith("+")],
                })
                span.end(end_time=at)
            if c.error_type is not None:
                send.set_status(Status(StatusCode.ERROR))
                send.set_attribute("error.type", c.error_type)
            send.end(end_time=end)
        root.end(end_time=end)

    # -- metrics --------------------------------------------------------------------------------
    def _metrics(self, c: Completed, f: Figures, base: Mapping[str, Any]) -> None:
        sent = "not sent" not in c.report.warnings
        if sent:
            duration = (c.report.measurement.total_s or 0.0) + (c.report.measurement.queue_s or 0.0) + c.prepare_s
            self.duration.record(duration, base)
            self.token_usage.record(f.input_tokens, {**base, "gen_ai.token.type": "input"})
            if f.output_tokens is not None:
                self.token_usage.record(f.output_tokens, {**base, "gen_ai.token.type": "output"})
            if f.ttft_s is not None and c.report.decode_params.get("stream"):
                self.first_chunk.record(f.ttft_s, base)
        own = {k: v for k, v in base.items() if k != "error.type"}
        if c.report.endpoint:
            own["trimkit.endpoint"] = c.report.endpoint
        self.requests.add(1, {**own, "trimkit.outcome": f.outcome})
        if f.ttft_s is not None:
            self.ttft.record(f.ttft_s, own)
        if f.budget_met is not None:
            self.attainment.add(1, {**own, "trimkit.budget.met": f.budget_met})
        if f.budget_use is not None:
            self.budget_use.record(f.budget_use, own)
        if f.prediction_error is not None:
            self.prediction_error.record(f.prediction_error, {**own, "trimkit.prediction.direction": f.prediction_direction})
        if f.tokens_removed:
            self.tokens_removed.add(f.tokens_removed, own)
        if f.decode_tokens_per_s is not None:
            self.decode_speed.record(f.decode_tokens_per_s, own)
        if f.replans:
            self.replans.add(f.replans, own)


def _base_attributes(c: Completed, f: Figures) -> dict[str, Any]:
    """The GenAI attributes every span and metric of a request carries."""
    a: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": c.report.backend}
    _put(a, "gen_ai.request.model", f.model or None)
    _put(a, "server.address", f.server_address)
    _put(a, "server.port", f.server_port if f.server_address else None)
    _put(a, "error.type", c.error_type)
    return a


def _request_attributes(c: Completed, f: Figures) -> dict[str, Any]:
    """The request span's own attributes: the GenAI usage figures and trimkit's."""
    r = c.report
    p = r.decode_params
    a: dict[str, Any] = {"gen_ai.usage.input_tokens": f.input_tokens}
    _put(a, "gen_ai.usage.output_tokens", f.output_tokens)
    _put(a, "gen_ai.usage.cache_read.input_tokens", f.cached_tokens)
    _put(a, "gen_ai.response.time_to_first_chunk", f.ttft_s)
    _put(a, "gen_ai.request.stream", p.get("stream") if isinstance(p.get("stream"), bool) else None)
    for key in ("max_tokens", "temperature", "top_p", "seed"):
        value = p.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            a[f"gen_ai.request.{key}"] = value
    optional = {
        "trimkit.budget_s": f.budget_s, "trimkit.ttft.predicted_s": f.predicted_ttft_s,
        "trimkit.ttft.predicted_before_s": r.predicted_ttft_before_s, "trimkit.ttft.measured_s": f.ttft_s,
        "trimkit.ttft.engine_s": r.engine_ttft_s, "trimkit.queue.wait_s": r.queue_wait_s, "trimkit.safety_margin": r.safety_margin,
        "trimkit.budget.met": f.budget_met, "trimkit.feasible": r.feasible, "trimkit.verdict": r.verdict,
        "trimkit.endpoint": r.endpoint, "trimkit.decode.tokens_per_s": f.decode_tokens_per_s,
    }
    a.update({k: v for k, v in optional.items() if v is not None})
    a.update({
        "trimkit.outcome": f.outcome,
        "trimkit.trimmed": r.trimmed,
        "trimkit.watched": r.watched,
        "trimkit.replans": f.replans,
        "trimkit.tokens.before": f.input_tokens_before if f.input_tokens_before is not None else f.input_tokens,
        "trimkit.tokens.after": f.input_tokens,
        "trimkit.tokens.removed": f.tokens_removed,
        "trimkit.tokens.cached_predicted": r.cached_tokens_predicted,
        "trimkit.history.compacted": bool(f.summarized_messages),
        "trimkit.removed.messages.count": len(f.removed_messages),
        "trimkit.removed.messages.indices": list(f.removed_messages),
        "trimkit.summarized.messages.count": len(f.summarized_messages),
        "trimkit.removed.chunks.count": len(f.removed_chunks),
        "trimkit.removed.chunks.ids": list(f.removed_chunks),
        "trimkit.provisional": r.provisional,
    })
    return a


def _plan_attributes(r: Any, f: Figures) -> dict[str, Any]:
    a: dict[str, Any] = {"trimkit.strategies": [str(getattr(x, "strategy", "")) for x in r.actions],
                         "trimkit.tokens.before": f.input_tokens_before if f.input_tokens_before is not None else f.input_tokens,
                         "trimkit.tokens.after": f.input_tokens}
    _put(a, "trimkit.ttft.predicted_s", f.predicted_ttft_s)
    _put(a, "trimkit.planning_s", r.planning_s)
    return a


def _send_attributes(r: Any, f: Figures) -> dict[str, Any]:
    a: dict[str, Any] = {"trimkit.tokens.after": f.input_tokens, "trimkit.replans": f.replans, "trimkit.queue.wait_s": r.queue_wait_s}
    _put(a, "trimkit.ttft.measured_s", f.ttft_s)
    return a


def instrument(tracer_provider: Any = None, meter_provider: Any = None) -> Instrumentation:
    """Export every wrapped request of this process to OpenTelemetry: a span per request and the
    metrics of docs/observability.md, through ``tracer_provider`` / ``meter_provider`` (None: the
    global API's — whatever you installed; trimkit installs none). Returns the instrumentation;
    ``.uninstrument()`` stops it. Calling it again adds a second exporter (call it once)."""
    inst = Instrumentation(tracer_provider, meter_provider)
    add_observer(inst)
    return inst
