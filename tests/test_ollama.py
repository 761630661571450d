"""trimkit.wrap(ollama.Client) on Ollama's native API, against a loopback server replaying replies
recorded from Ollama's own documentation and the official client's tests.

No real Ollama server can be installed here (docs/servers.md says what was and was not
verified). Each reply below names its source:

- DOCS: ollama/ollama ``docs/api.md`` (commit 01e52d24bc00defcd9bcc6d995b11df0f08bc6f1),
  "Generate a chat completion": the streamed lines and final line of "Chat request
  (Streaming)", "Chat request (Structured outputs)" (a cold load: ``load_duration`` 574751416),
  "Chat request (with tools)", and "Generate request (Streaming)" for ``/api/generate``;
- CLIENT_TESTS: ollama/ollama-python ``tests/test_client.py`` (commit
  0221728a9f4b03871f25efeb2ee5d4a3dea65fdb), ``test_client_chat_stream``: three lines
  without a final ``done`` line.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from typing import Any

import pytest

ollama = pytest.importorskip("ollama")

import trimkit  # noqa: E402
from tests._core_helpers import make_profile  # noqa: E402
from tests.test_server_faults import FaultServer, json_reply, raw_reply  # noqa: E402
from trimkit.backends.ollama import OllamaBackend  # noqa: E402
from trimkit.errors import InvalidInputError, PromptTruncatedError, ServerError, StreamInterruptedError  # noqa: E402
from trimkit.wrapper import AsyncTrimmedOllama, TrimmedOllama, cold_load_note  # noqa: E402

# DOCS, "Chat request (Streaming)": a content line, then the final line
DOCS_STREAM_LINE = {"model": "llama3.2", "created_at": "2023-08-04T08:52:19.385406455-07:00",
                    "message": {"role": "assistant", "content": "The", "images": None}, "done": False}
DOCS_STREAM_FINAL = {"model": "llama3.2", "created_at": "2023-08-04T19:22:45.499127Z", "done": True, "total_duration": 4883583458,
                     "load_duration": 1334875, "prompt_eval_count": 26, "prompt_eval_duration": 342546000, "eval_count": 282,
                     "eval_duration": 4535599000}
# DOCS, "Chat request (Structured outputs)": the model was loaded for this request (574.75 ms)
DOCS_COLD = {"model": "llama3.1", "created_at": "2024-12-06T00:46:58.265747Z",
             "message": {"role": "assistant", "content": "{\"age\": 22, \"available\": false}"}, "done_reason": "stop", "done": True,
             "total_duration": 2254970291, "load_duration": 574751416, "prompt_eval_count": 34, "prompt_eval_duration": 1502000000,
             "eval_count": 12, "eval_duration": 175000000}
# DOCS, "Chat request (with tools)"
DOCS_TOOLS = {"model": "llama3.2", "created_at": "2024-07-22T20:33:28.123648Z",
              "message": {"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": "get_current_weather", "arguments": {"format": "celsius", "location": "Paris, FR"}}}]},
              "done_reason": "stop", "done": True, "total_duration": 885095291, "load_duration": 3753500, "prompt_eval_count": 122,
              "prompt_eval_duration": 328493000, "eval_count": 33, "eval_duration": 552222000}
# CLIENT_TESTS, test_client_chat_stream: no final line
CLIENT_TEST_LINES = [{"model": "dummy", "message": {"role": "assistant", "content": part}} for part in ("I ", "don't ", "know.")]

QUESTION = [{"role": "user", "content": "why is the sky blue?"}]


def ndjson(*lines: dict[str, Any], status: int = 200) -> Any:
    return raw_reply(b"".join(json.dumps(line).encode() + b"\n" for line in lines), status=status, content_type="application/x-ndjson")


class OllamaReplay(FaultServer):
    """A loopback server answering ``/api/chat`` with recorded lines; keeps every body it got."""

    def __init__(self, *lines: dict[str, Any]) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []
        self.replay(*(lines or (DOCS_STREAM_LINE, DOCS_STREAM_FINAL)))
        self.routes["/api/version"] = json_reply({"version": "0.5.1"})  # DOCS, "Version"

    def replay(self, *lines: dict[str, Any], status: int = 200) -> None:
        reply = ndjson(*lines, status=status)

        def recorded(h: Any, body: dict[str, Any]) -> None:
            self.bodies.append(body)
            reply(h, body)

        self.routes["/api/chat"] = recorded

    @property
    def host(self) -> str:
        return self.base_url[: -len("/v1")]


@pytest.fixture
def replay():
    s = OllamaReplay()
    yield s
    s.close()


def wrapped(replay: OllamaReplay, **kwargs: Any) -> TrimmedOllama:
    kwargs.setdefault("profile", make_profile())
    return trimkit.wrap(ollama.Client(host=replay.host), model="llama3.2", **kwargs)


def test_wrap_returns_the_clients_own_chat_response_with_the_engines_numbers(replay):
    chat = wrapped(replay)
    assert isinstance(chat, TrimmedOllama)
    out = chat.chat(model="llama3.2", messages=QUESTION)
    assert isinstance(out, ollama.ChatResponse)
    assert out.message.content == "The" and out.done and out.prompt_eval_count == 26 and out.eval_count == 282
    m = chat.last_report.measurement
    assert m.timing_source == "ollama"
    assert m.engine_prefill_s == pytest.approx(0.342546)  # prompt_eval_duration, ns
    assert m.evaluated_tokens == 26 and m.completion_tokens == 282
    assert m.server["load_s"] == pytest.approx(0.001334875)


def test_the_request_asks_for_the_planned_context_and_streams(replay):
    chat = wrapped(replay, n_ctx=8192)
    chat.chat(model="llama3.2", messages=QUESTION, options={"temperature": 0, "num_predict": 64}, keep_alive="5m")
    body = replay.bodies[-1]
    assert body["options"] == {"temperature": 0, "num_predict": 64, "num_ctx": 8192}
    assert body["stream"] is True and body["model"] == "llama3.2" and body["keep_alive"] == "5m"
    assert body["messages"] == QUESTION


def test_stream_yields_chat_responses_and_reports_at_the_end(replay):
    chat = wrapped(replay)
    stream = chat.chat(model="llama3.2", messages=QUESTION, stream=True)
    parts = list(stream)
    assert all(isinstance(p, ollama.ChatResponse) for p in parts) and [p.done for p in parts] == [False, True]
    assert stream.report is not None and stream.report.measurement.evaluated_tokens == 26


def test_tool_calls_survive_the_rebuilt_response(replay):
    replay.replay(DOCS_TOOLS)
    out = wrapped(replay).chat(model="llama3.2", messages=[{"role": "user", "content": "What is the weather today in Paris?"}])
    call = out.message.tool_calls[0]
    assert call.function.name == "get_current_weather" and call.function.arguments == {"format": "celsius", "location": "Paris, FR"}


def test_a_cold_load_is_reported_and_not_learned_as_first_token_overhead(replay):
    replay.replay(DOCS_COLD)
    chat = wrapped(replay)
    chat.chat(model="llama3.1", messages=QUESTION)
    report = chat.last_report
    assert report.measurement.server["load_s"] == pytest.approx(0.574751416)
    assert report.measurement.engine_prefill_s == pytest.approx(1.502)  # prefill, without the load
    assert any("cold load" in w for w in report.warnings)


def test_the_cold_load_note_appears_only_for_a_load_that_is_a_share_of_the_wait():
    from tests._core_helpers import make_measurement

    warm = make_measurement(engine_prefill_s=0.342546, server={"load_s": 0.001334875})  # DOCS streaming example
    cold = make_measurement(engine_prefill_s=1.502, server={"load_s": 0.574751416})  # DOCS structured outputs
    assert cold_load_note(warm) == () and len(cold_load_note(cold)) == 1


def test_the_load_is_taken_out_of_the_ttft_that_is_learned():
    from tests._core_helpers import make_measurement
    from trimkit.pipeline import _whole_request

    class Sent:
        replans = ()

    m = make_measurement(ttft_s=0.7, server={"load_s": 0.5})
    assert _whole_request(m, Sent()).ttft_s == pytest.approx(0.2)
    assert _whole_request(make_measurement(ttft_s=0.7), Sent()).ttft_s == 0.7


LONG = [{"role": "user", "content": " ".join(["the sky scatters blue light more than red light"] * 40)}]


def test_a_prompt_the_server_cut_raises_a_typed_error_with_the_report(replay):
    # the docs' reply took in 26 tokens; trimkit sent about 400: the server cut the prompt
    chat = wrapped(replay)
    with pytest.raises(PromptTruncatedError) as info:
        chat.chat(model="llama3.2", messages=LONG)
    assert info.value.truncated_tokens > 300 and info.value.report.measurement.truncated_tokens == info.value.truncated_tokens


def test_on_truncation_warn_answers_and_warns_loudly(replay, caplog):
    chat = wrapped(replay, on_truncation="warn")
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        out = chat.chat(model="llama3.2", messages=LONG)
    assert out.message.content == "The"
    assert chat.last_report.measurement.truncated_tokens > 300
    assert any("truncated" in r.getMessage() for r in caplog.records)


def test_a_prompt_that_fits_is_not_called_truncated(replay):
    chat = wrapped(replay, on_truncation="raise")
    chat.chat(model="llama3.2", messages=QUESTION)  # ~14 tokens sent, 26 taken in (the template's own)
    assert chat.last_report.measurement.truncated_tokens == 0


def test_a_prompt_over_the_window_is_caught_whatever_the_estimates_tolerance():
    from trimkit.backends.replies import ServerStats, detect_truncation

    stats = ServerStats(source="ollama", prompt_tokens=4096)
    assert detect_truncation(4500, stats, tolerance_tokens=1125) == 0
    assert detect_truncation(4500, stats, tolerance_tokens=1125, context_tokens=4096) == 404


def test_with_a_budget_the_plan_keeps_the_prompt_inside_the_window(replay):
    chat = wrapped(replay, n_ctx=256, ttft_budget_s=30.0, on_truncation="warn")  # the replayed reply took in 26 tokens
    history = []
    for i in range(12):
        history += [{"role": "user", "content": f"question {i} " + "about the sky " * 8}, {"role": "assistant", "content": "an answer " * 8}]
    chat.chat(model="llama3.2", messages=history + QUESTION, options={"num_predict": 32})
    report = chat.last_report
    assert report.prompt_tokens <= 256 - 32 < report.prompt_tokens_before and not report.passthrough  # turns dropped to fit num_ctx
    assert replay.bodies[-1]["messages"][-1] == QUESTION[0]


def test_async_client(replay):
    chat = trimkit.wrap(ollama.AsyncClient(host=replay.host), model="llama3.2", profile=make_profile())
    assert isinstance(chat, AsyncTrimmedOllama)

    async def run() -> Any:
        out = await chat.chat(model="llama3.2", messages=QUESTION)
        stream = await chat.chat(model="llama3.2", messages=QUESTION, stream=True)
        parts = [p async for p in stream]
        return out, parts, stream.report

    out, parts, report = asyncio.run(run())
    assert isinstance(out, ollama.ChatResponse) and out.message.content == "The"
    assert len(parts) == 2 and report.measurement.engine_prefill_s == pytest.approx(0.342546)
    chat.close()


def test_a_stream_without_its_final_line_is_interrupted(replay):
    replay.replay(*CLIENT_TEST_LINES)
    with pytest.raises(StreamInterruptedError) as info:
        wrapped(replay).chat(model="dummy", messages=QUESTION)
    assert info.value.report is not None


def test_an_error_reply_is_a_server_error(replay):
    replay.replay({"error": "model \"nope\" not found, try pulling it first"}, status=404)
    with pytest.raises(ServerError) as info:
        wrapped(replay).chat(model="nope", messages=QUESTION)
    assert info.value.status == 404 and "not found" in info.value.server_message


@pytest.mark.parametrize("bad", [
    {"stream": "yes"},
    {"options": {"num_ctx": 2048}},
    {"messages": "hello"},
])
def test_bad_input_is_refused_before_anything_is_sent(replay, bad):
    chat = wrapped(replay)
    args = {"model": "llama3.2", "messages": QUESTION, **bad}
    with pytest.raises(InvalidInputError):
        chat.chat(**args)
    assert replay.bodies == []


def test_bad_settings_are_refused(replay):
    with pytest.raises(InvalidInputError):
        wrapped(replay, on_truncation="ignore")
    with pytest.raises(InvalidInputError):
        OllamaBackend(object())
    with pytest.raises(InvalidInputError):
        TrimmedOllama(ollama.AsyncClient(host=replay.host), model="m", profile=make_profile())


def test_the_callers_messages_are_not_mutated(replay):
    chat = wrapped(replay, n_ctx=256, ttft_budget_s=30.0, on_truncation="warn")  # the replayed reply took in 26 tokens
    messages = [{"role": "user", "content": "about the sky " * 40}, {"role": "assistant", "content": "ok"}] * 4 + QUESTION
    before = copy.deepcopy(messages)
    chat.chat(model="llama3.2", messages=messages, options={"num_predict": 16})
    assert messages == before


def test_other_attributes_are_the_clients(replay):
    client = ollama.Client(host=replay.host)
    chat = trimkit.wrap(client, model="llama3.2", profile=make_profile())
    assert chat.list is not None and chat.chat is not client.chat and chat.client is client


def test_calibration_probes_go_to_generate_raw(replay):
    bodies: list[dict[str, Any]] = []
    generate = ndjson({"model": "llama3.2", "created_at": "2023-08-04T08:52:19.385406455-07:00", "response": "The", "done": False},
                      {**DOCS_STREAM_FINAL, "response": ""})  # DOCS, "Generate request (Streaming)" shape

    def recorded(h: Any, body: dict[str, Any]) -> None:
        bodies.append(body)
        generate(h, body)

    replay.routes["/api/generate"] = recorded
    backend = OllamaBackend(ollama.Client(host=replay.host), model="llama3.2", n_ctx=2048)
    seconds = backend.measure_prefill(64)
    assert seconds == pytest.approx(0.342546)
    assert bodies[-1]["raw"] is True and bodies[-1]["options"]["num_ctx"] == 2048 and bodies[-1]["options"]["num_predict"] == 1
    assert backend.profile_key().engine_version == "0.5.1"


def test_python_function_tools_are_sent_as_the_client_sends_them(replay):
    def get_current_weather(location: str, format: str) -> str:
        """Get the current weather for a location.

        Args:
          location: The location to get the weather for, e.g. San Francisco, CA
          format: The format to return the weather in, e.g. 'celsius' or 'fahrenheit'
        """
        return "sunny"

    replay.replay(DOCS_TOOLS)
    out = wrapped(replay).chat(model="llama3.2", messages=[{"role": "user", "content": "What is the weather today in Paris?"}],
                               tools=[get_current_weather])
    sent = replay.bodies[-1]["tools"][0]
    assert sent["type"] == "function" and sent["function"]["name"] == "get_current_weather"
    assert set(sent["function"]["parameters"]["properties"]) == {"location", "format"}
    assert out.message.tool_calls[0].function.name == "get_current_weather"


def test_images_are_sent_as_the_client_sends_them(replay):
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8  # bytes, as a caller passes them; the client sends base64
    wrapped(replay).chat(model="llava", messages=[{"role": "user", "content": "what is in this image?", "images": [png]}])
    import base64

    assert replay.bodies[-1]["messages"][0]["images"] == [base64.b64encode(png).decode()]
