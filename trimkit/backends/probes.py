"""Calibration probes of a model server: how long it takes to prefill, to decode, and what a
request costs beyond the prefill (:class:`ServerProbes`).

Probes are real English text (the packaged corpus, :func:`default_probe_text`) cut to a length
counted by the server's own tokenizer, a different leading text for every cold probe so the
server's prefix cache cannot serve it. Prefill probes stream ``/v1/completions`` with raw text
and one generated token; the server's own prompt time is used where it reports one, else the
client TTFT.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from trimkit._tokens import PromptTokenizer
from trimkit.backends.base import Measurement, first_token_overhead_s, probe_text
from trimkit.errors import CalibrationError, ContextTooSmallError, InvalidInputError

__all__ = ["DelegatedProbes", "MAX_PROBE_TEXT_BYTES", "PROBE_WORDS_PER_TOKEN", "ProbedServer", "ServerProbes", "default_probe_text"]

log = logging.getLogger("trimkit")

#: a calibration probe's text never exceeds this many bytes: a tokenize endpoint that counts too
#: few tokens would otherwise make the probe grow without end (CalibrationError instead)
MAX_PROBE_TEXT_BYTES = 1 << 20
#: ... nor this many words per token asked for (real tokenizers give about 1.3 tokens a word)
PROBE_WORDS_PER_TOKEN = 8


def default_probe_text() -> str:
    """Real English text for calibration prompts: the packaged corpus, else a generated one."""
    try:
        return probe_text()
    except OSError:
        rng = random.Random(20240601)
        subjects = ["The engineer", "A small model", "The server", "Every request", "The old library", "A careful reader",
                    "The cache", "Our team", "The river", "A quiet village", "The committee", "The first draft"]
        verbs = ["reads", "measures", "describes", "remembers", "ignores", "explains", "compares", "follows", "rebuilds", "questions"]
        objects = ["the long report", "each number in turn", "the history of the valley", "what the budget allows",
                   "the weather of last spring", "a map of the harbour", "the cost of waiting", "the next chapter",
                   "every token it was given", "the letters from home"]
        tails = ["before the evening train.", "with some patience.", "because nobody else would.", "and then rests.",
                 "while the tea grows cold.", "in plain words.", "as the rules require.", "for the second time."]
        sentences = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}" for _ in range(3000)]
        return " ".join(sentences)


class ProbedServer(Protocol):
    """What the probes need of a backend."""

    base_url: str
    client_is_async: bool

    @property
    def tokenizer(self) -> PromptTokenizer: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def cache_block_tokens(self) -> int: ...

    def send(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Any: ...

    def probe_completion(self, text: str, tokens: list[int], *, max_tokens: int = 1, extra: Mapping[str, Any] | None = None) -> Measurement: ...

    def probe_chat(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Measurement: ...


class ServerProbes:
    """The calibration probes of one server (:class:`~trimkit.backends.base.Backend`'s
    ``warm_up`` and ``measure_*``)."""

    def __init__(self, server: ProbedServer, words: Callable[[], str] = default_probe_text) -> None:
        self.server = server
        self._text = words
        self._words: list[str] | None = None
        self._seq = 0
        self._cache: dict[tuple[int, int], tuple[str, list[int]]] = {}

    @property
    def words(self) -> list[str]:
        if self._words is None:
            self._words = self._text().split()
        return self._words

    def next_offset(self) -> int:
        self._seq += 1
        return self._seq * 7919  # a different leading text for every cold probe

    def prompt(self, n_tokens: int, offset: int) -> tuple[str, list[int]]:
        """Real text starting at word ``offset`` of the probe corpus whose prompt tokenization
        (as the server counts it, BOS included) is ``n_tokens`` long, or as close as word
        boundaries allow. Longer probes at the same offset extend shorter ones."""
        key = (n_tokens, offset)
        if key in self._cache:
            return self._cache[key]
        words = self.words
        rotated = words[offset % len(words) :] + words[: offset % len(words)]
        encode = self.server.tokenizer.encode_prompt
        url = self.server.base_url

        def text_of(k: int) -> str:
            reps = k // len(rotated) + 1
            return " ".join((rotated * reps)[:k])

        # the probe text is capped (MAX_PROBE_TEXT_BYTES, PROBE_WORDS_PER_TOKEN): a tokenizer that
        # counts too few tokens, or the same count whatever the text, must not grow it without end
        bytes_per_word = (sum(len(w) for w in rotated) + len(rotated)) / len(rotated)
        max_words = min(PROBE_WORDS_PER_TOKEN * n_tokens + 64, int(MAX_PROBE_TEXT_BYTES / bytes_per_word))
        lo, hi = 1, n_tokens + 2
        if hi > max_words:
            raise CalibrationError(f"a probe of {n_tokens} tokens would need a text over the {MAX_PROBE_TEXT_BYTES}-byte probe cap")
        count = len(encode(text_of(hi)))
        while count < n_tokens:
            if hi >= max_words:
                raise CalibrationError(f"the server at {url} counts only {count} tokens in {hi} words of text: a {n_tokens}-token "
                                       f"probe would pass the probe cap ({PROBE_WORDS_PER_TOKEN} words a token, {MAX_PROBE_TEXT_BYTES} bytes)")
            longer = min(hi * 2, max_words)
            longer_count = len(encode(text_of(longer)))
            if longer_count <= count:
                raise CalibrationError(f"the server at {url} counts {count} tokens in {hi} words and {longer_count} in {longer}: "
                                       "its tokenize endpoint's counts do not grow with the text, so no probe length can be chosen")
            lo, hi, count = hi, longer, longer_count
        while lo < hi:  # the most words whose tokenization fits n_tokens
            mid = (lo + hi + 1) // 2
            if len(encode(text_of(mid))) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        text = text_of(lo)
        result = (text, encode(text))
        self._cache[key] = result
        return result

    def warm_up(self) -> None:
        """One short completion and one short chat request: pays the server's first-eval costs."""
        self.server.probe_completion(*self.prompt(min(64, self.server.n_ctx // 4), self.next_offset()))
        if not self.server.client_is_async:
            self.server.send([{"role": "user", "content": "Hello."}], {"max_tokens": 1}).drain()

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` the server has cached: the
        server's own prompt time where it reports one, else the client TTFT of a one-token
        completion. A cached probe first sends the prefix alone, then prefix + new tokens."""
        if new_tokens < 1 or cached_tokens < 0:
            raise InvalidInputError(f"new_tokens must be >= 1 and cached_tokens >= 0, got {new_tokens}, {cached_tokens}")
        if new_tokens + cached_tokens + 1 > self.server.n_ctx:  # the prompt and the one generated token
            raise ContextTooSmallError(f"a probe of {new_tokens + cached_tokens} tokens does not fit the server's n_ctx={self.server.n_ctx}")
        offset = self.next_offset()
        if cached_tokens:
            self.server.probe_completion(*self.prompt(cached_tokens, offset))
        m = self.server.probe_completion(*self.prompt(cached_tokens + new_tokens, offset))
        if cached_tokens and m.cached_tokens is not None and m.cached_tokens < cached_tokens - max(self.server.cache_block_tokens, 8):
            log.info("trimkit: depth probe: the server reused %d of the %d primed tokens", m.cached_tokens, cached_tokens)
        seconds = m.engine_prefill_s if m.engine_prefill_s is not None else m.ttft_s
        if seconds is None or seconds <= 0:
            raise CalibrationError(f"the server at {self.server.base_url} sent no token for a prefill probe")
        return seconds

    def measure_decode(self, n_tokens: int = 32) -> float:
        """Decode tokens/s over ``n_tokens`` generated tokens: the server's numbers where it
        reports them, else client-side chunk timing (one token per chunk). One token more than
        ``n_tokens`` is asked for: the first belongs to the prefill, so one step needs two."""
        text, tokens = self.prompt(64, self.next_offset())
        speed = self.server.probe_completion(text, tokens, max_tokens=n_tokens + 1, extra={"ignore_eos": True}).decode_tokens_per_s
        if not speed or not math.isfinite(speed):
            raise CalibrationError(f"the server at {self.server.base_url} produced too few tokens to measure decode speed")
        return speed

    def measure_first_token_overhead(self) -> float:
        """Median over three short chat requests of client TTFT minus prefill (the server's
        prefill time, else a completion probe of the same length measured the same way)."""
        words = self.words

        def probe(i: int) -> Measurement:
            start = self.next_offset() % max(len(words) - 40, 1)
            messages = [{"role": "user", "content": f"Probe {i}: " + " ".join(words[start : start + 30])}]
            return self.server.probe_chat(messages, {"max_tokens": 2, "temperature": 0.0})

        def prefill_s(m: Measurement) -> float:
            return m.engine_prefill_s if m.engine_prefill_s is not None else self.measure_prefill(max(m.prompt_tokens or 1, 1))

        return first_token_overhead_s((probe(i) for i in range(3)), prefill_s)


class DelegatedProbes:
    """The calibration probes of a server backend, delegated to its :class:`ServerProbes`
    (``self.probes``): mixed in before :class:`~trimkit.backends.base.Backend` by the HTTP and
    Ollama backends."""

    probes: ServerProbes

    def warm_up(self) -> None:
        self.probes.warm_up()

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.probes.measure_prefill(new_tokens, cached_tokens)

    def measure_decode(self, n_tokens: int = 32) -> float:
        return self.probes.measure_decode(n_tokens)

    def measure_first_token_overhead(self) -> float:
        return self.probes.measure_first_token_overhead()
