"""The strategy protocol and how strategies combine.

A :class:`Strategy` looks at the one :class:`~trimkit.planning.state.PlanState` and returns a
:class:`~trimkit.planning.state.Proposal` from ``propose(state)``: what the engine
(:mod:`trimkit.planning.engine`) may change. Strategies combine with ``+`` or :func:`chain`
(nested chains flatten) into a :class:`Chain`, planned together. The built-in strategies are in
:mod:`trimkit.strategies.builtin`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import attrs

from trimkit.errors import InvalidInputError
from trimkit.planning.engine import solve
from trimkit.planning.state import PlanState, Proposal
from trimkit.planning.values import ValueModel

__all__ = ["Strategy", "Chain", "chain"]


class Strategy(abc.ABC):  # noqa: B024 - a strategy implements propose() or __call__()
    """One way to make a prompt cheaper: ``propose(state)`` says what the engine may change."""

    __slots__ = ()
    name: ClassVar[str] = "strategy"
    #: True for a strategy that edits the prompt itself (overrides ``__call__`` only, returning
    #: ``state.apply(candidate, action)``); the engine applies such edits, in order, before it
    #: chooses. Set for each subclass from what it overrides.
    edits_prompt: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.edits_prompt = cls.__call__ is not Strategy.__call__ and cls.propose is Strategy.propose

    def propose(self, state: PlanState) -> Proposal | None:
        """What this strategy allows the engine to change in ``state`` (None: nothing)."""
        return None

    def __call__(self, state: PlanState) -> PlanState | None:
        """Plan ``state`` with this strategy alone: the state the engine reaches, or None when
        nothing changes."""
        strategies = list(self) if isinstance(self, Chain) else [self]
        out = solve(state, strategies, ValueModel())
        if out.candidate == state.candidate and out.actions == state.actions:
            return None
        return out

    def __add__(self, other: Strategy | Iterable[Strategy]) -> Chain:
        return chain(self, other)

    def __radd__(self, other: Strategy | Iterable[Strategy]) -> Chain:
        return chain(other, self)


@attrs.frozen
class Chain(Strategy):
    """Strategies planned together: the engine combines what each allows."""

    strategies: tuple[Strategy, ...]
    name: ClassVar[str] = "chain"

    def __iter__(self) -> Iterator[Strategy]:
        return iter(self.strategies)

    def __len__(self) -> int:
        return len(self.strategies)


def chain(*strategies: Strategy | Iterable[Strategy]) -> Chain:
    """Compose strategies (or lists / chains of them) into one flat :class:`Chain`."""
    flat: list[Strategy] = []

    def add(item: Any) -> None:
        if isinstance(item, Chain):
            flat.extend(item.strategies)
        elif isinstance(item, Strategy):
            flat.append(item)
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            for sub in item:
                add(sub)
        else:
            raise InvalidInputError(f"not a strategy: {item!r} (subclass trimkit.strategies.Strategy)")

    for s in strategies:
        add(s)
    return Chain(tuple(flat))
