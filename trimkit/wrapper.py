"""The drop-in wrapper: ``trimkit.wrap(llm, ttft_budget_s=...)``, and the in-process front-ends.

:func:`wrap` looks at what it is given (:func:`~trimkit.backends.clients.client_kind`) and returns
the matching front-end. Every front-end holds a :class:`~trimkit.pipeline.Pipeline` (validate →
plan → measure → report) and only sends: :class:`Trimmer` sends through any
:class:`~trimkit.backends.base.Backend` (taking an in-process engine for the length of the
stream), :class:`TrimmedLlama` gives that the chat API of ``llama_cpp.Llama``; the OpenAI-client
front-ends live in :mod:`trimkit.openai_wrapper`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from trimkit.backends.base import Backend
from trimkit.backends.clients import client_kind
from trimkit.backends.completion import assemble_chat_completion
from trimkit.backends.llama import LlamaBackend
from trimkit.errors import InvalidInputError
from trimkit.frontend import FrontEnd, ReportingStream, send_params, usage_counts
from trimkit.messages import validate_messages
from trimkit.openai_wrapper import wrap_openai
from trimkit.pipeline import Pipeline
from trimkit.prepared import Prepared, place_chunks

__all__ = ["Trimmer", "TrimmedLlama", "ReportingStream", "Prepared", "wrap", "place_chunks"]


class Trimmer(FrontEnd):
    """A :class:`~trimkit.backends.base.Backend` behind a TTFT budget, with the chat API of
    ``llama_cpp.Llama`` (:meth:`create_chat_completion`); :meth:`prepare` plans a request and
    :meth:`execute` sends it, returning a :class:`ReportingStream`. Keyword arguments are those
    of :func:`wrap`."""

    def __init__(self, backend: Backend, **kwargs: Any) -> None:
        #: validate → plan → measure → report; this front-end only sends
        self.pipeline = Pipeline(backend, **kwargs)

    def execute(self, prepared: Prepared, params: Mapping[str, Any]) -> ReportingStream:
        """Send a prepared request; returns a stream of the engine's chunks that reports when done.

        An in-process engine is taken here, for the stream (restoring a snapshot and starting
        the stream are one step); the stream gives it back when it is finished, closed or
        garbage-collected, from any thread. While another request holds it this waits at most
        the request's TTFT budget (without one, the backend's ``engine_wait_s``), then raises
        :class:`~trimkit.errors.EngineBusyError`. The wait is reported (``measurement.queue_s``
        and a warning), never counted in the measured TTFT."""
        backend = self.pipeline.backend
        hold_engine = getattr(backend, "hold_engine", None)
        section = hold_engine(prepared.budget_s) if hold_engine is not None else contextlib.nullcontext(0.0)
        with section as waited:
            if prepared.snapshot is not None:
                backend.restore_prefix(prepared.snapshot)  # type: ignore[attr-defined]
            ts = backend.send(prepared.messages, send_params(params), prompt_tokens=prepared.prompt_tokens)
        if waited:
            ts.queue_s = getattr(ts, "queue_s", 0.0) + waited
        prepared = self.pipeline.sent(prepared, waited_s=waited or 0.0)
        return ReportingStream(ts, self.pipeline, prepared, params)

    def create_chat_completion(self, messages: Any = None, **kwargs: Any) -> Any:
        """Like ``Llama.create_chat_completion``, inside the TTFT budget: the same arguments plus
        ``rag_chunks=`` and a per-call ``ttft_budget_s=``; every other argument passes through
        unchanged. Returns a ``chat.completion`` dict, or with ``stream=True`` a
        :class:`ReportingStream` of the engine's chunks (with ``.report``)."""
        rag_chunks = kwargs.pop("rag_chunks", None)
        budget = kwargs.pop("ttft_budget_s", None)
        prepared = self.prepare(messages, rag_chunks, kwargs, ttft_budget_s=budget)
        rs = self.execute(prepared, kwargs)
        if kwargs.get("stream", False):
            return rs
        for _ in rs:
            pass
        completion_tokens = rs.report.completion_tokens if rs.report is not None else None
        return assemble_chat_completion(rs.chunks, usage=usage_counts(len(prepared.prompt_tokens), completion_tokens or 0))


class TrimmedLlama(Trimmer):
    """A ``llama_cpp.Llama`` whose chat calls keep TTFT inside a budget.

    ``create_chat_completion`` takes the same arguments as the original plus ``rag_chunks=``
    and a per-call ``ttft_budget_s=``; every other argument passes through unchanged, and it
    returns what llama-cpp-python returns (a dict, or an iterator of chunks with
    ``stream=True`` — that iterator also has ``.report``). Any other attribute is the wrapped
    ``Llama``'s own.
    """

    backend: LlamaBackend

    def __init__(self, llm: Any, *, backend: LlamaBackend | None = None, **kwargs: Any) -> None:
        self.llm = llm
        super().__init__(backend or LlamaBackend(llm), **kwargs)

    def __getattr__(self, name: str) -> Any:  # drop-in: everything else is the Llama's
        if name in ("llm", "pipeline"):
            raise AttributeError(name)
        return getattr(self.llm, name)

    def prewarm(self, messages: Any, *, keep: bool = True) -> Any:
        """Prefill a known, stable prefix (system prompt, pinned documents) off the critical path.

        The rendered ``messages`` (without the generation prompt's last tokens) are evaluated
        into the KV cache; with ``keep`` their KV state (not the logits) is also stored, so a
        later conversation that starts with the same prefix restores it instead of prefilling
        it again — the restore time is counted in predictions. Returns the snapshot (or None).
        """
        validate_messages(messages)
        tokens = self.backend.tokenizer.prompt_tokens(messages)
        prefix = tokens[: max(len(tokens) - 1, 1)]
        if keep:
            return self.backend.save_prefix(prefix)
        self.backend.prefill(prefix)
        return None


def wrap(client: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> Any:
    """Wrap the client you already use so that each chat request meets a TTFT budget.

    ``client`` is a ``llama_cpp.Llama`` (returns a :class:`TrimmedLlama`, a drop-in for its
    chat API), an OpenAI-style client with ``.chat.completions.create`` (returns a drop-in
    for that: :func:`~trimkit.openai_wrapper.wrap_openai`) or a trimkit
    :class:`~trimkit.backends.base.Backend` (returns a :class:`Trimmer`). ``kwargs``:

    - ``strategies``: what the planner may change (default: reuse the cached prefix, drop or
      excerpt chunks, use a ready summary, drop old turns; the previous request's cut too);
    - ``values``: a :class:`~trimkit.planning.values.ValueModel` weighing chunks against history;
    - ``on_infeasible``: ``"best_effort"`` (send the minimal prompt, say so) or ``"raise"``;
    - ``profile``: else the stored one for this model and settings, or a quick calibration now;
    - ``summarizer``: computes summaries of older turns *after* each response, in a background
      thread (``background_summaries=False``: on ``.idle()``); the planner may put a
      ready one in their place on a later turn. Default ``"extractive"``
      (:class:`~trimkit.strategies.summarize.ExtractiveSummarizer`, model-free, milliseconds);
      ``None`` turns summaries off;
    - ``attainment_target``: the share of budgeted requests the learned safety margin aims to
      keep inside the budget (default 0.97);
    - ``rag_template``, ``rag_chunk_template``, ``clock``.
    """
    kind = client_kind(client)
    if kind == "llama":
        return TrimmedLlama(client, ttft_budget_s=ttft_budget_s, **kwargs)
    if kind == "backend":
        return Trimmer(client, ttft_budget_s=ttft_budget_s, **kwargs)
    if kind == "openai":
        return wrap_openai(client, ttft_budget_s=ttft_budget_s, **kwargs)
    raise InvalidInputError(
        f"cannot wrap {type(client).__name__}: pass a llama_cpp.Llama or an OpenAI-style client (with .chat.completions.create)"
    )
