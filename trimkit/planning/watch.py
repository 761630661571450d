"""The watched prefill: measure the pace of *this* request while it runs, and decide again (docs/design.md §2 "The watched
prefill"). :class:`PrefillWatch` is the decision, with no I/O; a re-plan first cuts the chunks not evaluated yet
(:func:`cut_chunks`), and only when that cannot fit plans the whole request again. The driver is ``pipeline.WatchedPrefill``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from trimkit.messages import last_user_index, with_chunks
from trimkit.planning.costs import largest_fitting
from trimkit.planning.profile import Profile
from trimkit.planning.tokens import common_prefix_len

#: short, so the pace is read early; long enough that its fixed cost does not swamp it (benchmarks/closed_loop.py)
FIRST_STEP_TOKENS = 64
#: at most this many re-plans a request (each costs a plan: milliseconds)
MAX_REPLANS = 2
#: prompts with fewer new tokens than this are sent unwatched: one step would be the whole prompt
MIN_WATCHED_TOKENS = 2 * FIRST_STEP_TOKENS
#: the pace is read over this many latest steps
PACE_STEPS = 2
#: a request projected this share under its target may put back dropped chunks (a gap against one step's jitter)
AHEAD_SHARE = 0.05


@attrs.frozen
class WatchStep:
    """One step: ``new_tokens`` after ``cached_tokens`` in ``seconds``, against ``predicted_s`` (as planned)."""

    new_tokens: int
    cached_tokens: int
    seconds: float
    predicted_s: float


@attrs.frozen
class Replan:
    """One re-plan, for the report: where it happened, the pace and projection then, and the plan that replaced it;
    ``dropped`` names what it cut, and with a ``+`` what it put back."""

    evaluated_tokens: int
    prompt_tokens: int
    elapsed_s: float
    pace: float
    projected_ttft_s: float
    predicted_ttft_before_s: float
    predicted_ttft_after_s: float
    prompt_tokens_after: int
    dropped: tuple[str, ...] = ()

    def summary(self) -> str:
        gone = [d for d in self.dropped if not d.startswith("+")]
        back = [d[1:] for d in self.dropped if d.startswith("+")]
        dropped = (f"; dropped {', '.join(gone)}" if gone else "") + (f"; put back {', '.join(back)}" if back else "")
        return (f"re-planned after {self.evaluated_tokens:,} of {self.prompt_tokens:,} prompt tokens: this request prefilled at "
                f"{self.pace:.2f}× the predicted time (first token projected at {self.projected_ttft_s:.3f} s); prompt → "
                f"{self.prompt_tokens_after:,} tokens, predicted TTFT {self.predicted_ttft_before_s:.3f} s → "
                f"{self.predicted_ttft_after_s:.3f} s{dropped}")

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


class PrefillWatch:
    """The decisions of one watched prefill; ``margin``: the share of the budget held back for what follows the last step."""

    def __init__(self, tokens: Sequence[int], cached: int, profile: Profile, budget_s: float, *, margin: float, n_batch: int, replans: int = 0) -> None:
        self.tokens = tuple(tokens)
        self.cached = max(min(int(cached), len(self.tokens) - 1), 0)
        self.profile = profile
        self.budget_s = float(budget_s)
        self.margin = float(margin)
        self.n_batch = max(int(n_batch), 1)
        self.first_step_tokens = min(FIRST_STEP_TOKENS, self.n_batch)
        self.replans = replans
        self.steps: list[WatchStep] = []
        self.position = self.cached  # how far the context holds this prompt
        self.origin = self.cached  # where its evaluation began: steps are priced as parts of one prefill from here

    @property
    def watched(self) -> bool:
        """Whether this prompt is long enough to watch (else it is sent in one piece)."""
        return len(self.tokens) - self.cached >= MIN_WATCHED_TOKENS

    def next_end(self) -> int | None:
        """Where the next step ends (a token index), or None when the whole prompt is evaluated."""
        n = len(self.tokens)
        if self.position >= n:
            return None
        size = self.first_step_tokens if not self.steps else self.n_batch
        end = min(self.position + size, n)
        if n - end < self.first_step_tokens:  # never leave a sliver for a step of its own
            end = n
        return end

    def record(self, end: int, seconds: float, start: int | None = None) -> None:
        """The step to ``end`` took ``seconds`` (``start``: if the engine could not keep the prefix up to :attr:`position`)."""
        start = self.position if start is None else start
        self.origin = min(self.origin, start)
        self.steps.append(WatchStep(max(end - start, 1), start, float(seconds), self._part_s(start, end)))
        self.position = end

    def _part_s(self, start: int, end: int) -> float:
        """The predicted time of tokens ``start``–``end`` as a part of one prefill from :attr:`origin`."""
        def upto(i: int) -> float:
            return self.profile.predict_prefill_s(i - self.origin, self.origin) if i > self.origin else 0.0
        return max(upto(end) - upto(start), 0.0)

    @property
    def prefill_so_far(self) -> tuple[int, int, float]:
        """The unbroken run of steps ending at :attr:`position` as one prefill: (new tokens, cached, seconds). Steps whose
        tokens left the prompt after a start-over are no part of it (priced as a few tokens, they skewed the margin)."""
        seconds, start = 0.0, self.position
        for step in reversed(self.steps):
            if step.cached_tokens + step.new_tokens != start:
                break
            seconds += step.seconds
            start = step.cached_tokens
        return self.position - start, start, seconds

    @property
    def pace(self) -> float:
        """Measured ÷ predicted of the latest step if long (half a batch or more), else of the last :data:`PACE_STEPS`."""
        last = self.steps[-1:]
        recent = last if last and last[0].new_tokens * 2 >= self.n_batch else self.steps[-PACE_STEPS:]
        predicted = sum(s.predicted_s for s in recent)
        measured = sum(s.seconds for s in recent)
        return measured / predicted if predicted > 0 and measured > 0 else 1.0

    def projected_ttft_s(self, elapsed_s: float, *, pace: float | None = None) -> float:
        """When the first token comes if the rest of the prompt runs at ``pace`` (default :attr:`pace`)."""
        n = len(self.tokens)
        pace = self.pace if pace is None else pace
        prefill = self._part_s(self.position, n) * pace if n > self.position else 0.0
        return elapsed_s + prefill + self.profile.first_token_overhead_s(n)

    def over_budget(self, elapsed_s: float) -> bool:
        """Whether the first token is projected too late while a re-plan may still help."""
        if self.replans >= MAX_REPLANS or self.position >= len(self.tokens):
            return False
        target = self.budget_s * (1.0 - self.margin)
        pace = self.decision_pace
        if self.projected_ttft_s(elapsed_s, pace=pace) <= target:
            return False
        if self.measured_long_step:
            return True
        # only a short step measured: cut now only if the next (long) step and a short tail at that pace would already be
        # too late, else measure one long step first (what it evaluates stays)
        end = self.next_end() or len(self.tokens)
        tail = min(self.first_step_tokens, len(self.tokens) - end)
        later = self._part_s(self.position, end) + self._part_s(end, end + tail)
        return elapsed_s + pace * later + self.profile.first_token_overhead_s(len(self.tokens)) > target

    def ahead(self, elapsed_s: float) -> bool:
        """Whether a long step projects the first token :data:`AHEAD_SHARE` under target (before any re-plan)."""
        if self.replans or not self.measured_long_step or self.position >= len(self.tokens):
            return False
        return self.projected_ttft_s(elapsed_s) <= (1.0 - AHEAD_SHARE) * self.budget_s * (1.0 - self.margin)

    @property
    def measured_long_step(self) -> bool:
        return any(s.new_tokens * 2 >= self.n_batch for s in self.steps)

    @property
    def decision_pace(self) -> float:
        """:attr:`pace`, discounted by the profile's noise while only short steps were measured."""
        pace = self.pace
        if self.measured_long_step:
            return pace
        err = self.profile.error.p90_pct
        noise = min(max(err / 100.0, 0.05), 0.5) if err == err else 0.2  # nan: unknown
        return max(pace / (1.0 + noise), min(pace, 1.0))

    def paced_profile(self) -> Profile:
        return attrs.evolve(self.profile, drift=self.profile.drift * self.pace)

    def continue_with(self, tokens: Sequence[int], *, held: int | None = None) -> PrefillWatch:
        """The watch over a re-planned prompt: what the context holds of it (``held``) is its cache; it keeps the steps."""
        kept = common_prefix_len(self.tokens[: self.position], tokens) if held is None else held
        nxt = PrefillWatch(tokens, kept, self.profile, self.budget_s, margin=self.margin, n_batch=self.n_batch, replans=self.replans + 1)
        nxt.steps = list(self.steps)
        nxt.position = min(kept, len(tuple(tokens)))
        nxt.origin = min(self.origin, nxt.position)
        return nxt


@attrs.frozen
class Cut:
    """A re-planned prompt: its chunks, messages and tokens, what the context holds of it, its predicted TTFT from now."""

    chunks: tuple[Any, ...]
    messages: Sequence[Any]
    tokens: Sequence[int]
    cached: int
    predicted_s: float


def cut_chunks(plan: Any, original_last_user: Mapping[str, Any], price: Callable[[Sequence[Any]], tuple[Sequence[int], int, float]],
               target_s: float, rag_template: str, rag_chunk_template: str, *, position: int, value: Callable[[Any], float],
               extra: Sequence[Any] = (), least: bool = False) -> Cut | None:
    """The re-plan that keeps the evaluated prefix: chunks evaluated (even in part) stay; of the others (and ``extra``:
    dropped ones that may come back) the most value per character that fits ``target_s`` is kept, in the plan's order.
    None when nothing fits; ``least``: the cut keeping no free chunk, whatever it costs."""
    own = tuple(getattr(plan, "kept_chunks", ()))  # in prompt order, the most relevant one last
    if not own and not extra:
        return None
    where = last_user_index(plan.messages)
    memo: dict[tuple[int, ...], Cut] = {}

    def render(chunks: tuple[Any, ...]) -> Cut:
        key = tuple(id(c) for c in chunks)
        if key not in memo:
            messages = list(plan.messages)
            messages[where] = with_chunks(original_last_user, chunks, rag_template, rag_chunk_template) if chunks else dict(original_last_user)
            tokens, cached, predicted = price(messages)
            memo[key] = Cut(chunks, messages, tokens, cached, predicted)
        return memo[key]

    # the leading chunks the context already holds (in part): chunk i starts where the prompts with and without it part
    fixed = 0
    while fixed < len(own):
        start = common_prefix_len(render(own[:fixed]).tokens, render(own[: fixed + 1]).tokens)
        if start >= position:
            break
        fixed += 1
    # chunks put back go before the plan's last one (its most relevant, next to the question) unless it is evaluated
    kept = (*own[:-1], *extra, *own[-1:]) if fixed < len(own) else (*own, *extra)

    free = sorted(range(fixed, len(kept)), key=lambda i: -value(kept[i]) / max(len(str(kept[i].text)), 1))

    def cut(m: int) -> Cut:
        """The evaluated chunks and the ``m`` densest free ones, in the plan's order."""
        return render(tuple(kept[i] for i in sorted([*range(fixed), *free[:m]])))

    if least:
        return cut(0)
    if cut(0).predicted_s > target_s:
        return None
    return cut(largest_fitting(lambda m: cut(m).predicted_s <= target_s, 0, len(free)))
