"""Every Python example in README.md and docs/*.md runs — and so does the package docstring's quick start.

Each fenced ```python block carries a marker on the line before it saying how it runs:

- ``<!-- docs-test: real -->`` — on the real embedded model (``trimkit.default_llama()``);
- ``<!-- docs-test: fake -->`` — with ``llm`` bound to a :class:`trimkit.testing.FakeBackend`
  (for examples about planning and reports, where a real model adds minutes and nothing else);
- ``<!-- docs-test: server -->`` — against an OpenAI-compatible server on loopback
  (:class:`trimkit.testing.FakeOpenAIServer` behind a real HTTP socket): the example's
  ``http://127.0.0.1:8080/v1`` is pointed at it, and a stored profile for that endpoint exists
  (the fake server has no ``/v1/completions`` to calibrate against). Examples that import
  ``openai`` are skipped when it is not installed (it is not a trimkit dependency);
- ``<!-- docs-test: skip: <reason> -->`` — not run, with the reason.

The blocks of one file run in order in one namespace (a later example uses the ``chat`` an
earlier one built). Names the prose refers to without defining — ``messages``, ``msgs``,
``chunks`` — are bound to a short conversation and two chunks before the first block. A block
without a marker fails the test, so every new example is a conscious choice.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import http.server
import importlib
import inspect
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

import trimkit
from trimkit._calibration import save_profile
from trimkit.backends.base import is_llama
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.testing import FakeBackend, FakeOpenAIServer

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-test:\s*(real|fake|server|skip)\s*(?::\s*(.*?))?\s*-->")
EXAMPLE_URL = "http://127.0.0.1:8080/v1"
#: a file of real-model examples loads the model and calibrates once (quick), then runs a few short requests
REAL_TIMEOUT_S = 600
SKIPPED_RC = 77


@attrs.frozen
class Example:
    path: Path
    line: int
    code: str
    mode: str  # real | fake | server | skip | "" (no marker)
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples_in(path: Path) -> list[Example]:
    """The ```python blocks of a markdown file, with the marker on the nearest non-blank line above."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = [line for line in text[: m.start()].splitlines() if line.strip()]
        marker = MARKER.search(before[-1]) if before else None
        line = text.count("\n", 0, m.start()) + 1
        mode, reason = (marker.group(1), marker.group(2) or "") if marker else ("", "")
        out.append(Example(path, line, m.group(1), mode, reason))
    return out


def docstring_example() -> Example:
    """The package docstring's quick start: the ``::`` block under "Quick start"."""
    doc = trimkit.__doc__ or ""
    head, _, rest = doc.partition("::\n")
    assert "Quick start" in head, "the package docstring should open with its quick start"
    block = []
    for line in rest.splitlines():
        if line.strip() and not line.startswith("    "):
            break
        block.append(line[4:])
    return Example(ROOT / "trimkit" / "__init__.py", 1, "\n".join(block).strip() + "\n", "real")


# -- what examples may use without defining -------------------------------------------------------------
def given_names() -> dict[str, Any]:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is the lighthouse?"},
        {"role": "assistant", "content": "On the headland north of the harbour."},
        {"role": "user", "content": "When was it first lit?"},
    ]
    chunks = [
        trimkit.Chunk(text="The lighthouse on the headland was first lit in 1887.", id="doc-1", score=0.9),
        "The harbour has moorings for forty boats.",
    ]
    return {"messages": messages, "msgs": messages, "chunks": chunks}


_real_llm: list[Any] = []


def real_llm() -> Any:
    """One embedded model for the session's ``real`` examples that use ``llm`` without opening it."""
    if not _real_llm:
        _real_llm.append(trimkit.default_llama())
    return _real_llm[0]


# -- a loopback OpenAI-compatible server ------------------------------------------------------------------
@contextlib.contextmanager
def loopback(server: FakeOpenAIServer) -> Iterator[str]:
    """Serve ``server`` on a real socket (127.0.0.1, a free port); yields its ``/v1`` base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            request = httpx.Request(self.command, f"http://{self.headers.get('host')}{self.path}", headers=dict(self.headers), content=body)
            response = server(request)
            content = response.read()
            self.send_response(response.status_code)
            self.send_header("content-type", response.headers.get("content-type", "application/json"))
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


def store_profile_for(url: str, model: str) -> None:
    """A stored profile for the endpoint (measured on the fake engine), so wrapping it does not calibrate."""
    with OpenAIHTTPBackend(url, model=model) as backend:
        key = backend.profile_key()
    profile = trimkit.calibrate(FakeBackend(), store=False)
    save_profile(attrs.evolve(profile, key=key))


# -- running ------------------------------------------------------------------------------------------------
def run(example: Example, namespace: dict[str, Any], url: str | None) -> None:
    code = example.code
    if example.mode == "server":
        if re.search(r"\bopenai\.|^\s*import openai", code, re.M):
            pytest.importorskip("openai", reason=f"{example.where} needs the openai package")
        assert url is not None
        code = code.replace(EXAMPLE_URL, url)
    if example.mode == "fake":
        namespace["llm"] = FakeBackend()
    elif example.mode == "real" and not is_llama(namespace.get("llm")):
        namespace["llm"] = real_llm()
    compiled = compile(code, example.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    if compiled.co_flags & inspect.CO_COROUTINE:
        asyncio.run(eval(compiled, namespace))  # noqa: S307 - the project's own examples
    else:
        exec(compiled, namespace)  # noqa: S102 - the project's own examples


def run_all(examples: list[Example]) -> None:
    namespace: dict[str, Any] = {"__name__": "__docs__", **given_names()}
    with contextlib.ExitStack() as stack:
        url = None
        if any(e.mode == "server" for e in examples):
            url = stack.enter_context(loopback(FakeOpenAIServer(model="qwen")))
            store_profile_for(url, "qwen")
        for example in examples:
            if example.mode == "skip":
                continue
            try:
                run(example, namespace, url)
            except pytest.skip.Exception:
                continue
            except Exception as exc:
                raise AssertionError(f"the example at {example.where} ({example.mode}) failed: {type(exc).__name__}: {exc}") from exc


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_example_has_a_marker(path):
    for example in examples_in(path):
        assert example.mode, f"{example.where}: add <!-- docs-test: real|fake|server|skip: reason --> before the block"
        if example.mode == "skip":
            assert len(example.reason) >= 10, f"{example.where}: say why the example is skipped"


def run_isolated(target: str) -> None:
    """Run examples that load the real model in a fresh interpreter (``python -m tests.test_docs
    TARGET``): a crash in llama.cpp fails the test instead of taking pytest down with it, and
    each file starts from a model nobody else has touched."""
    proc = subprocess.run([sys.executable, "-m", "tests.test_docs", target], cwd=ROOT, capture_output=True, text=True,
                          timeout=REAL_TIMEOUT_S, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    if proc.returncode == SKIPPED_RC:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, f"examples of {target} failed (exit status {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"


@pytest.mark.parametrize("path", [p for p in DOC_FILES if examples_in(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_examples_run(path):
    if any(e.mode == "real" for e in examples_in(path)):
        run_isolated(str(path.relative_to(ROOT)))
    else:
        run_all(examples_in(path))


def test_the_package_docstring_quick_start_runs():
    example = docstring_example()
    assert "trimkit.default_llama()" in example.code  # the embedded default model, opened with a template that keeps system prompts
    run_isolated("trimkit")


def main(target: str) -> int:
    """``python -m tests.test_docs FILE.md`` (or ``trimkit`` for the package docstring)."""
    examples = [docstring_example()] if target == "trimkit" else examples_in(ROOT / target)
    try:
        run_all(examples)
    except pytest.skip.Exception as exc:
        print(f"skipped: {exc}")
        return SKIPPED_RC
    return 0


def test_few_examples_are_skipped():
    examples = [e for p in DOC_FILES for e in examples_in(p)]
    skipped = [e.where for e in examples if e.mode == "skip"]
    assert len(skipped) <= 2, f"keep skipped examples few and justified: {skipped}"


# -- the public API (docs/design.md §9) ------------------------------------------------------------------------
#: where each name that left the top level of ``trimkit`` lives now
MOVED = {
    "trimkit.backends": "Backend Measurement TimedStream LlamaBackend OpenAIHTTPBackend ServerInfo",
    "trimkit.backends.llama": "LlamaBackend PrefixSnapshot llama_summarizer",
    "trimkit.testing": "FakeBackend FakeClock FakeOpenAIServer",
    "trimkit.planning.costs": "CostModel ErrorStats PrefillSample",
    "trimkit.planning.planner": "Action Plan PlanState plan",
    "trimkit.report": "Report DECODE_PARAMETERS_UNTOUCHED Diagnosis diagnose Verdict judge DecodeContext VERDICTS READING_SPEED_TOKENS_PER_S "
                       "DEFAULT_WAIT_THRESHOLD_S",
    "trimkit.messages": "Chunk DEFAULT_RAG_TEMPLATE DEFAULT_RAG_CHUNK_TEMPLATE",
    "trimkit.backends.llama_format": "check_model_path default_model_path",
    "trimkit.planning.profile": "Profile ProfileKey",
    "trimkit._calibration": "calibrate load_profile save_profile",
    "trimkit.planning.speed": "LiveProfile",
    "trimkit.strategies": "Strategy chain default_strategies reuse_prefix cap_rag_chunks summarize_history drop_oldest_turns keep_cached_cut",
    "trimkit.planning.summaries": "ExtractiveSummarizer PromptSummarizer Summary SummaryCache summary_job next_summary_job",
    "trimkit.planning.tokens": "PromptTokenizer TiktokenTokenizer",
    "trimkit.planning.values": "ValueModel",
    "trimkit.openai_wrapper": "TrimmedOpenAI AsyncTrimmedOpenAI wrap_openai",
    "trimkit.wrapper": "Trimmer TrimmedLlama ReportingStream wrap",
    "trimkit.pipeline": "Pipeline Prepared place_chunks",
    "trimkit.errors": " ".join(trimkit.errors.__all__),
}


def test_the_top_level_is_small_and_every_other_name_has_a_home():
    assert 15 <= len(trimkit.__all__) <= 25
    for name in trimkit.__all__:
        assert hasattr(trimkit, name), name
    for namespace in ("strategies", "errors", "backends", "testing"):  # usable after a bare ``import trimkit``
        assert isinstance(getattr(trimkit, namespace), type(trimkit)), namespace
    assert trimkit.strategies.cap_rag_chunks and trimkit.backends.OpenAIHTTPBackend and trimkit.testing.FakeBackend
    for module, names in MOVED.items():
        mod = importlib.import_module(module)
        for name in names.split():
            assert hasattr(mod, name), f"{module}.{name} is gone"


# -- what the docs and the code say about decode (issue 12) -------------------------------------------------
#: what trimkit used to say about decode: false on small models (each generated token reads the KV
#: cache, so a long context slows the stream), or a faster stream presented as trimkit's doing
FALSE_DECODE_CLAIMS = re.compile(
    r"decode untouched|— untouched by trimkit|\(untouched\)|trimming does not change it|does nothing for the stream|"
    r"(almost|nearly|is) independent of the prompt|speed and barely depends on the prompt|at the same decode speed|"
    r"leave decode alone|decode was never touched|trimming (made|makes) (decode|the stream) faster",
    re.I,
)
OLD_CLAIMS = ("32 tokens — untouched by trimkit", "decode=27.2tok/s(untouched)", "(the stream; trimming does not change it)",
              "A shorter prompt shortens the wait and does nothing for the stream", "almost independent of the prompt length",
              "sets the streaming speed and barely depends on the prompt", "print(report)  # decode untouched")


def test_no_doc_or_module_says_decode_is_independent_of_the_prompt_or_sped_up_by_trimming():
    assert all(FALSE_DECODE_CLAIMS.search(old) for old in OLD_CLAIMS)  # the check can fail
    found = []
    for path in [*DOC_FILES, *sorted((ROOT / "trimkit").rglob("*.py"))]:
        text = " ".join(path.read_text(encoding="utf-8").split())  # a claim may wrap across lines
        found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in FALSE_DECODE_CLAIMS.finditer(text)]
    assert not found, found


# -- claims the docs make that no example shows -------------------------------------------------------------
def test_a_budgeted_call_over_http_is_planned_within_the_servers_context():
    """docs/servers.md §5 / design.md §5: the plan keeps the prompt within the server's n_ctx less max_tokens."""
    server = FakeOpenAIServer(model="m", n_ctx=1024)
    backend = OpenAIHTTPBackend("http://fake.test/v1", model="m", http_client=httpx.Client(transport=server.transport))
    assert backend.n_ctx == 1024  # what the server reports
    profile = attrs.evolve(trimkit.calibrate(FakeBackend(), store=False), key=backend.profile_key())
    chat = trimkit.wrap(backend, ttft_budget_s=1000.0, profile=profile)  # the budget never binds: only the context does
    chunks = [trimkit.Chunk(text=f"Passage {i}: " + "the harbour wall was rebuilt in stone after the storm. " * 12, id=f"doc-{i}")
              for i in range(12)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "When was the harbour wall rebuilt?"}]
    params = {"max_tokens": 200}
    stream = chat.execute(chat.prepare(messages, chunks, params), params)
    for _ in stream:
        pass
    report = stream.report
    assert report.prompt_tokens_before > 1024 - 200
    assert report.prompt_tokens <= 1024 - 200
    assert report.actions  # what was dropped to fit is reported


if __name__ == "__main__":
    import tempfile

    os.environ.setdefault("TRIMKIT_CACHE_DIR", tempfile.mkdtemp(prefix="trimkit-docs-cache-"))
    raise SystemExit(main(sys.argv[1]))
