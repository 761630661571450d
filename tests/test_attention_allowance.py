"""The calibration's attention allowance: the worst-case prior until depth was measured, then
twice the measured steepness (bounded both ways), so a model with cheap attention is probed
further in the same time and a model with steep attention is still predicted long."""

from __future__ import annotations

import math

import pytest

from tests._core_helpers import exact_predictor
from trimkit._calibration import (
    ATTENTION_PRIOR_MAX_FACTOR,
    ATTENTION_PRIOR_TOKENS,
    FULL_BUDGET_S,
    attention_doubling_tokens,
    calibrate,
)
from trimkit.planning.costs import CostModel
from trimkit.testing import FakeBackend

#: attention doubles the per-token cost at 3,500 tokens of context (a 135M Llama on a CPU)
MILD = CostModel(overhead_s=0.01, per_token_s=0.007, depth_s=2e-6)
#: attention doubles it at 600 tokens
STEEP = CostModel(overhead_s=0.02, per_token_s=0.0035, depth_s=5.8e-6)


def test_the_prior_holds_until_depth_was_measured_far_enough():
    assert attention_doubling_tokens(None, 4096) == ATTENTION_PRIOR_TOKENS
    # a fit whose probes stayed short of the prior's own context does not vouch for long prompts
    assert attention_doubling_tokens(MILD, ATTENTION_PRIOR_TOKENS - 1) == ATTENTION_PRIOR_TOKENS


def test_a_measured_depth_term_sets_the_allowance_at_twice_its_steepness():
    measured = MILD.per_token_s / MILD.depth_s
    assert attention_doubling_tokens(MILD, 1024) == pytest.approx(measured / 2)


@pytest.mark.parametrize(("depth_s", "expected"), [
    (0.0, ATTENTION_PRIOR_MAX_FACTOR * ATTENTION_PRIOR_TOKENS),   # no attention seen: still bounded
    (1e-9, ATTENTION_PRIOR_MAX_FACTOR * ATTENTION_PRIOR_TOKENS),  # attention lost in noise: the cap
    (1e-4, ATTENTION_PRIOR_TOKENS),                               # steeper than the prior: the prior
])
def test_the_allowance_is_bounded_both_ways(depth_s, expected):
    fit = CostModel(overhead_s=0.01, per_token_s=0.007, depth_s=depth_s)
    assert attention_doubling_tokens(fit, 2048) == pytest.approx(expected)
    assert math.isfinite(attention_doubling_tokens(fit, 2048))


@pytest.mark.parametrize("model", [MILD, STEEP], ids=["mild", "steep"])
def test_beyond_the_probed_context_predictions_still_err_long(model):
    p = exact_predictor(model, [(32, 0), (16, 32), (16, 0), (128, 0), (512, 0), (64, 512), (256, 512)])
    for n, k in ((1024, 0), (2048, 0), (4096, 0), (1024, 2048)):
        assert p.engine_s(n, k) >= model.prefill_s(n, k) * (1 - 1e-9), (n, k)


def test_a_mild_attention_model_is_predicted_closer_than_by_the_worst_case_prior():
    probes = [(32, 0), (16, 32), (16, 0), (128, 0), (512, 0), (64, 512), (256, 512)]
    p = exact_predictor(MILD, probes)
    truth = MILD.prefill_s(2048, 0)
    top = 512 + 256
    rate = MILD.prefill_s(256, 512) / (256 * (1 + (512 + 128) / ATTENTION_PRIOR_TOKENS))
    worst_case = rate * 2048 * (1 + 1024 / ATTENTION_PRIOR_TOKENS)
    assert top >= ATTENTION_PRIOR_TOKENS
    assert truth <= p.engine_s(2048, 0) < worst_case


def _full_calibration_reach(model: CostModel) -> tuple[int, float]:
    backend = FakeBackend(model, decode_tokens_per_s=40.0, n_ctx=8192)
    start = backend.clock()
    profile = calibrate(backend, mode="full", store=False)
    return profile.probed_new_tokens, backend.clock() - start


def test_full_calibration_of_a_mild_model_reaches_further_within_its_budget():
    """The allowance that follows the measured depth term lets the same 30 s reach a longer
    prompt on a model whose attention is cheap than on one whose attention is steep, at the
    same per-token cost — and both stay inside the budget."""
    steep_like = CostModel(overhead_s=MILD.overhead_s, per_token_s=MILD.per_token_s, depth_s=MILD.per_token_s / 600)
    mild_reach, mild_s = _full_calibration_reach(MILD)
    steep_reach, steep_s = _full_calibration_reach(steep_like)
    assert mild_s <= FULL_BUDGET_S and steep_s <= FULL_BUDGET_S
    assert mild_reach > steep_reach
