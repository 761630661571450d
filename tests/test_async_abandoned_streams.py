"""Async streams a caller abandons or cancels, on a REAL loopback server that streams slowly, through
the three async front-ends (``wrap_url(..., asynchronous=True)``, ``trimkit.wrap`` of an
``openai.AsyncOpenAI``, a fleet of one URL): ``break`` without ``async with`` or ``close()``, a
reader task cancelled (``task.cancel()``, ``asyncio.wait_for``), the stream closed — awaited, or
in a task of its own — while a cancelled reader has not unwound yet or while another task still
reads it, a stream dropped unfinished (also inside a reference cycle), and one still open when
``asyncio.run()`` ends (issue 34, item 9).

Nothing may be printed or lost: no "Task exception was never retrieved", no "aclose(): asynchronous
generator is already running", no "an error occurred during closing of asynchronous generator"
(all three reach the loop's exception handler, which these tests replace), no unraisable
exception, no unclosed socket or transport (ResourceWarning); ``close()`` closes the response
before it returns; every connection goes back to the pool — the checks send through a pool of two
connections and then make a full request, which would wait forever for a connection held by a
stream nobody closed. No test measures time; pytest-timeout bounds each against a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import trimkit
from tests.test_server_faults import ASK, DEADLINE_S, GOOD_STREAM, PROFILE, FaultServer, chunk, sse_reply

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(120)

FORMS = ("url", "openai", "fleet")


class Trickle:
    """A long answer: its role chunk, then a content chunk every 20 ms until the client goes away
    (a write fails) or the server closes. ``streaming`` counts the answers still being written:
    the server's view of the connections no client has closed."""

    def __init__(self) -> None:
        self.streaming = 0
        self.lock = threading.Lock()

    def __call__(self, h: Any, body: dict[str, Any]) -> None:
        with self.lock:
            self.streaming += 1
        try:
            h.head(200, "text/event-stream")
            event, i = chunk(role="assistant"), 0
            while True:
                h.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                h.wfile.flush()
                if h.server.owner.released.wait(0.02):
                    return
                event, i = chunk(f"w{i} "), i + 1
        finally:
            with self.lock:
                self.streaming -= 1

    async def all_ended(self) -> bool:
        """Whether every answer has ended — its client closed the connection — after letting
        the loop run what asyncio scheduled to close dropped streams (bounded steps, not a time)."""
        for _ in range(500):
            if self.streaming == 0:
                return True
            await asyncio.sleep(0.01)
        return False


class Seen:
    """The responses an ``httpx.AsyncClient`` received (an event hook), and a pool of two connections."""

    def __init__(self) -> None:
        self.responses: list[httpx.Response] = []

        async def hook(response: httpx.Response) -> None:
            self.responses.append(response)

        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=2, max_keepalive_connections=2), event_hooks={"response": [hook]})

    def open_count(self) -> int:
        return sum(not r.is_closed for r in self.responses)


def make(form: str, server: FaultServer, http: httpx.AsyncClient | None = None) -> Any:
    options: dict[str, Any] = dict(profile=PROFILE, ttft_budget_s=0.5, retry_deadline_s=DEADLINE_S, summarizer=None)
    if form == "openai":
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", **({"http_client": http} if http is not None else {}))
        return trimkit.wrap(client, model="m", **options)
    if http is not None:
        options["async_http_client"] = http
    return trimkit.wrap_url([server.base_url] if form == "fleet" else server.base_url, model="m", asynchronous=True, **options)


@contextlib.contextmanager
def watched() -> Iterator[list[str]]:
    """What asyncio and the interpreter would print about the streams, as a list: unraisable
    exceptions and warnings (an unclosed socket or transport) here, the loop's exception handler
    through :func:`watch_loop`. A final full collection flushes what finalisers would report."""
    problems: list[str] = []
    gc.collect()  # what earlier tests left is not this test's
    before = sys.unraisablehook

    def unraisable(u: Any) -> None:
        problems.append(f"unraisable {u.exc_type.__name__}: {u.exc_value} ({u.err_msg} {u.object!r})")

    sys.unraisablehook = unraisable
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield problems
            gc.collect()
        problems.extend(f"{w.category.__name__}: {w.message}" for w in caught if not issubclass(w.category, DeprecationWarning))
    finally:
        sys.unraisablehook = before


def watch_loop(problems: list[str]) -> None:
    """Record what the running loop would log ("Task exception was never retrieved", "an error
    occurred during closing of asynchronous generator", ...) — also while ``asyncio.run`` shuts it down."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        problems.append(f"asyncio: {context.get('message')}: {context.get('exception')!r}")

    asyncio.get_running_loop().set_exception_handler(handler)


async def read_in_task(stream: Any, after: int = 2) -> tuple[asyncio.Task[int], asyncio.Event]:
    """A task reading ``stream`` to its end, and an event set once it has read ``after`` chunks —
    from then on it is always inside ``__anext__``, waiting for the server."""
    got = asyncio.Event()

    async def read() -> int:
        n = 0
        async for _ in stream:
            n += 1
            if n == after:
                got.set()
        return n

    task = asyncio.ensure_future(read())
    await got.wait()
    return task, got


async def full_answer(chat: Any, server: FaultServer) -> str:
    """A whole (non-streamed) answer on the same wrapper, its server now answering at once."""
    streaming = server.routes["/v1/chat/completions"]
    server.chat(sse_reply(*GOOD_STREAM))
    try:
        out = await chat.chat.completions.create(messages=ASK)
    finally:
        server.chat(streaming)
    return out["choices"][0]["message"]["content"] if isinstance(out, dict) else out.choices[0].message.content


@pytest.mark.parametrize("how", ["await", "task"])
@pytest.mark.parametrize("form", FORMS)
def test_a_stream_closed_while_its_cancelled_reader_unwinds(server, form, how):
    """``task.cancel()`` then ``close()`` at once — the cancelled reader is still inside
    ``__anext__`` until the loop runs it again: closing the stream raised ``RuntimeError:
    aclose(): asynchronous generator is already running``; closed in a task of its own, asyncio
    logged "Task exception was never retrieved" with that error."""
    server.chat(trickle := Trickle())
    seen = Seen()
    chat = make(form, server, seen.http)

    async def run(problems: list[str]) -> None:
        watch_loop(problems)
        closers = []
        for _ in range(6):
            stream = await chat.chat.completions.create(messages=ASK, stream=True)
            reader, _ = await read_in_task(stream)
            reader.cancel()
            if how == "await":
                await stream.close()  # raised RuntimeError
            else:
                closers.append(asyncio.ensure_future(stream.close()))
            with pytest.raises(asyncio.CancelledError):
                await reader
            assert stream.report is None
        if closers:
            await asyncio.wait(closers)  # (not retrieving their exceptions, as a fire-and-forget close does not)
            assert [c.exception() for c in closers] == [None] * len(closers)
        assert await trickle.all_ended()
        assert await full_answer(chat, server) == "Hello there"  # through the two-connection pool
        await chat.close()
        await seen.http.aclose()

    with watched() as problems:
        asyncio.run(run(problems))
    assert problems == []


@pytest.mark.parametrize("form", FORMS)
def test_a_stream_closed_by_another_task_ends_its_reader(server, form):
    """``close()`` from another task while a reader (not cancelled) waits inside ``__anext__``:
    the response is closed under it and its ``async for`` ends; the stream has no report (it was
    not read to its end). It raised ``RuntimeError`` and left the reader reading."""
    server.chat(Trickle())
    seen = Seen()
    chat = make(form, server, seen.http)

    async def run(problems: list[str]) -> None:
        watch_loop(problems)
        for _ in range(4):
            stream = await chat.chat.completions.create(messages=ASK, stream=True)
            reader, _ = await read_in_task(stream)
            await stream.close()
            assert seen.open_count() == 0  # closed before close() returned
            assert await reader >= 2  # its async for ended, without an error
            assert stream.report is None
        assert await full_answer(chat, server) == "Hello there"
        await chat.close()
        await seen.http.aclose()

    with watched() as problems:
        asyncio.run(run(problems))
    assert problems == []


@pytest.mark.parametrize("how", ["close", "async with"])
@pytest.mark.parametrize("form", FORMS)
def test_closing_a_stream_closes_its_response_before_it_returns(server, form, how):
    """``await stream.close()`` and the end of ``async with``: the HTTP response is closed when
    they return — not later, by a task asyncio schedules to close a generator trimkit dropped
    (which a loop that ends right after may never run)."""
    server.chat(Trickle())
    seen = Seen()
    chat = make(form, server, seen.http)

    async def run(problems: list[str]) -> None:
        watch_loop(problems)
        for _ in range(3):
            stream = await chat.chat.completions.create(messages=ASK, stream=True)
            if how == "close":
                async for _ in stream:
                    break
                await stream.close()
            else:
                async with stream:
                    async for _ in stream:
                        break
            assert seen.responses and seen.open_count() == 0
        await chat.close()
        await seen.http.aclose()

    with watched() as problems:
        asyncio.run(run(problems))
    assert problems == []


@pytest.mark.parametrize("pool", ["own", "two connections"])
@pytest.mark.parametrize("form", FORMS)
def test_streams_abandoned_while_the_loop_runs(server, form, pool):
    """``break`` without ``close()``, a reader task cancelled, ``asyncio.wait_for`` timing out,
    and a stream dropped inside a reference cycle that the cyclic collector frees — eight of each,
    on one loop, through the wrapper's own client or a pool of two connections: nothing is
    logged, every answer's connection is closed (the server sees its client go), and a full
    request then gets a connection. Before the reference cycle through a stream was removed
    (issue 34, item 1) the collector finalised all of a stream's async generators at once and
    asyncio closed them concurrently — while one closed the AsyncClient made for the stream, the
    generator around it was closed too: "Task exception was never retrieved" with
    ``RuntimeError: aclose(): asynchronous generator is already running``, and unclosed sockets."""
    server.chat(trickle := Trickle())
    seen = Seen()
    chat = make(form, server, seen.http if pool == "two connections" else None)

    async def abandon() -> None:
        stream = await chat.chat.completions.create(messages=ASK, stream=True)
        async for _ in stream:
            break

    async def cancel() -> None:
        stream = await chat.chat.completions.create(messages=ASK, stream=True)
        reader, _ = await read_in_task(stream)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    async def time_out() -> None:
        async def read_all() -> None:
            stream = await chat.chat.completions.create(messages=ASK, stream=True)
            async for _ in stream:
                pass

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(read_all(), 0.3)

    async def in_a_cycle() -> None:
        async def read() -> bool:
            stream = await chat.chat.completions.create(messages=ASK, stream=True)
            try:
                async for _ in stream:
                    raise ValueError("the caller's code failed on a chunk")
            except ValueError as exc:
                error = exc  # the frame holds the error, the error's traceback the frame (and the stream)
            return error is not None

        assert await read()
        gc.collect()

    async def run(problems: list[str]) -> None:
        watch_loop(problems)
        for _ in range(8):
            for case in (abandon, cancel, time_out, in_a_cycle):
                await case()
        assert await trickle.all_ended()
        assert await full_answer(chat, server) == "Hello there"
        await chat.close()
        await seen.http.aclose()

    with watched() as problems:
        asyncio.run(run(problems))
    assert problems == []


@pytest.mark.parametrize("form", FORMS)
def test_a_stream_still_open_when_asyncio_run_ends(server, form):
    """A stream read in part and kept (a session object, a cache) when ``asyncio.run()`` ends, one
    loop after another: the loop's ``shutdown_asyncgens()`` closes every async generator still
    open, all at once and in any order. trimkit's stream was an async generator inside another
    (and inside an ``asynccontextmanager``'s): closed before the generator around it, the inner one
    made its closing fail — "an error occurred during closing of asynchronous generator
    ``_achunks``: RuntimeError: generator didn't stop after athrow()", in about half the runs."""
    server.chat(Trickle())
    chat = make(form, server)
    held: list[Any] = []

    async def run(problems: list[str]) -> None:
        watch_loop(problems)
        stream = await chat.chat.completions.create(messages=ASK, stream=True)
        async for _ in stream:
            break
        held.append(stream)

    with watched() as problems:
        for _ in range(20):
            asyncio.run(run(problems))
        held.clear()
    backend = getattr(chat, "backend", None)
    if backend is not None:
        backend.close()
    assert problems == []


@pytest.mark.parametrize("form", FORMS)
def test_an_unfinished_async_stream_is_freed_without_the_cyclic_collector(server, form):
    """With the collector off, a stream read in part and dropped is freed at once by reference
    counting — the stream, its timed stream and its chunk generator — so asyncio closes the
    generator on its own, in order, while the loop runs. In a reference cycle (issue 34, item 1)
    the collector freed all of a stream's async generators together, at a random moment."""
    server.chat(Trickle())
    chat = make(form, server)

    async def run(problems: list[str]) -> list[bool]:
        watch_loop(problems)
        gc.collect()
        gc.disable()
        try:
            stream = await chat.chat.completions.create(messages=ASK, stream=True)
            for _ in range(3):
                await stream.__anext__()
            refs = [weakref.ref(stream), weakref.ref(stream.timed), weakref.ref(stream.timed._achunks)]  # a fleet's is the endpoint's stream
            del stream
            freed = [r() is None for r in refs]
        finally:
            gc.enable()
        await chat.close()
        return freed

    with watched() as problems:
        assert asyncio.run(run(problems)) == [True] * 3
    assert problems == []


# -- Ollama's native API (trimkit.wrap of an ollama.AsyncClient): the same stream, NDJSON lines -------
def ollama_trickle(h: Any, body: dict[str, Any]) -> None:
    """A long Ollama answer: a line every 20 ms until the client goes away or the server closes."""
    h.head(200, "application/x-ndjson")
    i = 0
    while True:
        line = {"model": "llama3.2", "message": {"role": "assistant", "content": f"w{i} "}, "done": False}
        h.wfile.write(json.dumps(line).encode() + b"\n")
        h.wfile.flush()
        if h.server.owner.released.wait(0.02):
            return
        i += 1


@pytest.fixture
def ollama_chat():
    ollama = pytest.importorskip("ollama")
    from tests.test_ollama import OllamaReplay

    server = OllamaReplay()
    server.routes["/api/chat"] = ollama_trickle
    chat = trimkit.wrap(ollama.AsyncClient(host=server.host), model="llama3.2", profile=PROFILE)
    yield chat
    chat.close()
    server.close()


def test_an_ollama_stream_closed_while_its_cancelled_reader_unwinds(ollama_chat):
    """``task.cancel()`` then ``close()`` at once, awaited or in a task of its own, on Ollama's
    native stream: nothing raised, nothing logged."""

    async def run(problems: list[str]) -> None:
        watch_loop(problems)
        closers = []
        for how in ("await", "task") * 3:
            stream = await ollama_chat.chat(model="llama3.2", messages=ASK, stream=True)
            reader, _ = await read_in_task(stream)
            reader.cancel()
            if how == "await":
                await stream.close()
            else:
                closers.append(asyncio.ensure_future(stream.close()))
            with pytest.raises(asyncio.CancelledError):
                await reader
        await asyncio.wait(closers)
        assert [c.exception() for c in closers] == [None] * len(closers)

    with watched() as problems:
        asyncio.run(run(problems))
    assert problems == []


def test_an_ollama_stream_still_open_when_asyncio_run_ends(ollama_chat):
    """Ollama's stream was an async generator inside another, inside ``httpx``'s ``stream()``
    context manager: the loop's ``shutdown_asyncgens()`` closed them in any order — "an error
    occurred during closing of asynchronous generator ``_alines``: RuntimeError: athrow():
    asynchronous generator is already running", in every run."""
    held: list[Any] = []

    async def run(problems: list[str]) -> None:
        watch_loop(problems)
        stream = await ollama_chat.chat(model="llama3.2", messages=ASK, stream=True)
        await stream.__anext__()
        held.append(stream)

    with watched() as problems:
        for _ in range(8):
            asyncio.run(run(problems))
        held.clear()
    assert problems == []
