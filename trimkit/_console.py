"""What the command line and the demo show a person: the model they open, a progress bar while
calibrating, a calibration profile as a table or a plot, and a report log
(``wrap(..., report_log=...)``) as summary figures and a plot of predicted vs measured TTFT."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from trimkit.backends.llama_format import DEFAULT_MODEL, EMBEDDED_MODELS, check_model_path
from trimkit.errors import InvalidInputError, require_extra
from trimkit.planning.profile import Profile

__all__ = ["open_llama", "ProgressBar", "profile_lines", "decode_text", "plot_profile", "read_report_log", "report_log_lines",
           "plot_report_log"]


def open_llama(model: str | None, n_ctx: int, chat_format: str | None = None, **kwargs: Any) -> Any:
    """A ``llama_cpp.Llama`` for ``model`` — a GGUF path, or the name of an embedded model
    (``"smollm2"``, ``"gemma"``; None = the default, see :mod:`trimkit.backends.llama_format`) — checked first,
    opened quietly (llama.cpp prints some context-creation notes even with ``verbose=False``; a
    failed load still raises, with its message)."""
    llama_cpp = require_extra("llama_cpp", "llama", "opening a GGUF model in process")
    from llama_cpp._utils import suppress_stdout_stderr

    from trimkit.backends.llama import default_llama

    if model is None or model in EMBEDDED_MODELS:
        # each with a template that keeps system prompts: SmolLM2's own (in its GGUF), Gemma 3's
        # (its GGUF has none; llama-cpp-python's "gemma" format drops system messages)
        if chat_format is not None:
            kwargs["chat_format"] = chat_format
        with suppress_stdout_stderr(disable=False):
            return default_llama(model or DEFAULT_MODEL, n_ctx=n_ctx, **kwargs)
    path = str(check_model_path(model))
    with suppress_stdout_stderr(disable=False):
        return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, verbose=False, chat_format=chat_format, **kwargs)


class ProgressBar:
    """A tqdm progress bar on stderr as a calibration ``progress(done, total, label)`` callback;
    drawn only when ``enabled``, and only from the first call on."""

    def __init__(self, desc: str, enabled: bool) -> None:
        self.desc = desc
        self.enabled = enabled
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.desc, unit="step", file=sys.stderr, leave=False)
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def profile_lines(profile: Profile) -> list[str]:
    """The profile as a table a person can read."""
    key = profile.key
    out = [
        f"profile for {key.model}",
        f"  n_ctx={key.n_ctx} n_batch={key.n_batch} threads={key.n_threads}/{key.n_threads_batch} "
        f"flash_attn={key.flash_attn} gpu_layers={key.n_gpu_layers} · {key.engine_version} · {key.cpu}",
        f"  {'prompt tokens':>13} {'cached':>7} {'measured':>10} {'predicted':>10} {'error':>8} {'ms/token':>9}",
    ]
    for r in profile.table():
        out.append(
            f"  {r['new_tokens']:>13,} {r['cached_tokens']:>7,} {r['measured_s']:>9.3f}s {r['predicted_s']:>9.3f}s "
            f"{r['error_pct']:>+7.1f}% {r['ms_per_token']:>9.2f}"
        )
    m = profile.model
    out += [
        f"  model ({m.name}): T(n|k) = {m.overhead_s * 1000:.1f} ms + {m.per_token_s * 1000:.3f} ms·n + "
        f"{m.depth_s * 1e6:.3f} µs·(n·k + n²/2)" + (f" + {m.per_batch_s * 1000:.1f} ms·⌈n/{m.n_batch}⌉" if m.per_batch_s else ""),
        f"  held-out error (leave one probe out): median {profile.error.median_pct:.1f} %, p90 {profile.error.p90_pct:.1f} %",
        _attention_text(profile),
        f"  first-token overhead {profile.first_token_s * 1000:.1f} ms"
        + (f" + {profile.first_token_per_token_s * 1e6:.1f} ms per 1,000 prompt tokens (tokenizing it)" if profile.first_token_per_token_s else "")
        + f" · {decode_text(profile)}",
        f"  calibrated in {profile.calibration_wall_s:.1f} s ({profile.mode}"
        + (f", time budget {profile.time_budget_s:g} s" if profile.time_budget_s else "")
        + (", provisional: it improves from requests" if profile.provisional else "") + ")",
        f"  probed up to {profile.probed_new_tokens:,} new tokens and {profile.probed_context_tokens:,} tokens of context; "
        "predictions beyond are extrapolated and get a wider margin",
    ]
    return out


def _attention_text(profile: Profile) -> str:
    """Where the per-token cost doubles with context: fitted, and what the model's architecture
    says (the prior the fit leans on where the probes reach too little context to show it)."""
    m = profile.model
    fitted = f"every {m.per_token_s / m.depth_s:,.0f} tokens of context" if m.depth_s > 0 else "not seen in the probes"
    prior = (f"; the architecture says every {profile.attention_prior_tokens:,.0f} (the prior the fit leans on)"
             if profile.attention_prior_tokens else "; no architecture prior (the fit has the probes alone)")
    return f"  attention: the per-token cost doubles {fitted}{prior}"


def decode_text(profile: Profile) -> str:
    """The stream's speed as the profile predicts it: at the shortest and the longest context
    it measured when decode slows with context (each generated token reads the KV cache of
    every token before it), else the one speed, with the profile's note."""
    model = profile.decode_model()
    if model is None or not model.context_dependent:
        return f"decode {profile.decode_tokens_per_s:.1f} tokens/s" + (f" ({model.note})" if model is not None and model.note else "")
    lo, hi = (round(c) for c in model.context_range)
    return (f"decode {profile.decode_tokens_per_s_at(lo):.1f} tokens/s at {lo:,} tokens of context, "
            f"{profile.decode_tokens_per_s_at(hi):.1f} at {hi:,} (a longer context decodes slower: each token reads the KV cache)")


def plot_profile(profile: Profile, path: str, budget_s: float | None = None) -> str:
    """Measured prefill time against prompt length, with the fitted curve (and a budget line),
    written to ``path``. Needs matplotlib (``pip install 'trimkit[plot]'``)."""
    plt = _pyplot("--plot")
    cold = [s for s in profile.samples if s.cached_tokens == 0]
    deep = [s for s in profile.samples if s.cached_tokens > 0]
    top = max(s.new_tokens + s.cached_tokens for s in profile.samples)
    xs = list(range(1, top + 1, max(top // 200, 1)))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot([s.new_tokens for s in cold], [s.seconds for s in cold], "o", label="measured (cold prompt)", alpha=0.8)
    ax.plot(xs, [profile.model.prefill_s(x) for x in xs], "-", label=f"fitted cost model ({profile.model.name})")
    for k in sorted({s.cached_tokens for s in deep}):
        pts = [s for s in deep if s.cached_tokens == k]
        ax.plot([s.new_tokens for s in pts], [s.seconds for s in pts], "s", label=f"measured, after {k:,} cached tokens")
        ax.plot(xs, [profile.model.prefill_s(x, k) for x in xs], ":", alpha=0.6)
    if budget_s:
        ax.axhline(budget_s - profile.first_token_s, color="red", ls="--", label=f"prefill share of a {budget_s:g} s TTFT budget")
    return _finish(plt, fig, ax, path, "prompt tokens evaluated (n)", "prefill time (s)",
                   f"Prefill cost on this host — {profile.key.model.split(':')[0]}")


def _finish(plt: Any, fig: Any, ax: Any, path: str, xlabel: str, ylabel: str, title: str) -> str:
    """Label the axes, add the grid and the legend, write the figure to ``path`` and close it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _pyplot(needed_by: str) -> Any:
    """matplotlib's pyplot, drawing to files only; a clear error naming the extra when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidInputError(f"{needed_by} needs matplotlib: pip install 'trimkit[plot]'") from None
    return plt


def read_report_log(path: str) -> list[dict[str, Any]]:
    """The reports of a report log (one JSON object a line; blank lines skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise InvalidInputError(f"cannot read the report log {path}: {exc.strerror or exc}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise InvalidInputError(f"{path}, line {n}: not JSON (a report log has one report's to_dict() a line)") from None
        if not isinstance(row, dict) or "predicted_ttft_s" not in row or "measured_ttft_s" not in row:
            raise InvalidInputError(f"{path}, line {n}: not a trimkit report (no predicted_ttft_s / measured_ttft_s)")
        rows.append(row)
    if not rows:
        raise InvalidInputError(f"{path} holds no reports")
    return rows


def _quantile(values: Sequence[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1] if len(values) > 1 else values[0]


def report_log_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The summary figures of a report log, as lines a person reads."""
    measured = [r["measured_ttft_s"] for r in rows if r.get("measured_ttft_s") is not None]
    budgeted = [r for r in rows if r.get("budget_met") is not None]
    met = sum(1 for r in budgeted if r["budget_met"])
    errors = [abs(r["ttft_error_pct"]) for r in rows if r.get("ttft_error_pct") is not None]
    decode = [r["decode_tokens_per_s"] for r in rows if r.get("decode_tokens_per_s")]
    removed = sum(max((r.get("prompt_tokens_before") or 0) - (r.get("prompt_tokens") or 0), 0) for r in rows)
    lines = [f"{len(rows)} requests: {sum(1 for r in rows if not r.get('passthrough', True))} trimmed, "
             f"{sum(1 for r in rows if r.get('replans'))} re-planned while prefilling, "
             f"{sum(1 for r in rows if r.get('error_type'))} ended in an error, {removed:,} prompt tokens removed"]
    if budgeted:
        lines.append(f"budget met: {met} of {len(budgeted)} budgeted requests ({met / len(budgeted):.0%})")
    if measured:
        lines.append(f"measured TTFT: median {statistics.median(measured):.3f} s, p90 {_quantile(measured, 0.9):.3f} s, "
                     f"max {max(measured):.3f} s")
    if errors:
        lines.append(f"prediction error |predicted − measured| / measured: median {statistics.median(errors):.1f} %, "
                     f"p90 {_quantile(errors, 0.9):.1f} %")
    if decode:
        lines.append(f"decode (left untouched): median {statistics.median(decode):.1f} tokens/s")
    return lines


def plot_report_log(rows: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str:
    """Predicted and measured TTFT per request with the budget line; re-plans and misses marked.
    Written to ``path`` (PNG). Needs matplotlib (``pip install 'trimkit[plot]'``)."""
    plt = _pyplot("trimkit report")
    xs = list(range(1, len(rows) + 1))
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    budget = [r.get("ttft_budget_s") for r in rows]
    if any(b is not None for b in budget):
        ax.step(xs, [float("nan") if b is None else b for b in budget], where="mid", color="red", ls="--", lw=1.2, label="TTFT budget")
    ax.plot(xs, [_nan(r.get("predicted_ttft_s")) for r in rows], "o", mfc="none", color="tab:blue", label="predicted (prompt sent)")
    ax.plot(xs, [_nan(r.get("measured_ttft_s")) for r in rows], ".", ms=9, color="tab:green", label="measured")
    misses = [(x, r["measured_ttft_s"]) for x, r in zip(xs, rows) if r.get("budget_met") is False and r.get("measured_ttft_s") is not None]
    if misses:
        ax.plot(*zip(*misses), "x", ms=10, mew=2, color="red", label=f"missed the budget ({len(misses)})")
    replanned = [x for x, r in zip(xs, rows) if r.get("replans")]
    for i, x in enumerate(replanned):
        ax.axvline(x, color="tab:orange", alpha=0.35, lw=3, label=f"re-planned while prefilling ({len(replanned)})" if i == 0 else None)
    failed = [x for x, r in zip(xs, rows) if r.get("error_type")]
    for i, x in enumerate(failed):
        ax.axvline(x, color="grey", ls=":", label=f"ended in an error ({len(failed)})" if i == 0 else None)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    return _finish(plt, fig, ax, path, "request", "time to first token (s)", title or "Predicted vs measured TTFT")


def _nan(value: Any) -> float:
    return float("nan") if value is None else float(value)
