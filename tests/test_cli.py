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
    assert "the wait (prefill)" in r.stdout and "trim" in r.stdout


def test_diagnose_from_numbers_names_the_stream():
    r = run("diagnose", "--ttft", "0.2", "--tokens-per-s", "3", "--output-tokens", "300", cache="/nonexistent-unused")
    assert r.returncode == 0, r.stderr
    assert "the stream (decode)" in r.stdout and "quantization" in r.stdout


def test_diagnose_runs_a_prompt_file(cli_cache, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Explain in one sentence why the sea is salty. " * 20)
    r = run("diagnose", "--prompt-file", str(prompt), "--n-ctx", "4096", "--output-tokens", "8", cache=cli_cache)
    assert r.returncode == 0, r.stderr
    assert "dominant phase" in r.stdout and "untouched by trimkit" in r.stdout


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
    for cmd in ("calibrate", "diagnose", "demo"):
        assert cmd in r.stdout
