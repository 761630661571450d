"""The human text of a :class:`~trimkit.report.Report`: :func:`report_lines` (``str(report)``)
and :func:`report_log_line` (``report.log_line()``). Both read only the report's public fields
and properties, so they take any object that has them."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["report_lines", "report_log_line"]


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
