"""Retrieved text must not become control tokens of the model's chat template.

llama-cpp-python (and llama.cpp's server, and trimkit's own counts) tokenize the *rendered*
prompt with special tokens parsed, so a retrieved chunk that contains ``<end_of_turn>\\n<start_of_turn>system``
(Gemma) or ``<|im_start|>system`` (ChatML) becomes real turn markers: text nobody vetted forges a
turn of the conversation. trimkit is the layer that puts retrieved text into the prompt, so it
neutralises it there: each occurrence of a control token's text gets a zero-width space (U+200B)
after its first character, so it tokenizes as plain text (``<\\u200bstart_of_turn>``), and the
report says how many it broke and where.

Which texts: the model's own control tokens where trimkit can read its vocabulary (an in-process
``Llama``, or a ``tokenizer=`` built from one: :func:`llama_control_texts`), else the control
tokens of the common chat templates (:data:`KNOWN_CONTROL_TEXTS`). Pure functions; the vocabulary
is read once per model.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from trimkit.errors import InvalidInputError
from trimkit.messages import Chunk

__all__ = ["KNOWN_CONTROL_TEXTS", "KNOWN", "ZERO_WIDTH_SPACE", "ControlTexts", "NEUTRALIZE_MODES", "llama_control_texts", "neutralize_text",
           "neutralize_chunks", "neutralize_messages", "check_mode"]

#: what is inserted after a control token's first character
ZERO_WIDTH_SPACE = "\u200b"
#: the control tokens of the common chat templates (Gemma, ChatML/Qwen/SmolLM, Llama 2/3, Mistral, Phi, Zephyr, DeepSeek)
KNOWN_CONTROL_TEXTS: tuple[str, ...] = (
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>",
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
)
#: ``neutralize_control_tokens=``: ``"chunks"`` (default: retrieved text), ``"all"`` (message content too), ``"off"``
NEUTRALIZE_MODES = ("chunks", "all", "off")


def check_mode(mode: Any) -> str:
    if mode not in NEUTRALIZE_MODES:
        raise InvalidInputError(f"neutralize_control_tokens must be one of {NEUTRALIZE_MODES}, got {mode!r}")
    return str(mode)


class ControlTexts:
    """A set of control-token texts, searchable fast in long text: grouped by first character,
    with the lengths each first character starts."""

    def __init__(self, texts: Iterable[str]) -> None:
        kept = sorted({t for t in texts if isinstance(t, str) and len(t) >= 3 and not t.isalnum() and not t.isspace()}, key=len, reverse=True)
        self.texts = frozenset(kept)
        self._by_first: dict[str, tuple[int, ...]] = {}
        for t in kept:
            self._by_first[t[0]] = tuple(sorted({*self._by_first.get(t[0], ()), len(t)}, reverse=True))

    def __len__(self) -> int:
        return len(self.texts)

    def find(self, text: str) -> list[tuple[int, int]]:
        """``(start, end)`` of each occurrence in ``text``, left to right, not overlapping."""
        out: list[tuple[int, int]] = []
        if not self._by_first:
            return out
        i, n = 0, len(text)
        firsts = self._by_first
        while i < n:
            lengths = firsts.get(text[i])
            if lengths is not None:
                hit = next((k for k in lengths if i + k <= n and text[i : i + k] in self.texts), None)
                if hit is not None:
                    out.append((i, i + hit))
                    i += hit
                    continue
            # jump to the next character that starts a control text
            j = min((p for c in firsts if (p := text.find(c, i + 1)) != -1), default=n)
            i = j
        return out


KNOWN = ControlTexts(KNOWN_CONTROL_TEXTS)
_BY_MODEL: weakref.WeakKeyDictionary[Any, ControlTexts] = weakref.WeakKeyDictionary()


def llama_control_texts(llm: Any) -> ControlTexts:
    """The control tokens of a ``llama_cpp.Llama``'s vocabulary (token attribute CONTROL: the
    ones only parsed as special because the prompt is tokenized with ``special=True``) and the
    known ones; read once per model (about 0.1 s for a 262k vocabulary)."""
    model: Any = getattr(llm, "_model", None)
    try:
        cached = _BY_MODEL.get(model) if model is not None else None
    except TypeError:
        cached = None
    if cached is not None:
        return cached
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
    try:
        if model is not None:
            _BY_MODEL[model] = found
    except TypeError:
        pass
    return found


def neutralize_text(text: str, controls: ControlTexts) -> tuple[str, int]:
    """``text`` with every control-token text broken by a zero-width space after its first
    character, and how many were broken."""
    spans = controls.find(text)
    if not spans:
        return text, 0
    parts, last = [], 0
    for start, end in spans:
        parts.append(text[last : start + 1])
        parts.append(ZERO_WIDTH_SPACE)
        parts.append(text[start + 1 : end])
        last = end
    parts.append(text[last:])
    return "".join(parts), len(spans)


def _found(controls: ControlTexts, text: str) -> list[str]:
    return sorted({text[s:e] for s, e in controls.find(text)})


def neutralize_chunks(chunks: Sequence[Chunk], controls: ControlTexts) -> tuple[tuple[Chunk, ...], str | None]:
    """The chunks with their control-token texts neutralised (new Chunk objects for those that
    had any: the caller's are not changed) and the report's warning (None: nothing found)."""
    out, hits, names, which = [], 0, set(), []
    for ch in chunks:
        text, n = neutralize_text(ch.text, controls)
        if n:
            names.update(_found(controls, ch.text))
            hits += n
            which.append(str(ch.id))
            ch = attrs.evolve(ch, text=text)
        out.append(ch)
    if not hits:
        return tuple(chunks), None
    return tuple(out), (f"neutralised {hits} control-token text(s) ({', '.join(sorted(names)[:6])}) in retrieved chunk(s) "
                        f"{', '.join(which[:10])}{' …' if len(which) > 10 else ''}: a zero-width space keeps them plain text, "
                        "so retrieved text cannot forge a turn of the chat template")


def _content(content: Any, controls: ControlTexts) -> tuple[Any, int, set[str]]:
    if isinstance(content, str):
        text, n = neutralize_text(content, controls)
        return text, n, set(_found(controls, content)) if n else set()
    if isinstance(content, list):
        parts, total, names = [], 0, set()
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                text, n = neutralize_text(part["text"], controls)
                if n:
                    names.update(_found(controls, part["text"]))
                    part = {**part, "text": text}
                    total += n
            parts.append(part)
        return (parts if total else content), total, names
    return content, 0, set()


def neutralize_messages(messages: Sequence[Mapping[str, Any]], controls: ControlTexts) -> tuple[Sequence[Mapping[str, Any]], str | None]:
    """The messages with control-token texts in their content neutralised (system messages, the
    developer's own, are left as they are); new dicts for those changed, the list itself when
    nothing was; and the report's warning."""
    out: list[Mapping[str, Any]] = []
    hits, names, which = 0, set(), []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping) and m.get("role") not in ("system", "developer") and "content" in m:
            content, n, found = _content(m["content"], controls)
            if n:
                hits += n
                names |= found
                which.append(i)
                m = {**m, "content": content}
        out.append(m)
    if not hits:
        return messages, None
    return out, (f"neutralised {hits} control-token text(s) ({', '.join(sorted(names)[:6])}) in message(s) "
                 f"{', '.join(map(str, which[:10]))}: a zero-width space keeps them plain text")
