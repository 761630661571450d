"""Judge each phase of a request against its own standard, and say what decode did.

A local model feels slow for one of two reasons, with different cures (``docs/phases.md``):

- **the wait** before the first token (prefill, TTFT) is longer than the caller can bear: judged
  against the request's TTFT budget, or without one against :data:`DEFAULT_WAIT_THRESHOLD_S`
  (1 s; ``wait_threshold_s=``). Exactly at the limit is not slow.
- **the stream** after it (decode, tokens/s) is slower than its reader: judged against the
  caller's ``tokens_per_s_target`` when given, else against reading speed
  (:data:`READING_SPEED_TOKENS_PER_S`, ~7 tokens/s; ``reading_speed_tokens_per_s=``). Exactly at
  the standard is not slow. How long the answer is does not matter: a long answer streamed
  faster than anyone reads is not a slow stream.

:func:`judge` gives the :class:`Verdict` — ``"none"``, ``"wait"``, ``"stream"`` or ``"both"`` —
with the cures that fit it. :class:`DecodeContext` states what a shorter context did to decode:
trimkit leaves the decode *parameters* untouched (``max_tokens``, ``temperature``, ``stop``,
sampling) and never aims at the stream, but every generated token reads the KV cache as well as
the weights, so a shorter context can speed decode a little, as a side effect. It is measured,
predicted from the profile, and reported as such, never as a trimming gain.
"""

from __future__ import annotations

from typing import Literal

import attrs

from trimkit.validation import budget as valid_budget
from trimkit.validation import count, non_negative_finite, positive_finite

__all__ = [
    "VerdictName", "VERDICTS", "VERDICT_LABELS", "DEFAULT_WAIT_THRESHOLD_S", "READING_SPEED_TOKENS_PER_S",
    "MIN_STATED_DECODE_CHANGE_PCT", "WAIT_CURES", "STREAM_CURES", "NOT_THE_STREAM_CURE", "NOTHING_TO_CURE",
    "DECODE_PARAMETERS_UNTOUCHED", "Verdict", "judge", "DecodeContext", "valid_tokens_per_s_target", "Diagnosis", "diagnose",
]

VerdictName = Literal["none", "wait", "stream", "both"]
VERDICTS: tuple[VerdictName, ...] = ("none", "wait", "stream", "both")
VERDICT_LABELS = {
    "none": "nothing is slow",
    "wait": "the wait (prefill)",
    "stream": "the stream (decode)",
    "both": "both the wait (prefill) and the stream (decode)",
}

_HEADS = {
    "none": "nothing is slow",
    "wait": "the wait (prefill) is slow",
    "stream": "the stream (decode) is slow",
    "both": "both the wait and the stream are slow",
}

#: without a TTFT budget, a wait before the first token longer than this (seconds) is slow
DEFAULT_WAIT_THRESHOLD_S = 1.0
#: roughly how fast people read (~5 words/s ≈ 7 tokens/s): a slower stream is felt as slow
READING_SPEED_TOKENS_PER_S = 7.0
#: the smallest change of decode speed a report states, % (a request's decode speed varies by a
#: few % around its prediction even where single steps hardly vary); a profile whose decode
#: noise is larger raises it to that noise
MIN_STATED_DECODE_CHANGE_PCT = 5.0

WAIT_CURES = (
    "trim what is prefilled (cap RAG chunks, summarize or drop old turns): trimkit.wrap(..., ttft_budget_s=...)",
    "keep stable content first so the KV-cache prefix is reused (system prompt, pinned documents)",
    "prefill stable prefixes off the critical path (chat.prewarm)",
)
STREAM_CURES = (
    "a smaller or faster model",
    "a lower-bit quantization (e.g. Q4_K_M instead of Q8_0)",
    "more memory bandwidth, or offloading layers to a GPU (n_gpu_layers)",
)
NOT_THE_STREAM_CURE = (
    "trimming will not fix the stream: trimkit aims at the wait; a shorter context can speed decode "
    "a little as a side effect, which the report measures"
)
NOTHING_TO_CURE = "nothing needs curing"
DECODE_PARAMETERS_UNTOUCHED = (
    "decode parameters untouched by trimkit: max_tokens, temperature, stop and every other generation "
    "parameter passed through unchanged; trimkit never aims at the stream (a shorter context can speed "
    "decode a little, as a side effect, which the report measures and states as such)"
)


def _fmt_tps(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


@attrs.frozen
class Verdict:
    """Which phase of a request is slow, each judged against its own standard.

    ``wait_slow`` / ``stream_slow`` are None when that phase was not measured (no first token;
    an answer too short to time): an unmeasured phase is never called slow. ``wait_limit_s`` is
    the budget, or the default threshold without one (``wait_limit_source``: ``"budget"`` or
    ``"default"``); ``stream_floor_tokens_per_s`` the caller's target, or reading speed without
    one (``stream_floor_source``: ``"target"`` or ``"reading speed"``)."""

    verdict: VerdictName
    ttft_s: float | None
    decode_tokens_per_s: float | None
    wait_slow: bool | None
    stream_slow: bool | None
    wait_limit_s: float
    wait_limit_source: str
    stream_floor_tokens_per_s: float
    stream_floor_source: str
    reading_speed_tokens_per_s: float

    @property
    def label(self) -> str:
        return VERDICT_LABELS[self.verdict]

    @property
    def cures(self) -> tuple[str, ...]:
        """What helps: the wait's cures, the stream's, both, or none."""
        return {"none": (), "wait": WAIT_CURES, "stream": STREAM_CURES, "both": WAIT_CURES + STREAM_CURES}[self.verdict]

    @property
    def notes(self) -> tuple[str, ...]:
        """What a reader must not conclude: that trimming cures a slow stream, or that anything
        needs curing when nothing is slow."""
        if self.verdict == "none":
            return (NOTHING_TO_CURE,)
        if self.verdict == "stream":
            return (NOT_THE_STREAM_CURE,)
        if self.verdict == "both":
            return ("trimming and caching shorten the wait; the stream needs the decode cures",)
        return ()

    def wait_text(self) -> str:
        limit = f"its {self.wait_limit_s:.3f} s budget" if self.wait_limit_source == "budget" else (
            f"{self.wait_limit_s:g} s (no budget: the default)")
        if self.ttft_s is None:
            return "the wait: not measured (no first token)"
        return f"the wait {self.ttft_s:.3f} s is " + ("over " if self.wait_slow else "within ") + limit

    def stream_text(self) -> str:
        floor = _fmt_tps(self.stream_floor_tokens_per_s)
        standard = f"your target of {floor} tokens/s" if self.stream_floor_source == "target" else f"reading speed ({floor} tokens/s)"
        if self.decode_tokens_per_s is None:
            return "the stream: too short to time"
        out = f"the stream {_fmt_tps(self.decode_tokens_per_s)} tokens/s " + ("is below " if self.stream_slow else "keeps up with ") + standard
        if self.stream_floor_source == "target" and not self.stream_slow and self.decode_tokens_per_s < self.reading_speed_tokens_per_s:
            out += f" (below reading speed, {_fmt_tps(self.reading_speed_tokens_per_s)} tokens/s)"
        return out

    def summary(self) -> str:
        """One line: the verdict and the two judgements behind it."""
        return f"{_HEADS[self.verdict]}: {self.wait_text()}; {self.stream_text()}"

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = attrs.asdict(self)
        d.update(label=self.label, cures=list(self.cures), notes=list(self.notes))
        return d


def valid_tokens_per_s_target(value: object) -> float | None:
    """A stream-speed target as given to :func:`judge` or ``trimkit.wrap(..., tokens_per_s_target=)``:
    None, or a finite number > 0 (else :class:`~trimkit.errors.InvalidNumberError`)."""
    return None if value is None else positive_finite(value, "tokens_per_s_target")


def judge(
    ttft_s: float | None,
    decode_tokens_per_s: float | None,
    *,
    ttft_budget_s: float | None = None,
    tokens_per_s_target: float | None = None,
    reading_speed_tokens_per_s: float = READING_SPEED_TOKENS_PER_S,
    wait_threshold_s: float = DEFAULT_WAIT_THRESHOLD_S,
) -> Verdict:
    """The :class:`Verdict` for a measured wait (``ttft_s``) and stream (``decode_tokens_per_s``);
    either may be None (not measured). The wait is slow when it exceeds ``ttft_budget_s`` (or
    ``wait_threshold_s`` without a budget); the stream when it is slower than
    ``tokens_per_s_target`` (or ``reading_speed_tokens_per_s`` without one). Bad input raises a
    typed :class:`~trimkit.errors.InvalidNumberError` / :class:`~trimkit.errors.InvalidBudgetError`."""
    ttft = None if ttft_s is None else non_negative_finite(ttft_s, "ttft_s")
    tps = None if decode_tokens_per_s is None else non_negative_finite(decode_tokens_per_s, "decode_tokens_per_s")
    reading = positive_finite(reading_speed_tokens_per_s, "reading_speed_tokens_per_s")
    threshold = positive_finite(wait_threshold_s, "wait_threshold_s")
    limit, limit_source = (threshold, "default") if ttft_budget_s is None else (valid_budget(ttft_budget_s), "budget")
    target = valid_tokens_per_s_target(tokens_per_s_target)
    floor, floor_source = (reading, "reading speed") if target is None else (target, "target")
    wait_slow = None if ttft is None else ttft > limit
    stream_slow = None if tps is None else tps < floor
    name: VerdictName = ("both" if stream_slow else "wait") if wait_slow else ("stream" if stream_slow else "none")
    return Verdict(
        verdict=name, ttft_s=ttft, decode_tokens_per_s=tps, wait_slow=wait_slow, stream_slow=stream_slow,
        wait_limit_s=limit, wait_limit_source=limit_source, stream_floor_tokens_per_s=floor, stream_floor_source=floor_source,
        reading_speed_tokens_per_s=reading,
    )


@attrs.frozen
class DecodeContext:
    """The decode speed measured, and the profile's predictions at the context sent and at the
    untrimmed one (the prompt before trimming, the same answer); None: unknown.

    :attr:`side_effect_pct` is how much faster the stream ran because trimming shortened the
    context: the predicted difference (sent vs untrimmed), capped by what the measurement shows
    (measured vs the untrimmed prediction) — stated only when the request was trimmed and that
    figure exceeds the larger of ``noise_pct`` (the profile's decode noise; None: unknown) and
    :data:`MIN_STATED_DECODE_CHANGE_PCT`."""

    measured_tokens_per_s: float | None
    predicted_tokens_per_s: float | None = None
    predicted_before_tokens_per_s: float | None = None
    noise_pct: float | None = None
    trimmed: bool = False

    @property
    def side_effect_pct(self) -> float | None:
        sent, before, measured = self.predicted_tokens_per_s, self.predicted_before_tokens_per_s, self.measured_tokens_per_s
        if not self.trimmed or not sent or not before or measured is None:
            return None
        pct = min(sent / before - 1.0, measured / before - 1.0) * 100.0
        return pct if pct > max(self.noise_pct or 0.0, MIN_STATED_DECODE_CHANGE_PCT) else None

    def statement(self) -> str:
        """What trimkit did to decode, truthfully: its parameters untouched, and the side effect
        of a shorter context when there is one to state."""
        pct = self.side_effect_pct
        if pct is None:
            return "decode parameters untouched by trimkit"
        return (f"decode parameters untouched by trimkit; the stream was ~{pct:.0f} % faster because the context was shorter "
                f"(a side effect, not what trimkit aims at: predicted {_fmt_tps(self.predicted_tokens_per_s or 0.0)} tokens/s "
                f"at the context sent, {_fmt_tps(self.predicted_before_tokens_per_s or 0.0)} untrimmed; measured "
                f"{_fmt_tps(self.measured_tokens_per_s or 0.0)})")

    def predictions_text(self, prompt_tokens: int, prompt_tokens_before: int | None) -> str:
        """The predicted speeds at the context sent and, when trimmed, at the untrimmed one
        (named by their prompt lengths)."""
        if self.predicted_tokens_per_s is None:
            return ""
        out = f"predicted {_fmt_tps(self.predicted_tokens_per_s)} at the {prompt_tokens:,}-token context sent"
        if self.trimmed and self.predicted_before_tokens_per_s is not None and prompt_tokens_before is not None:
            out += f", {_fmt_tps(self.predicted_before_tokens_per_s)} at the untrimmed {prompt_tokens_before:,}"
        return out


# -- the verdict for numbers you measured (trimkit.diagnose) ------------------------------------------
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
