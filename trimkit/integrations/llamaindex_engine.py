"""What a LlamaIndex LLM runs on, as a trimkit front-end: the one place the LlamaIndex integration
reaches past the LLM object to the engine behind it.

:func:`engine_of` takes what a user has — a LlamaIndex ``LlamaCPP`` (its ``llama_cpp.Llama``), an
``OpenAILike`` or any LlamaIndex LLM with an ``api_base`` (the server's URL), a
``llama_cpp.Llama``, a server URL, or a trimkit wrapper made by :func:`trimkit.wrap` /
:func:`trimkit.wrap_url` — and returns an :class:`Engine`: the trimkit front-end every request
goes through (built with :func:`trimkit.wrap` or :func:`trimkit.wrap_url`; no second planner),
the decode parameters the LlamaIndex LLM was configured with, and what its metadata says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from llama_index.core.llms import LLM

from trimkit.backends.base import client_kind, is_llama
from trimkit.errors import InvalidInputError
from trimkit.fleet import wrap_url
from trimkit.wrapper import wrap

__all__ = ["Engine", "engine_of", "send"]

#: LlamaIndex call arguments that are not the engine's (``complete(prompt, formatted=True)``)
_LLAMAINDEX_ONLY = ("formatted",)


@attrs.frozen
class Engine:
    """A trimkit front-end and what the LlamaIndex LLM it came from was configured with.

    ``front_end``: a sync trimkit wrapper (``TrimmedLlama`` or ``TrimmedOpenAI``); ``params``:
    decode parameters sent with every call (a call's own override them); ``url``: for a server,
    ``(base_url, model, api_key, wrap_url keyword arguments)``, from which the async twin is
    made (None: async calls run the sync front-end in a worker thread); ``model_name``;
    ``function_calling``: what the LlamaIndex LLM's metadata said (None: it did not say);
    ``inner``: that LlamaIndex LLM itself (None for a ``Llama``, a URL or a trimkit wrapper), whose
    own conversions (tools, replies, metadata) the wrapper reuses; it never sends through it."""

    front_end: Any
    params: Mapping[str, Any] = attrs.field(factory=dict)
    url: tuple[str, str | None, str | None, Mapping[str, Any]] | None = None
    model_name: str = ""
    function_calling: bool | None = None
    system_prompt: str | None = None
    inner: Any = None

    def async_twin(self) -> Any:
        """An ``AsyncTrimmedOpenAI`` on the same server (for ``achat``/``astream_chat``), planning
        with the sync front-end's profile (no second calibration) and sharing its engine's state."""
        assert self.url is not None
        base_url, model, api_key, kwargs = self.url
        kwargs = {k: v for k, v in kwargs.items() if k not in ("profile", "calibration")}
        return wrap_url(base_url, model=model, api_key=api_key, asynchronous=True, ttft_budget_s=self.front_end.ttft_budget_s,
                        profile=self.front_end.profile, **kwargs)


def _decode_params(llm: Any) -> dict[str, Any]:
    """The decode parameters a LlamaIndex LLM sends: ``LlamaCPP``'s ``generate_kwargs``
    (``temperature``, ``max_tokens``; not the ``stream`` flag it leaves there), ``OpenAILike``'s
    ``temperature``, ``max_tokens`` and ``additional_kwargs``."""
    params: dict[str, Any] = {}
    generate = getattr(llm, "generate_kwargs", None)
    if isinstance(generate, Mapping):
        params.update({k: v for k, v in generate.items() if k != "stream"})
    for key in ("temperature", "max_tokens"):
        value = getattr(llm, key, None)
        if value is not None and key not in params:
            params[key] = value
    extra = getattr(llm, "additional_kwargs", None)
    if isinstance(extra, Mapping):
        params.update(extra)
    return params


def _function_calling(llm: Any) -> bool | None:
    try:
        return bool(llm.metadata.is_function_calling_model)
    except Exception:  # metadata of an LLM whose engine is not up: it did not say
        return None


def engine_of(target: Any, ttft_budget_s: float | None = None, **kwargs: Any) -> Engine:
    """The trimkit front-end for ``target`` (see the module docstring); ``kwargs`` go to
    :func:`trimkit.wrap` / :func:`trimkit.wrap_url` (``profile``, ``strategies``, ``values``,
    ``on_infeasible``, …; for a URL also ``model``, ``api_key``). A trimkit wrapper is
    used as it is (configure it where it was made: ``kwargs`` are refused); an async one is
    refused (LlamaIndex calls an LLM both ways). Anything else raises
    :class:`~trimkit.errors.InvalidInputError`."""
    if isinstance(target, str):
        model, api_key = kwargs.pop("model", None), kwargs.pop("api_key", None)
        front = wrap_url(target, model=model, api_key=api_key, ttft_budget_s=ttft_budget_s, **kwargs)
        return Engine(front, url=(target, model, api_key, dict(kwargs)), model_name=model or target)
    if is_llama(target):
        return Engine(wrap(target, ttft_budget_s, **kwargs), model_name=str(getattr(target, "model_path", "")))
    if client_kind(target) == "wrapper":
        if kwargs:
            raise InvalidInputError(f"{sorted(kwargs)} configure a new trimkit wrapper: pass them where {type(target).__name__} was made")
        if getattr(target, "is_async", False):
            raise InvalidInputError("an async trimkit wrapper cannot serve LlamaIndex's sync calls: pass a sync one (trimkit.wrap_url(url))")
        return Engine(target, model_name=str(getattr(getattr(target, "backend", None), "name", "")))
    if isinstance(target, LLM):
        model = getattr(target, "_model", None)  # LlamaCPP keeps its llama_cpp.Llama here
        if is_llama(model):
            return Engine(wrap(model, ttft_budget_s, **kwargs), params=_decode_params(target), model_name=str(getattr(target, "model_path", "")),
                          function_calling=_function_calling(target), system_prompt=target.system_prompt, inner=target)
        api_base = getattr(target, "api_base", None)
        if isinstance(api_base, str):  # OpenAILike, OpenAI with a local api_base, …
            name, api_key = getattr(target, "model", None), getattr(target, "api_key", None)
            headers = getattr(target, "default_headers", None)
            if isinstance(headers, Mapping) and headers and "headers" not in kwargs:  # what its client sends with every request
                kwargs["headers"] = dict(headers)
            front = wrap_url(api_base, model=name, api_key=api_key, ttft_budget_s=ttft_budget_s, **kwargs)
            return Engine(front, params=_decode_params(target), url=(api_base, name, api_key, dict(kwargs)), model_name=name or api_base,
                          function_calling=_function_calling(target), system_prompt=target.system_prompt, inner=target)
    raise InvalidInputError(
        f"cannot reach the engine behind {type(target).__name__}: pass a LlamaIndex LlamaCPP (its llama_cpp.Llama), a LlamaIndex LLM "
        "with an api_base (OpenAILike), a llama_cpp.Llama, a server URL, or a sync trimkit wrapper (trimkit.wrap / trimkit.wrap_url)"
    )


def send(front_end: Any, call: Mapping[str, Any]) -> Any:
    """Send ``call`` (``messages``, ``rag_chunks``, decode parameters, ``stream``) through a
    trimkit front-end: ``create_chat_completion`` in process, ``chat.completions.create`` for a
    server (awaitable on an async one). LlamaIndex-only arguments are left out."""
    call = {k: v for k, v in call.items() if k not in _LLAMAINDEX_ONLY}
    create = getattr(front_end, "create_chat_completion", None)
    if create is not None:
        return create(**call)
    return front_end.chat.completions.create(**call)
