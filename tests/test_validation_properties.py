"""The argument boundary, by property: whatever JSON-like value a caller passes as messages,
chunks or a budget, and whatever JSON a profile file holds, trimkit answers with a result or
one of its own errors (``trimkit.errors``), never another exception, and changes nothing the
caller passed (issue 8, items 5 and 7)."""

from __future__ import annotations

import copy
import json
import logging
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests._core_helpers import make_key, make_profile
from tests._planner_helpers import PROFILE, tokenizer
from trimkit._calibration import load_profile
from trimkit.errors import (
    InvalidBudgetError,
    InvalidInputError,
    InvalidNumberError,
    ProfileError,
    TrimkitError,
)
from trimkit.planning.planner import Plan, plan
from trimkit.planning.profile import Profile
from trimkit.planning.speed import LiveProfile

EXAMPLES = 2000
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def same(a: Any, b: Any) -> bool:
    """Deep equality that also checks types, and counts NaN equal to NaN (a NaN the caller
    passed is still their NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# -- strategies ---------------------------------------------------------------------------------

#: numbers as callers get them wrong: huge ints (10**400 overflowed float()), NaN, infinities, bools
numbers = (
    st.integers(min_value=-(10**3), max_value=10**3)
    | st.sampled_from([10**400, -(10**400), 2**1024, 10**20])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
)
scalars = st.none() | numbers | st.text(max_size=6)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
words = st.text(alphabet="abcxyz ?.", min_size=0, max_size=12)
#: longer texts, so that small budgets force the planner to trim
passages = st.builds(lambda w, n: " ".join([w] * n), st.sampled_from(["alpha beta.", "gamma?", "x y z"]), st.integers(1, 40))
texts = passages | words


def _paths_in(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``value`` (dict keys and list indexes)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths_in(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths_in(v, (*prefix, i))
    return out


def corrupt(draw: Any, value: Any, times: int) -> Any:
    """``value`` with ``times`` places replaced by arbitrary JSON or removed (the root too)."""
    for _ in range(times):
        path = draw(st.sampled_from(_paths_in(value)))
        if not path:
            return draw(json_values)
        parent = value
        for step in path[:-1]:
            parent = parent[step]
        if draw(st.booleans()):
            parent.pop(path[-1])  # a dict key or a list item
        else:
            parent[path[-1]] = draw(json_values)
    return value


@st.composite
def good_message(draw: Any) -> dict[str, Any]:
    role = draw(st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"]))
    parts = st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts})
        | st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}),
        max_size=2,
    )
    m: dict[str, Any] = {"role": role, "content": draw(texts | parts)}
    if role == "assistant" and draw(st.booleans()):
        call = st.fixed_dictionaries(
            {"id": words, "type": st.just("function"), "function": st.fixed_dictionaries({"name": words, "arguments": words})}
        )
        m["tool_calls"] = draw(st.lists(call, min_size=1, max_size=2))
        m["content"] = draw(st.none() | texts)
    if role == "assistant" and draw(st.integers(0, 5)) == 0:
        m["function_call"] = {"name": draw(words), "arguments": draw(words)}
    if role == "tool":
        m["tool_call_id"] = draw(words)
    if draw(st.integers(0, 3)) == 0:
        m["name"] = draw(words)
    return m


@st.composite
def requests(draw: Any) -> tuple[Any, Any]:
    """(messages, rag_chunks): a well-formed request, then none to three places made arbitrary."""
    messages = [*draw(st.lists(good_message(), max_size=3)), {"role": "user", "content": draw(texts)}]
    chunk = (
        passages
        | st.fixed_dictionaries(
            {"text": passages},
            optional={"score": st.floats(-5, 5) | st.integers(-5, 5), "id": words | st.integers(0, 3)},
        )
    )
    chunks = draw(st.none() | st.lists(chunk, max_size=3))
    times = draw(st.sampled_from([0, 1, 1, 1, 2, 3]))
    request = corrupt(draw, [messages, chunks], times)
    if not isinstance(request, list) or len(request) != 2:
        return request, None
    return request[0], request[1]


#: budgets: mostly usable (a small one trims), sometimes anything
budgets = st.floats(min_value=0.02, max_value=3.0) | st.sampled_from([10**400, 2**1024, -(10**400), 0, -1.0]) | numbers | json_values
templates = st.sampled_from(
    ["{chunks}\n\n{question}", "{question}", "{chunks}", "{chunks} {nope}", "{0}", "{chunks!r}{question:>2}", "{", "x"]
) | json_values
chunk_templates = st.sampled_from(["[{id}] {text}", "{id}", "{text}{n}", "{text!z}", "}"]) | json_values


# -- planning: messages, chunks, budgets, templates, counts -------------------------------------


@PROPERTY
@given(
    request=requests(),
    budget=budgets,
    extra=st.fixed_dictionaries(
        {},
        optional={
            "rag_template": templates,
            "rag_chunk_template": chunk_templates,
            "cached_tokens": st.integers(0, 50) | numbers | json_values,
            "safety_margin": st.floats(0, 0.5) | numbers | json_values,
            "max_prompt_tokens": st.integers(1, 400) | numbers | json_values,
        },
    ),
)
def test_plan_answers_a_plan_or_a_trimkit_error_and_never_mutates(request, budget, extra):
    messages, chunks = request
    before = copy.deepcopy((messages, chunks, budget, extra))
    try:
        result = plan(messages, ttft_budget_s=budget, profile=PROFILE, tokenizer=tokenizer(), rag_chunks=chunks, **extra)
    except TrimkitError as exc:
        event(type(exc).__name__)
    else:
        event("a plan" + (" (trimmed)" if not result.passthrough else ""))
        assert isinstance(result, Plan)
        assert result.predicted_ttft_s > 0 and math.isfinite(result.predicted_ttft_s)
    assert same((messages, chunks, budget, extra), before)


@pytest.mark.parametrize("budget", [10**400, -(10**400), 10**5000, 2**1024], ids=["1e400", "-1e400", "1e5000", "2^1024"])
def test_a_budget_too_large_for_a_float_is_an_invalid_budget(budget):
    with pytest.raises(InvalidBudgetError):
        plan([{"role": "user", "content": "q"}], ttft_budget_s=budget, profile=PROFILE, tokenizer=tokenizer())


@pytest.mark.parametrize("value", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"])
def test_number_helpers_refuse_ints_too_large_for_a_float(value):
    from trimkit import errors as validation

    for check in (
        lambda v: validation.positive_finite(v, "x"),
        lambda v: validation.non_negative_finite(v, "x"),
        validation.real_float,
        lambda v: validation.fraction(v, "x"),
    ):
        with pytest.raises(InvalidNumberError):
            check(value)
    with pytest.raises(InvalidBudgetError):
        validation.budget(value)


def test_a_non_utf8_prompt_file_is_a_usage_error(tmp_path, capsys):
    """`trimkit diagnose --prompt-file` on a Latin-1 file exited 1 with a bare UnicodeDecodeError."""
    from trimkit.cli import main

    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert main(["diagnose", "--prompt-file", str(prompt)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "UnicodeDecodeError" not in err


# -- profile files: arbitrary JSON shapes -------------------------------------------------------

VALID = make_profile().to_dict()


@st.composite
def profile_documents(draw: Any) -> Any:
    """A valid stored profile with none to three places removed or made arbitrary JSON."""
    return corrupt(draw, copy.deepcopy(VALID), draw(st.sampled_from([0, 1, 1, 1, 2, 3])))


def _usable(profile: Profile) -> None:
    """Everything a budgeted request does with a profile works on a loaded one."""
    for n in (0, 1, 1000, 100_000):
        assert profile.predict_ttft_s(n) > 0
    assert profile.predict_prefill_s(1) > 0 and profile.predict_prefill_s(1000) > 0
    assert 0 < profile.safety_margin < 1
    assert profile.max_new_tokens(1.0) >= 0
    json.dumps(profile.to_dict())
    live = LiveProfile(profile)
    live.observe(100, 0, 0.1)
    assert live.current.predict_ttft_s(100) > 0
    try:
        plan([{"role": "user", "content": "a question"}], ttft_budget_s=0.5, profile=profile, tokenizer=tokenizer())
    except TrimkitError:
        pass


@PROPERTY
@given(doc=profile_documents())
def test_profile_from_dict_gives_a_usable_profile_or_a_profile_error(doc):
    before = copy.deepcopy(doc)
    try:
        profile = Profile.from_dict(doc)
    except ProfileError:
        event("ProfileError")
    else:
        event("a profile")
        _usable(profile)
    assert same(doc, before)


@PROPERTY
@given(doc=profile_documents())
def test_load_profile_of_any_json_file_gives_a_profile_or_none(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("p") / "profile.json"
    try:
        path.write_text(json.dumps(doc))
    except ValueError:  # an int too long for json.dumps's str(): write it some other way
        path.write_text("{}")
    logging.getLogger("trimkit").disabled = True
    try:
        loaded = load_profile(make_key(), path)
    finally:
        logging.getLogger("trimkit").disabled = False
    event("loaded" if loaded is not None else "None")
    if loaded is not None:
        assert loaded.key == make_key()
        _usable(loaded)


def test_invalid_input_errors_are_value_errors():
    """Callers that catch ValueError for bad arguments keep working."""
    assert issubclass(InvalidInputError, ValueError)
