"""Calibration: measure what prefill costs on this host within a time budget, fit the cost model,
store the profile.

Use :func:`calibrate` once per model and settings; the profile is stored in the user cache and
reused on the next run with the same :class:`~trimkit.profile.ProfileKey`. Pass
``recalibrate=True`` (CLI: ``--recalibrate``) after changing hardware or drivers in ways the key
cannot see. Calibration uses the engine's KV cache for its probes, so the next request after it
pays a cold prefill.

Calibration is bounded in **wall time**, whatever the host and the model: ``micro`` ≤ 3 s
(the provisional profile ``trimkit.wrap`` serves with), ``quick`` ≤ 10 s, ``full`` ≤ 30 s, or
``time_budget_s``. A first short probe measures the host's speed; the rest of the schedule is
sized to the time left and every step is checked against it before it runs
(:mod:`trimkit.calibration_schedule`; the run itself is :mod:`trimkit.calibration_run`). The
profile records the budget, the mode and the range it probed. Calibration also measures decode
speed, and in process decode steps at the deepest context its probes leave cached and at an
empty one: the profile predicts decode speed at any context (:mod:`trimkit.decode_model`,
:meth:`~trimkit.profile.Profile.decode_tokens_per_s_at`). Served requests refine the profile from then on
(:mod:`trimkit.planning.drift`), and in process every budgeted request is watched while it
prefills (:mod:`trimkit.planning.watch`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trimkit.backends.base import Backend
from trimkit.backends.clients import client_kind
from trimkit.backends.http import OpenAIHTTPBackend
from trimkit.backends.llama import LlamaBackend
from trimkit.calibration_run import CalibrationRun, Progress
from trimkit.calibration_schedule import (ATTENTION_PRIOR_TOKENS, FULL_BUDGET_S, MICRO_BUDGET_S, MIN_N_CTX, MIN_SAMPLES, QUICK_BUDGET_S, Probe,
                                          calibration_probes, context_cap, get_mode, mode_for_budget)
from trimkit.errors import CalibrationError, InvalidInputError
from trimkit.planning.costs import CostModel, ErrorStats, PrefillSample, error_stats, fit_cost_model, heldout_predictions, per_token_rate
from trimkit.profile import CALIBRATION_MODES, Profile
from trimkit.profile_store import load_profile, save_profile
from trimkit.validation import budget

__all__ = ["calibrate", "calibration_probes", "as_backend", "Probe", "MIN_N_CTX",
           "MICRO_BUDGET_S", "QUICK_BUDGET_S", "FULL_BUDGET_S"]

log = logging.getLogger("trimkit")

#: a fit whose cost grows by less than this factor from the shortest to the longest probe is flat
FLAT_GROWTH = 1.1


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
    if kind == "ollama":
        raise InvalidInputError("an ollama client does not say which model to calibrate: pass "
                                "trimkit.backends.OllamaBackend(client, model=...) or the wrapper trimkit.wrap(client, model=...) gave")
    raise InvalidInputError(
        f"cannot use {type(target).__name__} as a model: pass a llama_cpp.Llama, an OpenAI-style client or a trimkit Backend"
    )


def _mode_name(quick: bool, mode: str | None, time_budget_s: float | None) -> str:
    """``mode`` if given; else quick's; else, with a budget, the most thorough mode it affords."""
    if mode is not None:
        name = get_mode(mode).name
        if quick and name == "full":
            raise InvalidInputError("quick=True contradicts mode='full'")
        return name
    if quick:
        return "quick"
    return mode_for_budget(time_budget_s) if time_budget_s is not None else "full"


def _satisfies(stored: Profile, mode: str) -> bool:
    """A stored full profile serves any request, a quick one quick and micro, a micro one micro."""
    return CALIBRATION_MODES.index(stored.mode) >= CALIBRATION_MODES.index(mode)


def calibrate(
    target: Any,
    *,
    quick: bool = False,
    mode: str | None = None,
    time_budget_s: float | None = None,
    recalibrate: bool = False,
    store: bool = True,
    progress: Progress | None = None,
    clock: Callable[[], float] | None = None,
) -> Profile:
    """Measure prefill cost on this host within a wall-time budget and return a
    :class:`~trimkit.profile.Profile`.

    ``target`` is the ``llama_cpp.Llama`` you already use (or a trimkit backend / OpenAI-style
    client). ``mode``: ``"micro"`` (3 s, a provisional profile), ``"quick"`` (10 s) or
    ``"full"`` (30 s); default ``quick`` when ``quick``, else the most thorough mode
    ``time_budget_s`` affords, else ``full``. ``time_budget_s`` replaces the mode's budget: the
    whole call — warm-up, probes, decode (and its points at two contexts), first-token
    overhead — ends within it on any host
    (the minimum of 3 probes excepted, with a warning, on a host too slow for even that).

    A stored profile for the same key is returned without measuring unless ``recalibrate``,
    if it is at least as thorough (full serves any mode, quick serves quick and micro, micro
    only micro). A corrupt stored profile is measured again with a warning.
    ``progress(done, total, label)`` is called after each step; ``total`` is the current plan
    and changes as the schedule is sized. ``clock`` times the budget (default: the backend's).
    """
    backend = as_backend(target)
    budget_s = None if time_budget_s is None else budget(time_budget_s, "time_budget_s")
    name = _mode_name(quick, mode, budget_s)
    budget_s = get_mode(name).budget_s if budget_s is None else budget_s
    context_cap(backend.n_ctx)  # ContextTooSmallError before anything is measured
    key = backend.profile_key()
    if not recalibrate:
        stored = load_profile(key)
        if stored is not None and _satisfies(stored, name):
            log.info("trimkit: reusing stored %s profile for %s", stored.mode, key.model)
            if not stored.attention_prior_tokens and backend.attention_prior_tokens:
                # stored before profiles kept the prior: its later (live) refits lean on it
                stored = attrs.evolve(stored, attention_prior_tokens=backend.attention_prior_tokens)
            return stored

    run = CalibrationRun(backend, key.n_batch or 512, get_mode(name), budget_s, clock or getattr(backend, "clock", None) or time.perf_counter, progress,
                         threads=key.n_threads_batch)
    run.execute()
    if len(run.samples) < MIN_SAMPLES:  # pragma: no cover - the minimum is enforced by _Run
        raise CalibrationError("calibration produced fewer than 3 samples")
    samples = list(run.samples)
    prior = backend.attention_prior_tokens
    model, err, heldout, alternatives = _fit(samples, key.n_batch or 512, prior)
    profile = Profile(
        key=key,
        model=model,
        first_token_s=run.first_token_s,
        decode_tokens_per_s=run.decode_tps,
        samples=tuple(samples),
        error=err,
        alternatives=alternatives,
        calibration_wall_s=run.wall_s,
        quick=name != "full",
        created_at=time.time(),
        residuals=tuple(heldout),  # seeds the learned safety margin (trimkit.planning.margin)
        mode=name,
        time_budget_s=budget_s,
        first_token_estimated=run.first_token_estimated,
        first_token_per_token_s=run.first_token_per_token_s,
        attention_prior_tokens=prior or 0.0,
        # no point measured but decode was: its speed stands as one point (the profile's default)
        **({"decode_points": tuple(run.decode_points)} if run.decode_points or run.decode_estimated else {}),
    )
    if store:
        path = save_profile(profile)
        if path is not None:  # None: the cache folder is unwritable (save_profile warned once)
            log.info("trimkit: stored profile %s", path)
    return profile


def _fit(samples: Sequence[PrefillSample], n_batch: int,
         prior: float | None = None) -> tuple[CostModel, ErrorStats, list[tuple[float, float]], dict[str, Any]]:
    """The cost model for ``samples``, its held-out error and residuals, and both candidates.
    ``prior``: the architecture's attention doubling length (:mod:`trimkit.architecture`),
    which the fit leans on where the samples say little about attention, and the fallbacks use
    in place of the conservative :data:`ATTENTION_PRIOR_TOKENS`."""
    candidates = {}
    for batched in (False, True):
        model = fit_cost_model(samples, n_batch=n_batch, batched=batched, depth_prior_tokens=prior)
        heldout = heldout_predictions(samples, n_batch=n_batch, batched=batched, depth_prior_tokens=prior)
        candidates["batched" if batched else "design"] = (model, error_stats(heldout), heldout)
    # the plain model (docs/design.md, §2) unless the per-chunk variant is clearly better on held-out probes
    name = "design"
    d_err, b_err = candidates["design"][1], candidates["batched"][1]
    if math.isfinite(b_err.median_pct) and b_err.median_pct < d_err.median_pct * 0.9:
        name = "batched"
    model, err, heldout = candidates[name]
    alternatives = {n: {"model": m.to_dict(), "heldout_error": e.to_dict()} for n, (m, e, _) in candidates.items()}
    lo, hi = min(s.new_tokens for s in samples), max(s.new_tokens for s in samples)
    rate = per_token_rate(samples)
    if model.depth_s * ATTENTION_PRIOR_TOKENS > max(model.per_token_s, rate):
        # attention costing more per token than the weights do before ATTENTION_PRIOR_TOKENS of
        # context is no model of a transformer (for any size: the weights cost ~2·params FLOPs a
        # token, attention ~4·d_model·layers·context); noisy probes spanning too little context
        # (a busy host's minimum) can fit one, and it would price a 1,000-token prompt in
        # minutes. The architecture's attention instead where known, else the schedule's
        # conservative allowance: it errs long, and the live refits correct it from the first requests.
        model = CostModel(overhead_s=0.0, per_token_s=rate, depth_s=rate / (prior or ATTENTION_PRIOR_TOKENS), n_batch=n_batch)
        heldout = [(model.prefill_s(s.new_tokens, s.cached_tokens), s.seconds) for s in samples]
        err = error_stats(heldout)
        alternatives["attention_prior"] = {"model": model.to_dict(), "heldout_error": err.to_dict()}
        log.warning("trimkit: the fitted attention term was implausible (noisy probes over a short range); "
                    "using a conservative per-token rate with the attention allowance instead")
    elif model.prefill_s(hi) < FLAT_GROWTH * model.prefill_s(lo):
        # a cost that barely grows across all the lengths probed is no model of prefill: noisy
        # probes that span too little (a slow or busy host's minimum) can fit one, and it would
        # price a 4,000-token prompt like a 16-token one. Proportional instead (with the
        # architecture's attention where known): it errs long.
        model = CostModel(overhead_s=0.0, per_token_s=rate, depth_s=rate / prior if prior else 0.0, n_batch=n_batch)
        heldout = [(model.prefill_s(s.new_tokens, s.cached_tokens), s.seconds) for s in samples]
        err = error_stats(heldout)
        alternatives["proportional"] = {"model": model.to_dict(), "heldout_error": err.to_dict()}
    return model, err, heldout, alternatives


