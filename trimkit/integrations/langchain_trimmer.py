"""``prompt | trimkit_trimmer(...) | llm``: trim a prompt's messages in an LCEL chain.

:func:`trimkit_trimmer` returns a :class:`TrimkitTrimmer`, a ``Runnable`` that takes what a
prompt template produces (a ``PromptValue``, a list of messages, a string, or a dict with
``"messages"`` and, optionally, ``"documents"``), plans it with :func:`trimkit.plan` and returns
the messages to send, as LangChain messages, for any chat model after it. It plans only — it
sends nothing and so measures nothing: its record is the :class:`~trimkit.planning.planner.Plan`
(``trimmer.last_plan``, and the custom callback event ``"trimkit_plan"`` with ``plan.to_dict()``).
To plan *and* measure, use :class:`~trimkit.integrations.langchain.TrimmedChatModel` instead.

What it plans with (``target``):

- a :class:`~trimkit.integrations.langchain.TrimmedChatModel` or a trimkit wrapper
  (``trimkit.wrap(...)``): its engine's current profile, tokenizer, learned safety margin,
  strategies, values and summaries, and its default budget;
- a ``ChatLlamaCpp`` / ``ChatOpenAI``: wrapped as ``TrimmedChatModel`` wraps it (its stored
  profile, else a micro-calibration through its client);
- a :class:`~trimkit.profile.Profile` with ``tokenizer=`` (a ``PromptTokenizer`` of the engine
  that will run the prompt).

Retrieved documents come from the input dict's ``"documents"`` (Documents or trimkit chunks) or
from the prompt's context variable formatted by ``trimkit_context()``
(:mod:`~trimkit.integrations.langchain_documents`). Kept messages are the caller's very objects;
an edited one (the last user message with its chunks placed) is a copy with new content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.callbacks import dispatch_custom_event
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, convert_to_messages, convert_to_openai_messages
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable, RunnableConfig

from trimkit.errors import InvalidBudgetError, InvalidInputError, InvalidMessageError
from trimkit.integrations.langchain_documents import as_chunks, find_context
from trimkit.integrations.langchain_engines import Engine
from trimkit.messages import SYSTEM_ROLES, last_user_index
from trimkit.planning.planner import Plan, plan
from trimkit.profile import Profile
from trimkit.validation import budget as valid_budget

__all__ = ["TrimkitTrimmer", "trimkit_trimmer", "PLAN_EVENT", "as_openai_messages", "as_langchain_messages"]

#: the name of the custom callback event carrying ``plan.to_dict()``
PLAN_EVENT = "trimkit_plan"


def as_openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as OpenAI-style dicts, one each (tool calls and tool results whole)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, BaseMessage):
            raise InvalidMessageError(f"messages[{i}] must be a LangChain message, got {type(m).__name__}")
        out.append(convert_to_openai_messages(m))
    return out


def as_langchain_messages(sent: Sequence[Mapping[str, Any]], planned: Sequence[Mapping[str, Any]], originals: Sequence[BaseMessage],
                          converted: Sequence[Mapping[str, Any]] | None = None) -> list[BaseMessage]:
    """The dicts ``sent`` (a plan of ``planned``) back as LangChain messages. ``converted[i]``
    is ``originals[i]`` as converted (default: ``planned`` itself); a sent dict that is one of
    them becomes its original message, the caller's very object; an edited one (the last user
    message, or the first system message, or a message of ``planned`` that differs from its
    conversion) a copy of its original with the new content; anything else is converted."""
    converted = planned if converted is None else converted
    at = {id(d): i for i, d in enumerate(planned)}
    kept = {id(d) for d in sent}
    out: list[BaseMessage] = []
    for d in sent:
        i = at.get(id(d))
        if i is None:
            i = _edited_index(d, planned, kept)
        if i is None:
            out.append(convert_to_messages([d])[0])
        else:
            out.append(originals[i] if d is converted[i] else originals[i].model_copy(update={"content": d.get("content")}))
    return out


def _edited_index(d: Mapping[str, Any], planned: Sequence[Mapping[str, Any]], kept: set[int]) -> int | None:
    role = d.get("role")
    if role == "user":
        return last_user_index(planned)
    if role in SYSTEM_ROLES:
        return next((i for i, p in enumerate(planned) if p.get("role") in SYSTEM_ROLES and id(p) not in kept), None)
    return None


class TrimkitTrimmer(Runnable[Any, list[BaseMessage]]):
    """Trims a prompt's messages to a TTFT budget (see the module docstring). ``last_plan``: the
    plan of the most recent call. ``plan_options`` go to :func:`trimkit.plan` (``strategies``,
    ``values``, ``on_infeasible``, ``rag_template``, ``rag_chunk_template``, ``safety_margin``,
    ``max_prompt_tokens``, ``tools``) and override the target's own."""

    def __init__(self, target: Any, ttft_budget_s: float | None = None, *, tokenizer: Any = None, **plan_options: Any) -> None:
        self.wrapper: Any = None
        self.profile: Profile | None = None
        self.tokenizer = tokenizer
        if isinstance(target, Profile):
            if tokenizer is None:
                raise InvalidInputError("trimkit_trimmer(profile) needs tokenizer=: the engine's PromptTokenizer (e.g. chat.backend.tokenizer)")
            self.profile = target
        elif getattr(getattr(target, "trimkit", None), "pipeline", None) is not None:  # a TrimmedChatModel
            self.wrapper = target.trimkit
        elif getattr(target, "pipeline", None) is not None and getattr(target, "backend", None) is not None:  # trimkit.wrap(...)
            self.wrapper = target
        elif isinstance(target, BaseChatModel):
            self.wrapper = Engine(target, ttft_budget_s, {}).chat
        else:
            raise InvalidInputError(f"trimkit_trimmer needs a TrimmedChatModel, a trimkit wrapper, a ChatLlamaCpp/ChatOpenAI or a "
                                    f"trimkit Profile (with tokenizer=), got {type(target).__name__}")
        default = getattr(self.wrapper, "ttft_budget_s", None) if ttft_budget_s is None else ttft_budget_s
        if default is None:
            raise InvalidBudgetError("trimkit_trimmer needs ttft_budget_s= (or a target with a default budget)")
        self.ttft_budget_s = valid_budget(default)
        self.plan_options = plan_options
        #: the plan of the most recent call (None before the first)
        self.last_plan: Plan | None = None

    def _engine_options(self) -> dict[str, Any]:
        w = self.wrapper
        if w is None:
            return {"profile": self.profile, "tokenizer": self.tokenizer}
        p = w.pipeline
        return {"profile": w.profile, "tokenizer": w.backend.tokenizer, "safety_margin": w.safety_margin, "strategies": w.strategies,
                "values": w.values, "on_infeasible": w.on_infeasible, "summaries": w.summaries, "rag_template": p.rag_template,
                "rag_chunk_template": p.rag_chunk_template}

    def _split(self, value: Any) -> tuple[list[BaseMessage], Any]:
        docs = None
        if isinstance(value, Mapping):
            if "messages" not in value:
                raise InvalidMessageError("a dict given to trimkit_trimmer needs 'messages' (and may have 'documents')")
            value, docs = value["messages"], value.get("documents")
        if isinstance(value, PromptValue):
            return value.to_messages(), docs
        if isinstance(value, str):
            return [HumanMessage(content=value)], docs
        if isinstance(value, Sequence):
            return list(value), docs
        raise InvalidMessageError(f"trimkit_trimmer takes a prompt value, messages, a str or a dict, got {type(value).__name__}")

    def trim(self, value: Any, ttft_budget_s: float | None = None) -> list[BaseMessage]:
        """Plan ``value`` and return the messages to send (outside any LangChain run)."""
        originals, docs = self._split(value)
        planned = converted = as_openai_messages(originals)
        options = {**self._engine_options(), **self.plan_options}
        chunks = as_chunks(docs) if docs is not None else None
        match = find_context(planned) if chunks is None and planned else None
        if match is not None:
            planned, chunks = match.messages, match.chunks
            options.update(rag_template=match.rag_template, rag_chunk_template=match.rag_chunk_template)
        try:
            result = plan(planned, ttft_budget_s=self.ttft_budget_s if ttft_budget_s is None else ttft_budget_s, rag_chunks=chunks or (),
                          **options)
        except TypeError as exc:  # an option trimkit.plan does not take
            raise InvalidInputError(f"trimkit_trimmer: {exc}") from None
        self.last_plan = result
        return as_langchain_messages(result.messages, planned, originals, converted)

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> list[BaseMessage]:
        return self._call_with_config(self._run, input, config, run_type="prompt", **kwargs)

    def _run(self, value: Any, **kwargs: Any) -> list[BaseMessage]:
        out = self.trim(value, kwargs.get("ttft_budget_s"))
        if self.last_plan is not None:
            dispatch_custom_event(PLAN_EVENT, self.last_plan.to_dict())
        return out


def trimkit_trimmer(target: Any, ttft_budget_s: float | None = None, *, tokenizer: Any = None, **plan_options: Any) -> TrimkitTrimmer:
    """An LCEL step that trims a prompt's messages to ``ttft_budget_s``::

        chain = prompt | trimkit_trimmer(trimmed_model_or_wrapper, ttft_budget_s=1.0) | llm

    See :class:`TrimkitTrimmer` for what ``target`` may be and what the step records."""
    return TrimkitTrimmer(target, ttft_budget_s, tokenizer=tokenizer, **plan_options)
