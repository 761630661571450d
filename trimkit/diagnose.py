"""Which phase makes a request slow — the wait (prefill), the stream (decode), both or neither —
and what helps it. Use :func:`diagnose` on numbers you measured (or on a report's).

Each phase is judged against its own standard (:mod:`trimkit.verdict`): the wait against your
TTFT budget (without one, 1 s), the stream against your tokens/s target (without one, reading
speed, ~7 tokens/s). Trimming and caching shorten the wait; a slow stream needs a smaller or
faster model, a lower-bit quantization, more memory bandwidth or GPU offload — trimming will not
fix it (a shorter context can speed decode a little, as a side effect, which reports measure).
"""

from __future__ import annotations

import attrs

from trimkit.validation import count, positive_finite
from trimkit.verdict import (
    DEFAULT_WAIT_THRESHOLD_S,
    NOT_THE_STREAM_CURE,
    READING_SPEED_TOKENS_PER_S,
    STREAM_CURES,
    WAIT_CURES,
    Verdict,
    VerdictName,
    judge,
)

__all__ = [
    "Diagnosis", "diagnose", "WAIT_CURES", "STREAM_CURES", "NOT_THE_STREAM_CURE", "READING_SPEED_TOKENS_PER_S",
    "DEFAULT_WAIT_THRESHOLD_S",
]


@attrs.frozen
class Diagnosis:
    """The two phases of one request, the :attr:`verdict` and the cures that fit it.

    ``verdict`` (``"none"``, ``"wait"``, ``"stream"``, ``"both"``) is what is printed and what the
    cures follow; ``judgement`` holds the standards it was judged against. ``dominant_phase``
    (``"prefill"`` when the wait is at least the time to stream ``output_tokens``) and
    ``stream_s`` are informational only: a long answer streamed faster than reading speed is
    not a slow stream."""

    judgement: Verdict
    prompt_tokens: int | None
    output_tokens: int
    stream_s: float
    dominant_phase: str  # "prefill" or "decode": informational
    prefill_ms_per_token: float | None

    @property
    def verdict(self) -> VerdictName:
        return self.judgement.verdict

    @property
    def verdict_label(self) -> str:
        return self.judgement.label

    @property
    def cures(self) -> tuple[str, ...]:
        return self.judgement.cures

    @property
    def wait_slow(self) -> bool:
        return bool(self.judgement.wait_slow)

    @property
    def stream_slow(self) -> bool:
        return bool(self.judgement.stream_slow)

    @property
    def ttft_s(self) -> float:
        return self.judgement.ttft_s or 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.judgement.decode_tokens_per_s or 0.0

    @property
    def dominant_label(self) -> str:
        return "the wait (prefill)" if self.dominant_phase == "prefill" else "the stream (decode)"

    def lines(self) -> list[str]:
        j = self.judgement
        per_tok = f" ({self.prefill_ms_per_token:.2f} ms per prompt token)" if self.prefill_ms_per_token else ""
        out = [
            f"wait before first token (prefill): {self.ttft_s:.3f} s" + (f" for {self.prompt_tokens} prompt tokens" if self.prompt_tokens else "") + per_tok,
            f"stream (decode): {self.decode_tokens_per_s:.1f} tokens/s → {self.stream_s:.2f} s for {self.output_tokens} output tokens",
            f"verdict: {j.summary()}",
        ]
        if self.cures:
            out.append("what helps:")
            out.extend(f"  - {c}" for c in self.cures)
        out.extend(f"note: {n}" for n in j.notes)
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, object]:
        j = self.judgement
        return {
            "verdict": self.verdict,
            "verdict_label": self.verdict_label,
            "summary": j.summary(),
            "cures": list(self.cures),
            "notes": list(j.notes),
            "wait_slow": self.wait_slow,
            "stream_slow": self.stream_slow,
            "ttft_s": self.ttft_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "wait_limit_s": j.wait_limit_s,
            "wait_limit_source": j.wait_limit_source,
            "stream_floor_tokens_per_s": j.stream_floor_tokens_per_s,
            "stream_floor_source": j.stream_floor_source,
            "reading_speed_tokens_per_s": j.reading_speed_tokens_per_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "stream_s": self.stream_s,
            "dominant_phase": self.dominant_phase,
            "dominant_label": self.dominant_label,
            "prefill_ms_per_token": self.prefill_ms_per_token,
        }


def diagnose(
    ttft_s: float,
    decode_tokens_per_s: float,
    prompt_tokens: int | None = None,
    output_tokens: int = 256,
    *,
    ttft_budget_s: float | None = None,
    tokens_per_s_target: float | None = None,
    reading_speed_tokens_per_s: float = READING_SPEED_TOKENS_PER_S,
    wait_threshold_s: float = DEFAULT_WAIT_THRESHOLD_S,
) -> Diagnosis:
    """Judge a measured request: is the wait slow, the stream, both or neither — and what helps.

    ``ttft_s``: the wait before the first token; ``decode_tokens_per_s``: the stream's speed.
    The wait is slow above ``ttft_budget_s`` (without a budget: ``wait_threshold_s``, 1 s); the
    stream below ``tokens_per_s_target`` (without one: ``reading_speed_tokens_per_s``, 7).
    ``prompt_tokens`` (prefill cost per token) and ``output_tokens`` (the time to stream a typical
    answer, and the informational ``dominant_phase``) are only reported. Bad input raises a
    typed :class:`~trimkit.errors.InvalidNumberError` (:class:`~trimkit.errors.InvalidBudgetError`
    for the budget)."""
    ttft_s = positive_finite(ttft_s, "ttft_s")
    tps = positive_finite(decode_tokens_per_s, "decode_tokens_per_s")
    if prompt_tokens is not None:
        count(prompt_tokens, "prompt_tokens", minimum=1)
    count(output_tokens, "output_tokens", minimum=1)
    judgement = judge(ttft_s, tps, ttft_budget_s=ttft_budget_s, tokens_per_s_target=tokens_per_s_target,
                      reading_speed_tokens_per_s=reading_speed_tokens_per_s, wait_threshold_s=wait_threshold_s)
    stream_s = output_tokens / tps
    return Diagnosis(
        judgement=judgement,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        stream_s=stream_s,
        dominant_phase="prefill" if ttft_s >= stream_s else "decode",
        prefill_ms_per_token=(ttft_s / prompt_tokens * 1000) if prompt_tokens else None,
    )
