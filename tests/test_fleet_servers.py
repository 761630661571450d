"""A fleet of two REAL llama-cpp-python servers on loopback (``python -m llama_cpp.server``, one
thread each, the embedded Gemma-3-270M): each endpoint micro-calibrated at construction, a
conversation kept on the replica that holds its prefix, and failover when a server process is
killed — before a request's first token it moves to the other replica; a stream in flight breaks
with its report; with both dead the fleet says so.

llama-cpp-python's server exposes no load (no ``/slots``, ``/metrics``, ``/get_load``): the fleet
counts what it sent. Both servers are stopped at the end of the module whatever happens.
"""

from __future__ import annotations

import httpx
import pytest

import trimkit
from tests._server import two_llama_servers  # noqa: F401
from trimkit.backends.llama import llama_prompt_tokenizer
from trimkit.backends.replies import chunk_content
from trimkit.errors import StreamInterruptedError
from trimkit.fleet import FleetFrontEnd, FleetUnavailableError

BAN_END = {"1": -100.0, "106": -100.0}  # Gemma's <eos> and <end_of_turn>: the model keeps talking
SYSTEM = {"role": "system", "content": "You answer questions about the harbour town of Marrowby in one short sentence."}
#: the fleet's budget: loose, so that a slow moment of a shared host (a replica not answering
#: within the budget is taken out of rotation, by design) is not mistaken for the killed replica
#: or the routing these tests are about
LOOSE_S = 20.0
CHUNKS = [f"Record {i}: the {'north south east west'.split()[i % 4]} pier of Marrowby was rebuilt in {1880 + i} after a storm." for i in range(12)]


STREETS = [f"Street {i}: {name} Lane runs from the {'north south east west'.split()[i % 4]} gate to the market." for i, name in
           enumerate("Rope Tar Gull Anchor Salt Kelp Mast Net Oar Reef Sail Tide".split())]


def pasted(records: list[str], question: str) -> list[dict]:
    """A conversation that starts with a document pasted into its first message (its own long prefix)."""
    return [SYSTEM, {"role": "user", "content": "\n".join(records) + "\n\n" + question}]


def turn(history: list[dict], question: str) -> list[dict]:
    return [*history, {"role": "user", "content": question}]


def answered(history: list[dict], out: dict) -> list[dict]:
    return [*history, {"role": "assistant", "content": out["choices"][0]["message"]["content"] or "…"}]


class Paths:
    """An httpx event hook keeping the path of every request sent."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> None:
        self.paths.append(request.url.path)


@pytest.fixture(scope="module")
def sent_paths():
    return Paths()


@pytest.fixture(scope="module")
def fleet(two_llama_servers, sent_paths):  # noqa: F811
    """The replicas of the embedded model, counted locally and exactly (the GGUF's vocabulary,
    Gemma 3's template): routing and planning never ask a server that is busy (llama-cpp-python's
    server answers a tokenize request only once its model is free)."""
    a, b = two_llama_servers
    tokenizer = llama_prompt_tokenizer(trimkit.default_llama("gemma", vocab_only=True, n_ctx=512))
    chat = trimkit.wrap_url([a.base_url, b.base_url], ttft_budget_s=LOOSE_S, tokenizer=tokenizer, n_ctx=4096,
                            http_client=httpx.Client(event_hooks={"request": [sent_paths]}))
    yield chat
    chat.close()


def test_each_replica_is_reached_calibrated_and_shows_no_load(fleet, two_llama_servers):  # noqa: F811
    assert isinstance(fleet, FleetFrontEnd) and [ep.label for ep in fleet.endpoints] == [s.base_url for s in two_llama_servers]
    for ep in fleet.endpoints:
        assert ep.is_up and ep.profile.model.per_token_s > 0 and ep.slots == 1 and ep.backend.prompt_count_exact
        assert ep.load.read() is None and ep.load.absent == {"/slots", "/metrics", "/get_load"}


def test_a_real_conversation_sticks_to_the_replica_holding_it(fleet, sent_paths):
    sent_paths.paths.clear()  # (reaching a server asks which tokenize endpoint it has, once)
    x = pasted(CHUNKS, "Which pier was rebuilt first?")
    busy = fleet.chat.completions.create(messages=x, max_tokens=400, logit_bias=BAN_END, stream=True)
    a = busy.endpoint.label  # the replica predicted faster (each has its own profile)
    b = next(ep.label for ep in fleet.endpoints if ep.label != a)
    y = pasted(STREETS, "Name one street of Marrowby.")
    out_y = fleet.chat.completions.create(messages=y, max_tokens=8)
    assert fleet.last_report.endpoint == b  # a works on X: the idle replica takes Y
    busy.close()
    x = [*x, {"role": "assistant", "content": "The north pier."}]
    y = answered(y, out_y)
    for question in ("And the last one?", "Who rebuilt it?"):
        x = turn(x, question)
        out = fleet.chat.completions.create(messages=x, max_tokens=8)
        r = fleet.last_report
        assert r.endpoint == a and r.cached_tokens_predicted > 200 and r.measured_ttft_s > 0
        x = answered(x, out)
        y = turn(y, question)
        out = fleet.chat.completions.create(messages=y, max_tokens=8)
        assert fleet.last_report.endpoint == b and fleet.last_report.cached_tokens_predicted > 150
        y = answered(y, out)
    assert all(ep.in_flight == 0 for ep in fleet.endpoints)
    assert not any("tokenize" in p for p in sent_paths.paths)  # counted locally


def test_a_replica_killed_between_requests_fails_over_before_the_first_token(fleet, two_llama_servers):  # noqa: F811
    # the document pasted into the first message: a long prefix that only the replica answering it
    # holds, so that the fleet routes the follow-up there (retrieved chunks would move to each new
    # user turn, hold nothing, and leave the choice to the two replicas' speeds of the moment)
    x = pasted(CHUNKS, "Which pier is the longest?")
    out = fleet.chat.completions.create(messages=x, max_tokens=8, ttft_budget_s=LOOSE_S)
    i = [ep.label for ep in fleet.endpoints].index(fleet.last_report.endpoint)
    a, b = fleet.endpoints[i], fleet.endpoints[1 - i]
    assert a.is_up and b.is_up
    two_llama_servers[i].proc.kill()  # the replica holding the conversation dies; the fleet does not know yet
    two_llama_servers[i].proc.wait(timeout=10)
    out = fleet.chat.completions.create(messages=turn(answered(x, out), "And the shortest?"), rag_chunks=STREETS[:4], max_tokens=8,
                                        ttft_budget_s=LOOSE_S)
    r = fleet.last_report
    assert out["choices"][0]["message"]["role"] == "assistant" and r.endpoint == b.label
    assert any(w.startswith(f"failover: {a.label} failed before the first token") for w in r.warnings)
    assert not a.is_up and a.in_flight == 0 and fleet.probe_now() == [b.label]  # a stays out: its probe is refused


def test_the_last_replica_killed_mid_stream_raises_with_its_report_then_all_are_down(fleet, two_llama_servers):  # noqa: F811
    stream = fleet.chat.completions.create(messages=turn([SYSTEM], "Tell me about the piers."), rag_chunks=CHUNKS, max_tokens=400,
                                           logit_bias=BAN_END, stream=True, ttft_budget_s=LOOSE_S)
    i = fleet.endpoints.index(stream.endpoint)
    a, b = fleet.endpoints[1 - i], fleet.endpoints[i]  # b: the one still up, and streaming
    assert not a.is_up
    with pytest.raises(StreamInterruptedError) as err:
        for c in stream:
            if chunk_content(c):
                two_llama_servers[i].proc.kill()
                two_llama_servers[i].proc.wait(timeout=10)
    report = err.value.report
    assert report is not None and report.endpoint == b.label and report.measured_ttft_s > 0
    assert not b.is_up and b.in_flight == 0
    with pytest.raises(FleetUnavailableError) as down:
        fleet.chat.completions.create(messages=turn([SYSTEM], "Hello?"), max_tokens=4)
    assert {label for label, _ in down.value.attempts} == {a.label, b.label}
