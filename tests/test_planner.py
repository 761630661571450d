import copy
import json
import math
import statistics

import attrs
import pytest

from tests._planner_helpers import PROFILE, budget_for_tokens, conversation, fresh_tokenizer, holding, tokenizer, tokens_of, tool_turn
from trimkit.errors import (
    InfeasibleBudgetError,
    InvalidBudgetError,
    InvalidChunkError,
    InvalidInputError,
    InvalidMessageError,
    InvalidNumberError,
)
from trimkit.messages import Chunk, append_text
from trimkit.pipeline import place_chunks
from trimkit.planning.planner import Plan, plan
from trimkit.planning.speed import LiveProfile
from trimkit.planning.summaries import ExtractiveSummarizer, SummaryCache, summary_job, summary_note
from trimkit.planning.values import ValueModel
from trimkit.strategies import cap_rag_chunks, drop_oldest_turns, reuse_prefix, summarize_history


def run(messages, budget, **kw):
    kw.setdefault("profile", PROFILE)
    kw.setdefault("tokenizer", tokenizer())
    return plan(messages, ttft_budget_s=budget, **kw)


CHUNKS = [f"Fact {i}: cats have {i} whiskers on the left side and like fish number {i}." for i in range(8)]


# -- passthrough -------------------------------------------------------------------------------
def test_under_budget_passes_the_very_same_list_through():
    msgs = conversation(3)
    p = run(msgs, 10.0)
    assert p.messages is msgs
    assert p.passthrough and p.feasible and not p.minimal and p.actions == ()
    assert p.prompt_tokens == p.prompt_tokens_before == tokens_of(msgs)
    assert p.predicted_ttft_s == p.predicted_ttft_before_s == pytest.approx(PROFILE.predict_ttft_s(tokens_of(msgs)))


def test_under_budget_with_chunks_places_all_of_them_in_a_copy():
    msgs = conversation(1, question="How many whiskers do cats have?")
    before = copy.deepcopy(msgs)
    p = run(msgs, 10.0, rag_chunks=CHUNKS)
    assert p.passthrough and p.messages is not msgs and msgs == before
    assert p.messages[:-1] == msgs[:-1] and p.messages[0] is msgs[0]
    last = p.messages[-1]["content"]
    assert last.startswith("Use the following retrieved context") and last.endswith("Question: How many whiskers do cats have?")
    assert all(f"[{i + 1}]" in last for i in range(8)) and p.dropped_chunks == ()


def test_cached_prefix_makes_a_long_prompt_cheap():
    msgs = conversation(10)
    total = tokens_of(msgs)
    budget = budget_for_tokens(200)
    assert not run(msgs, budget).passthrough
    p = run(msgs, budget, cached_tokens=total - 20)
    assert p.passthrough and p.messages is msgs
    assert p.cached_tokens == total - 20 and p.new_tokens == 20


def test_cached_tokens_never_exceed_the_prompt_minus_one():
    msgs = conversation(1)
    p = run(msgs, 10.0, cached_tokens=10**6)
    assert p.cached_tokens == p.prompt_tokens - 1 and p.new_tokens == 1


# -- trimming ----------------------------------------------------------------------------------
def test_over_budget_trims_until_it_fits_and_reports_everything():
    msgs = conversation(12)
    before = copy.deepcopy(msgs)
    budget = budget_for_tokens(tokens_of(msgs) // 3)
    p = run(msgs, budget, rag_chunks=CHUNKS)
    assert msgs == before
    assert p.feasible and not p.passthrough and not p.minimal
    assert p.predicted_ttft_s <= p.target_s < p.predicted_ttft_before_s
    assert p.prompt_tokens == tokens_of(p.messages)
    removed = {i for a in p.actions for i in a.removed_messages}
    assert set(p.removed_message_indices) <= removed
    dropped = {c for a in p.actions for c in a.removed_chunks}
    assert {c.id for c in p.dropped_chunks} <= dropped
    assert p.messages[0] is msgs[0]  # unchanged messages are shared, never copied or modified
    assert p.messages[-1]["content"].endswith("What about cats?")


def test_dropping_history_loses_the_cached_prefix_after_the_first_dropped_message():
    msgs = conversation(10)
    total = tokens_of(msgs)
    p = run(msgs, budget_for_tokens(total // 3), cached_tokens=total // 2)
    counts = tokenizer().segment_counts(msgs).counts
    first = p.removed_message_indices[0]
    assert 0 < p.cached_tokens <= sum(counts[:first])  # nothing after the first dropped message is cached
    # the cached old turns are nearly free, so the engine keeps them and drops newer, uncached ones
    assert first > 1
    cold = run(msgs, budget_for_tokens(total // 3))
    assert cold.removed_message_indices[0] == 1 and cold.cached_tokens == 0  # nothing cached: the oldest go


def test_editing_only_the_last_message_keeps_the_history_cached():
    msgs = conversation(6, question="How many whiskers do cats have?")
    counts = tokenizer().segment_counts(msgs).counts
    history = sum(counts[:-1])
    budget = PROFILE.predict_ttft_s(200, history) / (1 - PROFILE.safety_margin)
    # history worth keeping: only the last message (its chunks) is edited, the history stays cached
    p = run(msgs, budget, rag_chunks=CHUNKS * 3, cached_tokens=history, values=ValueModel(history_weight=1.0))
    assert p.feasible and p.removed_message_indices == () and p.dropped_chunks
    assert p.cached_tokens == history
    # by default a chunk can outweigh two old turns; what is dropped forfeits only the cache after it
    p = run(msgs, budget, rag_chunks=CHUNKS * 3, cached_tokens=history)
    first = min(p.removed_message_indices, default=len(msgs) - 1)
    assert p.feasible and p.cached_tokens == sum(counts[:first])


def test_no_over_trimming_on_realistic_workloads():
    ratios = []
    for turns in (4, 8, 16, 24):
        msgs = conversation(turns, words=60)
        total = tokens_of(msgs)
        for frac in (0.3, 0.5, 0.7, 0.9):
            p = run(msgs, budget_for_tokens(int(total * frac)), rag_chunks=CHUNKS)
            assert p.feasible
            ratios.append(p.predicted_ttft_s / p.budget_s)
    assert statistics.median(ratios) >= 0.85, ratios


def test_tools_count_against_the_budget():
    msgs = conversation(3)
    tools = [{"type": "function", "function": {"name": f"tool{i}", "description": "does a thing " * 30}} for i in range(5)]
    without, with_tools = run(msgs, 10.0), run(msgs, 10.0, tools=tools)
    assert with_tools.prompt_tokens > without.prompt_tokens + 200
    budget = budget_for_tokens(without.prompt_tokens + 10)
    assert run(msgs, budget).passthrough and not run(msgs, budget, tools=tools).passthrough


def test_tool_pairs_are_dropped_together():
    msgs = [{"role": "system", "content": "sys"}]
    for n in range(5):
        msgs += tool_turn(n)
    msgs.append({"role": "user", "content": "total?"})
    p = run(msgs, budget_for_tokens(tokens_of(msgs) // 2))
    kept_roles = [m["role"] for m in p.messages]
    assert kept_roles[1] == "user" and len(p.removed_message_indices) % 4 == 0


def test_trailing_tool_results_of_the_current_turn_are_never_dropped():
    msgs = conversation(4) + tool_turn(9)[1:3]  # the current turn already called a tool
    p = run(msgs, budget_for_tokens(60))
    assert p.messages[-2:] == msgs[-2:] and p.messages[-3] is msgs[-3]


def test_list_content_last_user_message_gets_chunks_in_its_text_part():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Cats?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    before = copy.deepcopy(msgs)
    p = run(msgs, 10.0, rag_chunks=CHUNKS[:2])
    parts = p.messages[0]["content"]
    assert parts[0]["text"].endswith("Question: Cats?") and "[1]" in parts[0]["text"]
    assert parts[1] == before[0]["content"][1] and msgs == before


def test_the_most_relevant_chunk_is_placed_next_to_the_question_the_rest_most_relevant_first():
    chunks = [Chunk("Parrots talk.", id="p"), Chunk("Cats purr. Cats nap.", id="c"), Chunk("Cats hunt.", id="h")]
    p = run(conversation(0, question="Do cats purr?"), 10.0, rag_chunks=chunks)
    text = p.messages[-1]["content"]
    assert text.index("[h]") < text.index("[p]") < text.index("[c]") < text.index("Question: Do cats purr?")
    assert [c.id for c in p.kept_chunks] == ["h", "p", "c"]  # the order the prompt shows them
    # an untrimmed plan and place_chunks give the same prompt
    assert place_chunks(conversation(0, question="Do cats purr?"), chunks)[-1]["content"] == text


def test_chunk_only_trim_keeps_every_chunk_that_fits():
    msgs = conversation(0, question="How many whiskers do cats have?")
    all_in = run(msgs, 10.0, rag_chunks=CHUNKS)
    for target in range(tokens_of(msgs) + 20, all_in.prompt_tokens, 37):
        p = run(msgs, budget_for_tokens(target), rag_chunks=CHUNKS)
        assert p.feasible and p.prompt_tokens <= target
        if p.dropped_chunks:
            kept = {c.id for c in p.kept_chunks} | {p.dropped_chunks[0].id}
            ordered = [c for c in all_in.kept_chunks if c.id in kept]
            more = run(msgs, 10.0, rag_chunks=ordered)
            assert more.prompt_tokens > target


# -- infeasible ------------------------------------------------------------------------------------
def test_infeasible_best_effort_returns_the_minimal_plan():
    msgs = conversation(5)
    p = run(msgs, 0.001, rag_chunks=CHUNKS)
    assert not p.feasible and p.minimal
    assert [m["role"] for m in p.messages] == ["system", "user"] and p.messages[-1] is msgs[-1]
    (action,) = p.actions
    assert action.strategy == "minimal" and set(action.removed_messages) == set(range(1, 11))
    assert len(action.removed_chunks) == len(CHUNKS)
    assert p.predicted_ttft_s == pytest.approx(PROFILE.predict_ttft_s(p.prompt_tokens))


def test_infeasible_raise_carries_the_plan():
    with pytest.raises(InfeasibleBudgetError) as info:
        run(conversation(5), 0.001, on_infeasible="raise")
    assert isinstance(info.value.plan, Plan) and not info.value.plan.feasible
    assert "cannot be met" in str(info.value)


def test_strategies_that_cannot_fit_fall_back_to_the_minimal_prompt():
    msgs = conversation(8)
    p = run(msgs, budget_for_tokens(80), strategies=[reuse_prefix()])
    assert p.feasible and p.minimal and p.actions[0].strategy == "minimal"


# -- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"messages": "hi"}, InvalidMessageError),
        ({"messages": []}, InvalidMessageError),
        ({"messages": [{"content": "x"}]}, InvalidMessageError),
        ({"messages": [{"role": "user"}]}, InvalidMessageError),
        ({"messages": [{"role": "wizard", "content": "x"}]}, InvalidMessageError),
        ({"rag_chunks": [{"score": 1}]}, InvalidChunkError),
        ({"rag_chunks": ["  "]}, InvalidChunkError),
        ({"ttft_budget_s": 0}, InvalidBudgetError),
        ({"ttft_budget_s": -1.0}, InvalidBudgetError),
        ({"ttft_budget_s": math.nan}, InvalidBudgetError),
        ({"ttft_budget_s": math.inf}, InvalidBudgetError),
        ({"ttft_budget_s": "1"}, InvalidBudgetError),
        ({"on_infeasible": "ignore"}, InvalidInputError),
        ({"cached_tokens": -1}, InvalidNumberError),
        ({"strategies": ["drop"]}, InvalidInputError),
        ({"summaries": {}}, InvalidInputError),
        ({"cache": 3}, InvalidInputError),
        ({"cache": [[1, 2, 3]]}, InvalidInputError),
        ({"values": 3}, InvalidInputError),
        ({"safety_margin": 1.5}, InvalidNumberError),
        ({"max_prompt_tokens": 0}, InvalidNumberError),
        ({"rag_template": "{context}"}, InvalidInputError),
        ({"profile": object()}, InvalidInputError),
    ],
)
def test_bad_input_raises_a_typed_error_before_any_work(kwargs, error):
    tok = fresh_tokenizer()
    args = {"messages": conversation(2), "ttft_budget_s": 1.0, "profile": PROFILE, "tokenizer": tok}
    args.update(kwargs)
    messages = args.pop("messages")
    with pytest.raises(error):
        plan(messages, **args)
    assert tok.count_calls == 0


# -- cost of planning -------------------------------------------------------------------------------
def test_a_second_identical_plan_tokenizes_nothing():
    tok = fresh_tokenizer()
    msgs = conversation(50, words=30)
    chunks = [f"Chunk {i} about cats and whiskers number {i}. " * 5 for i in range(20)]
    budget = budget_for_tokens(tokens_of(msgs) // 3)
    first = plan(msgs, ttft_budget_s=budget, profile=PROFILE, tokenizer=tok, rag_chunks=chunks)
    assert not first.passthrough
    calls = tok.count_calls
    second = plan(msgs, ttft_budget_s=budget, profile=PROFILE, tokenizer=tok, rag_chunks=chunks)
    assert tok.count_calls == calls
    assert second.to_dict() | {"planning_s": 0} == first.to_dict() | {"planning_s": 0}


def test_planning_time_uses_the_injected_clock():
    ticks = iter(range(100))
    p = run(conversation(3), 10.0, clock=lambda: float(next(ticks)))
    assert p.planning_s == 1.0


# -- the engine's cache state and summaries --------------------------------------------------------------
def test_the_cache_state_is_looked_up_at_most_twice():
    msgs = conversation(10)
    held = holding((msgs, 0))
    cache = SummaryCache()
    cache.put(msgs[1:9], _summary(msgs[1:9]))
    run(msgs, budget_for_tokens(tokens_of(msgs) // 4), cache=held, summaries=cache, rag_chunks=CHUNKS)
    assert 1 <= len(held.looked_up) <= 2


def test_a_candidate_the_tokenizer_cannot_count_is_estimated(caplog):
    tok = fresh_tokenizer()

    def prompt_tokens(messages, tools=None):
        raise RuntimeError("tokenizer down")

    tok.prompt_tokens = prompt_tokens
    p = run(conversation(6), budget_for_tokens(100), tokenizer=tok, cache=holding((conversation(6), 50)))
    assert p.feasible and "tokenizer down" in caplog.text


def _summary(covered):
    from trimkit.planning.summaries import make_summary

    return make_summary(ExtractiveSummarizer(), covered, target_tokens=30, count_tokens=tokenizer())


def test_precomputed_summary_flows_from_job_to_next_plan():
    cache = SummaryCache()
    msgs = conversation(8)
    budget = budget_for_tokens(tokens_of(msgs) // 2)
    first = run(msgs, budget, summaries=cache)
    assert not any(a.strategy == "summarize_history" for a in first.actions)  # nothing ready yet
    history = msgs + [{"role": "assistant", "content": "Cats are great."}]
    job = summary_job(history, ExtractiveSummarizer(), cache, plan=first, count_tokens=tokenizer(), target_tokens=60)
    assert job is not None and job() is not None
    nxt = run(history + [{"role": "user", "content": "And dogs?"}], budget, summaries=cache)
    assert nxt.feasible and nxt.summary is not None
    (action,) = [a for a in nxt.actions if a.strategy == "summarize_history"]
    assert set(nxt.summarized_message_indices) == set(action.summarized_messages)
    assert "Summary of the earlier conversation" in nxt.messages[0]["content"]
    assert nxt.inline_s == 0.0  # computed off the critical path


def test_a_byte_stable_summary_already_in_the_kv_cache_is_counted_as_cached():
    cache = SummaryCache()
    msgs = conversation(8)
    cache.put(msgs[1:13], _summary(msgs[1:13]))
    # the engine served this very prompt last turn (all but its last 30 tokens are cached); the
    # caller's unsummarized history diverges from it inside the system message
    summarized = [append_text(msgs[0], f"\n\n{summary_note(cache.get(msgs[1:13]))}"), *msgs[13:]]
    held = holding((summarized, len(tokenizer().prompt_tokens(summarized)) - 30))
    budget = budget_for_tokens(120)
    p = run(msgs, budget, summaries=cache, cache=held)
    assert p.feasible and p.summary is not None and p.removed_message_indices == ()
    assert p.messages == summarized and p.cached_tokens == len(tokenizer().prompt_tokens(summarized)) - 30
    assert len(held.looked_up) == 2  # reuse_prefix looked up the prompt as it stands, the summary its candidate


def test_live_profile_is_accepted():
    p = run(conversation(3), 10.0, profile=LiveProfile(PROFILE))
    assert p.passthrough


def test_custom_strategy_list_is_used_in_order():
    msgs = conversation(8, question="How many whiskers do cats have?")
    p = run(msgs, budget_for_tokens(tokens_of(msgs) // 2), rag_chunks=CHUNKS, strategies=[drop_oldest_turns(), cap_rag_chunks()])
    assert p.actions[0].strategy == "drop_oldest_turns"


def test_inline_summary_time_is_part_of_the_prediction():
    ticks = iter(x * 0.1 for x in range(1000))
    msgs = conversation(8)
    p = run(
        msgs,
        budget_for_tokens(tokens_of(msgs) // 2) + 0.3,
        strategies=[summarize_history(inline=True, target_tokens=40), drop_oldest_turns()],
        clock=lambda: next(ticks),
    )
    assert p.feasible and p.inline_s == pytest.approx(0.1)
    assert p.predicted_ttft_s == pytest.approx(PROFILE.predict_ttft_s(p.new_tokens, p.cached_tokens) + 0.1)


# -- the plan value --------------------------------------------------------------------------------------
def test_plan_to_dict_is_json_and_str_is_readable():
    p = run(conversation(10), budget_for_tokens(150), rag_chunks=CHUNKS)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["feasible"] is True and d["actions"] and d["message_count"] == len(p.messages)
    text = str(p)
    assert "predicted TTFT" in text and "drop_oldest_turns" in text
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.feasible = False  # type: ignore[misc]


def test_a_template_that_depends_on_position_is_corrected_by_the_exact_count():
    """Gemma-like templates render the first user message differently; the additive estimate
    misses that when old turns are dropped, and the exact count of the final prompt catches it."""
    from trimkit.messages import message_text
    from trimkit.planning.tokens import PromptTokenizer, TiktokenTokenizer

    def render(messages, tools=None):
        out, first = [], True
        for m in messages:
            prefix = ""
            if m["role"] == "user" and first:
                prefix, first = "<first user turn> " * 30, False
            out.append(f"<|im_start|>{m['role']}\n{prefix}{message_text(m)}<|im_end|>\n")
        return "".join(out) + "<|im_start|>assistant\n"

    tok = PromptTokenizer(TiktokenTokenizer(), render)
    msgs = conversation(10)
    total = tok.segment_counts(msgs).total
    p = plan(msgs, ttft_budget_s=budget_for_tokens(total // 2), profile=PROFILE, tokenizer=tok)
    assert p.feasible and not p.minimal
    assert p.prompt_tokens == tok.segment_counts(p.messages).total <= total // 2
    assert p.predicted_ttft_s <= p.target_s


def test_next_summary_job_summarizes_the_plans_request_for_the_next_turn():
    from trimkit.planning.summaries import next_summary_job

    cache = SummaryCache()
    msgs = conversation(8)
    budget = budget_for_tokens(tokens_of(msgs) // 2)
    first = run(msgs, budget, summaries=cache)
    assert first.request_messages is msgs
    job = next_summary_job(first, ExtractiveSummarizer(), cache, count_tokens=tokenizer(), target_tokens=60)
    summary = job()
    assert summary.covered_messages == 14  # all but the current turn and the one before it
    nxt = run(msgs + [{"role": "assistant", "content": "Cats are great."}, {"role": "user", "content": "Dogs?"}], budget, summaries=cache)
    assert nxt.summary == summary and nxt.summarized_message_indices == tuple(range(1, 15))
    assert next_summary_job(None, ExtractiveSummarizer(), cache) is None
    assert next_summary_job(run(msgs, 100.0), ExtractiveSummarizer(), cache) is None  # no pressure: nothing due


def test_room_left_after_whole_chunks_is_filled_with_an_excerpt():
    sentences = [f"Sentence {i} says the ferry leaves pier {i} at {i} o'clock sharp." for i in range(40)]
    chunks = [Chunk(text=" ".join(sentences), id="long-doc", score=1.0), Chunk(text="Short note about the pier.", id="note", score=0.5)]
    msgs = [{"role": "user", "content": "When does the ferry leave?"}]
    p = run(msgs, 0.45, rag_chunks=chunks)
    (excerpt,) = [a for a in p.actions if a.strategy == "excerpt_chunk"]
    assert excerpt.detail["chunk"] == "long-doc"
    kept = {c.id: c for c in p.kept_chunks}
    cut = kept["long-doc"].text
    assert "…" in cut and "excerpt" not in cut and len(cut) < len(chunks[0].text)
    parts = [part.strip() for part in cut.split("…") if part.strip()]
    assert all(part in chunks[0].text for part in parts)  # whole sentences, in order
    assert all(part.endswith("sharp.") for part in parts)  # a sentence boundary, never mid-sentence
    assert p.predicted_ttft_s <= p.budget_s * (1 - p.safety_margin)
    assert p.predicted_ttft_s / p.budget_s > 0.8
