"""The watched prefill (trimkit/planning/watch.py, the pipeline's WatchedPrefill): a fake engine
whose speed changes in the middle of a prefill, on a fake clock — exact, no wall-clock time."""

from __future__ import annotations

import copy
import math

import pytest

import trimkit
from tests._core_helpers import TRUE_MODEL, make_profile
from trimkit.planning.costs import PrefillSample
from trimkit.planning.speed import tail_share
from trimkit.planning.watch import FIRST_STEP_TOKENS, MAX_REPLANS, PrefillWatch
from trimkit.testing import FakeBackend, FakeClock

WORDS = "the harbour records list every vessel with its tonnage, its crew and the day it first sailed from the quay".split()


def chunk_text(i: int, words: int = 120) -> str:
    return f"Record {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) + "."


def rag_request(n_chunks: int = 20) -> tuple[list[dict], list[trimkit.Chunk]]:
    messages = [{"role": "system", "content": "Answer from the records."},
                {"role": "user", "content": "Which vessel sailed first from the quay?"}]
    chunks = [trimkit.Chunk(text=chunk_text(i), score=1.0 - i / 20, id=f"doc-{i}") for i in range(n_chunks)]
    return messages, chunks


def wrapped(pace=None, *, watch: bool = True):
    clock = FakeClock()
    fake = FakeBackend(TRUE_MODEL, clock=clock, n_ctx=16384, first_token_s=0.02, pace=pace)
    chat = trimkit.wrap(fake, profile=make_profile(), clock=clock, summarizer=None, watch_prefill=watch)
    return fake, chat


def untrimmed_ttft(n_chunks: int = 20) -> float:
    fake, chat = wrapped(watch=False)
    messages, chunks = rag_request(n_chunks)
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4)
    return chat.last_report.predicted_ttft_before_s


@pytest.mark.parametrize("slower", [2.0, 4.0])
def test_a_host_that_slows_down_mid_prefill_is_replanned_inside_the_budget(slower):
    budget = 0.8 * untrimmed_ttft(40)
    messages, chunks = rag_request(40)
    # calibrated speed for the steps that start in the first 500 tokens of the ~6,000-token
    # prompt, then `slower` times slower
    fake, chat = wrapped(pace=lambda position: 1.0 if position < 500 else slower)
    given, given_chunks = copy.deepcopy(messages), copy.deepcopy(chunks)
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    r = chat.last_report
    assert messages == given and chunks == given_chunks  # the caller's data is untouched
    assert r.watched and 1 <= len(r.replans) <= MAX_REPLANS
    assert r.measured_ttft_s <= budget
    # no token evaluated twice: every step starts where the context's kept prefix ends
    spans = fake.steps
    assert all(b >= 0 for b, _ in spans)
    assert sum(e - b for b, e in spans) == r.measurement.evaluated_tokens
    covered = set()
    for b, e in spans:
        assert not covered & set(range(b, e)), "a token was evaluated twice"
        covered |= set(range(b, e))
    # the report says what happened
    x = r.replans[0]
    assert x.pace > 1.5 and x.dropped
    text = str(r)
    assert "re-planned after" in text and f"{x.pace:.2f}× the predicted time" in text
    assert r.to_dict()["replans"][0]["evaluated_tokens"] == x.evaluated_tokens
    assert "replans=" in r.log_line()
    # the system prompt and the question reach the engine
    sent = fake.calls[-1][0]
    assert sent[0]["content"] == "Answer from the records."
    assert "Which vessel sailed first from the quay?" in sent[-1]["content"]


def test_the_open_loop_arm_misses_where_the_watch_holds():
    budget = 0.8 * untrimmed_ttft()
    messages, chunks = rag_request()
    fake, chat = wrapped(pace=lambda position: 1.0 if position < 600 else 4.0, watch=False)
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    r = chat.last_report
    assert not r.watched and not r.replans
    assert r.measured_ttft_s > budget


@pytest.mark.parametrize("share", [0.8, 0.5, 0.3])
def test_on_pace_nothing_is_replanned_and_the_plan_is_sent_as_made(share):
    """Also where the plan trims much (its prompt far shorter than the untrimmed one): the watch
    holds the request to the target the plan filled to, not to a stricter one."""
    budget = share * untrimmed_ttft()
    messages, chunks = rag_request()
    fake, chat = wrapped()
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    r = chat.last_report
    assert r.watched and r.replans == ()
    assert r.budget_met
    assert len(fake.steps) >= 2 and fake.steps[0][1] - fake.steps[0][0] == FIRST_STEP_TOKENS
    assert "on pace, no re-plan" in str(r)


def test_a_request_without_a_budget_or_too_short_is_not_watched():
    fake, chat = wrapped()
    chat.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2, ttft_budget_s=5.0)
    assert not chat.last_report.watched and fake.steps == []
    messages, chunks = rag_request()
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=2)
    assert not chat.last_report.watched and fake.steps == []


def test_a_faster_host_puts_back_what_the_plan_dropped_and_its_prefill_feeds_the_one_speed_estimate():
    budget = 0.8 * untrimmed_ttft()
    messages, chunks = rag_request()
    fake, chat = wrapped(pace=lambda position: 0.5)
    before = chat.engine.speed.observations
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    r = chat.last_report
    [x] = r.replans  # one re-plan, after the first long step: the dropped chunks go back before the question
    assert x.pace == pytest.approx(0.5) and all(d.startswith("+") for d in x.dropped)
    assert "put back doc-" in str(r) and r.budget_met and r.prompt_tokens > r.replans[0].prompt_tokens
    assert r.measurement.evaluated_tokens == r.prompt_tokens  # nothing evaluated twice
    # the watched evaluation is one sample (not one per step), and not fed twice after the response
    assert chat.engine.speed.observations - before == 1 and len(fake.steps) > 2
    assert chat.engine.speed.samples[-1].seconds == pytest.approx(chat.last_report.measurement.engine_prefill_s)
    for _ in range(2):
        fake.kv = []
        chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    assert chat.profile.drift == pytest.approx(0.5, rel=0.02)  # 3 of the latest 5 say the host is twice as fast


def chunk_order(sent_messages) -> list[str]:
    """The chunk ids of the last user message, in the order the prompt shows them."""
    import re

    return re.findall(r"^\[(doc-\d+)\]", sent_messages[-1]["content"], flags=re.M)


@pytest.mark.parametrize("pace", [2.0, 0.5], ids=["slower: a cut", "faster: chunks put back"])
def test_a_replan_keeps_the_most_relevant_chunk_next_to_the_question(pace):
    """The prompt shows the most relevant chunk last, next to the question, so that the chunks a
    watched prefill has not evaluated yet are the least relevant ones and that one. A re-plan
    keeps it there: a cut keeps it (its value), chunks put back go before it."""
    n = 40 if pace > 1 else 20
    budget = 0.8 * untrimmed_ttft(n)
    messages, chunks = rag_request(n)  # doc-0 scores highest
    fake, chat = wrapped()  # on pace: the plan as made
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    assert not chat.last_report.replans
    planned = chunk_order(fake.calls[-1][0])
    fake, chat = wrapped(pace=(lambda position: 1.0 if position < 500 else pace) if pace > 1 else (lambda position: pace))
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    assert len(chat.last_report.replans) >= 1
    sent = chunk_order(fake.calls[-1][0])
    assert planned[-1] == sent[-1] == "doc-0"
    assert fake.calls[-1][0][-1]["content"].index("[doc-0]") > fake.calls[-1][0][-1]["content"].index(f"[{sent[-2]}]")
    if pace > 1:
        assert set(sent) < set(planned)  # a cut
    else:
        assert set(sent) > set(planned)  # put back, before doc-0
    assert sent[:-1] == sorted(sent[:-1], key=lambda d: int(d.split("-")[1]))  # the rest most relevant first


def test_the_watch_projects_at_the_measured_pace():
    profile = make_profile()
    tokens = list(range(2000))
    w = PrefillWatch(tokens, 0, profile, budget_s=10.0, margin=0.0, n_batch=512)
    assert w.next_end() == FIRST_STEP_TOKENS
    w.record(FIRST_STEP_TOKENS, 2 * profile.predict_prefill_s(FIRST_STEP_TOKENS, 0))
    assert w.pace == pytest.approx(2.0)
    # the rest as a part of one prefill of the whole prompt (its fixed cost was in the first step)
    rest = profile.predict_prefill_s(2000, 0) - profile.predict_prefill_s(FIRST_STEP_TOKENS, 0)
    assert w.projected_ttft_s(0.1) == pytest.approx(0.1 + 2 * rest + profile.first_token_overhead_s(2000))
    assert w.next_end() == FIRST_STEP_TOKENS + 512
    # a sliver is never left for a step of its own
    w.position = 2000 - FIRST_STEP_TOKENS - 1
    assert w.next_end() == 2000


def test_a_short_first_step_decides_alone_only_when_there_is_no_later_chance():
    profile = make_profile(p90_pct=10.0)
    tokens = list(range(3000))
    whole = profile.predict_prefill_s(3000, 0) + profile.first_token_overhead_s(3000)
    first = profile.predict_prefill_s(FIRST_STEP_TOKENS, 0)

    def after_first(pace):
        w = PrefillWatch(tokens, 0, profile, budget_s=1.02 * whole, margin=0.0, n_batch=512)
        w.record(FIRST_STEP_TOKENS, pace * first)
        return w

    assert not after_first(1.08).over_budget(1.08 * first)  # jitter within the profile's noise
    # twice as slow: the projection is far over, but one long step still fits: it measures it first
    slow = after_first(2.0)
    assert slow.projected_ttft_s(2 * first) > slow.budget_s and not slow.over_budget(2 * first)
    slow.record(FIRST_STEP_TOKENS + 512, 2.0 * slow._part_s(FIRST_STEP_TOKENS, FIRST_STEP_TOKENS + 512))
    assert slow.over_budget(2.0 * profile.predict_prefill_s(FIRST_STEP_TOKENS + 512, 0))  # a long step: taken as measured
    # so slow that the next long step alone would be too late: it cuts at once
    w = PrefillWatch(tokens, 0, profile, budget_s=0.5 * whole, margin=0.0, n_batch=512)
    w.record(FIRST_STEP_TOKENS, 6.0 * first)
    assert w.over_budget(6.0 * first)


def chat_request(n_chunks: int = 12, n_turns: int = 6) -> tuple[list[dict], list[trimkit.Chunk]]:
    """A RAG chat: ``n_turns`` earlier exchanges before the question."""
    messages = [{"role": "system", "content": "Answer from the records."}]
    for t in range(n_turns):
        messages += [{"role": "user", "content": f"Earlier question {t}: " + " ".join(WORDS[:30])},
                     {"role": "assistant", "content": f"Earlier answer {t}: " + " ".join(WORDS[5:40])}]
    messages.append({"role": "user", "content": "Which vessel sailed first from the quay?"})
    _, chunks = rag_request(n_chunks)
    return messages, chunks


def test_a_slowdown_no_cut_absorbs_keeps_the_evaluated_prefix_rather_than_start_over_and_miss():
    """Late in the prefill the host slows to 1.5×: no cut of the chunks not evaluated yet meets
    the budget, and neither would starting over with the system prompt and the question alone
    (the time left is shorter than their prefill). Starting over would send the question without
    its history or any chunk for nothing; the cut that keeps the evaluated prefix goes instead."""
    messages, chunks = chat_request()
    fake, chat = wrapped(watch=False)
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4)
    budget = 0.8 * chat.last_report.predicted_ttft_before_s
    fake, chat = wrapped()
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    planned, planned_messages = chat.last_report.prompt_tokens, fake.calls[-1][0]
    fake, chat = wrapped(pace=lambda position: 1.0 if position < planned // 2 else 1.5)
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    r = chat.last_report
    assert len(r.replans) == 1 and not r.budget_met
    x = r.replans[0]
    assert x.predicted_ttft_after_s > budget  # said as it is: the budget is missed
    assert x.dropped and not any(d.startswith("message") for d in x.dropped)  # chunks not evaluated yet, no turn
    # no token evaluated twice: the prefill went on from where it was
    assert all(b == e for (_, e), (b, _) in zip(fake.steps, fake.steps[1:]))
    sent = fake.calls[-1][0]
    assert sent[:-1] == planned_messages[:-1] and len(sent) > 2  # the planned turns, all of them
    assert "starting over would miss it too" in str(r)


def test_what_the_speed_estimate_learns_of_a_watch_is_the_evaluation_the_prompt_kept():
    """After a start-over the evaluated steps whose tokens left the prompt are no part of the
    sample: it is the unbroken run of steps that ends where the prompt's evaluation ended."""
    profile = make_profile()
    tokens = list(range(1000))
    w = PrefillWatch(tokens, 20, profile, budget_s=10.0, margin=0.0, n_batch=512)
    w.record(84, 0.3)
    w.record(596, 2.4)
    assert w.prefill_so_far == (576, 20, pytest.approx(2.7))
    # a cut that keeps all that was evaluated: the steps go on from there, one prefill
    cut = w.continue_with(tokens[:700], held=596)
    cut.record(700, 0.5)
    assert cut.prefill_so_far == (680, 20, pytest.approx(3.2))
    # a start-over keeps the first 30 tokens: 67 new tokens after them, in the time of their step only
    over = w.continue_with(tokens[:30] + list(range(5000, 5067)), held=30)
    over.record(97, 0.25)
    assert over.prefill_so_far == (67, 30, pytest.approx(0.25))
    # the engine could not keep the prefix and evaluated from 0: one prefill from there
    lost = PrefillWatch(tokens, 200, profile, budget_s=10.0, margin=0.0, n_batch=512)
    lost.record(264, 1.0, start=0)
    assert lost.prefill_so_far == (264, 0, pytest.approx(1.0))


def test_a_start_over_does_not_hold_the_next_requests_to_half_their_budget():
    """A request whose host slows down 1.5x late in its prefill starts over (no cut of its chunks
    fits; the system prompt and the question alone do). The speed estimate learns one sample of
    what its prompt kept, not the time of the ~1,000 tokens it threw away priced as 48: the
    requests after it, on a calm host again, do not plan to the margin's cap."""
    messages, chunks = chat_request(8, 6)
    fake, chat = wrapped(watch=False)
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4)
    budget = 0.8 * chat.last_report.predicted_ttft_before_s
    slow = [False]
    fake, chat = wrapped(pace=lambda position: 1.5 if slow[0] and position >= 400 else 1.0)
    for _ in range(5):  # a calm spell: the window fills with live samples
        fake.kv = []
        chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
        assert not chat.last_report.replans
    slow[0] = True
    fake.kv = []
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    [x] = chat.last_report.replans
    assert any(d.startswith("message") for d in x.dropped) and chat.last_report.prompt_tokens < 100  # it started over
    # the sample: at most the pace the host ran at (the old sample priced 48 tokens at the time of
    # ~1,100 and read as the clip, 5x: the margin went to its cap, 0.6, for the next requests)
    assert chat.engine.speed.ratios(chat.profile.model)[-1] <= 1.5 * 1.01
    assert chat.safety_margin < 1 - 1 / 1.6


def test_a_watched_requests_outcome_is_what_the_margin_of_the_next_ones_holds_back():
    """Each watched request with a budget leaves its measured ÷ predicted TTFT (the prompt it
    sent); once a few are known, a watched margin holds back at least what their 97th
    percentile needs — the spread of prefills around the factor alone missed what the watch's
    steps cost and how far the factor lags."""
    messages, chunks = rag_request(20)
    fake, chat = wrapped(pace=lambda position: 1.0)
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4)
    assert chat.engine.speed.outcomes == ()  # no budget: nothing to learn for the margin
    budget = 0.3 * chat.last_report.predicted_ttft_before_s
    fake.kv = []
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4, ttft_budget_s=budget)
    r = chat.last_report
    assert r.watched and chat.engine.speed.outcomes == (pytest.approx(r.measured_ttft_s / r.predicted_ttft_s),)
    speed, model = chat.engine.speed, chat.profile.model
    before = speed.margin(model, fallback=0.05, share=0.5)
    for ratio in (1.02, 1.05, 1.08):
        speed.observe_outcome(ratio, 1.0)
    assert speed.margin(model, fallback=0.05, share=0.5) == pytest.approx(1 - 1 / 1.08)  # the largest of 4: rank ceil(5 × 0.97)
    assert before < 0.05
    assert speed.margin(model, fallback=0.05, share=1.0) == pytest.approx(speed.margin(model, fallback=0.05))  # open loop: the prefill spread
    for bad in (math.nan, -1.0, 0.0, math.inf):  # never fails a request that was answered
        speed.observe_outcome(bad, 1.0)
        speed.observe_outcome(1.0, bad)
    assert len(speed.outcomes) == 4


def test_a_watched_margin_covers_the_tail_of_the_prompt_the_plan_will_send():
    """A 2,600-token prompt whose budget allows ~600: the watch checks a 600-token prompt once,
    after its first step, so most of it is tail — the margin is sized for that, not for the
    tail of the prompt the caller gave (one batch of 2,600)."""
    messages, chunks = rag_request(20)
    fake, chat = wrapped()
    chat.create_chat_completion(messages=messages, rag_chunks=chunks, max_tokens=4)
    n = chat.last_report.prompt_tokens
    budget = 0.2 * chat.last_report.predicted_ttft_before_s
    engine, profile = chat.engine, chat.profile
    for ratio in (1.0, 1.02, 0.99, 1.05, 1.01):  # a spread the margin reads
        engine.speed.observe(PrefillSample(600, 0, ratio * profile.model.prefill_s(600, 0) * profile.drift))
    watched = engine.request_margin(0.97, budget, n, 0, watched=True)
    allowed = profile.max_new_tokens(budget * (1 - watched))
    assert n > 4 * allowed  # the plan sends a fifth of the prompt at most
    assert watched == pytest.approx(engine.safety_margin(0.97, share=tail_share(profile, allowed)), rel=0.05)
    assert watched > engine.safety_margin(0.97, share=tail_share(profile, n))  # the old reading: one batch of the whole
    assert watched <= engine.request_margin(0.97, budget, n, 0)  # never more than open loop
