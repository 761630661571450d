"""Builders shared by the core-module tests (cost model, profile, calibration, report).

Tests build their values directly with these, the way tenacity's tests build a
``RetryCallState``: no engine, no clock, numbers chosen so the expected results can be
worked out by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from trimkit.backends.base import Measurement
from trimkit.planning.costs import CostModel, ErrorStats, PrefillSample
from trimkit.planning.profile import Profile, ProfileKey

#: a cost model shaped like the measurements in docs/design.md / benchmarks.md (ms-scale, a visible depth term)
TRUE_MODEL = CostModel(overhead_s=0.01, per_token_s=0.0014, depth_s=1e-7)

#: (new_tokens, cached_tokens) probes: cold lengths plus depth probes
PROBES: tuple[tuple[int, int], ...] = ((16, 0), (64, 0), (256, 0), (1024, 0), (2048, 0), (256, 2048), (1024, 2048))


def exact_samples(model: CostModel, probes: Iterable[tuple[int, int]] = PROBES, source: str = "calibration") -> list[PrefillSample]:
    """Noise-free samples: each probe timed exactly as ``model`` predicts."""
    return [PrefillSample(n, k, model.prefill_s(n, k), source=source) for n, k in probes]


def make_key(**overrides: Any) -> ProfileKey:
    fields: dict[str, Any] = {"backend": "fake", "model": "test-model:123:abc", "n_ctx": 4096, "n_batch": 512, "cpu": "test-cpu"}
    fields.update(overrides)
    return ProfileKey(**fields)


def make_profile(
    *,
    model: CostModel = TRUE_MODEL,
    samples: Sequence[PrefillSample] | None = None,
    first_token_s: float = 0.02,
    decode_tokens_per_s: float = 50.0,
    p90_pct: float = 5.0,
    drift: float = 1.0,
    key: ProfileKey | None = None,
    mode: str = "full",
) -> Profile:
    """A profile with finite, hand-chosen numbers (no NaN, so equality after a round trip holds)."""
    return Profile(
        key=key or make_key(),
        model=model,
        first_token_s=first_token_s,
        decode_tokens_per_s=decode_tokens_per_s,
        samples=tuple(samples if samples is not None else exact_samples(model)),
        error=ErrorStats(median_pct=p90_pct / 2, p90_pct=p90_pct, max_pct=p90_pct * 2, n=7),
        alternatives={"design": {"model": model.to_dict()}},
        calibration_wall_s=1.5,
        mode=mode,
        created_at=1_700_000_000.0,
        drift=drift,
    )


def make_measurement(**overrides: Any) -> Measurement:
    """A measured request: 1 s to the first token, 33 output tokens streamed in 0.8 s of engine decode."""
    fields: dict[str, Any] = {
        "ttft_s": 1.0,
        "total_s": 1.9,
        "first_output_s": 1.0,
        "prompt_tokens": 700,
        "cached_tokens": 100,
        "evaluated_tokens": 600,
        "engine_prefill_s": 0.95,
        "completion_tokens": 33,
        "engine_decode_s": 0.8,
        "client_decode_s": 0.85,
        "timing_source": "llama_perf",
        "finish_reason": "stop",
    }
    fields.update(overrides)
    return Measurement(**fields)


def exact_predictor(model: CostModel, probes: Iterable[tuple[int, int]]) -> Any:
    """A calibration :class:`~trimkit._calibration.CostPredictor` that observed ``probes``
    taking exactly what ``model`` says (engine time = wall time)."""
    from trimkit._calibration import CostPredictor

    p = CostPredictor()
    for n, k in probes:
        t = model.prefill_s(n, k)
        p.observe(n, k, t, t)
    return p


def contains(seq: Sequence[int], sub: Sequence[int]) -> bool:
    """Whether ``sub`` occurs in ``seq`` as a contiguous run of token ids."""
    seq, sub = [int(t) for t in seq], [int(t) for t in sub]
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def evaluated_tokens(llm: Any) -> list[int]:
    """The token ids a ``Llama``'s context holds."""
    return [int(t) for t in llm.input_ids[: llm.n_tokens]]
