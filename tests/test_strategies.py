import logging
from typing import ClassVar

import attrs
import pytest

from tests._planner_helpers import budget_for_tokens, conversation, holding, state, tokenizer, tokens_of, tool_turn
from trimkit.errors import InvalidInputError
from trimkit.messages import Chunk, append_text
from trimkit.planning.solver import Action, PlanState
from trimkit.planning.summaries import PromptSummarizer, Summary, SummaryCache, summary_note
from trimkit.strategies import (
    Chain,
    Strategy,
    cap_rag_chunks,
    chain,
    default_strategies,
    drop_oldest_turns,
    reuse_prefix,
    summarize_history,
)


@attrs.frozen
class Recorder(Strategy):
    calls: list
    name: ClassVar[str] = "recorder"

    def __call__(self, state: PlanState) -> PlanState | None:
        self.calls.append(state.prediction.prompt_tokens)
        return None


def _summary(text="The user asked about many numbered topics.", covered=4):
    return Summary(text=text, covered_messages=covered, source_tokens=500, summary_tokens=12, seconds=0.0, summarizer="test")


class FakeClock:
    def __init__(self, step):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return self.t


# -- composition -----------------------------------------------------------------------------
def test_plus_and_chain_flatten():
    a, b, c = reuse_prefix(), cap_rag_chunks(), drop_oldest_turns()
    assert isinstance(a + b, Chain)
    assert list(a + (b + c)) == [a, b, c]
    assert list(chain([a, b], chain(c))) == [a, b, c]
    assert list([a] + b) == [a, b]
    assert [s.name for s in default_strategies()] == ["reuse_prefix", "cap_rag_chunks", "summarize_history", "drop_oldest_turns"]


def test_chain_rejects_what_is_not_a_strategy():
    with pytest.raises(InvalidInputError):
        chain(reuse_prefix(), "drop")
    with pytest.raises(InvalidInputError):
        reuse_prefix() + 3


def test_edit_strategies_run_before_the_engine_and_only_over_budget():
    msgs = conversation(6)
    calls = []
    s = state(msgs, budget=budget_for_tokens(tokens_of(msgs) // 2))
    out = (drop_oldest_turns() + Recorder(calls))(s)
    assert out.fits and calls == [s.prediction.prompt_tokens]  # it saw the request as given
    calls.clear()
    under = state(msgs, budget=100.0)
    assert (Recorder(calls) + Recorder(calls))(under) is None
    assert calls == []


def test_the_order_of_strategies_does_not_decide():
    msgs = conversation(6, question="Tell me about cats?")
    s = state(msgs, budget=budget_for_tokens(tokens_of(msgs) // 2), rag_chunks=CAT_CHUNKS)
    a = (cap_rag_chunks() + drop_oldest_turns())(s)
    b = (drop_oldest_turns() + cap_rag_chunks())(s)
    assert a.candidate == b.candidate


def test_strategy_parameters_are_validated_at_construction():
    with pytest.raises(InvalidInputError):
        cap_rag_chunks(min_chunks=-1)
    with pytest.raises(InvalidInputError):
        drop_oldest_turns(keep_last_turns=0)
    with pytest.raises(InvalidInputError):
        summarize_history(target_tokens=0)


# -- reuse_prefix --------------------------------------------------------------------------------
def test_reuse_prefix_without_a_probe_does_nothing():
    msgs = conversation(6)
    assert reuse_prefix()(state(msgs, budget=0.3)) is None


def test_reuse_prefix_probes_once_and_counts_the_cached_prefix():
    msgs = conversation(6)
    total = tokens_of(msgs)
    cache = holding((msgs, total - 10))
    s = state(msgs, budget=budget_for_tokens(50), cache=cache)
    assert not s.fits
    out = reuse_prefix()(s)
    assert out is not None and out.fits
    assert out.prediction.cached_tokens == total - 10
    assert out.candidate == s.candidate  # nothing removed
    assert [a.strategy for a in out.actions] == ["reuse_prefix"]
    assert cache.looked_up == [tokenizer().prompt_tokens(msgs)]


def test_reuse_prefix_trusts_cached_tokens_from_the_caller():
    msgs = conversation(6)
    cache = holding((msgs, 100))
    s = state(msgs, budget=0.3, cached_tokens=40, cache=cache)
    assert reuse_prefix()(s) is None and cache.looked_up == []


# -- cap_rag_chunks ------------------------------------------------------------------------------
CAT_CHUNKS = [
    Chunk("Dogs bark at the postman every morning. " * 8, id="dogs"),
    Chunk("Cats purr when they are happy and cats sleep a lot. " * 8, id="cats"),
    Chunk("Cats and kittens: a cat hunts mice. " * 8, id="kittens"),
    Chunk("Parrots can talk. " * 8, id="parrots"),
]


def test_cap_rag_chunks_keeps_the_most_relevant_that_fit():
    msgs = conversation(0, question="Tell me about cats?")
    s = state(msgs, budget=0.5, rag_chunks=CAT_CHUNKS)
    assert [c.id for c in s.chunks][:2] == ["cats", "kittens"]
    one_chunk = tokens_of(s.build_messages(attrs.evolve(s.candidate, kept_chunks=s.chunks[:2])))
    s = state(msgs, budget=budget_for_tokens(one_chunk + 5), rag_chunks=CAT_CHUNKS)
    out = cap_rag_chunks()(s)
    assert [c.id for c in out.candidate.kept_chunks] == ["cats", "kittens"]
    (action,) = out.actions
    assert action.strategy == "cap_rag_chunks" and set(action.removed_chunks) == {"dogs", "parrots"}
    assert out.fits


def test_cap_rag_chunks_skips_a_long_chunk_for_a_shorter_one_that_fits():
    chunks = [
        Chunk("cats " * 10, id="short-best"),
        Chunk("cats kittens " * 300, id="long"),
        Chunk("cats and more " * 5, id="short"),
    ]
    msgs = conversation(0, question="cats?")
    s = state(msgs, budget=budget_for_tokens(tokens_of(msgs) + 100), rag_chunks=chunks)
    out = cap_rag_chunks()(s)
    kept = [c.id for c in out.candidate.kept_chunks]
    assert "long" not in kept and "short" in kept


def test_cap_rag_chunks_min_chunks_are_never_dropped_or_cut():
    msgs = conversation(0, question="Tell me about parrots?")
    s = state(msgs, budget=budget_for_tokens(tokens_of(msgs) + 80), rag_chunks=CAT_CHUNKS)
    top = s.chunks[0]
    out = cap_rag_chunks(min_chunks=1)(s)
    assert out.candidate.kept_chunks[0] == top and out.fits
    assert cap_rag_chunks(min_chunks=1)(state(msgs, budget=0.05, rag_chunks=CAT_CHUNKS)) is None  # cannot fit


def test_cap_rag_chunks_without_chunks_does_nothing():
    assert cap_rag_chunks()(state(conversation(3), budget=0.1)) is None


# -- summarize_history ---------------------------------------------------------------------------
def _turn_messages(msgs, n):
    """Messages of the first n history turns of conversation()."""
    return msgs[1 : 1 + 2 * n]


def test_summarize_history_does_nothing_without_a_ready_summary():
    msgs = conversation(6)
    assert summarize_history()(state(msgs, budget=0.2)) is None
    assert summarize_history()(state(msgs, budget=0.2, summaries=SummaryCache())) is None


def test_summarize_history_uses_a_cached_summary_in_the_system_message():
    msgs = conversation(6)
    cache = SummaryCache()
    cache.put(_turn_messages(msgs, 4), _summary(covered=8))
    s = state(msgs, budget=0.3, summaries=cache)
    out = (summarize_history() + drop_oldest_turns())(s)
    assert out.candidate.summarized == frozenset(range(1, 9))
    (action,) = [a for a in out.actions if a.strategy == "summarize_history"]
    assert action.summarized_messages == tuple(range(1, 9)) and action.detail["source"] == "cached"
    sent = out.build_messages(out.candidate)
    assert len(sent) == len(msgs) - 8 - len(out.candidate.removed)
    assert sent[0]["role"] == "system" and sent[0]["content"].startswith("You are a helpful assistant.")
    assert sent[0]["content"].endswith("Summary of the earlier conversation:\nThe user asked about many numbered topics.")
    assert msgs[0]["content"] == "You are a helpful assistant."  # the caller's dict is untouched
    assert out.prediction.prompt_tokens < s.prediction.prompt_tokens


def test_summarize_history_inserts_a_system_message_when_there_is_none():
    msgs = conversation(6, system=False)
    cache = SummaryCache()
    cache.put(msgs[:8], _summary(covered=8))
    out = summarize_history()(state(msgs, budget=budget_for_tokens(tokens_of(msgs[6:]) + 60), summaries=cache))
    sent = out.build_messages(out.candidate)
    assert sent[0] == {"role": "system", "content": "Summary of the earlier conversation:\nThe user asked about many numbered topics."}
    assert [m["role"] for m in sent[1:]] == ["user", "assistant", "user", "assistant", "user"]


def test_summarize_history_respects_keep_last_turns():
    msgs = conversation(5)
    cache = SummaryCache()
    cache.put(_turn_messages(msgs, 2), _summary("two turns", covered=4))
    cache.put(_turn_messages(msgs, 5), _summary("all turns", covered=10))
    both = summarize_history(keep_last_turns=3) + drop_oldest_turns()
    out = both(state(msgs, budget=0.2, summaries=cache))
    assert out.candidate.summary.text == "two turns"
    out = (summarize_history() + drop_oldest_turns())(state(msgs, budget=0.2, summaries=cache))
    assert out.candidate.summary.text == "all turns"


def test_summarize_history_skips_a_summary_that_does_not_help():
    msgs = conversation(3, words=5)
    cache = SummaryCache()
    cache.put(_turn_messages(msgs, 1), _summary("very long summary " * 200, covered=2))
    assert summarize_history()(state(msgs, budget=0.05, summaries=cache)) is None


def test_summarize_history_probes_a_cached_summary_candidate():
    msgs = conversation(6)
    cache = SummaryCache()
    summary = _summary(covered=8)
    cache.put(_turn_messages(msgs, 4), summary)
    # the engine holds this exact prompt from the previous turn
    sent = [append_text(msgs[0], f"\n\n{summary_note(summary)}"), *msgs[9:]]
    held = holding((sent, 10_000))
    out = summarize_history()(state(msgs, budget=0.3, summaries=cache, cache=held))
    assert held.looked_up == [tokenizer().prompt_tokens(sent)]
    assert out.prediction.cached_tokens == len(held.looked_up[0]) - 1  # all but the last token of the exact prompt
    assert out.fits


def test_summarize_history_inline_counts_its_time_against_the_budget():
    msgs = conversation(8)
    cache = SummaryCache()
    s = state(msgs, budget=budget_for_tokens(tokens_of(msgs) // 2) + 0.25, summaries=cache, clock=FakeClock(0.25))
    out = (summarize_history(inline=True, target_tokens=40) + drop_oldest_turns())(s)
    assert out is not None
    (action,) = [a for a in out.actions if a.strategy == "summarize_history"]
    assert action.detail["source"] == "inline" and action.detail["inline_s"] == pytest.approx(0.25)
    assert out.candidate.extra_s == pytest.approx(0.25)
    assert out.prediction.ttft_s == pytest.approx(s.estimate(attrs.evolve(out.candidate, extra_s=0.0)).ttft_s + 0.25)
    # it summarized only the oldest turns needed, and cached the result for the next request
    n = action.detail["turns"]
    assert 1 <= n < 8
    assert cache.get(_turn_messages(msgs, n)) == out.candidate.summary


def test_summarize_history_inline_failure_is_logged(caplog):
    broken = PromptSummarizer(lambda p: (_ for _ in ()).throw(RuntimeError("no model")))
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert summarize_history(summarizer=broken, inline=True)(state(conversation(6), budget=0.2)) is None
    assert "no model" in caplog.text


def test_summarize_history_inline_uses_the_given_summarizer():
    out = summarize_history(summarizer=PromptSummarizer(lambda p: "They talked."), inline=True)(state(conversation(6), budget=0.3))
    assert out.candidate.summary.text == "They talked." and out.candidate.summary.summarizer == "prompt"


# -- drop_oldest_turns ---------------------------------------------------------------------------
def test_drop_oldest_turns_drops_the_fewest_that_fit():
    msgs = conversation(6)
    without_two = msgs[:1] + msgs[5:]
    s = state(msgs, budget=budget_for_tokens(tokens_of(without_two)))
    out = drop_oldest_turns()(s)
    (action,) = out.actions
    assert action.removed_messages == (1, 2, 3, 4)
    assert out.fits
    assert out.build_messages(out.candidate) == without_two


def test_drop_oldest_turns_keeps_tool_calls_with_their_results():
    msgs = [{"role": "system", "content": "sys"}]
    for n in range(4):
        msgs += tool_turn(n)
    msgs.append({"role": "user", "content": "and now?"})
    out = drop_oldest_turns()(state(msgs, budget=budget_for_tokens(tokens_of(msgs) * 2 // 3)))
    removed = out.actions[0].removed_messages
    assert removed and len(removed) % 4 == 0
    assert removed == tuple(range(1, 1 + len(removed)))  # whole turns, oldest first


def test_drop_oldest_turns_respects_keep_last_turns():
    msgs = conversation(5)
    out = drop_oldest_turns(keep_last_turns=3)(state(msgs, budget=budget_for_tokens(tokens_of(msgs[:1] + msgs[7:]))))
    assert out.actions[0].removed_messages == tuple(range(1, 7)) and out.fits
    assert drop_oldest_turns(keep_last_turns=3)(state(msgs, budget=0.05)) is None  # cannot fit: nothing to offer


def test_the_engine_drops_a_summary_that_costs_more_than_it_is_worth():
    msgs = conversation(4)
    cache = SummaryCache()
    cache.put(_turn_messages(msgs, 4), _summary("a rambling summary " * 150, covered=8))
    out = (summarize_history() + drop_oldest_turns())(state(msgs, budget=budget_for_tokens(tokens_of(msgs[:1] + msgs[-1:]) + 40), summaries=cache))
    assert out.candidate.summary is None and out.candidate.removed == frozenset(range(1, 9))


def test_drop_oldest_turns_without_history_does_nothing():
    assert drop_oldest_turns()(state(conversation(0), budget=0.01)) is None


def test_a_custom_strategy_can_be_written_against_plan_state():
    @attrs.frozen
    class drop_everything_old(Strategy):
        name: ClassVar[str] = "drop_everything_old"

        def __call__(self, state):
            gone = frozenset(i for s, e in state.history_turns for i in range(s, e))
            return state.apply(attrs.evolve(state.candidate, removed=gone), Action(self.name, "all", removed_messages=tuple(sorted(gone))))

    out = drop_everything_old()(state(conversation(3), budget=0.1))
    assert out.candidate.removed == frozenset(range(1, 7))
