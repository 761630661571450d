"""The watched prefill on the real engine (llama-cpp-python in process): a profile made five times
too optimistic on purpose sends a prompt that cannot fit; the watch measures the pace after its
first step and re-plans. Nothing here asserts a wall-clock time: the counts are llama.cpp's own."""

from __future__ import annotations

import copy

import attrs

import trimkit
from trimkit.cli import load_corpus
from trimkit.planning.watch import FIRST_STEP_TOKENS

SYSTEM = {"role": "system", "content": "You answer questions about the town of Marrowby briefly."}
QUESTION = "When was the lighthouse first lit?"


def request():
    chunks = [trimkit.Chunk(text=d["text"], id=d["id"], score=1.0 - i / 100) for i, d in enumerate(load_corpus()[:14])]
    return [SYSTEM, {"role": "user", "content": QUESTION}], chunks


def optimistic_chat(llm, quick_profile, messages, chunks):
    """A chat whose profile is five times too optimistic about this request, under a budget of half
    what the whole request costs this engine now (llama.cpp's own prefill time, unbudgeted)."""
    plain = trimkit.wrap(llm, profile=quick_profile, summarizer=None)
    llm.reset()
    plain.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=1)
    m = plain.last_report.measurement
    truth = m.engine_prefill_s / quick_profile.predict_prefill_s(m.evaluated_tokens, 0)  # the host's speed vs the profile, now
    optimistic = attrs.evolve(quick_profile, drift=quick_profile.drift * truth / 5, created_at=quick_profile.created_at + 1)
    return trimkit.wrap(llm, ttft_budget_s=0.5 * m.engine_prefill_s, profile=optimistic, summarizer=None)


def test_a_five_times_optimistic_profile_is_replanned_and_the_evaluated_prefix_is_kept(llm, quick_profile):
    messages, chunks = request()
    given = copy.deepcopy((messages, chunks))
    chat = optimistic_chat(llm, quick_profile, messages, chunks)
    llm.reset()  # a cold context: the whole prompt is evaluated by this request
    stream = chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=8, temperature=0.0, stream=True)
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in stream)
    r = stream.report
    assert (messages, chunks) == given  # the caller's data is untouched
    assert r.watched and 1 <= len(r.replans) <= 2
    first = r.replans[0]
    assert first.pace > 2.0  # measured: the profile priced it far too cheap
    assert first.evaluated_tokens < first.prompt_tokens and first.dropped
    # the evaluated prefix was reused: llama.cpp evaluated the prompt sent, and beyond it at most
    # what the re-plan could not keep; after a long step the cut keeps all of it (each token once)
    assert r.prompt_tokens <= r.measurement.evaluated_tokens <= r.prompt_tokens + first.evaluated_tokens
    assert r.prompt_tokens < r.prompt_tokens_before
    if first.evaluated_tokens > FIRST_STEP_TOKENS and len(r.replans) == 1 and first.dropped and r.prompt_tokens > first.evaluated_tokens:
        assert r.measurement.evaluated_tokens == r.prompt_tokens
    # the completion is valid, and the system prompt and the question reached the model
    assert text and r.measurement.finish_reason in ("stop", "length")
    sent = stream.prepared.messages
    assert sent[0] == SYSTEM and sent[-1]["content"].rstrip().endswith(QUESTION)
    rendered = llm.detokenize(list(stream.prepared.prompt_tokens)).decode("utf-8", "ignore")
    assert SYSTEM["content"] in rendered and QUESTION in rendered
    # what the re-plan cut is gone, the rest stays (how many chunks fit depends on the host's pace now)
    kept = [c.id for c in stream.prepared.plan.kept_chunks]
    assert set(first.dropped).isdisjoint(kept) and set(kept) | set(first.dropped) <= {c.id for c in chunks}
    assert "re-planned after" in str(r) and r.to_dict()["replans"]


def test_a_replanned_completion_counts_the_prompt_it_sent(llm, quick_profile):
    """Not streamed: the completion's usage, the report and ``last_prepared`` all state the
    re-plan's prompt — what llama.cpp evaluated — not the plan made before the watch."""
    messages, chunks = request()
    chat = optimistic_chat(llm, quick_profile, messages, chunks)
    llm.reset()
    out = chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=2, temperature=0.0)
    r = chat.last_report
    assert r.replans  # the watch cut the plan
    assert out["usage"]["prompt_tokens"] == r.prompt_tokens == r.measurement.prompt_tokens == r.replans[-1].prompt_tokens_after
    assert r.prompt_tokens < r.replans[0].prompt_tokens
    assert chat.last_prepared.replans == r.replans and len(chat.last_prepared.prompt_tokens) == r.prompt_tokens


def test_on_a_true_profile_a_request_that_fits_is_watched_and_sent_as_planned(llm, quick_profile):
    messages, chunks = request()
    chat = trimkit.wrap(llm, ttft_budget_s=1e4, profile=quick_profile, summarizer=None)
    llm.reset()
    out = chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, temperature=0.0)
    r = chat.last_report
    assert r.watched and r.replans == () and r.passthrough
    assert r.measurement.evaluated_tokens == r.prompt_tokens
    assert out["choices"][0]["message"]["content"] is not None
