"""How much of ``trimkit demo`` fits this host: the demo's time target, its clock
(:class:`Timeline`), the speeds it plans with (:class:`HostSpeed`) and the sizing of each part
from the profile's predictions (the long prompt, answer lengths, the chat's budget)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "TIME_TARGET_S", "CALIBRATION_SHARE", "BUDGET_SHARE", "LONG_PROMPT_ANSWER_TOKENS", "SHORT_PROMPT_ANSWER_TOKENS",
    "TURN_ANSWER_TOKENS", "LONG_PROMPT_DOCS", "SHORT_PROMPT", "Timeline", "HostSpeed", "decode_s", "predicted_total_s",
    "answer_tokens", "size_long_prompt", "turn_budget",
]


#: What the whole demo aims to take on any host: loading the model, calibrating (unless a profile
#: is stored) and every request. What it runs is sized to this from the host's measured speed.
TIME_TARGET_S = 150.0
#: The share of the time target a calibration may take when no usable profile is stored.
CALIBRATION_SHARE = 0.2
#: Without ``--budget``, the chat's budget is the predicted TTFT of this share of the untrimmed prompt.
BUDGET_SHARE = 0.45
#: Generated tokens: the long prompt's short answer, the short prompt's long answer (at most; fewer
#: where decode is slow), a chat turn's answer.
LONG_PROMPT_ANSWER_TOKENS = 24
SHORT_PROMPT_ANSWER_TOKENS = 96
TURN_ANSWER_TOKENS = 32
#: The long prompt of part 2 holds up to this many corpus documents (fewer where prefill is slow).
LONG_PROMPT_DOCS = 10


class Timeline:
    """The demo's clock: time spent, time left of the target, each request's share, a line per step.

    A request may take an equal share of the time left among the requests still to come, so time
    one request did not use goes to the next ones and time one overran is taken from them."""

    def __init__(self, target_s: float, clock: Callable[[], float] = time.perf_counter, out: Any = None) -> None:
        self.target_s = target_s
        self.clock = clock
        self.out = out
        self.t0 = clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return max(self.target_s - self.elapsed(), 0.0)

    def share(self, requests_left: int) -> float:
        """The most the next request may take (predicted TTFT + decode)."""
        return self.left() / max(requests_left, 1)

    def step(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", file=self.out or sys.stdout, flush=True)


class HostSpeed:
    """What the demo plans with: the wrapper's (live) profile for TTFT, and the decode speed the
    last request measured — the profile's until one has (a calibration short of time may only
    have estimated it)."""

    def __init__(self, trimmer: Any) -> None:
        self.trimmer = trimmer
        self.measured_tps: float | None = None

    def predict_ttft_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.trimmer.profile.predict_ttft_s(new_tokens, cached_tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.measured_tps or self.trimmer.profile.decode_tokens_per_s

    def learn(self, report: Any) -> None:
        tps = getattr(report, "decode_tokens_per_s", None)
        if tps is not None and tps > 0:
            self.measured_tps = tps


def decode_s(speed: Any, max_tokens: int) -> float:
    tps = speed.decode_tokens_per_s
    return max_tokens / tps if tps > 0 else 0.0


def predicted_total_s(speed: Any, prepared: Any, max_tokens: int) -> float:
    """Predicted TTFT plus the decode of ``max_tokens``."""
    return (prepared.predicted_ttft_s or 0.0) + decode_s(speed, max_tokens)


def answer_tokens(speed: Any, wanted: int, room_s: float) -> int:
    """Tokens an answer may generate: ``wanted``, fewer when their decode would not fit in
    ``room_s`` at the decode speed (at least one: the wait before it is the point)."""
    tps = speed.decode_tokens_per_s
    if tps <= 0:
        return wanted
    return int(min(wanted, max(room_s * tps, 1)))


def _long_prompt(corpus: Sequence[dict[str, Any]], docs: int) -> list[dict[str, Any]]:
    text = "\n\n".join(d["text"] for d in corpus[:docs])
    return [{"role": "user", "content": text + "\n\nIn one sentence: what is this text about?"}]


SHORT_PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


def size_long_prompt(trimmer: Any, speed: Any, corpus: Sequence[dict[str, Any]], bound_s: float, max_tokens: int) -> tuple[Any, int]:
    """The longest prompt of up to :data:`LONG_PROMPT_DOCS` corpus documents whose predicted TTFT
    plus ``max_tokens`` of decode fits ``bound_s`` (one document if none fits): ``(prepared, documents)``."""
    lo, hi = 1, min(LONG_PROMPT_DOCS, len(corpus))
    best = None
    while lo <= hi:  # the prediction grows with the documents: bisect
        mid = (lo + hi) // 2
        prepared = trimmer.prepare(_long_prompt(corpus, mid))
        if predicted_total_s(speed, prepared, max_tokens) <= bound_s:
            best, lo = (prepared, mid), mid + 1
        else:
            hi = mid - 1
    return best or (trimmer.prepare(_long_prompt(corpus, 1)), 1)


def turn_budget(speed: Any, untrimmed: int, minimal_ttft_s: float, bound_s: float, share: float, max_tokens: int) -> tuple[float, str]:
    """The chat's TTFT budget without ``--budget``: the predicted TTFT of ``share`` of the untrimmed
    prompt, capped so a turn (TTFT + ``max_tokens`` of decode) fits ``bound_s``, but never under the
    predicted TTFT of the smallest prompt (system and question alone). ``(budget, how it was derived)``."""
    share_tokens = max(int(untrimmed * share), 1)
    budget = speed.predict_ttft_s(share_tokens, 0)
    derived = (
        f"  budget {budget:.2f} s: the profile's predicted TTFT for {share:.0%} of the untrimmed "
        f"prompt ({share_tokens:,} of {untrimmed:,} tokens, nothing cached) on this host"
    )
    cap = bound_s - decode_s(speed, max_tokens)
    if budget > cap:
        budget = max(cap, minimal_ttft_s)
        derived += (f",\n  capped at {budget:.2f} s so a turn (TTFT + {max_tokens} tokens of decode) fits its "
                    f"{bound_s:.1f} s share of the time left")
    return budget, derived
