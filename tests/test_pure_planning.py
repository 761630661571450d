"""Planning is pure (issue 37): a plan asks the engine nothing and writes nothing. What the
engine's KV cache holds comes as data (:class:`~trimkit.planning.costs.CacheState`), read by the
pipeline before it plans; the refined profile a request teaches is stored by the pipeline."""

from __future__ import annotations

import builtins
import os
import pathlib
import threading

import pytest

import trimkit
import trimkit.pipeline
from trimkit.planning.costs import CacheState, CostModel
from trimkit.planning.tokens import reusable_prefix_len
from trimkit.testing import FakeBackend, FakeClock
from trimkit.wrapper import Trimmer


class WatchedFake(FakeBackend):
    """A fake engine that records every attribute read while a plan is being made, by the thread
    making it (a background summary of the last turn may read it meanwhile: no part of the plan)."""

    planning = False
    planner = 0

    def __getattribute__(self, name: str):
        if (not name.startswith("__") and object.__getattribute__(self, "planning")
                and threading.get_ident() == object.__getattribute__(self, "planner")):
            object.__getattribute__(self, "read_while_planning").append(name)
        return object.__getattribute__(self, name)


def conversation(turns: int, question: str = "And what about cats?") -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {t}: " + " ".join(f"word{t}x{i}" for i in range(80))})
        msgs.append({"role": "assistant", "content": f"Answer {t}. " + " ".join(f"reply{t}y{i}." for i in range(80))})
    return [*msgs, {"role": "user", "content": question}]


def test_a_plan_asks_the_engine_nothing_and_writes_nothing(isolated_cache, monkeypatch):
    fake = WatchedFake(CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-7), clock=FakeClock())
    fake.read_while_planning = []
    trimmer = Trimmer(fake, ttft_budget_s=1.0, profile=trimkit.calibrate(fake), clock=fake.clock)
    writes: list[str] = []
    real_open, real_replace = builtins.open, os.replace

    def planning() -> bool:  # the planning thread (another one, a background summary, may write meanwhile)
        return fake.planning and threading.get_ident() == fake.planner

    def open_(file, mode="r", *args, **kwargs):
        if planning() and any(c in mode for c in "wax+"):
            writes.append(f"open({file!r}, {mode!r})")
        return real_open(file, mode, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        if planning():
            writes.append(f"os.replace({src!r}, {dst!r})")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(pathlib.Path, "write_text", lambda *a, **k: writes.append("Path.write_text") if planning() else None)
    real_plan = trimkit.pipeline.make_plan
    plans, held = [], []

    def watched_plan(*args, **kwargs):
        held.append(list(fake.kv))  # what the engine holds as the plan is made
        fake.planner = threading.get_ident()
        fake.planning = True
        try:
            plans.append(real_plan(*args, **kwargs))
            return plans[-1]
        finally:
            fake.planning = False

    monkeypatch.setattr(trimkit.pipeline, "make_plan", watched_plan)
    msgs = conversation(12)
    for question in ("Tell me about dogs.", "And cats?"):  # the second finds the first's prompt in the cache
        prepared = trimmer.prepare([*msgs, {"role": "user", "content": question}], None, {"max_tokens": 4})
        for _ in trimmer.execute(prepared, {"max_tokens": 4}):
            pass
        msgs = [*msgs, {"role": "user", "content": question}, {"role": "assistant", "content": "Yes."}]
    # over budget: history edited — dropped, or summarized when the background summary of the first
    # request is ready in time for the second (a race on a busy host, either is right)
    assert len(plans) == 2 and all(p.removed_message_indices or p.summarized_message_indices for p in plans)
    assert fake.read_while_planning == [] and writes == []
    # the cache state the pipeline handed over made the plan's cached count exact
    assert plans[-1].cached_tokens == reusable_prefix_len(held[-1], fake.tokenizer.prompt_tokens(plans[-1].messages)) > 0


def test_the_cache_state_counts_what_the_engine_would_reuse():
    held = [1, 2, 3, 4, 5, 6, 7, 8]
    assert CacheState(prompts=(held,)).cached([1, 2, 3, 4, 9]) == 4
    assert CacheState(prompts=(held,)).cached(held) == 7  # one token is evaluated again
    assert CacheState(prompts=(held,), block=4).cached([1, 2, 3, 4, 5, 6, 9]) == 4
    assert CacheState(prompts=(held,), after=[1, 2, 9]).cached([1, 2, 3, 4, 9]) == 2
    assert CacheState().cached(held) == 0
    # a snapshot counts where restoring it and prefilling the rest is predicted faster
    snap = CacheState(prompts=([1, 9],), snapshots=[(held, 0.001)])
    assert snap.cached(held + [10], cost=lambda new, cached: new * 0.01) == 8
    assert snap.cached(held + [10], cost=lambda new, cached: new * 1e-6) == 1


@pytest.mark.parametrize("reuse", [True, False])
def test_the_fake_engines_cache_state_is_its_predicted_cached_count(reuse):
    fake = FakeBackend(reuse_prefix=reuse)
    fake.kv = list(range(100))
    for tokens in ([*range(50), 7], list(range(100)), [5, 6], []):
        assert fake.cache_state().cached(tokens) == fake.predict_cached_tokens(tokens)
