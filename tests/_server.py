"""A real OpenAI-compatible server for tests: llama-cpp-python's ``llama_cpp.server`` serving the
embedded Gemma-3-270M on loopback.

``llama_server`` (session fixture) yields the base URL (``http://127.0.0.1:PORT/v1``) of one
server shared by the session; :func:`running_server` starts extra ones for tests that need to
start late or kill a server, and :func:`running_servers` several at once (a fleet's replicas:
``two_llama_servers``, one thread each, ``--interrupt_requests false`` so that a request queued
behind another does not cut its stream short). Every process is stopped at the end whatever happens (terminate,
then kill), and on Linux it also dies with the test process (``PR_SET_PDEATHSIG``).

The server runs with ``--chat_format gemma-3`` (Gemma 3's own template, :mod:`trimkit.backends.llama`,
registered by the launcher of :func:`trimkit.backends.llama.server_command`): the GGUF carries no chat
template; under llama-cpp-python's fallback (llama-2) format the model answers with an immediate
end of turn, and its ``gemma`` format drops system messages.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import httpx
import pytest

__all__ = ["ServerProcess", "free_port", "start_server", "wait_ready", "stop_server", "running_server", "running_servers", "llama_server",
           "two_llama_servers", "REPLICA_ARGS"]

READY_TIMEOUT_S = 60.0


@attrs.define
class ServerProcess:
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, n_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def start_server(port: int | None = None, *, model_path: str | None = None, n_ctx: int = 4096, extra_args: Sequence[str] = (),
                 delay_s: float = 0.0, chat_format: str = "gemma-3") -> ServerProcess:
    """Start ``python -m llama_cpp.server`` on loopback (with trimkit's ``gemma-3`` template
    registered) without waiting for it; with ``delay_s``
    the process sleeps that long before it starts loading (a server that comes up late).

    Call it from a long-lived thread: the child gets SIGTERM when the thread that started it ends.
    """
    if model_path is None:
        from trimkit.backends.llama_format import default_model_path

        model_path = default_model_path("gemma")
    port = port or free_port()
    fd, log_name = tempfile.mkstemp(prefix=f"trimkit-llama-server-{port}-", suffix=".log")
    from trimkit.backends.llama import server_command

    cmd = server_command(
        "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", str(n_ctx), "--chat_format", chat_format,
        # the server's default logits_all=True copies every position's logits: 3–6× slower prefill
        "--logits_all", "false", *extra_args,
    )
    if delay_s > 0:
        cmd = ["sh", "-c", f'sleep {float(delay_s)}; exec "$@"', "sh", *cmd]
    with os.fdopen(fd, "wb") as log:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    return ServerProcess(port, proc, Path(log_name))


def wait_ready(server: ServerProcess, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until ``/v1/models`` answers; raise (with the server's log) if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.base_url + "/models", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"llama_cpp.server did not answer within {timeout_s:.0f} s:\n{server.log_tail()}")


def stop_server(server: ServerProcess) -> None:
    """Terminate, then kill; always reaps the process and removes its log."""
    proc = server.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    with contextlib.suppress(OSError):
        server.log_path.unlink()


@contextlib.contextmanager
def running_server(port: int | None = None, **kwargs: object) -> Iterator[ServerProcess]:
    """A started and ready server, stopped on exit."""
    server = start_server(port, **kwargs)  # type: ignore[arg-type]
    try:
        wait_ready(server)
        yield server
    finally:
        stop_server(server)


@contextlib.contextmanager
def running_servers(n: int, **kwargs: object) -> Iterator[list[ServerProcess]]:
    """``n`` servers, started together (they load in parallel) and ready; every one stopped on
    exit, even if another failed to start."""
    servers: list[ServerProcess] = []
    try:
        for _ in range(n):
            servers.append(start_server(**kwargs))  # type: ignore[arg-type]
        for server in servers:
            wait_ready(server)
        yield servers
    finally:
        for server in servers:
            stop_server(server)


#: a fleet replica on this 2-core host: one thread each; a second request waits instead of
#: interrupting the stream in flight (llama-cpp-python's default)
REPLICA_ARGS = ("--n_threads", "1", "--n_threads_batch", "1", "--interrupt_requests", "false")


@pytest.fixture(scope="module")
def two_llama_servers() -> Iterator[list[ServerProcess]]:
    """Two real llama-cpp-python servers for one test module (a fleet's replicas); a test may
    kill one. Both are stopped at the end of the module whatever happens."""
    with running_servers(2, extra_args=REPLICA_ARGS) as servers:
        yield servers


@pytest.fixture(scope="session")
def llama_server() -> Iterator[str]:
    """Base URL of one real llama-cpp-python server shared by the test session."""
    with running_server() as server:
        yield server.base_url
