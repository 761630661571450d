"""The routers of vLLM and SGLang fleets, for real: ``vllm-router`` and ``sglang-router`` (the
PyPI wheels pinned in constraints.txt) in front of two real ``llama_cpp.server`` workers on
loopback, each behind a :class:`~tests._routers.HealthShim` (neither router registers a worker
without ``GET /health``, which llama-cpp-python's server lacks). The shims record the headers
of every request a worker received, so each test sees where each request went.

What is checked: a routing key keeps each conversation on one worker (vllm-router's
``consistent_hash`` reads ``x-session-id``, sglang-router's ``manual`` reads
``x-smg-routing-key``); the router is recognised and every report says what trimkit's probes
could and could not see through it; sglang-router's rewrite of ``max_tokens`` into
``max_completion_tokens`` (which llama-cpp-python ignores) makes answers run on, and the report
names it — the same request sent to a worker directly keeps to ``max_tokens`` and says nothing.
Skipped, saying why, where a router is not installed (``make venv`` installs both).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests._core_helpers import make_profile
from tests._routers import HealthShim, router_module, running_router
from tests._server import REPLICA_ARGS, running_servers
from trimkit import wrap_url
from trimkit.backends.server import conversation_key

pytestmark = pytest.mark.timeout(600)

#: a short answer: greedy, a few tokens, cut at the first line break
SHORT = {"max_tokens": 6, "temperature": 0.0, "stop": ["\n"]}


@pytest.fixture(scope="module")
def shimmed_workers() -> Iterator[list[HealthShim]]:
    """Two real llama_cpp.server workers (one thread each), each behind a /health shim."""
    with running_servers(2, extra_args=REPLICA_ARGS) as workers:
        shims = [HealthShim(f"http://127.0.0.1:{w.port}") for w in workers]
        try:
            yield shims
        finally:
            for shim in shims:
                shim.close()


def needs(kind: str) -> None:
    if router_module(kind) is None:
        pytest.skip(f"{kind} is not installed (make venv installs it: it is pinned in constraints.txt)")


def chat_on(url: str, **kwargs: Any) -> Any:
    return wrap_url(url, n_ctx=4096, chat_format="gemma-3", profile=make_profile(), summarizer=None, **kwargs)


def conversations(chat: Any, n: int, turns: int) -> list[list[dict[str, Any]]]:
    """``n`` conversations of ``turns`` turns each, interleaved (turn 1 of each, then turn 2, ...)."""
    convs = [[{"role": "system", "content": "Answer in one short line."},
              {"role": "user", "content": f"Conversation {i}: name a colour."}] for i in range(n)]
    for _ in range(turns):
        for i, msgs in enumerate(convs):
            out = chat.chat.completions.create(messages=msgs, **SHORT)
            convs[i] = [*msgs, out["choices"][0]["message"], {"role": "user", "content": "And another one?"}]
    return convs


def workers_of(shims: list[HealthShim], header: str, since: list[int]) -> dict[str, set[int]]:
    """For each routing key: the workers (indexes) whose chat requests carried it since ``since``."""
    where: dict[str, set[int]] = {}
    for i, shim in enumerate(shims):
        for headers, _ in shim.chats()[since[i]:]:
            if header in headers:
                where.setdefault(headers[header], set()).add(i)
    return where


def test_vllm_router_keeps_each_conversation_on_one_worker_and_is_recognised(shimmed_workers):
    needs("vllm-router")
    shims = shimmed_workers
    with running_router("vllm-router", [s.url for s in shims], policy="consistent_hash") as router:
        chat = chat_on(router.base_url, auto_routing_key=True)
        info = chat.backend.server_info()
        since = [len(s.chats()) for s in shims]
        convs = conversations(chat, 4, 3)  # were the key ignored (each body hashed anew), all four would stay put 1 time in 256
    where = workers_of(shims, "x-session-id", since)
    assert set(where) == {conversation_key(c) for c in convs}  # vllm-router forwarded trimkit's x-session-id
    assert all(len(ws) == 1 for ws in where.values()), where  # and kept each conversation on one worker
    assert sum(len(s.chats()) - since[i] for i, s in enumerate(shims)) == 12
    # recognised, and what its probes saw: vllm-router forwards the paths it does not serve to a worker
    assert info.router is not None and (info.router.kind, info.router.workers, info.router.healthy) == ("vllm-router", 2, 2)
    assert info.engine == "llama-cpp-python" and info.tokenize_endpoint == "/extras/tokenize"
    assert chat.backend.evaluate_to is None
    r = chat.last_report
    assert r.measurement.server["router"] == "vllm-router" and r.measurement.ttft_s is not None
    note = next(w for w in r.warnings if w.startswith("behind vllm-router (2 workers, 2 healthy)"))
    assert "/extras/tokenize — from whichever worker the router picked" in note
    assert "could not see which worker answered" in note and "/props (the context size: pass n_ctx=)" in note
    assert "sent with a routing key (x-session-id, x-smg-routing-key)" in note


def test_sglang_router_keeps_conversations_by_its_key_and_its_max_tokens_rewrite_is_caught(shimmed_workers):
    needs("sglang-router")
    shims = shimmed_workers
    count = [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]
    with running_router("sglang-router", [s.url for s in shims], policy="manual") as router:
        chat = chat_on(router.base_url, model="gemma", auto_routing_key=True)
        info = chat.backend.server_info()
        since = [len(s.chats()) for s in shims]
        convs = conversations(chat, 4, 3)  # were the key ignored (a random worker each), all four would stay put 1 time in 256
        where = workers_of(shims, "x-smg-routing-key", since)
        chat.chat.completions.create(messages=count, max_tokens=3, temperature=0.0)
        through = chat.last_report
    assert set(where) == {conversation_key(c) for c in convs} and all(len(ws) == 1 for ws in where.values()), where
    sent = [h for s in shims for h, _ in s.chats()[since[shims.index(s)]:]]
    assert sent and not any("x-session-id" in h for h in sent)  # sglang-router forwards only its own header
    assert info.router is not None and info.router.kind == "sglang-router" and info.router.models_own
    assert info.engine == "unknown" and info.tokenize_endpoint is None  # it answers /v1/models itself and forwards no side endpoint
    # the worker got max_completion_tokens, which llama-cpp-python ignores: the answer ran on, and the report says so
    bodies = [b for s in shims for _, b in s.chats()]
    assert any(b is not None and b"max_completion_tokens" in b and b"max_tokens" not in b.replace(b"max_completion_tokens", b"") for b in bodies)
    assert through.measurement.completion_tokens is not None and through.measurement.completion_tokens > 3
    assert any("ran past max_tokens=3" in w for w in through.warnings)
    assert any(w.startswith("behind sglang-router (2 workers, 2 healthy)") and "max_completion_tokens" in w for w in through.warnings)
    # the same request straight to a worker keeps to max_tokens, and nothing is said
    direct = chat_on(shims[0].url + "/v1")
    direct.chat.completions.create(messages=count, max_tokens=3, temperature=0.0)
    r = direct.last_report
    assert r.measurement.completion_tokens is not None and r.measurement.completion_tokens <= 3
    assert not any("ran past" in w or "router" in w for w in r.warnings)
