"""The planning engine: keep the most value whose predicted TTFT fits the budget.

Strategies (:mod:`trimkit.strategies`) say *what may change*: which history turns may go, which
chunks may be dropped or cut to an excerpt, which summary or earlier cut may stand in for the
oldest turns. This engine decides *what does change*, in one pass:

1. Every optional item gets a value (:mod:`trimkit.planning.values`) and a cost in tokens, which the
   profile turns into predicted seconds; pinned content (system messages, the last user turn,
   turns and chunks no strategy may touch) is fixed.
2. The cache decides the rest of the cost. Dropping a turn inside the cached prefix forfeits the
   cache after it, so the engine tries a few *scenarios*: each start of the prompt a strategy
   proposed (the caller's history, a summary of the oldest turns, the previous request's cut)
   with the first ``d`` turns after it kept verbatim (and so cached). Each scenario gives a
   token allowance from the profile (:meth:`~trimkit.profile.Profile.max_new_tokens` after the
   cached prefix) and the room left after the fixed content.
3. In each scenario a knapsack (:func:`knapsack`, below: at most one variant per item,
   a chunk whole or one of its excerpts) picks the items with the most value that fit the room.
   The scenario with the most value wins; ties go to the faster prompt.

The chosen candidate is returned as a :class:`~trimkit.planning.state.PlanState` whose actions name
every removed, summarized or excerpted item with its value and predicted cost. The engine knows
strategies only through what they return (:class:`~trimkit.planning.state.Proposal`), so it does
not import :mod:`trimkit.strategies`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from trimkit.messages import Chunk, message_text
from trimkit.planning.costs import evaluated_tokens
from trimkit.planning.request import Candidate
from trimkit.planning.state import Action, Lead, PlanState, Proposal
from trimkit.planning.values import Excerpt, ValueModel, chunk_values, excerpts_of, index_runs, question_idf, span_label, turn_values

#: capacity resolution of the knapsack: item sizes are rounded up to room / RESOLUTION tokens
RESOLUTION = 512


def knapsack(groups: Sequence[Sequence[tuple[int, float]]], room: int) -> tuple[float, list[int]]:
    """Pick at most one ``(tokens, value)`` variant per group, most total value within ``room``
    tokens. Returns the value and the chosen variant index per group (-1: none).

    Sizes are rounded *up* to ``room / RESOLUTION`` tokens, so a selection never exceeds ``room``.
    """
    chosen = [-1] * len(groups)
    if room <= 0 or not groups:
        return 0.0, chosen
    quantum = max(1, -(-room // RESOLUTION))
    cap = room // quantum
    dp = np.zeros(cap + 1)
    choices = np.full((len(groups), cap + 1), -1, dtype=np.int16)
    sizes = [[-(-w // quantum) for w, _ in variants] for variants in groups]
    for g, variants in enumerate(groups):
        best = dp.copy()
        arg = choices[g]
        for vi, (_, value) in enumerate(variants):
            wq = sizes[g][vi]
            if wq > cap or value <= 0:
                continue
            cand = dp[: cap + 1 - wq] + value
            seg = best[wq:]
            better = cand > seg + 1e-12
            seg[better] = cand[better]
            arg[wq:][better] = vi
        dp = best
    c = cap
    for g in range(len(groups) - 1, -1, -1):
        vi = int(choices[g][c])
        if vi >= 0:
            chosen[g] = vi
            c -= sizes[g][vi]
    return float(dp[cap]), chosen


# Lead and Proposal are defined in trimkit.planning.state; importable from here as before.
__all__ = ["solve", "Lead", "Proposal"]

#: scenarios tried per start of the prompt (how many leading turns to keep cached)
MAX_KEEP_SCENARIOS = 6
#: exact counts spent putting back chunks the additive estimates left out
MAX_REFILL_COUNTS = 4
#: times a scenario's room shrinks when its choice, estimated again, does not fit
MAX_SCENARIO_TIGHTENINGS = 3
#: how far (tokens) an additive estimate may overcount a chunk at its joins
REFILL_TOLERANCE_TOKENS = 3


@attrs.frozen
class _Item:
    kind: str  # "turn" | "chunk"
    key: Any  # turn position | chunk id
    variants: tuple[tuple[int, float, Any], ...]  # (tokens, value, payload: None | Chunk)


def solve(state: PlanState, strategies: Sequence[Any], values: ValueModel) -> PlanState:
    """The candidate with the most value that fits ``state``'s target, or ``state`` itself
    (not fitting) when nothing the strategies allow can make it fit.

    ``strategies`` are :class:`~trimkit.strategies.Strategy` objects: each ``propose(state)``
    says what may change; one whose ``edits_prompt`` is true edits the prompt itself when
    called, and is applied in order before the engine chooses."""
    ctx = state.ctx
    proposals: list[tuple[str, Proposal]] = []
    for s in strategies:
        if getattr(s, "edits_prompt", False):  # a user's edit: applied in order, before the engine chooses
            if not state.fits:
                state = s(state) or state
            continue
        p = s.propose(state)
        if p is not None:
            proposals.append((s.name, p))
    notes = tuple(a for _, p in proposals for a in p.notes)
    state = PlanState(ctx, state.candidate, (*state.actions, *notes))  # a probe may have changed the prediction
    if state.fits:
        return state
    return _Solver(state, proposals, values).best() or state


class _Solver:
    def __init__(self, state: PlanState, proposals: list[tuple[str, Proposal]], values: ValueModel) -> None:
        self.state = state
        self.ctx = ctx = state.ctx
        self.values = values
        c0 = state.candidate
        self.base = c0
        turns = ctx.history_turns
        droppable_turns = frozenset().union(*(p.droppable_turns for _, p in proposals))
        self.turn_owner = next((n for n, p in proposals if p.droppable_turns), "drop_oldest_turns")
        self.chunk_owner = next((n for n, p in proposals if p.droppable_chunks), "cap_rag_chunks")
        self.droppable_turns = frozenset(j for j in droppable_turns if 0 <= j < len(turns) and turns[j][0] not in c0.gone)
        present = {str(ch.id): ch for ch in c0.kept_chunks}
        self.droppable_chunks = frozenset().union(*(p.droppable_chunks for _, p in proposals)) & present.keys()
        excerptable = frozenset().union(*(p.excerpt_chunks for _, p in proposals)) & self.droppable_chunks
        self.leads = [Lead(0, None, "")] + [lead for _, p in proposals for lead in p.leads if 0 < lead.covers <= len(turns)]
        question = message_text(ctx.messages[ctx.last_user])
        self.turn_value = turn_values(ctx.messages, turns, question, values)
        self.chunk_value = chunk_values(ctx.given_chunks, question, values)  # the retriever's order counts
        self.pinned_chunks = tuple(ch for ch in c0.kept_chunks if str(ch.id) not in self.droppable_chunks)
        # chunk items: whole, or one of its excerpts
        self.chunk_items: list[_Item] = []
        idf = question_idf(question, ctx.chunks) if excerptable else {}
        for ch in c0.kept_chunks:
            cid = str(ch.id)
            if cid not in self.droppable_chunks:
                continue
            v = self.chunk_value.get(cid, 0.0)
            variants: list[tuple[int, float, Any]] = [(self._chunk_cost(ch), v, ch)]
            if cid in excerptable:
                for ex in excerpts_of(ch, idf):
                    variants.append((self._chunk_cost(ex.chunk), v * ex.value_share, ex))
            self.chunk_items.append(_Item("chunk", cid, tuple(variants)))

    def _chunk_cost(self, chunk: Chunk) -> int:
        ctx = self.ctx
        return ctx.chunk_tokens([chunk]) - ctx.chunk_overhead + ctx.chunk_separator

    def _allowance(self, cached_tokens: int, extra_s: float) -> int | None:
        """The most prompt tokens that fit the target (and the context window) with
        ``cached_tokens`` cached; None when not even one new token fits."""
        allowance = self.state.token_allowance(cached_tokens, extra_s)
        if allowance is not None and self.ctx.max_prompt_tokens is not None:
            allowance = min(allowance, self.ctx.max_prompt_tokens)
        return allowance

    # -- scenarios ------------------------------------------------------------------------------
    def best(self) -> PlanState | None:
        found: tuple[float, float, Candidate, Lead] | None = None
        for lead in self.leads:
            for keep in self._keep_options(lead):
                result = self._scenario(lead, keep)
                if result is None:
                    continue
                value, candidate = result
                ttft = self.ctx.estimate(candidate).ttft_s
                tie = found is not None and abs(value - found[0]) <= 1e-9 and abs(ttft - found[1]) <= 1e-9
                if (
                    found is None
                    or value > found[0] + 1e-9
                    or (value >= found[0] - 1e-9 and ttft < found[1] - 1e-9)
                    or (tie and lead.covers > 0 and candidate == found[2])  # name the start that explains the cache
                ):
                    found = (value, ttft, candidate, lead)
        if found is None:
            return None
        _, _, candidate, lead = found
        return self._explain(self._refill(candidate), lead)

    def _refill(self, c: Candidate) -> Candidate:
        """Put back chunks (whole, or an excerpt) that fit after all by an exact count.

        Per-chunk token counts are additive estimates, a token or two pessimistic at joins; the
        exact count of the chosen prompt can leave room. The most valuable chunks dropped or cut
        are tried, a few exact counts at most."""
        ctx = self.ctx
        if not self.chunk_items:
            return c
        exact = ctx.exact_tokens(c)
        allowance = self._allowance(ctx.cached_for(ctx.layout(c), exact), c.extra_s)
        if allowance is None or exact >= allowance:
            return c
        kept = {str(ch.id): ch for ch in c.kept_chunks}
        # each option priced additively (its variant's tokens less those of what it replaces):
        # linear in the chunks; only the few tried are built in order and counted exactly
        options: list[tuple[float, int, Chunk]] = []
        for it in self.chunk_items:
            current = kept.get(it.key)
            now_v, now_w = 0.0, 0
            if current is not None:
                now_w, now_v = next(((w, v) for w, v, p in it.variants if _variant_text(p) == current.text), (0, 0.0))
            options += [(v - now_v, w - now_w, _variant_chunk(p)) for w, v, p in it.variants if v > now_v + 1e-12]
        options.sort(key=lambda o: -o[0])
        tries = 0
        upgraded: set[str] = set()
        position = {str(x.id): i for i, x in enumerate(self.base.kept_chunks)}
        for _, delta, ch in options:
            cid = str(ch.id)
            if cid in upgraded:
                continue
            if exact + delta - REFILL_TOLERANCE_TOKENS > allowance:
                continue
            if tries >= MAX_REFILL_COUNTS:
                break
            tries += 1
            trial_kept = {**kept, cid: ch}
            order = tuple(trial_kept[k] for k in sorted(trial_kept, key=position.__getitem__))
            trial = attrs.evolve(c, kept_chunks=order)
            trial_exact = ctx.exact_tokens(trial)
            # a chunk put back ahead of the others can end the cached prefix earlier: price it with its own
            trial_allowance = self._allowance(ctx.cached_for(ctx.layout(trial), trial_exact), trial.extra_s)
            if trial_allowance is not None and trial_exact <= trial_allowance:
                c, exact, kept = trial, trial_exact, trial_kept
                upgraded.add(cid)
        return c

    def _lead_candidate(self, lead: Lead, keep: int) -> Candidate:
        """The scenario's fixed part: the lead, turns ``[covers, keep)`` verbatim, pinned chunks,
        every other droppable turn out."""
        turns = self.ctx.history_turns
        covered = frozenset(i for s, e in turns[: lead.covers] for i in range(s, e))
        optional = frozenset(
            i for j, (s, e) in enumerate(turns) if j >= max(keep, lead.covers) and j in self.droppable_turns for i in range(s, e)
        )
        c = self.base
        if lead.summary is not None:
            c = attrs.evolve(c, summarized=c.summarized | covered, summary=lead.summary, extra_s=c.extra_s + lead.extra_s)
            removed = c.removed | optional
        else:
            removed = c.removed | covered | optional
        return attrs.evolve(c, removed=removed - c.summarized, kept_chunks=self.pinned_chunks)

    def _keep_options(self, lead: Lead) -> list[int]:
        """How many leading turns after the lead to keep verbatim: from none to all that lie in
        the predicted cached prefix (a few points between), and all of them."""
        ctx = self.ctx
        turns = ctx.history_turns
        start = lead.covers
        full = self._lead_candidate(lead, len(turns))
        cached = ctx.estimate(full).cached_tokens
        if cached <= 0:
            return [start]
        offsets: dict[Any, int] = {}
        pos = 0
        for key, n in ctx.layout(full):
            pos += n
            offsets[key] = pos
        last = start
        for j in range(start, len(turns)):
            end = offsets.get(turns[j][1] - 1)
            if end is None or end > cached:
                break
            last = j + 1
        # and every turn: the offsets above add per-message counts, which overcount a token or so
        # at each join, so over a long history the last cached turns can look uncached
        if last == start:
            return sorted({start, len(turns)})
        span = last - start
        steps = min(span, MAX_KEEP_SCENARIOS - 1)
        return sorted({start + round(i * span / steps) for i in range(steps + 1)} | {len(turns)})

    def _scenario(self, lead: Lead, keep: int) -> tuple[float, Candidate] | None:
        """The most valuable candidate of one scenario that fits, or None.

        The room is priced with the fixed part's cached prefix; what the knapsack adds can end
        that prefix earlier (chunks go into the last user turn, whose start the previous prompt
        may share), so the chosen candidate is estimated again and, while it does not fit, the
        room becomes what the fixed part leaves under the prefix the choice really keeps cached
        (:data:`MAX_SCENARIO_TIGHTENINGS` times at most). When no choice with chunks fits, the
        turns alone are chosen, and failing that the fixed part alone, which fits whenever the
        scenario has room at all."""
        ctx = self.ctx
        fixed_c = self._lead_candidate(lead, keep)
        est = ctx.estimate(fixed_c)
        allowance = self._allowance(est.cached_tokens, fixed_c.extra_s)
        if allowance is None:
            return None
        room0 = room = allowance - est.prompt_tokens
        if room0 < 0:
            return None
        fixed_value = self._fixed_value(lead, keep)
        for _ in range(MAX_SCENARIO_TIGHTENINGS + 1):
            if room < 0:
                break
            value, candidate = self._fill(lead, keep, fixed_c, room)
            after = ctx.estimate(candidate)
            if ctx.fits(after.prompt_tokens, after.ttft_s):
                return value + fixed_value, candidate
            # the room the fixed part leaves when the prefix is cached only as far as this choice's
            real = self._allowance(after.cached_tokens, candidate.extra_s)
            if real is None:
                break
            room = min(room - 1, real - est.prompt_tokens)
        value, candidate = self._fill(lead, keep, fixed_c, room0, chunks=False)
        after = ctx.estimate(candidate)
        if ctx.fits(after.prompt_tokens, after.ttft_s):
            return value + fixed_value, candidate
        return (fixed_value, fixed_c) if ctx.fits(est.prompt_tokens, est.ttft_s) else None

    def _fill(self, lead: Lead, keep: int, fixed_c: Candidate, room: int, *, chunks: bool = True) -> tuple[float, Candidate]:
        """The knapsack's choice of optional turns (and, with ``chunks``, chunks) within ``room``
        tokens: ``(value, candidate)``."""
        ctx = self.ctx
        turns = ctx.history_turns
        items = [
            _Item("turn", j, ((sum(ctx.base[i] for i in range(s, e)), self.turn_value[j], None),))
            for j, (s, e) in enumerate(turns)
            if j >= max(keep, lead.covers) and j in self.droppable_turns
        ]
        value, chosen = knapsack([[(w, v) for w, v, _ in it.variants] for it in items], room)
        if chunks and self.chunk_items:
            # the RAG template's own text comes with the first chunk: unless a pinned chunk already
            # paid for it, chunks compete for what is left after it
            shared = 0 if fixed_c.kept_chunks else ctx.chunk_overhead - ctx.chunk_separator
            all_items = items + self.chunk_items
            value2, chosen2 = knapsack([[(w, v) for w, v, _ in it.variants] for it in all_items], room - shared)
            if value2 > value + 1e-12:
                items, value, chosen = all_items, value2, chosen2
        kept_turns: set[int] = set()
        picked: dict[str, Any] = {}
        for it, vi in zip(items, chosen, strict=True):
            if vi < 0:
                continue
            if it.kind == "turn":
                kept_turns.add(it.key)
            else:
                picked[it.key] = _variant_chunk(it.variants[vi][2])
        back = frozenset(i for j in kept_turns for i in range(*turns[j]))
        kept_chunks = tuple(picked.get(str(ch.id), ch) for ch in self.base.kept_chunks if str(ch.id) in picked or ch in self.pinned_chunks)
        return value, attrs.evolve(fixed_c, removed=fixed_c.removed - back, kept_chunks=kept_chunks)

    def _fixed_value(self, lead: Lead, keep: int) -> float:
        """Value of what the scenario keeps without choosing: the lead (a summary is worth a share of
        the turns it covers), turns kept verbatim, and turns no strategy may drop."""
        total = 0.0
        for j, v in enumerate(self.turn_value):
            if j < lead.covers:
                total += v * self.values.summary_share if lead.summary is not None else 0.0
            elif j < keep or j not in self.droppable_turns:
                total += v
        return total + sum(self.chunk_value.get(str(ch.id), 0.0) for ch in self.pinned_chunks)

    # -- the report -----------------------------------------------------------------------------
    def _explain(self, c: Candidate, lead: Lead) -> PlanState:
        ctx = self.ctx
        state = self.state
        after = ctx.estimate(c)
        new0 = evaluated_tokens(after.prompt_tokens, after.cached_tokens)

        def cost_s(tokens: int) -> float:
            p = ctx.profile
            return float(p.predict_prefill_s(new0 + tokens, after.cached_tokens) - p.predict_prefill_s(new0, after.cached_tokens))

        def item(kind_value: float, tokens: int, **extra: Any) -> dict[str, Any]:
            return {**extra, "tokens": tokens, "value": round(kind_value, 4), "cost_s": round(cost_s(tokens), 4)}

        actions: list[Action] = list(state.actions)
        turns = ctx.history_turns
        before_tokens = state.prediction.prompt_tokens
        if lead.covers:
            covered = tuple(i for s, e in turns[: lead.covers] for i in range(s, e))
            span = _span_text(covered)
            if lead.summary is not None:
                sm = lead.summary
                actions.append(Action(
                    strategy=lead.strategy,
                    summary=f"replaced {len(covered)} message(s) in the {lead.covers} oldest turn(s) (messages {span}, "
                    f"{sm.source_tokens:,} tokens) with a {sm.summary_tokens:,}-token {lead.source} summary"
                    + (f", computed inline in {lead.extra_s:.3f} s" if lead.extra_s else ""),
                    summarized_messages=covered,
                    tokens_before=before_tokens,
                    tokens_after=after.prompt_tokens,
                    detail={"turns": lead.covers, "source": lead.source, "summarizer": sm.summarizer,
                            "source_tokens": sm.source_tokens, "summary_tokens": sm.summary_tokens, "inline_s": lead.extra_s},
                ))
            else:
                actions.append(Action(
                    strategy=lead.strategy,
                    summary=f"dropped the {lead.covers} oldest turn(s) (messages {span}), the same cut as the previous "
                    f"request, so {after.cached_tokens:,} cached tokens are reused",
                    removed_messages=covered,
                    tokens_before=before_tokens,
                    tokens_after=after.prompt_tokens,
                    detail={"turns": lead.covers, "cached_tokens": after.cached_tokens},
                ))
        lead_gone = {i for s, e in turns[: lead.covers] for i in range(s, e)}
        dropped = [(j, s, e) for j, (s, e) in enumerate(turns) if s in c.removed and s not in lead_gone and s not in self.base.gone]
        if dropped:
            removed = tuple(i for _, s, e in dropped for i in range(s, e))
            actions.append(Action(
                strategy=self.turn_owner,
                summary=f"dropped {len(dropped)} turn(s) (messages {_span_text(removed)}): the least value per predicted second",
                removed_messages=removed,
                tokens_before=before_tokens,
                tokens_after=after.prompt_tokens,
                detail={"turns": [item(self.turn_value[j], sum(ctx.base[i] for i in range(s, e)), messages=[s, e - 1]) for j, s, e in dropped]},
            ))
        kept = {str(ch.id): ch for ch in c.kept_chunks}
        gone_chunks = [it for it in self.chunk_items if it.key not in kept]
        cut = [it for it in self.chunk_items if it.key in kept and kept[it.key].text != it.variants[0][2].text]
        if gone_chunks:
            ids = tuple(it.key for it in gone_chunks)
            actions.append(Action(
                strategy=self.chunk_owner,
                summary=f"kept {len(c.kept_chunks)} of {len(ctx.chunks)} chunks ({len(cut)} as excerpts); dropped {', '.join(ids)}: "
                "the least value per predicted second",
                removed_chunks=ids,
                tokens_before=before_tokens,
                tokens_after=after.prompt_tokens,
                detail={"kept": list(kept), "dropped": [item(it.variants[0][1], it.variants[0][0], chunk=it.key) for it in gone_chunks]},
            ))
        for it in cut:
            ex = kept[it.key]
            info = ex.metadata.get("excerpt", {})
            spans = span_label(info.get("spans", []))
            tokens = self._chunk_cost(ex)
            share = next((v for w, v, p in it.variants if isinstance(p, Excerpt) and p.chunk.text == ex.text), 0.0)
            actions.append(Action(
                strategy="excerpt_chunk",
                summary=f"kept sentences {spans} of {info.get('sentences', '?')} of {it.key} (those matching the question, "
                f"with their neighbours): {it.variants[0][0] - tokens:,} of {it.variants[0][0]:,} tokens cut",
                tokens_before=before_tokens,
                tokens_after=after.prompt_tokens,
                detail={"chunk": it.key, "spans": info.get("spans", []), "sentences": info.get("sentences"),
                        **item(share, tokens), "whole_tokens": it.variants[0][0], "whole_value": round(it.variants[0][1], 4)},
            ))
        return PlanState(ctx, c, tuple(actions))


def _variant_chunk(payload: Any) -> Chunk:
    return payload.chunk if isinstance(payload, Excerpt) else payload


def _variant_text(payload: Any) -> str:
    return _variant_chunk(payload).text


def _span_text(indices: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` → ``"1–3, 5"``."""
    return span_label(index_runs(indices))
