"""The wrapper (Trimmer) above the backend seam, on the deterministic fake backend."""

from __future__ import annotations

import copy
import json
import logging
import threading

import pytest

import trimkit
from trimkit.backends.base import TimedStream
from trimkit.backends.replies import chunk_content
from trimkit.errors import (
    InfeasibleBudgetError,
    InvalidBudgetError,
    InvalidChunkError,
    InvalidInputError,
    InvalidMessageError,
    StreamInterruptedError,
)
from trimkit.planning.costs import CostModel
from trimkit.testing import FakeBackend, FakeClock
from trimkit.wrapper import TrimmedLlama, Trimmer

WORDS = "the harbour lamp keeper rows out at dawn and counts the fishing boats along the quay".split()


def text(n_words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i + seed) % len(WORDS)] for i in range(n_words))


def conversation(turns: int = 12, words: int = 60) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {t}: " + text(words // 3, t)})
        msgs.append({"role": "assistant", "content": f"answer {t}: " + text(words, t)})
    msgs.append({"role": "user", "content": "What time do the boats come back?"})
    return msgs


@pytest.fixture
def fake(isolated_cache):
    return FakeBackend(CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-7), clock=FakeClock())


@pytest.fixture
def trimmer(fake):
    profile = trimkit.calibrate(fake)  # exact for the fake: its probes return its cost model
    return Trimmer(fake, ttft_budget_s=1.0, profile=profile, clock=fake.clock)


def test_under_budget_passes_the_callers_list_through(trimmer, fake):
    msgs = [{"role": "user", "content": "hi"}]
    prepared = trimmer.prepare(msgs)
    assert prepared.messages is msgs
    trimmer.execute(prepared, {"max_tokens": 4}).__next__()
    assert fake.calls[0][0] == msgs


def test_decode_parameters_pass_through_unchanged(trimmer, fake):
    params = {"max_tokens": 7, "temperature": 0.3, "top_p": 0.9, "stop": ["\n"], "seed": 4}
    TrimmedFake(trimmer).create(conversation(3), **params)
    assert fake.calls[0][1] == params


class TrimmedFake:
    """Drive a Trimmer like the Llama front-end does (non-stream: drain the stream)."""

    def __init__(self, trimmer):
        self.t = trimmer

    def create(self, messages, rag_chunks=None, stream=False, **params):
        prepared = self.t.prepare(messages, rag_chunks, params)
        rs = self.t.execute(prepared, dict(params, stream=stream))
        if stream:
            return rs
        for _ in rs:
            pass
        return rs


def test_over_budget_trims_and_reports_every_removal(trimmer, fake):
    msgs = conversation(20, 90)
    chunks = [trimkit.Chunk(text=text(80, i), id=f"doc-{i}") for i in range(10)]
    before = copy.deepcopy((msgs, chunks))
    rs = TrimmedFake(trimmer).create(msgs, rag_chunks=chunks, max_tokens=4)
    report = rs.report
    assert (msgs, chunks) == before, "caller's messages or chunks were mutated"
    assert report.trimmed and report.actions
    assert report.prompt_tokens < report.prompt_tokens_before
    removed = set()
    for a in report.actions:
        removed.update(a.removed_messages)
        removed.update(a.summarized_messages)
    sent = fake.calls[-1][0]
    kept_contents = {m["content"] for m in sent}
    for i, m in enumerate(msgs[:-1]):
        if m["content"] not in kept_contents and not (m["role"] == "system"):
            assert i in removed, f"message {i} vanished without an action"
    assert report.budget_met
    # the fake's cost is exactly the profile's model: prediction == measurement
    assert report.predicted_ttft_s == pytest.approx(report.measured_ttft_s, rel=1e-6)
    json.dumps(report.to_dict())


def test_trimming_keeps_most_of_the_budget(trimmer):
    msgs = conversation(30, 90)
    rs = TrimmedFake(trimmer).create(msgs, max_tokens=4)
    assert rs.report.predicted_ttft_s / rs.report.ttft_budget_s >= 0.7


def test_stream_yields_chunks_then_reports(trimmer):
    rs = TrimmedFake(trimmer).create(conversation(2), stream=True, max_tokens=5)
    assert rs.report is None
    chunks = list(rs)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert rs.report is not None and rs.report.completion_tokens == 5
    assert trimmer.last_report is rs.report


def test_infeasible_raise_carries_plan_and_report(fake):
    profile = trimkit.calibrate(fake)
    t = Trimmer(fake, ttft_budget_s=0.015, profile=profile, on_infeasible="raise", clock=fake.clock)
    msgs = [{"role": "system", "content": text(400)}, {"role": "user", "content": text(300)}]
    with pytest.raises(InfeasibleBudgetError) as info:
        t.prepare(msgs)
    assert info.value.plan is not None and not info.value.plan.feasible
    assert info.value.report is not None and info.value.report.predicted_ttft_s > 0.015
    assert fake.calls == []


def test_infeasible_best_effort_sends_minimal_prompt_and_says_so(fake):
    profile = trimkit.calibrate(fake)
    t = Trimmer(fake, ttft_budget_s=0.2, profile=profile, clock=fake.clock)
    msgs = [{"role": "system", "content": text(300)}, *conversation(4)[1:-1], {"role": "user", "content": text(200)}]
    rs = TrimmedFake(t).create(msgs, max_tokens=2)
    assert rs.report.feasible is False
    assert any("infeasible" in w for w in rs.report.warnings)
    sent = fake.calls[-1][0]
    assert [m["role"] for m in sent] == ["system", "user"]


@pytest.mark.parametrize(
    "messages, chunks, budget, error",
    [
        ("hello", None, 1.0, InvalidMessageError),
        ([{"content": "no role"}], None, 1.0, InvalidMessageError),
        ([{"role": "wizard", "content": "x"}], None, 1.0, InvalidMessageError),
        ([{"role": "user"}], None, 1.0, InvalidMessageError),
        ([{"role": "user", "content": "q"}], [{"id": "x"}], 1.0, InvalidChunkError),
        ([{"role": "user", "content": "q"}], ["  "], 1.0, InvalidChunkError),
        ([{"role": "user", "content": "q"}], None, 0.0, InvalidBudgetError),
        ([{"role": "user", "content": "q"}], None, -1.0, InvalidBudgetError),
        ([{"role": "user", "content": "q"}], None, float("nan"), InvalidBudgetError),
        ([{"role": "user", "content": "q"}], None, float("inf"), InvalidBudgetError),
    ],
)
def test_bad_input_is_refused_before_anything_is_sent(trimmer, fake, messages, chunks, budget, error):
    with pytest.raises(error):
        trimmer.prepare(messages, chunks, ttft_budget_s=budget)
    assert fake.calls == []


def test_budget_and_target_can_be_changed_and_are_validated(trimmer):
    trimmer.ttft_budget_s = 2.5
    assert trimmer.ttft_budget_s == 2.5
    assert trimmer.prepare([{"role": "user", "content": "q"}]).budget_s == 2.5
    trimmer.ttft_budget_s = None
    assert trimmer.ttft_budget_s is None
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(InvalidBudgetError):
            trimmer.ttft_budget_s = bad
    assert trimmer.ttft_budget_s is None
    trimmer.attainment_target = 0.9
    assert trimmer.attainment_target == 0.9
    for bad in (0, 1, True, "0.9"):
        with pytest.raises(InvalidInputError):
            trimmer.attainment_target = bad
    assert trimmer.attainment_target == 0.9


def test_bad_constructor_arguments(fake):
    profile = trimkit.calibrate(fake)
    with pytest.raises(InvalidInputError):
        Trimmer(fake, profile=profile, on_infeasible="sometimes")
    with pytest.raises(InvalidBudgetError):
        Trimmer(fake, profile=profile, ttft_budget_s=0)
    with pytest.raises(InvalidInputError):
        Trimmer(fake, profile=profile, rag_template="{nope}")
    with pytest.raises(InvalidInputError):
        trimkit.wrap(42)


def test_live_measurements_refine_the_profile(fake):
    # calibrated on a faster machine than the one it now runs on: drift must follow
    fast = FakeBackend(CostModel(overhead_s=0.01, per_token_s=0.001, depth_s=0.0), clock=FakeClock())
    fast_profile = trimkit.calibrate(fast, store=False)
    t = Trimmer(fake, ttft_budget_s=5.0, profile=fast_profile, clock=fake.clock)
    errors = []
    for i in range(8):
        with fake.lock:
            fake.kv = []
        rs = TrimmedFake(t).create([{"role": "user", "content": text(300, i)}], max_tokens=2)
        errors.append(abs(rs.report.ttft_error_pct))
    assert t.profile.drift > 1.3
    assert errors[-1] < errors[0] / 2


def test_one_info_log_line_per_request(trimmer, caplog):
    with caplog.at_level(logging.INFO, logger="trimkit"):
        TrimmedFake(trimmer).create(conversation(2), max_tokens=2)
    lines = [r for r in caplog.records if r.getMessage().startswith("trimkit: backend=")]
    assert len(lines) == 1 and "untouched" in lines[0].getMessage()


def test_concurrent_calls_from_threads_all_report(trimmer, fake):
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(5):
                TrimmedFake(trimmer).create(conversation(3 + (i + j) % 4), max_tokens=3)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(trimmer.reports) == 20 and len(fake.calls) == 20


def test_summaries_are_computed_off_the_critical_path_and_reused(fake):
    profile = trimkit.calibrate(fake)
    strategies = [trimkit.strategies.summarize_history(), trimkit.strategies.drop_oldest_turns()]  # no previous-cut reuse competing
    t = Trimmer(fake, ttft_budget_s=0.9, profile=profile, summarizer=trimkit.planning.summaries.ExtractiveSummarizer(), clock=fake.clock, strategies=strategies)
    convo = conversation(10, 80)
    summarized_turns = 0
    cached = []
    for turn in range(6):
        rs = TrimmedFake(t).create(list(convo), max_tokens=3)
        t.idle()
        if any(a.strategy == "summarize_history" for a in rs.report.actions):
            summarized_turns += 1
            cached.append(rs.report.cached_tokens)
        convo.append({"role": "assistant", "content": "noted " + text(30, turn)})
        convo.append({"role": "user", "content": f"follow-up {turn}: " + text(12, turn)})
    assert summarized_turns >= 2
    assert len(t.summaries) >= 1
    assert max(cached) > 50, "a byte-stable summary should keep the prefix cached on later turns"


def test_later_turns_keep_the_previous_cut_to_reuse_the_cache(fake):
    profile = trimkit.calibrate(fake)
    t = Trimmer(fake, ttft_budget_s=0.6, profile=profile, clock=fake.clock, summarizer=None)  # no summary competing
    convo = conversation(16, 80)
    first = TrimmedFake(t).create(list(convo), max_tokens=3).report
    assert any(a.strategy == "drop_oldest_turns" for a in first.actions)
    convo += [{"role": "assistant", "content": "noted " + text(20)}, {"role": "user", "content": "and then? " + text(8)}]
    second = TrimmedFake(t).create(list(convo), max_tokens=3).report
    assert [a.strategy for a in second.actions] == ["keep_cached_cut"]
    assert second.cached_tokens > 0.5 * second.prompt_tokens
    assert second.prompt_tokens > first.prompt_tokens  # more history kept, for less time
    assert second.measured_ttft_s < first.measured_ttft_s


# -- the learned safety margin and the engine's shared state ---------------------------------------


def test_safety_margin_is_read_from_the_speed_estimate(fake):
    profile = trimkit.calibrate(fake, mode="quick")
    t = Trimmer(fake, ttft_budget_s=1.0, profile=profile, clock=fake.clock)
    assert isinstance(t.safety_margin, float)
    for i in range(30):
        with fake.lock:
            fake.kv = []
        TrimmedFake(t).create([{"role": "user", "content": text(250, i)}], max_tokens=2)
    # the fake is exact: every ratio is 1, so the margin is the 1 % floor
    assert t.engine.speed.observations >= 30
    assert t.safety_margin == pytest.approx(0.01)


def test_report_states_the_margin_used(trimmer):
    report = TrimmedFake(trimmer).create(conversation(2), max_tokens=2).report
    assert report.safety_margin is not None and 0 < report.safety_margin < 1
    assert "safety margin" in str(report) and report.to_dict()["safety_margin"] == report.safety_margin


def test_a_second_wrap_of_the_same_engine_starts_from_what_the_first_learned(fake):
    profile = trimkit.calibrate(fake)
    first = trimkit.wrap(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    fake.cost_model = CostModel(overhead_s=0.013, per_token_s=0.0026, depth_s=1.3e-7)  # 30 % slower
    for i in range(3):
        with fake.lock:
            fake.kv = []
        TrimmedFake(first).create([{"role": "user", "content": text(300, i)}], max_tokens=2)
    second = trimkit.wrap(fake, ttft_budget_s=1.2, profile=profile, clock=fake.clock)
    assert second.live is first.live and second.engine is first.engine
    assert second.profile.drift == pytest.approx(1.3, rel=0.01)
    assert second.safety_margin == first.safety_margin


# -- keeping the answer: the context window, the template, summaries by default -------------------------


def test_with_a_budget_a_prompt_over_the_context_window_is_trimmed_to_fit(isolated_cache):
    fake = FakeBackend(CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-7), clock=FakeClock(), n_ctx=1024)
    profile = trimkit.calibrate(fake, mode="quick")
    t = Trimmer(fake, ttft_budget_s=1e3, profile=profile, clock=fake.clock)  # the budget alone would keep everything
    convo = conversation(20, 60)
    assert len(fake.tokenizer.prompt_tokens(convo)) > 1024
    report = TrimmedFake(t).create(list(convo), max_tokens=100).report
    assert report.prompt_tokens <= 1024 - 100
    assert any(a.removed_messages for a in report.actions)


def test_summaries_are_on_by_default_and_can_be_turned_off(fake):
    profile = trimkit.calibrate(fake, mode="quick")
    assert isinstance(Trimmer(fake, profile=profile).summarizer, trimkit.planning.summaries.ExtractiveSummarizer)
    assert Trimmer(fake, profile=profile, summarizer=None).summarizer is None
    with pytest.raises(InvalidInputError):
        Trimmer(fake, profile=profile, summarizer="abstractive")


def test_a_template_that_drops_a_message_is_named_in_the_report(trimmer):
    class Dropping:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def dropped_messages(self, messages, tools=None):
            return tuple(i for i, m in enumerate(messages) if m.get("role") == "system")

    trimmer.backend.tokenizer = Dropping(trimmer.backend.tokenizer)
    report = TrimmedFake(trimmer).create(conversation(2), max_tokens=2).report
    assert any("dropped message(s) 0 (system)" in w for w in report.warnings)


def test_values_are_validated_and_used(fake):
    profile = trimkit.calibrate(fake, mode="quick")
    with pytest.raises(InvalidInputError):
        Trimmer(fake, profile=profile, values={"history_weight": 1})
    chunks = [trimkit.Chunk(text=text(120, i), id=f"c{i}", score=1.0 - i / 10) for i in range(4)]
    budgeted = [Trimmer(fake, ttft_budget_s=0.9, profile=profile, clock=fake.clock, values=v) for v in (None, trimkit.ValueModel(history_weight=20.0))]
    removed = [len(t.prepare(conversation(8, 60), chunks, {}).plan.removed_message_indices) for t in budgeted]
    assert removed[1] < removed[0]


# -- the report an error carries -------------------------------------------------------------------------


class BreakingFake(FakeBackend):
    """A fake whose stream breaks 0.5 s after its first content chunk, which comes 0.25 s after sending."""

    def send(self, messages, params, *, prompt_tokens=None, **kw):
        self.calls.append((list(messages), dict(params)))

        def chunks():
            yield {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            self.clock.advance(0.25)
            yield {"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}
            self.clock.advance(0.5)
            raise StreamInterruptedError("the engine went away")

        def finish(ts):
            raise AssertionError("a broken stream has no measurement")

        return TimedStream(chunks(), started=None, clock=self.clock, content_of=chunk_content, finish=finish)


def test_an_error_mid_stream_carries_the_report_of_what_was_sent_with_the_time_to_the_failure(isolated_cache):
    fake = BreakingFake(CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-7), clock=FakeClock())
    t = Trimmer(fake, ttft_budget_s=1.0, profile=trimkit.calibrate(fake), clock=fake.clock)
    prepared = t.prepare(conversation(2))
    rs = t.execute(prepared, {"max_tokens": 4})
    with pytest.raises(StreamInterruptedError) as info:
        list(rs)
    report = info.value.report
    assert report is not None and rs.report is None and t.last_report is None  # nothing learned from a failure
    assert report.prompt_tokens == len(prepared.prompt_tokens) and report.predicted_ttft_s == prepared.predicted_ttft_s
    assert report.measurement.ttft_s == pytest.approx(0.25)
    # total_s: from sending to the failure, on every front-end (was 0.0 in-process, the elapsed time over HTTP)
    assert report.measurement.total_s == pytest.approx(0.75)


def test_the_error_report_of_a_stream_that_never_started_has_no_time(trimmer):
    prepared = trimmer.prepare(conversation(1))
    ts = TimedStream(iter(()), started=None, clock=trimmer.pipeline.clock, content_of=chunk_content, finish=lambda ts: None)
    error = StreamInterruptedError("broken")
    trimmer.pipeline.attach_report(error, ts, prepared, {})
    assert error.report.measurement.total_s == 0.0 and error.report.measurement.ttft_s is None


# -- the Llama front-end over the fake engine ---------------------------------------------------------------


def test_trimmed_llama_returns_llama_shaped_responses_and_delegates_the_rest(fake):
    class Llm:  # what the drop-in hands through: anything the wrapper does not define
        def tokenize(self, text):
            return [1, 2, 3]

    chat = TrimmedLlama(Llm(), backend=fake, ttft_budget_s=1.0, profile=trimkit.calibrate(fake), clock=fake.clock)
    out = chat.create_chat_completion(messages=conversation(2), max_tokens=3, temperature=0.0)
    report = chat.last_report
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["content"]
    assert out["usage"] == {"prompt_tokens": report.prompt_tokens, "completion_tokens": 3, "total_tokens": report.prompt_tokens + 3}
    assert report.decode_params == {"max_tokens": 3, "temperature": 0.0}
    stream = chat.create_chat_completion(messages=conversation(2), max_tokens=2, stream=True, ttft_budget_s=0.5)
    assert list(stream) and stream.report is chat.last_report and stream.report.ttft_budget_s == 0.5
    assert chat.tokenize("x") == [1, 2, 3] and chat.profile is chat.pipeline.profile and chat.backend is fake


def test_a_wrapped_backend_has_the_llama_chat_api(fake):
    chat = trimkit.wrap(fake, ttft_budget_s=1.0, profile=trimkit.calibrate(fake), clock=fake.clock)
    assert isinstance(chat, Trimmer)
    out = chat.create_chat_completion(messages=conversation(2), max_tokens=2)
    assert out["choices"][0]["message"]["content"] and out["usage"]["completion_tokens"] == 2
    assert chat.last_report.ttft_budget_s == 1.0 and fake.calls[-1][1] == {"max_tokens": 2}
