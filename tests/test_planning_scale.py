"""Planning stays near-linear in the number of retrieved chunks (issue 34, item 5): the refill
that puts back chunks after the exact count prices each candidate additively and counts only the
few it tries, so the texts the tokenizer counts grow linearly with the chunks (the old refill
rebuilt the kept order and priced every kept chunk again for each candidate: quadratic). Counted,
not timed: the chunks priced and the texts tokenized, for a few sizes."""

from __future__ import annotations

import sys

import trimkit
from tests._core_helpers import make_profile
from trimkit.planning.tokens import PromptTokenizer

ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "When was pier 42 rebuilt?"}]


def _chunks(n: int) -> list[trimkit.Chunk]:
    return [trimkit.Chunk(text=f"Record {i}: pier number {i} of Marrowby was rebuilt in {1800 + i % 200} after a storm. It has {i % 7} lamps.",
                          id=f"c{i}") for i in range(n)]


def _calls_to_plan(n: int) -> tuple[int, int]:
    """(lines of Python run by one plan() of ``n`` chunks — a count of the work, whatever the
    machine's speed; texts tokenized)."""
    tok = PromptTokenizer.estimate()
    chunks = _chunks(n)
    calls = [0]

    def tracer(frame, event, arg):
        calls[0] += 1
        return tracer

    profile = make_profile()
    sys.settrace(tracer)
    try:
        plan = trimkit.plan(ASK, rag_chunks=chunks, ttft_budget_s=0.5, profile=profile, tokenizer=tok)
    finally:
        sys.settrace(None)
    assert 0 < len(plan.kept_chunks) < n  # trimmed: the refill ran
    return calls[0], tok.count_calls


def test_the_work_of_planning_grows_linearly_with_the_chunks():
    small, small_counted = _calls_to_plan(1000)
    large, large_counted = _calls_to_plan(4000)
    assert large < 6 * small, (small, large)  # linear: 4x; quadratic: 16x
    assert large_counted <= 3 * 4000 + 100 and large_counted < 6 * small_counted
