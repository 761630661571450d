"""The per-request report: what trimkit predicted, what it measured, what it changed, which phase
was slow (:attr:`Report.verdict`, :mod:`trimkit.verdict`) and what decode did. ``str(report)`` is
for people; ``report.to_dict()`` for programs; ``report.log_line()`` for logs.

**Decode.** trimkit leaves the decode *parameters* untouched and never aims at the stream. The
report shows the decode speed measured, the speed the profile predicts at the context sent and,
for a trimmed request, at the untrimmed context; a difference beyond the profile's decode noise
that the measurement bears out is stated as a side effect of a shorter KV cache, never as a
trimming gain (:class:`~trimkit.verdict.DecodeContext`).

**Predicted and measured TTFT are both the TTFT the caller felt.** ``predicted_ttft_s`` includes
the wait predicted for the requests ahead on the engine (``queue_wait_predicted_s``), and
``measured_ttft_s`` includes the wait measured (``measurement.queue_s``, in process: the time the
request waited for the engine); ``budget_met`` and ``ttft_error_pct`` compare the two. The
engine's own TTFT, from the start of the stream, stays ``measurement.ttft_s``
(``engine_ttft_s``). Over HTTP the server's queue is inside ``measurement.ttft_s`` and
``queue_s`` is 0. Only a snapshot's restore time is in the prediction and not in the measurement
(it runs before the stream starts; milliseconds)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from trimkit.backends.base import Measurement
from trimkit.planning.costs import evaluated_tokens
from trimkit.verdict import (
    DECODE_PARAMETERS_UNTOUCHED,
    DecodeContext,
    Verdict,
    VerdictName,
    judge,
)


def _fmt_s(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f} s"


def _fmt_n(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def report_lines(r: Any) -> list[str]:
    """A report (:class:`~trimkit.report.Report`) as lines a person reads."""
    m = r.measurement
    out = [f"trimkit report — {r.backend}" + (f" ({r.model})" if r.model else "") + (f" @ {r.endpoint}" if r.endpoint else "")]
    if r.ttft_budget_s is not None:
        met = r.budget_met
        met_text = "n/a" if met is None else ("met" if met else "MISSED")
        feas = "" if r.feasible in (None, True) else " — " + _infeasible_note(r)
        margin = ""
        if r.safety_margin is not None and math.isfinite(r.safety_margin):
            margin = f" · safety margin {r.safety_margin * 100:.1f} % (planned to {r.ttft_budget_s * (1 - r.safety_margin):.3f} s)"
        out.append(f"  budget     {r.ttft_budget_s:.3f} s → {met_text}{margin}{feas}")
    if r.provisional or r.extrapolated:
        out.append(f"  profile    {_profile_note(r)}")
    pred = _fmt_s(r.predicted_ttft_s)
    if r.predicted_ttft_before_s is not None and r.trimmed:
        pred += f" (before trimming {_fmt_s(r.predicted_ttft_before_s)})"
    err = r.ttft_error_pct
    err_s = f" · error {err:+.1f} %" if err is not None else ""
    label = "measured" if m.ttft_s is not None or m.first_output_s is None else "measured (first chunk, no content)"
    out.append(f"  TTFT       predicted {pred} · {label} {_fmt_s(r.measured_ttft_s)}{err_s}")
    queue = _queue_line(r)
    if queue:
        out.append(queue)
    if m.engine_prefill_s is not None:
        prefill = f"  prefill    {_fmt_s(m.engine_prefill_s)} engine-measured ({m.timing_source})"
        overhead = m.server.get("network_overhead_s")
        if overhead is not None:
            prefill += f" · network/queue {_fmt_s(overhead)} (client TTFT − server prefill)"
        out.append(prefill)
    tok = f"  prompt     {_fmt_n(r.prompt_tokens)} tokens"
    if r.prompt_tokens_before is not None and r.prompt_tokens_before != r.prompt_tokens:
        tok += f" (before trimming {_fmt_n(r.prompt_tokens_before)})"
    tok += f" · reused from cache {_fmt_n(m.cached_tokens)} (predicted {_fmt_n(r.cached_tokens_predicted)}) · evaluated {_fmt_n(m.evaluated_tokens)}"
    out.append(tok)
    if r.watched:
        if r.replans:
            out.extend(f"  re-plan    {x.summary()}" for x in r.replans)
        else:
            out.append("  watched    prefill watched while it ran: on pace, no re-plan")
    if r.actions:
        out.append("  trimming")
        for a in r.actions:
            out.append(f"    - {getattr(a, 'strategy', '?')}: {getattr(a, 'summary', a)}")
    elif r.ttft_budget_s is not None and r.feasible is False:
        out.append("  trimming   none possible: nothing the strategies may remove (system messages and the last user turn stay)")
    elif r.ttft_budget_s is not None:
        out.append("  trimming   none (under budget: request passed through unchanged)")
    out.extend(_phase_lines(r))
    if m.truncated_tokens:
        out.append(f"  WARNING    the engine evaluated {m.truncated_tokens:,} fewer prompt tokens than were sent: it truncated the prompt")
    for w in r.warnings:
        out.append(f"  warning    {w}")
    return out


def _phase_lines(r: Any) -> list[str]:
    """Decode measured vs predicted, what trimkit did to it, and the verdict with its cures."""
    tps, tpot, decode = r.decode_tokens_per_s, r.time_per_output_token_s, r.decode
    if tps is not None and tpot is not None:
        line = f"  decode     {tps:.1f} tokens/s measured ({tpot * 1000:.1f} ms per output token), {_fmt_n(r.completion_tokens)} tokens"
    else:
        line = f"  decode     {_fmt_n(r.completion_tokens)} output tokens (too few to time)"
    predicted = decode.predictions_text(r.prompt_tokens, r.prompt_tokens_before)
    out = [line + (f" · {predicted}" if predicted else ""), f"             {decode.statement()}"]
    j = r.judgement
    if j is not None:
        out.append(f"  verdict    {j.summary()}")
        out.extend(f"    cure     {c}" for c in j.cures)
        out.extend(f"    note     {n}" for n in j.notes)
    return out


def _infeasible_note(r: Any) -> str:
    wait = r.queue_wait_predicted_s or 0.0
    if wait and r.predicted_ttft_s is not None and r.ttft_budget_s is not None and r.predicted_ttft_s - wait <= r.ttft_budget_s:
        return f"predicted over budget because of the {wait:.3f} s wait for the requests ahead"
    return "infeasible: even the minimal prompt cannot fit; sent the best achievable"


def _queue_line(r: Any) -> str:
    """The wait for the engine, predicted and measured (empty when there was none)."""
    pred, meas = r.queue_wait_predicted_s, r.queue_wait_s
    if not pred and meas < 0.001:
        return ""
    ahead = f", {r.queue_ahead} request(s) ahead" if r.queue_ahead else ""
    return (f"  queue      waited {meas:.3f} s for the engine (predicted {_fmt_s(pred)}{ahead}) · in the TTFT above; "
            f"from the start of the stream {_fmt_s(r.engine_ttft_s)}")


def _profile_note(r: Any) -> str:
    notes = []
    if r.provisional:
        notes.append("provisional (a micro-calibration, improving from each request)")
    if r.extrapolated:
        notes.append("prompt beyond the lengths it has measured (extrapolated)")
    wider = " — wider safety margin" if r.ttft_budget_s is not None and r.extrapolated else ""
    return " · ".join(notes) + wider


def report_log_line(r: Any) -> str:
    """A report as one line for ``logging`` (INFO): key=value pairs."""
    parts = [f"backend={r.backend}"] + ([f"endpoint={r.endpoint}"] if r.endpoint else [])
    if r.ttft_budget_s is not None:
        parts.append(f"budget={r.ttft_budget_s:.3f}s met={r.budget_met}")
    parts.append(f"ttft_pred={_fmt_s(r.predicted_ttft_s)} ttft_meas={_fmt_s(r.measured_ttft_s)}")
    if r.queue_wait_predicted_s or r.queue_wait_s >= 0.001:
        parts.append(f"queue_pred={_fmt_s(r.queue_wait_predicted_s)} queue_meas={_fmt_s(r.queue_wait_s)} ahead={r.queue_ahead}")
    parts.append(f"prompt={r.prompt_tokens} before={r.prompt_tokens_before} cached={r.cached_tokens} evaluated={r.evaluated_tokens}")
    parts.append(f"actions={len(r.actions)}")
    if r.watched:
        parts.append(f"watched=True replans={len(r.replans)}")
        for x in r.replans:
            parts.append(f"replan=after:{x.evaluated_tokens}/{x.prompt_tokens},pace:{x.pace:.2f}x,"
                         f"pred:{x.predicted_ttft_before_s:.3f}->{x.predicted_ttft_after_s:.3f}s,dropped:{'|'.join(x.dropped) or '-'}")
    if r.provisional or r.extrapolated:
        parts.append("profile=" + ",".join(n for n, on in (("provisional", r.provisional), ("extrapolated", r.extrapolated)) if on))
    parts.append(f"verdict={r.verdict or 'n/a'}")
    decode = r.decode
    tps, pred, before = decode.measured_tokens_per_s, decode.predicted_tokens_per_s, decode.predicted_before_tokens_per_s
    parts.append(f"decode={tps:.1f}tok/s" if tps else "decode=n/a")
    if pred is not None:
        parts.append(f"decode_pred={pred:.1f}tok/s" + (f" decode_pred_untrimmed={before:.1f}tok/s" if decode.trimmed and before else ""))
    side = decode.side_effect_pct
    if side is not None:
        parts.append(f"decode_side_effect=+{side:.0f}%(shorter context)")
    parts.append("decode_params=untouched")
    return "trimkit: " + " ".join(parts)


if TYPE_CHECKING:  # for annotations only: prepared sits above this module
    from trimkit.prepared import Prepared
    from trimkit.profile import Profile

__all__ = ["Report", "DECODE_PARAMETERS_UNTOUCHED", "template_warnings"]

def template_warnings(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Any) -> list[str]:
    """Say so when the chat template drops a message (the model never sees it); ``tokenizer``:
    the backend's, if it can tell (``dropped_messages``)."""
    dropped_messages = getattr(tokenizer, "dropped_messages", None)
    if dropped_messages is None:
        return []
    try:
        dropped = dropped_messages(messages, tools)
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


@attrs.frozen
class Report:
    """One request, end to end.

    ``predicted_ttft_s`` is the prediction for the prompt actually sent;
    ``predicted_ttft_before_s`` the prediction for the prompt as the caller gave it; both include
    ``queue_wait_predicted_s``, the wait predicted for the ``queue_ahead`` requests ahead on the
    engine (None: nobody predicted one — a server, unless its caller did), and are compared
    with ``measured_ttft_s``, which includes the measured wait (see the module docstring).
    ``cached_tokens`` / ``evaluated_tokens`` are the engine's word when it gives one.
    ``safety_margin`` is the fraction of the budget the plan held back (None without a budget).
    ``endpoint`` names the replica that served the request (None for one engine).
    ``provisional``: the profile was still provisional (a ~3 s micro-calibration, improving
    from requests); ``extrapolated``: the prompt sent lies beyond the lengths the
    profile has measured. Either makes the prediction less certain and the margin wider.
    ``tokens_per_s_target``: the stream's standard for the :attr:`verdict` (None: reading speed).
    ``decode_predicted_tokens_per_s`` / ``decode_predicted_before_tokens_per_s``: the decode
    speed the profile predicts at the context sent / at the untrimmed one (same answer length;
    None: unknown); ``decode_noise_pct``: the profile's decode noise, % (None: unknown), which
    with :data:`~trimkit.verdict.MIN_STATED_DECODE_CHANGE_PCT` sets the smallest difference stated.
    """

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
    #: whether the prefill was watched while it ran (in process), and the re-plans it made
    #: (:class:`~trimkit.planning.watch.Replan`: after how many tokens, the pace, what changed)
    watched: bool = False
    replans: tuple[Any, ...] = ()

    @classmethod
    def of_request(cls, prepared: Prepared, m: Measurement, params: Mapping[str, Any], *, backend: str, model: str,
                   profile: Profile, notes: Sequence[str] = (), sent: bool = True, endpoint: str | None = None,
                   tokens_per_s_target: float | None = None) -> Report:
        """The report of a prepared request with what was measured of it: ``profile`` is the one
        it was planned with, ``notes`` are the front-end's warnings, ``sent=False`` for a request
        that never went out, ``endpoint`` the replica it went to, ``tokens_per_s_target`` the
        stream's standard. The decode predictions are the profile's
        (:meth:`~trimkit.profile.Profile.decode_tokens_per_s_at`, over the measured answer's length)."""
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
            backend=backend,
            measurement=m,
            prompt_tokens=n,
            predicted_ttft_s=prepared.predicted_ttft_s,
            ttft_budget_s=prepared.budget_s,
            predicted_ttft_before_s=prepared.predicted_ttft_before_s,
            prompt_tokens_before=prepared.prompt_tokens_before,
            cached_tokens_predicted=cached,
            actions=tuple(plan.actions) if plan is not None else (),
            feasible=prepared.feasible,
            passthrough=plan.passthrough if plan is not None else True,
            planning_s=getattr(plan, "planning_s", None) if plan is not None else None,
            profile_error_pct=profile.error.median_pct,
            warnings=tuple(warnings),
            decode_params={k: v for k, v in params.items() if k not in ("messages",)},
            model=model,
            # the margin the plan held back (the plan records what it was given)
            safety_margin=getattr(plan, "safety_margin", None) if plan is not None and prepared.budget_s is not None else None,
            provisional=profile.provisional,
            extrapolated=profile.extrapolated(evaluated_tokens(n, cached), cached),
            queue_wait_predicted_s=getattr(prepared, "queue_wait_s", None),
            queue_ahead=getattr(prepared, "queue_ahead", 0),
            endpoint=endpoint,
            tokens_per_s_target=tokens_per_s_target,
            decode_predicted_tokens_per_s=profile.decode_tokens_per_s_at(n, answer),
            decode_predicted_before_tokens_per_s=None if before is None else profile.decode_tokens_per_s_at(before, answer),
            decode_noise_pct=profile.decode_noise_pct,
            watched=bool(getattr(prepared, "watched", False)),
            replans=tuple(getattr(prepared, "replans", ())),
        )

    # -- derived figures ------------------------------------------------------------------------
    @property
    def engine_ttft_s(self) -> float | None:
        """The TTFT from the start of the stream: ``measurement.ttft_s`` (its first output, when
        no content came)."""
        m = self.measurement
        return m.ttft_s if m.ttft_s is not None else m.first_output_s

    @property
    def measured_ttft_s(self) -> float | None:
        """The TTFT the caller felt: the measured wait for the engine (``measurement.queue_s``)
        plus :attr:`engine_ttft_s` — what ``predicted_ttft_s`` predicts."""
        engine = self.engine_ttft_s
        return None if engine is None else engine + (self.measurement.queue_s or 0.0)

    @property
    def queue_wait_s(self) -> float:
        """The measured wait for the engine (``measurement.queue_s``; 0 over HTTP, where a
        server's queue is inside the TTFT)."""
        return self.measurement.queue_s or 0.0

    @property
    def ttft_error_pct(self) -> float | None:
        """(predicted − measured) / measured, in percent: both as the caller felt them (wait included)."""
        measured = self.measured_ttft_s
        if measured is None or self.predicted_ttft_s is None or measured <= 0:
            return None
        return (self.predicted_ttft_s - measured) / measured * 100.0

    @property
    def budget_met(self) -> bool | None:
        """The TTFT the caller felt (:attr:`measured_ttft_s`, the wait included) is within the budget."""
        if self.ttft_budget_s is None or self.measured_ttft_s is None:
            return None
        return self.measured_ttft_s <= self.ttft_budget_s

    @property
    def cached_tokens(self) -> int | None:
        return self.measurement.cached_tokens

    @property
    def evaluated_tokens(self) -> int | None:
        return self.measurement.evaluated_tokens

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.measurement.decode_tokens_per_s

    @property
    def time_per_output_token_s(self) -> float | None:
        return self.measurement.time_per_output_token_s

    @property
    def completion_tokens(self) -> int | None:
        return self.measurement.completion_tokens

    @property
    def stream_s(self) -> float | None:
        """Time spent streaming after the first token."""
        m = self.measurement
        if m.engine_decode_s is not None:
            return m.engine_decode_s
        return m.client_decode_s

    @property
    def dominant_phase(self) -> str | None:
        """"prefill" when the wait before the first token (from the start of the stream: the
        queue for the engine is neither phase) is longer than the stream after it."""
        ttft = self.engine_ttft_s
        stream = self.stream_s
        if ttft is None:
            return None
        if stream is None:
            return "prefill"
        return "prefill" if ttft >= stream else "decode"

    @property
    def judgement(self) -> Verdict | None:
        """Each phase judged against its own standard (:func:`~trimkit.verdict.judge`): the wait
        the caller felt (:attr:`measured_ttft_s`) against the budget (without one, 1 s), the
        stream against ``tokens_per_s_target`` (without one, reading speed). None: no first token."""
        if self.measured_ttft_s is None:
            return None
        return judge(self.measured_ttft_s, self.decode_tokens_per_s, ttft_budget_s=self.ttft_budget_s,
                     tokens_per_s_target=self.tokens_per_s_target)

    @property
    def verdict(self) -> VerdictName | None:
        """``"none"``, ``"wait"``, ``"stream"`` or ``"both"``: which phase was slow (None: no first token)."""
        j = self.judgement
        return None if j is None else j.verdict

    @property
    def advice(self) -> tuple[str, ...]:
        """The cures that fit the :attr:`verdict` (none when nothing is slow)."""
        j = self.judgement
        return () if j is None else j.cures

    @property
    def decode(self) -> DecodeContext:
        """The decode speed measured and predicted (at the context sent, and untrimmed)."""
        return DecodeContext(self.decode_tokens_per_s, self.decode_predicted_tokens_per_s, self.decode_predicted_before_tokens_per_s,
                             self.decode_noise_pct, self.trimmed and (self.prompt_tokens_before or 0) > self.prompt_tokens)

    @property
    def trimmed(self) -> bool:
        return not self.passthrough

    @property
    def decode_untouched(self) -> str:
        return DECODE_PARAMETERS_UNTOUCHED

    # -- output ---------------------------------------------------------------------------------
    def lines(self) -> list[str]:
        """The report as lines a person reads (:func:`report_lines`)."""
        return report_lines(self)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def log_line(self) -> str:
        """One line for ``logging`` (INFO): :func:`report_log_line`."""
        return report_log_line(self)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "backend": self.backend,
            "model": self.model,
            "ttft_budget_s": self.ttft_budget_s,
            "safety_margin": self.safety_margin,
            "provisional": self.provisional,
            "extrapolated": self.extrapolated,
            "budget_met": self.budget_met,
            "feasible": self.feasible,
            "predicted_ttft_s": self.predicted_ttft_s,
            "predicted_ttft_before_s": self.predicted_ttft_before_s,
            "measured_ttft_s": self.measured_ttft_s,
            "engine_ttft_s": self.engine_ttft_s,
            "ttft_error_pct": self.ttft_error_pct,
            "queue_wait_predicted_s": self.queue_wait_predicted_s,
            "queue_wait_s": self.queue_wait_s,
            "queue_ahead": self.queue_ahead,
            "endpoint": self.endpoint,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_before": self.prompt_tokens_before,
            "cached_tokens_predicted": self.cached_tokens_predicted,
            "cached_tokens": self.cached_tokens,
            "evaluated_tokens": self.evaluated_tokens,
            "passthrough": self.passthrough,
            "watched": self.watched,
            "replans": [x.to_dict() for x in self.replans],
            "actions": [a for a in self.actions],
            "planning_s": self.planning_s,
            "profile_error_pct": self.profile_error_pct,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "time_per_output_token_s": self.time_per_output_token_s,
            "completion_tokens": self.completion_tokens,
            "decode_predicted_tokens_per_s": self.decode_predicted_tokens_per_s,
            "decode_predicted_before_tokens_per_s": self.decode_predicted_before_tokens_per_s,
            "decode_noise_pct": self.decode_noise_pct,
            "decode_side_effect_pct": self.decode.side_effect_pct,
            "decode_statement": self.decode.statement(),
            "decode_untouched": DECODE_PARAMETERS_UNTOUCHED,
            "decode_params": dict(self.decode_params),
            "tokens_per_s_target": self.tokens_per_s_target,
            "verdict": self.verdict,
            "judgement": None if self.judgement is None else self.judgement.to_dict(),
            "dominant_phase": self.dominant_phase,
            "advice": list(self.advice),
            "warnings": list(self.warnings),
            "measurement": self.measurement.to_dict(),
        }
        return _json_safe(d)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)
