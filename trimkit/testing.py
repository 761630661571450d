"""Test doubles for code that uses trimkit: a fake engine, a fake clock and a fake server.

:class:`FakeBackend` prefills at a known :class:`CostModel` cost, reuses the longest common prefix as
llama-cpp-python does and advances a :class:`FakeClock` by what it does, so predicted == measured exactly.
:class:`FakeOpenAIServer` answers an OpenAI-compatible client in memory through ``httpx.MockTransport``.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import httpx

from trimkit.backends.base import Backend, Measurement, TimedStream
from trimkit.backends.replies import chunk_content
from trimkit.errors import ContextTooSmallError, positive_finite
from trimkit.planning.costs import CacheState, CostModel
from trimkit.planning.profile import ProfileKey
from trimkit.planning.queue import DEFAULT_ENGINE_WAIT_S, EngineLease
from trimkit.planning.tokens import PromptTokenizer, TiktokenTokenizer, Tokenizer, chatml_render, common_prefix_len, reusable_prefix_len

__all__ = ["FakeClock", "FakeBackend", "FakeOpenAIServer", "fake_openai_transport"]

DEFAULT_REPLY = "This is a fake reply from the fake backend."


def reply_words(reply: str, max_tokens: Any) -> list[str]:
    return reply.split(" ")[: max(int(max_tokens), 1)]


#: how often :meth:`FakeBackend.measure_prefill_within` asks whether to stop, in seconds of its clock
ABORT_CHECK_S = 0.001


class FakeClock:
    """A clock that moves only when told to: ``clock()`` reads it, ``clock.advance(s)`` moves it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class FakeBackend(Backend):
    """A fake engine: cost ``cost_model.prefill_s(new, cached) + first_token_s``, decode at ``decode_tokens_per_s``,
    ``reply`` one word a token; ``slowdown``: a host that many times slower. ``calls`` records every request as received.
    Like an in-process engine it runs one request at a time (:attr:`engine`; ``with fake.lock:`` is a section of it).
    """

    name = "fake"
    #: seconds ``send`` waits for a stream another thread has not finished, before EngineBusyError
    engine_wait_s: float = DEFAULT_ENGINE_WAIT_S
    n_ctx: int = 8192

    def __init__(self, cost_model: CostModel | None = None, *, clock: FakeClock | None = None, tokenizer: PromptTokenizer | None = None,
                 n_ctx: int = 8192, first_token_s: float = 0.02, decode_tokens_per_s: float = 50.0, reply: str = DEFAULT_REPLY,
                 reuse_prefix: bool = True, slowdown: float = 1.0, attention_prior_tokens: float | None = None,
                 pace: Callable[[int], float] | None = None) -> None:
        self.attention_prior_tokens = attention_prior_tokens
        #: ``pace(position)``: how many times slower than ``cost_model`` a prefill step starting there runs
        self.pace = pace
        #: every watched step as ``(start, end)`` token positions, in order
        self.steps: list[tuple[int, int]] = []
        self._step_s: list[float] = []
        self._origin: int | None = None
        self.cost_model = cost_model or CostModel(overhead_s=0.01, per_token_s=0.0014, depth_s=1e-7)
        if slowdown != 1.0:
            positive_finite(slowdown, "slowdown")
            m = self.cost_model
            self.cost_model = CostModel(overhead_s=m.overhead_s * slowdown, per_token_s=m.per_token_s * slowdown, depth_s=m.depth_s * slowdown,
                                        per_batch_s=m.per_batch_s * slowdown, n_batch=m.n_batch)
            first_token_s *= slowdown
            decode_tokens_per_s /= slowdown
        self.clock: FakeClock = clock or FakeClock()
        self.tokenizer = tokenizer or PromptTokenizer.estimate()
        self.n_ctx = n_ctx
        self.first_token_s = first_token_s
        self.decode_tokens_per_s = decode_tokens_per_s
        self.reply = reply
        self.reuse_prefix = reuse_prefix
        self.kv: list[int] = []
        self.calls: list[tuple[list[Any], dict[str, Any]]] = []
        self.engine = EngineLease(self.clock)
        self.lock = self.engine

    def profile_key(self) -> ProfileKey:
        return ProfileKey(backend=self.name, model="fake-model", n_ctx=self.n_ctx, n_batch=self.cost_model.n_batch, cpu="fake")

    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        return reusable_prefix_len(self.kv, prompt_tokens) if self.reuse_prefix else 0

    def cache_state(self) -> CacheState:
        return CacheState(prompts=(self.kv,) if self.reuse_prefix else ())

    def evaluate_to(self, tokens: Sequence[int], end: int) -> tuple[float, int]:
        """One step of a watched prefill: the context holds ``tokens[:end]`` after. ``(seconds, start)``."""
        target = list(tokens[:end])
        start = common_prefix_len(self.kv, target) if self.reuse_prefix else 0
        if start >= len(target):
            return 0.0, len(target)
        # the steps of one request are parts of one prefill from where it began: watching costs nothing here
        origin = self._origin if self._origin is not None and self._origin <= start else start
        self._origin = origin
        whole = self.cost_model.prefill_s(len(target) - origin, origin)
        done = self.cost_model.prefill_s(start - origin, origin) if start > origin else 0.0
        seconds = max(whole - done, 0.0) * (self.pace(start) if self.pace is not None else 1.0)
        self.clock.advance(seconds)
        self.kv = target
        self.steps.append((start, len(target)))
        self._step_s.append(seconds)
        return seconds, start

    def _unwatched_prefill_s(self, cached: int, total: int) -> float:
        """With a :attr:`pace`, llama.cpp's ``n_batch`` pieces each at the pace of its start."""
        if self.pace is None:
            return self.cost_model.prefill_s(total - cached, cached)
        step = max(int(self.cost_model.n_batch or 512), 1)
        return sum(self.cost_model.prefill_s(min(step, total - b), b) * self.pace(b) for b in range(cached, total, step))

    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None,
             watch: Any = None) -> TimedStream:
        tokens = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        if len(tokens) > self.n_ctx:
            raise ContextTooSmallError(f"prompt of {len(tokens)} tokens exceeds n_ctx={self.n_ctx}")
        # never a lock held across a yield: a stream abandoned by one thread must not block the others
        release, waited = self.engine.hold(self.engine_wait_s)
        self.calls.append((list(messages), dict(params)))
        max_tokens = params.get("max_tokens") or 16
        words = reply_words(self.reply, max_tokens)
        state: dict[str, Any] = {}

        def chunks() -> Iterator[dict[str, Any]]:
            nonlocal tokens
            cached = self.predict_cached_tokens(tokens)
            if watch is not None:
                first = len(self.steps)
                self._origin = None
                messages_sent, sent = watch(self.evaluate_to, self.clock, cached)
                self._origin = None
                tokens = list(sent)
                self.calls[-1] = (list(messages_sent), dict(params))
                new, prefill, left = sum(e - b for b, e in self.steps[first:]), sum(self._step_s), 0.0  # the steps advanced the clock
                self._step_s = []
                if self.kv != tokens:  # the watch stopped short: the engine evaluates the rest
                    k = reusable_prefix_len(self.kv, tokens)
                    left = self.cost_model.prefill_s(len(tokens) - k, k)
                    new, prefill = new + len(tokens) - k, prefill + left
                cached = max(len(tokens) - new, 0)
            else:
                new = len(tokens) - cached
                prefill = left = self._unwatched_prefill_s(cached, len(tokens))
            state.update(cached=cached, new=new, prefill=prefill)
            yield {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            self.clock.advance(left + self.first_token_s)
            for i, w in enumerate(words):
                if i:
                    self.clock.advance(1.0 / self.decode_tokens_per_s)
                yield {"choices": [{"index": 0, "delta": {"content": (" " if i else "") + w}, "finish_reason": None}]}
            yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "length" if len(words) >= max_tokens else "stop"}]}
            self.kv = tokens + [0] * len(words)

        def finish(ts: TimedStream) -> Measurement:
            n_out = len(words)
            return Measurement(
                ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=ts.total_s, prompt_tokens=len(tokens), cached_tokens=state.get("cached"),
                evaluated_tokens=state.get("new"), engine_prefill_s=state.get("prefill"), completion_tokens=n_out,
                engine_decode_s=(n_out - 1) / self.decode_tokens_per_s if n_out > 1 else None, client_decode_s=ts.client_decode_s,
                timing_source="llama_perf", finish_reason="length" if n_out >= max_tokens else "stop",
            )

        return TimedStream(chunks(), started=None, clock=self.clock, content_of=chunk_content, finish=finish,
                           release=release, queue_s=waited)

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens + cached_tokens > self.n_ctx:
            raise ContextTooSmallError(f"probe of {new_tokens + cached_tokens} tokens does not fit n_ctx={self.n_ctx}")
        seconds = self.cost_model.prefill_s(new_tokens, cached_tokens)
        self.clock.advance(seconds)
        return seconds

    def measure_prefill_within(self, new_tokens: int, cached_tokens: int, should_abort: Callable[[], bool]) -> float | None:
        """:meth:`measure_prefill` stopped (None) as soon as ``should_abort()``, asked every :data:`ABORT_CHECK_S`."""
        start = self.clock.now
        seconds = self.measure_prefill(new_tokens, cached_tokens)
        spent, self.clock.now = self.clock.now - start, start
        checks = min(max(64, math.ceil(spent / ABORT_CHECK_S)), 1_000_000)
        for _ in range(checks):
            if should_abort():
                return None
            self.clock.advance(spent / checks)
        return seconds

    def measure_decode(self, n_tokens: int = 32) -> float:
        self.clock.advance(n_tokens / self.decode_tokens_per_s)
        return self.decode_tokens_per_s

    def measure_first_token_overhead(self) -> float:
        return self.first_token_s


class FakeOpenAIServer:
    """An OpenAI-compatible chat server in memory, like llama.cpp's: ``…/chat/completions`` (streamed or not, ``reply``
    one word a token, the common prefix with the previous prompt reported cached), ``…/models``, ``/tokenize`` and
    ``/apply-template`` (ChatML). ``requests`` records ``(method, path, JSON body)``; use :attr:`transport`.
    """

    def __init__(self, *, reply: str = DEFAULT_REPLY, model: str = "fake-model", n_ctx: int = 8192, tokenizer: Tokenizer | None = None) -> None:
        self.reply = reply
        self.model = model
        self.n_ctx = n_ctx
        self.tokenizer: Tokenizer = tokenizer or TiktokenTokenizer()
        self.requests: list[tuple[str, str, Any]] = []
        self.last_prompt: list[int] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        try:
            body = json.loads(request.content) if request.content else None
        except ValueError:
            return _error(400, "the request body is not JSON")
        with self._lock:
            self.requests.append((request.method, path, body))
        if request.method == "POST" and path.endswith("/chat/completions"):
            return self._chat(body)
        if request.method == "GET" and path.endswith("/models"):
            entry = {"id": self.model, "object": "model", "owned_by": "trimkit-fake", "meta": {"n_ctx": self.n_ctx}}
            return httpx.Response(200, json={"object": "list", "data": [entry]})
        if request.method == "POST" and path == "/tokenize" and isinstance(body, Mapping):
            return httpx.Response(200, json={"tokens": self.tokenizer.encode(str(body.get("content", "")))})
        if request.method == "POST" and path == "/apply-template" and isinstance(body, Mapping):
            return httpx.Response(200, json={"prompt": chatml_render(body.get("messages") or [], body.get("tools"))})
        return _error(404, f"no route for {request.method} {path}")

    def _chat(self, body: Any) -> httpx.Response:
        if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list):
            return _error(400, "the body needs \"messages\": an array")
        tokens = self.tokenizer.encode(chatml_render(body["messages"], body.get("tools")))
        with self._lock:
            cached = reusable_prefix_len(self.last_prompt, tokens)
            self.last_prompt = tokens
            n = next(self._ids)
        max_tokens = body.get("max_tokens") or 16
        words = reply_words(self.reply, max_tokens)
        finish = "length" if len(words) >= max_tokens else "stop"
        usage = {"prompt_tokens": len(tokens), "completion_tokens": len(words), "total_tokens": len(tokens) + len(words),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        head = {"id": f"chatcmpl-fake-{n}", "created": 0, "model": body.get("model") or self.model}
        if not body.get("stream"):
            message = {"role": "assistant", "content": " ".join(words)}
            return httpx.Response(200, json={**head, "object": "chat.completion", "usage": usage,
                                             "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
        chunk = {**head, "object": "chat.completion.chunk"}
        deltas = [{"role": "assistant"}, *({"content": (" " if i else "") + w} for i, w in enumerate(words)), {}]
        events = [
            {**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": finish if i == len(deltas) - 1 else None}]}
            for i, d in enumerate(deltas)
        ]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**chunk, "choices": [], "usage": usage})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode("utf-8"), headers={"content-type": "text/event-stream"})


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error", "code": status}})


def fake_openai_transport(**kwargs: Any) -> httpx.MockTransport:
    """``httpx.MockTransport`` over a new :class:`FakeOpenAIServer` (``kwargs`` go to it)."""
    return FakeOpenAIServer(**kwargs).transport
