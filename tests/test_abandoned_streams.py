"""Streams a caller abandons (``for chunk in stream: break``, or an unfinished stream dropped) on
a REAL loopback server: each is closed at once, on the caller's thread, so its connection goes
back to the pool — never later by the cyclic garbage collector on whatever thread it runs (inside
httpcore's pool, holding its lock, that deadlocked every later request: issue 34, item 1).

The garbage collector is switched off while these run: what is freed must be freed by reference
counting alone."""

from __future__ import annotations

import gc
import weakref

import httpx
import pytest

import trimkit
from tests.test_server_faults import ASK, PROFILE, FaultServer, chunk, hang, make_chat, sse_reply
from trimkit import wrap_url

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def endless(server: FaultServer) -> None:
    """A stream that sends its first content and then holds the connection open (a long answer)."""
    server.chat(sse_reply(chunk(role="assistant"), chunk("Hello"), done=False, then=hang))


def test_a_stream_left_after_its_first_chunk_gives_its_connection_back_at_once(server, no_gc):
    endless(server)
    http = httpx.Client(limits=httpx.Limits(max_connections=2, max_keepalive_connections=2))
    chat = wrap_url(server.base_url, model="m", profile=PROFILE, ttft_budget_s=0.5, retry_deadline_s=1.0, summarizer=None, http_client=http)
    try:
        for _ in range(8):  # more than the pool holds: a stream not closed keeps its connection
            for c in chat.chat.completions.create(messages=ASK, stream=True):
                assert c["choices"][0]["delta"]
                break
        server.chat(sse_reply(chunk(role="assistant"), chunk("Hello"), chunk(finish="stop")))
        out = chat.chat.completions.create(messages=ASK)
        assert out["choices"][0]["message"]["content"] == "Hello"
        assert server.count("/v1/chat/completions") == 9
    finally:
        chat.close()
        http.close()


@pytest.mark.parametrize("form", ["url", "openai", "fleet"])
def test_an_unfinished_stream_is_freed_without_the_cyclic_collector(server, no_gc, form):
    endless(server)
    options = dict(profile=PROFILE, ttft_budget_s=0.5, retry_deadline_s=1.0, summarizer=None)
    if form == "fleet":
        chat = trimkit.wrap_url([server.base_url], model="m", **options)
    else:
        chat = make_chat(form, server, **options)
    try:
        stream = chat.chat.completions.create(messages=ASK, stream=True)
        next(stream)
        refs = [weakref.ref(stream), weakref.ref(stream.timed)]  # a fleet's stream is the endpoint's reporting stream
        del stream
        assert [r() for r in refs] == [None, None]  # no reference cycle holds them
        if form == "fleet":
            assert [ep.in_flight for ep in chat.endpoints] == [0]
    finally:
        chat.close()
