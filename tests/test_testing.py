"""trimkit.testing: the fake engine's lease, and the fake OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.errors import EngineBusyError
from trimkit.planning.tokens import TiktokenTokenizer, chatml_render
from trimkit.testing import FakeBackend, FakeOpenAIServer, fake_openai_transport

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


@pytest.fixture
def server() -> FakeOpenAIServer:
    return FakeOpenAIServer(reply="Paris is the capital of France.")


@pytest.fixture
def http(server: FakeOpenAIServer) -> httpx.Client:
    return httpx.Client(transport=server.transport, base_url="http://fake")


# -- the fake server through a plain httpx client ---------------------------------------------------


def test_a_non_streamed_completion_is_a_chat_completion_object(server, http):
    r = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": ASK, "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris is the"}, "finish_reason": "length"}]
    prompt_tokens = len(TiktokenTokenizer().encode(chatml_render(ASK)))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["total_tokens"] == prompt_tokens + 3
    assert server.requests == [("POST", "/v1/chat/completions", {"model": "fake-model", "messages": ASK, "max_tokens": 3})]


def test_a_streamed_completion_is_server_sent_events_ending_in_done(http):
    body = {"messages": ASK, "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == "Paris is the capital of France."
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_no_usage_chunk_unless_asked(http):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all("usage" not in c for c in chunks)


def test_the_second_request_reports_the_common_prefix_as_cached(http):
    first = http.post("/v1/chat/completions", json={"messages": ASK}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    longer = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    second = http.post("/v1/chat/completions", json={"messages": longer}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]


def test_models_tokenize_and_template_endpoints(server, http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"] and models["data"][0]["meta"]["n_ctx"] == 8192
    assert http.post("/tokenize", json={"content": "hello world"}).json() == {"tokens": TiktokenTokenizer().encode("hello world")}
    assert http.post("/apply-template", json={"messages": ASK}).json() == {"prompt": chatml_render(ASK)}


def test_unknown_routes_and_bad_bodies_get_openai_style_errors(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400


def test_the_transport_serves_an_async_client_too():
    async def ask() -> httpx.Response:
        async with httpx.AsyncClient(transport=fake_openai_transport(reply="hi there"), base_url="http://fake") as client:
            return await client.post("/v1/chat/completions", json={"messages": ASK})

    assert asyncio.run(ask()).json()["choices"][0]["message"]["content"] == "hi there"


# -- through the public HTTP backend ------------------------------------------------------------------


def test_the_http_backend_streams_and_measures_through_the_fake_server(server, http):
    backend = OpenAIHTTPBackend("http://fake/v1", model="fake-model", http_client=http)
    assert backend.n_ctx == 8192
    assert backend.prompt_count_exact  # /tokenize and /apply-template: counts are the server's
    stream = backend.send(ASK, {"max_tokens": 4})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in stream if c.get("choices"))
    m = stream.measurement
    assert text == "Paris is the capital"
    assert m is not None and m.ttft_s is not None and m.ttft_s >= 0
    assert m.prompt_tokens == len(TiktokenTokenizer().encode(chatml_render(ASK)))
    assert m.finish_reason == "length"
    assert ("POST", "/v1/chat/completions") in [(method, path) for method, path, _ in server.requests]


def test_wrap_url_chats_with_the_fake_server_and_reports(server, http):
    import trimkit
    from tests._core_helpers import make_profile

    chat = trimkit.wrap_url("http://fake/v1", model="fake-model", http_client=http, profile=make_profile())
    out = chat.chat.completions.create(model="fake-model", messages=ASK, max_tokens=2)
    assert out["choices"][0]["message"]["content"] == "Paris is"
    report = chat.last_report
    assert report is not None and report.prompt_tokens == len(TiktokenTokenizer().encode(chatml_render(ASK)))


# -- FakeBackend holds its engine per stream, not a lock across yields -------------------------------


def test_an_abandoned_fake_stream_does_not_block_other_threads():
    fake = FakeBackend()
    stream = fake.send(ASK, {"max_tokens": 3})
    next(stream)  # started, then left unfinished by this thread
    fake.engine_wait_s = 0.05
    errors: list[BaseException] = []

    def other() -> None:
        try:
            fake.send(ASK, {"max_tokens": 3}).drain()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], EngineBusyError)  # bounded, not a hang
    stream.close()  # closing it, from any thread, frees the engine
    assert stream.released
    th = threading.Thread(target=lambda: fake.send(ASK, {"max_tokens": 3}).drain())
    th.start()
    th.join(timeout=5)
    assert not th.is_alive() and len(fake.calls) == 2


# -- the first-token overhead median (one home for every backend's probe) ------------------------------


def test_first_token_overhead_is_the_upper_median_of_the_probe_gaps():
    from trimkit.backends.base import Measurement, first_token_overhead_s

    def m(ttft, prefill, first_output=None):
        return Measurement(ttft_s=ttft, total_s=1.0, first_output_s=first_output, engine_prefill_s=prefill)

    assert first_token_overhead_s([m(0.5, 0.2), m(0.9, 0.2), m(0.3, 0.2)]) == pytest.approx(0.3)
    assert first_token_overhead_s([m(0.5, 0.2), m(0.9, 0.2)]) == pytest.approx(0.7)  # the upper of two
    assert first_token_overhead_s([m(0.1, 0.2)]) == 0.0  # never negative
    assert first_token_overhead_s([m(None, 0.2, first_output=0.4)]) == pytest.approx(0.2)  # stopped at once
    assert first_token_overhead_s([m(None, 0.2), m(0.5, None)]) == 0.0  # nothing counted
    asked = []
    got = first_token_overhead_s([m(0.5, None), m(None, None)], prefill_s=lambda p: asked.append(p) or 0.1)
    assert got == pytest.approx(0.4) and len(asked) == 1  # asked only for a probe with output


def test_background_work_counts_tokens_without_asking_the_server(server: FakeOpenAIServer, http: httpx.Client):
    # llama_cpp.server interrupts the stream in flight when another request arrives, so background
    # summaries must not tokenize through the server while the caller's next answer streams.
    for chat_format in (None, "gemma-3"):
        backend = OpenAIHTTPBackend("http://fake/v1", http_client=http, chat_format=chat_format)
        assert backend.tokenizer.count("hello there") > 0  # the server's tokenizer: it asks
        before = len(server.requests)
        tok = backend.background_tokenizer
        assert tok.count("hello there, how are you today?") > 0
        assert tok.prompt_tokens([{"role": "user", "content": "hi"}])
        assert len(server.requests) == before


def test_background_tokenizer_is_made_once(http: httpx.Client):
    backend = OpenAIHTTPBackend("http://fake/v1", http_client=http)
    assert backend.background_tokenizer is backend.background_tokenizer
