"""A deterministic fake engine for unit tests of everything above the backend seam.

Its prefill cost is a known function of the tokens it evaluates (a :class:`CostModel`), it keeps
a token-level "KV cache" and reuses the longest common prefix exactly as llama-cpp-python does,
and time comes from an injectable :class:`FakeClock` that the fake advances by the cost of what
it does — so tests can assert predicted == measured exactly. It is never a substitute for the
real path: the real model runs in the default test suite.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from trimkit.backends.base import Backend, Measurement, TimedStream
from trimkit.backends.llama import chunk_content
from trimkit.costmodel import CostModel
from trimkit.errors import ContextTooSmallError
from trimkit.profile import ProfileKey
from trimkit.tokens import PromptTokenizer, common_prefix_len

__all__ = ["FakeClock", "FakeBackend"]


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
    """A fake engine: cost = ``cost_model.prefill_s(new, cached) + first_token_s``; decode at
    ``decode_tokens_per_s``; replies with ``reply`` split into words.

    ``calls`` records every request's messages and parameters exactly as received.
    """

    name = "fake"

    def __init__(
        self,
        cost_model: CostModel | None = None,
        *,
        clock: FakeClock | None = None,
        tokenizer: PromptTokenizer | None = None,
        n_ctx: int = 8192,
        first_token_s: float = 0.02,
        decode_tokens_per_s: float = 50.0,
        reply: str = "This is a fake reply from the fake backend.",
        reuse_prefix: bool = True,
    ) -> None:
        self.cost_model = cost_model or CostModel(overhead_s=0.01, per_token_s=0.0014, depth_s=1e-7)
        self.clock: FakeClock = clock or FakeClock()
        self.tokenizer = tokenizer or PromptTokenizer.estimate()
        self._n_ctx = n_ctx
        self.first_token_s = first_token_s
        self.decode_tokens_per_s = decode_tokens_per_s
        self.reply = reply
        self.reuse_prefix = reuse_prefix
        self.kv: list[int] = []
        self.calls: list[tuple[list[Any], dict[str, Any]]] = []
        self.lock = threading.RLock()

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def profile_key(self) -> ProfileKey:
        return ProfileKey(backend=self.name, model="fake-model", n_ctx=self._n_ctx, n_batch=self.cost_model.n_batch, cpu="fake")

    def predict_cached_tokens(self, prompt_tokens: Sequence[int]) -> int:
        if not self.reuse_prefix or not prompt_tokens:
            return 0
        return min(common_prefix_len(self.kv, prompt_tokens), len(prompt_tokens) - 1)

    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any], *, prompt_tokens: Sequence[int] | None = None) -> TimedStream:
        tokens = list(prompt_tokens) if prompt_tokens is not None else self.tokenizer.prompt_tokens(messages, params.get("tools"))
        if len(tokens) > self._n_ctx:
            raise ContextTooSmallError(f"prompt of {len(tokens)} tokens exceeds n_ctx={self._n_ctx}")
        self.calls.append((list(messages), dict(params)))
        max_tokens = params.get("max_tokens") or 16
        words = self.reply.split(" ")[: max(int(max_tokens), 1)]
        state: dict[str, Any] = {}

        def chunks() -> Iterator[dict[str, Any]]:
            with self.lock:
                cached = self.predict_cached_tokens(tokens)
                new = len(tokens) - cached
                prefill = self.cost_model.prefill_s(new, cached)
                state.update(cached=cached, new=new, prefill=prefill)
                yield {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
                self.clock.advance(prefill + self.first_token_s)
                for i, w in enumerate(words):
                    if i:
                        self.clock.advance(1.0 / self.decode_tokens_per_s)
                    yield {"choices": [{"index": 0, "delta": {"content": (" " if i else "") + w}, "finish_reason": None}]}
                yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "length" if len(words) >= max_tokens else "stop"}]}
                self.kv = tokens + [0] * len(words)

        def finish(ts: TimedStream) -> Measurement:
            n_out = len(words)
            return Measurement(
                ttft_s=ts.ttft_s,
                first_output_s=ts.first_output_s,
                total_s=(ts.ended_at or 0.0) - (ts.started or 0.0),
                prompt_tokens=len(tokens),
                cached_tokens=state.get("cached"),
                evaluated_tokens=state.get("new"),
                engine_prefill_s=state.get("prefill"),
                completion_tokens=n_out,
                engine_decode_s=(n_out - 1) / self.decode_tokens_per_s if n_out > 1 else None,
                client_decode_s=(ts.last_chunk_at - ts.first_content_at) if ts.first_content_at and ts.last_chunk_at else None,
                timing_source="llama_perf",
                finish_reason="length" if n_out >= max_tokens else "stop",
            )

        return TimedStream(chunks(), started=None, clock=self.clock, content_of=chunk_content, finish=finish)

    # -- calibration probes: the exact cost function ------------------------------------------------
    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens + cached_tokens > self._n_ctx:
            raise ContextTooSmallError(f"probe of {new_tokens + cached_tokens} tokens does not fit n_ctx={self._n_ctx}")
        seconds = self.cost_model.prefill_s(new_tokens, cached_tokens)
        self.clock.advance(seconds)
        return seconds

    def measure_decode(self, n_tokens: int = 32) -> float:
        self.clock.advance(n_tokens / self.decode_tokens_per_s)
        return self.decode_tokens_per_s

    def measure_first_token_overhead(self) -> float:
        return self.first_token_s
