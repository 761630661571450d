"""What a server's own numbers teach about it, request after request: whether it reuses cached
prompt prefixes (:attr:`ServerEvidence.prefix_reuse`), how far trimkit's token count is off
from the server's (:attr:`ServerEvidence.correction`), and the
:class:`~trimkit.backends.base.Measurement` of each request. No I/O.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trimkit._tokens import reusable_prefix_len
from trimkit.backends.base import Clock, Measurement, TimedStream
from trimkit.backends.replies import Reply
from trimkit.backends.server_timings import ServerStats, build_measurement, detect_truncation
from trimkit.backends.streams import StreamState

__all__ = ["ServerEvidence", "CACHE_REPORT_FLAGS", "KEYED_PROMPTS"]

log = logging.getLogger("trimkit")

#: the server flag that makes an engine report its cached prompt tokens (without it the field is
#: absent or ``null``: "not reported", never 0)
CACHE_REPORT_FLAGS = {"vllm": "--enable-prompt-tokens-details", "sglang": "--enable-cache-report"}
#: how many routing keys' last prompts are kept (the least recently sent forgotten first)
KEYED_PROMPTS = 1024


class ServerEvidence:
    """Cache and count evidence of one server. ``cache_block`` gives the engine's prefix-cache
    granularity (it may need the server's facts, so it is asked only when needed);
    ``counts_exact`` whether trimkit's prompt counts are the server's own; ``engine`` the engine
    recognised (None: not yet known), so that one which reports counts but no cached tokens is
    told, once, the flag that would make it (:data:`CACHE_REPORT_FLAGS`)."""

    def __init__(self, url: str, cache_block: Callable[[], int], counts_exact: Callable[[], bool],
                 engine: Callable[[], str | None] = lambda: None) -> None:
        self.url = url
        self.cache_block = cache_block
        self.counts_exact = counts_exact  # is trimkit's prompt count the server's own?
        self.lock = threading.Lock()
        self.last_prompt: list[int] | None = None
        self.prefix_reuse: bool | None = None  # None: the server never said how much it reused
        self.correction = 1.0
        self._samples = 0
        self._reuse_warned = False
        self.engine = engine
        self.flag_warned = False  # the cache-report flag was named
        #: behind a router: the last prompt sent with each routing key (the router keeps a key on one worker)
        self.keyed: collections.OrderedDict[str, list[int]] = collections.OrderedDict()

    def predict_cached_tokens(self, prompt_tokens: Sequence[int], key: str | None = None) -> int:
        """The longest common prefix with the last prompt sent — with routing ``key``, when one
        was sent with it (behind a router, the worker that key stays on) — rounded down to the
        engine's cache block, leaving at least one token to evaluate; 0 once the server has shown
        it does not reuse prefixes."""
        with self.lock:
            last = self.keyed.get(key, self.last_prompt) if key is not None else self.last_prompt
            reuse = self.prefix_reuse
        if reuse is False or not last or not prompt_tokens:
            return 0
        lcp = reusable_prefix_len(last, prompt_tokens)
        block = self.cache_block()
        return (lcp // block) * block

    def remember(self, key: str, prompt_tokens: Sequence[int]) -> None:
        """``prompt_tokens`` were sent with routing ``key``: what that key's worker holds next."""
        with self.lock:
            self.keyed[key] = list(prompt_tokens)
            self.keyed.move_to_end(key)
            while len(self.keyed) > KEYED_PROMPTS:
                self.keyed.popitem(last=False)

    def corrected_count(self, counted_tokens: int) -> int:
        return int(round(counted_tokens * self.correction))

    def learn(self, sent: list[int] | None, predicted_cached: int, stats: ServerStats, truncated: int) -> None:
        block = self.cache_block() if stats.cached_tokens is not None and stats.cached_tokens <= 1 else 1
        if stats.cached_tokens is None and stats.prompt_tokens is not None and not self.flag_warned:
            flag = CACHE_REPORT_FLAGS.get(self.engine() or "")
            if flag is not None:
                self.flag_warned = True
                log.warning("trimkit: %s (%s) reports prompt tokens but not how many it reused from its prefix cache: start it with %s "
                            "so that reports show the cached tokens (until then they read n/a, never 0)", self.url, self.engine(), flag)
        with self.lock:
            if stats.cached_tokens is not None:
                # one token kept is no reuse: llama-server keeps the BOS of a prompt it re-processes in full
                if stats.cached_tokens > 1:
                    self.prefix_reuse = True
                elif predicted_cached >= max(32, 2 * block):
                    if not self._reuse_warned:
                        cure = ("a sliding-window model (Gemma 2/3, ...) re-prefills every turn unless llama-server is started with "
                                "--swa-full" if self.engine() == "llama.cpp" else "sliding-window model or prefix caching off?")
                        log.warning("trimkit: %s reused no cached tokens although %d matched the previous prompt (%s); predicting "
                                    "no reuse from now on", self.url, predicted_cached, cure)
                        self._reuse_warned = True
                    self.prefix_reuse = False
            if sent is not None and stats.prompt_tokens and not truncated:
                # a tokenizer estimate is never off by 5x: a ratio beyond is not a count correction
                ratio = min(max(stats.prompt_tokens / max(len(sent), 1), 0.2), 5.0)
                self._samples += 1
                alpha = max(1.0 / self._samples, 0.2)
                self.correction = (1 - alpha) * self.correction + alpha * ratio
            self.last_prompt = list(sent) if sent is not None else None

    def measure(self, stats: ServerStats, *, ttft_s: float | None, total_s: float, client_decode_s: float | None,
                sent: list[int] | None, predicted_cached: int, finish_reason: str | None, content_chunks: int | None,
                first_output_s: float | None = None, context_tokens: int | None = None) -> Measurement:
        """The measurement of one request (and what it teaches, learned). An estimated count is
        compared with the server's after correction, and only a clear shortfall is truncation —
        or a prompt counted over ``context_tokens`` (the window the request ran in, when trimkit
        set it) of which the server took in no more than the window."""
        exact = self.counts_exact()
        sent_n = len(sent) if sent is not None else None
        if exact or sent_n is None:
            truncated = detect_truncation(sent_n, stats, predicted_cached=predicted_cached, context_tokens=context_tokens)
        else:
            expected = self.corrected_count(sent_n)
            truncated = detect_truncation(expected, stats, predicted_cached=predicted_cached, tolerance_tokens=max(32, expected // 4),
                                          context_tokens=context_tokens)
        self.learn(sent, predicted_cached, stats, truncated)
        extra: dict[str, Any] = {
            "predicted_cached_tokens": predicted_cached,
            "prompt_count_exact": exact,
            "token_count_correction": self.correction,
        }
        if stats.completion_tokens is None and content_chunks:
            extra["completion_tokens_from"] = "content chunks (server did not report)"
        m = build_measurement(stats, ttft_s=ttft_s, total_s=total_s, first_output_s=first_output_s, client_decode_s=client_decode_s,
                              sent_tokens=sent_n, finish_reason=finish_reason, truncated_tokens=truncated, extra=extra)
        if m.completion_tokens is None and content_chunks:
            m = attrs.evolve(m, completion_tokens=content_chunks)
        return m

    def stream_measure(self, sent: list[int] | None, predicted_cached: int, clock: Clock) -> Callable[[StreamState, TimedStream], Measurement]:
        """The ``measure`` of :func:`~trimkit.backends.streams.timed_stream`: a streamed request's
        client timing and the server's numbers from its last chunk that carried any."""

        def measure(state: StreamState, ts: TimedStream) -> Measurement:
            client_decode = None
            if ts.first_content_at is not None and ts.last_chunk_at is not None:
                client_decode = ts.last_chunk_at - ts.first_content_at
            stats = state.stats_reply.stats if state.stats_reply is not None else ServerStats()
            m = self.measure(stats, ttft_s=ts.ttft_s, first_output_s=ts.first_output_s, total_s=(ts.ended_at or clock()) - (ts.started or 0.0),
                             client_decode_s=client_decode, sent=sent, predicted_cached=predicted_cached, finish_reason=state.finish_reason,
                             content_chunks=ts.n_content_chunks)
            if state.served_model:  # what the server says answered: the report compares it with the model asked for
                m = attrs.evolve(m, server={**m.server, "model": state.served_model})
            return m

        return measure

    def whole_measure(self, reply: Reply, total_s: float, sent: list[int], predicted_cached: int) -> Measurement:
        """The measurement of a non-streamed response: the server's numbers only, no TTFT."""
        m = self.measure(reply.stats, ttft_s=None, total_s=total_s, client_decode_s=None, sent=sent, predicted_cached=predicted_cached,
                         finish_reason=reply.finish_reason, content_chunks=None)
        return attrs.evolve(m, server={**m.server, "model": reply.model}) if reply.model else m
