"""Parsing servers' own numbers (trimkit.backends.replies).

Shapes the local llama-cpp-python server does not produce — llama.cpp server ``timings``,
Ollama's native counters, vLLM's ``prompt_tokens_details.cached_tokens`` — are constructed
here as the engines document them and go through the same functions the backend uses.
"""

from __future__ import annotations

import logging

import pytest

from trimkit.backends.replies import (
    SOURCE_CLIENT,
    SOURCE_LLAMA_SERVER,
    SOURCE_OLLAMA,
    SOURCE_USAGE,
    ServerStats,
    build_measurement,
    detect_truncation,
    has_server_stats,
    parse_server_stats,
)

LLAMA_SERVER_FINAL_CHUNK = {
    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1200, "completion_tokens": 40, "total_tokens": 1240},
    "timings": {
        "cache_n": 1136, "prompt_n": 64, "prompt_ms": 96.0, "prompt_per_token_ms": 1.5,
        "predicted_n": 40, "predicted_ms": 800.0, "predicted_per_second": 50.0,
    },
}

OLLAMA_FINAL = {
    "model": "gemma3", "done": True, "done_reason": "stop",
    "total_duration": 174560334, "load_duration": 101397084,
    "prompt_eval_count": 11, "prompt_eval_cached_count": 8, "prompt_eval_duration": 13074791,
    "eval_count": 18, "eval_duration": 52479709,
}

VLLM_USAGE_CHUNK = {
    "choices": [],
    "usage": {"prompt_tokens": 2048, "completion_tokens": 12, "total_tokens": 2060,
              "prompt_tokens_details": {"cached_tokens": 1024}},
}


def test_llama_cpp_server_timings_give_prefill_cache_and_decode():
    s = parse_server_stats(LLAMA_SERVER_FINAL_CHUNK)
    assert s.source == SOURCE_LLAMA_SERVER == "llama.cpp server timings"
    assert (s.prompt_tokens, s.evaluated_tokens, s.cached_tokens) == (1200, 64, 1136)
    assert s.prefill_s == pytest.approx(0.096)
    assert (s.completion_tokens, s.decode_s) == (40, pytest.approx(0.8))
    assert s.raw["timings.prompt_ms"] == 96.0 and s.raw["usage.prompt_tokens"] == 1200


def test_llama_cpp_server_timings_without_usage_sum_evaluated_and_cached():
    s = parse_server_stats({"timings": {"prompt_n": 10, "cache_n": 90, "prompt_ms": 20.0}})
    assert (s.prompt_tokens, s.evaluated_tokens, s.cached_tokens) == (100, 10, 90)


def test_old_llama_cpp_timings_without_cache_n_do_not_invent_a_cached_count():
    s = parse_server_stats({"timings": {"prompt_n": 10, "prompt_ms": 20.0, "predicted_n": 3, "predicted_ms": 30.0}})
    assert s.cached_tokens is None and s.prompt_tokens is None and s.evaluated_tokens == 10


def test_ollama_native_counters_in_nanoseconds():
    s = parse_server_stats(OLLAMA_FINAL)
    assert s.source == SOURCE_OLLAMA
    assert (s.prompt_tokens, s.cached_tokens, s.evaluated_tokens) == (11, 8, 3)
    assert s.prefill_s == pytest.approx(0.013074791)
    assert (s.completion_tokens, s.decode_s) == (18, pytest.approx(0.052479709))
    assert s.raw["load_duration"] == 101397084


def test_ollama_without_cached_count_reports_the_count_as_evaluated():
    payload = {k: v for k, v in OLLAMA_FINAL.items() if k != "prompt_eval_cached_count"}
    s = parse_server_stats(payload)
    assert s.evaluated_tokens == 11 and s.prompt_tokens is None and s.cached_tokens is None


def test_vllm_usage_with_cached_tokens():
    s = parse_server_stats(VLLM_USAGE_CHUNK)
    assert s.source == SOURCE_USAGE
    assert (s.prompt_tokens, s.cached_tokens, s.evaluated_tokens, s.completion_tokens) == (2048, 1024, 1024, 12)
    assert s.prefill_s is None


def test_usage_without_details_leaves_cached_unknown():
    s = parse_server_stats({"usage": {"prompt_tokens": 16, "completion_tokens": 0, "prompt_tokens_details": None}})
    assert s.source == SOURCE_USAGE and s.prompt_tokens == 16
    assert s.cached_tokens is None and s.evaluated_tokens is None


@pytest.mark.parametrize("payload", [None, {}, {"choices": [{"delta": {"content": "hi"}}]}, {"usage": None}, {"usage": {"prompt_tokens": "x"}}])
def test_nothing_reported_means_client_timing(payload):
    s = parse_server_stats(payload)
    assert s == ServerStats() and s.source == SOURCE_CLIENT and not s.reported


def test_openai_objects_keep_server_extras():
    from openai.types.chat import ChatCompletionChunk

    chunk = ChatCompletionChunk.model_validate({
        "id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        **LLAMA_SERVER_FINAL_CHUNK,
    })
    assert has_server_stats(chunk)
    s = parse_server_stats(chunk)
    assert s.source == SOURCE_LLAMA_SERVER and s.cached_tokens == 1136


def test_has_server_stats_is_false_for_a_content_chunk():
    assert not has_server_stats({"choices": [{"delta": {"content": "x"}}]})
    assert has_server_stats(VLLM_USAGE_CHUNK) and has_server_stats(OLLAMA_FINAL)


def test_truncation_is_detected_and_logged(caplog):
    s = parse_server_stats({"usage": {"prompt_tokens": 2048, "completion_tokens": 1}})
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert detect_truncation(5000, s) == 2952
    assert "2952 tokens were silently truncated" in caplog.text


def test_no_truncation_when_counts_match_or_within_tolerance(caplog):
    s = parse_server_stats({"usage": {"prompt_tokens": 1000}})
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert detect_truncation(1000, s) == 0
        assert detect_truncation(1010, s, tolerance_tokens=16) == 0
        assert detect_truncation(None, s) == 0
        assert detect_truncation(1000, ServerStats()) == 0
    assert caplog.text == ""


def test_ollama_truncation_counts_predicted_cache_when_the_server_omits_it():
    evaluated_only = parse_server_stats({"prompt_eval_count": 200, "eval_count": 1})
    assert detect_truncation(1000, evaluated_only, predicted_cached=800) == 0  # a cache hit, not truncation
    assert detect_truncation(1000, evaluated_only, predicted_cached=0) == 800  # Ollama kept only 200


def test_build_measurement_shows_client_ttft_and_server_prefill():
    s = parse_server_stats(LLAMA_SERVER_FINAL_CHUNK)
    m = build_measurement(s, ttft_s=0.150, total_s=1.0, client_decode_s=0.85, sent_tokens=1200, finish_reason="stop")
    assert m.ttft_s == 0.150 and m.engine_prefill_s == pytest.approx(0.096)
    assert m.server["network_overhead_s"] == pytest.approx(0.054)
    assert m.server["cached_tokens_reported"] is True
    assert (m.cached_tokens, m.evaluated_tokens, m.prompt_tokens) == (1136, 64, 1200)
    assert m.timing_source == "llama.cpp server timings"
    assert m.decode_tokens_per_s == pytest.approx(50.0)


def test_build_measurement_says_not_reported():
    m = build_measurement(ServerStats(), ttft_s=0.2, total_s=0.5, sent_tokens=42)
    assert m.cached_tokens is None and m.engine_prefill_s is None
    assert m.server["cached_tokens_reported"] is False and "network_overhead_s" not in m.server
    assert m.prompt_tokens == 42 and m.timing_source == "client"
