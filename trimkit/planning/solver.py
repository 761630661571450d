"""The solver: the request as the planner sees it, the state strategies work on, and the search that keeps the most value
whose predicted TTFT fits the budget (docs/design.md §3–4)."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from trimkit.errors import InvalidInputError, budget, count, fraction
from trimkit.messages import (
    DEFAULT_RAG_CHUNK_TEMPLATE,
    DEFAULT_RAG_TEMPLATE,
    SYSTEM_ROLES,
    Chunk,
    append_text,
    check_rag_templates,
    coerce_chunks,
    in_prompt_order,
    last_user_index,
    message_text,
    turn_spans,
    validate_messages,
    with_chunks,
)
from trimkit.planning.costs import CacheState, evaluated_tokens, reusable_cached_tokens
from trimkit.planning.summaries import Summary, SummaryCache, summary_note
from trimkit.planning.values import ValueModel, chunk_values, excerpts_of, index_runs, rank_chunks, span_label, text_idf, turn_values

log = logging.getLogger("trimkit")
#: exact cached counts one plan looks up in the engine's cache state: each tokenizes the whole candidate prompt
MAX_PROBES = 2
#: A prompt as (segment key, tokens) pairs in prompt order; equal keys mean equal text.
Layout = tuple[tuple[Hashable, int], ...]


@attrs.frozen
class Candidate:
    """A candidate prompt, as edits of the caller's request."""

    kept_chunks: tuple[Chunk, ...] = ()
    removed: frozenset[int] = frozenset()
    summarized: frozenset[int] = frozenset()
    summary: Summary | None = None
    extra_s: float = 0.0

    gone: frozenset[int] = attrs.field(init=False, eq=False, repr=False)
    """Indices not sent verbatim (removed or summarized)."""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "gone", self.removed | self.summarized)

    @property
    def unchanged(self) -> bool:
        """No message is dropped or summarized and no chunk placed: the caller's request as given."""
        return not self.kept_chunks and not self.gone and self.summary is None


@attrs.frozen
class Estimate:
    """Predicted size and TTFT of a candidate. ``cached_tokens`` is the prefix predicted to be in
    the KV cache; ``ttft_s`` includes the candidate's inline work."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _summary_block(summary: Summary) -> str:
    """The summary as appended to the first system message."""
    return f"\n\n{summary_note(summary)}"


class RequestContext:
    """Everything fixed for one request, computed once: inputs, per-message token counts, turns, what is known about the
    engine's KV cache (the caller's ``cached_tokens`` and ``cache``), and the prices of candidate prompts."""

    def __init__(self, messages: Sequence[Mapping[str, Any]], *, ttft_budget_s: float, profile: Any, tokenizer: Any, rag_chunks: Any = (),
                 tools: Any = None, cached_tokens: int = 0, cache: CacheState | None = None, summaries: SummaryCache | None = None,
                 rag_template: str = DEFAULT_RAG_TEMPLATE, rag_chunk_template: str = DEFAULT_RAG_CHUNK_TEMPLATE,
                 clock: Callable[[], float] = time.perf_counter, safety_margin: float | None = None, max_prompt_tokens: int | None = None,
                 on_infeasible: str = "best_effort", values: Any = None) -> None:
        """The one place that checks :func:`~trimkit.planning.planner.plan`'s arguments, before any work."""
        if on_infeasible not in ("best_effort", "raise"):
            raise InvalidInputError(f"on_infeasible must be 'best_effort' or 'raise', got {on_infeasible!r}")
        validate_messages(messages)
        budget(ttft_budget_s)
        chunks = coerce_chunks(rag_chunks)
        count(cached_tokens, "cached_tokens")
        for name, value, kind, shown in (("cache", cache, CacheState, "trimkit.planning.costs.CacheState"), ("summaries", summaries, SummaryCache, "SummaryCache"),
                                         ("values", values, ValueModel, "trimkit.planning.values.ValueModel")):
            if value is not None and not isinstance(value, kind):
                raise InvalidInputError(f"{name} must be a {shown} or None, got {type(value).__name__}")
        if safety_margin is not None:
            fraction(safety_margin, "safety_margin")
        if max_prompt_tokens is not None:
            count(max_prompt_tokens, "max_prompt_tokens", minimum=1)
        check_rag_templates(rag_template, rag_chunk_template)
        current = getattr(profile, "current", None)
        if current is not None and hasattr(current, "predict_ttft_s"):
            profile = current
        for attr in ("predict_ttft_s", "max_new_tokens", "safety_margin"):
            if not hasattr(profile, attr):
                raise InvalidInputError(f"profile must be a Profile (no {attr!r}), got {type(profile).__name__}")
        for attr in ("segment_counts", "count", *(("prompt_tokens",) if cache is not None else ())):
            if not hasattr(tokenizer, attr):
                raise InvalidInputError(f"tokenizer must be a PromptTokenizer (no {attr!r}), got {type(tokenizer).__name__}")
        self.messages = messages
        self.tools = tools
        self.budget_s = float(ttft_budget_s)
        self.profile = profile
        self.safety_margin = float(profile.safety_margin if safety_margin is None else safety_margin)
        #: the budget less the safety margin: what a prediction must fit
        self.target_s = self.budget_s * (1.0 - self.safety_margin)
        #: the most prompt tokens the context window takes (n_ctx less max_tokens), if known
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = tokenizer
        self.summaries = summaries
        self.cache = cache
        self.rag_template = rag_template
        self.rag_chunk_template = rag_chunk_template
        self.clock = clock
        self.last_user = last_user_index(messages)
        self.leading_system = messages[0].get("role") in SYSTEM_ROLES
        segments = tokenizer.segment_counts(messages, tools)
        self.base = segments.counts
        self.tail = segments.tail
        spans = turn_spans(messages)
        protected_from = next(s for s, e in spans if s <= self.last_user < e)
        #: ``[start, end)`` spans of the turns that may be summarized or dropped, oldest first (never the last user's turn)
        self.history_turns: tuple[tuple[int, int], ...] = tuple((s, e) for s, e in spans if e <= protected_from)
        #: every chunk of the request, most relevant first (:func:`~trimkit.planning.values.rank_chunks`)
        self.chunks = rank_chunks(chunks, message_text(messages[self.last_user])) if chunks else ()
        #: the chunks in the caller's (the retriever's) order, which relevance weighs
        self.given_chunks = chunks
        self._chunk_costs: dict[tuple[str | None, int, str], int] = {}
        self.chunk_overhead = tokenizer.count(rag_template.format(chunks="", question="")) if chunks else 0
        self.chunk_separator = tokenizer.count("\n\n") if chunks else 0
        #: tokens added to every estimate after a plan's estimates proved optimistic
        self.correction = 0
        #: the ``cached_tokens`` the caller passed (for ``messages`` as given)
        self.caller_cached_tokens = cached_tokens
        caller_layout: Layout = tuple((i, n) for i, n in enumerate(self.base)) + (("tail", self.tail),)
        self.knowledge: list[tuple[Layout, int]] = [(caller_layout, cached_tokens)]
        self.probed: dict[tuple[Hashable, ...], int] = {}
        self.probes_used = 0

    def message_tokens(self, index: int) -> int:
        """Tokens of the caller's message ``index`` as rendered (its template wrapper included)."""
        return self.base[index]

    # -- token costs of edited messages (additive estimates; the final prompt is counted exactly)
    def chunk_tokens(self, chunks: Sequence[Chunk]) -> int:
        """Tokens ``chunks`` add to the last user message (template text and separators included)."""
        if not chunks:
            return 0
        total = self.chunk_overhead + self.chunk_separator * (len(chunks) - 1)
        for n, c in enumerate(chunks, start=1):
            key = (c.id, n, c.text)  # text too: a chunk cut at a sentence boundary keeps its id
            if key not in self._chunk_costs:
                self._chunk_costs[key] = self.tokenizer.count(self.rag_chunk_template.format(id=c.shown_id, text=c.text, n=n))
            total += self._chunk_costs[key]
        return total

    def summary_tokens(self, summary: Summary) -> int:
        """Tokens the summary adds (a system message of its own when the request has none)."""
        return self.tokenizer.count(_summary_block(summary)) + (0 if self.leading_system else self._system_overhead)

    @functools.cached_property
    def _system_overhead(self) -> int:
        """Tokens of an empty system message, as the template wraps it."""
        return int(self.tokenizer.segment_counts([{"role": "system", "content": ""}]).counts[0])

    def layout(self, c: Candidate) -> Layout:
        """The candidate as (segment key, tokens) pairs in prompt order; equal keys mean equal text."""
        summary_tokens = self.summary_tokens(c.summary) if c.summary is not None else 0
        segs: list[tuple[Hashable, int]] = [(("summary", c.summary.text), summary_tokens)] if c.summary is not None and not self.leading_system else []
        for i, n in enumerate(self.base):
            if i in c.gone:
                continue
            if i == 0 and c.summary is not None and self.leading_system:
                segs.append((("summary", c.summary.text), n + summary_tokens))
            elif i == self.last_user and c.kept_chunks:
                segs.append((("chunks", tuple(ch.id for ch in c.kept_chunks)), n + self.chunk_tokens(c.kept_chunks)))
            else:
                segs.append((i, n))
        segs.append(("tail", self.tail))
        return tuple(segs)

    def cached_for(self, layout: Layout, total: int) -> int:
        """Predicted cached prefix: exact if this very prompt was probed; else, over everything
        known, the cached tokens of the longest prefix shared with a prompt whose count is known."""
        cached = self.probed.get(tuple(k for k, _ in layout))
        if cached is None:
            cached = max((min(known_cached, sum(seg[1] for seg, _ in itertools.takewhile(lambda p: p[0][0] == p[1][0], zip(layout, known))))
                          for known, known_cached in self.knowledge), default=0)
        return reusable_cached_tokens(total, cached)

    def predict(self, tokens: int, cached: int, extra_s: float = 0.0) -> float:
        """Predicted TTFT of a ``tokens`` prompt with ``cached`` of them in the KV cache, plus ``extra_s`` of inline work."""
        cached = reusable_cached_tokens(tokens, cached)
        return float(self.profile.predict_ttft_s(tokens - cached, cached) + extra_s)

    def fits(self, tokens: int, predicted_s: float) -> bool:
        """A ``tokens`` prompt predicted at ``predicted_s`` is within the target (and, when known, the context window)."""
        return predicted_s <= self.target_s and (self.max_prompt_tokens is None or tokens <= self.max_prompt_tokens)

    def token_allowance(self, cached_tokens: int, extra_s: float = 0.0) -> int | None:
        """The most prompt tokens that fit the target (and, when known, the context window) when ``cached_tokens`` of them
        are cached, or None if not even one new token fits."""
        new = self.profile.max_new_tokens(self.target_s - extra_s, cached_tokens)
        # the inverse is found by bisection on seconds; agree exactly with the forward prediction
        for _ in range(2):
            if self.profile.predict_ttft_s(new + 1, cached_tokens) + extra_s <= self.target_s:
                new += 1
        if new <= 0:
            return None
        return cached_tokens + new if self.max_prompt_tokens is None else min(cached_tokens + new, self.max_prompt_tokens)

    def estimate(self, c: Candidate) -> Estimate:
        """Predicted size, cached prefix and TTFT of ``c`` (no tokenization of unchanged text)."""
        layout = self.layout(c)
        total = sum(n for _, n in layout) + self.correction
        cached = self.cached_for(layout, total)
        return Estimate(total, cached, self.predict(total, cached, c.extra_s))

    def build_messages(self, c: Candidate) -> list[dict[str, Any]]:
        """The concrete message list for a candidate (new dicts only where something changed). The caller's list itself
        when nothing changes."""
        if c.unchanged:
            return self.messages  # type: ignore[return-value]
        out: list[Any] = [{"role": "system", "content": summary_note(c.summary)}] if c.summary is not None and not self.leading_system else []
        for i, m in enumerate(self.messages):
            if i in c.gone:
                continue
            if i == 0 and c.summary is not None and self.leading_system:
                m = append_text(m, _summary_block(c.summary))
            elif i == self.last_user and c.kept_chunks:
                m = with_chunks(m, in_prompt_order(c.kept_chunks), self.rag_template, self.rag_chunk_template)
            out.append(m)
        return out

    def exact_tokens(self, c: Candidate) -> int:
        """The candidate's prompt counted through the template (cached per message)."""
        if c.unchanged:
            return sum(self.base) + self.tail  # the caller's request, counted at the start
        return self.tokenizer.segment_counts(self.build_messages(c), self.tools).total

    def probe(self, c: Candidate) -> int | None:
        """How many tokens of ``c`` the engine has cached, exactly: ``c`` tokenized and looked up in :attr:`cache` (data:
        the engine is not asked), at most :data:`MAX_PROBES` times per request, memoised; None when there is no cache
        state, the allowance is spent or the tokenizer failed (it is an optimisation and never fails a request)."""
        if self.cache is None:
            return None
        layout = self.layout(c)
        keys = tuple(k for k, _ in layout)
        if keys in self.probed or self.probes_used >= MAX_PROBES:
            return self.probed.get(keys)
        self.probes_used += 1
        try:
            tokens = self.tokenizer.prompt_tokens(self.build_messages(c), self.tools)
        except Exception as exc:  # the lookup is an optimisation; never fail a request for it
            log.warning("counting a candidate's cached prefix failed (%s: %s); estimating it instead", type(exc).__name__, exc)
            return None
        cached = self.cache.cached(tokens, getattr(self.profile, "predict_prefill_s", None))
        self.probed[keys] = cached
        self.knowledge.append((layout, cached))
        return cached


@attrs.frozen
class Action:
    """One thing a strategy did, for the report. Indices refer to the caller's message list;
    chunks are named by id. Token counts are the prompt's (estimated) size before and after."""

    strategy: str
    summary: str
    removed_messages: tuple[int, ...] = ()
    summarized_messages: tuple[int, ...] = ()
    removed_chunks: tuple[str, ...] = ()
    tokens_before: int = 0
    tokens_after: int = 0
    detail: Mapping[str, Any] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        return {k: list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v for k, v in out.items()}

    def __str__(self) -> str:
        return f"{self.strategy}: {self.summary}"


@attrs.frozen
class Lead:
    """A different start of the prompt: the ``covers`` oldest history turns replaced by
    ``summary`` (summarized) or, with no summary, dropped (e.g. the previous request's cut)."""

    covers: int
    summary: Summary | None
    strategy: str
    source: str = ""
    extra_s: float = 0.0


@attrs.frozen
class Proposal:
    """What one strategy allows: turns (positions in ``state.history_turns``) that may be
    dropped, chunk ids that may be dropped and cut to excerpts, alternative starts of the
    prompt, and notes (actions that removed nothing, e.g. a probed cache) for the report."""

    droppable_turns: frozenset[int] = frozenset()
    droppable_chunks: frozenset[str] = frozenset()
    excerpt_chunks: frozenset[str] = frozenset()
    leads: tuple[Lead, ...] = ()
    notes: tuple[Action, ...] = ()


@attrs.frozen
class PlanState:
    """What every strategy receives: the current candidate, its prediction and the actions so far. What is fixed for the
    request is read through to it (:class:`RequestContext`: ``messages``, ``chunks``, ``history_turns``, ``budget_s``,
    ``target_s``, ``profile``, ``tokenizer``, ``summaries``, ``clock``, ``caller_cached_tokens``, ``message_tokens(i)``,
    ``estimate(c)``, ``token_allowance(cached)``, ``probe(c)``, ``build_messages(c)``)."""

    ctx: RequestContext = attrs.field(repr=False)
    candidate: Candidate
    actions: tuple[Action, ...] = ()
    prediction: Estimate = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "prediction", self.ctx.estimate(self.candidate))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "ctx":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.ctx, name)

    @classmethod
    def start(cls, messages: Sequence[Mapping[str, Any]], **options: Any) -> PlanState:
        """The initial state (:class:`RequestContext`'s arguments, checked there): the whole request, every chunk kept (most
        relevant first)."""
        ctx = RequestContext(messages, **options)
        return cls(ctx, Candidate(kept_chunks=ctx.chunks))

    @property
    def fits(self) -> bool:
        """The current prediction is within the target (and, when known, the context window)."""
        return self.ctx.fits(self.prediction.prompt_tokens, self.prediction.ttft_s)

    def apply(self, candidate: Candidate, action: Action | None) -> PlanState:
        """A new state with ``candidate`` as the current prompt and ``action`` recorded."""
        actions = self.actions if action is None else (*self.actions, action)
        return PlanState(self.ctx, candidate, actions)


#: capacity resolution of the knapsack: item sizes are rounded up to room / RESOLUTION tokens
RESOLUTION = 512


def knapsack(groups: Sequence[Sequence[tuple[int, float]]], room: int) -> tuple[float, list[int]]:
    """Pick at most one ``(tokens, value)`` variant per group, most total value within ``room`` tokens: the value and the
    chosen variant index per group (-1: none). Sizes round *up* to ``room / RESOLUTION``: a choice never exceeds ``room``."""
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
        for vi, ((_, value), wq) in enumerate(zip(variants, sizes[g], strict=True)):
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
    key: Any  # turn position | chunk id
    variants: tuple[tuple[int, float, Any], ...]  # (tokens, value, the chunk or excerpt as a Chunk; None for a turn)


def solve(state: PlanState, strategies: Sequence[Any], values: ValueModel) -> PlanState:
    """The candidate with the most value that fits ``state``'s target, or ``state`` itself (not fitting) when nothing the
    strategies allow can make it fit."""
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
        self.base = c0 = state.candidate
        turns = ctx.history_turns
        self.turn_owner = next((n for n, p in proposals if p.droppable_turns), "drop_oldest_turns")
        self.chunk_owner = next((n for n, p in proposals if p.droppable_chunks), "cap_rag_chunks")
        self.droppable_turns = frozenset(j for _, p in proposals for j in p.droppable_turns if 0 <= j < len(turns) and turns[j][0] not in c0.gone)
        self.droppable_chunks = frozenset().union(*(p.droppable_chunks for _, p in proposals)) & {str(ch.id) for ch in c0.kept_chunks}
        excerptable = frozenset().union(*(p.excerpt_chunks for _, p in proposals)) & self.droppable_chunks
        self.leads = [Lead(0, None, "")] + [lead for _, p in proposals for lead in p.leads if 0 < lead.covers <= len(turns)]
        question = message_text(ctx.messages[ctx.last_user])
        self.turn_value = turn_values(ctx.messages, turns, question, values)
        self.chunk_value = chunk_values(ctx.given_chunks, question, values)  # the retriever's order counts
        self.pinned_chunks = tuple(ch for ch in c0.kept_chunks if str(ch.id) not in self.droppable_chunks)
        self.turn_items = [_Item(j, ((sum(ctx.base[i] for i in range(s, e)), self.turn_value[j], None),))
                           for j, (s, e) in enumerate(turns) if j in self.droppable_turns]
        # chunk items: whole, or one of its excerpts
        self.chunk_items: list[_Item] = []
        idf = text_idf(question, [c.text for c in ctx.chunks]) if excerptable else {}
        for ch in (ch for ch in c0.kept_chunks if str(ch.id) in self.droppable_chunks):
            v = self.chunk_value.get(str(ch.id), 0.0)
            excerpts = [(ex.chunk, v * ex.value_share) for ex in (excerpts_of(ch, idf) if str(ch.id) in excerptable else [])]
            self.chunk_items.append(_Item(str(ch.id), tuple((self._chunk_cost(x), xv, x) for x, xv in [(ch, v), *excerpts])))

    def _chunk_cost(self, chunk: Chunk) -> int:
        ctx = self.ctx
        return ctx.chunk_tokens([chunk]) - ctx.chunk_overhead + ctx.chunk_separator

    def best(self) -> PlanState | None:
        found: tuple[float, float, Candidate, Lead] | None = None
        for lead in self.leads:
            for keep in self._keep_options(lead):
                result = self._scenario(lead, keep)
                if result is None:
                    continue
                value, candidate = result
                ttft = self.ctx.estimate(candidate).ttft_s
                if found is None or value > found[0] + 1e-9 or (value >= found[0] - 1e-9 and ttft < found[1] - 1e-9):
                    found = (value, ttft, candidate, lead)
                elif lead.covers > 0 and candidate == found[2] and abs(value - found[0]) <= 1e-9 and abs(ttft - found[1]) <= 1e-9:
                    found = (value, ttft, candidate, lead)  # a tie: name the start that explains the cache
        if found is None:
            return None
        _, _, candidate, lead = found
        return self._explain(self._refill(candidate), lead)

    def _refill(self, c: Candidate) -> Candidate:
        """Put back chunks (whole, or an excerpt) that fit after all by an exact count: per-chunk counts are additive
        estimates, a token or two pessimistic at joins, so the chosen prompt's exact count can leave room."""
        ctx = self.ctx
        if not self.chunk_items:
            return c

        def priced(x: Candidate) -> tuple[int, int | None]:
            """Its exact count, and the allowance its own cached prefix leaves."""
            exact = ctx.exact_tokens(x)
            return exact, ctx.token_allowance(ctx.cached_for(ctx.layout(x), exact), x.extra_s)

        exact, allowance = priced(c)
        if allowance is None or exact >= allowance:
            return c
        kept = {str(ch.id): ch for ch in c.kept_chunks}
        # each option priced additively (its variant's tokens less those of what it replaces):
        # linear in the chunks; only the few tried are built in order and counted exactly
        options: list[tuple[float, int, Chunk]] = []
        for it in self.chunk_items:
            current = kept.get(it.key)
            now_w, now_v = next(((w, v) for w, v, p in it.variants if current is not None and p.text == current.text), (0, 0.0))
            options += [(v - now_v, w - now_w, p) for w, v, p in it.variants if v > now_v + 1e-12]
        options.sort(key=lambda o: -o[0])
        tries = 0
        upgraded: set[str] = set()
        position = {str(x.id): i for i, x in enumerate(self.base.kept_chunks)}
        for _, delta, ch in options:
            cid = str(ch.id)
            if cid in upgraded or exact + delta - REFILL_TOLERANCE_TOKENS > allowance:
                continue
            if tries >= MAX_REFILL_COUNTS:
                break
            tries += 1
            trial_kept = {**kept, cid: ch}
            trial = attrs.evolve(c, kept_chunks=tuple(trial_kept[k] for k in sorted(trial_kept, key=position.__getitem__)))
            # a chunk put back ahead of the others can end the cached prefix earlier: price it with its own
            trial_exact, trial_allowance = priced(trial)
            if trial_allowance is not None and trial_exact <= trial_allowance:
                c, exact, kept = trial, trial_exact, trial_kept
                upgraded.add(cid)
        return c

    def _fixed(self, lead: Lead, keep: int) -> tuple[Candidate, float]:
        """The scenario's fixed part (the lead, turns ``[covers, keep)`` verbatim, pinned chunks, every other droppable turn
        out) and its value: a summary is worth a share of the turns it covers; turns no strategy may drop count whole."""
        turns = self.ctx.history_turns
        covered = frozenset(i for s, e in turns[: lead.covers] for i in range(s, e))
        optional = frozenset(i for j, (s, e) in enumerate(turns) if j >= max(keep, lead.covers) and j in self.droppable_turns for i in range(s, e))
        c = self.base
        if lead.summary is not None:
            c = attrs.evolve(c, summarized=c.summarized | covered, summary=lead.summary, extra_s=c.extra_s + lead.extra_s)
            removed = c.removed | optional
        else:
            removed = c.removed | covered | optional
        share = self.values.summary_share if lead.summary is not None else 0.0
        value = sum(v * share if j < lead.covers else v for j, v in enumerate(self.turn_value) if j < max(keep, lead.covers) or j not in self.droppable_turns)
        value += sum(self.chunk_value.get(str(ch.id), 0.0) for ch in self.pinned_chunks)
        return attrs.evolve(c, removed=removed - c.summarized, kept_chunks=self.pinned_chunks), value

    def _keep_options(self, lead: Lead) -> list[int]:
        """How many leading turns after the lead to keep verbatim: from none to all that lie in
        the predicted cached prefix (a few points between), and all of them."""
        ctx = self.ctx
        turns = ctx.history_turns
        start = lead.covers
        full = self._fixed(lead, len(turns))[0]
        cached = ctx.estimate(full).cached_tokens
        if cached <= 0:
            return [start]
        layout = ctx.layout(full)
        offsets = dict(zip((key for key, _ in layout), itertools.accumulate(n for _, n in layout), strict=True))
        # the turns whose last message ends inside the cached prefix
        last = start + sum(1 for _ in itertools.takewhile(lambda t: offsets.get(t[1] - 1, cached + 1) <= cached, turns[start:]))
        # and every turn: the offsets above add per-message counts, which overcount a token or so
        # at each join, so over a long history the last cached turns can look uncached
        if last == start:
            return sorted({start, len(turns)})
        span = last - start
        steps = min(span, MAX_KEEP_SCENARIOS - 1)
        return sorted({start + round(i * span / steps) for i in range(steps + 1)} | {len(turns)})

    def _scenario(self, lead: Lead, keep: int) -> tuple[float, Candidate] | None:
        """The most valuable candidate of one scenario that fits, or None. What the knapsack adds can end the fixed part's
        cached prefix earlier: while the choice does not fit, the room shrinks to what that prefix leaves; failing that,
        the turns alone are chosen, and failing that the fixed part alone."""
        ctx = self.ctx
        fixed_c, fixed_value = self._fixed(lead, keep)
        start = max(keep, lead.covers)
        est = ctx.estimate(fixed_c)
        allowance = ctx.token_allowance(est.cached_tokens, fixed_c.extra_s)
        if allowance is None or allowance < est.prompt_tokens:
            return None
        room0 = room = allowance - est.prompt_tokens
        for _ in range(MAX_SCENARIO_TIGHTENINGS + 1):
            if room < 0:
                break
            value, candidate = self._fill(start, fixed_c, room)
            after = ctx.estimate(candidate)
            if ctx.fits(after.prompt_tokens, after.ttft_s):
                return value + fixed_value, candidate
            # the room the fixed part leaves when the prefix is cached only as far as this choice's
            real = ctx.token_allowance(after.cached_tokens, candidate.extra_s)
            if real is None:
                break
            room = min(room - 1, real - est.prompt_tokens)
        for room in (room0, 0):  # room 0: the fixed part itself
            value, candidate = self._fill(start, fixed_c, room, chunks=False)
            after = ctx.estimate(candidate)
            if ctx.fits(after.prompt_tokens, after.ttft_s):
                return value + fixed_value, candidate
        return None

    def _fill(self, start: int, fixed_c: Candidate, room: int, *, chunks: bool = True) -> tuple[float, Candidate]:
        """The knapsack's choice of optional turns from ``start`` (and, with ``chunks``, chunks) within ``room``
        tokens: ``(value, candidate)``."""
        ctx = self.ctx
        items = [it for it in self.turn_items if it.key >= start]
        value, chosen = knapsack([[(w, v) for w, v, _ in it.variants] for it in items], room)
        if chunks and self.chunk_items:
            # the RAG template's own text comes with the first chunk: unless a pinned chunk already
            # paid for it, chunks compete for what is left after it
            shared = 0 if fixed_c.kept_chunks else ctx.chunk_overhead - ctx.chunk_separator
            all_items = items + self.chunk_items
            value2, chosen2 = knapsack([[(w, v) for w, v, _ in it.variants] for it in all_items], room - shared)
            if value2 > value + 1e-12:
                items, value, chosen = all_items, value2, chosen2
        picks = [(it.key, it.variants[vi][2]) for it, vi in zip(items, chosen, strict=True) if vi >= 0]
        back = frozenset(i for key, chunk in picks if chunk is None for i in range(*ctx.history_turns[key]))
        picked = {key: chunk for key, chunk in picks if chunk is not None}
        kept_chunks = tuple(picked.get(str(ch.id), ch) for ch in self.base.kept_chunks if str(ch.id) in picked or ch in self.pinned_chunks)
        return value, attrs.evolve(fixed_c, removed=fixed_c.removed - back, kept_chunks=kept_chunks)

    # -- the report -----------------------------------------------------------------------------
    def _explain(self, c: Candidate, lead: Lead) -> PlanState:
        ctx = self.ctx
        after = ctx.estimate(c)
        new0 = evaluated_tokens(after.prompt_tokens, after.cached_tokens)

        def cost_s(tokens: int) -> float:
            p = ctx.profile
            return float(p.predict_prefill_s(new0 + tokens, after.cached_tokens) - p.predict_prefill_s(new0, after.cached_tokens))

        def item(kind_value: float, tokens: int, **extra: Any) -> dict[str, Any]:
            return {**extra, "tokens": tokens, "value": round(kind_value, 4), "cost_s": round(cost_s(tokens), 4)}

        actions: list[Action] = list(self.state.actions)
        turns = ctx.history_turns
        act = functools.partial(Action, tokens_before=self.state.prediction.prompt_tokens, tokens_after=after.prompt_tokens)
        covered = tuple(i for s, e in turns[: lead.covers] for i in range(s, e))
        if lead.covers:
            span = span_label(index_runs(covered))
            if lead.summary is not None:
                sm = lead.summary
                inline = f", computed inline in {lead.extra_s:.3f} s" if lead.extra_s else ""
                actions.append(act(lead.strategy, f"replaced {len(covered)} message(s) in the {lead.covers} oldest turn(s) (messages {span}, "
                                   f"{sm.source_tokens:,} tokens) with a {sm.summary_tokens:,}-token {lead.source} summary{inline}",
                                   summarized_messages=covered, detail={"turns": lead.covers, "source": lead.source, "summarizer": sm.summarizer,
                                   "source_tokens": sm.source_tokens, "summary_tokens": sm.summary_tokens, "inline_s": lead.extra_s}))
            else:
                actions.append(act(lead.strategy, f"dropped the {lead.covers} oldest turn(s) (messages {span}), the same cut as the previous "
                                   f"request, so {after.cached_tokens:,} cached tokens are reused", removed_messages=covered,
                                   detail={"turns": lead.covers, "cached_tokens": after.cached_tokens}))
        dropped = [(j, s, e) for j, (s, e) in enumerate(turns) if s in c.removed and s not in covered and s not in self.base.gone]
        if dropped:
            removed = tuple(i for _, s, e in dropped for i in range(s, e))
            details = [item(self.turn_value[j], sum(ctx.base[i] for i in range(s, e)), messages=[s, e - 1]) for j, s, e in dropped]
            actions.append(act(self.turn_owner, f"dropped {len(dropped)} turn(s) (messages {span_label(index_runs(removed))}): the least value per "
                               "predicted second", removed_messages=removed, detail={"turns": details}))
        kept = {str(ch.id): ch for ch in c.kept_chunks}
        gone_chunks = [it for it in self.chunk_items if it.key not in kept]
        cut = [it for it in self.chunk_items if it.key in kept and kept[it.key].text != it.variants[0][2].text]
        if gone_chunks:
            ids = tuple(it.key for it in gone_chunks)
            actions.append(act(self.chunk_owner, f"kept {len(c.kept_chunks)} of {len(ctx.chunks)} chunks ({len(cut)} as excerpts); dropped "
                               f"{', '.join(ids)}: the least value per predicted second", removed_chunks=ids,
                               detail={"kept": list(kept), "dropped": [item(it.variants[0][1], it.variants[0][0], chunk=it.key) for it in gone_chunks]}))
        for it in cut:
            ex = kept[it.key]
            info = ex.metadata.get("excerpt", {})
            tokens, share = next(((w, v) for w, v, p in it.variants[1:] if p.text == ex.text), (self._chunk_cost(ex), 0.0))
            whole_tokens, whole_value, _ = it.variants[0]
            actions.append(act("excerpt_chunk", f"kept sentences {span_label(info.get('spans', []))} of {info.get('sentences', '?')} of "
                               f"{it.key} (those matching the question, with their neighbours): {whole_tokens - tokens:,} of {whole_tokens:,} tokens cut",
                               detail={"chunk": it.key, "spans": info.get("spans", []), "sentences": info.get("sentences"), **item(share, tokens),
                                       "whole_tokens": whole_tokens, "whole_value": round(whole_value, 4)}))
        return PlanState(ctx, c, tuple(actions))
