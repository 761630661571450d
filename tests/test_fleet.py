"""A fleet of endpoints (trimkit.fleet) on in-memory fake servers: routing (lowest predicted TTFT,
affinity to the replica holding a conversation's prefix, a busy replica losing, other clients' load),
failover before the first token (refused, timed out, died), a stream broken after it, all down,
re-admission after a probe, bad input; and the pure parts (server-load parsers on real-shaped
payloads, the slot wait, held prompts, the health backoff).

The fakes answer at once, so measured TTFTs are tiny; routing runs on the predictions (a
FakeBackend-calibrated profile: ~1.4 ms a prompt token, 50 tokens/s decode).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from typing import Any

import attrs
import httpx
import pytest

import trimkit
from trimkit.backends.server import (
    ServerLoad,
    ServerLoadReader,
    load_from_metrics,
    load_from_sglang,
    load_from_slots,
    parse_prometheus,
)
from trimkit.errors import InvalidInputError, ServerUnreachableError, StreamInterruptedError
from trimkit.fleet import (
    FLEET_BACKEND_DEFAULTS,
    AsyncFleetFrontEnd,
    FleetEndpoint,
    FleetFrontEnd,
    FleetStream,
    FleetUnavailableError,
    slot_wait_s,
    wrap_fleet,
)
from trimkit.testing import FakeBackend, FakeOpenAIServer

SYSTEM = {"role": "system", "content": "You answer questions about the harbour town of Marrowby, briefly and exactly. " * 6}
A, B = "http://a/v1", "http://b/v1"


def ask(topic: str, words: int = 120) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": f"Tell me about the {topic}: " + " ".join(f"{topic}{i}" for i in range(words))}]


def follow_up(messages: list[dict], text: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": "Here is what I know."}, {"role": "user", "content": text}]


class Hosts:
    """Fake OpenAI-compatible servers by host name behind one httpx.MockTransport, with faults."""

    def __init__(self, *names: str) -> None:
        self.servers = {n: FakeOpenAIServer(n_ctx=10**7) for n in names}  # room for answers of any length
        self.refuse: set[str] = set()
        self.chat_fault: dict[str, object] = {}  # host → handler for its chat requests
        self.routes: dict[tuple[str, str], object] = {}  # (host, path) → handler (e.g. /metrics)
        self.log: list[tuple[str, str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.log.append((host, request.method, path))
        if host in self.refuse:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if (host, path) in self.routes:
            return self.routes[(host, path)](request)
        if path.endswith("/chat/completions") and host in self.chat_fault:
            return self.chat_fault[host](request)
        return self.servers[host](request)

    def chats(self, host: str) -> int:
        return sum(1 for h, _, p in self.log if h == host and p.endswith("/chat/completions"))

    def http(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self))


@pytest.fixture
def profile(isolated_cache):
    return trimkit.calibrate(FakeBackend(), mode="quick", store=False)


@pytest.fixture
def hosts():
    return Hosts("a", "b")


def fleet_of(hosts: Hosts, profile, urls=(A, B), **kwargs) -> FleetFrontEnd:
    kwargs.setdefault("ttft_budget_s", 2.0)
    return trimkit.wrap_url(list(urls), model="fake-model", profile=profile, http_client=hosts.http(), **kwargs)


def busy_for(chat, seconds: float, endpoint: int = 0) -> int:
    """``max_tokens`` keeping an endpoint busy ``seconds`` at the decode speed its queue predicts
    with (the fakes answer at once, so the speed learned from their streams is high)."""
    ep = chat.endpoints[endpoint]
    return max(int(ep.queue.tokens_per_s(ep.profile.decode_tokens_per_s) * seconds), 1)


def events(*chunks: dict) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode()


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake-model",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class Breaking(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A stream that sends ``head`` then resets the connection."""

    def __init__(self, head: bytes) -> None:
        self.head = head

    def __iter__(self):
        if self.head:
            yield self.head
        raise httpx.ReadError("connection reset by peer")

    async def __aiter__(self):
        if self.head:
            yield self.head
        raise httpx.ReadError("connection reset by peer")


def breaking(head: bytes):
    return lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Breaking(head))


# -- the same API as one endpoint -------------------------------------------------------------------
def test_a_list_of_urls_is_a_fleet_with_the_one_endpoint_api(hosts, profile):
    with fleet_of(hosts, profile) as chat:
        assert isinstance(chat, FleetFrontEnd) and [ep.label for ep in chat.endpoints] == [A, B]
        assert all(ep.is_up and ep.profile is profile for ep in chat.endpoints)
        out = chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=4)
        assert isinstance(out, dict) and out["choices"][0]["message"]["content"]
        r = chat.last_report
        assert r.endpoint == A and r.model == "fake-model" and r.measured_ttft_s > 0 and r.ttft_budget_s == 2.0
        stream = chat.chat.completions.create(messages=ask("harbour"), max_tokens=3, stream=True)
        assert isinstance(stream, FleetStream)
        with stream:
            chunks = list(stream)
        assert chunks and stream.report is chat.last_report and chat.reports[-2:] == [r, stream.report]
        assert stream.endpoint.label == stream.report.endpoint  # the replica it streams from
        whole = chat.chat.completions.create(messages=ask("quay"), max_tokens=2, n=2)
        assert whole["choices"] and chat.last_report.measurement.ttft_s is None
        assert all(ep.in_flight == 0 for ep in chat.endpoints)
        assert all(ep.backend.max_attempts == FLEET_BACKEND_DEFAULTS["max_attempts"] for ep in chat.endpoints)
    one = trimkit.wrap_url(A, model="fake-model", profile=profile, http_client=hosts.http())
    assert not isinstance(one, FleetFrontEnd) and one.backend.max_attempts == 10  # one URL: as before


def test_max_attempts_given_is_kept(hosts, profile):
    chat = fleet_of(hosts, profile, max_attempts=5)
    assert {ep.backend.max_attempts for ep in chat.endpoints} == {5}


# -- routing ----------------------------------------------------------------------------------------
def test_a_conversation_sticks_to_the_replica_holding_its_prefix(hosts, profile):
    chat = fleet_of(hosts, profile)
    x1, y1 = ask("lighthouse"), ask("ferry")
    busy = chat.chat.completions.create(messages=x1, max_tokens=busy_for(chat, 30), stream=True)  # A works on X for a while
    chat.chat.completions.create(messages=y1, max_tokens=4)
    assert chat.last_report.endpoint == B  # A busy: the free replica takes Y
    busy.close()
    assert chat.endpoints[0].in_flight == 0
    for turn in range(2):
        x = follow_up(x1, f"And the keeper, part {turn}?")
        chat.chat.completions.create(messages=x, max_tokens=4)
        assert chat.last_report.endpoint == A and chat.last_report.cached_tokens_predicted > 200
        x1 = x
        y = follow_up(y1, f"And the timetable, part {turn}?")
        chat.chat.completions.create(messages=y, max_tokens=4)
        assert chat.last_report.endpoint == B and chat.last_report.cached_tokens_predicted > 200
        assert chat.last_report.measurement.cached_tokens == chat.last_report.cached_tokens_predicted  # the server agrees
        y1 = y
    for ep in chat.endpoints:  # what a plan reads of a replica's cache (data) is what the replica predicts
        tokens = ep.backend.tokenizer.prompt_tokens(follow_up(x1, "Once more?"))
        assert ep.backend.cache_state().cached(tokens) == ep.backend.predict_cached_tokens(tokens)


def test_a_busy_replica_loses_only_when_its_wait_outweighs_its_cache(hosts, profile):
    chat = fleet_of(hosts, profile, ttft_budget_s=5.0)
    x1 = ask("lighthouse", words=300)
    chat.chat.completions.create(messages=x1, max_tokens=4)
    assert chat.last_report.endpoint == A
    x2 = follow_up(x1, "And the keeper?")
    short = chat.chat.completions.create(messages=x2, max_tokens=2, stream=True)  # A busy a few ms more
    x3 = follow_up(x2, "And the lamp?")
    chat.chat.completions.create(messages=x3, max_tokens=4)
    assert chat.last_report.endpoint == A  # its prefix saves far more than the wait costs
    short.close()
    long = chat.chat.completions.create(messages=x3, max_tokens=busy_for(chat, 30), stream=True)  # A busy 30 s
    x4 = follow_up(x3, "And the fog bell?")
    chat.chat.completions.create(messages=x4, max_tokens=4)
    r = chat.last_report
    assert r.endpoint == B and r.queue_wait_predicted_s == pytest.approx(0.0)
    long.close()


def test_the_wait_is_planned_against_and_reported(hosts, profile):
    chat = fleet_of(hosts, profile, urls=(A,), ttft_budget_s=1.0)
    frozen = chat.clock()  # the fleet's clocks stand still: no time passes between the calls, however loaded the host
    chat.clock = chat.endpoints[0].clock = chat.endpoints[0].queue.clock = lambda: frozen
    long = chat.chat.completions.create(messages=ask("ferry"), max_tokens=10, stream=True)  # 0.2 s of decode ahead
    chat.chat.completions.create(messages=ask("lighthouse", words=400), max_tokens=4)
    r = chat.last_report
    assert r.endpoint == A and 0.1 < r.queue_wait_predicted_s < 0.3
    assert r.predicted_ttft_s >= r.queue_wait_predicted_s and any("ahead" in w for w in r.warnings)
    long.close()


def test_ties_go_to_the_endpoint_with_fewest_in_flight(hosts, profile):
    chat = fleet_of(hosts, profile, slots=4)  # four requests at once: no wait on either
    held = chat.chat.completions.create(messages=[{"role": "user", "content": "Ferries? " * 300}], max_tokens=50, stream=True)
    assert chat.last_report is None and chat.endpoints[0].in_flight == 1
    chat.chat.completions.create(messages=[{"role": "user", "content": "Tides! " * 300}], max_tokens=4)  # nothing in common: a tie
    assert chat.last_report.endpoint == B
    held.close()


def test_other_clients_load_read_from_the_server_counts(hosts, profile):
    vllm_metrics = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    'vllm:num_requests_running{engine="0",model_name="fake-model"} 1.0\n'
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    'vllm:num_requests_waiting{engine="0",model_name="fake-model"} 3.0\n')
    hosts.routes[("a", "/metrics")] = lambda request: httpx.Response(200, text=vllm_metrics)
    chat = fleet_of(hosts, profile)
    load = chat.endpoints[0].load.read()
    assert load == ServerLoad(running=1, waiting=3, source="/metrics", at=load.at)
    assert chat.endpoints[1].load.read() is None and {"/slots", "/metrics", "/get_load"} <= chat.endpoints[1].load.absent
    chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=4)
    assert chat.last_report.endpoint == B  # A would be first, but four requests of others are ahead there


# -- failover before the first token -----------------------------------------------------------------
def test_a_refusing_endpoint_is_taken_out_and_the_request_served_elsewhere(hosts, profile):
    chat = fleet_of(hosts, profile)
    hosts.refuse.add("a")
    out = chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=4)
    r = chat.last_report
    assert out["choices"] and r.endpoint == B
    assert any(w.startswith(f"failover: {A} failed before the first token (ServerUnreachableError") for w in r.warnings)
    a = chat.endpoints[0]
    assert not a.is_up and "ServerUnreachableError" in a.last_error and a.in_flight == 0 and len(a.held) == 0
    chat.chat.completions.create(messages=ask("ferry"), max_tokens=4)
    assert chat.last_report.endpoint == B and hosts.chats("a") == 0  # out of rotation: not tried again


def test_a_silent_endpoint_times_out_within_the_budget_and_fails_over(hosts, profile):
    def hang(request):
        time.sleep(3.0)
        return hosts.servers["a"](request)

    chat = fleet_of(hosts, profile, ttft_budget_s=0.5)
    hosts.chat_fault["a"] = hang
    chat.chat.completions.create(messages=ask("lighthouse", words=40), max_tokens=4)
    r = chat.last_report
    assert r.endpoint == B  # an endpoint gets at least MIN_ATTEMPT_S (1 s), then the next (how long it took: the host's load)
    assert any("ServerTimeoutError" in w for w in r.warnings)
    assert r.ttft_budget_s < 0.5  # re-planned against what was left of the budget


def test_a_stream_dying_before_its_first_token_moves_to_the_next_endpoint(hosts, profile):
    chat = fleet_of(hosts, profile)
    hosts.chat_fault["a"] = breaking(events(chunk({"role": "assistant"})))  # a role delta, then reset
    stream = chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=4, stream=True)
    chunks = list(stream)
    assert all(c["id"].startswith("chatcmpl-fake") for c in chunks)  # nothing of A's reached the caller
    assert stream.report.endpoint == B and any("StreamInterruptedError" in w for w in stream.report.warnings)
    assert not chat.endpoints[0].is_up and chat.endpoints[0].in_flight == 0


def test_a_call_counts_its_prompt_once_for_routing_and_planning_even_after_a_failover(hosts, profile, monkeypatch):
    """The prompt as given is counted once, for routing, and handed to the pipeline that plans it
    (no second render and tokenize request): after a failover too."""
    chat = fleet_of(hosts, profile)
    counted = []
    tokenizer = type(chat.endpoints[0].backend.tokenizer)  # every endpoint's (the server's /tokenize)
    count = tokenizer.prompt_tokens
    monkeypatch.setattr(tokenizer, "prompt_tokens", lambda self, messages, tools=None: counted.append(list(messages)) or count(self, messages, tools))
    hosts.chat_fault["a"] = breaking(events(chunk({"role": "assistant"})))
    messages = ask("lighthouse")
    chat.chat.completions.create(messages=messages, max_tokens=4)
    assert chat.last_report.endpoint == B and any("StreamInterruptedError" in w for w in chat.last_report.warnings)
    assert counted.count(messages) == 1


def test_a_stream_dying_after_its_first_token_raises_with_its_report(hosts, profile):
    chat = fleet_of(hosts, profile)
    hosts.chat_fault["a"] = breaking(events(chunk({"role": "assistant"}), chunk({"content": "Hi"})))
    stream = chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=4, stream=True)
    with pytest.raises(StreamInterruptedError) as err:
        list(stream)
    report = err.value.report
    assert report is not None and report.endpoint == A and report.measured_ttft_s is not None
    assert not chat.endpoints[0].is_up and chat.endpoints[0].in_flight == 0 and hosts.chats("b") == 0
    hosts.chat_fault["b"] = breaking(events(chunk({"content": "Hi"})))
    with pytest.raises(StreamInterruptedError):  # not streamed: the same error, never a silent retry
        chat.chat.completions.create(messages=ask("ferry"), max_tokens=4)
    assert hosts.chats("b") == 1


def test_all_endpoints_down_is_a_typed_error_listing_what_was_tried(hosts, profile):
    chat = fleet_of(hosts, profile, probe_after_s=60.0)
    hosts.refuse.update({"a", "b"})
    with pytest.raises(FleetUnavailableError) as err:
        chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=4)
    assert isinstance(err.value, ServerUnreachableError)
    assert [label for label, _ in err.value.attempts] == [A, B] and chat.last_report is None
    n = len(hosts.log)
    with pytest.raises(FleetUnavailableError, match="in rotation"):  # both out: refused at once, nothing sent
        chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=4)
    assert len(hosts.log) == n


def test_an_endpoint_comes_back_after_a_probe(hosts, profile):
    chat = fleet_of(hosts, profile, probe_after_s=0.05)
    hosts.refuse.add("a")
    chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=4)
    a = chat.endpoints[0]
    assert not a.is_up
    assert chat.probe_now() == [B] and a.backoff_s == pytest.approx(0.1)  # still refused: the backoff doubles
    hosts.refuse.clear()
    time.sleep(0.15)
    chat.chat.completions.create(messages=ask("ferry"), max_tokens=4)  # starts the due probe in the background
    deadline = time.monotonic() + 5
    while not a.is_up and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.is_up and ("a", "GET", "/v1/models") in hosts.log
    chat.chat.completions.create(messages=[{"role": "user", "content": "Quays? " * 300}], max_tokens=4)
    assert chat.last_report.endpoint == A  # back in rotation (B holds nothing of this prompt: a tie, A first)


def test_an_endpoint_down_at_construction_joins_when_reached(hosts, profile):
    hosts.refuse.add("b")
    chat = fleet_of(hosts, profile, probe_after_s=0.01)
    b = chat.endpoints[1]
    assert b.front is None and not b.is_up and chat.endpoints[0].is_up
    hosts.refuse.clear()
    assert chat.probe_now() == [A, B] and b.front is not None and b.pipeline.endpoint_label == B
    hosts.refuse.update({"a", "b"})
    with pytest.raises(FleetUnavailableError, match="could be reached"):
        fleet_of(hosts, profile)


# -- bad input ----------------------------------------------------------------------------------------
def test_bad_fleets_are_invalid_input_before_anything_is_sent(hosts, profile):
    openai = pytest.importorskip("openai")
    sync_client = openai.OpenAI(base_url=A, api_key="x", http_client=hosts.http())
    async_client = openai.AsyncOpenAI(base_url=B, api_key="x")
    for targets, match in [([], "at least one"), ("http://a/v1", None), ([A, A + "/"], "more than once"), ([A, sync_client], "all URLs"),
                           ([sync_client, async_client], "all URLs"), ([A, 5], "URL or an openai"), (["ftp://a/v1"], "http")]:
        with pytest.raises(InvalidInputError, match=match):
            wrap_fleet(targets, profile=profile, http_client=hosts.http())
    with pytest.raises(InvalidInputError, match="one per endpoint"):
        wrap_fleet([A, B], profile=[profile], http_client=hosts.http())
    with pytest.raises(InvalidInputError, match="several URLs"):
        trimkit.openai_wrapper.wrap_one_url([A, B])
    chat = fleet_of(hosts, profile)
    n = len(hosts.log)
    with pytest.raises(InvalidInputError):
        chat.chat.completions.create(messages=[{"role": "nobody", "content": "x"}])
    with pytest.raises(InvalidInputError):
        chat.chat.completions.create(messages=ask("x"), ttft_budget_s=-1)
    with pytest.raises(InvalidInputError):
        chat.chat.completions.create(messages=ask("x"), on_busy="never")
    for ep in chat.endpoints:  # with no endpoint in rotation too: the input is judged first
        ep.mark_down(ServerUnreachableError("refused"))
    with pytest.raises(InvalidInputError):
        chat.chat.completions.create(messages=[{"role": "nobody", "content": "x"}])
    assert len(hosts.log) == n  # nothing was sent
    sync_client.close()


# -- clients, async, the queue's bookkeeping ----------------------------------------------------------
def test_openai_clients_make_a_fleet_of_their_own_types(hosts, profile):
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletion

    clients = [openai.OpenAI(base_url=u, api_key="x", http_client=hosts.http()) for u in (A, B)]
    chat = wrap_fleet(clients, profile=profile, ttft_budget_s=2.0, model="fake-model", http_client=hosts.http())
    hosts.refuse.add("a")
    out = chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=3)
    assert isinstance(out, ChatCompletion) and chat.last_report.endpoint == B
    chat.close()


def test_the_async_fleet_routes_streams_and_fails_over(hosts, profile):
    async def run():
        chat = fleet_of(hosts, profile, asynchronous=True, async_http_client=httpx.AsyncClient(transport=httpx.MockTransport(hosts)))
        assert isinstance(chat, AsyncFleetFrontEnd)
        out = await chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=3)
        first = chat.last_report
        hosts.refuse.add("a")
        stream = await chat.chat.completions.create(messages=ask("ferry"), max_tokens=3, stream=True)
        async with stream:
            chunks = [c async for c in stream]
        await chat.close()
        return out, first, chunks, stream.report

    out, first, chunks, report = asyncio.run(run())
    assert out["choices"] and first.endpoint == A
    assert chunks and report.endpoint == B and any("failover" in w for w in report.warnings)


def test_concurrent_conversations_are_all_answered_and_leave_nothing_in_flight(hosts, profile):
    from concurrent.futures import ThreadPoolExecutor

    chat = fleet_of(hosts, profile)

    def conversation(i: int) -> list[str]:
        messages, served = ask(f"topic{i}", words=60), []
        for t in range(3):
            stream = chat.chat.completions.create(messages=messages, max_tokens=3, stream=True)
            list(stream)
            served.append(stream.report.endpoint)
            messages = follow_up(messages, f"Turn {t}?")
        return served

    with ThreadPoolExecutor(6) as pool:
        served = list(pool.map(conversation, range(6)))
    assert all(len(s) == 3 and set(s) <= {A, B} for s in served) and len(chat.reports) == 18
    assert all(ep.in_flight == 0 and ep.is_up for ep in chat.endpoints)


def test_a_stream_dropped_unfinished_leaves_the_queue(hosts, profile):
    chat = fleet_of(hosts, profile)
    stream = chat.chat.completions.create(messages=ask("lighthouse"), max_tokens=200, stream=True)
    assert chat.endpoints[0].in_flight == 1
    del stream
    gc.collect()
    assert chat.endpoints[0].in_flight == 0


# -- the pure parts -------------------------------------------------------------------------------------
LLAMA_CPP_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 7.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen2.5-0.5B-Instruct"} 12.0
vllm:num_requests_running_fake{note="a } brace, and spaces"} 99
"""

SGLANG_METRICS = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen/qwen2.5-0.5b-instruct"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen/qwen2.5-0.5b-instruct"} 2.0
"""


def test_metrics_of_each_engine_are_parsed():
    assert load_from_metrics(LLAMA_CPP_METRICS) == ServerLoad(running=2, waiting=5, source="/metrics")
    assert load_from_metrics(VLLM_METRICS) == ServerLoad(running=4, waiting=7, source="/metrics")
    assert load_from_metrics(SGLANG_METRICS) == ServerLoad(running=4, waiting=2, source="/metrics")
    assert load_from_metrics("# nothing here\nprocess_cpu_seconds_total 1.5\n") is None
    assert parse_prometheus('x{a="}"} 3 1700000000\nx 2\nx NaN\ny junk\n', ["x", "y"]) == {"x": 5.0}
    assert load_from_metrics("llamacpp:requests_processing 1e30\n") == ServerLoad(running=None, waiting=None, source="/metrics")


def test_slots_and_sglang_loads_are_parsed():
    slots = [{"id": 0, "id_task": 135, "n_ctx": 65536, "speculative": False, "is_processing": True, "params": {"n_predict": -1}},
             {"id": 1, "id_task": -1, "n_ctx": 65536, "speculative": False, "is_processing": False}]
    assert load_from_slots(slots) == ServerLoad(running=1, slots=2, source="/slots")
    old = [{"id": 0, "state": 1, "prompt": "Say hello"}, {"id": 1, "state": 0}, {"id": 2, "state": 0}]
    assert load_from_slots(old) == ServerLoad(running=1, slots=3, source="/slots")
    assert load_from_slots({"detail": "Not Found"}) is None and load_from_slots([{"id": 0}]) is None
    get_load = [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 812}, {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0}]
    assert load_from_sglang(get_load) == ServerLoad(running=4, waiting=2, source="/get_load")
    loads = {"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "token_usage": 0.2}]}
    assert load_from_sglang(loads) == ServerLoad(running=3, waiting=2, source="/get_load")
    assert load_from_sglang({"status": "ready"}) is None and load_from_sglang([{"num_reqs": 1}]) is None


def test_the_reader_remembers_what_a_server_lacks_and_never_blocks_a_request():
    asked: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=LLAMA_CPP_METRICS)
        return httpx.Response(404, json={"detail": "Not Found"})

    clock = [100.0]
    reader = ServerLoadReader(httpx.Client(transport=httpx.MockTransport(handle)), "http://s", clock=lambda: clock[0], max_age_s=0.0)
    assert reader.read().requests == 7 and asked == ["/slots", "/metrics", "/get_load"]
    assert reader.read().running == 2 and asked[3:] == ["/metrics"]  # the absent ones are not asked again
    clock[0] += 601.0
    reader.read()
    assert asked[4:] == ["/slots", "/metrics", "/get_load"]  # ... until the re-check

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    down = ServerLoadReader(httpx.Client(transport=httpx.MockTransport(broken)), "http://s", clock=lambda: clock[0])
    assert down.read() is None and down.absent == {"/slots", "/metrics", "/get_load"}
    assert down.latest() is None  # nothing to ask until the retry: no thread, no wait
    live = ServerLoadReader(httpx.Client(transport=httpx.MockTransport(handle)), "http://s")
    assert live.latest() is None  # the first reading is fetched in the background
    deadline = time.monotonic() + 5
    while live.latest() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.latest().waiting == 5


def test_the_slot_wait_is_first_come_first_served():
    assert slot_wait_s([], 1) == 0.0 and slot_wait_s([1.0, 2.0], 1) == 3.0
    assert slot_wait_s([1.0, 2.0], 2) == 1.0 and slot_wait_s([1.0], 2) == 0.0
    assert slot_wait_s([3.0, 1.0, 1.0], 2) == 2.0  # the second slot frees at 1, takes the third, frees at 2


def test_held_prompts_and_health():
    from types import SimpleNamespace

    now = [10.0]

    def refuse():
        raise ServerUnreachableError("refused")

    backend = SimpleNamespace(prefix_reuse=True, cache_block_tokens=1, server_info=lambda: SimpleNamespace(engine="llama.cpp", metrics_off=False))
    ep = FleetEndpoint("x", backend, refuse, slots=1, held_prompts=2, probe_after_s=1.0, probe_max_s=3.0, clock=lambda: now[0])
    first, second, third = (ep.queue.enter() for _ in range(3))

    def cached(tokens):  # what the endpoint predicts from the prompts it holds
        return ep.cache_state().cached(tokens)

    ep.sent(first, [1, 2, 3, 4])
    ep.sent(second, [1, 2, 9, 9])
    assert cached([1, 2, 3, 4, 5]) == 4 and cached([1, 2, 3, 4]) == 3  # one token always evaluated
    ep.sent(third, [7, 7])
    assert cached([1, 2, 3, 4, 5]) == 2 and len(ep.held) == 2  # the oldest left
    ep.release(second, failed=True)
    assert cached([1, 2, 3]) == 0
    ep.probe(first=True)  # refused: out of rotation for probe_after_s
    assert not ep.is_up and ep.retry_at == 11.0 and "refused" in ep.last_error
    now[0] = 10.5
    ep.maybe_probe(wait=True)  # not due yet
    assert ep.backoff_s == 1.0
    now[0] = 11.0
    ep.maybe_probe(wait=True)  # due, and refused again: the wait doubles
    now[0] = 13.0
    ep.maybe_probe(wait=True)  # up to probe_max_s
    assert ep.backoff_s == 3.0 and ep.retry_at == 16.0
    ep.build = object  # it answers now
    now[0] = 16.0
    ep.maybe_probe(wait=True)
    assert ep.is_up and ep.retry_at is None and ep.backoff_s == 0.0


def test_when_every_endpoint_must_trim_the_one_that_keeps_the_most_wins():
    """A replica holding the prefix behind a long queue beats an idle one on total predicted
    TTFT, but with a budget neither meets untrimmed, it would trim the prompt to nothing: the
    router picks the endpoint that keeps the most of the prompt within the budget."""
    from types import SimpleNamespace

    from trimkit.fleet import RouteCost, best_route

    busy = RouteCost(SimpleNamespace(label="busy"), wait_s=1.9, cached_tokens=900, prefill_s=0.4, decode_s=1.0, in_flight=2,
                     kept_tokens=950, budget_s=1.0)
    idle = RouteCost(SimpleNamespace(label="idle"), wait_s=0.0, cached_tokens=0, prefill_s=3.5, decode_s=1.0, in_flight=0,
                     kept_tokens=300, budget_s=1.0)
    assert busy.ttft_s < idle.ttft_s and not busy.fits and not idle.fits
    busy_nothing = attrs.evolve(busy, kept_tokens=0)
    assert best_route([busy_nothing, idle]).endpoint.label == "idle"
    assert best_route([busy, idle]).endpoint.label == "busy"  # it still keeps more
    # one that fits untrimmed always wins over those that must trim
    fits = attrs.evolve(idle, prefill_s=0.5)
    assert best_route([busy, fits]).endpoint.label == "idle"
    # a queued request counts in the queue at most at the budget left after its wait
    assert idle.planned_prefill_s == 1.0 and busy_nothing.planned_prefill_s == 0.0
    # without a budget, the lowest predicted TTFT wins as before
    assert best_route([attrs.evolve(busy, budget_s=None, kept_tokens=None), attrs.evolve(idle, budget_s=None, kept_tokens=None)]).endpoint.label == "busy"


def test_identical_replicas_share_one_profile(hosts, isolated_cache):
    """Only replica A has a stored profile; B — the same engine, model and context — starts from
    it instead of calibrating on its own (the fakes have nothing to calibrate against: without
    sharing, B could not be built and would stay down)."""
    from trimkit._calibration import save_profile
    from trimkit.backends.http import OpenAIHTTPBackend

    stored = trimkit.calibrate(FakeBackend(), mode="quick", store=False)
    key_a = OpenAIHTTPBackend(A, model="fake-model", http_client=hosts.http()).profile_key()
    save_profile(attrs.evolve(stored, key=key_a))
    chat = trimkit.wrap_url([A, B], model="fake-model", http_client=hosts.http(), ttft_budget_s=2.0)
    a, b = chat.endpoints
    assert a.is_up and b.is_up
    assert a.profile.model == b.profile.model == stored.model


# /props as llama-server builds it (ggml-org/llama.cpp tools/server/server-context.cpp, get_res_props)
def props(metrics: bool) -> Any:
    body = {"default_generation_settings": {"n_ctx": 8192}, "total_slots": 1, "build_info": "b8000-abc",
            "endpoint_slots": True, "endpoint_metrics": metrics, "is_sleeping": False}
    return lambda request: httpx.Response(200, json=body)


@pytest.mark.parametrize("metrics, read_load, warned", [(False, True, 2), (True, True, 0), (False, False, 0)])
def test_the_metrics_flag_is_named_where_the_fleet_would_read_it(hosts, profile, caplog, metrics, read_load, warned):
    for host in ("a", "b"):
        hosts.routes[(host, "/props")] = props(metrics)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        fleet_of(hosts, profile, read_load=read_load)
    assert len([r for r in caplog.records if "--metrics" in r.getMessage()]) == warned  # once per endpoint
