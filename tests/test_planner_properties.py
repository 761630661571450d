"""Property tests: the planner's guarantees (docs/design.md, §7) on generated conversations."""

import copy
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._planner_helpers import PROFILE, tokenizer
from trimkit.errors import InfeasibleBudgetError, InvalidBudgetError
from trimkit.messages import SYSTEM_ROLES, Chunk, coerce_chunks, last_user_index
from trimkit.planning.costs import CacheState
from trimkit.planning.planner import plan
from trimkit.planning.summaries import SummaryCache
from trimkit.strategies import cap_rag_chunks, drop_oldest_turns, reuse_prefix, summarize_history

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

WORDS = ["cat", "dog", "whisker", "fish", "the", "a", "run", "blue", "sky", "tea", "Paris", "42", "is", "not"]


def text(max_words=120):
    return st.lists(st.sampled_from(WORDS), min_size=1, max_size=max_words).map(lambda ws: " ".join(ws) + ".")


@st.composite
def tool_exchange(draw, call_no):
    n_calls = draw(st.integers(1, 2))
    ids = [f"call_{call_no}_{k}" for k in range(n_calls)]
    msgs = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": i, "type": "function", "function": {"name": "lookup", "arguments": "{}"}} for i in ids],
        }
    ]
    msgs += [{"role": "tool", "tool_call_id": i, "content": draw(text(60))} for i in ids]
    return msgs


@st.composite
def conversations(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(text(30))})
    for t in range(draw(st.integers(0, 8))):
        if draw(st.integers(0, 9)) == 0:
            msgs.append({"role": "system", "content": draw(text(10))})
        user = draw(text())
        if draw(st.integers(0, 5)) == 0:
            msgs.append({"role": "user", "content": [{"type": "text", "text": user}]})
        else:
            msgs.append({"role": "user", "content": user})
        if draw(st.booleans()):
            msgs += draw(tool_exchange(t))
        if draw(st.integers(0, 4)) > 0:
            msgs.append({"role": "assistant", "content": draw(text())})
    msgs.append({"role": "user", "content": draw(text(30))})
    if draw(st.integers(0, 4)) == 0:  # an agent loop: the current turn already called a tool
        msgs += draw(tool_exchange(99))
    return msgs


def passage():
    """One sentence, or several (so that excerpts can be cut)."""
    return st.one_of(text(80), st.lists(text(20), min_size=2, max_size=8).map(" ".join))


@st.composite
def chunk_lists(draw):
    texts = draw(st.lists(passage(), max_size=6))
    kind = draw(st.sampled_from(["str", "chunk", "scored", "dict"]))
    if kind == "str":
        return texts
    if kind == "dict":
        return [{"text": t, "id": f"d{i}"} for i, t in enumerate(texts)]
    return [Chunk(t, score=float(i % 3) if kind == "scored" else None) for i, t in enumerate(texts)]


budgets = st.floats(min_value=-3.5, max_value=2.0).map(lambda e: 10.0**e)
#: a budget relative to what the whole request is predicted to cost: mostly in the range where
#: something must be trimmed, sometimes infeasible, sometimes generous
relative_budgets = st.floats(min_value=-1.7, max_value=0.3).map(lambda e: 10.0**e)

pipelines = st.sampled_from(
    [
        None,
        [reuse_prefix(), cap_rag_chunks(), summarize_history(inline=True, target_tokens=40), drop_oldest_turns()],
        [cap_rag_chunks(min_chunks=1), drop_oldest_turns(keep_last_turns=2)],
    ]
)


def _check_guarantees(msgs, chunks, p, summaries_given):
    n = len(msgs)
    gone = set(p.removed_message_indices) | set(p.summarized_message_indices)
    assert not set(p.removed_message_indices) & set(p.summarized_message_indices)
    last_user = last_user_index(msgs)
    # system messages and the whole last user turn are never removed
    assert all(msgs[i]["role"] not in SYSTEM_ROLES for i in gone)
    assert all(i < last_user for i in gone)
    # kept messages keep their order; unchanged ones are the caller's very dicts
    kept = [i for i in range(n) if i not in gone]
    out = list(p.messages)
    if p.summary is not None and msgs[0]["role"] not in SYSTEM_ROLES:
        inserted = out.pop(0)
        assert inserted["role"] == "system" and p.summary.text in inserted["content"]
    assert len(out) == len(kept)
    for i, m in zip(kept, out, strict=True):
        if i == 0 and p.summary is not None and msgs[0]["role"] in SYSTEM_ROLES:
            assert p.summary.text in str(m["content"])
        elif i == last_user and p.kept_chunks:
            assert m["role"] == "user" and m is not msgs[i]
        else:
            assert m is msgs[i]
    # a tool call and its results are kept or removed together
    for i, m in enumerate(msgs):
        for call in m.get("tool_calls") or []:
            for j, r in enumerate(msgs):
                if r.get("tool_call_id") == call["id"]:
                    assert (i in gone) == (j in gone)
    # a kept chunk is the caller's, or an excerpt of it: whole sentences of it, in order, marked
    originals = {c.id: c for c in coerce_chunks(chunks)}
    for c in p.kept_chunks:
        if "excerpt" in c.metadata:
            assert c.id in p.excerpted_chunks and "excerpt" not in c.text
            parts = [part.strip() for part in c.text.split(" … ")]
            parts[0] = parts[0].removeprefix("… ")
            parts[-1] = parts[-1].removesuffix(" …")
            positions = [originals[c.id].text.index(part) for part in parts]
            assert positions == sorted(positions)
        else:
            assert c == originals[c.id]
    # nothing is lost silently
    assert set(p.removed_message_indices) <= {i for a in p.actions for i in a.removed_messages}
    assert set(p.summarized_message_indices) <= {i for a in p.actions for i in a.summarized_messages}
    assert {c.id for c in p.dropped_chunks} <= {c for a in p.actions for c in a.removed_chunks}
    assert len(p.kept_chunks) + len(p.dropped_chunks) == len(chunks)
    if not summaries_given:
        assert p.summary is None
    # the prediction
    if p.feasible:
        assert p.predicted_ttft_s <= p.target_s <= p.budget_s
    else:
        assert p.minimal
    assert p.prompt_tokens == tokenizer().segment_counts(p.messages).total
    assert 0 <= p.cached_tokens < p.prompt_tokens and p.new_tokens == p.prompt_tokens - p.cached_tokens
    if p.passthrough:
        assert not gone and not p.dropped_chunks
        if not chunks:
            assert p.messages is msgs


@SETTINGS
@given(msgs=conversations(), chunks=chunk_lists(), scale=relative_budgets, cached_frac=st.floats(0, 1), pipeline=pipelines)
def test_guarantees_hold_for_generated_requests(msgs, chunks, scale, cached_frac, pipeline):
    msgs_before, chunks_before = copy.deepcopy(msgs), copy.deepcopy(chunks)
    total = tokenizer().segment_counts(msgs).total
    chunk_tokens = sum(tokenizer().count(str(c.text if isinstance(c, Chunk) else c["text"] if isinstance(c, dict) else c)) for c in chunks)
    budget = PROFILE.predict_ttft_s(total + chunk_tokens) * scale
    summaries = SummaryCache() if pipeline is not None and len(pipeline) == 4 else None
    p = plan(
        msgs,
        ttft_budget_s=budget,
        profile=PROFILE,
        tokenizer=tokenizer(),
        rag_chunks=chunks,
        cached_tokens=int(total * cached_frac),
        strategies=pipeline,
        summaries=summaries,
    )
    assert msgs == msgs_before and chunks == chunks_before
    _check_guarantees(msgs, chunks, p, summaries_given=summaries is not None)


@SETTINGS
@given(msgs=conversations(), chunks=chunk_lists(), frac=st.floats(0.05, 1.2))
def test_the_prompt_is_kept_inside_the_context_window(msgs, chunks, frac):
    everything = plan(msgs, ttft_budget_s=1e6, profile=PROFILE, tokenizer=tokenizer(), rag_chunks=chunks)
    limit = max(int(everything.prompt_tokens * frac), 1)
    p = plan(msgs, ttft_budget_s=1e6, profile=PROFILE, tokenizer=tokenizer(), rag_chunks=chunks, max_prompt_tokens=limit)
    if p.feasible:
        assert p.prompt_tokens <= limit
        assert p.passthrough == (everything.prompt_tokens <= limit)
    else:
        assert p.minimal and p.prompt_tokens > limit
    _check_guarantees(msgs, chunks, p, summaries_given=False)


@SETTINGS
@given(msgs=conversations(), chunks=chunk_lists(), budget=st.one_of(budgets, st.floats(0.02, 0.2)))
def test_infeasible_raise_carries_the_minimal_plan(msgs, chunks, budget):
    kwargs = {"ttft_budget_s": budget, "profile": PROFILE, "tokenizer": tokenizer(), "rag_chunks": chunks}
    best_effort = plan(msgs, **kwargs)
    if best_effort.feasible:
        assert plan(msgs, on_infeasible="raise", **kwargs).feasible
    else:
        with pytest.raises(InfeasibleBudgetError) as info:
            plan(msgs, on_infeasible="raise", **kwargs)
        assert info.value.plan.minimal and not info.value.plan.feasible
        assert info.value.plan.predicted_ttft_s == pytest.approx(best_effort.predicted_ttft_s)


@SETTINGS
@given(
    question=text(20),
    chunks=st.lists(text(80), min_size=1, max_size=8),
    frac=st.floats(0.05, 1.0),
)
def test_chunk_only_trims_do_not_over_trim(question, chunks, frac):
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]
    kwargs = {"profile": PROFILE, "tokenizer": tokenizer(), "rag_chunks": chunks}
    everything = plan(msgs, ttft_budget_s=100.0, **kwargs)
    bare = tokenizer().segment_counts(msgs).total
    target_tokens = bare + int((everything.prompt_tokens - bare) * frac)
    budget = PROFILE.predict_ttft_s(target_tokens) / (1 - PROFILE.safety_margin)
    p = plan(msgs, ttft_budget_s=budget, **kwargs)
    assert p.feasible and p.removed_message_indices == ()
    if p.dropped_chunks:
        with_one_more = {c.id for c in p.kept_chunks} | {p.dropped_chunks[0].id}
        ordered = [c for c in everything.kept_chunks if c.id in with_one_more]
        more = plan(msgs, ttft_budget_s=100.0, profile=PROFILE, tokenizer=tokenizer(), rag_chunks=ordered)
        assert PROFILE.predict_ttft_s(more.prompt_tokens) > p.target_s


@SETTINGS
@given(msgs=conversations(), bad=st.sampled_from([0.0, -1.0, -1e-9, math.nan, math.inf, -math.inf]))
def test_bad_budgets_are_refused(msgs, bad):
    before = copy.deepcopy(msgs)
    with pytest.raises(InvalidBudgetError):
        plan(msgs, ttft_budget_s=bad, profile=PROFILE, tokenizer=tokenizer())
    assert msgs == before


@SETTINGS
@given(msgs=conversations(), chunks=chunk_lists(), before=chunk_lists(), question=text(30), scale=relative_budgets)
def test_the_minimal_prompt_only_when_keeping_the_cached_history_does_not_fit(msgs, chunks, before, question, scale):
    """The turn after a request with chunks: its history is cached, its chunks are new. Keeping
    the history and dropping every chunk is a plan the default strategies allow, so when it fits
    the planner never falls back to the minimal prompt (it did when the chosen chunks ended the
    cached prefix earlier than the engine had priced)."""
    from trimkit.planning.tokens import reusable_prefix_len

    tok = tokenizer()
    previous = [*msgs[:-1], {"role": "user", "content": question}]
    sent_before = plan(previous, ttft_budget_s=1e9, profile=PROFILE, tokenizer=tok, rag_chunks=before)
    cache = tok.prompt_tokens(sent_before.messages, None)

    held = CacheState(prompts=(cache,))
    cached = reusable_prefix_len(cache, tok.prompt_tokens(msgs, None))
    everything = plan(msgs, ttft_budget_s=1e9, profile=PROFILE, tokenizer=tok, rag_chunks=chunks, cache=held)
    p = plan(msgs, ttft_budget_s=everything.predicted_ttft_s * scale, profile=PROFILE, tokenizer=tok, rag_chunks=chunks,
             cached_tokens=cached, cache=held)
    _check_guarantees(msgs, chunks, p, summaries_given=False)
    if p.minimal:
        history_only = plan(msgs, ttft_budget_s=1e9, profile=PROFILE, tokenizer=tok, cached_tokens=cached, cache=held)
        assert history_only.predicted_ttft_s > p.target_s, (p.target_s, history_only.predicted_ttft_s, p.actions)
