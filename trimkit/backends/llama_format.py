"""A Llama's chat template and tokenizer, as trimkit counts prompts with them.

llama-cpp-python renders a chat with a *chat handler*; the plain ones close over a
``ChatFormatter`` (``chat_formatter``) that turns messages into the prompt text. trimkit finds
that formatter (:func:`chat_formatter`) and renders with it, so prompt token counts are exactly
what ``Llama.create_chat_completion`` evaluates (:func:`llama_prompt_tokenizer`).
:func:`chat_format_renderer` does the same for a format name or Jinja template alone — for a
server whose template is known but which has no template endpoint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2

from trimkit._tokens import PromptTokenizer, chatml_render, llama_control_texts
from trimkit.errors import InvalidInputError, InvalidMessageError, require_extra

__all__ = ["LlamaTextTokenizer", "handler_formatter", "chat_formatter", "chat_format_renderer", "llama_prompt_tokenizer"]

log = logging.getLogger("trimkit")

Render = Callable[..., str]


class LlamaTextTokenizer:
    """A ``Llama``'s own tokenizer for message text (a :class:`~trimkit._tokens.Tokenizer`):
    no BOS, special tokens parsed as they will be in the rendered prompt."""

    exact = True

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.name = "llama.cpp:" + os.path.basename(getattr(llm, "model_path", "model"))

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def _chat_format_module() -> Any:
    """llama-cpp-python's chat formats, imported on first use (``trimkit[llama]``): a server
    wrapper that names no ``chat_format`` never needs them."""
    return require_extra("llama_cpp.llama_chat_format", "llama", "rendering a named chat_format")


def handler_formatter(handler: Any) -> Any:
    """The ChatFormatter a llama-cpp-python chat handler closes over, or None."""
    code = getattr(handler, "__code__", None)
    if code is None or getattr(handler, "__closure__", None) is None:
        return None
    cell = dict(zip(code.co_freevars, handler.__closure__)).get("chat_formatter")
    return cell.cell_contents if cell is not None else None


def _handler_by_name(name: str) -> Any:
    if name == "gemma-3":  # trimkit's own format: registered when trimkit.templates is imported
        import trimkit.templates  # noqa: F401
    return _chat_format_module().LlamaChatCompletionHandlerRegistry().get_chat_completion_handler_by_name(name)


def chat_format_renderer(chat_format: str) -> Render:
    """``render(messages, tools=None) -> str`` for a llama-cpp-python chat format name
    ("gemma", "chatml", "llama-3", …) or a Jinja chat template string.

    Use it to count tokens exactly for a server whose template you know but which has no
    template endpoint (llama-cpp-python's server started with ``--chat_format``)."""
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
            try:
                handler = _handler_by_name(fmt)
            except Exception:
                handler = None
    return handler_formatter(handler)


def llama_prompt_tokenizer(llm: Any) -> PromptTokenizer:
    """A :class:`~trimkit._tokens.PromptTokenizer` that renders and tokenizes exactly as
    ``llm.create_chat_completion`` does (a ChatML estimate, with a warning, for a custom handler)."""
    text_tok = LlamaTextTokenizer(llm)
    formatter = chat_formatter(llm)
    if formatter is None:
        log.warning("trimkit: unknown chat handler on this Llama; estimating template overhead with ChatML")
        return PromptTokenizer(
            text_tok,
            chatml_render,
            encode_prompt=lambda text: llm.tokenize(text.encode("utf-8"), add_bos=True, special=True),
            name=text_tok.name + "+chatml(estimate)",
            control_texts=lambda: llama_control_texts(llm),
        )
    added_special = {"value": False}

    def render(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
        try:
            result = formatter(messages=list(messages), tools=tools)
        except (TypeError, KeyError, ValueError, jinja2.TemplateError) as exc:  # the model's own template, not trimkit's
            raise InvalidMessageError(
                f"this model's chat template cannot render these messages ({type(exc).__name__}: {exc}); a common cause is an "
                "assistant turn with tool calls and no text content (content None) in a template that expects text"
            ) from exc
        added_special["value"] = bool(result.added_special)
        return result.prompt

    def encode_prompt(text: str) -> list[int]:
        return llm.tokenize(text.encode("utf-8"), add_bos=not added_special["value"], special=True)

    render([{"role": "user", "content": "x"}])  # learn whether the template adds BOS itself
    return PromptTokenizer(text_tok, render, encode_prompt=encode_prompt, name=text_tok.name + f"+{getattr(llm, 'chat_format', None) or 'handler'}",
                           control_texts=lambda: llama_control_texts(llm))
