"""Property tests of the reply boundary: arbitrary JSON shapes as server replies.

For every parser of :mod:`trimkit.backends.replies` (and the event-stream reader, the stats reader, the
response assembler) the property is the same: given anything a server could send, the result is
a valid typed value or a trimkit error — never another exception, never a hang — and the input
is left as it was. The parser-level tests run 2,000 examples each (no socket: fast); a smaller
number go through a real socket and the whole backend.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_server_faults import DEADLINE_S, FaultServer, json_reply, make_chat, raw_reply, sse_reply
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.replies import (
    MAX_JSON_DEPTH,
    MAX_SERVER_SECONDS,
    MAX_TOKEN_COUNT,
    Choice,
    Reply,
    ServerStats,
    assemble_chat_completion,
    chunk_content,
    error_message,
    load_json,
    parse_chunk,
    parse_completion,
    parse_server_stats,
    retry_after_s,
)
from trimkit.backends.server import (
    MAX_CONTEXT_TOKENS,
    MAX_TOKEN_ID,
    ModelList,
    parse_models,
    parse_openapi_version,
    parse_props,
    parse_tokens,
    parse_version,
)
from trimkit.backends.transport import EventReader, iter_events
from trimkit.errors import MalformedReplyError, ServerError, TrimkitError

pytestmark = pytest.mark.timeout(300)

PARSER = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOCKET = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# -- strategies: JSON shaped like what servers send, and not --------------------------------------------
#: the field names the parsers read, so that hypothesis explores near-valid shapes, not only noise
FIELDS = ["choices", "delta", "message", "content", "role", "index", "finish_reason", "text", "tool_calls", "function", "name",
          "arguments", "id", "type", "logprobs", "usage", "prompt_tokens", "completion_tokens", "prompt_tokens_details",
          "cached_tokens", "timings", "prompt_n", "cache_n", "prompt_ms", "predicted_n", "predicted_ms", "prompt_eval_count",
          "prompt_eval_duration", "eval_count", "eval_duration", "prompt_eval_cached_count", "error", "model", "created",
          "system_fingerprint", "reasoning_content", "reasoning", "function_call", "data", "tokens", "max_model_len", "meta",
          "n_ctx", "owned_by", "default_generation_settings", "build_info", "version", "info", "title", "prompt", "detail"]

numbers = (st.integers() | st.floats() | st.sampled_from([10**400, -(10**400), 2**31, 2**31 - 1, 2**63, -1, 0, 1e308, -0.0,
                                                           math.nan, math.inf, -math.inf, 1e-300]))
scalars = st.none() | st.booleans() | numbers | st.text(max_size=12)
keys = st.sampled_from(FIELDS) | st.text(max_size=6)
shaped = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys, kids, max_size=4), max_leaves=12)

VALID_CHUNK = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi",
                                                    "tool_calls": [{"index": 0, "id": "t", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{}"}}]},
                            "logprobs": {"content": [{"token": "Hi", "logprob": -0.1}]}, "finish_reason": None}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2}},
               "timings": {"prompt_n": 3, "cache_n": 2, "prompt_ms": 4.5, "predicted_n": 1, "predicted_ms": 2.0}}
VALID_COMPLETION = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi", "tool_calls": None}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
VALID_MODELS = {"object": "list", "data": [{"id": "m", "owned_by": "vllm", "max_model_len": 4096, "meta": {"n_ctx": 2048}}]}
VALID_PROPS = {"default_generation_settings": {"n_ctx": 8192}, "n_ctx": 4096, "build_info": "b5000"}
VALID_OLLAMA = {"prompt_eval_count": 11, "prompt_eval_cached_count": 8, "prompt_eval_duration": 13074791, "eval_count": 18, "eval_duration": 52479709}


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


@st.composite
def near(draw: Any, template: Any) -> Any:
    """``template`` with one to three places replaced by an arbitrary value (or deleted)."""
    value = copy.deepcopy(template)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(value) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = value
        for step in path[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and draw(st.booleans()) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(shaped)
    return value


def replies_like(template: Any) -> st.SearchStrategy[Any]:
    return near(template) | shaped | st.just(copy.deepcopy(template))


def frozen(value: Any) -> str:
    """A comparable snapshot of a JSON value (NaN-safe): to check the input was left unchanged."""
    return json.dumps(value, sort_keys=False, default=repr)


def check_stats(stats: ServerStats) -> None:
    for n in (stats.prompt_tokens, stats.evaluated_tokens, stats.cached_tokens, stats.completion_tokens):
        assert n is None or (isinstance(n, int) and 0 <= n <= MAX_TOKEN_COUNT)
    for s in (stats.prefill_s, stats.decode_s):
        assert s is None or (math.isfinite(s) and 0 <= s <= MAX_SERVER_SECONDS)


def check_choice(choice: Choice) -> None:
    assert isinstance(choice.index, int) and choice.index >= 0
    for text in (choice.role, choice.content, choice.reasoning, choice.text, choice.finish_reason):
        assert text is None or isinstance(text, str)
    for call in choice.tool_calls:
        assert all(v is None or isinstance(v, str) for v in (call.id, call.type, call.name, call.arguments))
        assert call.index is None or (isinstance(call.index, int) and call.index >= 0)
    assert choice.output is None or isinstance(choice.output, str)


def check_reply(reply: Reply, raw: Any) -> None:
    assert reply.raw is raw
    for choice in reply.choices:
        check_choice(choice)
    check_stats(reply.stats)
    assert reply.created is None or (isinstance(reply.created, int) and reply.created >= 0)
    assert all(v is None or isinstance(v, str) for v in (reply.id, reply.model, reply.system_fingerprint))


# -- parser level: 2,000 examples each -------------------------------------------------------------------
@PARSER
@given(replies_like(VALID_CHUNK))
def test_any_stream_chunk_parses_to_a_valid_reply_or_a_trimkit_error(value):
    before = frozen(value)
    try:
        reply = parse_chunk(value)
    except TrimkitError as exc:
        assert isinstance(exc, (MalformedReplyError, ServerError))
    else:
        check_reply(reply, value)
        assert chunk_content(value) == reply.output
        out = assemble_chat_completion([value, value], value)
        assert isinstance(out["choices"], list) and all(isinstance(c["message"], dict) for c in out["choices"])
        json.dumps(out)  # what the caller receives is JSON again
    assert frozen(value) == before


@PARSER
@given(replies_like(VALID_COMPLETION))
def test_any_completion_body_parses_to_a_valid_reply_or_a_trimkit_error(value):
    before = frozen(value)
    try:
        reply = parse_completion(value)
    except TrimkitError as exc:
        assert isinstance(exc, (MalformedReplyError, ServerError))
        if isinstance(value, dict) and value.get("error") is not None and value.get("choices") is None:
            assert not isinstance(exc, MalformedReplyError) or "nested" in str(exc)  # the server's own error, not "malformed"
    else:
        check_reply(reply, value)
        assert isinstance(value, dict) and isinstance(value["choices"], list)
    assert frozen(value) == before


@PARSER
@given(replies_like(VALID_CHUNK) | replies_like(VALID_OLLAMA), st.booleans())
def test_server_stats_are_in_range_or_a_malformed_reply(value, strict):
    before = frozen(value)
    try:
        stats = parse_server_stats(value, strict=strict)
    except TrimkitError as exc:
        assert strict and isinstance(exc, MalformedReplyError) and exc.field
    else:
        check_stats(stats)
    assert frozen(value) == before


@PARSER
@given(replies_like(VALID_MODELS))
def test_any_models_list_parses_or_names_the_field(value):
    before = frozen(value)
    try:
        models = parse_models(value)
    except TrimkitError as exc:
        assert isinstance(exc, MalformedReplyError)
    else:
        assert isinstance(models, ModelList)
        assert all(isinstance(i, str) and i for i in models.ids) and isinstance(models.owned_by, str)
        assert models.n_ctx is None or 0 < models.n_ctx <= MAX_CONTEXT_TOKENS
    assert frozen(value) == before


@PARSER
@given(replies_like(VALID_PROPS) | replies_like({"version": "0.6.3"}) | replies_like({"info": {"title": "x", "version": "1"}}))
def test_server_facts_parse_or_name_the_field(value):
    before = frozen(value)
    for parse in (parse_props, parse_version, parse_openapi_version):
        try:
            result = parse(value)
        except TrimkitError as exc:
            assert isinstance(exc, MalformedReplyError)
            continue
        if parse is parse_props:
            n_ctx, build, switches = result
            assert all(isinstance(v, bool) for v in switches.values())
            assert (n_ctx is None or 0 < n_ctx <= MAX_CONTEXT_TOKENS) and isinstance(build, str) and len(build) <= 200
        else:
            assert isinstance(result, str) and len(result) <= 200
    assert frozen(value) == before


@PARSER
@given(replies_like({"tokens": [1, 2, 3]}) | st.fixed_dictionaries({"tokens": st.lists(numbers | scalars, max_size=30)}), st.integers(0, 40))
def test_any_tokenize_reply_is_token_ids_or_a_malformed_reply(value, most):
    before = frozen(value)
    try:
        tokens = parse_tokens(value, what="/tokenize reply", max_tokens=most)
    except TrimkitError as exc:
        assert isinstance(exc, MalformedReplyError)
    else:
        assert len(tokens) <= most and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens)
    assert frozen(value) == before


def _nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


@PARSER
@given(st.one_of(
    st.binary(max_size=200),
    shaped.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 3000).map(lambda d: _nested(d).encode()),
    st.builds(lambda d, v: ('{"a": ' + _nested(d, json.dumps(v)) + "}").encode(), st.integers(1, 200), shaped),
    st.text(max_size=100).map(str.encode),
))
def test_any_bytes_decode_to_bounded_json_or_a_malformed_reply(data):
    try:
        value = load_json(data, what="body")
    except TrimkitError as exc:
        assert isinstance(exc, MalformedReplyError)
    else:
        def depth(v: Any) -> int:
            if isinstance(v, dict):
                return 1 + max((depth(x) for x in v.values()), default=0)
            if isinstance(v, list):
                return 1 + max((depth(x) for x in v), default=0)
            return 0

        assert depth(value) <= MAX_JSON_DEPTH


def _events(data: bytes, cuts: list[int]) -> tuple[list[Any], str | None]:
    """Read ``data`` as an event stream arriving in pieces cut at ``cuts``: (events, error class name)."""
    events: list[Any] = []
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    try:
        for event in iter_events((data[a:b] for a, b in zip(bounds, bounds[1:])), EventReader(max_event_bytes=4096)):
            events.append(event)
    except TrimkitError as exc:
        return events, type(exc).__name__
    return events, None


sse_lines = st.lists(st.one_of(
    shaped.map(lambda v: "data: " + json.dumps(v)),
    st.sampled_from(["", ": ping", "data: [DONE]", "event: error", "data: {", "data:", "retry: 5", "id: 3"]),
    st.text(max_size=30),
), max_size=12)


@PARSER
@given(sse_lines, st.sampled_from(["\n", "\r\n", "\r"]), st.lists(st.integers(0, 10_000), max_size=6), st.binary(max_size=20))
def test_any_event_stream_decodes_the_same_however_it_is_cut(lines, newline, cuts, tail):
    data = newline.join(lines).encode() + tail
    whole = _events(data, [])
    cut = _events(data, cuts)
    for _events_seen, error in (whole, cut):
        assert error is None or error in ("MalformedReplyError", "ServerError", "StreamInterruptedError")
    # the same events however the bytes arrived, and the same error (or none) after them
    assert frozen(cut[0]) == frozen(whole[0]) and cut[1] == whole[1]


def test_unescaped_unicode_line_separators_stay_inside_their_event():
    # JSON may carry U+2028/U+2029, U+0085, \x0b, \x0c and \x1c-\x1e unescaped; an SSE line ends only at \r, \n or \r\n
    text = "a\u2028b\u2029c\x85d\x0be\x0cf\x1cg\x1dh\x1ei"
    data = ("data: " + json.dumps({"choices": [{"delta": {"content": text}}]}, ensure_ascii=False) + "\n\ndata: [DONE]\n\n").encode()
    events = list(iter_events([data[:9], data[9:31], data[31:]]))
    assert events == [{"choices": [{"delta": {"content": text}}]}]


@PARSER
@given(shaped | st.binary(max_size=100) | st.text(max_size=100) | st.integers(1, 3000).map(_nested))
def test_an_error_body_always_gives_a_short_message(body):
    message = error_message(body)
    assert isinstance(message, str) and len(message) <= 1000


@PARSER
@given(st.one_of(st.none(), st.text(max_size=30), numbers.map(str)))
def test_a_retry_after_header_is_a_bounded_number_of_seconds_or_none(value):
    seconds = retry_after_s(value)
    assert seconds is None or (math.isfinite(seconds) and 0.0 <= seconds <= 3600.0)


# -- through a socket: the whole backend and wrapper ---------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[FaultServer]:
    s = FaultServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def url_chat(server):
    chat = make_chat("url", server, max_attempts=2)
    yield chat
    chat.close()


@pytest.fixture(scope="module")
def openai_chat(server):
    chat = make_chat("openai", server, max_attempts=2)
    yield chat
    chat.close()


def _drive(chat: Any, server: FaultServer, event: Any, finish: bool) -> None:
    """Stream one reply carrying ``event`` through ``chat``: chunks, or a trimkit error, in time."""
    first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}
    events: list[Any] = [first, json.dumps(event).encode().join([b"data: ", b"\n\n"])]
    if finish:
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    server.chat(sse_reply(*events))
    messages = [{"role": "user", "content": "Say hello."}]
    before = copy.deepcopy(messages)
    try:
        chunks = list(chat.chat.completions.create(messages=messages, max_tokens=4, stream=True))
    except TrimkitError as exc:
        assert getattr(exc, "report", None) is not None  # raised mid-stream: the report of what was sent
    else:
        assert chunks and chunk_content(chunks[0]) == "Hi"
    assert messages == before


@SOCKET
@given(event=replies_like(VALID_CHUNK), finish=st.booleans())
def test_any_chunk_through_wrap_url_is_a_result_or_a_trimkit_error(server, url_chat, event, finish):
    _drive(url_chat, server, event, finish)


@SOCKET
@given(event=replies_like(VALID_CHUNK), finish=st.booleans())
def test_any_chunk_through_the_openai_client_is_a_result_or_a_trimkit_error(server, openai_chat, event, finish):
    _drive(openai_chat, server, event, finish)


@SOCKET
@given(body=replies_like(VALID_MODELS) | st.binary(max_size=50))
def test_any_models_reply_through_the_backend_is_server_info_or_a_trimkit_error(server, body):
    server.routes["/v1/models"] = raw_reply(body) if isinstance(body, bytes) else json_reply(body)
    backend = OpenAIHTTPBackend(server.base_url, retry_deadline_s=DEADLINE_S, retry_backoff_s=0.01)
    try:
        info = backend.server_info()
    except TrimkitError as exc:
        assert isinstance(exc, MalformedReplyError)
    else:
        assert info.n_ctx is None or 0 < info.n_ctx <= MAX_CONTEXT_TOKENS
        assert all(isinstance(i, str) for i in info.model_ids) and 0 < backend.n_ctx <= MAX_CONTEXT_TOKENS
    finally:
        backend.close()
        server.routes["/v1/models"] = json_reply({"object": "list", "data": [{"id": "m", "owned_by": "fault"}]})


@SOCKET
@given(body=replies_like({"tokens": [2, 3, 4]}))
def test_any_tokenize_reply_through_the_backend_is_token_ids_or_a_trimkit_error(server, body):
    answers = iter([{"tokens": [2]}])  # the probe at the start is a fair one

    def tokenize(h: Any, request: dict[str, Any]) -> None:
        json_reply(next(answers, body))(h, request)

    server.routes["/extras/tokenize"] = tokenize
    backend = OpenAIHTTPBackend(server.base_url, retry_deadline_s=DEADLINE_S, retry_backoff_s=0.01)
    try:
        tokens = backend.tokenizer.tokenizer.encode("Hello there, sea.")
    except TrimkitError as exc:
        assert isinstance(exc, MalformedReplyError)
    else:
        assert all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens) and len(tokens) <= 2 * 17 + 16
    finally:
        backend.close()
        del server.routes["/extras/tokenize"]
