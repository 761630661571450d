"""What a model's architecture says about its prefill cost before anything is measured.

Prefilling one token costs about ``2·P`` floating-point operations for the weights it passes
through (``P``: the parameters a prompt token uses — every layer's, not the vocabulary table,
which is a lookup; the output projection runs for the last token only) and about
``4·L·H·d_head·p`` for attention at context position ``p`` (``L`` layers, ``H`` query heads of
``d_head`` dimensions: ``Q·Kᵀ`` and the weighted sum of ``V``). The per-token cost therefore
doubles every

    D = 2·P / (4·L·H·d_head) = P / (2·L·H·d_head)

tokens of context: the *attention doubling length* (docs/design.md, §2 "The attention prior").
The cost model's depth term is ``per_token_s / D``. Calibration measures that term only when its
probes reach deep enough into the context for attention to show above the host's noise; a
micro or quick calibration seldom does, and the fit then extrapolates from short prompts. This
prior, read from the model file, is what the fit leans on where the probes say little
(:func:`trimkit.planning.costs.fit_cost_model`).

It is a FLOP ratio, not a measurement: an engine may run attention more or less efficiently per
FLOP than the weight matrices (a fused flash-attention kernel, a GPU), a mixture-of-experts
model's unused experts are estimated from its GGUF's expert counts (:func:`idle_expert_params`),
and sliding-window layers are counted as full ones (llama.cpp computes them over
the whole cache unless told otherwise). The fit weighs it accordingly
(:data:`~trimkit.planning.costs.ATTENTION_PRIOR_SPREAD`).
"""

from __future__ import annotations

import math
from typing import Any

import llama_cpp

__all__ = ["attention_doubling_prior", "idle_expert_params", "llama_attention_prior"]


def attention_doubling_prior(*, n_params: int, n_vocab: int, n_embd: int, n_layer: int, n_head: int, head_dim: int,
                             idle_params: float = 0.0) -> float | None:
    """The context length (tokens) over which the per-token prefill cost doubles by the FLOP
    ratio above; None when the numbers do not describe a transformer (any of them not
    positive, or no parameters left outside the vocabulary table). ``idle_params``: parameters
    a token does not pass through (a mixture of experts' unused experts, :func:`idle_expert_params`)."""
    values = (n_params, n_vocab, n_embd, n_layer, n_head, head_dim)
    if any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values):
        return None
    if isinstance(idle_params, bool) or not isinstance(idle_params, (int, float)) or not (0 <= idle_params < math.inf):
        return None
    per_token = n_params - n_vocab * n_embd - idle_params
    if per_token <= 0:
        return None
    doubling = per_token / (2.0 * n_layer * n_head * head_dim)
    return doubling if math.isfinite(doubling) and doubling > 0 else None


def idle_expert_params(*, n_layer: int, n_embd: int, expert_count: int, expert_used_count: int, expert_ff: int) -> float:
    """The parameters a token of a mixture-of-experts model does not use: of the ``expert_count``
    experts per layer (each a gated feed-forward block of ``3·n_embd·expert_ff`` parameters),
    all but ``expert_used_count``. Counting every layer as a mixture one (some models keep a
    few dense layers) overstates it, which makes the prior read attention as steeper — the side
    that prices long prompts long. 0 for a dense model (fewer than 2 experts, or all used)."""
    if expert_count < 2 or expert_used_count >= expert_count or min(n_layer, n_embd, expert_used_count, expert_ff) <= 0:
        return 0.0
    return float(n_layer) * (expert_count - expert_used_count) * 3.0 * n_embd * expert_ff


def _int(value: Any) -> int | None:
    try:
        out = int(str(value).strip())
    except (TypeError, ValueError):
        return None
    return out if out > 0 else None


def llama_attention_prior(llm: Any) -> float | None:
    """:func:`attention_doubling_prior` for a ``llama_cpp.Llama``, from the loaded model's own
    counts (llama.cpp's ``llama_model_n_params``, ``_n_layer``, ``_n_head``) and the GGUF's
    ``<arch>.attention.key_length`` (default: the embedding width over the heads). None when
    any of it cannot be read: the fit then has no prior, as for a server."""
    try:
        model = llm.model
        n_params = int(llama_cpp.llama_model_n_params(model))
        n_layer = int(llama_cpp.llama_model_n_layer(model))
        n_head = int(llama_cpp.llama_model_n_head(model))
        n_embd, n_vocab = int(llm.n_embd()), int(llm.n_vocab())
        metadata = getattr(llm, "metadata", None) or {}
    except Exception:  # a stand-in Llama, an engine build without these calls: no prior
        return None
    arch = metadata.get("general.architecture", "")
    head_dim = _int(metadata.get(f"{arch}.attention.key_length")) if arch else None
    if head_dim is None and n_head > 0:
        head_dim = n_embd // n_head
    if head_dim is None:
        return None
    idle = 0.0
    experts, used = _int(metadata.get(f"{arch}.expert_count")), _int(metadata.get(f"{arch}.expert_used_count"))
    if experts and used:  # a mixture of experts: only the used experts' weights cost a token anything
        ff = _int(metadata.get(f"{arch}.expert_feed_forward_length")) or _int(metadata.get(f"{arch}.feed_forward_length"))
        if ff is None:
            return None  # the unused share cannot be told: no prior rather than one far too flat
        idle = idle_expert_params(n_layer=n_layer, n_embd=n_embd, expert_count=experts, expert_used_count=used, expert_ff=ff)
    return attention_doubling_prior(n_params=n_params, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                                    head_dim=head_dim, idle_params=idle)
