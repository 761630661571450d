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

The public API: ``__all__`` and the namespaces below (docs/design.md "Public API").
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
    "__version__", "wrap", "wrap_url", "plan", "calibrate", "diagnose", "load_profile", "default_llama", "default_model_path",
    "llama_summarizer", "Chunk", "Plan", "Report", "Profile", "Strategy", "ValueModel", "TrimkitError",
    "strategies", "errors", "backends", "testing",
]

def __getattr__(name: str) -> Any:
    """The in-process names on first use: ``import trimkit`` imports no engine (``trimkit[llama]``)."""
    if name in ("default_llama", "llama_summarizer"):
        return getattr(errors.require_extra("trimkit.backends.llama", "llama", f"trimkit.{name}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
