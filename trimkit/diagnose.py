"""Which phase makes a request slow — the wait (prefill) or the stream (decode) — and what helps it.

Trimming and caching shorten the wait before the first token; they do nothing for the stream.
Only a smaller or faster model, a lower-bit quantization, more memory bandwidth or GPU offload
make the stream faster. Use :func:`diagnose` on numbers you measured (or on a report).
"""

from __future__ import annotations

import attrs

from trimkit.validation import count, positive_finite

__all__ = ["Diagnosis", "diagnose", "WAIT_CURES", "STREAM_CURES", "READING_SPEED_TOKENS_PER_S"]

#: roughly how fast people read, in tokens/s; a stream slower than this is felt as slow
READING_SPEED_TOKENS_PER_S = 8.0

WAIT_CURES = (
    "trim what is prefilled (cap RAG chunks, summarize or drop old turns): trimkit.wrap(..., ttft_budget_s=...)",
    "keep stable content first so the KV-cache prefix is reused (system prompt, pinned documents)",
    "prefill stable prefixes off the critical path (chat.prewarm)",
)
STREAM_CURES = (
    "a smaller or faster model",
    "a lower-bit quantization (e.g. Q4_K_M instead of Q8_0)",
    "more memory bandwidth, or offloading layers to a GPU (n_gpu_layers)",
    "(trimming the prompt will not speed up the stream)",
)


@attrs.frozen
class Diagnosis:
    """The two phases of one request, which one dominates, and the cures that fit it."""

    ttft_s: float
    decode_tokens_per_s: float
    prompt_tokens: int | None
    output_tokens: int
    stream_s: float
    dominant_phase: str  # "prefill" or "decode"
    prefill_ms_per_token: float | None
    cures: tuple[str, ...]
    stream_slow: bool

    @property
    def dominant_label(self) -> str:
        return "the wait (prefill)" if self.dominant_phase == "prefill" else "the stream (decode)"

    def lines(self) -> list[str]:
        per_tok = f" ({self.prefill_ms_per_token:.2f} ms per prompt token)" if self.prefill_ms_per_token else ""
        out = [
            f"wait before first token (prefill): {self.ttft_s:.3f} s" + (f" for {self.prompt_tokens} prompt tokens" if self.prompt_tokens else "") + per_tok,
            f"stream (decode): {self.decode_tokens_per_s:.1f} tokens/s → {self.stream_s:.2f} s for {self.output_tokens} output tokens",
            f"dominant phase: {self.dominant_label}",
        ]
        if self.stream_slow:
            out.append(f"note: the stream is slower than reading speed (~{READING_SPEED_TOKENS_PER_S:.0f} tokens/s)")
        out.append("what helps:")
        out.extend(f"  - {c}" for c in self.cures)
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, object]:
        d = attrs.asdict(self)
        d["cures"] = list(self.cures)
        d["dominant_label"] = self.dominant_label
        return d


def diagnose(ttft_s: float, decode_tokens_per_s: float, prompt_tokens: int | None = None, output_tokens: int = 256) -> Diagnosis:
    """Name the phase that dominates a request of ``output_tokens`` and the cures that fit it.

    The wait dominates when the time to first token exceeds the time to stream the answer.
    """
    ttft_s = positive_finite(ttft_s, "ttft_s")
    tps = positive_finite(decode_tokens_per_s, "decode_tokens_per_s")
    if prompt_tokens is not None:
        count(prompt_tokens, "prompt_tokens", minimum=1)
    count(output_tokens, "output_tokens", minimum=1)
    stream_s = output_tokens / tps
    dominant = "prefill" if ttft_s >= stream_s else "decode"
    cures = WAIT_CURES if dominant == "prefill" else STREAM_CURES
    return Diagnosis(
        ttft_s=ttft_s,
        decode_tokens_per_s=tps,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        stream_s=stream_s,
        dominant_phase=dominant,
        prefill_ms_per_token=(ttft_s / prompt_tokens * 1000) if prompt_tokens else None,
        cures=cures,
        stream_slow=tps < READING_SPEED_TOKENS_PER_S,
    )
