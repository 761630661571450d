"""The per-request report: what trimkit predicted, what it measured, what it changed, and that
decode was left untouched. ``str(report)`` is for people; ``report.to_dict()`` for programs.

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
from trimkit.diagnose import STREAM_CURES, WAIT_CURES
from trimkit.planning.costs import evaluated_tokens

if TYPE_CHECKING:  # for annotations only: prepared sits above this module
    from trimkit.prepared import Prepared
    from trimkit.profile import Profile

__all__ = ["Report", "DECODE_UNTOUCHED", "template_warnings"]

DECODE_UNTOUCHED = (
    "decode untouched by trimkit: it changes only what is prefilled; max_tokens, temperature, stop and "
    "every other generation parameter passed through unchanged"
)


def _fmt_s(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f} s"


def _fmt_n(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


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
    from requests and idle probes); ``extrapolated``: the prompt sent lies beyond the lengths the
    profile has measured. Either makes the prediction less certain and the margin wider.
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

    @classmethod
    def of_request(cls, prepared: Prepared, m: Measurement, params: Mapping[str, Any], *, backend: str, model: str,
                   profile: Profile, notes: Sequence[str] = (), sent: bool = True, endpoint: str | None = None) -> Report:
        """The report of a prepared request with what was measured of it: ``profile`` is the one
        it was planned with, ``notes`` are the front-end's warnings, ``sent=False`` for a request
        that never went out, ``endpoint`` the replica it went to."""
        plan = prepared.plan
        warnings = list(prepared.warnings)
        if plan is not None and not plan.feasible:
            warnings.append("budget infeasible: sent the minimal prompt (system + last user message)")
        if not sent:
            warnings.append("not sent")
        warnings.extend(notes)
        n, cached = len(prepared.prompt_tokens), prepared.cached_tokens
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
    def advice(self) -> tuple[str, ...]:
        phase = self.dominant_phase
        if phase is None:
            return ()
        return WAIT_CURES if phase == "prefill" else STREAM_CURES

    @property
    def trimmed(self) -> bool:
        return not self.passthrough

    @property
    def decode_untouched(self) -> str:
        return DECODE_UNTOUCHED

    # -- output ---------------------------------------------------------------------------------
    def lines(self) -> list[str]:
        m = self.measurement
        out = [f"trimkit report — {self.backend}" + (f" ({self.model})" if self.model else "") + (f" @ {self.endpoint}" if self.endpoint else "")]
        if self.ttft_budget_s is not None:
            met = self.budget_met
            verdict = "n/a" if met is None else ("met" if met else "MISSED")
            feas = "" if self.feasible in (None, True) else " — " + self._infeasible_note()
            margin = ""
            if self.safety_margin is not None and math.isfinite(self.safety_margin):
                margin = f" · safety margin {self.safety_margin * 100:.1f} % (planned to {self.ttft_budget_s * (1 - self.safety_margin):.3f} s)"
            out.append(f"  budget     {self.ttft_budget_s:.3f} s → {verdict}{margin}{feas}")
        if self.provisional or self.extrapolated:
            out.append(f"  profile    {self._profile_note()}")
        pred = _fmt_s(self.predicted_ttft_s)
        if self.predicted_ttft_before_s is not None and self.trimmed:
            pred += f" (before trimming {_fmt_s(self.predicted_ttft_before_s)})"
        err = self.ttft_error_pct
        err_s = f" · error {err:+.1f} %" if err is not None else ""
        label = "measured" if m.ttft_s is not None or m.first_output_s is None else "measured (first chunk, no content)"
        out.append(f"  TTFT       predicted {pred} · {label} {_fmt_s(self.measured_ttft_s)}{err_s}")
        queue = self._queue_line()
        if queue:
            out.append(queue)
        if m.engine_prefill_s is not None:
            prefill = f"  prefill    {_fmt_s(m.engine_prefill_s)} engine-measured ({m.timing_source})"
            overhead = m.server.get("network_overhead_s")
            if overhead is not None:
                prefill += f" · network/queue {_fmt_s(overhead)} (client TTFT − server prefill)"
            out.append(prefill)
        tok = f"  prompt     {_fmt_n(self.prompt_tokens)} tokens"
        if self.prompt_tokens_before is not None and self.prompt_tokens_before != self.prompt_tokens:
            tok += f" (before trimming {_fmt_n(self.prompt_tokens_before)})"
        tok += f" · reused from cache {_fmt_n(m.cached_tokens)} (predicted {_fmt_n(self.cached_tokens_predicted)}) · evaluated {_fmt_n(m.evaluated_tokens)}"
        out.append(tok)
        if self.actions:
            out.append("  trimming")
            for a in self.actions:
                out.append(f"    - {getattr(a, 'strategy', '?')}: {getattr(a, 'summary', a)}")
        elif self.ttft_budget_s is not None:
            out.append("  trimming   none (under budget: request passed through unchanged)")
        tps = self.decode_tokens_per_s
        tpot = self.time_per_output_token_s
        if tps is not None and tpot is not None:
            out.append(
                f"  decode     {tps:.1f} tokens/s ({tpot * 1000:.1f} ms per output token), "
                f"{_fmt_n(self.completion_tokens)} tokens — untouched by trimkit"
            )
        else:
            out.append(f"  decode     {_fmt_n(self.completion_tokens)} output tokens (too few to time) — untouched by trimkit")
        phase = self.dominant_phase
        if phase is not None:
            what = "the wait (prefill): trimming and caching help it" if phase == "prefill" else (
                "the stream (decode): only a smaller/faster model, lower-bit quantization, more bandwidth or GPU offload help it"
            )
            out.append(f"  dominant   {what}")
        if m.truncated_tokens:
            out.append(f"  WARNING    the engine evaluated {m.truncated_tokens:,} fewer prompt tokens than were sent: it truncated the prompt")
        for w in self.warnings:
            out.append(f"  warning    {w}")
        return out

    def _infeasible_note(self) -> str:
        wait = self.queue_wait_predicted_s or 0.0
        if wait and self.predicted_ttft_s is not None and self.ttft_budget_s is not None and self.predicted_ttft_s - wait <= self.ttft_budget_s:
            return f"predicted over budget because of the {wait:.3f} s wait for the requests ahead"
        return "infeasible: even the minimal prompt cannot fit; sent the best achievable"

    def _queue_line(self) -> str:
        """The wait for the engine, predicted and measured (empty when there was none)."""
        pred, meas = self.queue_wait_predicted_s, self.queue_wait_s
        if not pred and meas < 0.001:
            return ""
        ahead = f", {self.queue_ahead} request(s) ahead" if self.queue_ahead else ""
        return (f"  queue      waited {meas:.3f} s for the engine (predicted {_fmt_s(pred)}{ahead}) · in the TTFT above; "
                f"from the start of the stream {_fmt_s(self.engine_ttft_s)}")

    def _profile_note(self) -> str:
        notes = []
        if self.provisional:
            notes.append("provisional (a micro-calibration, improving from each request and from idle probes)")
        if self.extrapolated:
            notes.append("prompt beyond the lengths it has measured (extrapolated)")
        wider = " — wider safety margin" if self.ttft_budget_s is not None else ""
        return " · ".join(notes) + wider

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def log_line(self) -> str:
        """One line for ``logging`` (INFO)."""
        parts = [f"backend={self.backend}"] + ([f"endpoint={self.endpoint}"] if self.endpoint else [])
        if self.ttft_budget_s is not None:
            parts.append(f"budget={self.ttft_budget_s:.3f}s met={self.budget_met}")
        parts.append(f"ttft_pred={_fmt_s(self.predicted_ttft_s)} ttft_meas={_fmt_s(self.measured_ttft_s)}")
        if self.queue_wait_predicted_s or self.queue_wait_s >= 0.001:
            parts.append(f"queue_pred={_fmt_s(self.queue_wait_predicted_s)} queue_meas={_fmt_s(self.queue_wait_s)} ahead={self.queue_ahead}")
        parts.append(f"prompt={self.prompt_tokens} before={self.prompt_tokens_before} cached={self.cached_tokens} evaluated={self.evaluated_tokens}")
        parts.append(f"actions={len(self.actions)}")
        if self.provisional or self.extrapolated:
            parts.append("profile=" + ",".join(n for n, on in (("provisional", self.provisional), ("extrapolated", self.extrapolated)) if on))
        tps = self.decode_tokens_per_s
        parts.append(f"decode={tps:.1f}tok/s(untouched)" if tps else "decode=n/a(untouched)")
        return "trimkit: " + " ".join(parts)

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
            "actions": [a for a in self.actions],
            "planning_s": self.planning_s,
            "profile_error_pct": self.profile_error_pct,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "time_per_output_token_s": self.time_per_output_token_s,
            "completion_tokens": self.completion_tokens,
            "decode_untouched": DECODE_UNTOUCHED,
            "decode_params": dict(self.decode_params),
            "dominant_phase": self.dominant_phase,
            "advice": list(self.advice),
            "warnings": list(self.warnings),
            "measurement": self.measurement.to_dict(),
        }
        return _json_safe(d)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)
