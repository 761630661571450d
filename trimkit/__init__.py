"""trimkit — keep a local LLM's time to first token inside a budget, and leave decode alone.

Quick start::

    import trimkit

    llm = trimkit.default_llama()                    # the embedded Gemma-3-270M, with Gemma 3's chat template
    chat = trimkit.wrap(llm, ttft_budget_s=1.0)      # calibrates once (stored), then trims to the budget
    out = chat.create_chat_completion(messages=[...], rag_chunks=[...], max_tokens=64)
    print(chat.last_report)                           # predicted vs measured TTFT, what was trimmed, decode untouched

Your own ``llama_cpp.Llama`` wraps the same way. For the embedded model use ``default_llama()``
(or ``chat_format="gemma-3"``, registered by :mod:`trimkit.templates`): llama-cpp-python's
``chat_format="gemma"`` silently drops system messages.

See ``docs/`` for the quickstart, the two phases, and the CLI reference.
"""

from trimkit.backends.base import Backend, Measurement, TimedStream
from trimkit.backends.fake import FakeBackend, FakeClock
from trimkit.backends.llama import LlamaBackend, PrefixSnapshot, llama_summarizer
from trimkit.calibration import calibrate
from trimkit.costmodel import CostModel, ErrorStats, PrefillSample
from trimkit.diagnose import Diagnosis, diagnose
from trimkit.errors import (
    BackendError,
    CalibrationError,
    ContextTooSmallError,
    EngineBusyError,
    InfeasibleBudgetError,
    InvalidBudgetError,
    InvalidChunkError,
    InvalidInputError,
    InvalidMessageError,
    InvalidNumberError,
    MalformedReplyError,
    ModelError,
    ModelNotFoundError,
    NotGGUFError,
    ProfileError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    StreamInterruptedError,
    TransientServerError,
    TrimkitError,
)
from trimkit.messages import DEFAULT_RAG_CHUNK_TEMPLATE, DEFAULT_RAG_TEMPLATE, Chunk
from trimkit.model import check_model_path, default_model_path
from trimkit.templates import default_llama
from trimkit.profile import LiveProfile, Profile, ProfileKey, load_profile, save_profile
from trimkit.report import DECODE_UNTOUCHED, Report
from trimkit.planner import Action, Plan, PlanState, plan
from trimkit.strategies import (
    Strategy,
    cap_rag_chunks,
    chain,
    default_strategies,
    drop_oldest_turns,
    keep_cached_cut,
    reuse_prefix,
    summarize_history,
)
from trimkit.summarize import ExtractiveSummarizer, PromptSummarizer, Summary, SummaryCache, next_summary_job, summary_job
from trimkit.tokens import PromptTokenizer, TiktokenTokenizer
from trimkit.values import ValueModel
from trimkit.openai_wrapper import AsyncTrimmedOpenAI, TrimmedOpenAI, wrap_openai, wrap_url
from trimkit.wrapper import ReportingStream, TrimmedLlama, Trimmer, place_chunks, wrap

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # the main entry points
    "wrap",
    "wrap_url",
    "wrap_openai",
    "calibrate",
    "diagnose",
    "default_model_path",
    "default_llama",
    "plan",
    # planning and strategies
    "Plan",
    "Action",
    "PlanState",
    "Strategy",
    "ValueModel",
    "chain",
    "default_strategies",
    "reuse_prefix",
    "cap_rag_chunks",
    "summarize_history",
    "drop_oldest_turns",
    "keep_cached_cut",
    "Summary",
    "SummaryCache",
    "ExtractiveSummarizer",
    "PromptSummarizer",
    "llama_summarizer",
    "summary_job",
    "next_summary_job",
    # values
    "Chunk",
    "Profile",
    "ProfileKey",
    "LiveProfile",
    "CostModel",
    "PrefillSample",
    "ErrorStats",
    "Report",
    "Diagnosis",
    "Measurement",
    "DECODE_UNTOUCHED",
    "DEFAULT_RAG_TEMPLATE",
    "DEFAULT_RAG_CHUNK_TEMPLATE",
    # wrappers and backends
    "Trimmer",
    "TrimmedLlama",
    "TrimmedOpenAI",
    "AsyncTrimmedOpenAI",
    "ReportingStream",
    "place_chunks",
    "Backend",
    "TimedStream",
    "LlamaBackend",
    "PrefixSnapshot",
    "FakeBackend",
    "FakeClock",
    "PromptTokenizer",
    "TiktokenTokenizer",
    "check_model_path",
    "load_profile",
    "save_profile",
    # errors
    "TrimkitError",
    "InvalidInputError",
    "InvalidMessageError",
    "InvalidChunkError",
    "InvalidBudgetError",
    "InvalidNumberError",
    "MalformedReplyError",
    "ModelError",
    "ModelNotFoundError",
    "NotGGUFError",
    "ContextTooSmallError",
    "EngineBusyError",
    "ProfileError",
    "CalibrationError",
    "InfeasibleBudgetError",
    "BackendError",
    "ServerError",
    "TransientServerError",
    "ServerTimeoutError",
    "ServerUnreachableError",
    "StreamInterruptedError",
]
