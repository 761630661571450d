"""Shared fixtures. The real embedded model runs in the default suite: it is small and comes from PyPI."""

from __future__ import annotations

import os
import tempfile

import pytest

# Never touch the user's cache: every test session gets its own profile store.
_SESSION_CACHE = tempfile.mkdtemp(prefix="trimkit-test-cache-")
os.environ["TRIMKIT_CACHE_DIR"] = _SESSION_CACHE


#: Run the suite on another GGUF: ``TRIMKIT_TEST_MODEL=/path/model.gguf make test`` (its own chat
#: template is used; tests about the embedded model's Gemma 3 template are skipped).
OTHER_MODEL = os.environ.get("TRIMKIT_TEST_MODEL") or None


@pytest.fixture(scope="session")
def model_path() -> str:
    import trimkit

    return OTHER_MODEL or trimkit.default_model_path()


@pytest.fixture(scope="session")
def llm(model_path):
    """One real llama.cpp context for the session (Gemma-3-270M, n_ctx 4096, Gemma 3's chat
    template; or ``TRIMKIT_TEST_MODEL`` with the chat template its GGUF carries)."""
    import trimkit

    if OTHER_MODEL:
        from llama_cpp import Llama

        return Llama(model_path=model_path, n_ctx=4096, verbose=False)
    return trimkit.default_llama(model_path=model_path, n_ctx=4096)


def pytest_collection_modifyitems(config, items):
    if not OTHER_MODEL:
        return
    skip = pytest.mark.skip(reason="about the embedded model's Gemma 3 template (TRIMKIT_TEST_MODEL is set)")
    for item in items:
        if item.fspath.basename == "test_templates.py" or "gemma" in item.name.lower():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def quick_profile(llm):
    """A quick calibration of the real model, measured once per session."""
    import trimkit

    return trimkit.calibrate(llm, quick=True)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A fresh, empty profile store for one test."""
    monkeypatch.setenv("TRIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _fresh_engine_state():
    """Each test starts with no learned drift or margin (an engine's state outlives its wrappers)."""
    from trimkit.planning.margin import forget_engines

    forget_engines()
    yield
    forget_engines()


# the real OpenAI-compatible server on loopback (python -m llama_cpp.server), one per session
from tests._server import llama_server  # noqa: E402,F401
