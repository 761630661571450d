"""One real ``Llama`` used from several threads: a stream belongs to whoever holds it, not to the
thread that started it. Every wait here is bounded (join timeouts), so a regression fails instead
of hanging the suite."""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import trimkit
from trimkit.errors import EngineBusyError

pytestmark = pytest.mark.timeout(300)

JOIN_S = 90.0  # far above any request here, far below the 120 s default engine wait
PARAMS = {"max_tokens": 4, "temperature": 0.0}


def ask(i: int = 0) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: name one colour of the sea."}]


@pytest.fixture
def chat(llm, quick_profile):
    chat = trimkit.wrap(llm, profile=quick_profile, summarizer=None)
    yield chat
    engine = getattr(chat.backend, "engine", None)
    assert engine is None or not engine.busy, "a test left the engine held"


@pytest.fixture
def handler():
    """A request-handler thread that stays alive (as in a server's pool) after starting a stream."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="handler")
    yield lambda fn, *args: pool.submit(fn, *args).result(timeout=JOIN_S)
    pool.shutdown(wait=False)


def in_thread(fn, *args):
    """Run ``fn(*args)`` in a daemon thread; its result, or its exception re-raised here.
    Fails (instead of hanging) when it does not finish within JOIN_S."""
    box: dict[str, object] = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(JOIN_S)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still blocked after {JOIN_S} s: the engine was never released"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("result")


def request(chat, i: int = 0):
    out = chat.create_chat_completion(messages=ask(i), **PARAMS)
    return out, chat.last_report


def start_stream(chat, i: int = 0):
    """What a request handler does: start a stream (and its first chunk) and hand it on."""
    rs = chat.create_chat_completion(messages=ask(i), stream=True, **PARAMS)
    first = next(rs)
    return rs, first


def wait_for(predicate, what: str, timeout_s: float = JOIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_stream_started_in_one_thread_is_drained_in_another(chat, handler):
    rs, first = handler(start_stream, chat, 1)
    chunks = in_thread(lambda: [first, *rs])  # the response iterator, on another thread
    assert rs.report is not None and rs.report.measurement.ttft_s is not None
    assert len(chunks) >= 2
    # the engine is free again: the next request, from a third thread, completes
    out, report = in_thread(request, chat, 2)
    assert out["choices"][0]["message"]["content"] is not None and report is not None


def test_a_dropped_stream_releases_the_engine(chat, handler):
    # never iterated, then dropped
    rs = chat.create_chat_completion(messages=ask(3), stream=True, **PARAMS)
    del rs
    gc.collect()
    out, _ = in_thread(request, chat, 4)
    assert out["choices"]
    # started in another thread, abandoned midway, collected here
    holder = [handler(start_stream, chat, 5)]
    holder.clear()
    gc.collect()
    out, report = in_thread(request, chat, 6)
    assert out["choices"] and report.measurement.ttft_s is not None


def test_dropping_the_last_reference_is_enough(chat, handler):
    rs, _ = handler(start_stream, chat, 25)
    gc.disable()  # the stream is in no reference cycle: its last reference going frees the engine
    try:
        del rs
        out, _ = in_thread(request, chat, 26)
    finally:
        gc.enable()
    assert out["choices"] and not chat.backend.engine.busy


def test_a_stream_closed_midway_releases_the_engine(chat, handler):
    rs, _ = handler(start_stream, chat, 7)
    rs.close()  # not the thread that started it
    rs.close()  # twice is harmless
    out, report = in_thread(request, chat, 8)
    assert out["choices"] and report is not None
    assert list(rs) == []  # a closed stream stays closed


def test_many_threads_all_finish_with_reports_and_the_wait_is_not_ttft(chat, handler):
    holder, _ = handler(start_stream, chat, 9)  # holds the engine until every worker waits
    done: dict[int, tuple[float, object]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            t0 = time.perf_counter()
            rs = chat.create_chat_completion(messages=ask(10 + i), stream=True, **PARAMS)
            for _ in rs:
                pass
            done[i] = (time.perf_counter() - t0, rs.report)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    wait_for(lambda: chat.backend.engine.waiters == 6, "six requests waiting for the engine")
    in_thread(lambda: list(holder))  # the holder is drained on yet another thread: the engine passes on
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a request never got the engine"
    assert not errors, errors
    assert sorted(done) == list(range(6))
    for wall, report in done.values():
        m = report.measurement
        assert m.ttft_s is not None and m.queue_s > 0  # each waited for the holder
        assert any("for the engine" in w for w in report.warnings)
        # the wait is reported beside the TTFT, never inside it: the two never overlap
        assert m.queue_s + m.total_s <= wall + 1e-3
        assert m.ttft_s <= m.total_s


def test_a_waiter_with_a_tiny_budget_gets_the_busy_error_within_its_budget(chat, handler):
    holder, _ = handler(start_stream, chat, 20)
    budget = 0.05

    def impatient():
        with pytest.raises(EngineBusyError) as info:
            chat.create_chat_completion(messages=ask(21), ttft_budget_s=budget, **PARAMS)
        return info.value

    err = in_thread(impatient)
    assert isinstance(err, trimkit.errors.BackendError) and budget <= err.waited_s  # it waited its budget (how much longer: the host's load)
    assert "busy" in str(err)
    assert chat.backend.engine.busy  # the holder still has it: nothing was taken from it
    in_thread(lambda: list(holder))
    assert holder.report is not None
    out, _ = in_thread(request, chat, 22)
    assert out["choices"]


def test_backends_over_one_llama_share_the_engine(llm, chat):
    from trimkit.backends.llama import LlamaBackend

    other = LlamaBackend(llm)
    assert other.engine is chat.backend.engine
    ts = other.send(ask(23), PARAMS)
    with pytest.raises(EngineBusyError):
        chat.create_chat_completion(messages=ask(24), ttft_budget_s=0.05, **PARAMS)
    m = in_thread(ts.drain)
    assert m.ttft_s is not None and m.queue_s == 0.0
