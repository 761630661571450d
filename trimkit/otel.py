"""OpenTelemetry traces and metrics of every wrapped request (``pip install 'trimkit[otel]'``).

``trimkit.otel.instrument()`` (or ``instrument(tracer_provider=tp, meter_provider=mp)``) after your own set-up;
trimkit never installs a global provider. Each request becomes a span ``chat {model}`` with children
``trimkit.plan``, ``trimkit.replan`` and ``trimkit.send``; names follow the GenAI semantic conventions
(:data:`SEMCONV_VERSION`), listed in docs/observability.md. No prompt or answer text is ever set.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from trimkit import report
from trimkit.report import Completed, Figures, add_observer, figures, remove_observer

__all__ = ["Instrumentation", "instrument", "SEMCONV_VERSION", "GENAI_DURATION_BUCKETS_S", "GENAI_TOKEN_BUCKETS"]

#: the GenAI semantic conventions the names follow
SEMCONV_VERSION = "1.41.1"
#: the buckets the conventions give for ``gen_ai.client.operation.duration`` and ``…time_to_first_chunk``
GENAI_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
#: the buckets the conventions give for ``gen_ai.client.token.usage``
GENAI_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


def _set(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """``attributes`` less those that are None (OpenTelemetry refuses None)."""
    return {k: v for k, v in attributes.items() if v is not None}


class Instrumentation:
    """The observer :func:`instrument` installs; :meth:`uninstrument` removes it."""

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        try:
            ours = version("trimkit")
        except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
            ours = "0"
        self.tracer = trace.get_tracer("trimkit", ours, tracer_provider=tracer_provider, schema_url=None)
        meter = metrics.get_meter("trimkit", ours, meter_provider=meter_provider)

        def hist(name: str, unit: str, description: str, buckets: tuple[float, ...]) -> Any:
            return meter.create_histogram(name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets)

        self.duration = hist("gen_ai.client.operation.duration", "s", "GenAI operation duration.", GENAI_DURATION_BUCKETS_S)
        self.token_usage = hist("gen_ai.client.token.usage", "{token}", "Number of input and output tokens used.", GENAI_TOKEN_BUCKETS)
        self.first_chunk = hist("gen_ai.client.operation.time_to_first_chunk", "s", "Time to receive the first chunk of a streamed response.",
                                GENAI_DURATION_BUCKETS_S)
        self.ttft = hist("trimkit.ttft", "s", "Measured time to first token (the wait for the engine included).", report.TTFT_BUCKETS_S)
        self.budget_use = hist("trimkit.budget.use", "1", "Measured TTFT divided by the TTFT budget.", report.BUDGET_USE_BUCKETS)
        self.prediction_error = hist("trimkit.prediction.error", "1", "|predicted - measured| / measured TTFT; trimkit.prediction.direction: over or under.",
                                     report.PREDICTION_ERROR_BUCKETS)
        self.decode_speed = hist("trimkit.decode.speed", "{token}/s", "Measured decode speed (left untouched).", report.DECODE_SPEED_BUCKETS)
        self.attainment = meter.create_counter("trimkit.budget.attainment", unit="{request}",
                                               description="Budgeted requests, by whether the measured TTFT met the budget.")
        self.tokens_removed = meter.create_counter("trimkit.tokens.removed", unit="{token}", description="Prompt tokens the plan removed (before minus sent).")
        self.replans = meter.create_counter("trimkit.replans", unit="{replan}", description="Re-plans of watched prefills.")
        self.requests = meter.create_counter("trimkit.requests", unit="{request}", description="Requests, by outcome.")

    def uninstrument(self) -> None:
        """Stop exporting (the providers stay as they are)."""
        remove_observer(self)

    def __call__(self, c: Completed) -> None:
        f = figures(c)
        base = _set({"gen_ai.operation.name": "chat", "gen_ai.provider.name": c.report.backend, "gen_ai.request.model": f.model or None,
                     "server.address": f.server_address, "server.port": f.server_port if f.server_address else None, "error.type": c.error_type})
        self._spans(c, f, base)
        self._metrics(c, f, base)

    def _spans(self, c: Completed, f: Figures, base: Mapping[str, Any]) -> None:
        r, m = c.report, c.report.measurement
        end = c.ended_ns
        send_start = end - int(((m.total_s or 0.0) + (m.queue_s or 0.0)) * 1e9)
        plan_start = send_start - int(max(c.prepare_s, 0.0) * 1e9)
        kind = SpanKind.INTERNAL if r.backend == "llama_cpp" else SpanKind.CLIENT
        root = self.tracer.start_span(f"chat {f.model}" if f.model else "chat", kind=kind, start_time=plan_start,
                                      attributes={**base, **_request_attributes(c, f)})
        if c.error_type is not None:
            root.set_status(Status(StatusCode.ERROR))
        ctx = trace.set_span_in_context(root)
        plan = self.tracer.start_span("trimkit.plan", context=ctx, start_time=plan_start, attributes=_set({
            "trimkit.strategies": [str(getattr(x, "strategy", "")) for x in r.actions], "trimkit.tokens.before": f.tokens_before,
            "trimkit.tokens.after": r.prompt_tokens, "trimkit.ttft.predicted_s": r.predicted_ttft_s, "trimkit.planning_s": r.planning_s}))
        plan.end(end_time=send_start)
        if "not sent" not in r.warnings:
            send = self.tracer.start_span("trimkit.send", context=ctx, start_time=send_start, attributes=_set({
                "trimkit.tokens.after": r.prompt_tokens, "trimkit.replans": len(r.replans), "trimkit.queue.wait_s": r.queue_wait_s,
                "trimkit.ttft.measured_s": r.measured_ttft_s}))
            send_ctx = trace.set_span_in_context(send)
            for i, p in enumerate(r.replans, 1):
                at = min(send_start + int(p.elapsed_s * 1e9), end)
                span = self.tracer.start_span("trimkit.replan", context=send_ctx, start_time=at, attributes={
                    "trimkit.replan.index": i, "trimkit.replan.evaluated_tokens": p.evaluated_tokens,
                    "trimkit.replan.prompt_tokens_before": p.prompt_tokens, "trimkit.replan.prompt_tokens_after": p.prompt_tokens_after,
                    "trimkit.replan.pace": p.pace, "trimkit.replan.elapsed_s": p.elapsed_s, "trimkit.replan.projected_ttft_s": p.projected_ttft_s,
                    "trimkit.replan.predicted_ttft_before_s": p.predicted_ttft_before_s, "trimkit.replan.predicted_ttft_after_s": p.predicted_ttft_after_s,
                    "trimkit.replan.removed_chunk_ids": [d for d in p.dropped if not d.startswith(("+", "message "))],
                    "trimkit.replan.restored_chunk_ids": [d[1:] for d in p.dropped if d.startswith("+")],
                })
                span.end(end_time=at)
            if c.error_type is not None:
                send.set_status(Status(StatusCode.ERROR))
                send.set_attribute("error.type", c.error_type)
            send.end(end_time=end)
        root.end(end_time=end)

    def _metrics(self, c: Completed, f: Figures, base: Mapping[str, Any]) -> None:
        r = c.report
        if "not sent" not in r.warnings:
            self.duration.record((r.measurement.total_s or 0.0) + (r.measurement.queue_s or 0.0) + c.prepare_s, base)
            self.token_usage.record(r.prompt_tokens, {**base, "gen_ai.token.type": "input"})
            if r.completion_tokens is not None:
                self.token_usage.record(r.completion_tokens, {**base, "gen_ai.token.type": "output"})
            if r.measured_ttft_s is not None and r.decode_params.get("stream"):
                self.first_chunk.record(r.measured_ttft_s, base)
        own = {k: v for k, v in base.items() if k != "error.type"}
        if r.endpoint:
            own["trimkit.endpoint"] = r.endpoint
        self.requests.add(1, {**own, "trimkit.outcome": f.outcome})
        if r.measured_ttft_s is not None:
            self.ttft.record(r.measured_ttft_s, own)
        if r.budget_met is not None:
            self.attainment.add(1, {**own, "trimkit.budget.met": r.budget_met})
        if f.budget_use is not None:
            self.budget_use.record(f.budget_use, own)
        if f.prediction_error is not None:
            self.prediction_error.record(f.prediction_error, {**own, "trimkit.prediction.direction": f.prediction_direction})
        if f.tokens_removed:
            self.tokens_removed.add(f.tokens_removed, own)
        if r.decode_tokens_per_s is not None:
            self.decode_speed.record(r.decode_tokens_per_s, own)
        if r.replans:
            self.replans.add(len(r.replans), own)


def _request_attributes(c: Completed, f: Figures) -> dict[str, Any]:
    """The request span's own attributes: the GenAI usage figures and trimkit's."""
    r, p = c.report, c.report.decode_params
    a: dict[str, Any] = {
        "gen_ai.usage.input_tokens": r.prompt_tokens, "gen_ai.usage.output_tokens": r.completion_tokens, "gen_ai.usage.cache_read.input_tokens": r.cached_tokens,
        "gen_ai.response.time_to_first_chunk": r.measured_ttft_s, "gen_ai.request.stream": p.get("stream") if isinstance(p.get("stream"), bool) else None,
    }
    for key in ("max_tokens", "temperature", "top_p", "seed"):
        value = p.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            a[f"gen_ai.request.{key}"] = value
    a.update({
        "trimkit.budget_s": r.ttft_budget_s, "trimkit.ttft.predicted_s": r.predicted_ttft_s, "trimkit.ttft.predicted_before_s": r.predicted_ttft_before_s,
        "trimkit.ttft.measured_s": r.measured_ttft_s, "trimkit.ttft.engine_s": r.engine_ttft_s, "trimkit.queue.wait_s": r.queue_wait_s,
        "trimkit.safety_margin": r.safety_margin, "trimkit.budget.met": r.budget_met, "trimkit.feasible": r.feasible, "trimkit.verdict": r.verdict,
        "trimkit.endpoint": r.endpoint, "trimkit.decode.tokens_per_s": r.decode_tokens_per_s, "trimkit.outcome": f.outcome,
        "trimkit.trimmed": r.trimmed, "trimkit.watched": r.watched, "trimkit.replans": len(r.replans), "trimkit.tokens.before": f.tokens_before,
        "trimkit.tokens.after": r.prompt_tokens, "trimkit.tokens.removed": f.tokens_removed, "trimkit.tokens.cached_predicted": r.cached_tokens_predicted,
        "trimkit.history.compacted": bool(f.summarized_messages), "trimkit.removed.messages.count": len(f.removed_messages),
        "trimkit.removed.messages.indices": list(f.removed_messages), "trimkit.summarized.messages.count": len(f.summarized_messages),
        "trimkit.removed.chunks.count": len(f.removed_chunks), "trimkit.removed.chunks.ids": list(f.removed_chunks), "trimkit.provisional": r.provisional,
    })
    return _set(a)


def instrument(tracer_provider: Any = None, meter_provider: Any = None) -> Instrumentation:
    """Export every wrapped request of this process to OpenTelemetry (None providers: the global API's).
    ``.uninstrument()`` on the result stops it; calling this again adds a second exporter."""
    inst = Instrumentation(tracer_provider, meter_provider)
    add_observer(inst)
    return inst
