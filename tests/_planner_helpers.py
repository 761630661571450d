"""Shared helpers for the planner, strategy and summary tests: a profile and a tokenizer that
need no model, and small conversation builders."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trimkit.planning.costs import CacheState, CostModel, ErrorStats
from trimkit.planning.planner import PlanState
from trimkit.planning.profile import Profile, ProfileKey
from trimkit.planning.tokens import PromptTokenizer

#: 1.4 ms a token plus a small depth term: ~0.7 s for 500 tokens, ~1.5 s for 1000.
PROFILE = Profile(
    key=ProfileKey(backend="fake", model="m", n_ctx=8192, n_batch=512),
    model=CostModel(overhead_s=0.01, per_token_s=0.0014, depth_s=1e-7),
    first_token_s=0.02,
    decode_tokens_per_s=50,
    samples=(),
    error=ErrorStats(2, 5, 8, 10),
)


@functools.lru_cache(maxsize=1)
def tokenizer() -> PromptTokenizer:
    """One shared tiktoken + ChatML tokenizer (its caches make the suite fast)."""
    return PromptTokenizer.estimate()


def fresh_tokenizer() -> PromptTokenizer:
    """A tokenizer with empty caches, for tests that count tokenizer calls."""
    return PromptTokenizer.estimate()


def conversation(turns: int, *, words: int = 40, system: bool = True, question: str = "What about cats?") -> list[dict[str, Any]]:
    """``turns`` user/assistant exchanges of about ``words`` words each, then a final question."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}] if system else []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {t}: " + " ".join(f"word{t}x{i}" for i in range(words))})
        msgs.append({"role": "assistant", "content": f"Answer {t}. " + " ".join(f"reply{t}y{i}." for i in range(words))})
    msgs.append({"role": "user", "content": question})
    return msgs


def tool_turn(n: int) -> list[dict[str, Any]]:
    """A user turn whose assistant reply calls a tool, the tool's result, and a final answer."""
    call_id = f"call_{n}"
    return [
        {"role": "user", "content": f"Look up item {n}."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": f'{{"item": {n}}}'}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": f"Item {n} costs {n * 3} euros. " * 10},
        {"role": "assistant", "content": f"Item {n} costs {n * 3} euros."},
    ]


def tokens_of(messages: list[dict[str, Any]]) -> int:
    return tokenizer().segment_counts(messages).total


def budget_for_tokens(n: int, profile: Profile = PROFILE) -> float:
    """A budget whose target (budget less the safety margin) fits exactly ``n`` uncached tokens."""
    return profile.predict_ttft_s(n) / (1 - profile.safety_margin)


def holding(*held: tuple[list[dict[str, Any]], int]) -> CacheSpy:
    """An engine's cache holding, for each ``(messages, n)``, the first ``n`` tokens of that
    prompt (and then tokens no prompt has)."""
    prompts = []
    for messages, n in held:
        tokens = tokenizer().prompt_tokens(messages)
        prompts.append([*tokens[:n], *[-1] * (len(tokens) - n + 1)])
    return CacheSpy(prompts=prompts)


@attrs.frozen(eq=False)
class CacheSpy(CacheState):
    """A :class:`CacheState` that records the prompts a plan looks up in it."""

    looked_up: list[list[int]] = attrs.field(factory=list)

    def cached(self, tokens: Sequence[int], cost: Callable[[int, int], float] | None = None) -> int:
        self.looked_up.append(list(tokens))
        return super().cached(tokens, cost)


def state(messages: list[dict[str, Any]], *, budget: float, **kwargs: Any) -> PlanState:
    """A planning state for strategy tests."""
    return PlanState.start(messages, ttft_budget_s=budget, profile=PROFILE, tokenizer=tokenizer(), **kwargs)
