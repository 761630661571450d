"""Routing keys and routers (docs/scaling.md §3): a call carries a routing key in the headers the
routers read (``x-session-id``: vllm-router; ``x-smg-routing-key``: sglang-router), given per call
or derived per conversation (a digest, never the text); a router in front of the workers is
recognised and every report says what trimkit's probes could and could not see through it; an
answer that runs past ``max_tokens`` is named in the report.

Here on a scripted loopback server (tests/test_server_faults.py's FaultServer). The router
replies it replays were recorded on this host from the real routers (tests/test_routers_real.py
runs them for real in front of real workers):

- ``VLLM_ROUTER_WORKERS``: ``GET /workers`` of vllm-router 0.1.17 (PyPI ``vllm-router``) routing
  to two workers;
- ``SGLANG_ROUTER_WORKERS`` and ``SGLANG_ROUTER_MODELS``: ``GET /workers`` and ``GET /v1/models``
  of sglang-router 0.3.2 (PyPI ``sglang-router``) — it lists model ``unknown`` owned by ``local``
  itself, whatever its workers serve.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import pytest

import trimkit
from tests._core_helpers import make_profile
from tests.test_server_faults import GOOD_STREAM, FaultServer, chunk, json_reply, sse_reply, status_reply
from trimkit import wrap_url
from trimkit.backends.server import MAX_ROUTING_KEY_CHARS, ROUTING_HEADERS, RoutingOptions, check_routing_key, conversation_key, parse_workers
from trimkit.errors import InvalidInputError
from trimkit.planning.tokens import reusable_prefix_len

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(60)

VLLM_ROUTER_WORKERS = {
    "workers": [
        {"url": "http://127.0.0.1:18101", "model_id": "unknown", "worker_type": "regular", "is_healthy": True, "load": 0,
         "connection_mode": "Http", "priority": 50, "cost": 1.0},
        {"url": "http://127.0.0.1:18102", "model_id": "unknown", "worker_type": "regular", "is_healthy": True, "load": 0,
         "connection_mode": "Http", "priority": 50, "cost": 1.0},
    ],
    "total": 2, "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 2},
}
SGLANG_ROUTER_WORKERS = {
    "workers": [
        {"id": "d8616f50-5d8b-44ae-bc63-dd9d04c5fdd9", "url": "http://127.0.0.1:18101", "model_id": "unknown", "priority": 50, "cost": 1.0,
         "worker_type": "regular", "is_healthy": True, "load": 0, "connection_mode": "HTTP", "disable_health_check": False},
        {"id": "918bdfd4-8791-444b-9968-92fe49feec1c", "url": "http://127.0.0.1:18102", "model_id": "unknown", "priority": 50, "cost": 1.0,
         "worker_type": "regular", "is_healthy": True, "load": 0, "connection_mode": "HTTP", "disable_health_check": False},
    ],
    "total": 2, "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 2},
}
SGLANG_ROUTER_MODELS = {"object": "list", "data": [{"id": "unknown", "object": "model", "owned_by": "local"}]}

SYSTEM = {"role": "system", "content": "Be brief."}


def recording(server: FaultServer, *events: Any) -> list[tuple[dict[str, str], dict[str, Any]]]:
    """Make the server's chat stream ``events`` (a short good answer by default) and record each
    chat request's headers (lower-cased) and body."""
    seen: list[tuple[dict[str, str], dict[str, Any]]] = []
    reply = sse_reply(*(events or GOOD_STREAM))

    def record(h: Any, body: dict[str, Any]) -> None:
        seen.append(({k.lower(): v for k, v in h.headers.items()}, body))
        reply(h, body)

    server.chat(record)
    return seen


def make_chat(form: str, server: FaultServer, **kwargs: Any) -> Any:
    options: dict[str, Any] = dict(profile=make_profile(), summarizer=None)
    options.update(kwargs)
    if form == "url":
        return wrap_url(server.base_url, model="m", **options)
    return trimkit.wrap(openai.OpenAI(base_url=server.base_url, api_key="x"), model="m", **options)


def keys(seen: list[tuple[dict[str, str], dict[str, Any]]]) -> list[tuple[str | None, ...]]:
    return [tuple(h.get(name) for name in ROUTING_HEADERS) for h, _ in seen]


# -- the key ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [5, b"abc", "", "a" * (MAX_ROUTING_KEY_CHARS + 1), "user-1\r\nx-evil: 1", " lead", "tab\there", "café"])
def test_a_bad_routing_key_is_a_typed_error_that_does_not_repeat_it(key):
    with pytest.raises(InvalidInputError) as info:
        check_routing_key(key)
    if isinstance(key, str) and len(key) > 3:
        assert key not in str(info.value)


@pytest.mark.parametrize("key", ["user-42", "a", "a" * MAX_ROUTING_KEY_CHARS, "session 7/b:c=d"])
def test_a_good_routing_key_is_kept_as_given(key):
    assert check_routing_key(key) == key


def test_a_conversation_key_is_stable_across_turns_and_never_the_text():
    first = [SYSTEM, {"role": "user", "content": "When was the lighthouse lit?"}]
    later = [*first, {"role": "assistant", "content": "In 1874."}, {"role": "user", "content": "By whom?"}]
    other = [SYSTEM, {"role": "user", "content": "How tall is the lighthouse?"}]
    key = conversation_key(first)
    assert key == conversation_key(later) == conversation_key(copy.deepcopy(later))
    assert key != conversation_key(other) and key != conversation_key([first[1]])
    assert key.startswith("tk-") and len(key) == 35 and all(c in "0123456789abcdef" for c in key[3:])
    assert check_routing_key(key) == key
    for word in ("lighthouse", "brief", "When"):
        assert word not in key


def test_routing_options_are_checked_at_once(server):
    with pytest.raises(InvalidInputError):
        RoutingOptions.of(auto_routing_key="yes")
    with pytest.raises(InvalidInputError):
        RoutingOptions.of(routing_headers=["x session"])
    with pytest.raises(InvalidInputError):
        RoutingOptions.of(routing_headers="x-session-id")
    assert RoutingOptions.of(routing_headers=["X-Session-ID"]).headers == ("x-session-id",)
    with pytest.raises(InvalidInputError):
        wrap_url(server.base_url, model="m", profile=make_profile(), auto_routing_key=1)
    with pytest.raises(InvalidInputError):
        trimkit.wrap_url([server.base_url, "http://127.0.0.1:9/v1"], model="m", auto_routing_key="on")
    assert server.hits == []


# -- the headers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["url", "openai"])
def test_a_calls_routing_key_goes_in_the_routers_headers_not_in_the_body(server, form):
    seen = recording(server)
    chat = make_chat(form, server)
    messages = [SYSTEM, {"role": "user", "content": "Say hello."}]
    kwargs = {"messages": messages, "max_tokens": 4, "routing_key": "user-42"}
    before = copy.deepcopy(kwargs)
    chat.chat.completions.create(**kwargs)
    assert kwargs == before  # the caller's arguments are not changed
    assert keys(seen) == [("user-42", "user-42")]
    assert "routing_key" not in seen[0][1]
    assert chat.last_report.measurement.server["routing_headers"] == sorted(ROUTING_HEADERS)
    assert "user-42" not in json.dumps(chat.last_report.to_dict(), default=str) and "user-42" not in str(chat.last_report)
    chat.chat.completions.create(messages=messages, max_tokens=4)  # no key, no headers
    assert keys(seen)[1] == (None, None)
    assert "routing_headers" not in chat.last_report.measurement.server


def test_the_callers_own_extra_headers_are_kept_beside_the_key(server):
    seen = recording(server)
    chat = make_chat("openai", server)
    extra = {"X-Trace": "t-1"}
    chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4, routing_key="k-1", extra_headers=extra)
    assert extra == {"X-Trace": "t-1"}
    assert seen[0][0]["x-trace"] == "t-1" and keys(seen) == [("k-1", "k-1")]


@pytest.mark.parametrize("form", ["url", "openai"])
def test_auto_routing_keys_keep_each_conversation_on_its_key(server, form):
    seen = recording(server)
    chat = make_chat(form, server, auto_routing_key=True)
    a = [SYSTEM, {"role": "user", "content": "Question A?"}]
    b = [SYSTEM, {"role": "user", "content": "Question B?"}]
    chat.chat.completions.create(messages=a, max_tokens=4)
    chat.chat.completions.create(messages=b, max_tokens=4)
    later = [*a, {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "More?"}]
    with chat.chat.completions.create(messages=later, max_tokens=4, stream=True) as stream:
        for _ in stream:
            pass
    chat.chat.completions.create(messages=a, max_tokens=4, routing_key="pinned")  # a call's own key wins
    chat.chat.completions.create(messages=a, max_tokens=4, routing_key=None)  # None: no key for this call
    got = keys(seen)
    assert got[0] == got[2] == (conversation_key(a),) * 2
    assert got[1] == (conversation_key(b),) * 2 and got[1] != got[0]
    assert got[3] == ("pinned", "pinned") and got[4] == (None, None)


def test_routing_headers_can_be_named(server):
    seen = recording(server)
    chat = make_chat("url", server, routing_headers=["x-session-id"])
    chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4, routing_key="k")
    assert seen[0][0].get("x-session-id") == "k" and "x-smg-routing-key" not in seen[0][0]


@pytest.mark.parametrize("form", ["url", "openai"])
def test_a_bad_routing_key_raises_before_anything_is_sent(server, form):
    recording(server)
    chat = make_chat(form, server)
    hits = len(server.hits)
    with pytest.raises(InvalidInputError):
        chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4, routing_key="a\nb")
    assert len(server.hits) == hits


async def test_the_async_front_end_sends_the_key_too(server):
    seen = recording(server)
    chat = trimkit.wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="x"), model="m", profile=make_profile(), summarizer=None)
    await chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4, routing_key="async-1")
    chat2 = wrap_url(server.base_url, model="m", profile=make_profile(), summarizer=None, asynchronous=True, auto_routing_key=True)
    messages = [{"role": "user", "content": "hi"}]
    await chat2.chat.completions.create(messages=messages, max_tokens=4)
    assert keys(seen) == [("async-1", "async-1"), (conversation_key(messages),) * 2]


def test_a_fleet_sends_the_key_to_the_endpoint_it_routes_to(server):
    other = FaultServer()
    try:
        seen_a, seen_b = recording(server), recording(other)
        fleet = trimkit.wrap_url([server.base_url, other.base_url], model="m", profile=make_profile(), summarizer=None)
        fleet.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4, routing_key="fleet-1")
        assert keys(seen_a + seen_b) == [("fleet-1", "fleet-1")]
    finally:
        other.close()


# -- the router ------------------------------------------------------------------------------------------
def test_workers_replies_are_read_at_the_boundary():
    vllm = parse_workers(VLLM_ROUTER_WORKERS)
    assert vllm is not None and (vllm.kind, vllm.workers, vllm.healthy, vllm.loads) == ("vllm-router", 2, 2, (0, 0))
    sglang = parse_workers(SGLANG_ROUTER_WORKERS)
    assert sglang is not None and sglang.kind == "sglang-router"
    odd = parse_workers({"workers": [{"url": "http://a", "is_healthy": "yes", "load": -1}]})
    assert odd is not None and odd.healthy is None and odd.loads == (None,)
    for body in (None, [], {"workers": 3}, {"workers": []}, {"workers": [{"name": "a"}]}, {"workers": ["http://a"]}, "workers"):
        assert parse_workers(body) is None
    assert "http://127.0.0.1:18101" not in repr(vllm)  # the workers' URLs are not kept


def llama_server_routes(server: FaultServer) -> None:
    """What llama.cpp's llama-server answers to trimkit's probes: /props with its build, /tokenize, /apply-template."""
    server.routes["/props"] = json_reply({"default_generation_settings": {"n_ctx": 4096}, "build_info": "b9999-test"})

    def tokenize(h: Any, body: dict[str, Any]) -> None:
        json_reply({"tokens": [ord(c) % 1000 for c in str(body.get("content", ""))]})(h, body)

    def apply_template(h: Any, body: dict[str, Any]) -> None:
        json_reply({"prompt": "".join(f"<{m['role']}>{m['content']}\n" for m in body["messages"])})(h, body)

    server.routes["/tokenize"] = tokenize
    server.routes["/apply-template"] = apply_template


def test_a_vllm_router_is_recognised_and_every_report_says_what_it_hid(server, caplog):
    seen = recording(server, chunk(role="assistant"), chunk("Hello"), chunk(finish="stop"))
    server.routes["/workers"] = json_reply(VLLM_ROUTER_WORKERS)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        chat = make_chat("url", server, auto_routing_key=True)
        info = chat.backend.server_info()
        for _ in range(2):
            chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert info.router is not None and info.router.kind == "vllm-router" and not info.router.models_own
    logged = [r.getMessage() for r in caplog.records if "behind vllm-router" in r.getMessage()]
    assert len(logged) == 1 and "routing key" in logged[0]
    r = chat.last_report
    assert r.measurement.server["router"] == "vllm-router" and r.measurement.server["router_workers"] == 2
    note = [w for w in r.warnings if w.startswith("behind vllm-router (2 workers, 2 healthy)")]
    assert len(note) == 1
    assert "could not see which worker answered" in note[0] and "a tokenize endpoint (prompt counts are estimates)" in note[0]
    assert "sent with a routing key (x-session-id, x-smg-routing-key)" in note[0]
    assert "behind vllm-router" in str(r) and keys(seen)[0][0] is not None


def test_an_sglang_router_is_recognised_by_its_workers_and_its_own_model_list(server):
    recording(server)
    server.routes["/workers"] = json_reply(SGLANG_ROUTER_WORKERS)
    server.routes["/v1/models"] = json_reply(SGLANG_ROUTER_MODELS)
    chat = make_chat("url", server)
    chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    router = chat.backend.server_info().router
    assert router is not None and router.kind == "sglang-router" and router.models_own
    note = next(w for w in chat.last_report.warnings if w.startswith("behind sglang-router"))
    assert "the workers' model names (pass model=)" in note and "max_completion_tokens" in note
    assert "sent without a routing key" in note


def test_no_router_no_router_note(server):
    recording(server)
    chat = make_chat("url", server)
    chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.backend.server_info().router is None
    assert "router" not in chat.last_report.measurement.server
    assert not [w for w in chat.last_report.warnings if "router" in w]
    assert server.count("/workers") == 1  # asked once, with the other server facts


@pytest.mark.parametrize("reply", [status_reply(401, {"error": {"message": "no"}}), status_reply(500, {"error": {"message": "boom"}}),
                                   json_reply({"workers": "many"})])
def test_a_workers_endpoint_that_refuses_or_means_something_else_is_no_router(server, reply):
    recording(server)
    server.routes["/workers"] = reply
    chat = make_chat("url", server)
    chat.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.backend.server_info().router is None


def test_no_watched_prefill_behind_a_router(server):
    # llama-server's probes answered through a router that forwards them (vllm-router does): the
    # watched prefill's steps and the chat request could reach different workers, so it is off
    llama_server_routes(server)
    backend = make_chat("url", server).backend
    assert backend.server_info().engine == "llama.cpp" and backend.evaluate_to is not None
    server.routes["/workers"] = json_reply(VLLM_ROUTER_WORKERS)
    behind = make_chat("url", server).backend
    assert behind.server_info().engine == "llama.cpp" and behind.server_info().router is not None
    assert behind.evaluate_to is None


@pytest.mark.parametrize("router", [True, False])
def test_behind_a_router_the_cache_is_predicted_on_the_worker_the_key_stays_on(server, router):
    # two conversations interleaved on one wrapper: behind a router, conversation A's second turn
    # is predicted against A's first (the worker its key stays on), not against B's, the last sent;
    # a server alone holds the last prompt whatever the key
    recording(server)
    if router:
        server.routes["/workers"] = json_reply(VLLM_ROUTER_WORKERS)
    chat = make_chat("url", server, auto_routing_key=True)
    a1 = [SYSTEM, {"role": "user", "content": "Tell me about the harbour and its forty moorings, please."}]
    b1 = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    a2 = [*a1, {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "And the lighthouse?"}]
    for messages in (a1, b1, a2):
        chat.chat.completions.create(messages=messages, max_tokens=4)
    count = chat.backend.tokenizer.prompt_tokens
    on_a, on_b = reusable_prefix_len(count(a1), count(a2)), reusable_prefix_len(count(b1), count(a2))
    assert on_a > on_b > 0
    r = chat.last_report
    assert r.cached_tokens_predicted == r.measurement.server["predicted_cached_tokens"] == (on_a if router else on_b)


# -- an answer longer than asked ------------------------------------------------------------------------------
def long_answer(n: int) -> tuple[Any, ...]:
    usage = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}}
    return (chunk(role="assistant"), *(chunk(f" w{i}") for i in range(n)), chunk(finish="stop"), usage)


@pytest.mark.parametrize("params, named", [({"max_tokens": 3}, "max_tokens=3"), ({"max_completion_tokens": 2}, "max_completion_tokens=2"),
                                           ({"max_tokens": 9, "max_completion_tokens": 4}, "max_completion_tokens=4")])
def test_an_answer_past_max_tokens_is_named_in_the_report(server, params, named):
    recording(server, *long_answer(6))
    chat = make_chat("url", server)
    chat.chat.completions.create(messages=[{"role": "user", "content": "Count to ten."}], **params)
    notes = [w for w in chat.last_report.warnings if "ran past" in w]
    assert len(notes) == 1 and named in notes[0] and "6 completion tokens" in notes[0]


@pytest.mark.parametrize("params", [{"max_tokens": 6}, {"max_tokens": 64}, {}, {"max_tokens": None}])
def test_an_answer_within_max_tokens_says_nothing(server, params):
    recording(server, *long_answer(6))
    chat = make_chat("url", server)
    chat.chat.completions.create(messages=[{"role": "user", "content": "Count to ten."}], **params)
    assert not [w for w in chat.last_report.warnings if "ran past" in w]


@pytest.mark.parametrize("completion_tokens, warned", [(6, False), (7, True)])
def test_with_several_choices_the_limit_is_per_choice(server, completion_tokens, warned):
    choice = {"message": {"role": "assistant", "content": "a b c"}, "finish_reason": "length"}
    server.chat(json_reply({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                            "choices": [{"index": 0, **choice}, {"index": 1, **choice}],
                            "usage": {"prompt_tokens": 9, "completion_tokens": completion_tokens, "total_tokens": 9 + completion_tokens}}))
    chat = make_chat("url", server)
    chat.chat.completions.create(messages=[{"role": "user", "content": "Count to ten."}], max_tokens=3, n=2)
    notes = [w for w in chat.last_report.warnings if "ran past" in w]
    assert bool(notes) is warned
    if warned:
        assert "max_tokens=3 per choice, 6 for n=2: 7 completion tokens" in notes[0]
