"""trimkit's OpenAI-client front-end against a REAL llama-cpp-python server on loopback (plus
httpx.MockTransport for the numbers that server never reports: llama.cpp ``timings``, truncation).

The real server (llama-cpp-python 0.3.36) streams no usage and no timings: TTFT is the client's,
cached tokens are predicted but never confirmed. One quick calibration against the endpoint is
shared by the module (stored in the session's test cache) and reused by the CLI test.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
import time

import httpx
import pytest

import trimkit
from tests._server import free_port, running_server
from tests.test_http_backend import llama_cpp_server_handler
from trimkit import wrap_url
from trimkit.backends.replies import chunk_content
from trimkit.cli import load_corpus, load_history
from trimkit.errors import (
    InvalidBudgetError,
    InvalidChunkError,
    InvalidInputError,
    InvalidMessageError,
    ServerUnreachableError,
    StreamInterruptedError,
)
from trimkit.openai_wrapper import (
    MIN_RETRY_DEADLINE_S,
    AsyncTrimmedOpenAI,
    ReportingOpenAIStream,
    TrimmedOpenAI,
    retry_deadline_for,
    wrap_openai,
)

openai = pytest.importorskip("openai")
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

SYSTEM = {"role": "system", "content": "You answer questions about the town of Marrowby briefly."}
ASK = [{"role": "user", "content": "Say hello."}]
BAN_END = {"1": -100.0, "106": -100.0}  # Gemma's <eos> and <end_of_turn>: the model keeps talking


def text_of(chunks) -> str:
    return "".join(chunk_content(c) or "" for c in chunks)


class Recorder:
    """An httpx event hook keeping the JSON body of every chat request the client sends."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))


@pytest.fixture(scope="module")
def profile(llama_server):  # noqa: F811
    """One quick calibration against the endpoint, stored in the session's test cache."""
    client = openai.OpenAI(base_url=llama_server, api_key="x", max_retries=0)
    p = trimkit.calibrate(client, mode="quick")
    client.close()
    return p


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture
def chat(llama_server, profile, recorder):  # noqa: F811
    client = openai.OpenAI(base_url=llama_server, api_key="x", max_retries=0, http_client=httpx.Client(event_hooks={"request": [recorder]}))
    with trimkit.wrap(client, ttft_budget_s=2.0, profile=profile) as wrapped:
        yield wrapped


# -- calibration ------------------------------------------------------------------------------------
def test_quick_calibration_against_the_endpoint_is_stored_with_a_positive_cost(profile, llama_server):  # noqa: F811
    assert (profile.mode != "full") and profile.model.per_token_s > 0
    assert profile.key.backend == "openai_http" and profile.key.model.startswith(llama_server + "|")
    assert trimkit.load_profile(profile.key) == profile
    # wrapping the same endpoint without a profile reuses the stored one instead of measuring again
    wrapped = wrap_openai(openai.OpenAI(base_url=llama_server, api_key="x", max_retries=0))
    assert wrapped.profile.created_at == profile.created_at
    wrapped.close()


def test_cli_calibrate_url_reads_the_stored_profile(profile, llama_server):  # noqa: F811
    model = profile.key.model.split("|", 1)[1]
    out = subprocess.run([sys.executable, "-m", "trimkit", "calibrate", "--url", llama_server, "--model", model, "--quick", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["key"]["model"] == profile.key.model and data["model"]["per_token_s"] > 0
    assert data["created_at"] == profile.created_at  # the same key: the module's calibration, reused


def test_cli_calibrate_url_with_a_bad_url_is_one_line_and_status_2():
    out = subprocess.run([sys.executable, "-m", "trimkit", "calibrate", "--url", "ftp://nowhere/v1", "--model", "m", "--quick"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("trimkit: error:") and "Traceback" not in out.stderr


# -- the drop-in ------------------------------------------------------------------------------------
def test_wrap_returns_the_sync_wrapper_and_delegates_the_rest(chat, llama_server):  # noqa: F811
    assert isinstance(chat, TrimmedOpenAI) and not isinstance(chat, AsyncTrimmedOpenAI)
    assert [m.id for m in chat.models.list().data] == [profile_model(chat)]  # the client's own
    assert str(chat.base_url).rstrip("/") == llama_server
    assert chat.chat.completions.with_raw_response is not None


def profile_model(chat) -> str:
    return chat.backend.model_name


def test_non_stream_returns_a_chat_completion_and_a_report(chat, recorder):
    messages = [SYSTEM, *ASK]
    before = copy.deepcopy(messages)
    out = chat.chat.completions.create(model=profile_model(chat), messages=messages, max_tokens=6, temperature=0.0)
    assert isinstance(out, ChatCompletion)
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens >= 1 and out.usage.prompt_tokens == chat.last_report.prompt_tokens
    assert messages == before
    r = chat.last_report
    assert r.passthrough and r.measured_ttft_s > 0 and r.predicted_ttft_s > 0
    assert r.measurement.server["cached_tokens_reported"] is False  # this server never says
    assert any("no usage while streaming" in w for w in r.warnings)
    assert "untouched by trimkit" in str(r) and "@ http://127.0.0.1" in r.model
    # under budget the caller's messages went out as they were, streamed so TTFT could be measured
    assert recorder.bodies[-1]["messages"] == messages and recorder.bodies[-1]["stream"] is True


def test_stream_yields_the_clients_chunks_and_sets_the_report(chat):
    stream = chat.chat.completions.create(messages=ASK, max_tokens=5, stream=True)
    assert isinstance(stream, ReportingOpenAIStream) and stream.report is None
    with stream:
        chunks = list(stream)
    assert chunks and all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert all(c.choices for c in chunks)  # the usage-only chunk trimkit asks for is not the caller's
    assert stream.report is chat.last_report and stream.report.measured_ttft_s > 0
    assert stream.report.decode_params == {"max_tokens": 5, "stream": True}
    assert not any("usage" in w for w in stream.report.warnings)


def test_decode_params_reach_the_server_unchanged(chat, recorder):
    params = {"max_tokens": 4, "temperature": 0.3, "top_p": 0.9, "stop": ["\n\n"], "seed": 7, "logit_bias": BAN_END,
              "presence_penalty": 0.1, "user": "u-1", "extra_body": {"top_k": 20}}
    chat.chat.completions.create(model=profile_model(chat), messages=ASK, **params)
    sent = recorder.bodies[-1]
    for key, value in params.items():
        if key != "extra_body":
            assert sent[key] == value, key
    assert sent["top_k"] == 20  # the client's extra_body is the client's business, merged by it
    assert chat.last_report.decode_params == {"model": profile_model(chat), **params}


def test_n_greater_than_one_is_sent_unstreamed_and_says_so(chat, recorder):
    out = chat.chat.completions.create(messages=ASK, max_tokens=3, n=2)
    assert isinstance(out, ChatCompletion)
    assert recorder.bodies[-1]["stream"] is False and recorder.bodies[-1]["n"] == 2
    r = chat.last_report
    assert r.measured_ttft_s is None and any("n=2" in w for w in r.warnings)
    assert r.measurement.timing_source == "usage" and r.measurement.prompt_tokens == out.usage.prompt_tokens


def test_long_rag_chat_is_trimmed_under_the_budget_without_touching_the_callers_data(chat, recorder):
    chunks = [trimkit.Chunk(text=d["text"], id=d["id"]) for d in load_corpus()[:12]]
    messages = [SYSTEM, *load_history(), {"role": "user", "content": "When was the lighthouse first lit?"}]
    before = copy.deepcopy((messages, chunks))
    out = chat.chat.completions.create(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=1.5)
    assert isinstance(out, ChatCompletion)
    assert (messages, chunks) == before
    r = chat.last_report
    assert r.ttft_budget_s == 1.5 and r.trimmed and r.prompt_tokens < r.prompt_tokens_before
    assert r.predicted_ttft_before_s > 1.5
    if r.feasible:
        assert r.predicted_ttft_s <= 1.5
    dropped = [c for a in r.actions for c in a.removed_chunks]
    removed = [i for a in r.actions for i in (*a.removed_messages, *a.summarized_messages)]
    assert dropped or removed
    assert recorder.bodies[-1]["messages"][0] == SYSTEM
    assert recorder.bodies[-1]["messages"][-1]["content"].rstrip().endswith("When was the lighthouse first lit?")
    assert r.measured_ttft_s is not None and r.measured_ttft_s > 0  # how fast depends on the host: the benchmark has the targets
    assert r.budget_met == (r.measured_ttft_s <= 1.5)


def test_bad_input_raises_typed_errors_before_anything_is_sent(chat, recorder):
    n = len(recorder.bodies)
    create = chat.chat.completions.create
    with pytest.raises(InvalidMessageError):
        create(max_tokens=2)
    with pytest.raises(InvalidMessageError):
        create(messages=[{"content": "no role"}], max_tokens=2)
    with pytest.raises(InvalidMessageError):
        create(messages="hello", max_tokens=2)
    with pytest.raises(InvalidChunkError):
        create(messages=ASK, rag_chunks=[{"id": "x"}], max_tokens=2)
    with pytest.raises(InvalidBudgetError):
        create(messages=ASK, ttft_budget_s=-1, max_tokens=2)
    with pytest.raises(InvalidInputError):
        create(messages=ASK, stream="yes")
    assert len(recorder.bodies) == n


def test_bad_urls_and_clients_are_invalid_input(profile):
    with pytest.raises(InvalidInputError):
        wrap_url("not a url", profile=profile)
    with pytest.raises(InvalidInputError):
        wrap_url("ftp://127.0.0.1/v1", profile=profile)
    with pytest.raises(InvalidInputError):
        wrap_openai(openai.OpenAI(base_url="localhost:8080", api_key="x"), profile=profile)
    with pytest.raises(InvalidInputError):
        wrap_openai(object())
    with pytest.raises(InvalidInputError):
        TrimmedOpenAI(openai.AsyncOpenAI(base_url="http://127.0.0.1:1/v1", api_key="x"), profile=profile)
    with pytest.raises(InvalidInputError):
        wrap_url("http://127.0.0.1:1/v1", profile=profile, retry_deadline_s=0)


def test_retry_deadline_follows_the_budget(chat):
    assert retry_deadline_for(None, 30.0) == 30.0
    assert retry_deadline_for(0.5, 30.0) == MIN_RETRY_DEADLINE_S
    assert retry_deadline_for(10.0, 30.0) == 20.0
    assert chat.deadlines.retry_s(0.2) == MIN_RETRY_DEADLINE_S
    assert chat.deadlines.retry_s(None) == 30.0  # the backend's own default
    assert chat.backend.retry_deadline_s == MIN_RETRY_DEADLINE_S  # planning's side requests: the default budget's (2 s)


def test_an_unreachable_server_gives_up_within_the_budgets_deadline(profile):
    chat = wrap_url(f"http://127.0.0.1:{free_port()}/v1", model="m", profile=profile, retry_backoff_max_s=0.5, ttft_budget_s=0.5)
    assert chat.deadlines.first_chunk_s(0.5) == MIN_RETRY_DEADLINE_S  # the budget's deadline, not the backend's 30 s
    with pytest.raises(ServerUnreachableError, match="attempts"):
        chat.chat.completions.create(messages=ASK, max_tokens=2)
    chat.close()


# -- wrap_url: plain dicts --------------------------------------------------------------------------
def test_wrap_url_gives_the_same_api_with_plain_dicts(llama_server, profile):  # noqa: F811
    with wrap_url(llama_server, ttft_budget_s=2.0, profile=profile) as chat:
        out = chat.chat.completions.create(messages=ASK, max_tokens=4)
        assert isinstance(out, dict) and out["object"] == "chat.completion"
        assert out["choices"][0]["message"]["role"] == "assistant" and out["usage"]["total_tokens"] > 0
        stream = chat.chat.completions.create(messages=ASK, max_tokens=4, stream=True)
        chunks = list(stream)
        assert all(isinstance(c, dict) for c in chunks) and stream.report.measured_ttft_s > 0
        with pytest.raises(AttributeError):
            _ = chat.models  # no client to delegate to


# -- async ------------------------------------------------------------------------------------------
def test_async_openai_client_is_wrapped(llama_server, profile):  # noqa: F811
    async def run():
        client = openai.AsyncOpenAI(base_url=llama_server, api_key="x", max_retries=0)
        chat = wrap_openai(client, ttft_budget_s=2.0, profile=profile)
        assert isinstance(chat, AsyncTrimmedOpenAI)
        messages = [SYSTEM, *ASK]
        before = copy.deepcopy(messages)
        out = await chat.chat.completions.create(messages=messages, max_tokens=4)
        report = chat.last_report
        stream = await chat.chat.completions.create(messages=messages, max_tokens=4, stream=True)
        async with stream:
            chunks = [c async for c in stream]
        with pytest.raises(InvalidMessageError):
            await chat.chat.completions.create(messages=[], max_tokens=2)
        models = await chat.models.list()
        await chat.close()
        return out, report, chunks, stream, messages == before, models

    out, report, chunks, stream, untouched, models = asyncio.run(run())
    assert isinstance(out, ChatCompletion) and out.choices[0].message.role == "assistant"
    assert report.measured_ttft_s > 0 and untouched
    assert chunks and all(isinstance(c, ChatCompletionChunk) for c in chunks) and text_of(chunks)
    assert stream.report is not None and stream.report.measured_ttft_s > 0
    assert models.data


def test_async_wrap_url(llama_server, profile):  # noqa: F811
    async def run():
        chat = wrap_url(llama_server, profile=profile, asynchronous=True)
        out = await chat.chat.completions.create(messages=ASK, max_tokens=3)
        await chat.close()
        return out, chat.last_report

    out, report = asyncio.run(run())
    assert isinstance(out, dict) and out["choices"] and report.measured_ttft_s > 0


def test_async_wrap_url_pools_one_client_per_event_loop(llama_server, profile):  # noqa: F811
    """Streams on one loop share one pooled AsyncClient (no client, SSL context or connection
    built per request, on the loop); another loop gets its own; ``close()`` closes it."""
    chat = wrap_url(llama_server, profile=profile, asynchronous=True)
    transport = chat.backend.transport

    async def two_requests():
        seen = []
        for stream in (False, True):
            out = await chat.chat.completions.create(messages=ASK, max_tokens=2, stream=stream)
            if stream:
                async for _ in out:
                    pass
            seen.append(transport._loop_clients[asyncio.get_running_loop()])
        return seen

    first = asyncio.run(two_requests())
    assert len(first) == 2 and first[0] is first[1] and not first[0].is_closed

    async def then_close():
        client = (await two_requests())[0]
        await chat.close()
        return client

    second = asyncio.run(then_close())
    assert second is not first[0] and second.is_closed


# -- what servers report: llama.cpp-shaped timings and truncation (MockTransport) ----------------------
def test_report_shows_the_servers_prefill_cached_tokens_and_network_overhead(profile):
    http = httpx.Client(transport=httpx.MockTransport(llama_cpp_server_handler()))
    chat = wrap_url("http://mock.test/v1", profile=profile, http_client=http, ttft_budget_s=1.0)
    out = chat.chat.completions.create(messages=ASK, max_tokens=2)
    r = chat.last_report
    m = r.measurement
    assert m.timing_source == "llama.cpp server timings"
    assert m.engine_prefill_s == pytest.approx(0.040) and r.cached_tokens == 1
    assert m.server["network_overhead_s"] == pytest.approx(r.measured_ttft_s - 0.040)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    assert "engine-measured" in str(r) and m.truncated_tokens == 0
    assert chat.live.observations == 1  # the server's prefill time refines the profile


def test_silent_truncation_by_the_server_is_in_the_report(profile, caplog):
    http = httpx.Client(transport=httpx.MockTransport(llama_cpp_server_handler(prompt_n_reported=5)))
    chat = wrap_url("http://mock.test/v1", profile=profile, http_client=http)
    chat.chat.completions.create(messages=[{"role": "user", "content": "word " * 50}], max_tokens=2)
    r = chat.last_report
    assert r.measurement.truncated_tokens == r.prompt_tokens - 5 > 0
    assert "truncated the prompt" in str(r) and "silently truncated" in caplog.text


# -- faults -----------------------------------------------------------------------------------------
def test_server_killed_mid_stream_raises_stream_interrupted_with_a_report(profile):
    with running_server(extra_args=["--logits_all", "false"]) as server:
        chat = wrap_openai(openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0), profile=profile)
        stream = chat.chat.completions.create(messages=ASK, max_tokens=2000, logit_bias=BAN_END, stream=True)
        with pytest.raises(StreamInterruptedError) as err:
            for c in stream:
                if chunk_content(c):
                    server.proc.kill()
                    server.proc.wait(timeout=10)
        chat.close()
    report = err.value.report
    assert report is not None and report.measured_ttft_s > 0
    assert report.decode_params["max_tokens"] == 2000 and stream.report is None


def test_named_chat_format_makes_server_counts_exact(llama_server):
    """The test server runs --chat_format gemma-3; naming it makes trimkit's count match the server's."""
    import httpx

    from trimkit.backends.http import OpenAIHTTPBackend

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name the harbour's oldest boat."}]
    named = OpenAIHTTPBackend(llama_server, chat_format="gemma-3")
    guessed = OpenAIHTTPBackend(llama_server)
    try:
        out = httpx.post(named.base_url + "/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60).json()
        server_count = out["usage"]["prompt_tokens"]
        assert named.prompt_count_exact and not guessed.prompt_count_exact
        assert len(named.tokenizer.prompt_tokens(messages)) == server_count
        assert len(guessed.tokenizer.prompt_tokens(messages)) != server_count
    finally:
        named.close()
        guessed.close()


# -- every front-end form on the in-memory fake server (no model needed) -----------------------------


@pytest.fixture
def fake_server():
    from trimkit.testing import FakeOpenAIServer

    return FakeOpenAIServer()


@pytest.fixture
def fake_profile(isolated_cache):
    from trimkit.testing import FakeBackend

    return trimkit.calibrate(FakeBackend(), mode="quick", store=False)


def fake_http(server):
    return httpx.Client(transport=server.transport)


def test_wrap_url_on_the_fake_server_streams_reports_and_sends_n_gt_1_whole(fake_server, fake_profile):
    with wrap_url("http://fake/v1", model=fake_server.model, profile=fake_profile, ttft_budget_s=1.0,
                  http_client=fake_http(fake_server)) as chat:
        out = chat.chat.completions.create(messages=ASK, max_tokens=4)
        assert isinstance(out, dict) and out["choices"][0]["message"]["content"] and out["usage"]["completion_tokens"] == 4
        assert chat.last_report.model == f"{fake_server.model} @ http://fake/v1" and chat.last_report.measured_ttft_s > 0
        stream = chat.chat.completions.create(messages=ASK, max_tokens=4, stream=True)
        assert isinstance(stream, ReportingOpenAIStream)
        with stream:
            chunks = list(stream)
        assert chunks and stream.report is chat.last_report and chat.last_prepared.budget_s == 1.0
        whole = chat.chat.completions.create(messages=ASK, max_tokens=4, n=2)
        assert whole["choices"] and any("n=2" in w for w in chat.last_report.warnings)
        assert chat.last_report.measurement.ttft_s is None


def test_the_openai_clients_on_the_fake_server_get_their_own_types(fake_server, fake_profile):
    client = openai.OpenAI(base_url="http://fake/v1", api_key="x", http_client=fake_http(fake_server))
    with trimkit.wrap(client, profile=fake_profile, ttft_budget_s=1.0, http_client=fake_http(fake_server)) as chat:
        assert isinstance(chat, TrimmedOpenAI)
        out = chat.chat.completions.create(model=fake_server.model, messages=ASK, max_tokens=3)
        assert isinstance(out, ChatCompletion) and out.usage.completion_tokens == 3
        assert [m.id for m in chat.models.list().data] == [fake_server.model]  # the client's own

    async def run():
        aclient = openai.AsyncOpenAI(base_url="http://fake/v1", api_key="x", http_client=httpx.AsyncClient(transport=fake_server.transport))
        achat = trimkit.wrap(aclient, profile=fake_profile, ttft_budget_s=1.0, http_client=fake_http(fake_server))
        assert isinstance(achat, AsyncTrimmedOpenAI) and not isinstance(achat, TrimmedOpenAI)
        out = await achat.chat.completions.create(model=fake_server.model, messages=ASK, max_tokens=3)
        stream = await achat.chat.completions.create(model=fake_server.model, messages=ASK, max_tokens=3, stream=True)
        async with stream:
            chunks = [c async for c in stream]
        await achat.close()
        return out, chunks, stream.report, achat.last_report

    out, chunks, report, last = asyncio.run(run())
    assert isinstance(out, ChatCompletion) and all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert report is last and report.measured_ttft_s > 0


def test_the_async_wrapper_has_no_sync_calls():
    assert not hasattr(AsyncTrimmedOpenAI, "execute") and not hasattr(AsyncTrimmedOpenAI, "__enter__")
    assert asyncio.iscoroutinefunction(AsyncTrimmedOpenAI.close) and not asyncio.iscoroutinefunction(TrimmedOpenAI.close)


class BreakingStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A streamed reply whose connection resets 0.05 s after its first content chunk."""

    EVENT = (b'data: {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", '
             b'"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\n\n')

    def __iter__(self):
        yield self.EVENT
        time.sleep(0.05)
        raise httpx.ReadError("connection reset by peer")

    async def __aiter__(self):
        yield self.EVENT
        await asyncio.sleep(0.05)
        raise httpx.ReadError("connection reset by peer")


def breaking_transport(server):
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/chat/completions"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=BreakingStream())
        return server(request)

    return httpx.MockTransport(handle)


def test_an_error_mid_stream_reports_the_time_to_the_failure_sync_and_async(fake_server, fake_profile):
    """The one report-on-error path: ``total_s`` runs from sending to the failure on every front-end."""
    transport = breaking_transport(fake_server)
    chat = wrap_url("http://fake/v1", model=fake_server.model, profile=fake_profile, ttft_budget_s=1.0, http_client=httpx.Client(transport=transport))
    with pytest.raises(StreamInterruptedError) as sync_error:
        chat.chat.completions.create(messages=ASK, max_tokens=4)
    chat.close()

    async def run():
        achat = wrap_url("http://fake/v1", model=fake_server.model, profile=fake_profile, ttft_budget_s=1.0, asynchronous=True,
                         http_client=httpx.Client(transport=transport), async_http_client=httpx.AsyncClient(transport=transport))
        try:
            stream = await achat.chat.completions.create(messages=ASK, max_tokens=4, stream=True)
            with pytest.raises(StreamInterruptedError) as info:
                async for _ in stream:
                    pass
            return info.value
        finally:
            await achat.close()

    for error in (sync_error.value, asyncio.run(run())):
        m = error.report.measurement
        assert m.ttft_s is not None and m.total_s >= m.ttft_s + 0.04
        assert error.report.prompt_tokens > 0 and error.report.ttft_budget_s == 1.0
