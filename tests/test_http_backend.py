"""OpenAIHTTPBackend against a REAL llama-cpp-python server on loopback, plus httpx.MockTransport
for transport-level behaviour the real server cannot be made to show (503/429 retries, a
llama.cpp- or vLLM-shaped server).

What llama-cpp-python 0.3.36's server actually reports, and these tests hold it to: streamed
chunks carry no ``usage`` and no ``timings`` (``stream_options`` is ignored); a non-streamed
response carries ``usage.prompt_tokens``/``completion_tokens`` but never a cached count;
``/extras/tokenize`` exists (it prepends BOS), ``/tokenize``, ``/apply-template``, ``/props``,
``/version`` do not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from tests._server import free_port, running_server, start_server, stop_server
from trimkit.backends.base import TimedStream
from trimkit.backends.http import AsyncTimedStream, OpenAIHTTPBackend
from trimkit.backends.replies import assemble_chat_completion, chunk_content
from trimkit.backends.transport import EventReader, iter_events
from trimkit.errors import (
    InvalidInputError,
    ServerError,
    ServerUnreachableError,
    StreamInterruptedError,
    TransientServerError,
)

ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
SMALL = {"max_tokens": 6, "temperature": 0.0}


# -- helpers ------------------------------------------------------------------------------------
def chunk(content=None, *, role=None, finish=None, **extra):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def sse(*events, done=True) -> bytes:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def sse_response(*events, done=True) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse(*events, done=done))


GOOD_STREAM = (chunk(role="assistant"), chunk("Hello"), chunk(" there"), chunk(finish="stop"))


def mock_backend(handler, **kwargs) -> OpenAIHTTPBackend:
    kwargs.setdefault("cache_block_tokens", 1)
    kwargs.setdefault("retry_backoff_s", 0.01)
    return OpenAIHTTPBackend("http://mock.test/v1", model="m", http_client=httpx.Client(transport=httpx.MockTransport(handler)), **kwargs)


def text_of(chunks) -> str:
    return "".join(chunk_content(c) or "" for c in chunks)


# -- real server: requests and timing ---------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(llama_server):  # noqa: F811
    b = OpenAIHTTPBackend(llama_server)
    yield b
    b.close()


def test_server_info_of_llama_cpp_python(backend):
    info = backend.server_info()
    assert info.engine == "llama-cpp-python"
    assert info.tokenize_endpoint == "/extras/tokenize" and not info.apply_template
    assert info.n_ctx is None  # the server does not say; the default applies
    assert "0.3.36" in info.engine_version
    assert backend.tokenizer.exact and backend.tokenizer.name.endswith("+chatml(estimate)")
    assert not backend.prompt_count_exact
    text = backend.tokenizer.tokenizer.encode("Hello world")
    prompt = backend.tokenizer.encode_prompt("Hello world")
    assert prompt[1:] == text and prompt[0] == info.bos_prefix[0]  # BOS only on whole prompts


def test_profile_key(backend, llama_server):  # noqa: F811
    key = backend.profile_key()
    assert key.backend == "openai_http" and key.cpu == "remote"
    assert key.model.startswith(llama_server + "|") and key.model.endswith(".gguf")
    assert key.n_ctx == 4096 and key.n_batch == 512
    assert "llama.cpp Python API 0.3.36" in key.engine_version


def test_streamed_chat_measures_ttft_client_side(backend):
    ts = backend.send(ASK, SMALL)
    chunks = list(ts)
    m = ts.measurement
    assert all(isinstance(c, dict) for c in chunks)
    assert text_of(chunks), "the model produced no content"
    assert 0 < m.ttft_s <= m.total_s
    assert m.finish_reason in ("stop", "length")
    # llama-cpp-python streams no usage and no timings: trimkit says so instead of inventing numbers
    assert m.timing_source == "client" and m.engine_prefill_s is None
    assert m.cached_tokens is None and m.server["cached_tokens_reported"] is False
    assert "network_overhead_s" not in m.server
    assert m.prompt_tokens == m.server["sent_prompt_tokens"] == len(backend.tokenizer.prompt_tokens(ASK))
    assert m.completion_tokens == ts.n_content_chunks and m.server["completion_tokens_from"].startswith("content chunks")


def test_non_streamed_chat_reads_usage(backend):
    response, m = backend.complete(ASK, SMALL, measure_ttft=False)
    assert response["object"] == "chat.completion"
    assert m.ttft_s is None and m.total_s > 0
    assert m.timing_source == "usage"
    assert m.prompt_tokens == response["usage"]["prompt_tokens"] > 0
    assert m.completion_tokens == response["usage"]["completion_tokens"]
    assert m.cached_tokens is None  # llama-cpp-python never reports a cached count
    assert m.truncated_tokens == 0
    assert backend.token_count_correction != 1.0  # learned from usage: ChatML estimate vs Gemma's template


def test_complete_streams_and_assembles(backend):
    response, m = backend.complete(ASK, SMALL)
    message = response["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    assert response["choices"][0]["finish_reason"] in ("stop", "length")
    assert response["usage"] is None  # not reported while streaming
    assert m.ttft_s is not None and m.ttft_s > 0


def test_second_turn_predicts_reuse_but_reports_cached_as_not_reported(backend):
    history = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Name a colour."}]
    first = backend.send(history, SMALL).drain()
    assert first.server["predicted_cached_tokens"] < 40  # nothing of this system prompt was sent before
    second_turn = history + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another."}]
    second = backend.send(second_turn, SMALL).drain()
    assert second.server["predicted_cached_tokens"] >= len(backend.tokenizer.prompt_tokens(history)) - 8
    assert second.cached_tokens is None and second.server["cached_tokens_reported"] is False
    assert backend.prefix_reuse is None  # no evidence either way from this server


def test_server_error_carries_the_server_message(backend):
    too_long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(ServerError) as err:
        backend.complete(too_long, {"max_tokens": 2}, measure_ttft=False)
    assert err.value.status == 400 and "maximum context length" in err.value.server_message
    assert not isinstance(err.value, TransientServerError)


def test_streamed_prompt_over_context_is_an_error_not_an_empty_answer(backend):
    with pytest.raises(ServerError, match="without sending a chunk"):
        backend.send([{"role": "user", "content": "word " * 5000}], {"max_tokens": 2}).drain()


def test_calibration_probes_give_positive_length_increasing_times(backend):
    backend.warm_up()
    short = backend.measure_prefill(32)
    long = backend.measure_prefill(256)
    deep = backend.measure_prefill(64, cached_tokens=192)
    assert 0 < short < long
    assert deep > 0
    assert backend.measure_decode(8) > 0
    assert backend.measure_first_token_overhead() >= 0


def test_probe_prompts_have_the_requested_length_and_differ_per_cold_probe(backend):
    text_a, tokens_a = backend.probe_prompt(100, backend.next_probe_offset())
    text_b, tokens_b = backend.probe_prompt(100, backend.next_probe_offset())
    assert 95 <= len(tokens_a) <= 100 and 95 <= len(tokens_b) <= 100
    assert tokens_a[1:4] != tokens_b[1:4]


def test_wraps_a_real_openai_client(llama_server):  # noqa: F811
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client = openai.OpenAI(base_url=llama_server, api_key="x", max_retries=0)
    backend = OpenAIHTTPBackend.from_openai_client(client)
    assert backend.base_url == llama_server and not backend.client_is_async
    ts = backend.send(ASK, SMALL)
    chunks = list(ts)
    assert chunks and all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk leaks into the user's stream
    assert text_of(chunks) and ts.measurement.ttft_s > 0
    response, m = backend.complete(ASK, SMALL)
    assert isinstance(response, ChatCompletion) and response.choices[0].message.content
    plain, m2 = backend.complete(ASK, SMALL, measure_ttft=False)
    assert isinstance(plain, ChatCompletion) and m2.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(ServerError) as err:  # the client's APIStatusError, translated
        backend.complete([{"role": "user", "content": "word " * 5000}], {"max_tokens": 2}, measure_ttft=False)
    assert err.value.status == 400 and "maximum context length" in err.value.server_message
    backend.close()
    client.close()


def test_wraps_a_real_async_openai_client(llama_server):  # noqa: F811
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    async def run():
        client = openai.AsyncOpenAI(base_url=llama_server, api_key="x", max_retries=0)
        backend = OpenAIHTTPBackend.from_openai_client(client)
        assert backend.client_is_async
        with pytest.raises(InvalidInputError):
            backend.send(ASK, SMALL)
        ts = await backend.asend(ASK, SMALL)
        assert isinstance(ts, AsyncTimedStream)
        chunks = [c async for c in ts]
        response, m2 = await backend.acomplete(ASK, SMALL)
        await client.close()
        backend.close()
        return chunks, ts.measurement, response, m2

    chunks, m, response, m2 = asyncio.run(run())
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks) and text_of(chunks)
    assert 0 < m.ttft_s <= m.total_s
    assert isinstance(response, ChatCompletion) and m2.ttft_s > 0


def test_async_url_form(backend):
    async def run():
        ts = await backend.asend(ASK, SMALL)
        chunks = [c async for c in ts]
        return chunks, ts.measurement

    chunks, m = asyncio.run(run())
    assert text_of(chunks) and 0 < m.ttft_s <= m.total_s


# -- real server: faults ------------------------------------------------------------------------------
def test_retries_until_a_late_server_is_up():
    port = free_port()
    backend = OpenAIHTTPBackend(f"http://127.0.0.1:{port}/v1", retry_deadline_s=60, retry_backoff_max_s=0.5, max_attempts=1000, cache_block_tokens=1)
    t0 = time.monotonic()
    server = start_server(port, delay_s=2.0)
    try:
        # prompt_tokens given: no server probe first, so the chat request itself is what is retried
        m = backend.send(ASK, SMALL, prompt_tokens=[2, 3, 4]).drain()
        assert time.monotonic() - t0 >= 2.0
        assert m.ttft_s is not None or m.first_output_s is not None
    finally:
        stop_server(server)
        backend.close()


def test_server_killed_mid_stream_raises_stream_interrupted():
    with running_server() as server:
        backend = OpenAIHTTPBackend(server.base_url)
        ban_end = {"1": -100.0, "106": -100.0}  # Gemma's <eos> and <end_of_turn>: keep it talking
        ts = backend.send(ASK, {"max_tokens": 2000, "logit_bias": ban_end})
        with pytest.raises(StreamInterruptedError):
            for c in ts:
                if chunk_content(c):
                    server.proc.kill()
                    server.proc.wait(timeout=10)
        assert ts.n_content_chunks >= 1
        backend.close()


def test_connection_refused_with_small_deadline_is_unreachable():
    url = f"http://127.0.0.1:{free_port()}/v1"
    backend = OpenAIHTTPBackend(url, retry_deadline_s=0.5, cache_block_tokens=1)
    with pytest.raises(ServerUnreachableError, match="attempts"):
        backend.send(ASK, SMALL, prompt_tokens=[1, 2]).drain()
    with pytest.raises(ServerUnreachableError):
        backend.send(ASK, SMALL)  # probing the server (for its tokenizer) is retried the same way
    backend.close()


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/v1", "http://", "127.0.0.1:8080", "not a url", "", 8080, None])
def test_bad_url_is_invalid_input(url):
    with pytest.raises(InvalidInputError):
        OpenAIHTTPBackend(url)


def test_bad_settings_are_invalid_input():
    with pytest.raises(InvalidInputError):
        OpenAIHTTPBackend("http://127.0.0.1:1/v1", retry_deadline_s=0)
    with pytest.raises(InvalidInputError):
        OpenAIHTTPBackend("http://127.0.0.1:1/v1", cache_block_tokens=0)
    with pytest.raises(InvalidInputError):
        OpenAIHTTPBackend("http://127.0.0.1:1/v1", client=object())


# -- transport-level behaviour (httpx.MockTransport) --------------------------------------------------------
def test_transient_statuses_are_retried_before_the_first_chunk():
    calls = []

    def handler(request):
        calls.append(request.url.path)
        if len(calls) == 1:
            return httpx.Response(503, json={"error": {"message": "loading model"}})
        if len(calls) == 2:
            return httpx.Response(429, headers={"retry-after": "0"}, json={"error": {"message": "busy"}})
        return sse_response(*GOOD_STREAM)

    backend = mock_backend(handler)
    ts = backend.send(ASK, {}, prompt_tokens=[1, 2, 3])
    assert text_of(list(ts)) == "Hello there"
    assert calls == ["/v1/chat/completions"] * 3


def test_transient_status_until_the_deadline_raises_transient_error():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(502, text="bad gateway")

    backend = mock_backend(handler, retry_deadline_s=0.3)
    with pytest.raises(TransientServerError) as err:
        backend.send(ASK, {}, prompt_tokens=[1]).drain()
    assert err.value.status == 502 and err.value.server_message == "bad gateway"
    assert 2 <= len(calls) < 100


def test_other_errors_surface_at_once_with_the_server_message():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(500, json={"error": {"message": "CUDA out of memory", "type": "server_error"}})

    backend = mock_backend(handler)
    with pytest.raises(ServerError) as err:
        backend.send(ASK, {}, prompt_tokens=[1]).drain()
    assert err.value.status == 500 and err.value.server_message == "CUDA out of memory"
    assert len(calls) == 1


class _BreaksAfterFirstChunk(httpx.SyncByteStream):
    def __iter__(self):
        yield sse(chunk(role="assistant"), chunk("Hel"), done=False)
        raise httpx.ReadError("connection reset by peer")


def test_no_retry_after_the_first_chunk():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_BreaksAfterFirstChunk())

    backend = mock_backend(handler)
    ts = backend.send(ASK, {}, prompt_tokens=[1])
    with pytest.raises(StreamInterruptedError, match="ReadError"):
        list(ts)
    assert len(calls) == 1 and ts.n_content_chunks == 1


def test_stream_ending_without_finish_or_done_is_interrupted():
    backend = mock_backend(lambda request: sse_response(chunk(role="assistant"), chunk("Hel"), done=False))
    with pytest.raises(StreamInterruptedError):
        backend.send(ASK, {}, prompt_tokens=[1]).drain()


def test_error_event_mid_stream_is_a_server_error():
    def handler(request):
        body = sse(chunk("Hi"), done=False) + b'data: {"error": {"code": 500, "message": "slot crashed"}}\n\n'
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    with pytest.raises(ServerError, match="slot crashed"):
        mock_backend(handler).send(ASK, {}, prompt_tokens=[1]).drain()


def test_connect_errors_are_retried_then_unreachable():
    calls = []

    def handler(request):
        calls.append(1)
        raise httpx.ConnectError("connection refused")

    with pytest.raises(ServerUnreachableError):
        mock_backend(handler, retry_deadline_s=0.2).send(ASK, {}, prompt_tokens=[1]).drain()
    assert len(calls) >= 2


def test_sse_events_handle_comments_multiline_data_and_done():
    d = EventReader()
    lines = [": ping - 2024", "", 'data: {"a":', "data: 1}", "", "event: message", 'data: {"b": 2}', "", "data: [DONE]", ""]
    events = list(iter_events([(line + "\n").encode() for line in lines], d))
    assert events == [{"a": 1}, {"b": 2}] and d.done


def test_usage_chunk_trimkit_asked_for_is_hidden_but_measured():
    seen = {}

    def handler(request):
        seen["body"] = json.loads(request.content)
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}}
        return sse_response(*GOOD_STREAM, usage)

    backend = mock_backend(handler)
    ts = backend.send(ASK, {"max_tokens": 4}, prompt_tokens=[1, 2, 3])
    chunks = list(ts)
    assert seen["body"]["stream_options"] == {"include_usage": True} and seen["body"]["max_tokens"] == 4
    assert all(c["choices"] for c in chunks)
    m = ts.measurement
    assert m.timing_source == "usage" and m.completion_tokens == 2 and m.cached_tokens == 0
    # the caller's own stream_options: the usage chunk is theirs and passes through
    chunks = list(backend.send(ASK, {"stream_options": {"include_usage": True}}, prompt_tokens=[1, 2, 3]))
    assert chunks[-1]["usage"]["prompt_tokens"] == 3


def test_server_refusing_stream_options_is_asked_again_without():
    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        if "stream_options" in body:
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument: stream_options"}})
        return sse_response(*GOOD_STREAM)

    backend = mock_backend(handler)
    assert text_of(list(backend.send(ASK, {}, prompt_tokens=[1]))) == "Hello there"
    assert ["stream_options" in b for b in bodies] == [True, False]
    list(backend.send(ASK, {}, prompt_tokens=[1]))
    assert "stream_options" not in bodies[-1]  # remembered


# -- other engines' shapes through the whole backend (MockTransport) -------------------------------------------
def _words(text):
    return [sum(map(ord, w)) % 5000 + 10 for w in text.split()]


def llama_cpp_server_handler(prompt_n_reported=None):
    """A llama.cpp-server-shaped endpoint: /props, /tokenize, /apply-template, and timings."""

    def handler(request):
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "qwen", "owned_by": "llamacpp"}]})
        if path == "/props":
            return httpx.Response(200, json={"default_generation_settings": {"n_ctx": 8192}, "build_info": "b5000-abc"})
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": ([1] if body.get("add_special") else []) + _words(body["content"])})
        if path == "/apply-template":
            return httpx.Response(200, json={"prompt": "".join(f"<|{m['role']}|> {m['content']} " for m in body["messages"]) + "<|assistant|>"})
        if path == "/v1/chat/completions":
            total = 1 + len(_words("".join(f"<|{m['role']}|> {m['content']} " for m in body["messages"]) + "<|assistant|>"))
            seen = prompt_n_reported or total
            final = chunk(finish="stop", timings={"prompt_n": seen - 1, "cache_n": 1, "prompt_ms": 40.0, "predicted_n": 2, "predicted_ms": 20.0})
            return sse_response(chunk(role="assistant"), chunk("Hi"), chunk("!"), final)
        return httpx.Response(404, json={"error": {"message": "not found"}})

    return handler


def test_llama_cpp_server_shape_exact_tokens_and_timings():
    backend = mock_backend(llama_cpp_server_handler(), cache_block_tokens=None)
    info = backend.server_info()
    assert info.engine == "llama.cpp" and info.apply_template and backend.n_ctx == 8192
    assert backend.profile_key().engine_version == "llama.cpp b5000-abc"
    assert backend.prompt_count_exact and backend.tokenizer.name.endswith("+server template")
    m = backend.send(ASK, {}).drain()
    assert m.timing_source == "llama.cpp server timings"
    assert m.engine_prefill_s == pytest.approx(0.040) and m.cached_tokens == 1
    assert m.server["network_overhead_s"] == pytest.approx(m.ttft_s - 0.040)
    assert m.truncated_tokens == 0 and m.prompt_tokens == len(backend.tokenizer.prompt_tokens(ASK))


def test_truncation_by_the_server_is_reported(caplog):
    backend = mock_backend(llama_cpp_server_handler(prompt_n_reported=5), cache_block_tokens=None)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        m = backend.send(ASK, {}).drain()
    sent = len(backend.tokenizer.prompt_tokens(ASK))
    assert m.truncated_tokens == sent - 5 > 0
    assert "silently truncated" in caplog.text


def vllm_handler(cached_reported):
    def handler(request):
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "llama", "owned_by": "vllm", "max_model_len": 32768}]})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.6.3"})
        if path == "/v1/chat/completions":
            usage = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached_reported}}}
            return sse_response(chunk("ok", role="assistant"), chunk(finish="stop"), usage)
        return httpx.Response(404, json={"detail": "Not Found"})

    return handler


def test_vllm_is_recognised_and_predictions_round_to_its_block():
    backend = mock_backend(vllm_handler(cached_reported=64), cache_block_tokens=None)
    assert backend.server_info().engine == "vllm" and backend.cache_block_tokens == 16
    assert backend.n_ctx == 32768 and backend.profile_key().engine_version == "0.6.3"
    assert backend.tokenizer.name.startswith("tiktoken") and not backend.tokenizer.exact
    prompt = list(range(100))
    backend.send(ASK, {}, prompt_tokens=prompt).drain()
    assert backend.predict_cached_tokens(prompt[:90] + [9999] * 10) == 80  # LCP 90 → 5 blocks of 16
    assert backend.predict_cached_tokens(prompt) == 96  # at least one token is evaluated again
    assert backend.prefix_reuse is True
    for tokens in (prompt[:90] + [9999] * 10, prompt, [5]):  # the same counts, as data a plan reads
        assert backend.cache_state().cached(tokens) == backend.predict_cached_tokens(tokens)


def test_a_server_that_shows_no_reuse_is_predicted_to_reuse_nothing(caplog):
    backend = mock_backend(vllm_handler(cached_reported=0), cache_block_tokens=None)
    prompt = list(range(100))
    backend.send(ASK, {}, prompt_tokens=prompt).drain()
    assert backend.predict_cached_tokens(prompt + [7]) == 96
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        m = backend.send(ASK, {}, prompt_tokens=prompt + [7]).drain()
        backend.send(ASK, {}, prompt_tokens=prompt + [7, 8]).drain()
    assert m.cached_tokens == 0 and m.server["predicted_cached_tokens"] == 96
    assert backend.prefix_reuse is False and backend.predict_cached_tokens(prompt + [7, 8, 9]) == 0
    assert backend.cache_state().cached(prompt + [7, 8, 9]) == 0
    assert caplog.text.count("reused no cached tokens") == 1


def test_estimated_counts_are_corrected_from_usage():
    backend = mock_backend(vllm_handler(cached_reported=0), cache_block_tokens=1)
    backend.send(ASK, {}, prompt_tokens=list(range(80))).drain()  # the server says 100
    assert backend.token_count_correction == pytest.approx(1.25)
    assert backend.corrected_count(80) == 100


def test_async_url_form_with_a_given_async_client():
    async def run():
        client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: sse_response(*GOOD_STREAM)))
        backend = OpenAIHTTPBackend("http://mock.test/v1", model="m", cache_block_tokens=1, async_http_client=client)
        ts = await backend.asend(ASK, {}, prompt_tokens=[1])
        chunks = [c async for c in ts]
        await client.aclose()
        return chunks, ts.measurement

    chunks, m = asyncio.run(run())
    assert text_of(chunks) == "Hello there" and m.ttft_s is not None and m.finish_reason == "stop"


class _AsyncBreaksAfterFirstChunk(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield sse(chunk(role="assistant"), chunk("Hel"), done=False)
        raise httpx.ReadError("connection reset by peer")


def test_async_retries_refusals_and_interruptions_behave_as_sync():
    calls = []

    def handler(request):
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            return httpx.Response(503, json={"error": {"message": "loading"}})
        if "stream_options" in calls[-1]:
            return httpx.Response(422, json={"detail": "stream_options: extra fields not permitted"})
        if len(calls) == 3:
            return sse_response(*GOOD_STREAM)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_AsyncBreaksAfterFirstChunk())

    async def run():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        backend = OpenAIHTTPBackend("http://mock.test/v1", model="m", cache_block_tokens=1, retry_backoff_s=0.01, async_http_client=client)
        ts = await backend.asend(ASK, {}, prompt_tokens=[1])
        good = [c async for c in ts]
        broken = await backend.asend(ASK, {}, prompt_tokens=[1])
        with pytest.raises(StreamInterruptedError):
            async for _ in broken:
                pass
        await client.aclose()
        return good, ts.measurement, broken

    good, m, broken = asyncio.run(run())
    assert text_of(good) == "Hello there" and m.ttft_s is not None
    assert ["stream_options" in c for c in calls] == [True, True, False, False]  # 503 retried, 422 asked again without
    assert broken.n_content_chunks == 1 and broken.measurement is None


def test_assemble_joins_content_and_tool_calls():
    chunks = [
        chunk(role="assistant"),
        {"id": "c1", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t1", "function": {"name": "get_", "arguments": '{"a"'}}]}}]},
        {"id": "c1", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": ": 1}"}}]}}]},
        chunk(finish="tool_calls"),
    ]
    out = assemble_chat_completion(chunks)
    msg = out["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"a": 1}'}
    assert out["choices"][0]["finish_reason"] == "tool_calls" and out["usage"] is None


def test_assemble_keeps_a_tool_name_that_every_chunk_repeats():
    """llama-cpp-python repeats the whole function name in every streamed tool-call chunk
    (OpenAI sends it once): the assembled call names it once."""
    def piece(args: str, **extra: str) -> dict:
        call = {"index": 0, "function": {"name": "lookup", "arguments": args}, **extra}
        return {"id": "c1", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}

    out = assemble_chat_completion([chunk(role="assistant"), piece('{"q"', id="t1"), piece(': "x"'), piece("}"), chunk(finish="tool_calls")])
    assert out["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"q": "x"}'}


def test_timed_stream_types():
    backend = mock_backend(lambda request: sse_response(*GOOD_STREAM))
    assert isinstance(backend.send(ASK, {}, prompt_tokens=[1]), TimedStream)


def test_trimkit_sends_through_the_client_without_its_own_retries_and_leaves_the_client_as_it_was():
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="x", max_retries=4, timeout=12.0)
    backend = OpenAIHTTPBackend.from_openai_client(client, model="m")
    assert backend.send_client.max_retries == 0 and client.max_retries == 4
    assert backend.send_client.base_url == client.base_url and backend.send_client.timeout == client.timeout
    backend.close()
    client.close()


def test_a_servers_absurd_usage_does_not_skew_the_count_correction_beyond_5x():
    def handler(request):
        usage = {"choices": [], "usage": {"prompt_tokens": 2**31 - 1, "completion_tokens": 1}}
        return sse_response(*GOOD_STREAM, usage)

    backend = mock_backend(handler)
    m = backend.send(ASK, {}, prompt_tokens=list(range(80))).drain()
    assert m.prompt_tokens == 2**31 - 1 and backend.token_count_correction <= 5.0


def test_sse_events_take_bytes_in_any_pieces_and_refuse_an_endless_line():
    from trimkit.errors import MalformedReplyError

    data = b'data: {"a": 1}\r\n\r\n: ping\n\ndata: {"b":\ndata: 2}\r\rdata: [DONE]\n\n'
    whole = list(iter_events([data]))
    pieces = EventReader()
    got = list(iter_events((data[i : i + 1] for i in range(len(data))), pieces))
    assert whole == got == [{"a": 1}, {"b": 2}] and pieces.done

    def endless():  # the bytes of a line that never ends: refused at the cap, not read to the end
        yield b"data: " + b"x" * 2000
        raise AssertionError("read past the cap")

    with pytest.raises(MalformedReplyError, match="longer than"):
        list(iter_events(endless(), EventReader(max_event_bytes=1000)))


@pytest.mark.parametrize("bad", ["x", 0, 2.5, True, None])
def test_max_attempts_must_be_a_positive_int(bad):
    from trimkit.errors import InvalidNumberError

    with pytest.raises(InvalidNumberError):
        OpenAIHTTPBackend("http://127.0.0.1:9/v1", max_attempts=bad)
