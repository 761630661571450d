"""The ``trimkit`` command line: calibrate, diagnose, plan, demo, report.

Every sub-command's ``--help`` is its documentation. Errors reach you as one line on stderr and
a non-zero exit status (2 for bad input, 1 for engine failures), never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trimkit import __version__
from trimkit._calibration import FULL_BUDGET_S, MICRO_BUDGET_S, QUICK_BUDGET_S, calibrate, load_profile, mode_for_budget
from trimkit._console import ProgressBar, open_llama, plot_profile, plot_report_log, profile_lines, read_report_log, report_log_lines
from trimkit._demo import TIME_TARGET_S, run_demo
from trimkit.backends.base import Backend
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.errors import InvalidInputError, InvalidNumberError, TrimkitError, budget
from trimkit.messages import coerce_chunks, validate_messages
from trimkit.planning.planner import plan as make_plan
from trimkit.planning.profile import Profile
from trimkit.prepared import place_chunks
from trimkit.report import DEFAULT_WAIT_THRESHOLD_S, READING_SPEED_TOKENS_PER_S, diagnose
from trimkit.wrapper import wrap

__all__ = ["main", "build_parser", "open_llama", "read_request", "profile_lines"]

EMBEDDED = "the embedded SmolLM2-135M-Instruct; \"gemma\" names the embedded Gemma-3-270M"
#: the share of ``trimkit calibrate``'s time budget left for printing and unloading the model
EXIT_SHARE = 0.05


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0: {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def process_age_s() -> float:
    """Seconds since this process started, as the OS tells it (Linux ``/proc``); 0.0 elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime_s - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start time in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def _calibration_mode(args: argparse.Namespace) -> tuple[str, float]:
    """The mode and the wall-time budget of ``trimkit calibrate`` (checked before the model loads)."""
    if args.time_budget is not None:
        budget_s = budget(args.time_budget, "--time-budget")
        mode = "micro" if args.micro else "quick" if args.quick else mode_for_budget(budget_s)
        return mode, budget_s
    mode = "micro" if args.micro else "quick" if args.quick else "full"
    return mode, {"micro": MICRO_BUDGET_S, "quick": QUICK_BUDGET_S, "full": FULL_BUDGET_S}[mode]


def _cmd_calibrate(args: argparse.Namespace) -> int:
    mode, budget_s = _calibration_mode(args)
    started = time.perf_counter() - process_age_s()  # the budget is the whole command's: start-up and model load too
    if args.url:
        if not args.model:
            raise InvalidInputError("--url needs --model NAME (the model name the server serves)")
        target: Any = OpenAIHTTPBackend(args.url, model=args.model, n_ctx=args.n_ctx)
    else:
        target = open_llama(args.model, args.n_ctx or 8192)
    bar = ProgressBar("calibrating", enabled=not args.json and sys.stderr.isatty() or args.progress)
    left = budget_s * (1 - EXIT_SHARE) - (time.perf_counter() - started)
    asked_at = time.time()
    try:
        # never less than a sliver: calibrate still takes its minimum (and warns) on a host too slow for the budget
        profile = calibrate(target, mode=mode, time_budget_s=max(left, 0.01 * budget_s), recalibrate=args.recalibrate, progress=bar)
    finally:
        bar.close()
    took = time.perf_counter() - started
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
    else:
        print("\n".join(profile_lines(profile)))
        probed_new, probed_ctx = profile.probed_range()
        print(f"  mode {profile.mode}{' (provisional)' if profile.provisional else ''}: probed up to {probed_new:,} new tokens "
              f"and {probed_ctx:,} tokens of context (predictions beyond are extrapolated)"
              + ("; first-token overhead estimated, not measured" if profile.first_token_estimated else ""))
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
        llm = open_llama(args.model, args.n_ctx)
        # no budget for the wrapper: the prompt is measured as given, then judged against --ttft-budget
        chat = wrap(llm, tokens_per_s_target=args.tokens_per_s_target)
        chat.create_chat_completion(messages=[{"role": "user", "content": text}], max_tokens=args.output_tokens)
        report = chat.last_report
        print(report)
        ttft, prompt_tokens = report.measured_ttft_s, report.prompt_tokens
        tps = report.decode_tokens_per_s or chat.profile.decode_tokens_per_s_at(prompt_tokens, args.output_tokens) or chat.profile.decode_tokens_per_s
    else:
        missing = [n for n in ("ttft", "tokens_per_s") if getattr(args, n) is None]
        if missing:
            raise InvalidNumberError(
                "diagnose needs either --ttft S --tokens-per-s N [--prompt-tokens N] or --prompt-file F [--model PATH]"
            )
        ttft, tps, prompt_tokens = args.ttft, args.tokens_per_s, args.prompt_tokens
    d = diagnose(ttft, tps, prompt_tokens, args.output_tokens, ttft_budget_s=args.ttft_budget, tokens_per_s_target=args.tokens_per_s_target,
                 reading_speed_tokens_per_s=args.reading_speed, wait_threshold_s=args.wait_threshold)
    if args.json:
        print(json.dumps(d.to_dict(), indent=1))
    else:
        print(d)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(model=args.model, budget_s=args.budget, budget_share=args.budget_share, turns=args.turns, n_ctx=args.n_ctx,
                    quick=args.quick, json_path=args.json, time_target_s=args.time_target,
                    report_log=args.report_log)


def _share(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a share in (0, 1]: {text!r}")
    return value


def read_request(path: str) -> tuple[list[Any], tuple[Any, ...], Any]:
    """``(messages, chunks, tools)`` from a JSON request file, checked; InvalidInputError otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read the request file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
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
    messages = data["messages"]
    try:
        validate_messages(messages)
        chunks = coerce_chunks(data.get("rag_chunks"))
    except InvalidInputError as exc:
        raise InvalidInputError(f"{path}: {exc}") from None
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidInputError(f"{path}: \"tools\" must be a list")
    return messages, chunks, tools


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
    print("trimkit: no stored calibration profile for this model and settings: calibrating quickly (stored for next time)…",
          file=sys.stderr)
    return calibrate(backend, mode="quick"), "a quick calibration measured now (no stored profile)"


def _index_ranges(indices: Sequence[int]) -> str:
    """``1, 2, 3, 7`` as ``1–3, 7``: a plan that drops 4,000 turns prints one short line."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs)


def _cmd_plan(args: argparse.Namespace) -> int:
    messages, chunks, tools = read_request(args.request)  # bad input fails before the model loads
    llm = open_llama(args.model, args.n_ctx)  # names the extra when llama-cpp-python is missing
    from trimkit.backends.llama import LlamaBackend

    backend = LlamaBackend(llm)
    profile, source = _plan_profile(args, backend)
    tok = backend.tokenizer
    as_is = place_chunks(messages, chunks) if chunks else messages
    # counted per message (the counts the planner reuses): a many-megabyte request is never
    # tokenized whole a second time just to be reported
    untrimmed_tokens = tok.segment_counts(as_is, tools).total
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
        out.update(
            request=args.request,
            budget_source=how,
            profile_source=source,
            untrimmed_prompt_tokens=untrimmed_tokens,
            untrimmed_predicted_ttft_s=untrimmed_s,
            prompt_tokens_exact=sent_tokens,
            predicted_ttft_exact_s=sent_s,
            template_dropped_messages=list(dropped_by_template),
        )
        print(json.dumps(out, indent=1))
        return 0
    print(f"request {args.request}: {len(messages)} messages, {len(chunks)} chunks, {untrimmed_tokens:,} prompt tokens untrimmed")
    print(f"budget {budget:.3f} s from {how}; profile: {source}")
    print(p)
    kept = ", ".join(str(c.id) for c in p.kept_chunks) or "none"
    dropped = ", ".join(str(c.id) for c in p.dropped_chunks) or "none"
    removed = _index_ranges(p.removed_message_indices) or "none"
    print(f"  chunks kept ({len(p.kept_chunks)} of {len(chunks)}): {kept}")
    print(f"  chunks dropped: {dropped}")
    print(f"  messages removed (indices): {removed}")
    if p.summarized_message_indices:
        print(f"  messages summarized (indices): {_index_ranges(p.summarized_message_indices)}")
    print(f"  prompt to send: {sent_tokens:,} tokens, predicted TTFT {sent_s:.3f} s with nothing cached "
          f"(untrimmed: {untrimmed_s:.3f} s) — nothing was generated")
    if dropped_by_template:
        print(f"  warning: the chat template drops message(s) {', '.join(map(str, dropped_by_template))}: the model would never see them")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    rows = read_report_log(args.log)
    for line in report_log_lines(rows):
        print(line)
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

    c = sub.add_parser("calibrate", help="measure prefill cost on this host and print the profile",
                       description="Measure prefill time at a spread of prompt lengths and depths within a time budget "
                       "(a first short probe measures this host's speed, the rest is sized to the time left), fit the cost "
                       "model, store the profile in the user cache (reused next time unless --recalibrate) and print it.")
    c.add_argument("--model", help=f"GGUF model path or embedded model name (default: {EMBEDDED}); with --url, the served model's name")
    c.add_argument("--url", help="calibrate an OpenAI-compatible server instead, e.g. http://127.0.0.1:8080/v1")
    c.add_argument("--n-ctx", type=_positive_int, default=None, help="context window (default 8192; with --url: the server's, else 4096)")
    cm = c.add_mutually_exclusive_group()
    cm.add_argument("--quick", action="store_true", help=f"the quick schedule, within {QUICK_BUDGET_S:g} s: shorter probes, less accurate for long prompts")
    cm.add_argument("--micro", action="store_true", help=f"the micro schedule, within {MICRO_BUDGET_S:g} s: a provisional profile (what wrap() starts from)")
    c.add_argument("--time-budget", type=float, metavar="S", default=None,
                   help=f"finish within S seconds, start-up and model load included (default {FULL_BUDGET_S:g}; "
                   f"{QUICK_BUDGET_S:g} with --quick, {MICRO_BUDGET_S:g} with --micro); without --quick/--micro the "
                   "mode is the most thorough one S affords")
    c.add_argument("--recalibrate", action="store_true", help="measure again even if a stored profile matches")
    c.add_argument("--json", action="store_true", help="print the profile as JSON")
    c.add_argument("--plot", metavar="FILE.png", help="draw measured prefill time vs prompt length with the fitted curve")
    c.add_argument("--budget", type=_positive_float, help="with --plot: draw a TTFT budget line (seconds)")
    c.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    c.set_defaults(func=_cmd_calibrate)

    d = sub.add_parser("diagnose", help="name the slow phase (the wait, the stream, both or neither) and the cure that fits",
                       description="Give measured numbers (--ttft, --tokens-per-s, --prompt-tokens) or run one prompt "
                       "(--prompt-file, --model) and learn which phase is slow — each judged against its own standard: "
                       "the wait against --ttft-budget (default: --wait-threshold, 1 s), the stream against "
                       "--tokens-per-s-target (default: --reading-speed, 7 tokens/s) — and what helps it.")
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
    d.add_argument("--model", help=f"GGUF model path or embedded model name for --prompt-file (default: {EMBEDDED})")
    d.add_argument("--n-ctx", type=_positive_int, default=8192, help="context window for --prompt-file (default 8192)")
    d.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    d.set_defaults(func=_cmd_diagnose)

    m = sub.add_parser("demo", help="see the two phases and a TTFT budget held, on the embedded model",
                       description="Calibrates (or reuses the stored profile), shows a long and a short prompt "
                       "(the wait vs the stream), then a multi-turn RAG chat kept under a TTFT budget set from this "
                       "host's profile, saying each turn whether the chunk that holds the answer was kept. Sized to "
                       "--time-target from this host's measured speed: each request may take its share of the time "
                       "left; one predicted to take longer is not run, its prediction is printed.")
    m.add_argument("--model", help=f"GGUF model path or embedded model name (default: {EMBEDDED})")
    mb = m.add_mutually_exclusive_group()
    mb.add_argument("--budget", type=_positive_float, default=None,
                    help="TTFT budget in seconds for the chat part (default: derived from this host's profile, see --budget-share)")
    mb.add_argument("--budget-share", type=_share, default=0.45,
                    help="without --budget: the budget is the predicted TTFT of this share of the untrimmed prompt (default 0.45)")
    m.add_argument("--turns", type=_positive_int, default=3, help="chat turns under the budget (default 3)")
    m.add_argument("--n-ctx", type=_positive_int, default=8192, help="context window (default 8192)")
    m.add_argument("--quick", action="store_true", help="quick calibration (at most 10 s) instead of full (at most 30 s); "
                   "either runs once (it is stored), and within a fifth of --time-target")
    m.add_argument("--time-target", type=_positive_float, default=TIME_TARGET_S, metavar="S",
                   help=f"what the whole demo aims to take on this host, in seconds (default {TIME_TARGET_S:g})")
    m.add_argument("--json", metavar="FILE", help="also write every report as JSON to FILE")
    m.add_argument("--report-log", metavar="FILE", help="append every report as a JSON line to FILE (draw it: trimkit report FILE)")
    m.set_defaults(func=_cmd_demo)

    pl = sub.add_parser("plan", help="show what a TTFT budget would keep and drop from a request, without generating",
                        description="Read a request (a JSON file: {\"messages\": [...], \"rag_chunks\": [...], \"tools\": [...]}), "
                        "plan it under a TTFT budget with this host's calibration profile and print what would be kept, "
                        "dropped and summarized and the predicted TTFT. Loads the model for its tokenizer and chat "
                        "template; generates nothing. Without a stored profile it calibrates quickly first.")
    pl.add_argument("request", metavar="REQUEST.json", help="the request: messages, optional rag_chunks (strings or {text, id, score}), optional tools")
    budget = pl.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", type=_positive_float, help="TTFT budget in seconds")
    budget.add_argument("--budget-share", type=_share, help="budget as a share (0–1] of the request's predicted untrimmed TTFT")
    pl.add_argument("--model", help=f"GGUF model path or embedded model name (default: {EMBEDDED})")
    pl.add_argument("--n-ctx", type=_positive_int, default=8192, help="context window (default 8192; part of the profile key)")
    pl.add_argument("--profile", metavar="PATH", help="a profile JSON file (trimkit calibrate --json) instead of the stored one")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=_cmd_plan)

    rp = sub.add_parser("report", help="summarize a report log and plot predicted vs measured TTFT per request",
                        description="Read a report log (wrap(..., report_log=FILE): one report a line), print the summary "
                                    "figures and draw predicted vs measured TTFT per request, with the budget line and the "
                                    "re-plans and misses marked, to a PNG (needs matplotlib: pip install 'trimkit[plot]').")
    rp.add_argument("log", help="the report log (JSON lines)")
    rp.add_argument("--plot", metavar="PNG", help="where to write the plot (default: the log's name with .png)")
    rp.add_argument("--no-plot", action="store_true", help="print the figures only")
    rp.set_defaults(func=_cmd_report)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
