"""The embedded default model and model-file checks (the real GGUF is assembled, never loaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trimkit.backends.llama_format import check_model_path, default_model_path, model_identity
from trimkit.errors import ModelError, ModelNotFoundError, NotGGUFError, TrimkitError

MiB = 1 << 20


def _gguf(path: Path, size: int, fill: int = 0) -> Path:
    path.write_bytes(b"GGUF" + bytes([fill]) * (size - 4))
    return path


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# -- the default model --------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "min_mib"), [("smollm2", 90), ("gemma", 200)])
def test_default_model_path_is_an_existing_gguf_file(model, min_mib):
    path = Path(default_model_path(model))
    assert path.is_file()
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert path.stat().st_size > min_mib * MiB  # the real weights (SmolLM2 98 MB, Gemma 253 MB), not a stub


def test_default_model_path_is_stable():
    assert default_model_path() == default_model_path()


# -- check_model_path ---------------------------------------------------------------------------


def test_a_missing_path_raises_model_not_found(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match="nope.gguf") as info:
        check_model_path(missing)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, ModelError) and isinstance(info.value, TrimkitError)


def test_a_directory_is_not_a_gguf(tmp_path):
    with pytest.raises(NotGGUFError, match="not a file"):
        check_model_path(tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"{\"not\": \"a model\"}", b"gguf" + b"\0" * 100, b"\0GGUF"])
def test_a_file_without_gguf_magic_is_refused(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(NotGGUFError, match="not a GGUF model") as info:
        check_model_path(path)
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, FileNotFoundError)


def test_a_gguf_file_is_returned_as_a_path(tmp_path):
    path = _gguf(tmp_path / "m.gguf", 64)
    assert check_model_path(str(path)) == path
    assert check_model_path(path) == path


def test_a_home_relative_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _gguf(tmp_path / "m.gguf", 64)
    assert check_model_path("~/m.gguf") == tmp_path / "m.gguf"


# -- model_identity -----------------------------------------------------------------------------


def test_identity_is_stable_for_an_unchanged_file(tmp_path):
    path = _gguf(tmp_path / "m.gguf", 3 * MiB)
    assert model_identity(path) == model_identity(str(path))


def test_identity_names_the_file_and_its_size(tmp_path):
    ident = model_identity(_gguf(tmp_path / "m.gguf", 1000))
    assert ident.startswith("m.gguf:1000:")


def test_identity_changes_with_the_size(tmp_path):
    path = _gguf(tmp_path / "m.gguf", 3 * MiB)
    before = model_identity(path)
    _gguf(path, 3 * MiB + 1)
    assert model_identity(path) != before


@pytest.mark.parametrize(
    "size, offset",
    [
        (1000, 500),  # a small file
        (3 * MiB, 10),  # the first MiB of a large file
        (3 * MiB, 3 * MiB - 10),  # the last MiB of a large file
        (MiB + MiB // 2, MiB + 10),  # past the first MiB of a file between 1 and 2 MiB
        (2 * MiB, 2 * MiB - 1),  # the very last byte of a 2 MiB file
    ],
    ids=["small", "head", "tail", "between-1-and-2-mib", "last-byte-2-mib"],
)
def test_identity_changes_when_the_content_changes_at_the_same_size(tmp_path, size, offset):
    path = _gguf(tmp_path / "m.gguf", size)
    before = model_identity(path)
    _flip(path, offset)
    assert os.path.getsize(path) == size
    assert model_identity(path) != before


def test_identity_of_the_default_model_is_stable():
    path = default_model_path()
    assert model_identity(path) == model_identity(path)
    assert model_identity(path).startswith(Path(path).name + ":")
