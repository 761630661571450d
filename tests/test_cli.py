"""The trimkit command line, end to end on the real embedded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run(*args: str, cache: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TRIMKIT_CACHE_DIR=cache)
    return subprocess.run([sys.executable, "-m", "trimkit", *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def cli_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cli-cache"))


def test_calibrate_quick_prints_json_and_plots(cli_cache, tmp_path):
    plot = tmp_path / "prefill.png"
    r = run("calibrate", "--quick", "--n-ctx", "4096", "--json", "--plot", str(plot), "--budget", "1.0", cache=cli_cache)
    assert r.returncode == 0, r.stderr
    profile = json.loads(r.stdout)
    assert profile["quick"] is True and profile["samples"]
    assert profile["model"]["per_token_s"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibrate_table_reuses_the_stored_profile(cli_cache):
    r = run("calibrate", "--quick", "--n-ctx", "4096", cache=cli_cache)
    assert r.returncode == 0, r.stderr
    assert "prompt tokens" in r.stdout and "held-out error" in r.stdout and "tokens/s" in r.stdout


def test_diagnose_from_numbers_names_the_wait():
    r = run("diagnose", "--ttft", "12", "--tokens-per-s", "40", "--prompt-tokens", "8000", cache="/nonexistent-unused")
    assert r.returncode == 0, r.stderr
    assert "verdict: the wait (prefill) is slow" in r.stdout and "trim" in r.stdout


def test_diagnose_from_numbers_names_the_stream():
    r = run("diagnose", "--ttft", "0.2", "--tokens-per-s", "3", "--output-tokens", "300", cache="/nonexistent-unused")
    assert r.returncode == 0, r.stderr
    assert "verdict: the stream (decode) is slow" in r.stdout and "quantization" in r.stdout
    assert "trimming will not fix the stream" in r.stdout


@pytest.mark.parametrize(
    "args, verdict",
    [
        (["--ttft", "0.44", "--tokens-per-s", "11", "--output-tokens", "32", "--ttft-budget", "1"], "none"),  # issue 12
        (["--ttft", "1.0", "--tokens-per-s", "11", "--ttft-budget", "1"], "none"),  # exactly at the budget
        (["--ttft", "1.01", "--tokens-per-s", "11", "--ttft-budget", "1"], "wait"),
        (["--ttft", "1.5", "--tokens-per-s", "11"], "wait"),  # no budget: the 1 s default
        (["--ttft", "1.5", "--tokens-per-s", "11", "--wait-threshold", "2"], "none"),
        (["--ttft", "0.2", "--tokens-per-s", "11", "--tokens-per-s-target", "12"], "stream"),
        (["--ttft", "0.2", "--tokens-per-s", "6", "--reading-speed", "5"], "none"),
        (["--ttft", "0.2", "--tokens-per-s", "7"], "none"),  # exactly at reading speed
        (["--ttft", "3", "--tokens-per-s", "6.9", "--ttft-budget", "2"], "both"),
    ],
)
def test_diagnose_judges_against_the_standards_given(args, verdict, capsys):
    from trimkit.cli import main

    assert main(["diagnose", *args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == verdict


@pytest.mark.parametrize("flag", ["--ttft-budget", "--tokens-per-s-target", "--reading-speed", "--wait-threshold"])
def test_diagnose_refuses_a_bad_standard(flag, capsys):
    from trimkit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["diagnose", "--ttft", "1", "--tokens-per-s", "10", flag, "0"])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_diagnose_runs_a_prompt_file(cli_cache, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Explain in one sentence why the sea is salty. " * 20)
    r = run("diagnose", "--prompt-file", str(prompt), "--n-ctx", "4096", "--output-tokens", "8", "--ttft-budget", "30", cache=cli_cache)
    assert r.returncode == 0, r.stderr
    assert "verdict: " in r.stdout and "decode parameters untouched by trimkit" in r.stdout
    assert "within its 30.000 s budget" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("calibrate", "--model", "/no/such/model.gguf"), "model file not found"),
        (("diagnose", "--ttft", "1"), "diagnose needs"),
        (("diagnose", "--ttft", "nan", "--tokens-per-s", "3"), "finite"),
        (("diagnose", "--ttft", "-1", "--tokens-per-s", "3"), "finite number > 0"),
    ],
)
def test_errors_are_one_line_and_nonzero(args, message, tmp_path):
    r = run(*args, cache=str(tmp_path))
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_not_a_gguf_is_refused(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a model")
    r = run("calibrate", "--model", str(bogus), cache=str(tmp_path))
    assert r.returncode == 2
    assert "not a GGUF" in r.stderr and "Traceback" not in r.stderr


def test_help_documents_every_command():
    r = run("--help", cache="/unused")
    assert r.returncode == 0
    for cmd in ("calibrate", "diagnose", "plan", "demo"):
        assert cmd in r.stdout


# -- trimkit plan ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def request_file(tmp_path_factory):
    """A 30-message RAG chat with 12 retrieved chunks, as a request file."""
    from trimkit.cli import SYSTEM, load_corpus, load_history, load_questions

    q = load_questions()[1]
    req = {
        "messages": [{"role": "system", "content": SYSTEM}, *load_history(), {"role": "user", "content": q["question"]}],
        "rag_chunks": [{"text": d["text"], "id": d["id"]} for d in load_corpus()[:12]],
    }
    path = tmp_path_factory.mktemp("plan") / "request.json"
    path.write_text(json.dumps(req))
    return str(path)


@pytest.fixture(scope="module")
def profile_file(quick_profile, tmp_path_factory):
    from trimkit._calibration import save_profile

    return str(save_profile(quick_profile, tmp_path_factory.mktemp("profile") / "profile.json"))


def test_plan_prints_what_the_budget_keeps_and_drops(request_file, profile_file, tmp_path):
    r = run("plan", request_file, "--budget-share", "0.4", "--profile", profile_file, cache=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "12 chunks" in out and "Plan: trimmed" in out
    assert "chunks kept (" in out and "chunks dropped:" in out and "messages removed (indices):" in out
    assert "nothing was generated" in out and f"--profile {profile_file}" in out


def test_plan_json(request_file, profile_file, tmp_path):
    r = run("plan", request_file, "--budget-share", "0.5", "--profile", profile_file, "--json", cache=str(tmp_path))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["budget_s"] == pytest.approx(0.5 * plan["untrimmed_predicted_ttft_s"])
    assert plan["untrimmed_prompt_tokens"] > plan["prompt_tokens_exact"] > 0
    ids = {f"doc-{i:02d}" for i in range(1, 13)}
    assert set(plan["kept_chunks"]) | set(plan["dropped_chunks"]) == ids and plan["dropped_chunks"]
    assert isinstance(plan["removed_message_indices"], list) and plan["template_dropped_messages"] == []
    assert plan["predicted_ttft_exact_s"] < plan["untrimmed_predicted_ttft_s"]


def test_plan_with_a_generous_budget_keeps_everything(request_file, profile_file, tmp_path):
    r = run("plan", request_file, "--budget", "100000", "--profile", profile_file, "--json", cache=str(tmp_path))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["passthrough"] and not plan["dropped_chunks"] and not plan["removed_message_indices"]


def test_plan_calibrates_quickly_without_a_stored_profile_then_reuses_it(tmp_path):
    req = tmp_path / "small.json"
    req.write_text(json.dumps([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]))
    cache = str(tmp_path / "cache")
    first = run("plan", str(req), "--budget", "5", "--n-ctx", "1024", cache=cache)
    assert first.returncode == 0, first.stderr
    assert "calibrating quickly" in first.stderr and "quick calibration measured now" in first.stdout
    second = run("plan", str(req), "--budget", "5", "--n-ctx", "1024", cache=cache)
    assert second.returncode == 0, second.stderr
    assert "stored quick calibration profile" in second.stdout and "calibrating" not in second.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read the request file"),
        ("{not json", "is not JSON"),
        ('"just a string"', "expected a JSON object"),
        ('{"rag_chunks": []}', 'no "messages"'),
        ('{"messages": [], "extra": 1}', "unknown field"),
        ('{"messages": [{"role": "wizard", "content": "hi"}]}', "role"),
        ('{"messages": [{"role": "assistant", "content": "hi"}]}', "user"),
        ('{"messages": [{"role": "user", "content": "hi"}], "rag_chunks": [{"id": "x"}]}', "text"),
        ('{"messages": [{"role": "user", "content": "hi"}], "tools": "none"}', "tools"),
    ],
)
def test_plan_bad_input_is_one_line_and_exit_2(content, message, tmp_path):
    path = tmp_path / "request.json"
    if content is not None:
        path.write_text(content)
    r = run("plan", str(path), "--budget", "1", cache=str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


@pytest.mark.parametrize("args", [(), ("--budget", "1", "--budget-share", "0.5"), ("--budget-share", "1.5"), ("--budget", "0")])
def test_plan_needs_one_valid_budget(args, tmp_path):
    path = tmp_path / "request.json"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}')
    r = run("plan", str(path), *args, cache=str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr


# -- trimkit demo --------------------------------------------------------------------------------


def test_demo_reads_what_the_plan_did_with_the_answer_chunk():
    from types import SimpleNamespace

    from trimkit.cli import answer_chunk_status
    from trimkit.messages import Chunk

    chunks = [Chunk(text="The lamp was first lit in 1863. It burns oil.", id="doc-04"), Chunk(text="Other text.", id="doc-09")]
    whole = SimpleNamespace(kept_chunks=(chunks[0],), dropped_chunks=(chunks[1],))
    excerpt = SimpleNamespace(kept_chunks=(Chunk(text="The lamp was first lit in 1863.", id="doc-04"),), dropped_chunks=(chunks[1],))
    dropped = SimpleNamespace(kept_chunks=(chunks[1],), dropped_chunks=(chunks[0],))
    assert answer_chunk_status(whole, chunks, "doc-04") == "kept whole"
    assert answer_chunk_status(excerpt, chunks, "doc-04") == "kept as an excerpt"
    assert answer_chunk_status(dropped, chunks, "doc-04") == "dropped"
    assert answer_chunk_status(None, chunks, "doc-04") == "kept whole"
    assert answer_chunk_status(whole, chunks, "doc-99") == "not retrieved"


def test_demo_budget_options():
    from trimkit.cli import build_parser

    args = build_parser().parse_args(["demo"])
    assert args.budget is None and args.budget_share == pytest.approx(0.45)
    assert build_parser().parse_args(["demo", "--budget", "2"]).budget == 2.0
