"""Idle probes: the probes a provisional profile lacks are measured while the engine is idle, one at
a time, each stopped the moment a request wants the engine. On a fake engine whose probes take
real time (and can be aborted), then on the real embedded model: llama.cpp's abort callback
really stops a decode, the context is put back, and the prober completes its schedule."""

from __future__ import annotations

import gc
import threading
import time

import attrs
import httpx
import pytest

import trimkit
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.llama import LlamaBackend
from trimkit.calibration import remaining_probes
from trimkit.idle_probes import IdleProber, idle_prober
from trimkit.planning.costs import CostModel, PrefillSample
from trimkit.planning.margin import EngineState, forget_engines
from trimkit.profile_store import load_profile
from trimkit.testing import FakeBackend, FakeClock, FakeOpenAIServer
from trimkit.wrapper import Trimmer

COST = CostModel(overhead_s=0.01, per_token_s=0.002, depth_s=1e-7)
ASK = [{"role": "user", "content": "When do the boats come back to the quay?"}]
QUIET_S = 0.05  # the tests' quiet period: short, so that they are fast


class ProbingFake(FakeBackend):
    """A fake engine whose idle probes take ``probe_wall_s`` of real time, asking
    ``should_abort`` every millisecond or two as llama.cpp does between graph nodes."""

    def __init__(self, *args, probe_wall_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe_wall_s = probe_wall_s
        self.probes: list[tuple[int, int]] = []  # every probe started
        self.aborted: list[tuple[int, int]] = []
        self.probing = threading.Event()  # set while a probe runs

    def idle_probe(self, new_tokens, cached_tokens, should_abort):
        with self.engine.section(0.0):  # the caller holds the engine (preemptibly)
            self.probes.append((new_tokens, cached_tokens))
            self.probing.set()
            try:
                end = time.monotonic() + self.probe_wall_s
                while time.monotonic() < end:
                    if should_abort():
                        self.aborted.append((new_tokens, cached_tokens))
                        return None
                    time.sleep(0.001)
                return self.measure_prefill(new_tokens, cached_tokens)
            finally:
                self.probing.clear()


def probing_fake(**kwargs) -> ProbingFake:
    return ProbingFake(COST, clock=FakeClock(), n_ctx=kwargs.pop("n_ctx", 256), **kwargs)


def wrap(engine, **kwargs) -> Trimmer:
    chat = trimkit.wrap(engine, ttft_budget_s=1.0, clock=engine.clock, **kwargs)
    if chat.pipeline.prober is not None:
        chat.pipeline.prober.quiet_s = QUIET_S
    return chat


def ask(chat) -> None:
    chat.create_chat_completion(messages=ASK, max_tokens=2)


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


@pytest.fixture(autouse=True)
def _no_prober_left():
    yield
    forget_engines()  # stops every prober (and waits for its thread)
    assert not [t for t in threading.enumerate() if t.name == "trimkit-idle-probes"]


# -- when it runs -------------------------------------------------------------------------------------


def test_nothing_is_probed_before_the_first_request_has_finished(isolated_cache):
    engine = probing_fake()
    chat = wrap(engine)
    assert chat.profile.provisional and remaining_probes(chat.profile, engine.n_ctx)
    time.sleep(10 * QUIET_S)
    assert engine.probes == [] and not chat.pipeline.prober.running


def test_left_idle_the_prober_completes_the_schedule_and_stores_a_full_profile(isolated_cache):
    engine = probing_fake()
    chat = wrap(engine)
    micro = chat.profile
    ask(chat)
    prober = chat.pipeline.prober
    assert prober.wait_complete(30.0) and prober.complete and prober.aborted == 0
    assert remaining_probes(chat.profile, engine.n_ctx) == []
    assert chat.profile.mode == "full" and not chat.profile.provisional
    assert len(chat.profile.samples) == len(micro.samples) + len(engine.probes) == len(micro.samples) + prober.probed
    stored = load_profile(engine.profile_key())
    assert stored is not None and stored.mode == "full" and stored.samples == chat.profile.samples
    first = remaining_probes(micro, engine.n_ctx)[0]
    assert engine.probes[0] == (first.new_tokens, first.cached_tokens)  # the cheapest first
    # the fake's cost model is exact: so are the refined predictions (within the 256-token context)
    assert chat.profile.predict_prefill_s(200) == pytest.approx(COST.prefill_s(200, 0), rel=1e-6)


def _slower(model: CostModel, factor: float) -> CostModel:
    return attrs.evolve(model, overhead_s=model.overhead_s * factor, per_token_s=model.per_token_s * factor, depth_s=model.depth_s * factor)


@pytest.mark.parametrize("factor", [1.5, 0.7])
def test_probes_taken_after_the_host_changed_speed_keep_the_profiles_shape(isolated_cache, factor):
    """The micro-calibration runs at one speed; then the host runs 1.5× slower (or faster) for
    the requests and for every idle probe. Drift carries the change; the probes join the
    calibration's samples at the calibration's speed, so the fit keeps the engine's shape (its
    long probes read as attention costing more otherwise) and every length is predicted at the
    host's new speed."""
    engine = probing_fake(probe_wall_s=0.2)  # a probe started between the requests below is stopped by the next
    chat = wrap(engine)
    engine.cost_model = _slower(COST, factor)
    prober = chat.pipeline.prober
    for _ in range(4):
        ask(chat)  # drift learns the new speed before the first probe
    assert prober.wait_complete(30.0) and prober.complete and prober.probed
    profile = chat.profile
    assert profile.drift == pytest.approx(factor, rel=1e-6)
    for n, k in ((16, 0), (100, 0), (200, 0), (32, 160)):
        assert profile.model.prefill_s(n, k) == pytest.approx(COST.prefill_s(n, k), rel=1e-3)  # the calibration's speed
        assert profile.predict_prefill_s(n, k) == pytest.approx(factor * COST.prefill_s(n, k), rel=1e-3)  # the host's now
    stored = load_profile(engine.profile_key())
    assert stored is not None and stored.samples == profile.samples


def test_each_probe_runs_on_a_thread_of_its_own_that_ends_with_it(isolated_cache):
    """The prober's own thread never runs the engine: with llama.cpp's OpenMP build a live
    thread that had run its compute slowed every later request (docs/benchmarks.md)."""
    engine = probing_fake()
    threads: list[threading.Thread] = []
    probe = engine.idle_probe

    def recording(*args):
        threads.append(threading.current_thread())
        return probe(*args)

    engine.idle_probe = recording
    chat = wrap(engine)
    ask(chat)
    prober = chat.pipeline.prober
    assert prober.wait_complete(30.0) and prober.complete and prober.probed >= 2
    assert len(threads) == prober.probed and len(set(threads)) == len(threads)  # a thread per probe
    assert all(t is not prober.thread and t is not threading.main_thread() for t in threads)
    assert not any(t.is_alive() for t in threads)


def test_a_probe_waits_for_a_quiet_period_after_the_last_request(isolated_cache):
    engine = probing_fake()
    chat = wrap(engine)
    chat.pipeline.prober.quiet_s = 1.0
    ask(chat)
    time.sleep(0.3)
    assert engine.probes == []  # not yet: the quiet period is 1 s
    assert wait_for(lambda: engine.probes, 10.0)


def test_nothing_is_probed_while_a_stream_holds_the_engine(isolated_cache):
    engine = probing_fake()
    chat = wrap(engine)
    ask(chat)
    assert wait_for(lambda: engine.probes)
    prepared = chat.prepare(ASK, None, {"max_tokens": 4})
    stream = chat.execute(prepared, {"max_tokens": 4})
    next(stream)  # the engine is the stream's until it ends
    n = len(engine.probes)
    time.sleep(10 * QUIET_S)
    assert len(engine.probes) == n
    for _ in stream:
        pass
    prober = chat.pipeline.prober
    assert wait_for(lambda: len(engine.probes) > n or prober.complete)


def test_a_request_aborts_the_running_probe_and_is_served_at_once(isolated_cache):
    engine = probing_fake(probe_wall_s=30.0)  # a probe would hold the engine for 30 s
    chat = wrap(engine)
    ask(chat)
    assert engine.probing.wait(10.0)
    t0 = time.monotonic()
    ask(chat)
    waited = time.monotonic() - t0
    assert engine.aborted == engine.probes[:1]  # the probe was stopped, its sample discarded
    assert waited < 10.0  # not the 30 s the probe would have taken
    # the prober counts the abort once the probe's thread has ended, which may be after the
    # request (served the moment the engine was free) returned
    assert wait_for(lambda: chat.pipeline.prober.aborted == 1)
    assert chat.pipeline.prober.probed == 0


def test_the_probe_is_tried_again_at_the_next_idle_stretch(isolated_cache):
    engine = probing_fake(probe_wall_s=0.3)
    chat = wrap(engine)
    ask(chat)
    assert engine.probing.wait(10.0)
    ask(chat)
    assert engine.aborted
    assert wait_for(lambda: chat.pipeline.prober.probed >= 1, 10.0)
    assert engine.probes[1] == engine.aborted[0]


# -- when it does not run ------------------------------------------------------------------------------


def test_idle_probes_can_be_turned_off(isolated_cache):
    engine = probing_fake()
    chat = wrap(engine, idle_probes=False)
    assert chat.pipeline.prober is None and chat.engine.prober is None
    ask(chat)
    time.sleep(10 * QUIET_S)
    assert engine.probes == []


def test_a_profile_you_pass_is_not_probed_unless_asked(isolated_cache):
    micro = trimkit.calibrate(probing_fake(), mode="micro", store=False)
    assert wrap(probing_fake(), profile=micro).pipeline.prober is None
    assert wrap(probing_fake(), profile=micro, idle_probes=True).pipeline.prober is not None


def test_a_server_gets_no_idle_probes(isolated_cache):
    server = FakeOpenAIServer(model="m")
    backend = OpenAIHTTPBackend("http://fake/v1", model="m", http_client=httpx.Client(transport=server.transport))
    micro = attrs.evolve(trimkit.calibrate(probing_fake(), mode="micro", store=False), key=backend.profile_key())
    chat = trimkit.wrap(backend, profile=micro, idle_probes=True)
    assert chat.pipeline.prober is None and chat.engine.prober is None


def test_an_engine_that_cannot_abort_a_probe_gets_none(isolated_cache):
    engine = FakeBackend(COST, clock=FakeClock(), n_ctx=1024)
    chat = trimkit.wrap(engine, ttft_budget_s=1.0, clock=engine.clock)
    assert chat.profile.provisional and chat.pipeline.prober is None


# -- one per engine, and its lifetime ---------------------------------------------------------------------


def test_wrappers_of_one_engine_share_one_prober(isolated_cache):
    engine = probing_fake()
    first, second = wrap(engine), wrap(engine)
    assert first.pipeline.prober is second.pipeline.prober is first.engine.prober


def test_the_prober_ends_when_the_wrapper_and_engine_are_collected(isolated_cache):
    engine = probing_fake(probe_wall_s=0.05)
    chat = wrap(engine)
    ask(chat)
    assert engine.probing.wait(10.0)
    thread = chat.pipeline.prober.thread
    del chat, engine
    gc.collect()
    thread.join(10.0)
    assert not thread.is_alive()


def test_stopping_the_engine_state_stops_its_prober(isolated_cache):
    engine = probing_fake(probe_wall_s=30.0)
    chat = wrap(engine)
    ask(chat)
    assert engine.probing.wait(10.0)
    chat.engine.close()
    assert not chat.pipeline.prober.running and engine.aborted


def test_a_schedule_that_never_shrinks_stops_the_prober(isolated_cache, monkeypatch):
    engine = probing_fake()
    micro = trimkit.calibrate(engine, mode="micro", store=False)
    state = EngineState(micro)
    prober = idle_prober(state, engine, quiet_s=0.0)
    monkeypatch.setattr("trimkit.idle_probes.refit_profile", lambda profile, samples, mode=None: profile)
    for _ in range(1000):
        delay = prober.step()
        if delay is None:
            break
        time.sleep(delay)
    assert delay is None and len(engine.probes) == 9  # 8 measurements of the same probe, then it gives up
    assert isinstance(prober, IdleProber) and not prober.complete


# -- the real model ----------------------------------------------------------------------------------------


def _in_thread(target):
    out: dict = {}

    def run():
        try:
            out["value"] = target()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _turns(chat):
    first = [{"role": "user", "content": "Name three things a lighthouse keeper does at dusk."}]
    reply = chat.create_chat_completion(messages=first, max_tokens=12, temperature=0.0)["choices"][0]["message"]
    second = [*first, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "And at dawn?"}]
    return first, second


def test_a_real_probe_is_aborted_by_a_request_and_the_context_is_put_back(llm, quick_profile):
    chat = trimkit.wrap(llm, ttft_budget_s=30.0, profile=quick_profile, idle_probes=False)
    backend: LlamaBackend = chat.backend
    first, second = _turns(chat)
    baseline = chat.create_chat_completion(messages=second, max_tokens=12, temperature=0.0)
    expected, expected_cached = baseline["choices"][0]["message"]["content"], chat.last_report.cached_tokens
    assert expected_cached > 10
    _turns(chat)  # the context holds the first turn again, as before the baseline
    held = list(backend.cached_tokens_in_context())
    asked, calls = threading.Event(), []

    def should_abort():
        calls.append(1)
        if len(calls) > 1:  # asked once before it starts, then by llama.cpp while it computes
            asked.set()
        return backend.engine.preempt_requested

    def probe():
        with backend.engine.preemptible() as got:
            assert got
            return backend.idle_probe(min(2048, backend.n_ctx // 2), 0, should_abort)

    thread, out = _in_thread(probe)
    assert asked.wait(60.0)
    # planned while the probe runs: the cache it will find is the one the probe puts back
    assert list(backend.cached_tokens_in_context()) == held
    again = chat.create_chat_completion(messages=second, max_tokens=12, temperature=0.0)
    thread.join(60.0)
    assert "error" not in out and out["value"] is None  # aborted: no sample
    report = chat.last_report
    assert again["choices"][0]["message"]["content"] == expected
    assert report.cached_tokens == report.cached_tokens_predicted == expected_cached


def test_after_an_aborted_probe_on_an_empty_context_the_next_request_predicts_no_cache(llm, quick_profile):
    chat = trimkit.wrap(llm, ttft_budget_s=30.0, profile=quick_profile, idle_probes=False)
    backend: LlamaBackend = chat.backend
    with backend.lock:
        llm.reset()
    asked, calls = threading.Event(), []

    def should_abort():
        calls.append(1)
        if len(calls) > 1:  # the decode is running
            asked.set()
        return backend.engine.preempt_requested

    def probe():
        with backend.engine.preemptible() as got:
            assert got
            return backend.idle_probe(min(2048, backend.n_ctx // 2), 0, should_abort)

    thread, out = _in_thread(probe)
    assert asked.wait(60.0)
    out_text = chat.create_chat_completion(messages=ASK, max_tokens=4, temperature=0.0)
    thread.join(60.0)
    assert out["value"] is None and llm.n_tokens > 0
    report = chat.last_report
    assert report.cached_tokens_predicted == 0 == report.cached_tokens
    assert out_text["choices"][0]["message"]["content"] is not None


def test_the_real_abort_stops_a_long_decode_early(llm):
    """llama.cpp stops within a graph node: far fewer tokens are evaluated than asked for."""
    backend = LlamaBackend(llm)
    calls = []

    def stop_on_second_ask():
        calls.append(1)
        return len(calls) > 1

    with backend.engine.preemptible() as got:
        assert got
        assert backend.idle_probe(min(2048, backend.n_ctx // 2), 0, stop_on_second_ask) is None
    assert len(calls) <= 3  # asked before it starts, then while it computes: it stopped there


def test_the_idle_prober_completes_its_schedule_on_the_real_model(model_path, isolated_cache):
    """A small context, and a profile that lacks only the two cheapest probes of its full schedule."""
    from llama_cpp import Llama

    from tests.conftest import OTHER_MODEL

    small = Llama(model_path=model_path, n_ctx=256, verbose=False) if OTHER_MODEL else trimkit.default_llama(model_path=model_path, n_ctx=256)
    chat = trimkit.wrap(small, ttft_budget_s=30.0, calibration="micro", idle_probes=False)
    micro = chat.profile
    todo = remaining_probes(micro, chat.backend.n_ctx)
    assert len(todo) > 2
    # as if the others were measured: their samples predicted by the micro profile itself
    filled = [PrefillSample(p.new_tokens, p.cached_tokens, micro.predict_prefill_s(p.new_tokens, p.cached_tokens))
              for p in todo[2:] for _ in range(p.repeats)]
    profile = attrs.evolve(micro, samples=micro.samples + tuple(filled), created_at=micro.created_at + 1)
    chat = trimkit.wrap(small, ttft_budget_s=30.0, profile=profile, idle_probes=True)
    prober = chat.pipeline.prober
    prober.quiet_s = QUIET_S
    chat.create_chat_completion(messages=ASK, max_tokens=2, temperature=0.0)
    assert prober.wait_complete(120.0) and prober.complete
    assert prober.probed == sum(p.repeats for p in todo[:2])
    assert chat.profile.mode == "full" and remaining_probes(chat.profile, chat.backend.n_ctx) == []
    assert load_profile(chat.backend.profile_key()).mode == "full"
    # the engine still answers, from a context the probes left consistent
    chat.create_chat_completion(messages=ASK, max_tokens=2, temperature=0.0)
    assert chat.last_report.cached_tokens == chat.last_report.cached_tokens_predicted


EXIT_SCRIPT = r"""
import sys, threading, time
import trimkit
from llama_cpp import Llama
from trimkit.backends.llama import LlamaBackend

path = sys.argv[1]
llm = Llama(model_path=path, n_ctx=512, verbose=False) if sys.argv[2] == "plain" else trimkit.default_llama(model_path=path, n_ctx=512)
backend = LlamaBackend(llm)
probe, running = backend.idle_probe, threading.Event()
backend.idle_probe = lambda n, k, should_abort: probe(n, k, lambda: running.set() or should_abort())
chat = trimkit.wrap(llm, backend=backend, ttft_budget_s=30.0, calibration="micro")
chat.pipeline.prober.quiet_s = 0.0
chat.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
assert running.wait(120), "no idle probe started"
print("exiting while a probe runs", flush=True)
"""


def test_the_process_exits_cleanly_while_a_real_probe_runs(model_path, tmp_path):
    """At exit the running probe is aborted (llama.cpp's callback), the thread ends: no hang, no crash."""
    import os
    import subprocess
    import sys

    from tests.conftest import OTHER_MODEL

    env = {**os.environ, "TRIMKIT_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, model_path, "plain" if OTHER_MODEL else "embedded"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting while a probe runs" in done.stdout


def test_a_stopped_probe_prints_nothing_on_stderr(llm, capfd):
    """llama.cpp logs an error-level notice when a decode is stopped, printed even with
    verbose=False; for a probe trimkit stopped on purpose it is dropped."""
    backend = LlamaBackend(llm)
    calls = []

    def should_abort():  # asked once before the probe starts, then while llama.cpp computes
        calls.append(1)
        return len(calls) > 2

    capfd.readouterr()
    with backend.engine.preemptible() as got:
        assert got
        assert backend.idle_probe(min(1024, backend.n_ctx // 2), 0, should_abort) is None
    assert len(calls) > 2  # stopped while computing, not before
    err = capfd.readouterr().err
    assert "removing memory module entries" not in err, err


def test_other_llama_messages_still_reach_the_callback_installed_before(capfd):
    import ctypes

    import llama_cpp

    from trimkit.backends.llama_idle import ABORT_NOTICE, AbortState, _RUNNING, quiet_planned_aborts

    assert quiet_planned_aborts()
    current, data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(current), ctypes.byref(data))
    notice = b"decode: " + ABORT_NOTICE + b" for seq_id = 0, pos = [0, +inf)\n"
    stopped = AbortState()
    stopped.fired = True
    capfd.readouterr()
    _RUNNING.state = stopped
    try:
        current(3, notice, data)  # a planned stop, on this thread: dropped
        current(3, b"trimkit-test: a real error\n", data)  # anything else: forwarded
        stopped.fired = False
        current(3, notice, data)  # a decode that failed by itself: forwarded
    finally:
        _RUNNING.state = None
    err = capfd.readouterr().err
    assert "trimkit-test: a real error" in err
    assert err.count("removing memory module entries") == 1


# -- whether a probe would finish before the next request ------------------------------------------
def test_a_probe_that_the_callers_pauses_would_cut_short_is_not_started():
    from trimkit.idle_probes import MIN_GAPS, likely_to_finish

    pauses = [1.5] * MIN_GAPS  # a caller who asks every 1.5 s
    assert not likely_to_finish(pauses, 1.0, 1.2)  # started at 1 s, stopped at 1.5 s
    assert likely_to_finish(pauses, 1.0, 0.4)  # done at 1.4 s
    assert likely_to_finish(pauses, 1.6, 1.2)  # a pause longer than any seen: the caller is away
    assert likely_to_finish(pauses[:-1], 1.0, 1.2)  # too few pauses known to say anything
    mixed = [1.5, 1.5, 1.5, 30.0, 30.0, 30.0]  # half the pauses are long
    assert likely_to_finish(mixed, 1.0, 1.2)
    assert not likely_to_finish([*mixed, 1.5], 1.0, 1.2)


def test_the_prober_remembers_the_pauses_between_requests(isolated_cache, monkeypatch):
    import trimkit.idle_probes as ip

    now = [100.0]
    monkeypatch.setattr(ip.time, "monotonic", lambda: now[0])
    prober = IdleProber(trimkit.wrap(probing_fake(), ttft_budget_s=1.0, idle_probes=False).pipeline.live, store=False)
    for pause in (2.0, 0.5, 7.0):
        prober.activity()  # planning starts
        now[0] += 1.0  # the request runs
        prober.request_done()
        now[0] += pause
    prober.activity()
    assert list(prober.gaps) == [2.0, 0.5, 7.0]  # from each request's end to the next one's start


def test_a_caller_with_short_pauses_gets_no_probe_started_and_stopped(isolated_cache, monkeypatch):
    """Pauses of 1 s, a probe predicted 0.6 s and a quiet rule of 0.2 s: the quiet rule alone
    would start it at 0.6 s and the next request would stop it at 1 s."""
    import trimkit.idle_probes as ip

    engine = probing_fake(probe_wall_s=0.1)
    chat = wrap(engine)
    prober = chat.pipeline.prober
    monkeypatch.setattr(ip, "_predicted_s", lambda profile, probe: 0.6)
    prober.quiet_s = 0.2
    prober.gaps.extend([1.0] * ip.MIN_GAPS)  # what this caller's pauses have been
    ask(chat)
    time.sleep(0.8)  # inside the caller's usual pause: the probe would not finish
    assert engine.probes == [] and prober.deferred == 1
    assert wait_for(lambda: engine.probes, 10.0)  # past any pause seen: the caller is away
