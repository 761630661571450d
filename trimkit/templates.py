"""Gemma 3's chat template as a llama-cpp-python chat handler, and the embedded models opened as ``Llama``.

The embedded GGUF (Gemma-3-270M) carries no chat template, and llama-cpp-python's own
``chat_format="gemma"`` silently **drops** ``system`` messages: the model never sees them.
:func:`format_gemma3` follows Gemma 3's own template instead (the Jinja template Google ships
in the model's ``tokenizer_config.json``)::

    <start_of_turn>user
    {system text}

    {first user message}<end_of_turn>
    <start_of_turn>model
    {assistant message}<end_of_turn>
    <start_of_turn>model

- ``<bos>`` (Gemma's template starts with it) is *not* written into the text: the response
  says ``added_special=False``, so llama-cpp-python's handler tokenizes with ``add_bos=True``
  and the prompt starts with exactly one BOS token, as with its own ``gemma`` format. Written
  into the text it would come out twice wherever the text is tokenized with special tokens
  added (llama.cpp's ``/tokenize``, llama-cpp-python's ``/extras/tokenize``).
- ``system`` and ``developer`` text goes at the head of the next user turn, followed by a blank
  line; several system messages are joined by blank lines. A system message with no user turn
  after it (next comes an assistant turn, or nothing) becomes a user turn of its own, so it is
  never lost.
- ``assistant`` turns are rendered with Gemma's role name ``model``; an assistant message's
  ``tool_calls`` (and legacy ``function_call``) are written as ``name(arguments)`` lines after
  its text.
- ``tool`` and ``function`` results are rendered as **user** turns: Gemma 3's template knows
  only ``user`` and ``model`` (any other unknown role is rendered as a user turn too).
- Message content is trimmed (``| trim``) as in the official template; a list of content parts
  contributes its text parts, each trimmed, concatenated. System text is kept as given.
- The generation prompt is ``<start_of_turn>model\\n``; generation stops at ``<end_of_turn>``.
- Roles need not alternate: where Gemma's template raises, this one renders the turns as they
  come. It never raises on a message list llama-cpp-python accepts.
- ``tools`` are not rendered (Gemma 3's template has no tool section).

Importing this module registers the handler under the name ``"gemma-3"``
(:data:`GEMMA3_CHAT_FORMAT`), so ``Llama(..., chat_format="gemma-3")``, trimkit's
``chat_format="gemma-3"`` for servers, and ``python -m llama_cpp.server --chat_format gemma-3``
started through :func:`server_command` all find it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from llama_cpp import Llama, llama_chat_format

from trimkit.backends.llama_format import handler_formatter
from trimkit.errors import InvalidInputError
from trimkit.model import DEFAULT_MODEL, EMBEDDED_MODELS, default_model_path

__all__ = [
    "GEMMA3_CHAT_FORMAT",
    "format_gemma3",
    "gemma3_chat_handler",
    "default_llama",
    "server_command",
]

log = logging.getLogger("trimkit")

#: The name the Gemma 3 handler is registered under in llama-cpp-python's handler registry.
GEMMA3_CHAT_FORMAT = "gemma-3"

_START = "<start_of_turn>"
_END = "<end_of_turn>\n"
_SYSTEM_ROLES = ("system", "developer")


def _content_text(content: Any, *, trim: bool) -> str:
    """A message's content as text: a string, or the text parts of a list (each trimmed when
    ``trim``), concatenated as Gemma's template does. Anything else contributes nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip() if trim else content
    if isinstance(content, Sequence):
        out = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"].strip() if trim else part["text"])
        return "".join(out)
    return ""


def _call_lines(message: Mapping[str, Any]) -> list[str]:
    """An assistant message's tool calls as ``name(arguments)`` lines."""
    calls: list[Any] = list(message.get("tool_calls") or [])
    if message.get("function_call"):
        calls.append({"function": message["function_call"]})
    lines = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            lines.append(f"{fn.get('name', '')}({fn.get('arguments', '')})")
    return lines


def format_gemma3(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> Any:
    """Render ``messages`` with Gemma 3's chat template (see the module docstring).

    A llama-cpp-python ``ChatFormatter``: returns a ``ChatFormatterResponse`` with the prompt
    (BOS left to the tokenizer: ``added_special=False``) and the stop string ``<end_of_turn>``.
    Other keyword arguments (``tools``, ``functions``, …) are accepted and ignored.
    """
    out: list[str] = []
    pending: list[str] = []  # system/developer text waiting for the next user turn

    def flush_system() -> None:
        if pending:
            out.append(f"{_START}user\n" + "\n\n".join(pending).strip() + _END)
            pending.clear()

    for message in messages or ():
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        content = message.get("content")
        if role in _SYSTEM_ROLES:
            pending.append(_content_text(content, trim=False))
            continue
        if role == "assistant":
            flush_system()
            text = "\n".join([t for t in [_content_text(content, trim=True)] if t] + _call_lines(message))
            out.append(f"{_START}model\n{text}{_END}")
            continue
        # user, and tool/function results (and any unknown role): a user turn
        head = "\n\n".join(pending) + "\n\n" if pending else ""
        pending.clear()
        out.append(f"{_START}user\n{head}{_content_text(content, trim=True)}{_END}")
    flush_system()
    if add_generation_prompt:
        out.append(f"{_START}model\n")
    return llama_chat_format.ChatFormatterResponse(prompt="".join(out), stop=_END.rstrip("\n"), added_special=False)


#: The llama-cpp-python chat completion handler for :func:`format_gemma3` (pass it as
#: ``Llama(chat_handler=...)``). It closes over the formatter as ``chat_formatter``, which is
#: how trimkit finds the template to count tokens exactly as the model sees them.
gemma3_chat_handler = llama_chat_format.chat_formatter_to_chat_completion_handler(format_gemma3)


def _register() -> None:
    registry = llama_chat_format.LlamaChatCompletionHandlerRegistry()
    existing = registry._chat_handlers.get(GEMMA3_CHAT_FORMAT)
    formatter = handler_formatter(existing)
    if existing is None or getattr(formatter, "__module__", None) == __name__:
        # free, or ours from an earlier import of this module (a reload): (re)register
        registry.register_chat_completion_handler(GEMMA3_CHAT_FORMAT, gemma3_chat_handler, overwrite=True)
    else:  # pragma: no cover - a future llama-cpp-python might ship its own "gemma-3"
        log.debug("trimkit: chat format %r is already registered; default_llama() passes its own handler", GEMMA3_CHAT_FORMAT)


_register()


def default_llama(model: str = DEFAULT_MODEL, **llama_kwargs: Any) -> Any:
    """An embedded model as a ``llama_cpp.Llama`` whose chat template keeps system prompts.

    ``model="smollm2"`` (the default) is SmolLM2-135M-Instruct, an instruction-tuned model that
    answers, with the ChatML template its GGUF carries. ``model="gemma"`` is Gemma-3-270M, the
    pretrained base model (a prefill workload; it continues text rather than answering), opened
    with :data:`gemma3_chat_handler` (Gemma 3's own template, see this module). Both get
    ``n_ctx=8192`` and ``verbose=False``; any ``Llama`` keyword passes through and overrides them
    (``model_path``, ``n_ctx``, ``n_threads``, ``chat_format``, ``chat_handler``, …): with
    ``model_path``, ``model`` only chooses the template. Nothing is downloaded: see
    :func:`trimkit.model.default_model_path` for the packages.
    """
    if model not in EMBEDDED_MODELS:
        raise InvalidInputError(f"unknown embedded model {model!r}: one of {', '.join(map(repr, EMBEDDED_MODELS))}")
    kwargs: dict[str, Any] = {"n_ctx": 8192, "verbose": False}
    if model == "gemma" and "chat_format" not in llama_kwargs and "chat_handler" not in llama_kwargs:
        kwargs.update(chat_format=GEMMA3_CHAT_FORMAT, chat_handler=gemma3_chat_handler)
    kwargs.update(llama_kwargs)
    if kwargs.get("model_path") is None:
        kwargs["model_path"] = default_model_path(model)
    return Llama(**kwargs)


#: Python code that registers ``"gemma-3"`` and then runs llama-cpp-python's server.
_SERVER_LAUNCHER = (
    "import runpy, trimkit.templates; "
    "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)"
)


def server_command(*server_args: str, python: str | None = None) -> list[str]:
    """The command line for ``python -m llama_cpp.server SERVER_ARGS…`` with ``"gemma-3"``
    registered first, so ``--chat_format gemma-3`` works (llama_cpp.server itself knows only
    its built-in names). Needs ``llama-cpp-python[server]``."""
    return [python or sys.executable, "-c", _SERVER_LAUNCHER, *server_args]
