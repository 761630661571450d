"""Calibration: measure what prefill costs on this host, fit the cost model, store the profile.

Use :func:`calibrate` once per model and settings; the profile is stored in the user cache and
reused on the next run with the same :class:`~trimkit.profile.ProfileKey`. Pass
``recalibrate=True`` (CLI: ``--recalibrate``) after changing hardware or drivers in ways the key
cannot see. Calibration uses the engine's KV cache for its probes, so the next request after it
pays a cold prefill.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import attrs

from trimkit.backends.base import Backend
from trimkit.backends.clients import client_kind
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.llama import LlamaBackend
from trimkit.errors import CalibrationError, ContextTooSmallError, InvalidInputError
from trimkit.planning.costs import PrefillSample, error_stats, fit_cost_model, heldout_predictions
from trimkit.profile import Profile
from trimkit.profile_store import load_profile, save_profile

__all__ = ["calibrate", "calibration_probes", "as_backend", "Probe", "MIN_N_CTX"]

log = logging.getLogger("trimkit")

#: the smallest context calibration can work in (a 32-token probe after a 64-token prefix, with room)
MIN_N_CTX = 128

Progress = Callable[[int, int, str], None]


@attrs.frozen
class Probe:
    """One calibration measurement to take: ``new_tokens`` after ``cached_tokens``, ``repeats`` times."""

    new_tokens: int
    cached_tokens: int = 0
    repeats: int = 1


def calibration_probes(n_ctx: int, *, quick: bool = False) -> list[Probe]:
    """The probe schedule for a context of ``n_ctx`` tokens.

    Cold prompts at geometric lengths (small ones repeated: they are cheap and noisy), then
    depth probes — new tokens after a long cached prefix — which pin down the attention term
    without paying for a very long cold prompt. Cold lengths stop at 2048 tokens (1024 when
    ``quick``) and no probe reaches past ~90 % of ``n_ctx`` (new + cached tokens). The probes
    are distinct: in a small context the short depth probe is shrunk rather than repeated.
    """
    if n_ctx < MIN_N_CTX:
        raise ContextTooSmallError(f"n_ctx={n_ctx} is too small to calibrate (need at least {MIN_N_CTX} tokens)")
    top = 1024 if quick else 2048
    deep = 512 if quick else 2048  # new tokens appended after the deepest cold probe
    cap = int(n_ctx * 0.9)
    if quick:
        cold = [(32, 2), (128, 2), (384, 1), (1024, 1)]
    else:
        cold = [(16, 3), (32, 3), (64, 3), (128, 3), (256, 3), (512, 2), (1024, 2), (2048, 1)]
    probes = [Probe(n, 0, r) for n, r in cold if n <= min(top, cap)]
    k = max((p.new_tokens for p in probes), default=0)
    if k < 64:
        probes.append(Probe(max(16, cap // 2), 0, 2))
        k = probes[-1].new_tokens
    room = cap - k
    # two depth probes of different lengths; where the room is short the long one takes all of
    # it and the short one half (min(short, room) would make both the same probe)
    for n in (min(128 if quick else 256, room // 2), min(deep, room)):
        if n >= 16 and Probe(n, k, 1) not in probes:
            probes.append(Probe(n, k, 1))
    return probes


def as_backend(target: Any) -> Backend:
    """A :class:`Backend` for ``target``: a Backend, a trimkit wrapper's, a ``llama_cpp.Llama``, or an OpenAI-style client
    (what it is: :func:`~trimkit.backends.clients.client_kind`, as for :func:`trimkit.wrap`)."""
    kind = client_kind(target)
    if kind == "backend":
        return target
    if kind == "wrapper":
        return target.backend
    if kind == "llama":
        return LlamaBackend(target)
    if kind == "openai":
        return OpenAIHTTPBackend.from_openai_client(target)
    raise InvalidInputError(
        f"cannot use {type(target).__name__} as a model: pass a llama_cpp.Llama, an OpenAI-style client or a trimkit Backend"
    )


def calibrate(
    target: Any,
    *,
    quick: bool = False,
    recalibrate: bool = False,
    store: bool = True,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Profile:
    """Measure prefill cost on this host and return a :class:`~trimkit.profile.Profile`.

    ``target`` is the ``llama_cpp.Llama`` you already use (or a trimkit backend / OpenAI-style
    client). A stored profile for the same key is returned without measuring unless
    ``recalibrate``; a stored *quick* profile does not satisfy a full calibration. A corrupt
    stored profile is measured again with a warning. ``progress(done, total, label)`` is called
    after each step.
    """
    backend = as_backend(target)
    key = backend.profile_key()
    if not recalibrate:
        stored = load_profile(key)
        if stored is not None and (quick or not stored.quick):
            log.info("trimkit: reusing stored profile for %s", key.model)
            return stored

    probes = calibration_probes(backend.n_ctx, quick=quick)
    steps = 1 + sum(p.repeats for p in probes) + 2
    done = 0

    def step(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, steps, label)

    t_start = clock()
    backend.warm_up()
    step("warm-up")
    samples: list[PrefillSample] = []
    # interleave repeats (round-robin) so slow drift on a shared machine spreads over all lengths
    rounds = max(p.repeats for p in probes)
    cold = [p for p in probes if p.cached_tokens == 0]
    deep = [p for p in probes if p.cached_tokens > 0]
    for r in range(rounds):
        for p in cold:
            if r < p.repeats:
                seconds = backend.measure_prefill(p.new_tokens, 0)
                samples.append(PrefillSample(p.new_tokens, 0, seconds))
                step(f"prefill {p.new_tokens} tokens")
    for p in deep:
        for _ in range(p.repeats):
            seconds = backend.measure_prefill(p.new_tokens, p.cached_tokens)
            samples.append(PrefillSample(p.new_tokens, p.cached_tokens, seconds))
            step(f"prefill {p.new_tokens} after {p.cached_tokens} cached")
    decode_tps = backend.measure_decode(16 if quick else 32)
    step("decode speed")
    first_token_s = backend.measure_first_token_overhead()
    step("first-token overhead")
    wall = clock() - t_start

    if len(samples) < 3:
        raise CalibrationError("calibration produced fewer than 3 samples")
    n_batch = key.n_batch or 512
    candidates = {}
    for batched in (False, True):
        model = fit_cost_model(samples, n_batch=n_batch, batched=batched)
        heldout = heldout_predictions(samples, n_batch=n_batch, batched=batched)
        candidates["batched" if batched else "design"] = (model, error_stats(heldout), heldout)
    # the plain model (docs/design.md, §2) unless the per-chunk variant is clearly better on held-out probes
    name = "design"
    d_err, b_err = candidates["design"][1], candidates["batched"][1]
    if math.isfinite(b_err.median_pct) and b_err.median_pct < d_err.median_pct * 0.9:
        name = "batched"
    model, err, heldout = candidates[name]
    profile = Profile(
        key=key,
        model=model,
        first_token_s=first_token_s,
        decode_tokens_per_s=decode_tps,
        samples=tuple(samples),
        error=err,
        alternatives={n: {"model": m.to_dict(), "heldout_error": e.to_dict()} for n, (m, e, _) in candidates.items()},
        calibration_wall_s=wall,
        quick=quick,
        created_at=time.time(),
        residuals=tuple(heldout),  # seeds the learned safety margin (trimkit.planning.margin)
    )
    if store:
        path = save_profile(profile)
        if path is not None:  # None: the cache folder is unwritable (save_profile warned once)
            log.info("trimkit: stored profile %s", path)
    return profile
