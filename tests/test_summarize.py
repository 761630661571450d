import json
import logging
import threading

import pytest

from tests._planner_helpers import conversation, tokenizer
from trimkit.errors import InvalidInputError
from trimkit.planning.summaries import (
    ExtractiveSummarizer,
    PromptSummarizer,
    Summary,
    SummaryCache,
    approx_tokens,
    cap_to_tokens,
    make_summary,
    messages_key,
    summary_job,
)


def _summary(text="s", covered=2):
    return Summary(text=text, covered_messages=covered, source_tokens=100, summary_tokens=5, seconds=0.0, summarizer="t")


class FakeClock:
    def __init__(self, step=0.25):
        self.t = 0.0
        self.step = step

    def __call__(self):
        self.t += self.step
        return self.t


# -- ExtractiveSummarizer --------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "I am planning a trip to Lisbon in May. What should I see? I like old trams."},
    {"role": "assistant", "content": "Lisbon has tram 28, the Alfama district and Belem tower. Trams are busy in May. Go early."},
    {"role": "user", "content": "How much is a tram ticket in Lisbon?"},
    {"role": "assistant", "content": "A single tram ticket costs about 3 euros. A day pass is cheaper for many rides."},
]


def test_extractive_summary_fits_the_target():
    count = tokenizer().count
    for target in (10, 25, 60):
        text = ExtractiveSummarizer().summarize(HISTORY, target_tokens=target, count_tokens=count)
        assert count(text) <= target


def test_extractive_summary_keeps_conversation_order_and_roles():
    text = ExtractiveSummarizer().summarize(HISTORY, target_tokens=200, count_tokens=tokenizer().count)
    lines = text.splitlines()
    assert lines[0].startswith("- User:") and "Lisbon" in lines[0]
    assert [ln.split(":")[0] for ln in lines] == ["- User", "- Assistant", "- User", "- Assistant"]


def test_extractive_summary_prefers_salient_sentences_when_short():
    text = ExtractiveSummarizer().summarize(HISTORY, target_tokens=20, count_tokens=tokenizer().count)
    assert "Lisbon" in text  # the recurring topic survives
    assert "Go early" not in text


def test_extractive_summary_is_deterministic_and_empty_when_nothing_fits():
    s = ExtractiveSummarizer()
    assert s.summarize(HISTORY, target_tokens=40) == s.summarize(HISTORY, target_tokens=40)
    assert s.summarize(HISTORY, target_tokens=1) == ""


def test_cap_to_tokens_cuts_at_a_sentence_boundary():
    text = "One two three. Four five six. Seven eight nine."
    out = cap_to_tokens(text, 8, tokenizer().count)
    assert out in ("One two three.", "One two three. Four five six.")
    assert tokenizer().count(out) <= 8
    assert cap_to_tokens(text, 1000, tokenizer().count) == text


def test_cap_to_tokens_falls_back_to_words_with_an_ellipsis():
    out = cap_to_tokens("alpha beta gamma delta epsilon zeta eta theta", 4, tokenizer().count)
    assert out.endswith("…") and tokenizer().count(out) <= 4


# -- PromptSummarizer ----------------------------------------------------------------------------
def test_prompt_summarizer_calls_complete_once_with_a_transcript():
    prompts = []

    def complete(prompt):
        prompts.append(prompt)
        return "  The user plans a Lisbon trip in May. Tickets cost 3 euros.  "

    text = PromptSummarizer(complete, max_tokens=100).summarize(HISTORY, target_tokens=50, count_tokens=tokenizer().count)
    assert text == "The user plans a Lisbon trip in May. Tickets cost 3 euros."
    assert len(prompts) == 1
    assert "User: I am planning a trip to Lisbon" in prompts[0] and "at most 50 tokens" in prompts[0]


def test_prompt_summarizer_caps_a_rambling_answer_to_max_tokens():
    s = PromptSummarizer(lambda p: "This is a sentence. " * 100, max_tokens=12)
    text = s.summarize(HISTORY, target_tokens=200, count_tokens=tokenizer().count)
    assert 0 < tokenizer().count(text) <= 12


def test_prompt_summarizer_rejects_a_bad_template_and_a_non_string_answer():
    with pytest.raises(InvalidInputError):
        PromptSummarizer(lambda p: "", template="{unknown}")
    with pytest.raises(InvalidInputError):
        PromptSummarizer(lambda p: "", max_tokens=0)
    with pytest.raises(TypeError):
        PromptSummarizer(lambda p: None).summarize(HISTORY, target_tokens=10)  # type: ignore[arg-type]


def test_make_summary_times_and_counts_with_the_injected_clock():
    summary = make_summary(ExtractiveSummarizer(), HISTORY, target_tokens=40, count_tokens=tokenizer(), clock=FakeClock(0.25))
    assert summary.seconds == pytest.approx(0.25)
    assert summary.covered_messages == 4
    assert summary.summarizer == "extractive"
    assert summary.summary_tokens == tokenizer().count(summary.text)
    assert summary.source_tokens > summary.summary_tokens
    json.dumps(summary.to_dict())


# -- SummaryCache ----------------------------------------------------------------------------------
def test_cache_round_trip_and_exact_keys():
    cache = SummaryCache()
    cache.put(HISTORY[:2], _summary("a"))
    assert cache.get([dict(m) for m in HISTORY[:2]]).text == "a"  # equal content, other objects
    changed = [dict(HISTORY[0], content=HISTORY[0]["content"] + "!"), HISTORY[1]]
    assert cache.get(changed) is None
    assert cache.get(HISTORY[:1]) is None


def test_messages_key_is_stable_and_order_sensitive():
    assert messages_key(HISTORY) == messages_key([dict(m) for m in HISTORY])
    assert messages_key(HISTORY) != messages_key(HISTORY[::-1])


def test_best_prefix_returns_the_longest_cached_prefix():
    turns = [HISTORY[:2], HISTORY[2:], [{"role": "user", "content": "more"}]]
    cache = SummaryCache()
    assert cache.best_prefix(turns) is None
    cache.put(HISTORY[:2], _summary("one"))
    cache.put(HISTORY, _summary("two"))
    n, s = cache.best_prefix(turns)
    assert (n, s.text) == (2, "two")
    assert cache.best_prefix(turns[:1])[1].text == "one"


def test_cache_evicts_the_least_recently_used():
    cache = SummaryCache(max_entries=2)
    a, b, c = [[{"role": "user", "content": x}] for x in "abc"]
    cache.put(a, _summary("a"))
    cache.put(b, _summary("b"))
    cache.get(a)
    cache.put(c, _summary("c"))
    assert cache.get(b) is None and cache.get(a) is not None and len(cache) == 2


def test_cache_rejects_non_summaries_and_bad_sizes():
    with pytest.raises(InvalidInputError):
        SummaryCache().put(HISTORY, "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        SummaryCache(max_entries=0)


def test_cache_is_thread_safe():
    cache = SummaryCache(max_entries=1000)
    errors = []

    def worker(k):
        try:
            for i in range(100):
                msgs = [{"role": "user", "content": f"{k}-{i}"}]
                cache.put(msgs, _summary(f"{k}-{i}"))
                assert cache.get(msgs).text == f"{k}-{i}"
                cache.best_prefix([msgs])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) == 400


# -- summary_job -------------------------------------------------------------------------------------
def test_summary_job_is_none_when_history_is_short():
    assert summary_job(conversation(1), ExtractiveSummarizer(), SummaryCache()) is None


def test_summary_job_summarizes_all_but_the_recent_turns_and_caches_it():
    msgs = conversation(6)  # system + 6 turns + question (its own turn)
    cache = SummaryCache()
    job = summary_job(msgs, ExtractiveSummarizer(), cache, count_tokens=tokenizer(), keep_recent_turns=2, target_tokens=60)
    summary = job()
    assert summary is not None and summary.covered_messages == 10  # 5 oldest turns of two messages
    assert cache.get(msgs[1:11]) == summary
    assert summary.summary_tokens <= 60 < summary.source_tokens


def test_summary_job_waits_for_enough_new_turns_then_builds_on_the_old_summary():
    cache = SummaryCache()
    first = summary_job(conversation(6), ExtractiveSummarizer(), cache, keep_recent_turns=2)()
    one_more = conversation(7)
    assert summary_job(one_more, ExtractiveSummarizer(), cache, keep_recent_turns=2) is None
    seen = []

    class Recording(ExtractiveSummarizer):
        def summarize(self, messages, **kw):
            seen.extend(messages)
            return super().summarize(messages, **kw)

    second = summary_job(conversation(8), Recording(), cache, keep_recent_turns=2)()
    assert second.covered_messages == 14
    assert first.text in seen[0]["content"]  # the earlier summary, not the whole history again
    assert len(seen) == 1 + 4


def test_summary_job_not_due_under_low_pressure():
    class P:
        budget_s = 1.0
        predicted_ttft_before_s = 0.3

    assert summary_job(conversation(8), ExtractiveSummarizer(), SummaryCache(), plan=P()) is None
    P.predicted_ttft_before_s = 0.9
    assert summary_job(conversation(8), ExtractiveSummarizer(), SummaryCache(), plan=P()) is not None


def test_summary_job_snapshots_the_messages():
    msgs = conversation(6)
    cache = SummaryCache()
    job = summary_job(msgs, ExtractiveSummarizer(), cache, keep_recent_turns=2)
    original = [dict(m) for m in msgs[1:11]]
    msgs[1]["content"] = "changed after the job was made"
    job()
    assert cache.get(original) is not None


def test_summary_job_failure_is_logged_not_raised(caplog):
    failing = PromptSummarizer(lambda p: (_ for _ in ()).throw(RuntimeError("model gone")))
    job = summary_job(conversation(6), failing, SummaryCache())
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert job() is None
    assert "model gone" in caplog.text


def test_approx_tokens():
    assert approx_tokens("") == 0 and approx_tokens("abcd") == 1 and approx_tokens("abcde") == 2
