"""OpenTelemetry, Prometheus and the report log (trimkit.otel, trimkit.metrics, trimkit.report),
with the real OpenTelemetry SDK (in-memory span exporter and metric reader), the real
prometheus-client registry, the real embedded engine in process, the real llama.cpp server on
loopback (a fleet) and the scripted fault server (a stream broken mid-way)."""

from __future__ import annotations

import copy
import io
import json
import logging
import subprocess
import sys

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest

import trimkit
import trimkit.metrics
import trimkit.otel
from tests.test_server_faults import chunk, reset, sse_reply
from trimkit.cli import load_corpus, load_history
from trimkit.errors import InfeasibleBudgetError, InvalidInputError, StreamInterruptedError
from trimkit.report import TTFT_BUCKETS_S

SYSTEM = {"role": "system", "content": "You answer questions about the town of Marrowby briefly."}
SECRET = "zanzibar-quokka-7731"  # in every prompt: must appear in no span, metric or log line


@pytest.fixture
def otel(caplog):
    """trimkit instrumented with SDK providers of the test's own (no global provider is set); the
    SDK must not have refused anything (it logs a warning, e.g. for a negative histogram value)."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    inst = trimkit.otel.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    yield spans, reader
    inst.uninstrument()
    refused = [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING]
    assert refused == []


@pytest.fixture
def prom():
    registry = CollectorRegistry()
    m = trimkit.metrics.enable(registry=registry)
    yield registry
    m.disable()


def ask(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"{question} (ref {SECRET})"}]


def long_request() -> tuple[list[dict], list[trimkit.Chunk]]:
    chunks = [trimkit.Chunk(text=d["text"] + f" {SECRET}", id=d["id"]) for d in load_corpus()[:12]]
    return [SYSTEM, *load_history(), {"role": "user", "content": f"When was the lighthouse first lit? {SECRET}"}], chunks


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def metric_points(reader) -> dict:
    """name → (unit, data points) of everything trimkit's meter recorded."""
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            assert sm.scope.name == "trimkit"
            for m in sm.metrics:
                out[m.name] = (m.unit, list(m.data.data_points))
    return out


def assert_no_text(spans, *texts):
    for s in spans:
        blob = json.dumps({"name": s.name, "attributes": dict(s.attributes), "events": [dict(e.attributes) for e in s.events]}, default=str)
        for t in texts:
            assert t not in blob


def test_import_trimkit_imports_neither_exporter_library():
    code = "import sys, trimkit; print(sorted(m for m in sys.modules if m.split('.')[0] in ('opentelemetry', 'prometheus_client')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_passthrough_request_is_one_span_tree_with_the_genai_attributes(llm, quick_profile, otel):
    spans, reader = otel
    chat = trimkit.wrap(llm, ttft_budget_s=30.0, profile=quick_profile)
    chat.create_chat_completion(messages=ask("Say hello."), max_tokens=4, temperature=0.0)
    r = chat.last_report
    got = spans.get_finished_spans()
    assert sorted(s.name for s in got) == sorted([f"chat {r.model}", "trimkit.plan", "trimkit.send"])
    root = by_name(got, f"chat {r.model}")[0]
    assert root.kind == SpanKind.INTERNAL and root.parent is None and root.status.status_code == StatusCode.UNSET
    for child in (by_name(got, "trimkit.plan")[0], by_name(got, "trimkit.send")[0]):
        assert child.parent.span_id == root.context.span_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "llama_cpp" and a["gen_ai.request.model"] == r.model
    assert a["gen_ai.usage.input_tokens"] == r.prompt_tokens and a["gen_ai.usage.output_tokens"] == r.completion_tokens
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(r.measured_ttft_s)
    assert a["trimkit.budget_s"] == 30.0 and a["trimkit.ttft.predicted_s"] == pytest.approx(r.predicted_ttft_s)
    assert a["trimkit.outcome"] == "passthrough" and a["trimkit.trimmed"] is False and a["trimkit.tokens.removed"] == 0
    assert a["trimkit.tokens.before"] == a["trimkit.tokens.after"] == r.prompt_tokens
    assert a["trimkit.budget.met"] is r.budget_met and a["trimkit.verdict"] == r.verdict and a["trimkit.replans"] == 0
    assert a["trimkit.safety_margin"] == pytest.approx(r.safety_margin)
    assert "error.type" not in a
    points = metric_points(reader)
    assert points["trimkit.ttft"][0] == "s" and points["gen_ai.client.operation.duration"][0] == "s"
    assert points["gen_ai.client.token.usage"][0] == "{token}"
    assert {dict(p.attributes)["gen_ai.token.type"] for p in points["gen_ai.client.token.usage"][1]} == {"input", "output"}
    ttft = points["trimkit.ttft"][1][0]
    assert tuple(ttft.explicit_bounds) == TTFT_BUCKETS_S and TTFT_BUCKETS_S[0] == 0.01 and TTFT_BUCKETS_S[-1] == 60.0
    assert ttft.count == 1 and ttft.sum == pytest.approx(r.measured_ttft_s)
    assert tuple(points["gen_ai.client.operation.duration"][1][0].explicit_bounds) == trimkit.otel.GENAI_DURATION_BUCKETS_S
    assert "gen_ai.client.operation.time_to_first_chunk" not in points  # not a streamed call (the conventions: streamed only)
    error = points["trimkit.prediction.error"][1][0]  # recorded (a histogram takes no negative value: the direction is an attribute)
    assert error.count == 1 and error.sum == pytest.approx(abs(r.ttft_error_pct) / 100)
    assert dict(error.attributes)["trimkit.prediction.direction"] == ("over" if r.ttft_error_pct > 0 else "under")
    assert points["trimkit.budget.use"][1][0].sum == pytest.approx(r.measured_ttft_s / 30.0)
    assert points["trimkit.budget.attainment"][1][0].value == 1 and points["trimkit.budget.attainment"][0] == "{request}"
    assert points["trimkit.decode.speed"][0] == "{token}/s"
    assert_no_text(got, SECRET)


def test_a_trimmed_request_says_what_was_removed_by_count_and_id_never_text(llm, quick_profile, otel, prom, tmp_path):
    spans, reader = otel
    log_path = tmp_path / "reports.jsonl"
    messages, chunks = long_request()
    # a budget from the engine's own predictions (half the request's, as cut to the context window):
    # it must trim, on any host at any load; whether the host then keeps it is not this test's business
    budget = trimkit.wrap(llm, ttft_budget_s=1e6, profile=quick_profile).prepare(messages, chunks).predicted_ttft_s / 2
    chat = trimkit.wrap(llm, ttft_budget_s=budget, profile=quick_profile, report_log=log_path)
    before = copy.deepcopy((messages, chunks))
    for _ in chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, stream=True):
        pass
    assert (messages, chunks) == before
    r = chat.last_report
    assert r.trimmed
    got = spans.get_finished_spans()
    root = by_name(got, f"chat {r.model}")[0]
    a = root.attributes
    removed_chunks = list(dict.fromkeys([c for x in r.actions for c in x.removed_chunks]
                                        + [d for p in r.replans for d in p.dropped if not d.startswith(("+", "message "))]))
    # infeasible when even the minimal prompt is predicted over the budget (a re-plan on a slow host)
    assert a["trimkit.outcome"] == ("infeasible" if r.feasible is False else "trimmed") and a["trimkit.trimmed"] is True
    assert a["trimkit.tokens.before"] == r.prompt_tokens_before > a["trimkit.tokens.after"] == r.prompt_tokens
    assert a["trimkit.tokens.removed"] == r.prompt_tokens_before - r.prompt_tokens
    assert list(a["trimkit.removed.chunks.ids"]) == removed_chunks and a["trimkit.removed.chunks.count"] == len(removed_chunks)
    assert a["trimkit.removed.messages.count"] == len({i for x in r.actions for i in x.removed_messages})
    assert a["trimkit.history.compacted"] is any(x.summarized_messages for x in r.actions)
    assert a["trimkit.replans"] == len(r.replans) and len(by_name(got, "trimkit.replan")) == len(r.replans)
    assert a["gen_ai.request.stream"] is True
    send = by_name(got, "trimkit.send")[0]
    for rp in by_name(got, "trimkit.replan"):
        assert rp.parent.span_id == send.context.span_id
    assert list(by_name(got, "trimkit.plan")[0].attributes["trimkit.strategies"]) == [x.strategy for x in r.actions]
    points = metric_points(reader)
    assert points["trimkit.tokens.removed"][1][0].value == r.prompt_tokens_before - r.prompt_tokens
    assert points["gen_ai.client.operation.time_to_first_chunk"][1][0].count == 1  # streamed
    assert_no_text(got, SECRET, load_corpus()[0]["text"][:40])
    # Prometheus, from the same request
    text = generate_latest(prom).decode()
    assert "trimkit_ttft_seconds_bucket" in text and 'le="60.0"' in text and 'le="0.01"' in text
    assert f'trimkit_budget_attainment_total{{endpoint="",met="{str(r.budget_met).lower()}",model="{r.model}"}} 1.0' in text
    assert prom.get_sample_value("trimkit_tokens_removed_total", {"model": r.model, "endpoint": ""}) == r.prompt_tokens_before - r.prompt_tokens
    assert prom.get_sample_value("trimkit_requests_total", {"model": r.model, "endpoint": "", "outcome": a["trimkit.outcome"]}) == 1.0
    assert prom.get_sample_value("trimkit_ttft_seconds_count", {"model": r.model, "endpoint": ""}) == 1.0
    assert SECRET not in text
    # the report log: one line, the report's to_dict(), nothing of the text
    lines = log_path.read_text().splitlines()
    assert len(lines) == 1 and SECRET not in lines[0] and load_corpus()[0]["text"][:40] not in lines[0]
    row = json.loads(lines[0])
    assert row["prompt_tokens"] == r.prompt_tokens and row["measured_ttft_s"] == pytest.approx(r.measured_ttft_s)
    assert row["error_type"] is None and row["decode_params"] == {"max_tokens": 4, "stream": True}


def test_an_infeasible_request_is_marked_so_and_one_refused_before_sending_is_an_error_span(llm, quick_profile, otel):
    spans, reader = otel
    messages, chunks = long_request()
    chat = trimkit.wrap(llm, ttft_budget_s=0.001, profile=quick_profile)
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=2)
    r = chat.last_report
    root = by_name(spans.get_finished_spans(), f"chat {r.model}")[0]
    assert r.feasible is False and root.attributes["trimkit.outcome"] == "infeasible" and root.attributes["trimkit.feasible"] is False
    assert root.attributes["trimkit.budget.met"] is False
    spans.clear()
    strict = trimkit.wrap(llm, ttft_budget_s=0.001, profile=quick_profile, on_infeasible="raise")
    with pytest.raises(InfeasibleBudgetError):
        strict.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=2)
    got = spans.get_finished_spans()
    assert sorted(s.name for s in got) == sorted([f"chat {r.model}", "trimkit.plan"])  # never sent: no send span
    root = by_name(got, f"chat {r.model}")[0]
    assert root.status.status_code == StatusCode.ERROR and root.attributes["error.type"] == "trimkit.errors.InfeasibleBudgetError"
    assert root.attributes["trimkit.outcome"] == "refused"
    outcomes = {dict(p.attributes)["trimkit.outcome"]: p.value for p in metric_points(reader)["trimkit.requests"][1]}
    assert outcomes == {"infeasible": 1, "refused": 1}
    assert_no_text(got, SECRET)


def test_a_stream_broken_mid_way_is_an_error_span_and_an_error_line(server, otel, prom):
    from tests.test_server_faults import make_chat

    spans, reader = otel
    server.chat(sse_reply(chunk(role="assistant"), chunk("Hel"), done=False, then=reset))
    log = io.StringIO()
    chat = make_chat("url", server, report_log=log)
    with pytest.raises(StreamInterruptedError) as err:
        for _ in chat.chat.completions.create(messages=ask("Say hello."), max_tokens=4, stream=True):
            pass
    chat.close()
    r = err.value.report
    got = spans.get_finished_spans()
    root = [s for s in got if s.name.startswith("chat ")][0]
    assert root.name == "chat m" and root.attributes["gen_ai.request.model"] == "m"  # the report's "m @ url" split
    assert root.attributes["server.address"] == "127.0.0.1" and root.attributes["server.port"] == int(server.base_url.split(":")[2].split("/")[0])
    assert root.kind == SpanKind.CLIENT and root.status.status_code == StatusCode.ERROR
    assert root.attributes["error.type"] == "trimkit.errors.StreamInterruptedError" and root.attributes["trimkit.outcome"] == "error"
    assert by_name(got, "trimkit.send")[0].status.status_code == StatusCode.ERROR
    duration = metric_points(reader)["gen_ai.client.operation.duration"][1][0]
    assert dict(duration.attributes)["error.type"] == "trimkit.errors.StreamInterruptedError"
    row = json.loads(log.getvalue())
    assert row["error_type"] == "trimkit.errors.StreamInterruptedError" and row["measured_ttft_s"] == pytest.approx(r.measured_ttft_s)
    assert prom.get_sample_value("trimkit_requests_total", {"model": "m", "endpoint": "", "outcome": "error"}) == 1.0
    assert_no_text(got, SECRET)


def test_a_fleet_request_names_its_endpoint(llama_server, otel, prom, tmp_path):
    spans, _ = otel
    log_path = tmp_path / "fleet.jsonl"
    chat = trimkit.wrap_url([llama_server], ttft_budget_s=30.0, calibration="micro", report_log=str(log_path), summarizer=None)
    try:
        chat.chat.completions.create(messages=ask("Say hello."), max_tokens=3)
    finally:
        chat.close()
    r = chat.last_report
    assert r.endpoint
    roots = [s for s in spans.get_finished_spans() if s.name.startswith("chat ")]
    assert len(roots) == 1 and roots[0].kind == SpanKind.CLIENT
    assert roots[0].attributes["trimkit.endpoint"] == r.endpoint and roots[0].attributes["gen_ai.provider.name"] == r.backend
    assert prom.get_sample_value("trimkit_requests_total", {"model": r.model, "endpoint": r.endpoint, "outcome": "passthrough"}) == 1.0
    assert [json.loads(x)["endpoint"] for x in log_path.read_text().splitlines()] == [r.endpoint]
    assert_no_text(spans.get_finished_spans(), SECRET)


def test_a_failing_observer_never_fails_the_request(llm, quick_profile, caplog):
    from trimkit.report import add_observer, remove_observer

    def broken(c):
        raise RuntimeError(SECRET)

    add_observer(broken)
    try:
        chat = trimkit.wrap(llm, ttft_budget_s=30.0, profile=quick_profile)
        chat.create_chat_completion(messages=ask("Say hello."), max_tokens=2)
    finally:
        remove_observer(broken)
    assert chat.last_report is not None
    assert "RuntimeError" in caplog.text and SECRET not in caplog.text


def test_uses_the_global_api_provider_without_installing_one(monkeypatch):
    from opentelemetry import trace

    set_calls = []
    monkeypatch.setattr(trace, "set_tracer_provider", lambda *a, **k: set_calls.append(a))
    inst = trimkit.otel.instrument()
    inst.uninstrument()
    assert set_calls == []


def test_a_bad_report_log_is_a_typed_error_before_anything_is_sent(llm, quick_profile):
    with pytest.raises(InvalidInputError, match="report_log"):
        trimkit.wrap(llm, ttft_budget_s=1.0, profile=quick_profile, report_log=42)


def test_trimkit_report_prints_the_figures_and_draws_the_log(llm, quick_profile, tmp_path, capsys):
    from trimkit.cli import main

    log_path = tmp_path / "r.jsonl"
    chat = trimkit.wrap(llm, ttft_budget_s=30.0, profile=quick_profile, report_log=log_path)
    chat.create_chat_completion(messages=ask("Say hello."), max_tokens=2)
    chat.create_chat_completion(messages=ask("Say hello again."), max_tokens=2, ttft_budget_s=0.001)  # a miss
    png = tmp_path / "r.png"
    assert main(["report", str(log_path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "2 requests:" in out and "budget met: 1 of 2 budgeted requests (50%)" in out and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trimkit_report_errors_are_clear(tmp_path, capsys, monkeypatch):
    from trimkit.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"predicted_ttft_s": 1.0, "measured_ttft_s": 0.5}\nnot json\n')
    assert main(["report", str(bad), "--no-plot"]) == 2
    assert "line 2: not JSON" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text('{"predicted_ttft_s": 1.0, "measured_ttft_s": 0.5}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    assert main(["report", str(good)]) == 2
    assert "pip install 'trimkit[plot]'" in capsys.readouterr().err


def test_the_frameworks_callbacks_keep_working_alongside(model_path, otel):
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_core.callbacks import BaseCallbackHandler

    from trimkit.integrations.langchain import REPORT_EVENT, TrimmedChatModel

    class Events(BaseCallbackHandler):
        def __init__(self):
            self.names, self.ends = [], 0

        def on_custom_event(self, name, data, *, run_id, **kwargs):
            self.names.append(name)

        def on_llm_end(self, response, *, run_id, **kwargs):
            self.ends += 1

    spans, _ = otel
    inner = ChatLlamaCpp(model_path=model_path, n_ctx=2048, max_tokens=3, temperature=0.0, verbose=False)
    model = TrimmedChatModel(inner, ttft_budget_s=30.0)
    events = Events()
    model.invoke([("user", f"Say hello. {SECRET}")], config={"callbacks": [events]})
    assert events.names == [REPORT_EVENT] and events.ends == 1
    roots = [s for s in spans.get_finished_spans() if s.name.startswith("chat ")]
    assert len(roots) == 1 and roots[0].attributes["gen_ai.usage.input_tokens"] == model.last_report.prompt_tokens
    assert_no_text(spans.get_finished_spans(), SECRET)
