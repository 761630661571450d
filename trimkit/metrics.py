"""Prometheus metrics of every wrapped request, without OpenTelemetry (``pip install 'trimkit[prometheus]'``).

``trimkit.metrics.enable()`` (or ``enable(registry=...)``), then serve the registry, e.g.
``prometheus_client.start_http_server(9464)``. The series are listed in docs/observability.md.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from trimkit.report import BUDGET_USE_BUCKETS, DECODE_SPEED_BUCKETS, PREDICTION_ERROR_BUCKETS, TTFT_BUCKETS_S, Completed, add_observer, figures, remove_observer

__all__ = ["PrometheusMetrics", "enable"]

_LABELS = ("model", "endpoint")


class PrometheusMetrics:
    """trimkit's series in ``registry`` (default: prometheus-client's global one); :meth:`disable` unregisters them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = REGISTRY if registry is None else registry

        def hist(name: str, doc: str, buckets: tuple[float, ...], *extra: str) -> Histogram:
            return Histogram(name, doc, (*_LABELS, *extra), buckets=buckets, registry=r)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, (*_LABELS, *extra), registry=r)

        self.ttft = hist("trimkit_ttft_seconds", "Measured time to first token (the wait for the engine included).", TTFT_BUCKETS_S)
        self.predicted_ttft = hist("trimkit_predicted_ttft_seconds", "Predicted time to first token of the prompt sent.", TTFT_BUCKETS_S)
        self.budget_use = hist("trimkit_budget_use_ratio", "Measured TTFT divided by the TTFT budget.", BUDGET_USE_BUCKETS)
        self.prediction_error = hist("trimkit_prediction_error_ratio", "|predicted - measured| / measured TTFT, by direction.",
                                     PREDICTION_ERROR_BUCKETS, "direction")
        self.decode_speed = hist("trimkit_decode_tokens_per_second", "Measured decode speed (left untouched).", DECODE_SPEED_BUCKETS)
        self.attainment = counter("trimkit_budget_attainment", "Budgeted requests, by whether the measured TTFT met the budget.", "met")
        self.tokens_removed = counter("trimkit_tokens_removed", "Prompt tokens the plan removed (before minus sent).")
        self.replans = counter("trimkit_replans", "Re-plans of watched prefills.")
        self.requests = counter("trimkit_requests", "Requests, by outcome.", "outcome")
        self._collectors = (self.ttft, self.predicted_ttft, self.budget_use, self.prediction_error, self.decode_speed, self.attainment,
                            self.tokens_removed, self.replans, self.requests)

    def __call__(self, c: Completed) -> None:
        f, r = figures(c), c.report
        labels = {"model": f.model, "endpoint": r.endpoint or ""}
        self.requests.labels(**labels, outcome=f.outcome).inc()
        if r.measured_ttft_s is not None:
            self.ttft.labels(**labels).observe(r.measured_ttft_s)
        if r.predicted_ttft_s is not None and "not sent" not in r.warnings:
            self.predicted_ttft.labels(**labels).observe(r.predicted_ttft_s)
        if r.budget_met is not None:
            self.attainment.labels(**labels, met=str(r.budget_met).lower()).inc()
        if f.budget_use is not None:
            self.budget_use.labels(**labels).observe(f.budget_use)
        if f.prediction_error is not None:
            self.prediction_error.labels(**labels, direction=f.prediction_direction).observe(f.prediction_error)
        if r.decode_tokens_per_s is not None:
            self.decode_speed.labels(**labels).observe(r.decode_tokens_per_s)
        self.tokens_removed.labels(**labels).inc(f.tokens_removed)
        self.replans.labels(**labels).inc(len(r.replans))

    def disable(self) -> None:
        remove_observer(self)
        for collector in self._collectors:
            self.registry.unregister(collector)


def enable(registry: Any = None) -> PrometheusMetrics:
    """Record every wrapped request of this process in ``registry``; ``.disable()`` on the result stops it."""
    m = PrometheusMetrics(registry)
    add_observer(m)
    return m
