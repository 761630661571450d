"""Calibration profiles: storage, prediction, safety margin and live drift."""

from __future__ import annotations

import json
import logging
import math

import attrs
import pytest

from tests._core_helpers import TRUE_MODEL, exact_samples, make_key, make_profile
from trimkit._calibration import cache_dir, load_profile, profile_path, save_profile
from trimkit.errors import InvalidNumberError
from trimkit.planning.costs import CostModel, ErrorStats, PrefillSample
from trimkit.planning.speed import LiveProfile


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "trimkit" and r.levelno == logging.WARNING]


# -- where profiles live ------------------------------------------------------------------------


def test_cache_dir_honours_trimkit_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TRIMKIT_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"


def test_cache_dir_falls_back_to_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("TRIMKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "trimkit"


def test_cache_dir_defaults_to_home_dot_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TRIMKIT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "trimkit"


def test_empty_trimkit_cache_dir_is_ignored(monkeypatch, tmp_path):
    monkeypatch.setenv("TRIMKIT_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "trimkit"


def test_profile_path_is_inside_the_cache_and_named_by_the_key(isolated_cache):
    a, b = profile_path(make_key()), profile_path(make_key(n_ctx=8192))
    assert a.parent == isolated_cache / "profiles"
    assert a.suffix == ".json"
    assert a != b
    assert profile_path(make_key()) == a


def test_every_key_field_changes_the_digest():
    base = make_key()
    changed = [
        make_key(backend="other"), make_key(model="other"), make_key(n_ctx=1), make_key(n_batch=1),
        make_key(n_ubatch=1), make_key(n_threads=3), make_key(n_threads_batch=3), make_key(flash_attn="on"),
        make_key(n_gpu_layers=1), make_key(engine_version="9"), make_key(cpu="other"), make_key(extra="x"),
    ]
    digests = {k.digest() for k in changed}
    assert base.digest() not in digests
    assert len(digests) == len(changed)


# -- save / load --------------------------------------------------------------------------------


def test_save_then_load_returns_an_equal_profile(isolated_cache):
    profile = make_profile(drift=1.25, mode="quick")
    path = save_profile(profile)
    assert path == profile_path(profile.key)
    loaded = load_profile(profile.key)
    assert loaded == profile
    assert loaded.samples == profile.samples and loaded.alternatives == profile.alternatives


def test_save_leaves_no_temporary_files(isolated_cache):
    profile = make_profile()
    save_profile(profile)
    save_profile(profile)  # overwriting too
    assert [p.name for p in (isolated_cache / "profiles").iterdir()] == [profile_path(profile.key).name]


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temporary_file(isolated_cache):
    profile = make_profile()
    path = save_profile(profile)
    before = path.read_text()
    unserializable = attrs.evolve(make_profile(p90_pct=7.0), alternatives={"x": object()})
    with pytest.raises(TypeError):
        save_profile(unserializable)
    assert path.read_text() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_save_to_an_explicit_path(tmp_path):
    target = tmp_path / "deep" / "dir" / "p.json"
    assert save_profile(make_profile(), target) == target
    assert load_profile(make_key(), target) == make_profile()


def test_load_without_a_stored_file_is_none(isolated_cache):
    assert load_profile(make_key()) is None


def test_load_of_a_profile_for_another_key_is_none(isolated_cache, caplog):
    profile = make_profile()
    other = make_key(n_ctx=8192)
    save_profile(profile, profile_path(other))  # a file at other's path that holds another key
    with caplog.at_level(logging.INFO, logger="trimkit"):
        assert load_profile(other) is None
    assert not _warnings(caplog)


@pytest.mark.parametrize(
    "content",
    [
        b"not json at all {",
        b"",
        b"[1, 2, 3]",
        b"null",
        b'{"schema": 1}',
        b"\xff\xfe{}",
        b"[" * 200_000,
        b'{"schema": 1, "n": ' + b"9" * 5000 + b"}",
    ],
    ids=["garbage", "empty", "list", "null", "missing-fields", "not-utf8", "deeply-nested", "huge-int"],
)
def test_a_corrupt_file_loads_as_none_with_a_warning(isolated_cache, caplog, content):
    path = profile_path(make_key())
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert load_profile(make_key()) is None
    assert len(_warnings(caplog)) == 1
    assert str(path) in _warnings(caplog)[0].getMessage()


def test_a_truncated_file_loads_as_none_with_a_warning(isolated_cache, caplog):
    path = save_profile(make_profile())
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert load_profile(make_key()) is None
    assert _warnings(caplog)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(schema=99),
        lambda d: d.pop("schema"),
        lambda d: d["model"].update(per_token_s=-1.0),
        lambda d: d["samples"][0].update(new_tokens=0),
        lambda d: d.update(first_token_s="fast"),
        lambda d: d.update(drift=0.0),
        lambda d: d["key"].pop("n_ctx"),
    ],
    ids=["future-schema", "no-schema", "negative-coefficient", "bad-sample", "bad-first-token", "zero-drift", "key-missing-field"],
)
def test_a_wrong_schema_file_loads_as_none_with_a_warning(isolated_cache, caplog, edit):
    path = save_profile(make_profile())
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert load_profile(make_key()) is None
    assert _warnings(caplog)


def test_an_unreadable_path_loads_as_none_with_a_warning(isolated_cache, caplog):
    profile_path(make_key()).mkdir(parents=True)  # a directory where the file should be
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert load_profile(make_key()) is None
    assert _warnings(caplog)


# -- predictions --------------------------------------------------------------------------------


def test_predict_ttft_is_prefill_plus_first_token_time():
    p = make_profile(first_token_s=0.02)
    assert p.predict_ttft_s(1000, 500) == pytest.approx(TRUE_MODEL.prefill_s(1000, 500) + 0.02)


def test_predict_ttft_always_evaluates_at_least_one_token():
    p = make_profile(first_token_s=0.02)
    one = TRUE_MODEL.prefill_s(1, 3000) + 0.02
    assert p.predict_ttft_s(0, 3000) == pytest.approx(one)
    assert p.predict_ttft_s(1, 3000) == pytest.approx(one)
    assert p.predict_prefill_s(0) > 0


def test_the_first_token_overhead_grows_with_the_whole_prompt_cached_tokens_included():
    """Every request tokenizes its whole prompt before the engine starts: a short turn after a
    long cached conversation pays for all of it, and drift (the engine's speed) does not scale it."""
    p = attrs.evolve(make_profile(first_token_s=0.004, drift=1.5), first_token_per_token_s=8e-6)
    assert p.first_token_overhead_s(2500) == pytest.approx(0.004 + 0.02)
    assert p.predict_ttft_s(30, 2470) == pytest.approx(1.5 * TRUE_MODEL.prefill_s(30, 2470) + 0.004 + 8e-6 * 2500)
    assert p.predict_ttft_s(0, 3000) == pytest.approx(1.5 * TRUE_MODEL.prefill_s(1, 3000) + 0.004 + 8e-6 * 3001)
    assert make_profile(first_token_s=0.004).first_token_per_token_s == 0.0  # unknown: the fixed part alone


@pytest.mark.parametrize("cached", [0, 2000])
@pytest.mark.parametrize("budget", [0.05, 0.3, 1.0, 2.5])
def test_max_new_tokens_counts_the_overhead_of_the_tokens_it_allows(cached, budget):
    # a slow tokenizer (a tenth of the prefill's per-token cost) so that the difference shows
    p = attrs.evolve(make_profile(drift=1.3), first_token_per_token_s=TRUE_MODEL.per_token_s / 10)
    n = p.max_new_tokens(budget, cached)
    if p.predict_ttft_s(1, cached) > budget:  # tokenizing the cached conversation alone is over the budget
        assert n == 0
        return
    assert p.predict_ttft_s(n, cached) <= budget * (1 + 1e-12)
    assert n < attrs.evolve(p, first_token_per_token_s=0.0).max_new_tokens(budget, cached)
    assert p.predict_ttft_s(n + 1, cached) > budget


def test_the_per_token_overhead_is_stored_and_a_profile_stored_before_it_loads_with_none(isolated_cache):
    p = attrs.evolve(make_profile(), first_token_per_token_s=7.5e-6)
    save_profile(p)
    assert load_profile(p.key).first_token_per_token_s == 7.5e-6
    data = p.to_dict()
    del data["first_token_per_token_s"]
    profile_path(p.key).write_text(json.dumps(data))
    assert load_profile(p.key).first_token_per_token_s == 0.0


@pytest.mark.parametrize("bad", [-1e-6, float("nan"), float("inf")])
def test_a_bad_per_token_overhead_is_refused(bad):
    with pytest.raises(InvalidNumberError):
        attrs.evolve(make_profile(), first_token_per_token_s=bad)


def test_predictions_scale_with_drift():
    slow = make_profile(drift=2.0, first_token_s=0.02)
    assert slow.predict_prefill_s(500) == pytest.approx(2 * TRUE_MODEL.prefill_s(500))
    assert slow.predict_ttft_s(500) == pytest.approx(2 * TRUE_MODEL.prefill_s(500) + 0.02)


@pytest.mark.parametrize("drift", [1.0, 1.7])
@pytest.mark.parametrize("cached", [0, 2000])
@pytest.mark.parametrize("budget", [0.05, 0.3, 1.0, 2.5])
def test_max_new_tokens_is_consistent_with_predict(drift, cached, budget):
    p = make_profile(drift=drift)
    n = p.max_new_tokens(budget, cached)
    assert n >= 1
    assert p.predict_ttft_s(n, cached) <= budget * (1 + 1e-12)
    assert p.predict_ttft_s(n + 1, cached) > budget


def test_max_new_tokens_is_zero_when_the_fixed_cost_alone_exceeds_the_budget():
    p = make_profile(first_token_s=0.5)
    assert p.max_new_tokens(0.4) == 0
    assert p.max_new_tokens(p.predict_ttft_s(1) * 0.999) == 0


@pytest.mark.parametrize("p90, margin", [(1.0, 0.03), (3.0, 0.03), (10.0, 0.10), (25.0, 0.25), (80.0, 0.25)])
def test_safety_margin_is_the_p90_error_clamped_to_3_to_25_percent(p90, margin):
    assert make_profile(p90_pct=p90).safety_margin == pytest.approx(margin)


def test_safety_margin_without_a_measured_error_is_ten_percent():
    unknown = attrs.evolve(make_profile(), error=ErrorStats(math.nan, math.nan, math.nan, 0))
    assert unknown.safety_margin == pytest.approx(0.10)


@pytest.mark.parametrize("field, bad", [("first_token_s", -0.1), ("first_token_s", math.nan), ("decode_tokens_per_s", math.inf), ("drift", 0.0), ("drift", -1.0), ("drift", math.nan), ("first_token_s", True)])
def test_profile_refuses_bad_numbers(field, bad):
    with pytest.raises(InvalidNumberError):
        attrs.evolve(make_profile(), **{field: bad})


# -- table --------------------------------------------------------------------------------------


def test_table_has_one_row_per_calibration_probe_with_the_median_time():
    model = CostModel(overhead_s=0.0, per_token_s=0.001, depth_s=0.0)
    samples = [
        PrefillSample(100, 0, 0.09), PrefillSample(100, 0, 0.10), PrefillSample(100, 0, 0.20),
        PrefillSample(50, 100, 0.04),
        PrefillSample(10, 0, 0.5, source="live"),  # live samples are not calibration probes
    ]
    rows = make_profile(model=model, samples=samples).table()
    assert [(r["new_tokens"], r["cached_tokens"], r["repeats"]) for r in rows] == [(100, 0, 3), (50, 100, 1)]
    cold, deep = rows
    assert cold["measured_s"] == pytest.approx(0.10)
    assert cold["predicted_s"] == pytest.approx(0.10)
    assert cold["error_pct"] == pytest.approx(0.0, abs=1e-9)
    assert cold["ms_per_token"] == pytest.approx(1.0)
    assert deep["measured_s"] == pytest.approx(0.04)
    assert deep["predicted_s"] == pytest.approx(0.05)
    assert deep["error_pct"] == pytest.approx(25.0)
    assert deep["ms_per_token"] == pytest.approx(0.8)


def test_table_is_ordered_by_depth_then_length():
    rows = make_profile(samples=exact_samples(TRUE_MODEL, [(1024, 2048), (64, 0), (256, 2048), (16, 0)])).table()
    assert [(r["cached_tokens"], r["new_tokens"]) for r in rows] == [(0, 16), (0, 64), (2048, 256), (2048, 1024)]


# -- LiveProfile --------------------------------------------------------------------------------


def test_live_profile_starts_at_the_profile():
    p = make_profile(drift=1.3)
    live = LiveProfile(p)
    assert live.current.model == p.model and live.current.drift == pytest.approx(1.3)  # the stored speed stands
    assert live.live_samples == ()


def test_observe_follows_a_slower_machine_after_three_requests():
    live = LiveProfile(make_profile(), refit_every=1000)
    drifts = []
    for n in (16, 256, 1024, 2048) * 3:
        live.observe(n, 0, 2.0 * TRUE_MODEL.prefill_s(n))
        drifts.append(live.current.drift)
    # the middle of the latest 5: two slow ratios are outvoted by calibration's, three are not
    assert drifts[:2] == pytest.approx([1.0, 1.0])
    assert drifts[2:] == pytest.approx([2.0] * 10)
    assert live.current.predict_prefill_s(512) == pytest.approx(2.0 * TRUE_MODEL.prefill_s(512))


def test_the_speed_factor_is_the_median_of_the_latest_five_ratios():
    live = LiveProfile(make_profile(), refit_every=1000)
    for ratio in (1.1, 1.5, 0.9, 1.2, 1.3, 1.4, 3.0):
        live.observe(512, 0, ratio * TRUE_MODEL.prefill_s(512))
    assert live.current.drift == pytest.approx(1.3)  # median of 0.9, 1.2, 1.3, 1.4, 3.0


def test_one_or_two_outliers_among_five_do_not_move_the_speed_factor():
    live = LiveProfile(make_profile(), refit_every=1000)
    for ratio in (1.0, 1.0, 1.0, 4.0, 1.0, 0.3):
        live.observe(512, 0, ratio * TRUE_MODEL.prefill_s(512))
        assert live.current.drift == pytest.approx(1.0)


def test_a_stored_speed_stands_in_for_the_ratios_not_yet_seen():
    live = LiveProfile(make_profile(drift=1.5), refit_every=1000)
    live.observe(512, 0, 1.0 * TRUE_MODEL.prefill_s(512))
    live.observe(512, 0, 1.0 * TRUE_MODEL.prefill_s(512))
    assert live.current.drift == pytest.approx(1.5)
    live.observe(512, 0, 1.0 * TRUE_MODEL.prefill_s(512))
    assert live.current.drift == pytest.approx(1.0)


def test_live_profile_refuses_a_bad_refit_interval():
    with pytest.raises(ValueError):
        LiveProfile(make_profile(), refit_every=0)


def test_live_profile_is_thread_safe():
    import threading

    live = LiveProfile(make_profile(), refit_every=7, keep_live=1000)

    def feed() -> None:
        for n in (16, 256, 1024, 2048) * 25:
            live.observe(n, 0, 1.5 * TRUE_MODEL.prefill_s(n))

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert live.observations == 400 and len(live.live_samples) == 400
    assert live.current.predict_prefill_s(512) == pytest.approx(1.5 * TRUE_MODEL.prefill_s(512), rel=0.01)


def test_observe_moves_drift_down_when_the_machine_speeds_up():
    live = LiveProfile(make_profile(), refit_every=1000)
    for _ in range(3):
        live.observe(512, 0, 0.5 * TRUE_MODEL.prefill_s(512))
    assert live.current.drift == pytest.approx(0.5)


def test_observe_leaves_drift_alone_when_predictions_are_right():
    live = LiveProfile(make_profile(), refit_every=1000)
    for n in (16, 512, 2048):
        live.observe(n, 100, TRUE_MODEL.prefill_s(n, 100))
    assert live.current.drift == pytest.approx(1.0)


@pytest.mark.parametrize(
    "new_tokens, seconds",
    [(512, math.nan), (512, math.inf), (512, -math.inf), (512, 0.0), (512, -0.1), (0, 0.5), (-3, 0.5)],
)
def test_observe_ignores_unusable_measurements(new_tokens, seconds):
    p = make_profile()
    live = LiveProfile(p, refit_every=1)
    live.observe(new_tokens, 0, seconds)
    assert live.current == p
    assert live.live_samples == ()


@pytest.mark.parametrize(
    "new_tokens, cached_tokens, seconds",
    [(None, 0, 0.5), (True, 0, 0.5), (512.0, 0, 0.5), (512, -1, 0.5), (512, None, 0.5), (512, 0, None), (512, 0, "0.5"), (512, 0, True)],
)
def test_observe_ignores_malformed_measurements_without_raising(new_tokens, cached_tokens, seconds):
    p = make_profile()
    live = LiveProfile(p, refit_every=1)
    live.observe(new_tokens, cached_tokens, seconds)
    assert live.current == p
    assert live.live_samples == ()


def test_observe_accepts_numpy_numbers():
    import numpy as np

    live = LiveProfile(make_profile(), refit_every=1000)
    for _ in range(3):
        live.observe(np.int64(512), np.int64(0), np.float32(2 * TRUE_MODEL.prefill_s(512)))
    assert live.current.drift == pytest.approx(2.0)
    assert live.live_samples[0].new_tokens == 512 and type(live.live_samples[0].new_tokens) is int


def test_observe_records_live_samples_up_to_keep_live():
    live = LiveProfile(make_profile(), refit_every=1000, keep_live=3)
    for n in (10, 20, 30, 40, 50):
        live.observe(n, 0, TRUE_MODEL.prefill_s(n))
    assert [s.new_tokens for s in live.live_samples] == [30, 40, 50]
    assert {s.source for s in live.live_samples} == {"live"}


def test_observe_refits_every_refit_every_observations():
    # the profile's model is stale; its own calibration samples and the live ones agree on
    # the true model, which only a refit (not a drift factor) can express
    true = CostModel(overhead_s=0.05, per_token_s=0.001, depth_s=1e-7)
    stale = CostModel(overhead_s=0.0, per_token_s=0.001, depth_s=0.0)
    live = LiveProfile(make_profile(model=stale, samples=exact_samples(true)), refit_every=4)
    for i, n in enumerate((16, 256, 1024)):
        live.observe(n, 0, true.prefill_s(n))
        assert live.current.model == stale, f"refitted after {i + 1} observations"
    live.observe(2048, 0, true.prefill_s(2048))
    refit = live.current.model
    assert refit.overhead_s == pytest.approx(true.overhead_s, rel=1e-4)
    assert refit.depth_s == pytest.approx(true.depth_s, rel=1e-4)
    assert live.current.drift == pytest.approx(1.0)  # the refit absorbed the drift


def test_observe_keeps_the_model_when_a_refit_explains_live_samples_worse():
    # a uniformly 2× slower machine is explained by drift; a refit that has to agree with the
    # 1× calibration samples too is worse on the live samples and is discarded
    p = make_profile()
    live = LiveProfile(p, refit_every=4)
    for n in (16, 256, 1024, 2048) * 2:
        live.observe(n, 0, 2.0 * TRUE_MODEL.prefill_s(n))
    assert live.current.model == p.model
    assert live.current.drift > 1.5


def test_by_default_a_uniformly_slower_host_moves_drift_not_the_model():
    # a refit on every request (the default) must not take a change of the host's speed for a
    # change of the model's shape: the model at its best single speed factor explains it
    p = make_profile()
    live = LiveProfile(p)
    for n in (16, 256, 1024, 2048, 64, 512) * 2:
        live.observe(n, 0, 1.3 * TRUE_MODEL.prefill_s(n))
    assert live.current.model == p.model
    assert live.current.drift == pytest.approx(1.3)


def test_by_default_every_request_refits_a_wrong_shape():
    # calibration saw no attention (short probes); the live requests, at the same speed, show it
    true = CostModel(overhead_s=0.02, per_token_s=0.001, depth_s=2e-7)
    flat = CostModel(overhead_s=0.02, per_token_s=0.001, depth_s=0.0)
    p = make_profile(model=flat, samples=exact_samples(true, [(16, 0), (64, 0), (128, 0), (256, 0)]))
    live = LiveProfile(p)
    errors = []
    for n in (2048, 128, 3000, 64, 1500, 4000):
        errors.append(abs(live.current.predict_prefill_s(n) / true.prefill_s(n) - 1))
        live.observe(n, 0, true.prefill_s(n))
    assert live.current.model != flat
    assert errors[-1] < 0.02 < errors[0]
    assert live.current.probed_range()[0] >= 4000  # the measured lengths joined the range


@pytest.mark.parametrize("speed", [1.3, 0.75])
def test_a_refit_after_the_host_changed_speed_corrects_the_shape_and_leaves_the_speed_to_the_factor(speed):
    # calibration probed 16-256 tokens and saw too little attention to price it (a flat model);
    # the host has changed speed since. Served requests, most of them in the calibrated range,
    # some far beyond it: the refit learns attention from them, brought to the calibration's
    # speed first. Fitted raw with the calibration's samples, the long requests measured at
    # another speed would read as more (or less) attention than the engine has.
    true = CostModel(overhead_s=0.02, per_token_s=0.001, depth_s=2e-7)
    flat = CostModel(overhead_s=0.02, per_token_s=0.0011, depth_s=0.0)
    p = make_profile(model=flat, samples=exact_samples(true, [(16, 0), (64, 0), (128, 0), (256, 0)]))
    live = LiveProfile(p)
    for _ in range(2):
        for n, k in ((40, 0), (200, 0), (3000, 0), (100, 0), (150, 0), (1500, 1000), (60, 0), (240, 0), (30, 0)):
            live.observe(n, k, speed * true.prefill_s(n, k))
    for n, k in ((20, 0), (700, 0), (4000, 0), (300, 3000)):
        assert live.current.predict_prefill_s(n, k) == pytest.approx(speed * true.prefill_s(n, k), rel=0.01)
    # the model kept is the engine's shape at the calibration's speed; the speed factor is the change since
    assert live.current.model.depth_s == pytest.approx(true.depth_s, rel=0.01)
    assert live.current.drift == pytest.approx(speed, rel=0.01)
    assert live.speed_factor(256) == pytest.approx(speed * true.prefill_s(256) / flat.prefill_s(256), rel=0.01)


def test_a_refit_that_cannot_be_computed_leaves_drift_to_follow_the_host():
    # a stored profile with a calibration sample no fit can use (a count beyond any float):
    # learning runs after the response and must never fail it
    p = make_profile(samples=[*exact_samples(TRUE_MODEL), PrefillSample(10**400, 0, 1.5)])
    live = LiveProfile(p)
    for n in (16, 256, 1024):
        live.observe(n, 0, 2.0 * TRUE_MODEL.prefill_s(n))
    assert live.current.model == p.model
    assert live.current.drift == pytest.approx(2.0)


def test_observe_never_changes_the_original_profile():
    p = make_profile()
    live = LiveProfile(p, refit_every=2)
    for n in (16, 256, 1024, 2048):
        live.observe(n, 0, 3.0 * TRUE_MODEL.prefill_s(n))
    assert p.drift == 1.0 and p.model == TRUE_MODEL
    assert live.current is not p


# -- issue 8, item 5: hostile or broken profile files -------------------------------------------


def _stored_with(edit):
    path = save_profile(make_profile())
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _zero_model(d):
    d["model"].update(overhead_s=0.0, per_token_s=0.0, depth_s=0.0, per_batch_s=0.0)


@pytest.mark.parametrize(
    "edit, names",
    [
        (lambda d: d["error"].update(p90_pct="high"), "error.p90_pct"),
        (lambda d: d["error"].update(median_pct=[1]), "error.median_pct"),
        (lambda d: d["error"].update(n=7.5), "error.n"),
        (lambda d: d["error"].update(n="7"), "error.n"),
        (lambda d: d["error"].update(max_pct=-3.0), "max_pct"),
        (_zero_model, "model predicts 0.0 s"),
        (lambda d: d["model"].update(n_batch=512.0), "model.n_batch"),
        (lambda d: d["samples"][0].update(new_tokens=16.0), "samples[0].new_tokens"),
        (lambda d: d["samples"][1].update(source=5), "samples[1].source"),
        (lambda d: d["samples"].append([16, 0, 0.1]), "samples[7]"),
        (lambda d: d.update(samples={"a": 1}), "samples must be a list"),
        (lambda d: d.update(alternatives=["design"]), "alternatives"),
        (lambda d: d.update(created_at="yesterday"), "created_at"),
        (lambda d: d.update(calibration_wall_s=-1.0), "calibration_wall_s"),
        (lambda d: d["key"].update(n_ctx="4096"), "key.n_ctx"),
        (lambda d: d["key"].update(model=["test-model"]), "key.model"),
        (lambda d: d.update(residuals=[[0.1, 0.2, 0.3]]), "residuals[0]"),
        (lambda d: d.update(residuals=[[0.1, "x"]]), "residuals[0][1]"),
        (lambda d: d.update(schema=True), "schema"),
        (lambda d: d.update(drift=1e400), "drift"),  # JSON Infinity
    ],
    ids=[
        "p90-str", "median-list", "n-float", "n-str", "negative-pct", "all-zero-model", "n-batch-float", "tokens-float",
        "source-int", "sample-list", "samples-dict", "alternatives-list", "created-at-str", "negative-wall",
        "key-n-ctx-str", "key-model-list", "residual-triple", "residual-str", "schema-true", "drift-inf",
    ],
)
def test_a_wrongly_typed_or_useless_profile_loads_as_none_with_one_warning_naming_file_and_field(isolated_cache, caplog, edit, names):
    """Wrong types used to load and then raise TypeError on every budgeted request (p90 'high'
    in safety_margin); an all-zero model predicted 0 s forever."""
    path = _stored_with(edit)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert load_profile(make_key()) is None
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert str(path) in warnings[0].getMessage() and names in warnings[0].getMessage()


def test_a_stored_profile_round_trips_with_nan_and_infinite_error_stats(isolated_cache):
    """Errors are NaN when nothing was measured: that is a valid profile, not a broken one."""
    nan = attrs.evolve(make_profile(), error=ErrorStats(math.nan, math.nan, math.inf, 0))
    save_profile(nan)
    loaded = load_profile(make_key())
    assert loaded is not None and math.isnan(loaded.error.p90_pct) and loaded.safety_margin == pytest.approx(0.10)


def test_from_dict_raises_profile_error_for_every_shape():
    from trimkit.errors import ProfileError
    from trimkit.planning.profile import Profile

    for bad in (None, [], "x", {"schema": 1}, {"schema": 1, "key": []}, {**make_profile().to_dict(), "error": {"n": 1}}):
        with pytest.raises(ProfileError):
            Profile.from_dict(bad)
    assert Profile.from_dict(make_profile().to_dict()) == make_profile()


def test_error_stats_and_samples_refuse_wrong_types_when_made():
    with pytest.raises(InvalidNumberError):
        ErrorStats("x", 1.0, 1.0, 1)
    with pytest.raises(InvalidNumberError):
        ErrorStats(1.0, 1.0, 1.0, 1.5)
    with pytest.raises(InvalidNumberError):
        ErrorStats(-1.0, 1.0, 1.0, 1)
    with pytest.raises(InvalidNumberError):
        ErrorStats(10**400, 1.0, 1.0, 1)
    from trimkit.errors import InvalidInputError

    with pytest.raises(InvalidInputError):
        PrefillSample(16, 0, 0.1, source=None)
    with pytest.raises(InvalidInputError):
        attrs.evolve(make_profile(), model={"overhead_s": 0.1})
    with pytest.raises(InvalidInputError):
        attrs.evolve(make_profile(), samples=({"new_tokens": 1},))


def test_a_corrupt_profile_is_recalibrated_with_one_warning_and_overwritten(isolated_cache, caplog):
    from trimkit._calibration import calibrate
    from trimkit.testing import FakeBackend

    backend = FakeBackend(TRUE_MODEL)
    path = profile_path(backend.profile_key())
    path.parent.mkdir(parents=True)
    bad = attrs.evolve(make_profile(key=backend.profile_key())).to_dict()
    bad["error"]["p90_pct"] = "high"
    path.write_text(json.dumps(bad))
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        profile = calibrate(backend, mode="quick")
    assert isinstance(profile.error.p90_pct, float) and profile.safety_margin > 0
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage() and "error.p90_pct" in warnings[0].getMessage()
    assert load_profile(backend.profile_key()) == profile  # the bad file was replaced


def test_looking_at_the_same_bad_file_twice_warns_once(isolated_cache, caplog):
    """The CLI loads, then calibrate() loads again before measuring: one warning, not two."""
    _stored_with(lambda d: d["error"].update(n="7"))
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert load_profile(make_key()) is None
        assert load_profile(make_key()) is None
    assert len(_warnings(caplog)) == 1


def test_a_fifo_at_the_profile_path_never_blocks_the_load(isolated_cache, caplog):
    import os
    import threading

    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    path = profile_path(make_key())
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    result: list = []
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        t = threading.Thread(target=lambda: result.append(load_profile(make_key())), daemon=True)
        t.start()
        t.join(5.0)
        blocked = t.is_alive()
        if blocked:  # release the reader the old code left waiting for a writer
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            t.join(5.0)
    assert not blocked, "load_profile blocked on a FIFO"
    assert result == [None]
    assert "not a regular file" in _warnings(caplog)[0].getMessage()


def test_an_oversized_profile_is_refused_unread(isolated_cache, caplog):
    from trimkit._calibration import MAX_PROFILE_BYTES

    path = save_profile(make_profile())
    text = path.read_text()
    path.write_text(text + " " * (MAX_PROFILE_BYTES + 1 - len(text)))  # valid JSON, just huge
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert load_profile(make_key()) is None
    assert "limit" in _warnings(caplog)[0].getMessage()


def _cache_is_a_file(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("in the way")
    monkeypatch.setenv("TRIMKIT_CACHE_DIR", str(blocker))
    return blocker


def test_saving_into_an_unwritable_cache_warns_once_and_keeps_going(tmp_path, monkeypatch, caplog):
    _cache_is_a_file(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        assert save_profile(make_profile()) is None
        assert save_profile(make_profile(drift=1.5)) is None
    assert len(_warnings(caplog)) == 1
    assert "kept in memory" in _warnings(caplog)[0].getMessage()
    assert load_profile(make_key()) is None


def test_an_explicit_unwritable_path_still_raises(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        save_profile(make_profile(), blocker / "p.json")


def test_calibrate_and_wrap_survive_an_unwritable_cache(tmp_path, monkeypatch, caplog):
    """wrap() used to fail with NotADirectoryError after calibrating."""
    import trimkit
    from trimkit._calibration import calibrate
    from trimkit.testing import FakeBackend

    _cache_is_a_file(tmp_path, monkeypatch)
    backend = FakeBackend(TRUE_MODEL)
    with caplog.at_level(logging.WARNING, logger="trimkit"):
        chat = trimkit.wrap(backend, ttft_budget_s=2.0)  # calibrates quickly: nothing stored
        assert chat.profile.model.prefill_s(100) > 0
        profile = calibrate(FakeBackend(TRUE_MODEL), mode="quick")
        assert profile.model.prefill_s(100) > 0
    assert len([w for w in _warnings(caplog) if "kept in memory" in w.getMessage()]) == 1


def test_stale_temporary_files_are_removed_on_the_next_save(isolated_cache):
    import os
    import time

    folder = isolated_cache / "profiles"
    folder.mkdir(parents=True)
    stale, fresh, other = folder / ".profile-killed.tmp", folder / ".profile-writing.tmp", folder / "notes.tmp"
    for f in (stale, fresh, other):
        f.write_text("{")
    old = time.time() - 120
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    save_profile(make_profile())
    assert not stale.exists()
    assert fresh.exists() and other.exists()  # a save in progress elsewhere; not ours to remove
