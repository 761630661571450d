"""A long-running service, compressed: requests with long retrieved chunks through ``wrap_url``, and
planning time against the number of chunks (issue 34). Cheap by default (about a minute); raise
``--requests`` for a real soak (the issue's check: ``--requests 2000 --chunk-kb 20``).

Two parts:

- **requests**: ``--requests`` chat requests through :func:`trimkit.wrap_url` to an in-memory
  OpenAI-compatible server (:class:`trimkit.testing.FakeOpenAIServer` behind ``httpx.MockTransport``:
  no sockets, no model), each with ``--chunks`` retrieved chunks of ``--chunk-kb`` KB of text never
  seen before (what makes entry-bounded caches grow), one in four streamed and abandoned after its
  first chunk. Every ``--every`` requests a line: requests done, RSS (MB), open fds, threads,
  the last report's planning ms. Flat memory is the claim: compare the first and the last lines.
- **planning**: :func:`trimkit.plan` of one question with 1k, 2k, 4k, 8k, 16k short chunks
  (``--plan-sizes``), nothing cached: seconds each (near-linear is the claim).

``--plan-only`` / ``--requests-only`` run one part. ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

import trimkit  # noqa: E402
from trimkit.planning.profile import Profile  # noqa: E402
from trimkit.planning.tokens import PromptTokenizer  # noqa: E402
from trimkit.testing import FakeOpenAIServer  # noqa: E402

WORDS = "harbour pier lamp storm ferry market gull rope tide anchor salt lane north south east west rebuilt keeper light".split()


def rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def text_of(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def _profile() -> Profile:
    """A hand-made profile (no calibration: there is no model): the test suite's."""
    from tests._core_helpers import make_profile

    return make_profile()


def soak(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    server = FakeOpenAIServer(n_ctx=1 << 20, reply="The pier was rebuilt in 1899.")
    http = httpx.Client(transport=server.transport)
    chat = trimkit.wrap_url("http://soak.invalid/v1", model=server.model, profile=_profile(), ttft_budget_s=1.0, summarizer=None,
                            http_client=http, n_ctx=1 << 20)
    rows = []
    t0 = time.perf_counter()
    try:
        for i in range(1, args.requests + 1):
            chunks = [text_of(rng, args.chunk_kb * 1024) for _ in range(args.chunks)]
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"When was pier {i} rebuilt?"}]
            if i % 4 == 0:
                for _ in chat.chat.completions.create(messages=messages, rag_chunks=chunks, max_tokens=8, stream=True):
                    break  # abandoned: must be freed at once
            else:
                chat.chat.completions.create(messages=messages, rag_chunks=chunks, max_tokens=8)
            server.requests.clear()
            if i % args.every == 0 or i == args.requests:
                report = chat.last_report
                row = {"requests": i, "rss_mb": round(rss_mb(), 1), "fds": open_fds(), "threads": threading.active_count(),
                       "planning_ms": round(1000 * report.planning_s, 2) if report and report.planning_s else None,
                       "elapsed_s": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        chat.close()
        http.close()
    return rows


def planning(args: argparse.Namespace) -> list[dict]:
    rows = []
    profile = _profile()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "When was pier 42 rebuilt?"}]
    for n in args.plan_sizes:
        chunks = [trimkit.Chunk(text=f"Record {i}: pier {i} of Marrowby was rebuilt in {1800 + i % 200} after a storm.", id=f"c{i}")
                  for i in range(n)]
        tok = PromptTokenizer.estimate()  # nothing cached
        t = time.perf_counter()
        p = trimkit.plan(messages, rag_chunks=chunks, ttft_budget_s=0.5, profile=profile, tokenizer=tok)
        row = {"chunks": n, "plan_s": round(time.perf_counter() - t, 3), "kept": len(p.kept_chunks), "texts_tokenized": tok.count_calls}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=4, help="retrieved chunks per request")
    ap.add_argument("--chunk-kb", type=int, default=20)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--plan-sizes", type=int, nargs="+", default=[1000, 2000, 4000, 8000, 16000])
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--requests-only", action="store_true")
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out: dict = {}
    if not args.plan_only:
        out["requests"] = soak(args)
    if not args.requests_only:
        out["planning"] = planning(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
