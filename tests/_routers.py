"""The routers of vLLM and SGLang fleets, for real, in front of real ``llama_cpp.server`` workers
on loopback (tests/test_routers_real.py).

- ``vllm-router`` (PyPI ``vllm-router``, a prebuilt Rust wheel) and ``sglang-router`` (PyPI
  ``sglang-router``, the SGLang Model Gateway) are test tools pinned in constraints.txt and the
  ``dev`` extra; ``make venv`` installs them. :func:`router_module` says whether one is here.
- Neither registers a stock ``llama_cpp.server``: both wait for a ``GET /health`` answered 200
  before they route to a worker (vllm-router 0.1.17: "Waiting for 2 unique hosts ... to become
  healthy"; llama-cpp-python's server has no ``/health``). :class:`HealthShim` is a loopback proxy
  in front of one worker that answers ``/health`` itself and forwards everything else, streams
  included, chunk by chunk. It also records the headers of every request it forwards, so a test
  sees which worker each request reached.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from tests._server import ServerProcess, _die_with_parent, free_port

__all__ = ["HealthShim", "RouterProcess", "router_module", "running_router"]

#: the router modules (``python -m <module>``) of the PyPI packages
ROUTER_MODULES = {"vllm-router": "vllm_router.launch_router", "sglang-router": "sglang_router.launch_router"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade", "proxy-connection"}


def router_module(kind: str) -> str | None:
    """The module that runs router ``kind``, or None when its package is not installed."""
    module = ROUTER_MODULES[kind]
    return module if importlib.util.find_spec(module.split(".")[0]) is not None else None


class _ShimHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body of a forwarded reply ends when the connection closes: streams pass as they come
    server: _ShimServer

    def log_message(self, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        shim = self.server.shim
        if self.command == "GET" and self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")
            return
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() != "host"}
        shim.record(self.command, self.path, headers, body)
        try:
            with shim.http.stream(self.command, shim.target + self.path, content=body, headers=headers) as resp:
                self.send_response(resp.status_code)
                for key, value in resp.headers.items():
                    if key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)
                self.end_headers()
                for part in resp.iter_raw():
                    self.wfile.write(part)
                    self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, httpx.HTTPError):
            pass

    do_GET = do_POST = _forward


class _ShimServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    shim: HealthShim

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class HealthShim:
    """A loopback proxy in front of one worker (``target``: its root URL) that answers
    ``GET /health`` itself. ``requests`` records ``(method, path, headers, body)`` of every
    request it forwarded."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.http = httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0))
        self.requests: list[tuple[str, str, dict[str, str], bytes | None]] = []
        self.lock = threading.Lock()
        self._server = _ShimServer(("127.0.0.1", 0), _ShimHandler)
        self._server.shim = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def record(self, method: str, path: str, headers: dict[str, str], body: bytes | None) -> None:
        with self.lock:
            self.requests.append((method, path, {k.lower(): v for k, v in headers.items()}, body))

    def chats(self) -> list[tuple[dict[str, str], bytes | None]]:
        """The chat requests this worker received: (headers, body)."""
        with self.lock:
            return [(h, b) for m, p, h, b in self.requests if m == "POST" and p.endswith("/chat/completions")]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.http.close()


@attrs.define
class RouterProcess(ServerProcess):
    """A router on loopback: a server process (its port, log) of a ``kind``."""

    kind: str = ""


def _wait_routing(router: RouterProcess, n_workers: int, timeout_s: float) -> None:
    """Until the router lists ``n_workers`` healthy workers (``GET /workers``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"{router.kind} exited with {router.proc.returncode}:\n{router.log_tail()}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            workers = httpx.get(f"http://127.0.0.1:{router.port}/workers", timeout=2.0).json().get("workers") or []
            if sum(1 for w in workers if w.get("is_healthy")) >= n_workers:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{router.kind} did not route to {n_workers} workers within {timeout_s:.0f} s:\n{router.log_tail()}")


@contextlib.contextmanager
def running_router(kind: str, worker_urls: Sequence[str], *, policy: str, timeout_s: float = 90.0) -> Iterator[RouterProcess]:
    """Router ``kind`` on loopback in front of ``worker_urls`` (each answering ``/health``),
    with ``policy``, ready to route; stopped on exit (terminate, then kill)."""
    module = router_module(kind)
    if module is None:
        raise RuntimeError(f"{kind} is not installed: run `make venv` (it is pinned in constraints.txt)")
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
           "--policy", policy, "--worker-startup-timeout-secs", str(int(timeout_s)), "--worker-startup-check-interval", "1",
           "--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1", "--log-level", "error"]
    fd, log_name = tempfile.mkstemp(prefix=f"trimkit-{kind}-{port}-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    router = RouterProcess(port, proc, Path(log_name), kind=kind)
    try:
        _wait_routing(router, len(worker_urls), timeout_s)
        yield router
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            Path(log_name).unlink()
