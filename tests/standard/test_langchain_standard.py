"""LangChain's own standard chat-model tests (``langchain-tests``: ``ChatModelUnitTests`` and
``ChatModelIntegrationTests``), run differentially: each engine has a raw arm (the chat model as
the user builds it) and a wrapped arm (``TrimmedChatModel`` around that very model), with the same
feature flags, on the same engine — ``ChatLlamaCpp`` on the real in-process embedded model, and
``ChatOpenAI`` over the real ``python -m llama_cpp.server`` on loopback.

A standard test may fail in both arms (what a 270M-parameter model or llama-cpp-python's server
cannot do: docs/integrations.md lists them); what must never happen is a test that passes raw and
fails wrapped: :func:`test_no_standard_test_passes_raw_and_fails_wrapped` (last in this module)
compares the outcomes of both arms and fails naming every such test.

Kept modest: answers are at most ``MAX_TOKENS`` tokens (``standard_chat_model_params``, both
arms), both arms share one ``Llama`` per model (``SharedLlamaChat``), and the tests whose outcome
is the model's and takes longest are skipped in both arms (``SKIPPED``, with the reason).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

try:
    from langchain_community.chat_models import ChatLlamaCpp
    from langchain_openai import ChatOpenAI
    from langchain_tests.integration_tests import ChatModelIntegrationTests
    from langchain_tests.unit_tests import ChatModelUnitTests
    from pydantic import model_validator
except ImportError as exc:  # the dev extra is part of the suite's set-up: fail, do not skip
    raise ImportError(f"tests/test_langchain_standard.py needs the dev extra (langchain-tests; pip install -e '.[dev]'): {exc}") from exc

from tests.conftest import OTHER_MODEL
from trimkit.integrations.langchain import TrimmedChatModel

MAX_TOKENS = 24
AMPLE_S = 1000.0  # a budget nothing here comes near: the arms differ by trimkit's path, not by trimming
#: standard tests skipped in both arms (their outcome is the model's, not the wrapper's, and they are the slowest)
SKIPPED = {
    "test_init_time": "a benchmark (pytest-benchmark), not a check; the wrapper's overhead is benchmarks/integrations.py's",
    "test_stream_time": "a VCR benchmark (enable_vcr_tests is off)",
    "test_agent_loop": "several tool-calling turns: a 270M model's tool calls fail the same way in both arms (test_tool_calling shows it)",
    "test_structured_few_shot_examples": "tool-call few-shot histories: the model's, and as test_tool_calling",
}

#: skipped in one arm only: what would crash the test process
RAW_CRASHES = {
    ("llama", "test_batch"): "raw ChatLlamaCpp's batch runs its calls in threads on one Llama: llama.cpp aborts the process",
    ("llama", "test_abatch"): "raw ChatLlamaCpp's abatch runs its calls in threads on one Llama: llama.cpp aborts the process",
}

_TOOLS_AND_STRUCTURE = ("test_bind_runnables_as_tools", "test_structured_output", "test_structured_output_async",
                        "test_structured_output_optional_param", "test_structured_output_pydantic_2_v1", "test_tool_calling",
                        "test_tool_calling_async", "test_tool_calling_with_no_arguments", "test_unicode_tool_call_integration")
_MODEL_TOOLS = "the 270M model answers in text instead of calling the tool, or its forced call's arguments fail the parser"
#: (engine, kind, arm or "both", test) -> why it fails there (docs/integrations.md): marked xfail (not strict), so the
#: suite passes; the differential check still sees the outcome (an xfail that fails counts as failed)
EXPECTED_FAILURES: dict[tuple[str, str, str, str], str] = {
    **{("llama", "unit", "both", n): "ChatLlamaCpp: no ls_model_name; bind_tools refuses tool_choice='any'; with_structured_output refuses method="
       for n in ("test_bind_tool_pydantic", "test_with_structured_output", "test_standard_params")},
    **{("llama", "integration", "both", n): _MODEL_TOOLS for n in _TOOLS_AND_STRUCTURE},
    ("llama", "integration", "both", "test_usage_metadata"): "ChatLlamaCpp sets no model_name in response_metadata",
    ("llama", "integration", "both", "test_usage_metadata_streaming"): "ChatLlamaCpp sets no model_name in response_metadata",
    **{("openai", "integration", "both", n): _MODEL_TOOLS + "; llama-cpp-python's server refuses json_schema response formats"
       for n in (*_TOOLS_AND_STRUCTURE, "test_tool_choice")},
    **{("openai", "integration", "both", n): "llama-cpp-python's server rejects an assistant message holding only tool calls"
       for n in ("test_tool_message_error_status", "test_tool_message_histories_list_content", "test_tool_message_histories_string_content")},
    # another model (TRIMKIT_TEST_MODEL=smollm2): SmolLM2's ChatML template concatenates every message's content, so an
    # assistant turn holding only tool calls (content None) fails it — the raw arm's TypeError, the wrapped arm's typed error
    **({("llama", "integration", "both", n): "this model's template cannot render an assistant turn holding only tool calls"
        for n in ("test_tool_message_error_status", "test_tool_message_histories_list_content", "test_tool_message_histories_string_content")}
       if OTHER_MODEL else {}),
    ("openai", "integration", "raw", "test_usage_metadata_streaming"): "the server sends no usage in streams (wrapped: trimkit's counts)",
    ("openai", "integration", "raw", "test_astream"): "sometimes 'Event loop is closed': the raw async client outlives the test's loop",
    ("openai", "integration", "raw", "test_astream_events_v3"): "sometimes 'Event loop is closed': the raw async client outlives the test's loop",
    ("openai", "unit", "wrapped", "test_serdes"): "langchain_core.load's allowed_objects='all' admits LangChain's own classes only "
                                                  "(test_serdes_loaded_with_an_allowlist checks the rest)",
}

_LLAMAS: dict[str, Any] = {}


def _shared_llama(model_path: str, params: dict[str, Any]) -> Any:
    """One ``Llama`` per model for every chat model of this module (both arms: the same engine)."""
    if model_path not in _LLAMAS:
        from llama_cpp import Llama

        _LLAMAS[model_path] = Llama(model_path, **params)
    return _LLAMAS[model_path]


class SharedLlamaChat(ChatLlamaCpp):
    """``ChatLlamaCpp`` on the module's shared ``Llama`` (it would load its own in every test)."""

    @model_validator(mode="after")
    def validate_environment(self) -> SharedLlamaChat:  # noqa: D102 - replaces ChatLlamaCpp's (which loads a Llama)
        params = {"n_ctx": self.n_ctx, "n_batch": self.n_batch, "verbose": False, **self.model_kwargs}
        self.client = _shared_llama(self.model_path, params)
        return self


class LocalChatOpenAI(ChatOpenAI):
    """``ChatOpenAI`` for a local server, as users configure it: ``max_tokens`` sent under the
    name local servers read (``ChatOpenAI`` sends ``max_completion_tokens``, which
    llama-cpp-python's server ignores: the raw arm would then decode to the end of the context)."""

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["tests", "standard", "test_langchain_standard"]  # where langchain_core.load finds this class

    def _get_request_payload(self, *args: Any, **kwargs: Any) -> dict:
        payload = super()._get_request_payload(*args, **kwargs)
        if "max_completion_tokens" in payload:
            payload["max_tokens"] = payload.pop("max_completion_tokens")
        return payload


def _wrapped(inner_cls: type, name: str) -> type:
    """A ``TrimmedChatModel`` built from the inner model's parameters (what the standard tests pass)."""

    def __init__(self, inner: Any = None, /, **params: Any) -> None:
        if inner is None and "inner" not in params:
            inner = inner_cls(**params)
            params = {}
        params.setdefault("ttft_budget_s", AMPLE_S)
        TrimmedChatModel.__init__(self, inner, **params)

    return type(name, (TrimmedChatModel,), {
        "__init__": __init__,
        "__module__": __name__,
        "get_lc_namespace": classmethod(lambda cls: ["tests", "standard", "test_langchain_standard"]),
        # as serialisable as the model it wraps (ChatLlamaCpp is not, ChatOpenAI is)
        "is_lc_serializable": classmethod(lambda cls: inner_cls.is_lc_serializable()),
    })


TrimmedLlamaChat = _wrapped(SharedLlamaChat, "TrimmedLlamaChat")
TrimmedLocalChatOpenAI = _wrapped(LocalChatOpenAI, "TrimmedLocalChatOpenAI")
TrimmedChatOpenAI = _wrapped(ChatOpenAI, "TrimmedChatOpenAI")


def _llama_params() -> dict[str, Any]:
    import trimkit
    import trimkit.backends.llama  # noqa: F401 - registers "gemma-3", which ChatLlamaCpp's Llama looks up by name

    return {"model_path": OTHER_MODEL or trimkit.default_model_path("gemma"), "n_ctx": 4096, "n_batch": 512, "verbose": False,
            "model_kwargs": {} if OTHER_MODEL else {"chat_format": "gemma-3"}}


_SERVER: dict[str, str] = {}


def _openai_params() -> dict[str, Any]:
    """The served model (integration), or a server that is never reached (unit tests do no I/O)."""
    return {"base_url": _SERVER.get("url", "http://127.0.0.1:9/v1"), "api_key": "none", "model": _SERVER.get("model", "gemma-3-270m"),
            "max_retries": 0}


class _Arm:
    """What every arm shares: the same answer length and the module's skips."""

    arm = ""
    engine = ""

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        return {**super().standard_chat_model_params, "max_tokens": MAX_TOKENS}  # type: ignore[misc]

    def _bounded(self, params: dict[str, Any]) -> dict[str, Any]:
        """Integration tests: every model answers at most MAX_TOKENS (test_stop_sequence builds
        one from chat_model_params alone); unit tests pass max_tokens themselves."""
        return {**params, "max_tokens": MAX_TOKENS} if isinstance(self, ChatModelIntegrationTests) else params

    @pytest.fixture(autouse=True)
    def _streams_left_open(self):
        """A failed test's traceback (pytest keeps the last in ``sys.last_traceback``) holds the
        frames of a stream it left unfinished; trimkit's stream holds the in-process engine until
        it is finished, closed or collected (docs/integrations.md), so the next test would wait
        for it. Let it be collected."""
        yield
        import gc
        import sys

        sys.last_traceback = sys.last_value = sys.last_type = None
        if hasattr(sys, "last_exc"):
            sys.last_exc = None
        gc.collect()

    @pytest.fixture(autouse=True)
    def _skips(self, request):
        name = request.node.originalname
        if name in SKIPPED:
            pytest.skip(f"both arms: {SKIPPED[name]}")
        kind = "unit" if isinstance(self, ChatModelUnitTests) else "integration"
        why = EXPECTED_FAILURES.get((self.engine, kind, "both", name)) or EXPECTED_FAILURES.get((self.engine, kind, self.arm, name))
        if why:
            request.node.add_marker(pytest.mark.xfail(reason=why, strict=False))
        if self.arm == "raw" and (self.engine, name) in RAW_CRASHES:
            pytest.skip(f"raw arm: {RAW_CRASHES[(self.engine, name)]} (the wrapped arm runs it: trimkit holds the engine per request)")


class _Llama(_Arm):
    engine = "llama"

    @property
    def has_tool_choice(self) -> bool:
        return False  # ChatLlamaCpp.bind_tools: a tool's name or dict only, not "any" / "auto" (its docstring)

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return self._bounded(_llama_params())


class _OpenAI(_Arm):
    engine = "openai"

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return {"OPENAI_API_KEY": "none"}, {"model": "gemma-3-270m", "base_url": "http://127.0.0.1:9/v1"}, {"openai_api_key": "none"}

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return self._bounded(_openai_params())


class _Served:
    @pytest.fixture(autouse=True)
    def _server(self, llama_server):  # noqa: F811
        if _SERVER.get("url") != llama_server:
            _SERVER["url"] = llama_server
            _SERVER["model"] = httpx.get(llama_server + "/models", timeout=10).json()["data"][0]["id"]


# -- unit tests: construction, tracing params, tool binding, structured output, serialisation ------------
class TestRawLlamaUnit(_Llama, ChatModelUnitTests):
    arm = "raw"
    chat_model_class = SharedLlamaChat


class TestWrappedLlamaUnit(_Llama, ChatModelUnitTests):
    arm = "wrapped"
    chat_model_class = TrimmedLlamaChat


class TestRawOpenAIUnit(_OpenAI, ChatModelUnitTests):  # ChatOpenAI itself (nothing is sent): langchain_core.load knows it
    arm = "raw"
    chat_model_class = ChatOpenAI


class TestWrappedOpenAIUnit(_OpenAI, ChatModelUnitTests):
    arm = "wrapped"
    chat_model_class = TrimmedChatOpenAI

    def test_serdes_loaded_with_an_allowlist(self, model, snapshot) -> None:
        """What the standard test_serdes checks, with ``load`` told the classes it may build:
        its ``allowed_objects="all"`` is langchain-core's own allowlist of LangChain's classes,
        which no class outside LangChain (a trimkit one) is on (docs/integrations.md)."""
        import os
        from unittest import mock

        from langchain_core.load import dumpd, load

        with mock.patch.dict(os.environ, self.init_from_env_params[0]):
            ser = dumpd(model)
            assert ser["kwargs"]["inner"] == dumpd(model.inner)  # the inner model's own serialisation, inside
            loaded = load(ser, valid_namespaces=["tests"], allowed_objects=[type(model), ChatOpenAI], secrets_from_env=True)
        assert model.dict() == loaded.dict() and type(loaded.inner) is ChatOpenAI


# -- integration tests: the real engines ---------------------------------------------------------------
class TestRawLlamaIntegration(_Llama, ChatModelIntegrationTests):
    arm = "raw"
    chat_model_class = SharedLlamaChat


class TestWrappedLlamaIntegration(_Llama, ChatModelIntegrationTests):
    arm = "wrapped"
    chat_model_class = TrimmedLlamaChat


class TestRawOpenAIIntegration(_Served, _OpenAI, ChatModelIntegrationTests):
    arm = "raw"
    chat_model_class = LocalChatOpenAI


class TestWrappedOpenAIIntegration(_Served, _OpenAI, ChatModelIntegrationTests):
    arm = "wrapped"
    chat_model_class = TrimmedLocalChatOpenAI


# -- the differential check ------------------------------------------------------------------------------
#: (engine, unit|integration, test id without the class) -> {arm: outcome}, filled by tests/standard/conftest.py's report hook
OUTCOMES: dict[tuple[str, str, str], dict[str, str]] = {}


def record_outcome(item: Any, report: Any) -> None:
    """Called by tests/standard/conftest.py for each phase of each test of this module."""
    cls = getattr(item, "cls", None)
    if cls is None or not getattr(cls, "arm", ""):
        return
    kind = "unit" if issubclass(cls, ChatModelUnitTests) else "integration"
    key = (cls.engine, kind, item.name)
    slot = OUTCOMES.setdefault(key, {})
    outcome = report.outcome
    if getattr(report, "wasxfail", None) is not None:  # an expected failure: what it did is what counts here
        outcome = "failed" if report.outcome == "skipped" else "passed"
    if report.when == "setup" and report.outcome != "passed":
        slot[cls.arm] = outcome if report.when == "call" else report.outcome
    elif report.when == "call":
        slot[cls.arm] = outcome
    elif report.when == "teardown" and report.outcome == "failed":
        slot[cls.arm] = "failed"


#: where the wrapped arm must differ, why, and the test of the wrapped arm that checks what it does instead
DIFFERENCES = {
    ("openai", "unit", "test_serdes"): ("langchain_core.load's allowed_objects='all' admits LangChain's own classes only: a "
                                        "TrimmedChatModel loads with allowed_objects=[TrimmedChatModel, ChatOpenAI]",
                                        "test_serdes_loaded_with_an_allowlist"),
}


def test_no_standard_test_passes_raw_and_fails_wrapped():
    pairs = {k: v for k, v in OUTCOMES.items() if "raw" in v and "wrapped" in v}
    for (engine, kind, name), (_why, instead) in DIFFERENCES.items():
        if (engine, kind, name) in pairs:
            assert OUTCOMES.get((engine, kind, instead), {}).get("wrapped") == "passed", f"{instead} (in place of {name}) did not pass"
            del pairs[(engine, kind, name)]
    if not pairs:
        pytest.skip("no standard test ran in both arms (this module was deselected)")
    regressions = sorted(f"{engine} {kind} {name}" for (engine, kind, name), v in pairs.items()
                         if v["raw"] == "passed" and v["wrapped"] != "passed")
    both_fail = sorted(f"{engine} {kind} {name}" for (engine, kind, name), v in pairs.items() if v["raw"] == v["wrapped"] == "failed")
    print("standard tests failing in both arms:", *both_fail, sep="\n  ")
    assert not regressions, f"pass raw, fail wrapped: {regressions}"
