"""The ``trimkit`` command line: calibrate, diagnose, plan, demo, report (docs/cli.md).

Errors reach the user as one line on stderr and a non-zero exit status (2 for bad input, 1 for engine
failures), never as a traceback. Below the commands: what they print, then the demo, sized to this host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import statistics
import sys
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from trimkit import __version__
from trimkit._calibration import FULL_BUDGET_S, MICRO_BUDGET_S, QUICK_BUDGET_S, as_backend, calibrate, load_profile, mode_and_budget
from trimkit.backends.base import Backend
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.llama_format import DEFAULT_MODEL, EMBEDDED_MODELS, check_model_path
from trimkit.backends.replies import chunk_content
from trimkit.errors import InvalidInputError, InvalidNumberError, TrimkitError, require_extra
from trimkit.messages import Chunk, coerce_chunks, validate_messages
from trimkit.pipeline import place_chunks
from trimkit.planning.planner import plan as make_plan
from trimkit.planning.profile import Profile
from trimkit.planning.values import index_runs, rank_chunks
from trimkit.report import DEFAULT_WAIT_THRESHOLD_S, READING_SPEED_TOKENS_PER_S, diagnose
from trimkit.wrapper import wrap

EMBEDDED = "the embedded SmolLM2-135M-Instruct; \"gemma\" names the embedded Gemma-3-270M"
#: the share of ``trimkit calibrate``'s time budget left for printing and unloading the model
EXIT_SHARE = 0.05


def _number(kind: Callable[[str], float], low: float, high: float = float("inf"), what: str = "a finite number > 0") -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` with ``low < value <= high`` (ints: ``low <= value``)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not (value >= low if kind is int else low < value <= high) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {what}: {text!r}")
        return value

    return parse


_positive_float = _number(float, 0.0)
_positive_int = _number(int, 1, what=">= 1")
_share = _number(float, 0.0, 1.0, "a share in (0, 1]")


def process_age_s() -> float:
    """Seconds since this process started, as Linux ``/proc`` tells it; 0.0 elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime_s - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start time in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    # --time-budget is checked before the model loads
    mode, budget_s = mode_and_budget("micro" if args.micro else "quick" if args.quick else None, args.time_budget, "--time-budget")
    started = time.perf_counter() - process_age_s()  # the budget is the whole command's: start-up and model load too
    if args.url:
        if not args.model:
            raise InvalidInputError("--url needs --model NAME (the model name the server serves)")
        target: Any = OpenAIHTTPBackend(args.url, model=args.model, n_ctx=args.n_ctx)
    else:
        target = open_llama(args.model, args.n_ctx)
    left = budget_s * (1 - EXIT_SHARE) - (time.perf_counter() - started)
    asked_at = time.time()
    with contextlib.closing(ProgressBar("calibrating", enabled=not args.json and sys.stderr.isatty() or args.progress)) as bar:
        # never less than a sliver: calibrate still takes its minimum (and warns) on a host too slow for the budget
        profile = calibrate(target, mode=mode, time_budget_s=max(left, 0.01 * budget_s), recalibrate=args.recalibrate, progress=bar)
    took = time.perf_counter() - started
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
    else:
        print("\n".join(profile_lines(profile)))
        if profile.created_at >= asked_at:  # measured now, not reused
            print(f"  budget {budget_s:g} s: the command took {took:.1f} s with start-up and model load")
        else:
            print(f"  stored profile reused (measured in {profile.calibration_wall_s:.1f} s); --recalibrate measures again")
    if args.plot:
        plot_profile(profile, args.plot, args.budget)
        if not args.json:
            print(f"  plot written to {args.plot}")
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    if args.prompt_file:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidInputError(f"cannot read --prompt-file: {exc}") from None
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"--prompt-file {args.prompt_file} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        if not text.strip():
            raise InvalidInputError("--prompt-file is empty")
        # no budget for the wrapper: the prompt is measured as given, then judged against --ttft-budget
        chat = wrap(open_llama(args.model, args.n_ctx), tokens_per_s_target=args.tokens_per_s_target)
        chat.create_chat_completion(messages=[{"role": "user", "content": text}], max_tokens=args.output_tokens)
        report = chat.last_report
        print(report)
        ttft, prompt_tokens = report.measured_ttft_s, report.prompt_tokens
        tps = report.decode_tokens_per_s or chat.profile.decode_tokens_per_s_at(prompt_tokens, args.output_tokens) or chat.profile.decode_tokens_per_s
    elif args.ttft is None or args.tokens_per_s is None:
        raise InvalidNumberError("diagnose needs either --ttft S --tokens-per-s N [--prompt-tokens N] or --prompt-file F [--model PATH]")
    else:
        ttft, tps, prompt_tokens = args.ttft, args.tokens_per_s, args.prompt_tokens
    d = diagnose(ttft, tps, prompt_tokens, args.output_tokens, ttft_budget_s=args.ttft_budget, tokens_per_s_target=args.tokens_per_s_target,
                 reading_speed_tokens_per_s=args.reading_speed, wait_threshold_s=args.wait_threshold)
    print(json.dumps(d.to_dict(), indent=1) if args.json else d)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(model=args.model, budget_s=args.budget, budget_share=args.budget_share, turns=args.turns, n_ctx=args.n_ctx or 8192,
                    quick=args.quick, json_path=args.json, time_target_s=args.time_target, report_log=args.report_log)


def read_request(path: str) -> tuple[list[Any], tuple[Any, ...], Any]:
    """``(messages, chunks, tools)`` from a JSON request file, checked; InvalidInputError otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read the request file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{path} is not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise InvalidInputError(f"{path} is nested too deep to read as a request") from None
    except ValueError as exc:  # an integer over Python's digit limit
        raise InvalidInputError(f"{path} is not a usable request: {str(exc)[:200]}") from None
    if isinstance(data, list):  # a bare message list is a request too
        data = {"messages": data}
    if not isinstance(data, dict):
        raise InvalidInputError(f"{path}: expected a JSON object with \"messages\" (and optional \"rag_chunks\", \"tools\")")
    unknown = sorted(set(data) - {"messages", "rag_chunks", "tools"})
    if unknown:
        raise InvalidInputError(f"{path}: unknown field(s) {', '.join(map(repr, unknown))}; expected messages, rag_chunks, tools")
    if "messages" not in data:
        raise InvalidInputError(f"{path}: no \"messages\"")
    try:
        validate_messages(data["messages"])
        chunks = coerce_chunks(data.get("rag_chunks"))
    except InvalidInputError as exc:
        raise InvalidInputError(f"{path}: {exc}") from None
    if data.get("tools") is not None and not isinstance(data["tools"], list):
        raise InvalidInputError(f"{path}: \"tools\" must be a list")
    return data["messages"], chunks, data.get("tools")


def _plan_profile(args: argparse.Namespace, backend: Backend) -> tuple[Profile, str]:
    """The profile to plan with, and where it came from."""
    if args.profile:
        try:
            return Profile.from_dict(json.loads(Path(args.profile).read_text(encoding="utf-8"))), f"--profile {args.profile}"
        except OSError as exc:
            raise InvalidInputError(f"cannot read --profile {args.profile}: {exc.strerror or exc}") from None
        except Exception as exc:
            raise InvalidInputError(f"--profile {args.profile} is not a trimkit profile ({type(exc).__name__}: {exc})") from None
    stored = load_profile(backend.profile_key())
    if stored is not None:
        return stored, f"the stored {stored.mode} calibration profile"
    print("trimkit: no stored calibration profile for this model and settings: calibrating quickly (stored for next time)…", file=sys.stderr)
    return calibrate(backend, mode="quick"), "a quick calibration measured now (no stored profile)"


def _index_ranges(indices: Sequence[int]) -> str:
    """``1, 2, 3, 7`` as ``1–3, 7``: a plan that drops 4,000 turns prints one short line."""
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in index_runs(indices))


def _cmd_plan(args: argparse.Namespace) -> int:
    messages, chunks, tools = read_request(args.request)  # bad input fails before the model loads
    llm = open_llama(args.model, args.n_ctx)
    from trimkit.backends.llama import LlamaBackend

    backend = LlamaBackend(llm)
    profile, source = _plan_profile(args, backend)
    tok = backend.tokenizer
    # counted per message (the counts the planner reuses): a huge request is never tokenized whole twice
    untrimmed_tokens = tok.segment_counts(place_chunks(messages, chunks) if chunks else messages, tools).total
    untrimmed_s = profile.predict_ttft_s(untrimmed_tokens, 0)
    if args.budget is not None:
        budget, how = args.budget, f"--budget {args.budget:g} s"
    else:
        budget = args.budget_share * untrimmed_s
        how = f"--budget-share {args.budget_share:g} of the predicted untrimmed TTFT {untrimmed_s:.3f} s"
    p = make_plan(messages, ttft_budget_s=budget, profile=profile, tokenizer=tok, rag_chunks=chunks, tools=tools)
    sent_tokens = len(tok.prompt_tokens(p.messages, tools))
    sent_s = profile.predict_ttft_s(sent_tokens, 0)
    dropped_by_template = tok.dropped_messages(p.messages, tools)
    if args.json:
        out = p.to_dict()
        out.update(request=args.request, budget_source=how, profile_source=source, untrimmed_prompt_tokens=untrimmed_tokens,
                   untrimmed_predicted_ttft_s=untrimmed_s, prompt_tokens_exact=sent_tokens, predicted_ttft_exact_s=sent_s,
                   template_dropped_messages=list(dropped_by_template))
        print(json.dumps(out, indent=1))
        return 0
    print(f"request {args.request}: {len(messages)} messages, {len(chunks)} chunks, {untrimmed_tokens:,} prompt tokens untrimmed")
    print(f"budget {budget:.3f} s from {how}; profile: {source}")
    print(p)
    print(f"  chunks kept ({len(p.kept_chunks)} of {len(chunks)}): {', '.join(str(c.id) for c in p.kept_chunks) or 'none'}")
    print(f"  chunks dropped: {', '.join(str(c.id) for c in p.dropped_chunks) or 'none'}")
    print(f"  messages removed (indices): {_index_ranges(p.removed_message_indices) or 'none'}")
    if p.summarized_message_indices:
        print(f"  messages summarized (indices): {_index_ranges(p.summarized_message_indices)}")
    print(f"  prompt to send: {sent_tokens:,} tokens, predicted TTFT {sent_s:.3f} s with nothing cached "
          f"(untrimmed: {untrimmed_s:.3f} s) — nothing was generated")
    if dropped_by_template:
        print(f"  warning: the chat template drops message(s) {', '.join(map(str, dropped_by_template))}: the model would never see them")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    rows = read_report_log(args.log)
    print("\n".join(report_log_lines(rows)))
    if not args.no_plot:
        out = args.plot or str(Path(args.log).with_suffix(".png"))
        print(f"plot: {plot_report_log(rows, out, title=f'Predicted vs measured TTFT — {Path(args.log).name}')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trimkit",
        description="Keep a local LLM's time to first token inside a budget by trimming what is prefilled. "
        "Prefill (the wait) grows with the prompt; decode (the stream) much less — trimkit aims only at the first.",
    )
    p.add_argument("--version", action="version", version=f"trimkit {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log trimkit's INFO lines to stderr")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    engine = argparse.ArgumentParser(add_help=False)  # the arguments of every command that opens a model
    engine.add_argument("--model", help=f"GGUF model path or embedded model name (default: {EMBEDDED}); with --url, the served model's name")
    engine.add_argument("--n-ctx", type=_positive_int, help="context window (default 8192, calibrate --url: the server's; part of the profile key)")

    def command(name: str, func: Callable[[argparse.Namespace], int], help: str, description: str, model: bool = True) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=description, parents=[engine] if model else [])
        s.set_defaults(func=func)
        return s

    c = command("calibrate", _cmd_calibrate, "measure prefill cost on this host and print the profile",
                "Measure prefill time at a spread of prompt lengths and depths within a time budget, fit the cost model, store the "
                "profile in the user cache (reused next time unless --recalibrate) and print it.")
    c.add_argument("--url", help="calibrate an OpenAI-compatible server instead, e.g. http://127.0.0.1:8080/v1")
    cm = c.add_mutually_exclusive_group()
    cm.add_argument("--quick", action="store_true", help=f"the quick schedule, within {QUICK_BUDGET_S:g} s: shorter probes, less accurate for long prompts")
    cm.add_argument("--micro", action="store_true", help=f"the micro schedule, within {MICRO_BUDGET_S:g} s: a provisional profile (what wrap() starts from)")
    c.add_argument("--time-budget", type=float, metavar="S", default=None,
                   help=f"finish within S seconds, start-up and model load included (default {FULL_BUDGET_S:g}; {QUICK_BUDGET_S:g} with --quick, "
                   f"{MICRO_BUDGET_S:g} with --micro); without --quick/--micro the mode is the most thorough one S affords")
    c.add_argument("--recalibrate", action="store_true", help="measure again even if a stored profile matches")
    c.add_argument("--json", action="store_true", help="print the profile as JSON")
    c.add_argument("--plot", metavar="FILE.png", help="draw measured prefill time vs prompt length with the fitted curve")
    c.add_argument("--budget", type=_positive_float, help="with --plot: draw a TTFT budget line (seconds)")
    c.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")

    d = command("diagnose", _cmd_diagnose, "name the slow phase (the wait, the stream, both or neither) and the cure that fits",
                "Give measured numbers or run one prompt (--prompt-file, on --model) and learn which phase is slow, each judged against "
                "its own standard (the wait: --ttft-budget or --wait-threshold; the stream: --tokens-per-s-target or --reading-speed), "
                "and what helps it.")
    d.add_argument("--ttft", type=_positive_float, help="measured time to first token, seconds")
    d.add_argument("--tokens-per-s", type=_positive_float, help="measured decode speed, tokens/s")
    d.add_argument("--prompt-tokens", type=_positive_int, help="prompt length in tokens")
    d.add_argument("--output-tokens", type=_positive_int, default=256, help="typical answer length in tokens (default 256)")
    d.add_argument("--ttft-budget", type=_positive_float, help="the wait you accept before the first token, seconds")
    d.add_argument("--tokens-per-s-target", type=_positive_float, help="the stream speed you need, tokens/s (default: reading speed)")
    d.add_argument("--reading-speed", type=_positive_float, default=READING_SPEED_TOKENS_PER_S,
                   help=f"how fast your reader reads, tokens/s: a slower stream is slow (default {READING_SPEED_TOKENS_PER_S:g})")
    d.add_argument("--wait-threshold", type=_positive_float, default=DEFAULT_WAIT_THRESHOLD_S,
                   help=f"without --ttft-budget, a longer wait is slow, seconds (default {DEFAULT_WAIT_THRESHOLD_S:g})")
    d.add_argument("--prompt-file", help="run this prompt on --model and diagnose the measured request")
    d.add_argument("--json", action="store_true", help="print the diagnosis as JSON")

    m = command("demo", _cmd_demo, "see the two phases and a TTFT budget held, on the embedded model",
                "Calibrate, show a long and a short prompt (the wait vs the stream), then a multi-turn RAG chat kept under a TTFT "
                "budget, sized to --time-target from this host's speed (a request predicted not to fit is not run).")
    mb = m.add_mutually_exclusive_group()
    mb.add_argument("--budget", type=_positive_float, default=None,
                    help="TTFT budget in seconds for the chat part (default: derived from this host's profile, see --budget-share)")
    mb.add_argument("--budget-share", type=_share, default=BUDGET_SHARE,
                    help=f"without --budget: the budget is the predicted TTFT of this share of the untrimmed prompt (default {BUDGET_SHARE:g})")
    m.add_argument("--turns", type=_positive_int, default=3, help="chat turns under the budget (default 3)")
    m.add_argument("--quick", action="store_true", help="quick calibration (at most 10 s) instead of full (at most 30 s); "
                   "either runs once (it is stored), and within a fifth of --time-target")
    m.add_argument("--time-target", type=_positive_float, default=TIME_TARGET_S, metavar="S",
                   help=f"what the whole demo aims to take on this host, in seconds (default {TIME_TARGET_S:g})")
    m.add_argument("--json", metavar="FILE", help="also write every report as JSON to FILE")
    m.add_argument("--report-log", metavar="FILE", help="append every report as a JSON line to FILE (draw it: trimkit report FILE)")

    pl = command("plan", _cmd_plan, "show what a TTFT budget would keep and drop from a request, without generating",
                 "Plan a request (JSON: messages, rag_chunks, tools) under a TTFT budget with this host's profile and print what would "
                 "be kept, dropped and summarized; loads the model for its tokenizer, generates nothing.")
    pl.add_argument("request", metavar="REQUEST.json", help="the request: messages, optional rag_chunks (strings or {text, id, score}), optional tools")
    pb = pl.add_mutually_exclusive_group(required=True)
    pb.add_argument("--budget", type=_positive_float, help="TTFT budget in seconds")
    pb.add_argument("--budget-share", type=_share, help="budget as a share (0–1] of the request's predicted untrimmed TTFT")
    pl.add_argument("--profile", metavar="PATH", help="a profile JSON file (trimkit calibrate --json) instead of the stored one")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    rp = command("report", _cmd_report, "summarize a report log and plot predicted vs measured TTFT per request",
                 "Print the summary figures of a report log (wrap(..., report_log=FILE)) and draw predicted vs measured TTFT per "
                 "request to a PNG (needs matplotlib: pip install 'trimkit[plot]').", model=False)
    rp.add_argument("log", help="the report log (JSON lines)")
    rp.add_argument("--plot", metavar="PNG", help="where to write the plot (default: the log's name with .png)")
    rp.add_argument("--no-plot", action="store_true", help="print the figures only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except TrimkitError as exc:
        print(f"trimkit: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        print("trimkit: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # an engine failure we did not anticipate: still one line
        print(f"trimkit: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def open_llama(model: str | None, n_ctx: int | None, chat_format: str | None = None, **kwargs: Any) -> Any:
    """A ``llama_cpp.Llama`` for a GGUF path or an embedded model's name (None: the default) with ``n_ctx`` (None: 8192), opened quietly
    (llama.cpp prints context notes even with ``verbose=False``; a failed load still raises)."""
    llama_cpp = require_extra("llama_cpp", "llama", "opening a GGUF model in process")
    from llama_cpp._utils import suppress_stdout_stderr

    from trimkit.backends.llama import default_llama

    path = None if model is None or model in EMBEDDED_MODELS else str(check_model_path(model))
    n_ctx = n_ctx or 8192
    with suppress_stdout_stderr(disable=False):
        if path is None:  # each with a template that keeps system prompts (llama-cpp-python's "gemma" format drops them)
            return default_llama(model or DEFAULT_MODEL, n_ctx=n_ctx, **{**kwargs, **({"chat_format": chat_format} if chat_format is not None else {})})
        return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, verbose=False, chat_format=chat_format, **kwargs)


class ProgressBar:
    """A tqdm bar on stderr as a calibration ``progress(done, total, label)`` callback, drawn from the first call on."""

    def __init__(self, desc: str, enabled: bool) -> None:
        self.desc = desc
        self.enabled = enabled
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.desc, unit="step", file=sys.stderr, leave=False)
        self.bar.total = total  # the schedule is resized as it learns the speed
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def profile_lines(profile: Profile) -> list[str]:
    """The profile as a table a person can read."""
    key, m = profile.key, profile.model
    out = [
        f"profile for {key.model}",
        f"  n_ctx={key.n_ctx} n_batch={key.n_batch} threads={key.n_threads}/{key.n_threads_batch} "
        f"flash_attn={key.flash_attn} gpu_layers={key.n_gpu_layers} · {key.engine_version} · {key.cpu}",
        f"  {'prompt tokens':>13} {'cached':>7} {'measured':>10} {'predicted':>10} {'error':>8} {'ms/token':>9}",
    ]
    out += [f"  {r['new_tokens']:>13,} {r['cached_tokens']:>7,} {r['measured_s']:>9.3f}s {r['predicted_s']:>9.3f}s "
            f"{r['error_pct']:>+7.1f}% {r['ms_per_token']:>9.2f}" for r in profile.table()]
    # where the per-token cost doubles with context: fitted, and the architecture's prior the fit leans on
    fitted = f"every {m.per_token_s / m.depth_s:,.0f} tokens of context" if m.depth_s > 0 else "not seen in the probes"
    prior = (f"; the architecture says every {profile.attention_prior_tokens:,.0f} (the prior the fit leans on)"
             if profile.attention_prior_tokens else "; no architecture prior (the fit has the probes alone)")
    out += [
        f"  model ({m.name}): T(n|k) = {m.overhead_s * 1000:.1f} ms + {m.per_token_s * 1000:.3f} ms·n + "
        f"{m.depth_s * 1e6:.3f} µs·(n·k + n²/2)" + (f" + {m.per_batch_s * 1000:.1f} ms·⌈n/{m.n_batch}⌉" if m.per_batch_s else ""),
        f"  held-out error (leave one probe out): median {profile.error.median_pct:.1f} %, p90 {profile.error.p90_pct:.1f} %",
        f"  attention: the per-token cost doubles {fitted}{prior}",
        f"  first-token overhead {profile.first_token_s * 1000:.1f} ms" + (" (estimated, not measured)" if profile.first_token_estimated else "")
        + (f" + {profile.first_token_per_token_s * 1e6:.1f} ms per 1,000 prompt tokens (tokenizing it)" if profile.first_token_per_token_s else "")
        + f" · {decode_text(profile)}",
        f"  calibrated in {profile.calibration_wall_s:.1f} s ({profile.mode}"
        + (f", time budget {profile.time_budget_s:g} s" if profile.time_budget_s else "")
        + (", provisional: it improves from requests" if profile.provisional else "") + ")",
        "  probed up to {:,} new tokens and {:,} tokens of context; predictions beyond are extrapolated and get a wider margin".format(*profile.probed_range()),
    ]
    return out


def decode_text(profile: Profile) -> str:
    """The stream's speed the profile predicts: at the shortest and longest context measured when it slows with context."""
    model = profile.decode_model()
    if model is None or not model.context_dependent:
        return f"decode {profile.decode_tokens_per_s:.1f} tokens/s" + (f" ({model.note})" if model is not None and model.note else "")
    lo, hi = (round(c) for c in model.context_range)
    return (f"decode {profile.decode_tokens_per_s_at(lo):.1f} tokens/s at {lo:,} tokens of context, "
            f"{profile.decode_tokens_per_s_at(hi):.1f} at {hi:,} (a longer context decodes slower: each token reads the KV cache)")


def _pyplot(needed_by: str) -> Any:
    """matplotlib's pyplot, drawing to files only; an error naming the extra when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidInputError(f"{needed_by} needs matplotlib: pip install 'trimkit[plot]'") from None
    return plt


def _finish(plt: Any, fig: Any, ax: Any, path: str, xlabel: str, ylabel: str, title: str) -> str:
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_profile(profile: Profile, path: str, budget_s: float | None = None) -> str:
    """Measured prefill time against prompt length with the fitted curve (and a budget line), written to ``path``."""
    plt = _pyplot("--plot")
    top = max(s.new_tokens + s.cached_tokens for s in profile.samples)
    xs = list(range(1, top + 1, max(top // 200, 1)))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    cold = [s for s in profile.samples if s.cached_tokens == 0]
    ax.plot([s.new_tokens for s in cold], [s.seconds for s in cold], "o", label="measured (cold prompt)", alpha=0.8)
    ax.plot(xs, [profile.model.prefill_s(x) for x in xs], "-", label=f"fitted cost model ({profile.model.name})")
    for k in sorted({s.cached_tokens for s in profile.samples} - {0}):
        pts = [s for s in profile.samples if s.cached_tokens == k]
        ax.plot([s.new_tokens for s in pts], [s.seconds for s in pts], "s", label=f"measured, after {k:,} cached tokens")
        ax.plot(xs, [profile.model.prefill_s(x, k) for x in xs], ":", alpha=0.6)
    if budget_s:
        ax.axhline(budget_s - profile.first_token_s, color="red", ls="--", label=f"prefill share of a {budget_s:g} s TTFT budget")
    return _finish(plt, fig, ax, path, "prompt tokens evaluated (n)", "prefill time (s)", f"Prefill cost on this host — {profile.key.model.split(':')[0]}")


def read_report_log(path: str) -> list[dict[str, Any]]:
    """The reports of a report log (one JSON object a line; blank lines skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
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


def report_log_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The summary figures of a report log, as lines a person reads."""
    def p90(values: Sequence[float]) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[89] if len(values) > 1 else values[0]

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
        lines.append(f"measured TTFT: median {statistics.median(measured):.3f} s, p90 {p90(measured):.3f} s, max {max(measured):.3f} s")
    if errors:
        lines.append(f"prediction error |predicted − measured| / measured: median {statistics.median(errors):.1f} %, p90 {p90(errors):.1f} %")
    if decode:
        lines.append(f"decode (left untouched): median {statistics.median(decode):.1f} tokens/s")
    return lines


def plot_report_log(rows: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str:
    """Predicted and measured TTFT per request with the budget line, re-plans and misses marked; a PNG at ``path``."""
    plt = _pyplot("trimkit report")
    xs = list(range(1, len(rows) + 1))
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)

    def column(key: str) -> list[float]:
        return [float("nan") if r.get(key) is None else float(r[key]) for r in rows]

    if any(r.get("ttft_budget_s") is not None for r in rows):
        ax.step(xs, column("ttft_budget_s"), where="mid", color="red", ls="--", lw=1.2, label="TTFT budget")
    ax.plot(xs, column("predicted_ttft_s"), "o", mfc="none", color="tab:blue", label="predicted (prompt sent)")
    ax.plot(xs, column("measured_ttft_s"), ".", ms=9, color="tab:green", label="measured")
    misses = [(x, r["measured_ttft_s"]) for x, r in zip(xs, rows) if r.get("budget_met") is False and r.get("measured_ttft_s") is not None]
    if misses:
        ax.plot(*zip(*misses), "x", ms=10, mew=2, color="red", label=f"missed the budget ({len(misses)})")
    for key, style, what in (("replans", {"color": "tab:orange", "alpha": 0.35, "lw": 3}, "re-planned while prefilling"),
                             ("error_type", {"color": "grey", "ls": ":"}, "ended in an error")):
        marked = [x for x, r in zip(xs, rows) if r.get(key)]
        for i, x in enumerate(marked):
            ax.axvline(x, **style, label=f"{what} ({len(marked)})" if i == 0 else None)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    return _finish(plt, fig, ax, path, "request", "time to first token (s)", title or "Predicted vs measured TTFT")


# -- ``trimkit demo``: the two phases, then a RAG chat kept under a TTFT budget; sized to this host -------

#: what the whole demo aims to take on any host: loading the model, calibrating and every request
TIME_TARGET_S = 150.0
#: the share of the time target a calibration may take when no usable profile is stored
CALIBRATION_SHARE = 0.2
#: without ``--budget``, the chat's budget is the predicted TTFT of this share of the untrimmed prompt
BUDGET_SHARE = 0.45
#: generated tokens at most: the long prompt's short answer, the short prompt's long answer, a chat turn's answer
LONG_PROMPT_ANSWER_TOKENS = 24
SHORT_PROMPT_ANSWER_TOKENS = 96
TURN_ANSWER_TOKENS = 32
#: the long prompt holds up to this many corpus documents (fewer where prefill is slow)
LONG_PROMPT_DOCS = 10
SHORT_PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]
#: the documents whose questions the demo asks, in order: questions the default model (greedy) answers right when
#: it reads the answer's chunk; how often a model reads right is benchmarks/rag_answers.py's figure
DEMO_DOCS = ("doc-04", "doc-03", "doc-06", "doc-08", "doc-09")
# a task, not "You are …": the 270M base model tends to repeat such a preamble as its answer
SYSTEM = (
    "Answer the visitor's question about Marrowby in one short sentence, using only the retrieved "
    "context and the conversation. If the context does not hold the answer, say so."
)


class Timeline:
    """The demo's clock: a request may take an equal share of the time left among those still to come."""

    def __init__(self, target_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.target_s = target_s
        self.clock = clock
        self.t0 = clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return max(self.target_s - self.elapsed(), 0.0)

    def share(self, requests_left: int) -> float:
        return self.left() / max(requests_left, 1)

    def step(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)


def predicted_s(profile: Any, max_tokens: int, ttft_s: float | None = 0.0) -> float:
    """A request's predicted TTFT ``ttft_s`` and then ``max_tokens`` of decode at the profile's speed, seconds."""
    tps = profile.decode_tokens_per_s
    return (ttft_s or 0.0) + (max_tokens / tps if tps > 0 else 0.0)


def measured_speed(profile: Any, tps: float | None) -> Any:
    """``profile`` with the decode speed the last request measured (None: its own), even a short answer's, which a live
    profile does not learn from: a host whose calibration only estimated decode would keep every answer short."""
    return attrs.evolve(profile, decode_tokens_per_s=tps) if tps else profile


def answer_tokens(profile: Any, wanted: int, room_s: float) -> int:
    """``wanted``, fewer when their decode would not fit ``room_s`` (at least one: the wait before it is the point)."""
    tps = profile.decode_tokens_per_s
    return wanted if tps <= 0 else int(min(wanted, max(room_s * tps, 1)))


#: the JSON labels of the demo's three requests without a budget
UNBUDGETED_LABELS = ("long prompt, short answer", "short prompt, long answer", "untrimmed")


def sized_request(i: int, trimmer: Any, profile: Any, corpus: Sequence[dict[str, Any]], rag: Any, bound_s: float) -> tuple[Any, int, str]:
    """The demo's request ``i`` without a budget (0: the longest prompt of up to :data:`LONG_PROMPT_DOCS` documents whose
    TTFT and short answer fit ``bound_s``, one if none fits; 1: a short prompt, long answer; 2: ``rag``), sized with
    ``profile``: ``(prepared, max_tokens, heading)``."""
    if i == 2:
        return rag, answer_tokens(profile, TURN_ANSWER_TOKENS, bound_s / 2), "untrimmed"
    if i == 1:
        prepared = trimmer.prepare(SHORT_PROMPT)
        max_tokens = answer_tokens(profile, SHORT_PROMPT_ANSWER_TOKENS, bound_s - (prepared.predicted_ttft_s or 0.0))
        return prepared, max_tokens, f"short prompt, long answer (up to {max_tokens} tokens)"
    max_tokens = answer_tokens(profile, LONG_PROMPT_ANSWER_TOKENS, bound_s / 2)
    for docs in range(min(LONG_PROMPT_DOCS, len(corpus)), 0, -1):
        text = "\n\n".join(d["text"] for d in corpus[:docs])
        prepared = trimmer.prepare([{"role": "user", "content": text + "\n\nIn one sentence: what is this text about?"}])
        if docs == 1 or predicted_s(profile, max_tokens, prepared.predicted_ttft_s) <= bound_s:
            break
    return prepared, max_tokens, f"long prompt ({docs} document{'s' if docs > 1 else ''}), short answer"


def turn_budget(profile: Any, untrimmed: int, minimal_ttft_s: float, bound_s: float, share: float, max_tokens: int) -> tuple[float, str]:
    """The chat's budget without ``--budget``: the predicted TTFT of ``share`` of the untrimmed prompt, capped so a turn
    fits ``bound_s``, never under ``minimal_ttft_s`` (system and question alone). ``(budget, how it was derived)``."""
    share_tokens = max(int(untrimmed * share), 1)
    budget = profile.predict_ttft_s(share_tokens, 0)
    derived = (f"  budget {budget:.2f} s: the profile's predicted TTFT for {share:.0%} of the untrimmed "
               f"prompt ({share_tokens:,} of {untrimmed:,} tokens, nothing cached) on this host")
    cap = bound_s - predicted_s(profile, max_tokens)
    if budget > cap:
        budget = max(cap, minimal_ttft_s)
        derived += f",\n  capped at {budget:.2f} s so a turn (TTFT + {max_tokens} tokens of decode) fits its {bound_s:.1f} s share of the time left"
    return budget, derived


def forecast(plain: Any, corpus: Sequence[dict[str, Any]], rag: Any, minimal_ttft_s: float, left_s: float, turns: int,
             budget_s: float | None, budget_share: float) -> tuple[float, int]:
    """What the demo's requests are predicted to take in all, sized as :func:`run_demo` sizes them: ``(seconds, requests that fit)``."""
    n, total, ran, profile = 3 + turns, 0.0, 0, plain.profile
    for i in range(n):
        bound = left_s / (n - i)
        if i < 3:
            prepared, max_tokens, _ = sized_request(i, plain, profile, corpus, rag, bound)
            ttft_s = prepared.predicted_ttft_s
        elif i == 3:  # the turns' answer length and budget are set once, from the first turn's share (then trimmed to it)
            max_tokens = answer_tokens(profile, TURN_ANSWER_TOKENS, bound / 2)
            if budget_s is None:
                budget_s, _ = turn_budget(profile, len(rag.prompt_tokens), minimal_ttft_s, bound, budget_share, max_tokens)
            ttft_s = min(budget_s, rag.predicted_ttft_s or 0.0)
        predicted = predicted_s(profile, max_tokens, ttft_s)
        if predicted <= bound:
            total, ran, left_s = total + predicted, ran + 1, left_s - predicted
    return total, ran


def _data_lines(name: str) -> list[dict[str, Any]]:
    text = resources.files("trimkit").joinpath(f"data/{name}").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_corpus() -> list[dict[str, Any]]:
    """The demo corpus: 40 short documents about the fictional town of Marrowby."""
    return _data_lines("corpus.jsonl")


def load_history() -> list[dict[str, str]]:
    """A 30-message demo conversation (user/assistant alternating)."""
    return _data_lines("history.jsonl")


def load_questions() -> list[dict[str, str]]:
    """One question per corpus document, with its answer and document id."""
    return _data_lines("questions.jsonl")


def demo_questions(turns: int) -> list[dict[str, str]]:
    """The questions of :data:`DEMO_DOCS`, then the corpus's others, for the untrimmed request and ``turns`` turns."""
    every = load_questions()
    chosen = [q for d in DEMO_DOCS for q in every if q["doc_id"] == d]
    return (chosen + [q for q in every if q["doc_id"] not in DEMO_DOCS])[: turns + 1]


_PLAIN = str.maketrans("\u2010\u2011\u2012\u2013\u2014\u2018\u2019\u201c\u201d", "-----''\"\"")


def _normalised(text: str) -> str:
    """Lower case, dashes and quotes made plain, punctuation off, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]", " ", unicodedata.normalize("NFKC", text).casefold().translate(_PLAIN)).split())


def answer_is_right(answer: str | None, expected: str) -> bool:
    """True when ``answer`` contains ``expected`` as whole words, both normalised: ``"It was lit in 1863."`` answers
    ``"1863"``, ``"18630"`` does not. An empty or missing answer is wrong."""
    want = _normalised(expected)
    return bool(answer and want) and f" {want} " in f" {_normalised(answer or '')} "


def answer_chunk_status(plan: Any, chunks: Sequence[Any], doc_id: str) -> str:
    """``"kept whole"``, ``"kept as an excerpt"`` (same id, shorter text), ``"dropped"`` or ``"not retrieved"``:
    what a plan (None: nothing planned) did with the chunk that holds the answer."""
    original = {c.id: c.text for c in chunks}
    if doc_id not in original:
        return "not retrieved"
    if plan is None:
        return "kept whole"
    kept = [c.text for c in plan.kept_chunks if c.id == doc_id]
    return "dropped" if not kept else "kept whole" if kept[0] == original[doc_id] else "kept as an excerpt"


def _calibrated(target: Any, quick: bool, tl: Timeline, clock: Callable[[], float]) -> tuple[Any, str]:
    """The stored profile (quick or full) if there is one, else a calibration within :data:`CALIBRATION_SHARE` of the target."""
    stored = load_profile(as_backend(target).profile_key())
    if stored is not None and not stored.provisional:
        return stored, f"reused the profile stored on {time.strftime('%Y-%m-%d %H:%M', time.localtime(stored.created_at))}"
    mode = "quick" if quick else "full"
    budget = min(QUICK_BUDGET_S if quick else FULL_BUDGET_S, CALIBRATION_SHARE * tl.target_s)
    tl.step(f"calibrating ({mode}, at most {budget:.0f} s: a first short probe measures this host's speed, the "
            "other probes are sized to the time left; stored for next time)")
    t0 = clock()
    with contextlib.closing(ProgressBar("calibrating", enabled=True)) as bar:
        profile = calibrate(target, mode=mode, time_budget_s=budget, progress=bar, clock=clock)
    return profile, f"measured now in {clock() - t0:.1f} s"


def _rule(title: str) -> None:
    print(f"\n== {title} " + "=" * max(4, 76 - len(title)), flush=True)


def run_demo(*, model: str | None = None, budget_s: float | None = None, budget_share: float = BUDGET_SHARE, turns: int = 3, n_ctx: int = 8192,
             quick: bool = False, json_path: str | None = None, time_target_s: float = TIME_TARGET_S, llm: Any = None,
             clock: Callable[[], float] = time.perf_counter, report_log: Any = None) -> int:
    """Run the demo in about ``time_target_s`` on any host: requests sized from the profile to the time left (one
    predicted not to fit is not run). ``budget_s`` None: the predicted TTFT of ``budget_share`` of the untrimmed prompt.
    ``llm``: an opened model or a backend to use instead of ``model`` (tests pass a FakeBackend and its ``clock``)."""
    tl = Timeline(time_target_s, clock)
    with contextlib.suppress(AttributeError, ValueError):  # a line per step, also when stdout is a pipe (make demo | tee)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    requests = 3 + turns
    print(f"trimkit demo: sized to finish within about {time_target_s:.0f} s on this host — load the model, calibrate\n"
          f"(at most {CALIBRATION_SHARE * time_target_s:.0f} s; none if a profile is stored), then up to {requests} requests, "
          "each sized from the profile\nto its share of the time left. A request predicted not to fit is not run; its "
          "prediction is printed.", flush=True)
    reports: list[dict[str, Any]] = []
    measured_tps: list[float] = []

    def speed(trimmer: Any) -> Any:
        return measured_speed(trimmer.profile, measured_tps[-1] if measured_tps else None)

    def send(trimmer: Any, prepared: Any, params: dict[str, Any], bound: float, part: str, label: str, **extra: Any) -> tuple[str | None, Any]:
        """Send ``prepared``, printing the answer as it streams, unless predicted over ``bound``; keep its report."""
        nonlocal requests
        requests -= 1
        predicted = predicted_s(speed(trimmer), params["max_tokens"], prepared.predicted_ttft_s)
        entry: dict[str, Any] = {"part": part, "label": label, "report": None, **extra}
        reports.append(entry)
        what = (f"{len(prepared.prompt_tokens):,} prompt tokens" + (f" ({prepared.cached_tokens:,} cached)" if prepared.cached_tokens else "")
                + f": predicted TTFT {prepared.predicted_ttft_s or 0.0:.1f} s + up to {params['max_tokens']} tokens of decode = {predicted:.1f} s")
        if predicted > bound:
            tl.step(f"not run — {what}, over the {bound:.1f} s this request may take (its share of the {tl.left():.0f} s left)")
            entry["not_run"] = {"predicted_s": predicted, "bound_s": bound}
            return None, None
        tl.step(f"running — {what}")
        stream = trimmer.execute(prepared, params)
        parts: list[str] = []
        print("   answer: ", end="", flush=True)
        for text in filter(None, map(chunk_content, stream)):
            text = text if parts else text.lstrip()
            parts.append(text)
            print(text.replace("\n", "\n           "), end="", flush=True)
        print(flush=True)
        print(stream.report)
        measured_tps.extend(filter(None, [stream.report.decode_tokens_per_s]))
        entry["report"] = stream.report.to_dict()
        return "".join(parts), stream.report

    if llm is None:
        tl.step(f"loading the model ({model or 'the embedded SmolLM2-135M-Instruct'}, n_ctx {n_ctx:,})")
        llm = open_llama(model, n_ctx)
    _rule("1. Calibration: what prefill costs on this machine")
    profile, how = _calibrated(llm, quick, tl, clock)
    print("\n".join(profile_lines(profile)))
    print(f"  ({how})")

    corpus, history, questions = load_corpus(), load_history(), demo_questions(turns)
    plain = wrap(llm, profile=profile, report_log=report_log)  # no budget: measure and report only
    chunk_texts = [Chunk(text=d["text"], id=d["id"]) for d in corpus]

    def rag_request(question: str) -> tuple[list[Any], list[Any]]:
        # a retriever would hand over its top 12; the library's own BM25 stands in for it
        return [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}], list(rank_chunks(chunk_texts, question)[:12])

    q0 = questions[0]["question"]
    rag = plain.prepare(*rag_request(q0))
    minimal_ttft_s = plain.prepare([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q0}]).predicted_ttft_s or 0.0
    est, fit = forecast(plain, corpus, rag, minimal_ttft_s, tl.left(), turns, budget_s, budget_share)
    tl.step(f"estimate: {fit} of {requests} requests fit, predicted {est:.0f} s in all → about {tl.elapsed() + est:.0f} s for the "
            f"demo (target {time_target_s:.0f} s; on this host TTFT {profile.predict_ttft_s(1000, 0):.2f} s for 1,000 prompt "
            f"tokens, decode {profile.decode_tokens_per_s:.1f} tokens/s)")

    _rule("2. The two phases: a long prompt and a short one, no budget")
    for i, label in enumerate(UNBUDGETED_LABELS):
        if i == 2:
            _rule(f"3. A RAG chat: {len(history)} earlier messages + 12 retrieved chunks")
            rag = plain.prepare(*rag_request(q0))  # again: what is cached now is not what was cached then
        bound = tl.share(requests)
        prepared, max_tokens, heading = sized_request(i, plain, speed(plain), corpus, rag, bound)
        print(f"\n-- {heading}")
        send(plain, prepared, {"max_tokens": max_tokens, "temperature": 0.2 if i == 2 else 0.7}, bound, "rag chat" if i == 2 else "two phases", label)
        if i == 1:
            print("\n  The long prompt waits before its first token (prefill grows with the prompt); the short one\n"
                  "  starts at once. Its stream is faster too (each generated token reads the KV cache of the\n"
                  "  prompt: compare the two decode lines), but the wait is what grows most. trimkit aims at the wait.")

    untrimmed = len(plain.prepare(*rag_request(questions[1]["question"] if len(questions) > 1 else q0)).prompt_tokens)
    bound = tl.share(requests)
    turn_params: dict[str, Any] = {"max_tokens": answer_tokens(speed(plain), TURN_ANSWER_TOKENS, bound / 2), "temperature": 0.0}  # greedy: reproducible
    if budget_s is None:
        budget_s, derived = turn_budget(speed(plain), untrimmed, minimal_ttft_s, bound, budget_share, turn_params["max_tokens"])
    else:
        derived = (f"  budget {budget_s:g} s (--budget); the untrimmed prompt is {untrimmed:,} tokens, "
                   f"predicted {plain.profile.predict_ttft_s(untrimmed, 0):.2f} s with nothing cached")
    _rule(f"4. The same chat under a TTFT budget of {budget_s:.2f} s, turn after turn")
    print(derived)
    chat = wrap(llm, ttft_budget_s=budget_s, profile=plain.profile, report_log=report_log)
    convo = [{"role": "system", "content": SYSTEM}, *history]
    kept_answer = right = 0
    for turn, q in enumerate(questions[1 : turns + 1], start=1):
        convo.append({"role": "user", "content": q["question"]})
        _, chunks = rag_request(q["question"])
        prepared = chat.prepare(convo, chunks, turn_params)
        status = answer_chunk_status(prepared.plan, chunks, q["doc_id"])
        kept_answer += status.startswith("kept")
        kept_n = len(prepared.plan.kept_chunks) if prepared.plan is not None else len(chunks)
        print(f"\n-- turn {turn}: {q['question']}")
        print(f"   answer chunk {q['doc_id']}: {status} ({kept_n} of {len(chunks)} chunks kept)")
        bound = tl.share(requests)
        answer, rep = send(chat, prepared, turn_params, bound, "budget", f"turn {turn}", answer_chunk={"id": q["doc_id"], "status": status})
        is_right = answer_is_right(answer, q["answer"])
        reports[-1].update(answer=answer, expected=q["answer"], right=is_right)
        if rep is None:
            convo.pop()
            continue
        right += is_right
        print(f"   expected {q['answer']!r}: {'right' if is_right else 'WRONG'}")
        convo.append({"role": "assistant", "content": answer or ""})
        chat.idle()
    met = [r["report"]["budget_met"] for r in reports if r["part"] == "budget" and r["report"] is not None]
    print(f"\n  budget met on {sum(bool(m) for m in met)} of {len(met)} turns run; answered right on {right} of {len(met)}; the "
          f"answer's chunk was kept on {kept_answer} of {turns} turns; decode parameters were never touched (a faster stream is the shorter "
          "context's side effect, stated as such in the reports).")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(reports, fh, indent=1)
        print(f"  reports written to {json_path}")
    tl.step(f"done in {tl.elapsed():.0f} s (target {time_target_s:.0f} s; the requests were predicted at {est:.0f} s)")
    return 0
