"""The architecture's attention prior (trimkit.planning.profile) and the fit that leans on it.

Short probes say little about attention: a micro or quick calibration fitted on them alone
extrapolates a depth term that is noise (an implausible one falls back to the conservative
allowance, which prices long prompts several times too long). The prior is the FLOP ratio of
attention to the weights, read from the model; the fit weighs it as one observation against the
probes, so long probes overrule it and short ones lean on it.
"""

from __future__ import annotations

import math
import random

import pytest

from trimkit._calibration import _fit, calibrate
from trimkit.backends.llama import llama_attention_prior
from trimkit.errors import InvalidInputError, InvalidNumberError, ProfileError
from trimkit.planning.costs import PROBE_NOISE, PROBE_NOISE_FLOOR, CostModel, PrefillSample, fit_cost_model, probe_noise
from trimkit.planning.profile import Profile, attention_doubling_prior, idle_expert_params
from trimkit.planning.speed import LiveProfile
from trimkit.testing import FakeBackend

#: Gemma-3-270M's counts (llama.cpp's n_params, the GGUF's vocabulary, width, layers, heads,
#: key length): 100.3 M parameters outside the vocabulary table, 18 × 4 × 256 attention
GEMMA_LIKE = {"n_params": 268_098_176, "n_vocab": 262_144, "n_embd": 640, "n_layer": 18, "n_head": 4, "head_dim": 256}


def test_the_doubling_length_is_the_flop_ratio():
    per_token = GEMMA_LIKE["n_params"] - GEMMA_LIKE["n_vocab"] * GEMMA_LIKE["n_embd"]
    expected = per_token / (2 * 18 * 4 * 256)
    assert attention_doubling_prior(**GEMMA_LIKE) == pytest.approx(expected)
    # twice the layers' attention for the same weights: attention doubles the cost twice as early
    assert attention_doubling_prior(**{**GEMMA_LIKE, "n_layer": 36}) == pytest.approx(expected / 2)


@pytest.mark.parametrize("change", [{"n_layer": 0}, {"n_head": -1}, {"head_dim": True}, {"n_params": 1.5e8},
                                    {"n_params": 262_144 * 640}])  # nothing outside the vocabulary table
def test_numbers_that_describe_no_transformer_give_no_prior(change):
    assert attention_doubling_prior(**{**GEMMA_LIKE, **change}) is None


def test_the_real_model_has_a_prior_from_its_own_counts(llm):
    import llama_cpp

    prior = llama_attention_prior(llm)
    n_head = llama_cpp.llama_model_n_head(llm.model)
    arch = llm.metadata["general.architecture"]
    head_dim = int(llm.metadata.get(f"{arch}.attention.key_length", llm.n_embd() // n_head))
    assert prior == pytest.approx(attention_doubling_prior(
        n_params=int(llama_cpp.llama_model_n_params(llm.model)), n_vocab=llm.n_vocab(), n_embd=llm.n_embd(),
        n_layer=int(llama_cpp.llama_model_n_layer(llm.model)), n_head=int(n_head), head_dim=head_dim))
    assert 100 < prior < 1_000_000


def test_an_object_that_is_no_llama_gives_no_prior():
    assert llama_attention_prior(object()) is None


def test_a_mixture_of_experts_counts_only_the_experts_a_token_uses():
    """Mixtral-8x7B's counts: 46.7 B parameters, 8 experts of which 2 are used per token in each
    of 32 layers (width 4,096, expert feed-forward 14,336): ~12.9 B active, as published."""
    idle = idle_expert_params(n_layer=32, n_embd=4096, expert_count=8, expert_used_count=2, expert_ff=14336)
    assert 46.7e9 - idle == pytest.approx(12.9e9, rel=0.02)
    counts = {"n_params": 46_702_792_704, "n_vocab": 32_000, "n_embd": 4096, "n_layer": 32, "n_head": 32, "head_dim": 128}
    dense = attention_doubling_prior(**counts)
    moe = attention_doubling_prior(**counts, idle_params=idle)
    outside_vocabulary = counts["n_params"] - counts["n_vocab"] * counts["n_embd"]
    assert moe == pytest.approx(dense * (outside_vocabulary - idle) / outside_vocabulary, rel=1e-9)
    assert 3 < dense / moe < 4  # attention weighs ~3.6× more against the weights a token uses
    assert idle_expert_params(n_layer=32, n_embd=4096, expert_count=1, expert_used_count=1, expert_ff=14336) == 0.0
    assert attention_doubling_prior(**counts, idle_params=46.7e9) is None  # nothing left a token passes through


class _StandInLlama:
    """What llama_attention_prior reads of a Llama, for a model file trimkit does not ship."""

    def __init__(self, metadata):
        self.model = object()
        self.metadata = metadata

    def n_embd(self):
        return 4096

    def n_vocab(self):
        return 32_000


def test_the_prior_of_a_mixture_model_is_read_from_its_metadata(monkeypatch):
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_model_n_params", lambda m: 46_702_792_704)
    monkeypatch.setattr(llama_cpp, "llama_model_n_layer", lambda m: 32)
    monkeypatch.setattr(llama_cpp, "llama_model_n_head", lambda m: 32)
    base = {"general.architecture": "llama", "llama.expert_count": "8", "llama.expert_used_count": "2"}
    idle = idle_expert_params(n_layer=32, n_embd=4096, expert_count=8, expert_used_count=2, expert_ff=14336)
    expected = attention_doubling_prior(n_params=46_702_792_704, n_vocab=32_000, n_embd=4096, n_layer=32, n_head=32,
                                        head_dim=128, idle_params=idle)
    assert llama_attention_prior(_StandInLlama({**base, "llama.feed_forward_length": "14336"})) == pytest.approx(expected)
    # the expert size unknown: no prior rather than one that reads attention far too flat
    assert llama_attention_prior(_StandInLlama(base)) is None
    # a dense model of the same counts: the whole model per token
    assert llama_attention_prior(_StandInLlama({"general.architecture": "llama"})) == pytest.approx(
        attention_doubling_prior(n_params=46_702_792_704, n_vocab=32_000, n_embd=4096, n_layer=32, n_head=32, head_dim=128))


def _noisy(truth: CostModel, points, rng: random.Random, noise: float) -> list[PrefillSample]:
    return [PrefillSample(n, k, truth.prefill_s(n, k) * math.exp(rng.gauss(0.0, noise))) for n, k in points]


SHORT = [(16, 0), (32, 0), (16, 32), (64, 0), (32, 64), (96, 0), (48, 96), (16, 0), (32, 0)]  # a micro-sized reach
LONG = [(64, 0), (256, 0), (1024, 0), (2048, 0), (256, 2048), (1024, 2048), (64, 0), (256, 0)]


def test_short_noisy_probes_lean_on_the_prior():
    """Probes reaching 144 tokens of context, 10 % noise: alone they price a 4,096-token prompt
    anywhere (their depth term is noise); with a prior 30 % off the truth the median error over
    40 seeded draws stays within 20 %, and it beats the probes alone in most draws."""
    truth = CostModel(overhead_s=0.01, per_token_s=0.004, depth_s=0.004 / 3000)
    exact = truth.prefill_s(4096)
    with_prior, alone = [], []
    for seed in range(40):
        samples = _noisy(truth, SHORT, random.Random(seed), 0.10)
        with_prior.append(abs(fit_cost_model(samples, depth_prior_tokens=3000 * 1.3).prefill_s(4096) / exact - 1))
        alone.append(abs(fit_cost_model(samples).prefill_s(4096) / exact - 1))
    assert sorted(with_prior)[20] < 0.20
    assert sum(w < a for w, a in zip(with_prior, alone, strict=True)) >= 30
    assert sorted(alone)[20] > sorted(with_prior)[20]


def test_long_probes_overrule_a_wrong_prior():
    """Probes reaching 3,072 tokens of context measure attention themselves: a prior twice too
    flat moves the fitted doubling length by little."""
    truth = CostModel(overhead_s=0.01, per_token_s=0.004, depth_s=0.004 / 1500)
    samples = _noisy(truth, LONG, random.Random(3), 0.05)
    fitted = fit_cost_model(samples, depth_prior_tokens=3000)
    assert fitted.per_token_s / fitted.depth_s == pytest.approx(1500, rel=0.2)
    assert fitted.prefill_s(4096) == pytest.approx(truth.prefill_s(4096), rel=0.1)


def test_no_prior_fits_the_probes_alone():
    samples = _noisy(CostModel(0.01, 0.004, 1e-6), LONG, random.Random(1), 0.05)
    assert fit_cost_model(samples, depth_prior_tokens=None) == fit_cost_model(samples)


@pytest.mark.parametrize("bad, error", [(0, InvalidNumberError), (-5.0, InvalidNumberError), (math.nan, InvalidNumberError),
                                        (math.inf, InvalidNumberError), (True, InvalidInputError), ("3000", InvalidInputError)])
def test_a_bad_prior_is_a_typed_error(bad, error):
    with pytest.raises(error):
        fit_cost_model([PrefillSample(16, 0, 0.1), PrefillSample(64, 0, 0.3), PrefillSample(16, 64, 0.1)], depth_prior_tokens=bad)


def test_probe_noise_is_read_off_the_probes():
    rows = [[1.0, float(n), n * n / 2.0] for n in (16, 32, 64, 128, 256)]
    exact = [0.01 + 0.004 * r[1] for r in rows]
    weights = [1 / t for t in exact]
    assert probe_noise(rows[:3], exact[:3], weights[:3]) == PROBE_NOISE  # no degrees of freedom
    assert probe_noise(rows, exact, weights) == PROBE_NOISE_FLOOR  # an exact fit: the floor
    rng = random.Random(0)
    noisy = [t * math.exp(rng.gauss(0, 0.3)) for t in exact]
    assert probe_noise(rows, noisy, [1 / t for t in noisy]) > 0.1


def test_an_implausible_term_falls_back_to_the_prior_where_known(caplog):
    samples = [PrefillSample(32, 0, 0.060), PrefillSample(16, 32, 0.400), PrefillSample(16, 0, 0.050)]
    with caplog.at_level("WARNING", logger="trimkit"):
        model, *_rest, alternatives = _fit(samples, 512, 3000.0)
    # with the prior the data alone cannot pull the term to an implausible steepness; whichever
    # model stands, it assumes attention no steeper than the architecture does
    assert model.depth_s * 3000 <= model.per_token_s * 1.0000001 or "attention_prior" not in alternatives
    assert model.prefill_s(1000) < 3 * model.per_token_s * 1000


def test_calibration_records_the_prior_and_live_refits_keep_it(isolated_cache):
    truth = CostModel(overhead_s=0.01, per_token_s=0.004, depth_s=0.004 / 2500)
    fake = FakeBackend(truth, attention_prior_tokens=2500.0)
    profile = calibrate(fake, mode="micro")
    assert profile.attention_prior_tokens == 2500.0 and profile.depth_prior_tokens == 2500.0
    again = Profile.from_dict(profile.to_dict())
    assert again.attention_prior_tokens == 2500.0
    live = LiveProfile(profile)
    for n in (64, 900, 64):
        live.observe(n, 0, truth.prefill_s(n))
    assert live.current.attention_prior_tokens == 2500.0
    # the fake engine is exact, so the fit on it matches it; the prior agrees and changes nothing
    assert live.current.predict_prefill_s(4096) == pytest.approx(truth.prefill_s(4096), rel=0.05)
    plain = calibrate(FakeBackend(truth), mode="micro", store=False, recalibrate=True)
    assert plain.attention_prior_tokens == 0.0 and plain.depth_prior_tokens is None


def test_a_stored_profile_without_the_prior_loads_and_a_bad_one_is_refused(isolated_cache):
    profile = calibrate(FakeBackend(attention_prior_tokens=2500.0), mode="micro")
    data = profile.to_dict()
    del data["attention_prior_tokens"]
    assert Profile.from_dict(data).attention_prior_tokens == 0.0
    for bad in (-1.0, "many", math.inf):
        with pytest.raises(ProfileError):
            Profile.from_dict({**profile.to_dict(), "attention_prior_tokens": bad})


def test_a_stored_profile_from_before_the_prior_gets_the_engines_prior_when_reused(isolated_cache):
    from trimkit._calibration import save_profile

    fake = FakeBackend(attention_prior_tokens=2500.0)
    old = calibrate(FakeBackend(), mode="micro", store=False, recalibrate=True)  # no prior, as stored by an older trimkit
    assert old.attention_prior_tokens == 0.0 and old.key == fake.profile_key()
    save_profile(old)
    reused = calibrate(fake, mode="micro")
    assert reused.created_at == old.created_at  # reused, not measured again
    assert reused.attention_prior_tokens == 2500.0
