"""The per-request report: predicted and measured TTFT (the wait for the engine included), what was
trimmed, the verdict on each phase (:func:`judge`, :func:`diagnose`) and what decode did (docs/phases.md).
:func:`completed` hands each finished report to the report log and the observers (docs/observability.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import attrs

from trimkit.backends.base import Measurement
from trimkit.errors import InvalidInputError, count, non_negative_finite, positive_finite
from trimkit.errors import budget as valid_budget
from trimkit.planning.costs import evaluated_tokens

if TYPE_CHECKING:
    from trimkit.pipeline import Prepared
    from trimkit.planning.profile import Profile

VerdictName = Literal["none", "wait", "stream", "both"]
VERDICTS: tuple[VerdictName, ...] = ("none", "wait", "stream", "both")
VERDICT_LABELS = {"none": "nothing is slow", "wait": "the wait (prefill)", "stream": "the stream (decode)",
                  "both": "both the wait (prefill) and the stream (decode)"}
_HEADS = {"none": "nothing is slow", "wait": "the wait (prefill) is slow", "stream": "the stream (decode) is slow",
          "both": "both the wait and the stream are slow"}

#: without a TTFT budget, a wait before the first token longer than this (seconds) is slow
DEFAULT_WAIT_THRESHOLD_S = 1.0
#: roughly how fast people read (~5 words/s ≈ 7 tokens/s): a slower stream is felt as slow
READING_SPEED_TOKENS_PER_S = 7.0
#: the smallest change of decode speed a report states, %; a profile's larger decode noise raises it
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
    """Which phase of a request is slow, each judged against its own standard (None: not measured, never slow)."""

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
        return {"none": (), "wait": WAIT_CURES, "stream": STREAM_CURES, "both": WAIT_CURES + STREAM_CURES}[self.verdict]

    @property
    def notes(self) -> tuple[str, ...]:
        """What a reader must not conclude: that trimming cures a slow stream, or that anything needs curing."""
        both = "trimming and caching shorten the wait; the stream needs the decode cures"
        return {"none": (NOTHING_TO_CURE,), "wait": (), "stream": (NOT_THE_STREAM_CURE,), "both": (both,)}[self.verdict]

    def wait_text(self) -> str:
        if self.ttft_s is None:
            return "the wait: not measured (no first token)"
        limit = f"its {self.wait_limit_s:.3f} s budget" if self.wait_limit_source == "budget" else f"{self.wait_limit_s:g} s (no budget: the default)"
        return f"the wait {self.ttft_s:.3f} s is " + ("over " if self.wait_slow else "within ") + limit

    def stream_text(self) -> str:
        if self.decode_tokens_per_s is None:
            return "the stream: too short to time"
        floor = _fmt_tps(self.stream_floor_tokens_per_s)
        standard = f"your target of {floor} tokens/s" if self.stream_floor_source == "target" else f"reading speed ({floor} tokens/s)"
        out = f"the stream {_fmt_tps(self.decode_tokens_per_s)} tokens/s " + ("is below " if self.stream_slow else "keeps up with ") + standard
        if self.stream_floor_source == "target" and not self.stream_slow and self.decode_tokens_per_s < self.reading_speed_tokens_per_s:
            out += f" (below reading speed, {_fmt_tps(self.reading_speed_tokens_per_s)} tokens/s)"
        return out

    def summary(self) -> str:
        return f"{_HEADS[self.verdict]}: {self.wait_text()}; {self.stream_text()}"

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = attrs.asdict(self)
        d.update(label=self.label, cures=list(self.cures), notes=list(self.notes))
        return d


def valid_tokens_per_s_target(value: object) -> float | None:
    """None, or a finite number > 0 (else :class:`~trimkit.errors.InvalidNumberError`)."""
    return None if value is None else positive_finite(value, "tokens_per_s_target")


def judge(ttft_s: float | None, decode_tokens_per_s: float | None, *, ttft_budget_s: float | None = None, tokens_per_s_target: float | None = None,
          reading_speed_tokens_per_s: float = READING_SPEED_TOKENS_PER_S, wait_threshold_s: float = DEFAULT_WAIT_THRESHOLD_S) -> Verdict:
    """The :class:`Verdict`: the wait is slow over ``ttft_budget_s`` (else ``wait_threshold_s``), the stream below
    ``tokens_per_s_target`` (else ``reading_speed_tokens_per_s``); None: not measured."""
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
    return Verdict(name, ttft, tps, wait_slow, stream_slow, limit, limit_source, floor, floor_source, reading)


@attrs.frozen
class DecodeContext:
    """The decode speed measured, and predicted at the context sent and at the untrimmed one (None: unknown)."""

    measured_tokens_per_s: float | None
    predicted_tokens_per_s: float | None = None
    predicted_before_tokens_per_s: float | None = None
    noise_pct: float | None = None
    trimmed: bool = False

    @property
    def side_effect_pct(self) -> float | None:
        """How much faster a trimmed request streamed: the predicted gain capped by the measured one, if over the noise."""
        sent, before, measured = self.predicted_tokens_per_s, self.predicted_before_tokens_per_s, self.measured_tokens_per_s
        if not self.trimmed or not sent or not before or measured is None:
            return None
        pct = min(sent / before - 1.0, measured / before - 1.0) * 100.0
        return pct if pct > max(self.noise_pct or 0.0, MIN_STATED_DECODE_CHANGE_PCT) else None

    def statement(self) -> str:
        pct = self.side_effect_pct
        if pct is None:
            return "decode parameters untouched by trimkit"
        return (f"decode parameters untouched by trimkit; the stream was ~{pct:.0f} % faster because the context was shorter "
                f"(a side effect, not what trimkit aims at: predicted {_fmt_tps(self.predicted_tokens_per_s or 0.0)} tokens/s "
                f"at the context sent, {_fmt_tps(self.predicted_before_tokens_per_s or 0.0)} untrimmed; measured "
                f"{_fmt_tps(self.measured_tokens_per_s or 0.0)})")

    def predictions_text(self, prompt_tokens: int, prompt_tokens_before: int | None) -> str:
        if self.predicted_tokens_per_s is None:
            return ""
        out = f"predicted {_fmt_tps(self.predicted_tokens_per_s)} at the {prompt_tokens:,}-token context sent"
        if self.trimmed and self.predicted_before_tokens_per_s is not None and prompt_tokens_before is not None:
            out += f", {_fmt_tps(self.predicted_before_tokens_per_s)} at the untrimmed {prompt_tokens_before:,}"
        return out


@attrs.frozen
class Diagnosis(Verdict):
    """A :class:`Verdict` on one measured request, with its two phases; ``dominant_phase`` and ``stream_s`` are
    informational only."""

    prompt_tokens: int | None
    output_tokens: int
    stream_s: float
    dominant_phase: str
    prefill_ms_per_token: float | None

    @property
    def verdict_label(self) -> str:
        return self.label

    @property
    def dominant_label(self) -> str:
        return "the wait (prefill)" if self.dominant_phase == "prefill" else "the stream (decode)"

    def lines(self) -> list[str]:
        per_tok = f" ({self.prefill_ms_per_token:.2f} ms per prompt token)" if self.prefill_ms_per_token else ""
        out = [
            f"wait before first token (prefill): {self.ttft_s:.3f} s" + (f" for {self.prompt_tokens} prompt tokens" if self.prompt_tokens else "") + per_tok,
            f"stream (decode): {self.decode_tokens_per_s:.1f} tokens/s → {self.stream_s:.2f} s for {self.output_tokens} output tokens",
            f"verdict: {self.summary()}",
        ]
        if self.cures:
            out.append("what helps:")
            out.extend(f"  - {c}" for c in self.cures)
        out.extend(f"note: {n}" for n in self.notes)
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, object]:
        own = ("prompt_tokens", "output_tokens", "stream_s", "dominant_phase", "dominant_label", "prefill_ms_per_token")
        d = {k: v for k, v in super().to_dict().items() if k not in own}  # the verdict and the standards, then this request's own figures
        d.update(verdict_label=d.pop("label"), summary=self.summary())
        d.update((k, getattr(self, k)) for k in own)
        return d


def diagnose(ttft_s: float, decode_tokens_per_s: float, prompt_tokens: int | None = None, output_tokens: int = 256, *,
             ttft_budget_s: float | None = None, tokens_per_s_target: float | None = None,
             reading_speed_tokens_per_s: float = READING_SPEED_TOKENS_PER_S, wait_threshold_s: float = DEFAULT_WAIT_THRESHOLD_S) -> Diagnosis:
    """Judge a measured request as :func:`judge` does; ``prompt_tokens`` and ``output_tokens`` are only reported."""
    ttft_s = positive_finite(ttft_s, "ttft_s")
    tps = positive_finite(decode_tokens_per_s, "decode_tokens_per_s")
    if prompt_tokens is not None:
        count(prompt_tokens, "prompt_tokens", minimum=1)
    count(output_tokens, "output_tokens", minimum=1)
    verdict = judge(ttft_s, tps, ttft_budget_s=ttft_budget_s, tokens_per_s_target=tokens_per_s_target,
                    reading_speed_tokens_per_s=reading_speed_tokens_per_s, wait_threshold_s=wait_threshold_s)
    stream_s = output_tokens / tps
    return Diagnosis(**attrs.asdict(verdict, recurse=False), prompt_tokens=prompt_tokens, output_tokens=output_tokens, stream_s=stream_s,
                     dominant_phase="prefill" if ttft_s >= stream_s else "decode", prefill_ms_per_token=(ttft_s / prompt_tokens * 1000) if prompt_tokens else None)


def _fmt_s(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f} s"


def _fmt_n(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def template_warnings(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any) -> list[str]:
    """Say so when the chat template drops a message, where the backend's tokenizer can tell."""
    dropped_messages = getattr(tokenizer, "dropped_messages", None)
    try:
        dropped = dropped_messages(messages, tools) if dropped_messages is not None else None
    except Exception:  # a check for the report must never fail the request
        return []
    if not dropped:
        return []
    roles = ", ".join(f"{i} ({messages[i].get('role')})" for i in dropped)
    return [f"the chat template dropped message(s) {roles}: the model never sees them"]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "to_dict"):
        return _json_safe(value.to_dict())
    if attrs.has(type(value)):
        return _json_safe(attrs.asdict(value))
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


#: what :meth:`Report.to_dict` adds to the report's fields
_COMPUTED_KEYS = ("budget_met", "measured_ttft_s", "engine_ttft_s", "ttft_error_pct", "queue_wait_s", "cached_tokens", "evaluated_tokens",
                  "decode_tokens_per_s", "time_per_output_token_s", "completion_tokens", "decode_side_effect_pct", "decode_statement",
                  "decode_untouched", "verdict", "judgement", "dominant_phase", "advice")


@attrs.frozen
class Report:
    """One request, end to end. ``predicted_ttft_s`` is for the prompt sent, ``predicted_ttft_before_s`` for the prompt as
    given; both include ``queue_wait_predicted_s`` (the wait for the ``queue_ahead`` requests ahead) and compare with
    ``measured_ttft_s``. ``provisional`` / ``extrapolated``: the profile was a micro-calibration / the prompt lies beyond
    what it measured (a wider margin). ``decode_predicted_*``: the profile's decode speed at the context sent / untrimmed."""

    backend: str
    measurement: Measurement
    prompt_tokens: int
    predicted_ttft_s: float | None
    ttft_budget_s: float | None = None
    predicted_ttft_before_s: float | None = None
    prompt_tokens_before: int | None = None
    cached_tokens_predicted: int = 0
    actions: tuple[Any, ...] = ()
    feasible: bool | None = None
    passthrough: bool = True
    planning_s: float | None = None
    profile_error_pct: float | None = None
    warnings: tuple[str, ...] = ()
    decode_params: Mapping[str, Any] = attrs.field(factory=dict)
    model: str = ""
    safety_margin: float | None = None
    provisional: bool = False
    extrapolated: bool = False
    queue_wait_predicted_s: float | None = None
    queue_ahead: int = 0
    endpoint: str | None = None
    tokens_per_s_target: float | None = None
    decode_predicted_tokens_per_s: float | None = None
    decode_predicted_before_tokens_per_s: float | None = None
    decode_noise_pct: float | None = None
    watched: bool = False
    replans: tuple[Any, ...] = ()

    @classmethod
    def of_request(cls, prepared: Prepared, m: Measurement, params: Mapping[str, Any], *, backend: str, model: str,
                   profile: Profile, notes: Sequence[str] = (), sent: bool = True, endpoint: str | None = None,
                   tokens_per_s_target: float | None = None) -> Report:
        """The report of a prepared request planned with ``profile``; ``notes``: the front-end's warnings."""
        plan = prepared.plan
        warnings = list(prepared.warnings)
        if plan is not None and not plan.feasible:
            warnings.append("budget infeasible: sent the minimal prompt (system + last user message)")
        if not sent:
            warnings.append("not sent")
        warnings.extend(notes)
        n, cached = len(prepared.prompt_tokens), prepared.cached_tokens
        answer = m.completion_tokens or 0
        before = prepared.prompt_tokens_before
        return cls(
            backend=backend, measurement=m, prompt_tokens=n, predicted_ttft_s=prepared.predicted_ttft_s, ttft_budget_s=prepared.budget_s,
            predicted_ttft_before_s=prepared.predicted_ttft_before_s, prompt_tokens_before=before, cached_tokens_predicted=cached,
            actions=tuple(plan.actions) if plan is not None else (), feasible=prepared.feasible,
            passthrough=plan.passthrough if plan is not None else True, planning_s=getattr(plan, "planning_s", None),
            profile_error_pct=profile.error.median_pct, warnings=tuple(warnings), decode_params={k: v for k, v in params.items() if k != "messages"},
            model=model, safety_margin=getattr(plan, "safety_margin", None) if prepared.budget_s is not None else None,
            provisional=profile.provisional, extrapolated=profile.extrapolated(evaluated_tokens(n, cached), cached),
            queue_wait_predicted_s=getattr(prepared, "queue_wait_s", None), queue_ahead=getattr(prepared, "queue_ahead", 0), endpoint=endpoint,
            tokens_per_s_target=tokens_per_s_target, decode_predicted_tokens_per_s=profile.decode_tokens_per_s_at(n, answer),
            decode_predicted_before_tokens_per_s=None if before is None else profile.decode_tokens_per_s_at(before, answer),
            decode_noise_pct=profile.decode_noise_pct, watched=bool(getattr(prepared, "watched", False)), replans=tuple(getattr(prepared, "replans", ())),
        )

    @property
    def engine_ttft_s(self) -> float | None:
        """The TTFT from the start of the stream (its first output, when no content came)."""
        m = self.measurement
        return m.ttft_s if m.ttft_s is not None else m.first_output_s

    @property
    def measured_ttft_s(self) -> float | None:
        """The TTFT the caller felt: the wait for the engine plus :attr:`engine_ttft_s`."""
        engine = self.engine_ttft_s
        return None if engine is None else engine + self.queue_wait_s

    @property
    def queue_wait_s(self) -> float:
        return self.measurement.queue_s or 0.0

    @property
    def ttft_error_pct(self) -> float | None:
        measured = self.measured_ttft_s
        if measured is None or self.predicted_ttft_s is None or measured <= 0:
            return None
        return (self.predicted_ttft_s - measured) / measured * 100.0

    @property
    def budget_met(self) -> bool | None:
        if self.ttft_budget_s is None or self.measured_ttft_s is None:
            return None
        return self.measured_ttft_s <= self.ttft_budget_s

    def __getattr__(self, name: str) -> Any:
        """``cached_tokens``, ``evaluated_tokens``, ``completion_tokens``, ``decode_tokens_per_s``, ``time_per_output_token_s``:
        the measurement's."""
        if name in ("cached_tokens", "evaluated_tokens", "completion_tokens", "decode_tokens_per_s", "time_per_output_token_s"):
            return getattr(self.measurement, name)
        raise AttributeError(name)

    @property
    def stream_s(self) -> float | None:
        m = self.measurement
        return m.engine_decode_s if m.engine_decode_s is not None else m.client_decode_s

    @property
    def dominant_phase(self) -> str | None:
        """"prefill" when the wait from the start of the stream is at least the stream after it."""
        ttft, stream = self.engine_ttft_s, self.stream_s
        if ttft is None:
            return None
        return "prefill" if stream is None or ttft >= stream else "decode"

    @property
    def judgement(self) -> Verdict | None:
        """:func:`judge` on the TTFT the caller felt and the stream (None: no first token)."""
        if self.measured_ttft_s is None:
            return None
        return judge(self.measured_ttft_s, self.decode_tokens_per_s, ttft_budget_s=self.ttft_budget_s, tokens_per_s_target=self.tokens_per_s_target)

    @property
    def verdict(self) -> VerdictName | None:
        j = self.judgement
        return None if j is None else j.verdict

    @property
    def advice(self) -> tuple[str, ...]:
        j = self.judgement
        return () if j is None else j.cures

    @property
    def decode(self) -> DecodeContext:
        return DecodeContext(self.decode_tokens_per_s, self.decode_predicted_tokens_per_s, self.decode_predicted_before_tokens_per_s,
                             self.decode_noise_pct, self.trimmed and (self.prompt_tokens_before or 0) > self.prompt_tokens)

    @property
    def trimmed(self) -> bool:
        return not self.passthrough

    @property
    def decode_untouched(self) -> str:
        return DECODE_PARAMETERS_UNTOUCHED

    def lines(self) -> list[str]:
        """The report as lines a person reads."""
        m = self.measurement
        out = [f"trimkit report — {self.backend}" + (f" ({self.model})" if self.model else "") + (f" @ {self.endpoint}" if self.endpoint else "")]
        if self.ttft_budget_s is not None:
            met = "n/a" if self.budget_met is None else ("met" if self.budget_met else "MISSED")
            margin = feas = ""
            if self.safety_margin is not None and math.isfinite(self.safety_margin):
                margin = f" · safety margin {self.safety_margin * 100:.1f} % (planned to {self.ttft_budget_s * (1 - self.safety_margin):.3f} s)"
            if self.feasible is False:
                wait = self.queue_wait_predicted_s or 0.0
                if wait and self.predicted_ttft_s is not None and self.predicted_ttft_s - wait <= self.ttft_budget_s:
                    feas = f" — predicted over budget because of the {wait:.3f} s wait for the requests ahead"
                else:
                    feas = " — infeasible: even the minimal prompt cannot fit; sent the best achievable"
            out.append(f"  budget     {self.ttft_budget_s:.3f} s → {met}{margin}{feas}")
        if self.provisional or self.extrapolated:
            notes = ["provisional (a micro-calibration, improving from each request)"] if self.provisional else []
            notes += ["prompt beyond the lengths it has measured (extrapolated)"] if self.extrapolated else []
            wider = " — wider safety margin" if self.ttft_budget_s is not None and self.extrapolated else ""
            out.append(f"  profile    {' · '.join(notes)}{wider}")
        pred = _fmt_s(self.predicted_ttft_s)
        if self.predicted_ttft_before_s is not None and self.trimmed:
            pred += f" (before trimming {_fmt_s(self.predicted_ttft_before_s)})"
        err = self.ttft_error_pct
        label = "measured" if m.ttft_s is not None or m.first_output_s is None else "measured (first chunk, no content)"
        out.append(f"  TTFT       predicted {pred} · {label} {_fmt_s(self.measured_ttft_s)}" + (f" · error {err:+.1f} %" if err is not None else ""))
        if self.queue_wait_predicted_s or self.queue_wait_s >= 0.001:
            ahead = f", {self.queue_ahead} request(s) ahead" if self.queue_ahead else ""
            out.append(f"  queue      waited {self.queue_wait_s:.3f} s for the engine (predicted {_fmt_s(self.queue_wait_predicted_s)}{ahead}) · "
                       f"in the TTFT above; from the start of the stream {_fmt_s(self.engine_ttft_s)}")
        if m.engine_prefill_s is not None:
            overhead = m.server.get("network_overhead_s")
            out.append(f"  prefill    {_fmt_s(m.engine_prefill_s)} engine-measured ({m.timing_source})"
                       + (f" · network/queue {_fmt_s(overhead)} (client TTFT − server prefill)" if overhead is not None else ""))
        before = f" (before trimming {_fmt_n(self.prompt_tokens_before)})" if self.prompt_tokens_before not in (None, self.prompt_tokens) else ""
        out.append(f"  prompt     {_fmt_n(self.prompt_tokens)} tokens{before} · reused from cache {_fmt_n(m.cached_tokens)} "
                   f"(predicted {_fmt_n(self.cached_tokens_predicted)}) · evaluated {_fmt_n(m.evaluated_tokens)}")
        if self.watched:
            out.extend([f"  re-plan    {x.summary()}" for x in self.replans] or ["  watched    prefill watched while it ran: on pace, no re-plan"])
        if self.actions:
            out.append("  trimming")
            out.extend(f"    - {getattr(a, 'strategy', '?')}: {getattr(a, 'summary', a)}" for a in self.actions)
        elif self.ttft_budget_s is not None and self.feasible is False:
            out.append("  trimming   none possible: nothing the strategies may remove (system messages and the last user turn stay)")
        elif self.ttft_budget_s is not None:
            out.append("  trimming   none (under budget: request passed through unchanged)")
        tps, tpot, decode = self.decode_tokens_per_s, self.time_per_output_token_s, self.decode
        if tps is not None and tpot is not None:
            line = f"  decode     {tps:.1f} tokens/s measured ({tpot * 1000:.1f} ms per output token), {_fmt_n(self.completion_tokens)} tokens"
        else:
            line = f"  decode     {_fmt_n(self.completion_tokens)} output tokens (too few to time)"
        predicted = decode.predictions_text(self.prompt_tokens, self.prompt_tokens_before)
        out += [line + (f" · {predicted}" if predicted else ""), f"             {decode.statement()}"]
        j = self.judgement
        if j is not None:
            out.append(f"  verdict    {j.summary()}")
            out.extend(f"    cure     {c}" for c in j.cures)
            out.extend(f"    note     {n}" for n in j.notes)
        if m.truncated_tokens:
            out.append(f"  WARNING    the engine evaluated {m.truncated_tokens:,} fewer prompt tokens than were sent: it truncated the prompt")
        out.extend(f"  warning    {w}" for w in self.warnings)
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def log_line(self) -> str:
        """The report as one line of key=value pairs for ``logging`` (INFO)."""
        parts = [f"backend={self.backend}"] + ([f"endpoint={self.endpoint}"] if self.endpoint else [])
        if self.ttft_budget_s is not None:
            parts.append(f"budget={self.ttft_budget_s:.3f}s met={self.budget_met}")
        parts.append(f"ttft_pred={_fmt_s(self.predicted_ttft_s)} ttft_meas={_fmt_s(self.measured_ttft_s)}")
        if self.queue_wait_predicted_s or self.queue_wait_s >= 0.001:
            parts.append(f"queue_pred={_fmt_s(self.queue_wait_predicted_s)} queue_meas={_fmt_s(self.queue_wait_s)} ahead={self.queue_ahead}")
        parts.append(f"prompt={self.prompt_tokens} before={self.prompt_tokens_before} cached={self.cached_tokens} evaluated={self.evaluated_tokens}")
        parts.append(f"actions={len(self.actions)}")
        if self.watched:
            parts.append(f"watched=True replans={len(self.replans)}")
            parts += [f"replan=after:{x.evaluated_tokens}/{x.prompt_tokens},pace:{x.pace:.2f}x,"
                      f"pred:{x.predicted_ttft_before_s:.3f}->{x.predicted_ttft_after_s:.3f}s,dropped:{'|'.join(x.dropped) or '-'}" for x in self.replans]
        if self.provisional or self.extrapolated:
            parts.append("profile=" + ",".join(n for n, on in (("provisional", self.provisional), ("extrapolated", self.extrapolated)) if on))
        parts.append(f"verdict={self.verdict or 'n/a'}")
        decode = self.decode
        tps, pred, before = decode.measured_tokens_per_s, decode.predicted_tokens_per_s, decode.predicted_before_tokens_per_s
        parts.append(f"decode={tps:.1f}tok/s" if tps else "decode=n/a")
        if pred is not None:
            parts.append(f"decode_pred={pred:.1f}tok/s" + (f" decode_pred_untrimmed={before:.1f}tok/s" if decode.trimmed and before else ""))
        if decode.side_effect_pct is not None:
            parts.append(f"decode_side_effect=+{decode.side_effect_pct:.0f}%(shorter context)")
        parts.append("decode_params=untouched")
        return "trimkit: " + " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        decode = self.decode
        computed = {"decode_side_effect_pct": decode.side_effect_pct, "decode_statement": decode.statement()}
        keys = (*(f.name for f in attrs.fields(Report) if f.name != "measurement"), *_COMPUTED_KEYS, "measurement")  # the long one last
        return _json_safe({k: computed[k] if k in computed else getattr(self, k) for k in keys})

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)


# -- where each report goes: the report log and the observers (OpenTelemetry, Prometheus) ----------------

log = logging.getLogger("trimkit")

#: the TTFT histogram's bucket boundaries, seconds (Prometheus and OpenTelemetry alike)
TTFT_BUCKETS_S: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
#: measured TTFT ÷ budget (1.0: the whole budget used)
BUDGET_USE_BUCKETS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
#: |predicted − measured| ÷ measured TTFT (its direction, "over" or "under", is a label)
PREDICTION_ERROR_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
#: decode speed, tokens/s
DECODE_SPEED_BUCKETS: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


@attrs.frozen
class Completed:
    """One request's end, as an observer receives it; ``ended_ns``: ``time.time_ns()`` when it ended."""

    report: Report
    error_type: str | None = None
    prepare_s: float = 0.0
    ended_ns: int = attrs.field(factory=time.time_ns)


@attrs.frozen
class Figures:
    """What every exporter records of one request beyond its report's own numbers (None: not known)."""

    outcome: str  # "passthrough", "trimmed", "infeasible", "refused" or "error"
    model: str  # the model asked for (the report's ``model`` without its `` @ url``)
    server_address: str | None  # the server's host, from that url (None in process)
    server_port: int | None
    budget_use: float | None
    prediction_error: float | None  # |predicted − measured| ÷ measured
    prediction_direction: str  # "over" (predicted above measured), "under" or "exact"; "" when unknown
    tokens_before: int  # the prompt's tokens before trimming (as sent when not trimmed)
    tokens_removed: int
    removed_messages: tuple[int, ...]
    summarized_messages: tuple[int, ...]
    removed_chunks: tuple[str, ...]


def figures(c: Completed) -> Figures:
    """What the exporters record of a finished request (counts and ids, never text)."""
    r = c.report
    chunks = [str(x) for a in r.actions for x in getattr(a, "removed_chunks", ())]
    chunks += [str(x) for p in r.replans for x in p.dropped if not str(x).startswith(("+", "message "))]
    if c.error_type is not None:
        outcome = "refused" if "not sent" in r.warnings else "error"
    elif r.feasible is False:
        outcome = "infeasible"
    else:
        outcome = "passthrough" if r.passthrough else "trimmed"
    ttft, budget, before = r.measured_ttft_s, r.ttft_budget_s, r.prompt_tokens_before
    model, _, url = (r.model or "").partition(" @ ")
    where = urlsplit(url) if url else None
    try:
        port = where.port if where is not None else None
    except ValueError:
        port = None
    err = r.ttft_error_pct
    return Figures(
        outcome=outcome, model=model, server_address=where.hostname if where is not None else None,
        server_port=port or ({"http": 80, "https": 443}.get(where.scheme) if where is not None and where.hostname else None),
        budget_use=None if ttft is None or not budget else ttft / budget, prediction_error=None if err is None else abs(err) / 100.0,
        prediction_direction="" if err is None else "over" if err > 0 else "under" if err < 0 else "exact",
        tokens_before=r.prompt_tokens if before is None else before, tokens_removed=max((before or 0) - r.prompt_tokens, 0),
        removed_messages=tuple(sorted({i for a in r.actions for i in getattr(a, "removed_messages", ())})),
        summarized_messages=tuple(sorted({i for a in r.actions for i in getattr(a, "summarized_messages", ())})),
        removed_chunks=tuple(dict.fromkeys(chunks)),
    )


Observer = Callable[[Completed], None]
_observers: list[Observer] = []
_lock = threading.Lock()


def add_observer(observer: Observer) -> None:
    """Call ``observer(completed)`` at the end of every request, in every wrapper of this process."""
    with _lock:
        if observer not in _observers:
            _observers.append(observer)


def remove_observer(observer: Observer) -> None:
    with _lock:
        if observer in _observers:
            _observers.remove(observer)


def completed(report: Report, *, error_type: str | None = None, prepare_s: float = 0.0, sinks: tuple[Observer, ...] = ()) -> None:
    """A request's report is complete: tell the wrapper's ``sinks`` and every installed observer."""
    everyone = (*sinks, *_observers)
    if not everyone:
        return
    c = Completed(report, error_type, prepare_s)
    for observer in everyone:
        try:
            observer(c)
        except Exception as exc:  # an exporter must never fail the request (its message may quote data)
            log.warning("trimkit: an observer failed (%s); the request is unaffected", type(exc).__name__)


class ReportLog:
    """One JSON line per finished request (its ``to_dict()``, less decode parameters that may carry text), appended to
    a path or written to a file-like object; safe to share between threads and wrappers."""

    #: one lock for every report log: a line is written whole, whichever wrappers share a file
    _lock = threading.Lock()

    def __init__(self, target: str | os.PathLike[str] | IO[str]) -> None:
        self.path: str | None = None
        self.stream: IO[str] | None = None
        if isinstance(target, (str, os.PathLike)):
            self.path = os.fspath(target)
        elif callable(getattr(target, "write", None)):
            self.stream = target
        else:
            raise InvalidInputError(f"report_log must be a path or a file-like object with .write, got {type(target).__name__}")

    def __call__(self, c: Completed) -> None:
        d = c.report.to_dict()
        params = d.get("decode_params") or {}
        d["decode_params"] = {k: v for k, v in params.items() if v is None or isinstance(v, (bool, int, float))}
        left_out = sorted(k for k in params if k not in d["decode_params"])
        if left_out:
            d["decode_params_not_logged"] = left_out
        d["error_type"] = c.error_type
        d["ended_at"] = c.ended_ns / 1e9
        line = json.dumps(d) + "\n"
        with self._lock:
            if self.stream is not None:
                self.stream.write(line)
                flush = getattr(self.stream, "flush", None)
                if flush is not None:
                    flush()
            else:
                with open(self.path, "a", encoding="utf-8") as f:  # type: ignore[arg-type]
                    f.write(line)


def report_log(target: Any) -> tuple[Observer, ...]:
    """The sinks of ``wrap(..., report_log=target)``, checked now, before any request."""
    if target is None:
        return ()
    return (target if isinstance(target, ReportLog) else ReportLog(target),)
